// salus-run: runs an unmodified program (a PyTorch script, any CUDA program) as an
// attached Salus session.
//
// It opens a clone session and keeps it open for the program's lifetime (the fd is
// close-on-exec, so the session ends when salus-run ends, whatever kills it),
// declares the job's memory with `need`, waits for admission, and starts the
// program with the environment that attaches it: SALUS_SESSION/SALUS_MOUNT (as
// `salusctl run`), LD_PRELOAD of libsalus-shim.so, CUDA_VISIBLE_DEVICES of the
// chosen GPU, and the PyTorch automark (PYTHONPATH + SALUS_AUTOMARK=1). The shim
// attaches by itself and meets salusd's gate at every iteration boundary.
//
// --measure and --retry-on-oom need salus-run to watch the session while the
// program runs: it reads the session's status every 50 ms (a FUSE read, off any
// hot path). See docs/salus-run.1.md for the rules.
//
// Exit status: the program's (128 + signal when a signal killed it), 2 for usage
// errors, 1 when salusd refused or is not there.
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "arena/size_units.hpp"
#include "cli_common.hpp"
#include "salus_config.hpp"
#include "salus_run_options.hpp"
#include "vgpu/unique_fd.hpp"

namespace {

using namespace salus::cli;
using salus::run::expandable_segments_on;
using salus::run::RunOptions;

// Status keys of an attached session (salusd's gate mirror; see salus.5 status).
constexpr const char* kIterKey = "iterations_completed";
constexpr const char* kPeakKey = "memory_peak";
constexpr const char* kChargedKey = "memory_charged";
constexpr const char* kOomKey = "oom_refusals";

void warn(const std::string& msg) {
  fmt::print(stderr, "salus-run: {}\n", msg);
}

// The directory of this executable, for finding the shim and the automark.
std::string exe_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<std::size_t>(n));
  return p.substr(0, p.rfind('/'));
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

std::string real(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// $SALUS_SHIM, else next to salus-run (installed or build tree), else the
// configured install path.
std::optional<std::string> find_shim() {
  if (const char* e = std::getenv("SALUS_SHIM"); e && *e) {
    if (!exists(e)) fail(fmt::format("SALUS_SHIM={}: {}", e, std::strerror(ENOENT)));
    return real(e);
  }
  const std::string d = exe_dir();
  for (const std::string& c : {d + "/libsalus-shim.so", d + "/../client/shim/libsalus-shim.so",
                               d + "/" SALUS_SHIM_FROM_BINDIR, d + "/../lib/salus/libsalus-shim.so",
                               d + "/../lib/libsalus-shim.so", std::string(SALUS_SHIM_INSTALLED)})
    if (exists(c)) return real(c);
  return std::nullopt;
}

// A directory holding FILE: installed (share/salus/SUB) or in the source tree.
std::optional<std::string> find_data(const std::string& sub, const std::string& file,
                                     const std::string& source_dir) {
  const std::string d = exe_dir();
  for (const std::string& c :
       {d + "/../share/salus/" + sub, std::string(SALUS_DATA_INSTALLED) + "/" + sub, source_dir})
    if (exists(c + "/" + file)) return real(c);
  return std::nullopt;
}

// ---------------------------------------------------------------- the session

// A clone session owned by salus-run: it ends when `fd` closes.
struct Session {
  salus::vgpu::UniqueFd fd;
  std::string id, dir;  // dir: sessions/ID
  void close() { fd.reset(); }
};

void open_session(const Ctx& ctx, Session& s) {
  const std::string clone = ctx.path("clone");
  s.fd.reset(::open(clone.c_str(), O_RDWR | O_CLOEXEC));
  if (!s.fd) fail_file(ctx, clone, errno);
  char buf[64];
  const ssize_t n = ::read(s.fd.get(), buf, sizeof buf - 1);
  if (n <= 0) fail_file(ctx, clone, n < 0 ? errno : EIO, "reading the session id");
  s.id.assign(buf, static_cast<std::size_t>(n));
  if (const auto nl = s.id.find('\n'); nl != std::string::npos) s.id.erase(nl);
  s.dir = "sessions/" + s.id;
}

void send(const Ctx& ctx, Session& s, const std::string& line) {
  const std::string text = line + "\n";
  if (::write(s.fd.get(), text.data(), text.size()) < 0) {
    const int err = errno;
    const std::string why = last_log_line(ctx, s.dir);
    fail_file(ctx, ctx.path(s.dir + "/ctl"), err, why.empty() ? line : line + ": " + why);
  }
}

KeyValues status_of(const Ctx& ctx, const Session& s) {
  std::string text;
  if (try_read(ctx.path(s.dir + "/status"), text)) return {};
  return parse_kv(text, ": ");
}

unsigned long long num(const KeyValues& kv, const char* key) {
  return to_u64(get(kv, key, "")).value_or(0);
}

// Waits until the session is admitted; returns its status, or nullopt when a
// signal came (its number in `sig`; the caller ends the session). Uses poll(2) on status, which
// wakes on every state change without occupying a salusd thread.
std::optional<KeyValues> wait_admitted(const Ctx& ctx, const Session& s, SignalFd& sigs, int& sig) {
  const std::string path = ctx.path(s.dir + "/status");
  const auto start = std::chrono::steady_clock::now();
  bool told = false;
  for (;;) {
    const salus::vgpu::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) fail_file(ctx, path, errno);
    std::string text;
    char buf[8192];
    for (ssize_t r; (r = ::read(fd.get(), buf, sizeof buf)) > 0;)
      text.append(buf, static_cast<std::size_t>(r));
    KeyValues kv = parse_kv(text, ": ");
    const std::string state = get(kv, "state");
    if (state == "admitted") return kv;
    if (state == "failed")
      fail(fmt::format("session {} failed before the program started: {}", s.id,
                       last_log_line(ctx, s.dir)));
    const auto waited = std::chrono::steady_clock::now() - start;
    if (!told && waited > std::chrono::seconds(1)) {
      warn(fmt::format("session {} is queued for admission on gpu {} (it waits for memory)", s.id,
                       get(kv, "gpu")));
      told = true;
    }
    pollfd p[2] = {{fd.get(), POLLIN, 0}, {sigs.fd(), POLLIN, 0}};
    const int r = ::poll(p, 2, 1000);
    if (r < 0 && errno != EINTR) fail(fmt::format("poll: {}", std::strerror(errno)));
    if (p[1].revents) {
      while (auto si = sigs.take())
        if (si->ssi_signo != SIGCHLD) {
          sig = static_cast<int>(si->ssi_signo);
          return std::nullopt;
        }
    }
  }
}

// ---------------------------------------------------------------- GPUs

struct GpuView {
  std::string index;
  unsigned long long capacity = 0, free = 0;
  // What admission counts for an attached program's context beside its need.
  unsigned long long context_reserve = 0;
  bool draining = false, empty = false;
  std::string uuid;
};

std::vector<GpuView> read_gpus(const Ctx& ctx) {
  std::vector<GpuView> out;
  std::string names;
  for (unsigned i = 0; i < 1024; ++i) {
    const std::string g = fmt::format("gpus/{}", i);
    std::string info, mem, lanes, queue;
    if (try_read(ctx.path(g + "/info"), info)) break;
    try_read(ctx.path(g + "/memory"), mem);
    try_read(ctx.path(g + "/lanes"), lanes);
    try_read(ctx.path(g + "/queue"), queue);
    const KeyValues ki = parse_kv(info, ": "), km = parse_kv(mem, ": ");
    GpuView v;
    v.index = std::to_string(i);
    v.capacity = num(km, "capacity");
    v.free = num(km, "free");
    v.context_reserve = num(km, "context_reserve");
    v.draining = get(ki, "draining") == "yes";
    v.uuid = get(ki, "uuid", "");
    v.empty = parse_rows(queue).empty();
    for (const auto& row : parse_rows(lanes))
      if (row.size() > 4 && row[4] != "-") v.empty = false;
    out.push_back(v);
  }
  return out;
}

// The value for CUDA_VISIBLE_DEVICES: the GPU's UUID when salusd shows one.
std::string visible_device(const Ctx& ctx, const std::string& gpu) {
  std::string info;
  if (try_read(ctx.path("gpus/" + gpu + "/info"), info) == 0) {
    const std::string uuid = get(parse_kv(info, ": "), "uuid", "");
    if (!uuid.empty() && uuid != "-") return uuid;
  }
  return gpu;
}

// On a GPU where salusd runs MPS (gpus/N/info `mps: on`), the program joins that
// server: its pipe directory, and as a backstop to the shim's accounting a
// device memory limit of the session's budget (persistent + ephemeral, in MiB
// rounded up; device 0 is the one GPU the program sees). Nothing otherwise.
void mps_env(const Ctx& ctx, const std::string& gpu, const KeyValues& status, const RunOptions& o,
             std::string& pipe, std::string& limit, std::string& threads) {
  std::string info;
  if (try_read(ctx.path("gpus/" + gpu + "/info"), info) != 0) return;
  const KeyValues ki = parse_kv(info, ": ");
  const std::string mps = get(ki, "mps", "off");
  if (mps == "down") {
    warn(fmt::format("gpu {}: salusd's MPS control daemon is gone; running without MPS", gpu));
    return;
  }
  if (mps != "on") {
    if (o.mps_threads) warn(fmt::format("gpu {} runs no MPS server: --mps-threads ignored", gpu));
    return;
  }
  pipe = get(ki, "mps_pipe_directory", "");
  if (pipe.empty() || pipe == "-") return;
  const unsigned long long budget = num(status, "persistent") + num(status, "ephemeral");
  limit = fmt::format("0={}M", std::max(1ull, (budget + (1ull << 20) - 1) >> 20));
  if (o.mps_threads) threads = std::to_string(*o.mps_threads);
}

// ---------------------------------------------------------------- the child

struct ChildEnv {
  std::string session, mount, shim, visible, automark_dir, python_dir;
  std::string need_after_restart;  // SALUS_NEED: the shim's `need` after a salusd restart
  // Set on a GPU where salusd runs MPS (empty otherwise): the server's pipe
  // directory, the memory limit (the session's budget), the SM share.
  std::string mps_pipe, mps_memory_limit, mps_threads;
  bool automark = false;
  std::string shared_lane;  // SALUS_SHARED_LANE's value; empty: not set
  int oom_fd = -1;          // write end of the OOM report pipe, or -1
};

void prepend_env(const char* name, const std::string& value, char sep) {
  const char* old = std::getenv(name);
  const std::string v = old && *old ? value + sep + old : value;
  ::setenv(name, v.c_str(), 1);
}

[[noreturn]] void exec_child(const ChildEnv& e, std::vector<std::string> command,
                             const sigset_t& mask) {
  pthread_sigmask(SIG_SETMASK, &mask, nullptr);
  ::setenv("SALUS_SESSION", e.session.c_str(), 1);
  ::setenv("SALUS_MOUNT", e.mount.c_str(), 1);
  ::setenv("SALUS_NEED", e.need_after_restart.c_str(), 1);
  if (!e.shim.empty()) prepend_env("LD_PRELOAD", e.shim, ':');
  ::setenv("CUDA_VISIBLE_DEVICES", e.visible.c_str(), 1);
  if (!e.python_dir.empty()) prepend_env("PYTHONPATH", e.python_dir, ':');
  if (e.automark) {
    prepend_env("PYTHONPATH", e.automark_dir, ':');
    ::setenv("SALUS_AUTOMARK", "1", 1);
  } else {
    ::unsetenv("SALUS_AUTOMARK");
  }
  if (!e.mps_pipe.empty()) {
    ::setenv("CUDA_MPS_PIPE_DIRECTORY", e.mps_pipe.c_str(), 1);
    ::setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", e.mps_memory_limit.c_str(), 1);
    if (!e.mps_threads.empty())
      ::setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", e.mps_threads.c_str(), 1);
  }
  if (e.oom_fd >= 0) ::setenv("SALUS_RUN_OOM_FD", std::to_string(e.oom_fd).c_str(), 1);
  if (!e.shared_lane.empty()) ::setenv("SALUS_SHARED_LANE", e.shared_lane.c_str(), 1);
  std::vector<char*> argv;
  for (auto& w : command) argv.push_back(w.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const int err = errno;
  fmt::print(stderr, "salus-run: {}: {}\n", command[0], std::strerror(err));
  ::_exit(err == ENOENT ? 127 : 126);
}

// What salus-run saw of one run of the program.
struct RunResult {
  int rc = 0;
  bool signalled_us = false;  // salus-run itself got SIGINT/SIGTERM/...
  unsigned long long oom_refusals = 0;
  bool oom_reported = false;  // the automark's excepthook saw a CUDA OOM
};

// The --measure state machine, fed with status snapshots while the program runs.
class Measure {
 public:
  explicit Measure(const RunOptions& o) : o_(o) {}
  // Returns the `need` line to write once the first K iterations are measured.
  std::optional<std::string> feed(const KeyValues& st) {
    if (done_) return std::nullopt;
    if (!st.count(kPeakKey) || !st.count(kIterKey)) return std::nullopt;  // not attached yet
    const auto iters = num(st, kIterKey);
    seen_ = iters;
    if (iters >= 1) persistent_ = std::min(persistent_, num(st, kChargedKey));
    if (iters < o_.measure_iters) return std::nullopt;
    done_ = true;
    const auto [p, e] = salus::run::measured_need(num(st, kPeakKey), persistent_);
    warn(
        fmt::format("--measure: peak {} after {} iterations, {} held after "
                    "iteration 1; need persistent={} ephemeral={}",
                    num(st, kPeakKey), iters, persistent_, p, e));
    return salus::run::need_line(o_, std::to_string(p), std::to_string(e), std::nullopt);
  }
  // At the program's exit: say so when the measurement never completed.
  void finish() const {
    if (!done_)
      warn(
          fmt::format("--measure: the program ended after {} of the {} iterations to measure; "
                      "the provisional need stayed",
                      seen_, o_.measure_iters));
  }

 private:
  const RunOptions& o_;
  bool done_ = false;
  unsigned long long seen_ = 0;
  unsigned long long persistent_ = ~0ULL;
};

// Runs the program once in session `s` and waits for it, watching the session.
RunResult run_child(const Ctx& ctx, Session& s, const RunOptions& o, ChildEnv env, SignalFd& sigs) {
  int oom_pipe[2] = {-1, -1};
  if (o.retry_on_oom && ::pipe2(oom_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    fail(fmt::format("pipe: {}", std::strerror(errno)));
  const salus::vgpu::UniqueFd oom_read(oom_pipe[0]);
  salus::vgpu::UniqueFd oom_write(oom_pipe[1]);
  env.oom_fd = oom_pipe[1];
  const pid_t child = ::fork();
  if (child < 0) fail(fmt::format("fork: {}", std::strerror(errno)));
  if (child == 0) {
    if (oom_pipe[1] >= 0) ::fcntl(oom_pipe[1], F_SETFD, 0);  // inherited by the program
    exec_child(env, o.command, sigs.old_mask());
  }
  oom_write.reset();  // the program holds the only write end: EOF when it exits
  RunResult res;
  std::optional<Measure> measure;
  if (o.measure) measure.emplace(o);
  const bool watch = o.measure || o.retry_on_oom;
  int wstatus = 0;
  for (bool done = false; !done;) {
    pollfd p[2] = {{sigs.fd(), POLLIN, 0}, {oom_pipe[0], POLLIN, 0}};
    if (::poll(p, oom_pipe[0] >= 0 ? 2 : 1, watch ? 50 : -1) < 0 && errno != EINTR) break;
    while (auto si = sigs.take()) {
      if (si->ssi_signo == SIGCHLD) continue;
      if (si->ssi_code == SI_USER || si->ssi_code == SI_QUEUE)
        ::kill(child, static_cast<int>(si->ssi_signo));
      res.signalled_us = true;
    }
    if (oom_pipe[0] >= 0 && (p[1].revents & POLLIN)) {
      char b[64];
      if (::read(oom_pipe[0], b, sizeof b) > 0) res.oom_reported = true;
    }
    if (watch) {
      const KeyValues st = status_of(ctx, s);
      res.oom_refusals = std::max(res.oom_refusals, num(st, kOomKey));
      if (measure)
        if (auto line = measure->feed(st)) send(ctx, s, *line);
    }
    const pid_t r = ::waitpid(child, &wstatus, WNOHANG);
    done = r == child || (r < 0 && errno != EINTR);
  }
  if (watch) res.oom_refusals = std::max(res.oom_refusals, num(status_of(ctx, s), kOomKey));
  if (oom_pipe[0] >= 0) {
    char b[64];
    if (::read(oom_pipe[0], b, sizeof b) > 0) res.oom_reported = true;
  }
  res.rc = exit_status_of(wstatus);
  if (measure && res.rc == 0) measure->finish();
  return res;
}

// ---------------------------------------------------------------- main flow

// The need of the first admission: the declared one, or --measure's provisional
// one (all the headroom the chosen GPU has now).
std::string first_need(const Ctx& ctx, const RunOptions& o) {
  if (!o.measure)
    return salus::run::need_line(o, o.persistent.value_or("0"), o.ephemeral.value_or("0"), o.gpu);
  const auto gpus = read_gpus(ctx);
  const GpuView* best = nullptr;
  for (const auto& g : gpus) {
    if (o.gpu && *o.gpu != "any" && g.index != *o.gpu) continue;
    if (g.draining && !(o.gpu && *o.gpu == g.index)) continue;
    if (!best || g.free > best->free) best = &g;
  }
  if (!best)
    fail(fmt::format("--measure: no usable GPU under {}{}", ctx.mount,
                     o.gpu ? " with --gpu " + *o.gpu : ""));
  // The context reserve is counted beside the need: leave it room.
  const unsigned long long room = best->free >= (1ULL << 20) ? best->free : best->capacity;
  const unsigned long long prov = room > best->context_reserve ? room - best->context_reserve : 0;
  warn(fmt::format(
      "--measure: admitting with a provisional need of persistent=0 ephemeral={} "
      "({} of gpu {}) until {} iterations are measured",
      salus::arena::format_size(prov), best->free >= (1ULL << 20) ? "the headroom" : "the capacity",
      best->index, o.measure_iters));
  return salus::run::need_line(o, "0", std::to_string(prov), best->index);
}

// The need of the OOM retry: a GPU of its own (one without sessions when there is
// one, else the largest, where it queues until the GPU empties), all of it.
std::string exclusive_need(const Ctx& ctx, const RunOptions& o) {
  const auto gpus = read_gpus(ctx);
  const GpuView* pick = nullptr;
  for (const auto& g : gpus) {
    if (g.draining) continue;
    const bool better = !pick || (g.empty && !pick->empty) ||
                        (g.empty == pick->empty && g.capacity > pick->capacity);
    if (better) pick = &g;
  }
  if (!pick) fail("--retry-on-oom: no GPU to retry on (all draining)");
  unsigned long long p = 0;
  if (o.persistent) p = salus::arena::parse_size(*o.persistent).value_or(0);
  const unsigned long long usable =
      pick->capacity > pick->context_reserve ? pick->capacity - pick->context_reserve : 0;
  p = std::min(p, usable);
  return salus::run::need_line(o, std::to_string(p), std::to_string(usable - p), pick->index);
}

// One run: session, admission, environment, program. Returns the result; sets
// `gpu` to the GPU it ran on.
RunResult run_once(const Ctx& ctx, const RunOptions& o, const std::string& need,
                   const ChildEnv& base, SignalFd& sigs) {
  Session s;
  open_session(ctx, s);
  send(ctx, s, need);
  int sig = 0;
  const auto st = wait_admitted(ctx, s, sigs, sig);
  if (!st) {
    RunResult r;
    r.rc = 128 + sig;
    r.signalled_us = true;
    return r;
  }
  if (o.verbose)
    warn(fmt::format("session {} admitted on gpu {} lane {}: {}", s.id, get(*st, "gpu"),
                     get(*st, "lane"), need));
  ChildEnv env = base;
  env.session = ctx.path(s.dir);
  env.visible = visible_device(ctx, get(*st, "gpu"));
  env.need_after_restart = salus::run::need_after_restart(need, get(*st, "gpu"));
  mps_env(ctx, get(*st, "gpu"), *st, o, env.mps_pipe, env.mps_memory_limit, env.mps_threads);
  RunResult r = run_child(ctx, s, o, env, sigs);
  if (o.verbose) warn(fmt::format("{} exited with status {}", o.command[0], r.rc));
  return r;
}

int run(const Ctx& ctx, const RunOptions& o) {
  // Checked before anything is created, for a clear message.
  std::string version;
  if (const int err = try_read(ctx.path("version"), version))
    fail_file(ctx, ctx.path("version"), err);
  ChildEnv env;
  env.mount = ctx.mount;
  if (const auto shim = find_shim()) {
    env.shim = *shim;
  } else {
    fail("libsalus-shim.so not found next to salus-run or in " SALUS_SHIM_INSTALLED
         "; set SALUS_SHIM to its path");
  }
  env.automark = !o.no_automark;
  env.shared_lane = o.shared_lane;
  if (o.shared_lane == "alloc")
    for (const char* var : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"})
      if (const char* conf = std::getenv(var); conf && expandable_segments_on(conf)) {
        // Its allocator makes every segment with cuMemCreate, which the memory
        // lane cannot hand out: the lane is room for them instead.
        env.shared_lane = "segments";
        if (o.verbose)
          warn(
              fmt::format("salus-run: {}={}: expandable segments allocate with cuMemCreate, so "
                          "the shared lane serves them as room (--shared-lane=segments)",
                          var, conf));
      }
  if (env.automark) {
    const auto d = find_data("automark", "sitecustomize.py", SALUS_AUTOMARK_SOURCE);
    if (!d) fail("the PyTorch automark (sitecustomize.py) is not installed; use --no-automark");
    env.automark_dir = *d;
  }
  env.python_dir = find_data("python", "salus.py", SALUS_PYTHON_SOURCE).value_or("");
  SignalFd sigs({SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT});
  RunResult r = run_once(ctx, o, first_need(ctx, o), env, sigs);
  const bool oom = r.oom_refusals > 0 || r.oom_reported;
  if (o.retry_on_oom && r.rc != 0 && !r.signalled_us && oom) {
    const std::string need = exclusive_need(ctx, o);
    warn(fmt::format(
        "{} exited with status {} after running out of GPU memory ({}); running it "
        "once more with a GPU of its own: {}",
        o.command[0], r.rc,
        r.oom_refusals ? fmt::format("{} allocations refused past its budget", r.oom_refusals)
                       : std::string("CUDA out of memory"),
        need));
    RunOptions again = o;
    again.measure = false;
    const bool named = std::any_of(o.hints.begin(), o.hints.end(),
                                   [](const std::string& h) { return h.rfind("name=", 0) == 0; });
    r = run_once(ctx, again, named ? need : need + " name=oom-retry", env, sigs);
  }
  return r.rc;
}

}  // namespace

int main(int argc, char** argv) {
  RunOptions o;
  std::string mount;
  if (const char* m = std::getenv("SALUS_MOUNT"); m && *m) mount = m;
  if (const auto err = salus::run::parse_args(argc, argv, o, mount)) {
    if (err->empty()) return 0;  // --help, --version
    fmt::print(stderr, "salus-run: {}\n", *err);
    return 2;
  }
  Ctx ctx;
  ctx.mount = salus::run::absolute_mount(mount.empty() ? "/salus" : mount);
  try {
    return run(ctx, o);
  } catch (const Failure& e) {
    std::fflush(stdout);
    fmt::print(stderr, "salus-run: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "salus-run: internal error: {}\n", e.what());
    return 1;
  }
}
