// salusctl: the operator's command-line tool for salusd.
//
// Every subcommand is a thin layer over the files of the /salus tree: whatever it
// does can be done with cat, echo, mkdir and rmdir, and `salusctl --explain CMD...`
// prints those shell commands instead of running them. It reads the mount point
// from --mount, else $SALUS_MOUNT, else /salus.
//
// Exit status: 0 on success, 1 when a file operation fails (the message names the
// file and the error), 2 for usage errors; `run` exits with its command's status.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "cli_common.hpp"
#include "salus_config.hpp"
#include "tools/cdi_spec.hpp"
#include "vgpu/unique_fd.hpp"

namespace {

using namespace salus::cli;

// Writes admin commands to /salus/ctl and returns its replies (read on the same fd).
constexpr const char* kAdminOnly = "only root and members of salusd's --admin-group may do this";

std::string ctl_command(const Ctx& ctx, const std::string& line) {
  const std::string path = ctx.path("ctl");
  const salus::vgpu::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) fail_file(ctx, path, errno, errno == EACCES ? kAdminOnly : "");
  const std::string text = line + "\n";
  const ssize_t n = ::write(fd.get(), text.data(), text.size());
  const int err = n < 0 ? errno : 0;
  std::string reply;
  char buf[4096];
  for (ssize_t r; (r = ::read(fd.get(), buf, sizeof buf)) > 0;)
    reply.append(buf, static_cast<std::size_t>(r));
  // salusd answers a failed line with "error ENAME: REASON": that is the
  // message, not the errno's text, which for ENOENT would read as if ctl
  // itself were missing.
  if (err && reply.rfind("error ", 0) == 0) {
    const std::string answer = reply.substr(6, reply.find('\n') - 6);
    if (const auto colon = answer.find(": "); colon != std::string::npos)
      fail(fmt::format("{}: {} ({})", line, answer.substr(colon + 2), answer.substr(0, colon)));
  }
  if (err) fail_file(ctx, path, err, line);
  return reply;
}

// Entries of a directory, numbers first (by value), then names.
std::vector<std::string> list_dir(const Ctx& ctx, const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (!d) fail_file(ctx, path, errno);
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  auto is_num = [](const std::string& s) {
    return !s.empty() && s.size() < 19 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    const bool na = is_num(a), nb = is_num(b);
    if (na != nb) return na;
    if (na) return std::stoull(a) < std::stoull(b);
    return a < b;
  });
  return names;
}

// ---------------------------------------------------------------- parsing

std::optional<double> to_double(const std::string& s) {
  if (s.empty() || s == "-") return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str()) return std::nullopt;
  return v;
}

// One sample of the Prometheus text exposition.
struct Metric {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Metric> parse_metrics(std::string_view text) {
  std::vector<Metric> out;
  for (const std::string& line : split_lines(text)) {
    if (line.empty() || line[0] == '#') continue;
    Metric m;
    std::size_t pos = line.find_first_of("{ ");
    if (pos == std::string::npos) continue;
    m.name = line.substr(0, pos);
    if (line[pos] == '{') {
      ++pos;
      while (pos < line.size() && line[pos] != '}') {
        const std::size_t eq = line.find('=', pos);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') break;
        const std::string key = line.substr(pos, eq - pos);
        std::string value;
        std::size_t i = eq + 2;
        for (; i < line.size() && line[i] != '"'; ++i) {
          if (line[i] == '\\' && i + 1 < line.size()) {
            ++i;
            value += line[i] == 'n' ? '\n' : line[i];
          } else {
            value += line[i];
          }
        }
        m.labels[key] = value;
        pos = i + 1;
        if (pos < line.size() && line[pos] == ',') ++pos;
      }
      pos = line.find(' ', pos);
      if (pos == std::string::npos) continue;
    }
    const auto v = to_double(line.substr(pos + 1));
    if (!v) continue;
    m.value = *v;
    out.push_back(std::move(m));
  }
  return out;
}

// ---------------------------------------------------------------- formatting

std::string human_bytes(const std::string& raw, bool exact) {
  const auto v = to_u64(raw);
  if (!v || exact) return raw.empty() ? "-" : raw;
  static constexpr const char* kUnits[] = {"K", "M", "G", "T", "P"};
  if (*v < 1024) return std::to_string(*v);
  double x = static_cast<double>(*v);
  int unit = -1;
  while (x >= 1024 && unit < 4) {
    x /= 1024;
    ++unit;
  }
  std::string s = fmt::format("{:.1f}", x);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  return s + kUnits[unit];
}

// Whether a cell reads as a number (so its column is right-aligned).
bool numeric_cell(const std::string& s) {
  if (s == "-") return true;
  if (s.empty() ||
      !(std::isdigit(static_cast<unsigned char>(s[0])) || (s[0] == '-' && s.size() > 1)))
    return false;
  return s.find_first_not_of("0123456789.-%KMGTP") == std::string::npos;
}

// Aligned columns separated by two spaces; numeric columns are right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) {
    row.resize(header_.size());
    rows_.push_back(std::move(row));
  }
  bool empty() const { return rows_.empty(); }
  std::vector<std::string> lines() const {
    const std::size_t n = header_.size();
    std::vector<std::size_t> width(n);
    std::vector<bool> right(n, true);
    for (std::size_t c = 0; c < n; ++c) {
      width[c] = header_[c].size();
      bool any_digit = false;
      for (const auto& r : rows_) {
        width[c] = std::max(width[c], r[c].size());
        right[c] = right[c] && numeric_cell(r[c]);
        any_digit = any_digit || r[c] != "-";
      }
      right[c] = right[c] && any_digit && !rows_.empty();
    }
    auto render = [&](const std::vector<std::string>& r) {
      std::string line;
      for (std::size_t c = 0; c < n; ++c) {
        if (c) line += "  ";
        const std::size_t pad = width[c] - r[c].size();
        if (right[c])
          line += std::string(pad, ' ') + r[c];
        else
          line += r[c] + std::string(c + 1 == n ? 0 : pad, ' ');
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      return line;
    };
    std::vector<std::string> out{render(header_)};
    for (const auto& r : rows_) out.push_back(render(r));
    return out;
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

void print_lines(const std::vector<std::string>& lines) {
  for (const auto& l : lines) fmt::print("{}\n", l);
}

// ---------------------------------------------------------------- snapshots of the tree

struct GpuView {
  std::string index;
  KeyValues info, memory;
  std::vector<std::vector<std::string>> lanes, queue;
  std::vector<std::vector<std::string>> processes;  // none from a salusd without the file
};

struct SessionView {
  std::string dir;  // name under sessions/
  int err = 0;      // reading its status failed with this (EACCES for others' sessions)
  KeyValues status;
};

// What /salus/metrics (readable by everyone) tells about each session.
struct SessionMetrics {
  std::string uid;
  double iterations = 0, gpu_s = 0, queue_s = 0;
};
using MetricsBySession = std::map<std::string, SessionMetrics>;

std::vector<GpuView> read_gpus(const Ctx& ctx) {
  std::vector<GpuView> out;
  for (const std::string& g : list_dir(ctx, ctx.path("gpus"))) {
    GpuView v;
    v.index = g;
    const std::string dir = ctx.path("gpus/" + g);
    v.info = parse_kv(read_file(ctx, dir + "/info"), ": ");
    v.memory = parse_kv(read_file(ctx, dir + "/memory"), ": ");
    v.lanes = parse_rows(read_file(ctx, dir + "/lanes"));
    v.queue = parse_rows(read_file(ctx, dir + "/queue"));
    if (std::string text; try_read(dir + "/processes", text) == 0) v.processes = parse_rows(text);
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<SessionView> read_sessions(const Ctx& ctx) {
  std::vector<SessionView> out;
  for (const std::string& name : list_dir(ctx, ctx.path("sessions"))) {
    SessionView v;
    v.dir = name;
    std::string text;
    v.err = try_read(ctx.path("sessions/" + name + "/status"), text);
    if (v.err == ENOENT) continue;  // ended since the listing
    if (!v.err) {
      v.status = parse_kv(text, ": ");
      if (get(v.status, "state") == "ended") continue;
    }
    out.push_back(std::move(v));
  }
  return out;
}

MetricsBySession session_metrics(const std::vector<Metric>& metrics) {
  MetricsBySession out;
  for (const Metric& m : metrics) {
    auto it = m.labels.find("session");
    if (it == m.labels.end()) continue;
    SessionMetrics& sm = out[it->second];
    if (auto u = m.labels.find("uid"); u != m.labels.end()) sm.uid = u->second;
    if (m.name == "salus_session_iterations_total") sm.iterations = m.value;
    if (m.name == "salus_session_gpu_seconds_total") sm.gpu_s = m.value;
    if (m.name == "salus_session_queue_seconds") sm.queue_s = m.value;
  }
  return out;
}

// The STATE cell of a session whose status could not be read.
std::string unreadable_state(int err) {
  return err == EACCES ? "no-access" : fmt::format("error:{}", strerrorname_np(err));
}

// How long the GPU has run nothing while sessions wait for it, in seconds
// (salus(5) idle_waiting_ms): "-" when it does not, or salusd does not say.
std::string idle_wait_cell(const std::string& ms) {
  char* end = nullptr;
  const double v = std::strtod(ms.c_str(), &end);
  if (ms.empty() || *end != '\0' || !(v > 0)) return "-";
  return fmt::format("{:.1f}s", v / 1000);
}

Table gpu_table(const std::vector<GpuView>& gpus, bool exact, const std::vector<double>* busy) {
  std::vector<std::string> header = {"GPU", "NAME", "BACKEND"};
  if (busy) header.push_back("BUSY%");
  for (const char* h : {"CAPACITY", "PERSISTENT", "RESERVED", "EPHEMERAL", "FREE", "OUTSIDE",
                        "LANES", "QUEUED", "DRAINING", "IDLE_WAIT"})
    header.push_back(h);
  Table t(header);
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    const GpuView& g = gpus[i];
    std::vector<std::string> row = {g.index, get(g.info, "name"), get(g.info, "backend")};
    if (busy) row.push_back(i < busy->size() ? fmt::format("{:.1f}", (*busy)[i]) : "-");
    for (const char* k : {"capacity", "persistent_used", "persistent_reserved", "ephemeral", "free",
                          "outside_sessions"})
      row.push_back(human_bytes(get(g.memory, k), exact));
    row.push_back(get(g.memory, "lanes"));
    row.push_back(get(g.memory, "queued"));
    row.push_back(get(g.info, "draining"));
    row.push_back(idle_wait_cell(get(g.info, "idle_waiting_ms")));
    t.add(std::move(row));
  }
  return t;
}

Table lane_table(const std::vector<GpuView>& gpus, bool exact) {
  Table t({"GPU", "LANE", "OFFSET", "SIZE", "USED", "SESSIONS", "RUNNING"});
  for (const GpuView& g : gpus) {
    for (const auto& r : g.lanes) {
      if (r.size() < 6) continue;
      t.add({g.index, r[0], human_bytes(r[1], exact), human_bytes(r[2], exact),
             human_bytes(r[3], exact), r[4], r[5]});
    }
  }
  return t;
}

// NVML's compute processes on each GPU, as salusd's census sorted them
// (salus(5) gpus/N/processes): who holds the card, inside sessions or not.
Table process_table(const std::vector<GpuView>& gpus, bool exact) {
  Table t({"GPU", "PID", "GPU_MEM", "ROLE", "SESSION"});
  for (const GpuView& g : gpus)
    for (const auto& r : g.processes)
      if (r.size() >= 4) t.add({g.index, r[0], human_bytes(r[1], exact), r[2], r[3]});
  return t;
}

Table queue_table(const std::vector<GpuView>& gpus, bool exact) {
  Table t({"GPU", "POS", "SESSION", "PERSISTENT", "EPHEMERAL", "WAITED_MS", "BYPASSED"});
  for (const GpuView& g : gpus) {
    for (const auto& r : g.queue) {
      if (r.size() < 6) continue;
      t.add({g.index, r[0], r[1], human_bytes(r[2], exact), human_bytes(r[3], exact), r[4], r[5]});
    }
  }
  return t;
}

// Sessions whose status is not readable (other users') get what metrics has.
Table session_table(const std::vector<SessionView>& sessions, bool exact,
                    const MetricsBySession& metrics) {
  // KIND sits before ERROR, the one column whose text may hold spaces.
  Table t({"ID", "NAME", "UID", "STATE", "GPU", "LANE", "PRIO", "PERSISTENT", "EPHEMERAL", "DONE",
           "ITERS", "QUEUED", "MEAN_MS", "GPU_MS", "WAIT_MS", "KIND", "ERROR"});
  for (const SessionView& s : sessions) {
    if (s.err) {
      const auto m = metrics.find(s.dir);
      const bool have = m != metrics.end();
      t.add({"-", s.dir, have ? m->second.uid : "-", unreadable_state(s.err), "-", "-", "-", "-",
             "-", have ? fmt::format("{:.0f}", m->second.iterations) : "-", "-", "-", "-",
             have ? fmt::format("{:.3f}", m->second.gpu_s * 1e3) : "-",
             have ? fmt::format("{:.3f}", m->second.queue_s * 1e3) : "-", "-", "-"});
      continue;
    }
    const KeyValues& k = s.status;
    t.add({get(k, "id"), s.dir, get(k, "uid"), get(k, "state"), get(k, "gpu"), get(k, "lane"),
           get(k, "priority"), human_bytes(get(k, "persistent"), exact),
           human_bytes(get(k, "ephemeral"), exact), get(k, "iterations_done"), get(k, "iters"),
           get(k, "iterations_queued"), get(k, "mean_iteration_ms"), get(k, "gpu_time_ms"),
           get(k, "queue_wait_ms"), get(k, "kind"), get(k, "error")});
  }
  return t;
}

// How much of the time an attached session held its lane its program kept the GPU
// busy (its reported device time over the hold salusd measured); "-" before any
// hold, or from a salusd that does not measure it.
std::string busy_while_held(const KeyValues& k) {
  const double held = std::strtod(get(k, "lane_held_ms", "0").c_str(), nullptr);
  const double busy = std::strtod(get(k, "gpu_time_ms", "0").c_str(), nullptr);
  if (!(held > 0.0)) return "-";
  return fmt::format("{:.0f}", std::min(100.0, 100.0 * busy / held));
}

// Attached programs (issue 14): what the shim charged against the budget beside
// the driver's own figure (NVML) and what lies beyond the charge (the CUDA
// context, which admission covers with salusd's --attach-context-reserve).
Table attached_table(const std::vector<SessionView>& sessions, bool exact) {
  Table t({"ID", "PID", "GPU", "BUDGET", "CHARGED", "PEAK", "GPU_MEM", "CONTEXT", "RESERVE",
           "UNGATED", "RESIDENCY", "ON_CARD", "GATE_WAITS", "GATE_WAIT_MS", "HELD_MS", "BUSY%"});
  // NVML's figure, or "-" where there is none ("unavailable (why)" has spaces).
  auto figure = [&](const KeyValues& k, const char* key) {
    const std::string v = get(k, key);
    return to_u64(v) ? human_bytes(v, exact) : std::string("-");
  };
  for (const SessionView& s : sessions) {
    const KeyValues& k = s.status;
    if (s.err || get(k, "kind") != "attached") continue;
    t.add({get(k, "id"), get(k, "pid"), get(k, "gpu"), human_bytes(get(k, "memory_budget"), exact),
           human_bytes(get(k, "memory_charged"), exact), human_bytes(get(k, "memory_peak"), exact),
           figure(k, "memory_gpu"), figure(k, "memory_context"),
           human_bytes(get(k, "memory_context_reserve"), exact), figure(k, "memory_ungated"),
           get(k, "residency"), human_bytes(get(k, "memory_counted_on_card"), exact),
           get(k, "gate_waits"), get(k, "gate_wait_ms"), get(k, "lane_held_ms"),
           busy_while_held(k)});
  }
  return t;
}

void print_section(const std::string& title, const Table& t) {
  fmt::print("\n{}\n", title);
  if (t.empty())
    fmt::print("  (none)\n");
  else
    print_lines(t.lines());
}

// ---------------------------------------------------------------- explain

void explain(const std::vector<std::string>& lines) {
  for (const auto& l : lines) fmt::print("{}\n", l);
}

std::string q(const Ctx& ctx, std::string_view rel) {
  return sh_quote(ctx.path(rel));
}

// A loop over the entries of DIR ("gpus" or "sessions") that runs BODY with the
// entry in $VAR. An empty directory leaves the glob unexpanded; the [ -e ] test
// skips it, so the loop (and a script ending with it) still succeeds.
std::string for_each_entry(const Ctx& ctx, std::string_view var, std::string_view dir,
                           std::string_view file, std::string_view body) {
  return fmt::format("for {0} in {1}/{2}/*; do [ -e \"${0}/{3}\" ] || continue; {4}; done", var,
                     sh_quote(ctx.mount), dir, file, body);
}

std::string cat_sessions(const Ctx& ctx) {
  return for_each_entry(ctx, "s", "sessions", "status", "cat \"$s/status\"");
}

// ---------------------------------------------------------------- commands

int cmd_status(const Ctx& ctx) {
  if (ctx.explain) {
    explain({fmt::format("cat {} {} {}", q(ctx, "version"), q(ctx, "policy"), q(ctx, "stats")),
             for_each_entry(ctx, "g", "gpus", "info",
                            "cat \"$g/info\" \"$g/memory\" \"$g/lanes\" \"$g/queue\""),
             cat_sessions(ctx)});
    return 0;
  }
  const std::string version = read_file(ctx, ctx.path("version"));
  const KeyValues policy = parse_kv(read_file(ctx, ctx.path("policy")), ": ");
  const KeyValues stats = parse_kv(read_file(ctx, ctx.path("stats")), " ");
  const auto gpus = read_gpus(ctx);
  const auto sessions = read_sessions(ctx);
  const auto metrics = session_metrics(parse_metrics(read_file(ctx, ctx.path("metrics"))));
  fmt::print("{} at {}: policy {}, placement {}, queue {}\n", version.substr(0, version.find('\n')),
             ctx.mount, get(policy, "policy"), get(policy, "placement"), get(policy, "queue"));
  fmt::print(
      "up {}s; {} GPU(s), {} session(s), {} lane(s), {} queued; {} iterations, {} "
      "command errors\n",
      get(stats, "uptime_s"), get(stats, "gpus"), get(stats, "sessions"), get(stats, "lanes"),
      get(stats, "queued_sessions"), get(stats, "iterations"), get(stats, "command_errors"));
  print_section("GPUS", gpu_table(gpus, ctx.exact, nullptr));
  print_section("LANES", lane_table(gpus, ctx.exact));
  const Table queue = queue_table(gpus, ctx.exact);
  if (!queue.empty()) print_section("QUEUE", queue);
  print_section("SESSIONS", session_table(sessions, ctx.exact, metrics));
  const Table attached = attached_table(sessions, ctx.exact);
  if (!attached.empty()) print_section("ATTACHED", attached);
  const Table processes = process_table(gpus, ctx.exact);
  if (!processes.empty()) print_section("PROCESSES", processes);
  return 0;
}

int cmd_sessions(const Ctx& ctx) {
  if (ctx.explain) {
    explain({cat_sessions(ctx)});
    return 0;
  }
  const auto sessions = read_sessions(ctx);
  const auto metrics = session_metrics(parse_metrics(read_file(ctx, ctx.path("metrics"))));
  print_lines(session_table(sessions, ctx.exact, metrics).lines());
  return 0;
}

int cmd_show(const Ctx& ctx, const std::string& id) {
  const std::string dir = "sessions/" + id;
  if (ctx.explain) {
    explain({fmt::format("cat {}", q(ctx, dir + "/status")),
             fmt::format("cat {}", q(ctx, dir + "/log"))});
    return 0;
  }
  std::string status;
  if (const int err = try_read(ctx.path(dir + "/status"), status)) {
    // "sessions/7/status: No such file or directory" would read as a broken
    // tree; say which session is missing, as `kill` does.
    struct stat st;
    if (err == ENOENT && ::stat(ctx.path("version").c_str(), &st) == 0)
      fail(fmt::format("show {}: no session {} (salusctl sessions lists them)", id, id));
    fail_file(ctx, ctx.path(dir + "/status"), err);
  }
  const std::string log = read_file(ctx, ctx.path(dir + "/log"));
  fmt::print("{}", status);
  fmt::print("\nlog ({}):\n{}", ctx.path(dir + "/log"), log.empty() ? "  (empty)\n" : log);
  return 0;
}

void check_word(const std::string& what, const std::string& w) {
  if (w.empty() || w.find_first_of(" \t\n#") != std::string::npos)
    throw CLI::ValidationError(what, "must be one word without spaces or '#'");
}

int cmd_ctl(const Ctx& ctx, const std::string& line) {
  if (ctx.explain) {
    explain({fmt::format("echo {} > {}", sh_quote(line), q(ctx, "ctl"))});
    return 0;
  }
  fmt::print("{}", ctl_command(ctx, line));
  return 0;
}

int cmd_policy(const Ctx& ctx, std::vector<std::string> args) {
  const std::string path = ctx.path("policy");
  if (args.empty()) {
    if (ctx.explain) {
      explain({fmt::format("cat {}", sh_quote(path))});
      return 0;
    }
    fmt::print("{}", read_file(ctx, path));
    return 0;
  }
  // "policy placement=lug" keeps the current policy and changes only the options.
  const bool keep_name = args[0].find('=') != std::string::npos;
  for (const auto& a : args) check_word("policy", a);
  if (ctx.explain) {
    std::string rest;
    for (const auto& a : args) rest += " " + a;
    if (keep_name)
      explain({fmt::format("name=$(sed -n 's/^policy: //p' {})", sh_quote(path)),
               fmt::format("echo \"$name{}\" > {}", rest, sh_quote(path)),
               fmt::format("cat {}", sh_quote(path))});
    else
      explain({fmt::format("echo {} > {}", sh_quote(rest.substr(1)), sh_quote(path)),
               fmt::format("cat {}", sh_quote(path))});
    return 0;
  }
  if (keep_name) {
    const std::string current = get(parse_kv(read_file(ctx, path), ": "), "policy", "");
    if (current.empty()) fail(path + ": no 'policy:' line to keep");
    args.insert(args.begin(), current);
  }
  std::string line;
  for (const auto& a : args) line += (line.empty() ? "" : " ") + a;
  if (const int err = try_write(path, line + "\n")) {
    std::string why;
    if (err == EACCES) why = kAdminOnly;
    if (err == EINVAL)
      why =
          "salusd rejected it (its log says why); expected NAME [placement=magm|lug|rr|exclusive] "
          "[queue=strict|bypass] [quantum_ms=N] [oversubscribe=R] "
          "[fair_share=user|user-across-lanes|session] with NAME fifo, pack, srtf, fair or "
          "priority";
    fail_file(ctx, path, err, why.empty() ? line : fmt::format("'{}': {}", line, why));
  }
  fmt::print("{}", read_file(ctx, path));
  return 0;
}

// ---------------------------------------------------------------- top

// Everything one frame of `top` needs, read at one instant.
struct TopSample {
  std::chrono::steady_clock::time_point at;
  std::vector<GpuView> gpus;
  std::vector<SessionView> sessions;
  std::map<std::string, double> busy_s;  // gpu -> salus_gpu_busy_seconds_total
  MetricsBySession metrics;
  KeyValues policy;
};

TopSample take_sample(const Ctx& ctx) {
  TopSample s;
  s.at = std::chrono::steady_clock::now();
  const auto metrics = parse_metrics(read_file(ctx, ctx.path("metrics")));
  for (const Metric& m : metrics) {
    auto gpu = m.labels.find("gpu");
    if (m.name == "salus_gpu_busy_seconds_total" && gpu != m.labels.end())
      s.busy_s[gpu->second] = m.value;
  }
  s.metrics = session_metrics(metrics);
  s.gpus = read_gpus(ctx);
  s.sessions = read_sessions(ctx);
  s.policy = parse_kv(read_file(ctx, ctx.path("policy")), ": ");
  return s;
}

std::vector<std::string> top_frame(const Ctx& ctx, const TopSample& a, const TopSample& b,
                                   double interval) {
  const double dt = std::max(1e-6, std::chrono::duration<double>(b.at - a.at).count());
  std::vector<std::string> out;
  char clock[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(clock, sizeof clock, "%H:%M:%S", std::localtime(&now));
  out.push_back(fmt::format("salus top at {}: policy {}, placement {}; every {:g}s  {}", ctx.mount,
                            get(b.policy, "policy"), get(b.policy, "placement"), interval, clock));
  out.emplace_back();

  std::vector<double> busy;
  for (const GpuView& g : b.gpus) {
    auto i0 = a.busy_s.find(g.index), i1 = b.busy_s.find(g.index);
    const double d = (i0 != a.busy_s.end() && i1 != b.busy_s.end()) ? i1->second - i0->second : 0;
    busy.push_back(std::clamp(100.0 * d / dt, 0.0, 100.0));
  }
  for (auto& l : gpu_table(b.gpus, ctx.exact, &busy).lines()) out.push_back(std::move(l));
  out.emplace_back();
  const Table lanes = lane_table(b.gpus, ctx.exact);
  if (lanes.empty()) {
    out.emplace_back("LANES  (none)");
  } else {
    for (auto& l : lanes.lines()) out.push_back(std::move(l));
  }
  out.emplace_back();

  // Per-session rates over the interval. SHARE is the session's part of the device
  // time that all sessions on its GPU used; GPU% is its device time per wall second.
  struct Row {
    const SessionView* s;
    std::string gpu;
    double iters_per_s = 0, gpu_pct = 0, dgpu = 0;
  };
  std::vector<Row> rows;
  std::map<std::string, double> per_gpu;
  std::map<std::string, const SessionView*> before;
  for (const SessionView& s : a.sessions) before[s.dir] = &s;
  for (const SessionView& s : b.sessions) {
    Row r{&s, s.err ? std::string("-") : get(s.status, "gpu")};
    double i0 = 0, i1 = 0, g0 = 0, g1 = 0;
    bool have = false;
    if (!s.err && before.count(s.dir) && !before[s.dir]->err) {
      const KeyValues& old = before[s.dir]->status;
      if (auto x = to_double(get(old, "iterations_done")),
          y = to_double(get(s.status, "iterations_done"));
          x && y) {
        i0 = *x;
        i1 = *y;
        have = true;
      }
      if (auto x = to_double(get(old, "gpu_time_ms")), y = to_double(get(s.status, "gpu_time_ms"));
          x && y) {
        g0 = *x / 1e3;
        g1 = *y / 1e3;
      }
    } else if (a.metrics.count(s.dir) && b.metrics.count(s.dir)) {
      i0 = a.metrics.at(s.dir).iterations;
      i1 = b.metrics.at(s.dir).iterations;
      g0 = a.metrics.at(s.dir).gpu_s;
      g1 = b.metrics.at(s.dir).gpu_s;
      have = true;
    }
    if (have) {
      r.iters_per_s = std::max(0.0, (i1 - i0) / dt);
      r.dgpu = std::max(0.0, g1 - g0);
      r.gpu_pct = 100.0 * r.dgpu / dt;
    }
    per_gpu[r.gpu] += r.dgpu;
    rows.push_back(r);
  }
  Table t({"ID", "NAME", "UID", "STATE", "GPU", "LANE", "ITER/S", "DONE", "QUEUED", "GPU%",
           "SHARE%", "WAIT_MS", "KIND"});
  for (const Row& r : rows) {
    const SessionView& s = *r.s;
    const double total = per_gpu[r.gpu];
    const std::string share = total > 0 ? fmt::format("{:.1f}", 100.0 * r.dgpu / total) : "0.0";
    if (s.err) {
      const auto m = b.metrics.find(s.dir);
      const bool have = m != b.metrics.end();
      t.add({"-", s.dir, have ? m->second.uid : "-", unreadable_state(s.err), "-", "-",
             fmt::format("{:.1f}", r.iters_per_s),
             have ? fmt::format("{:.0f}", m->second.iterations) : "-", "-",
             fmt::format("{:.1f}", r.gpu_pct), share,
             have ? fmt::format("{:.3f}", m->second.queue_s * 1e3) : "-", "-"});
      continue;
    }
    const KeyValues& k = s.status;
    t.add({get(k, "id"), s.dir, get(k, "uid"), get(k, "state"), r.gpu, get(k, "lane"),
           fmt::format("{:.1f}", r.iters_per_s), get(k, "iterations_done"),
           get(k, "iterations_queued"), fmt::format("{:.1f}", r.gpu_pct), share,
           get(k, "queue_wait_ms"), get(k, "kind")});
  }
  if (t.empty()) {
    out.emplace_back("SESSIONS  (none)");
  } else {
    for (auto& l : t.lines()) out.push_back(std::move(l));
  }
  return out;
}

std::pair<int, int> terminal_size() {
  winsize ws{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0)
    return {ws.ws_col, ws.ws_row};
  return {0, 0};
}

int cmd_top(const Ctx& ctx, double interval, bool once) {
  if (ctx.explain) {
    // One frame; rates are the increase between two frames one interval apart.
    const std::string busy =
        fmt::format("grep -E '^salus_(gpu_busy_seconds_total|gpu_memory_bytes|gpu_lanes)' {}",
                    q(ctx, "metrics"));
    const std::vector<std::string> frame = {
        "date", busy, for_each_entry(ctx, "g", "gpus", "lanes", "cat \"$g/lanes\""),
        for_each_entry(ctx, "s", "sessions", "status",
                       "echo \"== $s\"; grep -E "
                       "'^(state|gpu|lane|iterations_done|gpu_time_ms|queue_wait_ms):' "
                       "\"$s/status\"")};
    std::vector<std::string> lines = {
        "# busy % = increase of salus_gpu_busy_seconds_total over the interval; iter/s "
        "from the increase of iterations_done"};
    if (once) {
      // --once: a first sample, the interval, then the frame to compare it with.
      lines.push_back(busy);
      lines.push_back(fmt::format("sleep {:g}", interval));
      lines.insert(lines.end(), frame.begin(), frame.end());
    } else {
      lines.push_back("while :; do");
      lines.push_back("  clear");
      for (const auto& l : frame) lines.push_back("  " + l);
      lines.push_back(fmt::format("  sleep {:g}", interval));
      lines.push_back("done");
    }
    explain(lines);
    return 0;
  }
  SignalFd sigs({SIGINT, SIGTERM, SIGHUP});
  const bool tty = ::isatty(STDOUT_FILENO) && !once;
  auto wait_interval = [&](double seconds) {
    pollfd p{sigs.fd(), POLLIN, 0};
    const int ms = static_cast<int>(seconds * 1000);
    if (::poll(&p, 1, std::max(ms, 1)) <= 0) return false;
    // Consume it: a signal still pending when the mask is restored would kill us.
    while (sigs.take()) {
    }
    return true;  // a signal came
  };
  TopSample prev = take_sample(ctx);
  if (once) {
    if (wait_interval(interval)) return 130;
    print_lines(top_frame(ctx, prev, take_sample(ctx), interval));
    return 0;
  }
  if (tty) fmt::print("\x1b[?25l\x1b[H\x1b[2J");
  // The first frame comes after a short interval so that rates mean something.
  double wait = std::min(interval, 0.25);
  for (;;) {
    if (wait_interval(wait)) break;
    wait = interval;
    TopSample cur;
    try {
      cur = take_sample(ctx);
    } catch (const Failure& e) {
      if (tty) fmt::print("\x1b[?25h\n");
      std::fflush(stdout);
      throw;
    }
    auto lines = top_frame(ctx, prev, cur, interval);
    prev = std::move(cur);
    if (tty) {
      const auto [cols, rows] = terminal_size();
      std::string frame = "\x1b[H";
      for (std::size_t i = 0; i < lines.size(); ++i) {
        if (rows > 0 && i + 1 >= static_cast<std::size_t>(rows)) break;
        std::string& l = lines[i];
        if (cols > 0 && l.size() > static_cast<std::size_t>(cols)) l.resize(cols);
        frame += l + "\x1b[K\n";
      }
      frame += "\x1b[J";
      fmt::print("{}", frame);
    } else {
      print_lines(lines);
      fmt::print("\n");
    }
    std::fflush(stdout);
  }
  if (tty) fmt::print("\x1b[?25h\n");
  return 0;
}

// ---------------------------------------------------------------- run

struct RunOptions {
  std::optional<std::string> persistent, ephemeral, gpu, name;
  std::optional<unsigned long long> iters;
  std::optional<long long> priority;
  bool verbose = false;
  std::vector<std::string> command;
};

std::string need_line(const RunOptions& o) {
  if (!o.persistent && !o.ephemeral && !o.iters && !o.priority && !o.gpu) return {};
  std::string line = fmt::format("need persistent={} ephemeral={}", o.persistent.value_or("0"),
                                 o.ephemeral.value_or("0"));
  if (o.iters) line += fmt::format(" iters={}", *o.iters);
  if (o.priority) line += fmt::format(" priority={}", *o.priority);
  if (o.gpu) line += fmt::format(" gpu={}", *o.gpu);
  return line;
}

// run's --explain: the same steps as a shell script (the session named after
// the shell's pid when --name is not given).
void explain_run(const Ctx& ctx, const RunOptions& o, const std::string& dir,
                 const std::string& need) {
  std::string cmdline;
  for (const auto& w : o.command) cmdline += (cmdline.empty() ? "" : " ") + sh_quote(w);
  const std::string shown_dir = o.name ? ctx.path(dir) : ctx.path("sessions/run-") + "$$";
  const std::string d = o.name ? sh_quote(shown_dir) : "\"" + shown_dir + "\"";
  std::vector<std::string> lines = {fmt::format("mkdir {}", d)};
  if (!need.empty()) lines.push_back(fmt::format("echo {} > {}/ctl", sh_quote(need), d));
  lines.push_back(
      fmt::format("SALUS_SESSION={} SALUS_MOUNT={} {}; rc=$?", d, sh_quote(ctx.mount), cmdline));
  lines.push_back(fmt::format("[ $rc -eq 0 ] && cat {}/wait", d));
  lines.push_back(fmt::format("rmdir {}", d));
  lines.push_back("exit $rc");
  explain(lines);
}

// Waits for run's command. Signals typed at the terminal already reach it
// (same process group); signals sent to salusctl alone are passed on, and the
// last one is left in `interrupted`. Returns the wait status.
int wait_command(pid_t child, SignalFd& sigs, int& interrupted) {
  int wstatus = 0;
  for (bool done = false; !done;) {
    pollfd p{sigs.fd(), POLLIN, 0};
    if (::poll(&p, 1, -1) < 0 && errno != EINTR) break;
    while (auto si = sigs.take()) {
      if (si->ssi_signo == SIGCHLD) continue;
      if (si->ssi_code == SI_USER || si->ssi_code == SI_QUEUE)
        ::kill(child, static_cast<int>(si->ssi_signo));
      interrupted = static_cast<int>(si->ssi_signo);
    }
    const pid_t r = ::waitpid(child, &wstatus, WNOHANG);
    done = r == child || (r < 0 && errno != EINTR);
  }
  return wstatus;
}

int cmd_run(const Ctx& ctx, RunOptions o) {
  const std::string name = o.name.value_or(fmt::format("run-{}", ::getpid()));
  const std::string dir = "sessions/" + name;
  const std::string need = need_line(o);
  if (ctx.explain) {
    explain_run(ctx, o, dir, need);
    return 0;
  }
  const std::string path = ctx.path(dir);
  // Signals are taken (and later passed on to the command) from before the
  // session exists: one that came between the mkdir and the fork would end
  // salusctl and leave the session behind.
  SignalFd sigs({SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT});
  if (::mkdir(path.c_str(), 0700) != 0) fail_file(ctx, path, errno);
  // From here on the session exists and must be removed whatever happens.
  auto remove_session = [&]() {
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT)
      fmt::print(stderr, "salusctl: {}: rmdir: {}\n", path, std::strerror(errno));
  };
  if (!need.empty()) {
    if (const int err = try_write(path + "/ctl", need + "\n")) {
      const std::string why = last_log_line(ctx, dir);
      remove_session();
      fail_file(ctx, path + "/ctl", err, why.empty() ? need : need + ": " + why);
    }
  }
  const pid_t child = ::fork();
  if (child < 0) {
    const int err = errno;
    remove_session();
    fail(fmt::format("fork: {}", std::strerror(err)));
  }
  if (child == 0) {
    pthread_sigmask(SIG_SETMASK, &sigs.old_mask(), nullptr);
    ::setenv("SALUS_SESSION", path.c_str(), 1);
    ::setenv("SALUS_MOUNT", ctx.mount.c_str(), 1);
    // What the shim writes to the session it makes again after a salusd restart.
    if (need.rfind("need ", 0) == 0) ::setenv("SALUS_NEED", need.c_str() + 5, 1);
    std::vector<char*> argv;
    for (auto& w : o.command) argv.push_back(w.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    const int err = errno;
    fmt::print(stderr, "salusctl: {}: {}\n", o.command[0], std::strerror(err));
    ::_exit(err == ENOENT ? 127 : 126);
  }
  int interrupted = 0;
  const int rc = exit_status_of(wait_command(child, sigs, interrupted));
  if (rc == 0 && !interrupted) {
    // Wait for the session's GPU work in a thread so that a signal can still end it:
    // removing the session answers the pending wait with ECANCELED.
    std::string result;
    std::atomic<int> wait_err{0};
    int pipefd[2];
    if (::pipe2(pipefd, O_CLOEXEC) != 0) fail(fmt::format("pipe: {}", std::strerror(errno)));
    const salus::vgpu::UniqueFd woken(pipefd[0]), wake(pipefd[1]);
    std::thread waiter([&] {
      wait_err = try_read(path + "/wait", result);
      const char b = 1;
      [[maybe_unused]] const ssize_t n = ::write(pipefd[1], &b, 1);
    });
    int sig = 0;
    for (bool done = false; !done;) {
      pollfd p[2] = {{pipefd[0], POLLIN, 0}, {sigs.fd(), POLLIN, 0}};
      if (::poll(p, 2, -1) < 0 && errno != EINTR) break;
      if (p[0].revents) done = true;
      if (p[1].revents) {
        while (auto si = sigs.take())
          if (si->ssi_signo != SIGCHLD && !sig) sig = static_cast<int>(si->ssi_signo);
        if (sig) remove_session();
      }
    }
    waiter.join();
    if (sig) return 128 + sig;
    if (wait_err) {
      const std::string why = last_log_line(ctx, dir);
      fmt::print(stderr, "salusctl: {}/wait: {}{}\n", path, std::strerror(wait_err),
                 why.empty() ? "" : ": " + why);
    } else if (o.verbose) {
      fmt::print(stderr, "salusctl: session {}: {}\n", name, result.substr(0, result.find('\n')));
    }
  } else if (o.verbose) {
    fmt::print(stderr, "salusctl: {} exited with status {}\n", o.command[0], rc);
  }
  remove_session();
  return rc;
}

}  // namespace

// ---------------------------------------------------------------- cdi

struct CdiOptions {
  std::string kind = "salus.io/gpu";
  std::string shim = SALUS_LIBDIR "/libsalus-shim.so";
  std::string output;  // empty or "-": stdout
};

// Writes `text` to `path` through a temporary file and a rename, so a container
// engine reading the spec directory never sees half a spec.
void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  salus::vgpu::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) fail(fmt::format("{}: {}", tmp, std::strerror(errno)));
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      fd.reset();
      ::unlink(tmp.c_str());
      fail(fmt::format("{}: {}", tmp, std::strerror(err)));
    }
    done += static_cast<std::size_t>(n);
  }
  // fsync reports the write-back errors; close after it has nothing left to say.
  const int sync_err = ::fsync(fd.get()) == 0 ? 0 : errno;
  fd.reset();
  if (sync_err != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = sync_err != 0 ? sync_err : errno;
    ::unlink(tmp.c_str());
    fail(fmt::format("{}: {}", path, std::strerror(err)));
  }
}

int cmd_cdi(const Ctx& ctx, const CdiOptions& o) {
  salus::tools::CdiInput in;
  in.kind = o.kind;
  // The real path: a /salus symlink to /run/salus/fs must bind /run/salus.
  char resolved[PATH_MAX];
  in.mount = ::realpath(ctx.mount.c_str(), resolved) ? resolved : ctx.mount;
  for (const auto& g : list_dir(ctx, ctx.path("gpus"))) in.gpus.push_back(g);
  struct stat st;
  if (!o.shim.empty() && ::stat(o.shim.c_str(), &st) == 0 && S_ISREG(st.st_mode)) in.shim = o.shim;
  salus::tools::CdiSpec spec;
  try {
    spec = salus::tools::make_cdi_spec(in);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  for (const auto& note : spec.notes) fmt::print(stderr, "salusctl cdi: note: {}\n", note);
  if (o.output.empty() || o.output == "-") {
    std::fwrite(spec.json.data(), 1, spec.json.size(), stdout);
    return 0;
  }
  write_atomically(o.output, spec.json);
  return 0;
}

namespace {

// The `run` subcommand's options, bound to `o`.
void add_run(CLI::App& app, RunOptions& o) {
  auto* run = app.add_subcommand(
      "run", "Run a command in a named session: salusctl run [OPTIONS] -- CMD [ARGS...]");
  run->add_option("--persistent", o.persistent, "Persistent memory, e.g. 512M");
  run->add_option("--ephemeral", o.ephemeral, "Ephemeral (per-iteration) memory, e.g. 1G");
  run->add_option("--iters", o.iters, "Declared iterations (used by srtf)");
  run->add_option("--priority", o.priority, "Priority (used by the priority policy)");
  run->add_option("--gpu", o.gpu, "GPU index or 'any' (default $SALUS_GPU, if set)");
  run->add_option("--name", o.name, "Session name (default run-<pid>)");
  run->add_flag("-v,--verbose", o.verbose, "Report the session's result on stderr");
  run->add_option("CMD", o.command, "The command and its arguments, after --")->required();
}

// The `cdi` subcommand's options, bound to `o`.
void add_cdi(CLI::App& app, CdiOptions& o) {
  auto* cdi = app.add_subcommand(
      "cdi", "Write a CDI spec (podman/containerd/CRI-O --device KIND=GPU|any) for this host");
  cdi->add_option("-o,--output", o.output,
                  "File to write, e.g. /etc/cdi/salus.json (default: standard output)");
  cdi->add_option("--kind", o.kind, "CDI kind VENDOR/CLASS (default salus.io/gpu)");
  cdi->add_option("--shim", o.shim,
                  "libsalus-shim.so to bind and LD_PRELOAD in containers, if it exists "
                  "(default " SALUS_LIBDIR "/libsalus-shim.so; empty: none)");
}

// --mount without trailing slashes and absolute, so that the paths `run` hands
// to its command work from any directory.
std::string absolute_mount(std::string mount) {
  while (mount.size() > 1 && mount.back() == '/') mount.pop_back();
  if (!mount.empty() && mount[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof cwd)) mount = std::string(cwd) + "/" + mount;
  }
  return mount;
}

}  // namespace

int main(int argc, char** argv) {
  Ctx ctx;
  const char* env_mount = std::getenv("SALUS_MOUNT");
  std::string mount = env_mount && *env_mount ? env_mount : "/salus";

  CLI::App app{"salusctl: inspect and administer salusd through the files under /salus"};
  app.set_version_flag("--version",
                       fmt::format("salusctl {} (api {})", SALUS_VERSION, SALUS_API_VERSION));
  app.require_subcommand(1);
  app.fallthrough();
  app.add_option("-m,--mount", mount, "Where salusd is mounted (default $SALUS_MOUNT or /salus)");
  app.add_flag("--explain", ctx.explain,
               "Print the equivalent shell commands (cat, echo, mkdir...) instead of running");
  app.add_flag("-b,--bytes", ctx.exact, "Print byte counts instead of K/M/G sizes");

  app.add_subcommand("status", "GPUs, lanes, queues and sessions in aligned tables");
  app.add_subcommand("sessions", "One line per session");
  std::string session_id;
  auto* show = app.add_subcommand("show", "A session's status and log");
  show->add_option("ID", session_id, "Session id or name (a directory under sessions/)")
      ->required();
  std::string kill_id;
  auto* kill = app.add_subcommand("kill", "End a session and free what it holds (admin)");
  kill->add_option("ID", kill_id, "Session id or name")->required();
  std::vector<std::string> policy_args;
  auto* policy = app.add_subcommand("policy",
                                    "Show the policy, or switch it: policy NAME [placement=P] "
                                    "[queue=strict|bypass] [quantum_ms=N] [oversubscribe=R] "
                                    "[fair_share=user|user-across-lanes|session]");
  policy->add_option("ARGS", policy_args, "NAME [key=value...]; key=value alone keeps NAME");
  unsigned drain_gpu = 0, undrain_gpu = 0;
  auto* drain = app.add_subcommand("drain", "Stop placing new sessions on a GPU (admin)");
  drain->add_option("GPU", drain_gpu, "GPU index")->required();
  auto* undrain = app.add_subcommand("undrain", "Put a drained GPU back in service (admin)");
  undrain->add_option("GPU", undrain_gpu, "GPU index")->required();
  double interval = 1.0;
  bool once = false;
  auto* top = app.add_subcommand("top", "Live view: GPU busy %, memory, lanes, sessions' rates");
  top->add_option("-i,--interval", interval, "Seconds between frames")
      ->check(CLI::Range(0.05, 3600.0));
  top->add_flag("--once", once, "Print one frame (rates over one interval) and exit");
  RunOptions run_opts;
  add_run(app, run_opts);
  CdiOptions cdi_opts;
  add_cdi(app, cdi_opts);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  ctx.mount = absolute_mount(std::move(mount));

  try {
    if (app.got_subcommand("status")) return cmd_status(ctx);
    if (app.got_subcommand("sessions")) return cmd_sessions(ctx);
    if (app.got_subcommand("show")) {
      check_word("ID", session_id);
      return cmd_show(ctx, session_id);
    }
    if (app.got_subcommand("kill")) {
      check_word("ID", kill_id);
      return cmd_ctl(ctx, "kill " + kill_id);
    }
    if (app.got_subcommand("policy")) return cmd_policy(ctx, policy_args);
    if (app.got_subcommand("drain")) return cmd_ctl(ctx, fmt::format("drain {}", drain_gpu));
    if (app.got_subcommand("undrain")) return cmd_ctl(ctx, fmt::format("undrain {}", undrain_gpu));
    if (app.got_subcommand("top")) return cmd_top(ctx, interval, once);
    if (app.got_subcommand("cdi")) return cmd_cdi(ctx, cdi_opts);
    if (app.got_subcommand("run")) {
      if (run_opts.name) check_word("--name", *run_opts.name);
      // A CDI device (salusctl cdi) names the container's GPU in SALUS_GPU.
      const char* env_gpu = std::getenv("SALUS_GPU");
      if (!run_opts.gpu && env_gpu && *env_gpu && (run_opts.persistent || run_opts.ephemeral))
        run_opts.gpu = env_gpu;
      for (auto* v : {&run_opts.persistent, &run_opts.ephemeral, &run_opts.gpu})
        if (*v) check_word("run option", **v);
      return cmd_run(ctx, std::move(run_opts));
    }
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "salusctl: {}\n", e.what());
    return 2;
  } catch (const Failure& e) {
    std::fflush(stdout);
    fmt::print(stderr, "salusctl: {}\n", e.what());
    return 1;
  }
  return 2;
}
