// salus-bench: measures salusd through its real /salus files. Starts its own
// salusd (sim backend) on a temporary mount unless --mount names a running one.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "arena/gpu_arena.hpp"
#include "sched/gpu_scheduler.hpp"
#include "sched/trace_generator.hpp"

namespace {

namespace arena = salus::arena;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "salus-bench: %s\n", why.c_str());
  std::exit(1);
}

void write_all(int fd, const std::string& s) {
  if (::write(fd, s.data(), s.size()) != static_cast<ssize_t>(s.size()))
    die(fmt::format("write '{}': {}", s.substr(0, s.find('\n')), std::strerror(errno)));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A salusd this tool started; stopped and unmounted on destruction.
struct Daemon {
  pid_t pid = -1;
  std::string dir, mnt;
  Daemon(const std::string& salusd, const std::vector<std::string>& extra) {
    char tmpl[] = "/tmp/salus-bench-XXXXXX";
    if (!::mkdtemp(tmpl)) die("mkdtemp failed");
    dir = tmpl;
    mnt = dir + "/mnt";
    ::mkdir(mnt.c_str(), 0755);
    pid = ::fork();
    if (pid == 0) {
      std::vector<std::string> args = {salusd, "--backend",   "sim", "--mount",
                                       mnt,    "--log-level", "warn"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::_Exit(127);
    }
    for (int i = 0; i < 500; ++i) {
      if (fs::exists(mnt + "/version")) return;
      int st;
      if (::waitpid(pid, &st, WNOHANG) == pid) die("salusd exited during start-up");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    die("salusd did not mount");
  }
  ~Daemon() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);
      int st;
      ::waitpid(pid, &st, 0);
    }
    std::system(fmt::format("fusermount3 -u -z {} 2>/dev/null", mnt).c_str());
    fs::remove_all(dir);
  }
};

long rss_kib(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      long v;
      in >> v;
      return v;
    }
    in.ignore(1 << 12, '\n');
  }
  return -1;
}

struct Clone {
  int fd;
  std::string id;
  explicit Clone(const std::string& mnt) {
    fd = ::open((mnt + "/clone").c_str(), O_RDWR);
    if (fd < 0) die(fmt::format("open clone: {}", std::strerror(errno)));
    char buf[64];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) die("read clone id");
    id.assign(buf, static_cast<std::size_t>(n) - 1);
  }
  ~Clone() { ::close(fd); }
};

void wait_done(const std::string& mnt, const std::string& id) {
  const std::string text = read_file(fmt::format("{}/sessions/{}/wait", mnt, id));
  if (text.rfind("done", 0) != 0) die("wait failed: " + text);
}

int bench_ctl(const std::string& mnt, int n) {
  Clone c(mnt);
  write_all(c.fd, "need persistent=1M ephemeral=1M\n");
  char buf[256];
  while (::read(c.fd, buf, sizeof buf) > 0) {
  }
  const int vfd = ::open((mnt + "/version").c_str(), O_RDONLY);
  std::vector<double> ctl, ver;
  for (int i = 0; i < n + n / 10; ++i) {
    auto t0 = Clock::now();
    write_all(c.fd, "priority 0\n");
    if (::read(c.fd, buf, sizeof buf) <= 0) die("no ctl reply");
    const double a = us_since(t0);
    t0 = Clock::now();
    if (::pread(vfd, buf, sizeof buf, 0) <= 0) die("pread version");
    const double b = us_since(t0);
    if (i >= n / 10) {  // the first tenth warms up
      ctl.push_back(a);
      ver.push_back(b);
    }
  }
  ::close(vfd);
  const double c50 = percentile(ctl, 0.5), c99 = percentile(ctl, 0.99);
  const double v50 = percentile(ver, 0.5), v99 = percentile(ver, 0.99);
  fmt::print("ctl-roundtrip n={}\n", n);
  fmt::print("  ctl write+read reply   p50 {:8.1f} us  p99 {:8.1f} us\n", c50, c99);
  fmt::print("  pread /salus/version   p50 {:8.1f} us  p99 {:8.1f} us\n", v50, v99);
  fmt::print("  ratio                  p50 {:8.2f}     p99 {:8.2f}   (target p50 <= 2.0)\n",
             c50 / v50, c99 / v99);
  return 0;
}

int bench_dispatch(const std::string& mnt, long iters, int sessions, const std::string& body) {
  std::vector<std::unique_ptr<Clone>> cs;
  for (int i = 0; i < sessions; ++i) {
    cs.push_back(std::make_unique<Clone>(mnt));
    write_all(cs.back()->fd, fmt::format("need persistent=0 ephemeral=0\nbegin\n{}{}end\n", body,
                                         body.empty() ? "" : "\n"));
    wait_done(mnt, cs.back()->id);
  }
  const long per = iters / sessions;
  const auto t0 = Clock::now();
  for (auto& c : cs) write_all(c->fd, fmt::format("run {}\n", per));
  for (auto& c : cs) wait_done(mnt, c->id);
  const double secs = us_since(t0) / 1e6;
  const long total = per * sessions;
  fmt::print(
      "dispatch body='{}' sessions={} iterations={} time={:.3f}s rate={:.0f} "
      "iterations/s (target >= 100000)\n",
      body, sessions, total, secs, static_cast<double>(total) / secs);
  return 0;
}

int bench_scale(const std::string& mnt, pid_t daemon, int n) {
  const long rss0 = daemon > 0 ? rss_kib(daemon) : -1;
  for (int i = 0; i < n; ++i) {
    const std::string d = fmt::format("{}/sessions/bench-{}", mnt, i);
    if (::mkdir(d.c_str(), 0700) != 0) die(fmt::format("mkdir {}: {}", d, std::strerror(errno)));
  }
  const long rss1 = daemon > 0 ? rss_kib(daemon) : -1;
  std::vector<double> ls_ms, stats_ms;
  for (int r = 0; r < 20; ++r) {
    auto t0 = Clock::now();
    std::size_t count = 0;
    for (const auto& e : fs::directory_iterator(mnt + "/sessions")) count += !e.path().empty();
    ls_ms.push_back(us_since(t0) / 1e3);
    if (count < static_cast<std::size_t>(n)) die("ls saw too few sessions");
    t0 = Clock::now();
    (void)read_file(mnt + "/stats");
    stats_ms.push_back(us_since(t0) / 1e3);
  }
  fmt::print("scale sessions={}\n", n);
  fmt::print("  ls sessions/   p50 {:.2f} ms  max {:.2f} ms  (target < 50 ms)\n",
             percentile(ls_ms, 0.5), percentile(ls_ms, 1.0));
  fmt::print("  cat stats      p50 {:.2f} ms  max {:.2f} ms  (target < 50 ms)\n",
             percentile(stats_ms, 0.5), percentile(stats_ms, 1.0));
  if (daemon > 0)
    fmt::print("  daemon RSS {} KiB -> {} KiB: {:.1f} KiB per idle session (target < 64)\n", rss0,
               rss1, static_cast<double>(rss1 - rss0) / n);
  for (int i = 0; i < n; ++i) ::rmdir(fmt::format("{}/sessions/bench-{}", mnt, i).c_str());
  return 0;
}

// Admission decisions of the pure arena at scale (no daemon involved): ~1,000
// sessions in ~100 lanes, then request/leave pairs, timing each call.
int bench_assign(int sessions, int rounds) {
  using namespace salus::arena;
  constexpr Bytes M = 1u << 20;
  GpuArena arena(16ull << 30);
  arena::SessionId next = 1;
  for (int i = 0; i < sessions; ++i) {
    // 100 big lanes first; the rest carry no persistent memory so they can all be
    // admitted into existing lanes once no new lane fits.
    const Bytes e = i < 100 ? 150 * M : (50 + static_cast<Bytes>(i % 100)) * M;
    arena.request(next++, Need{i < 100 ? M : 0, e}, 0);
  }
  (void)arena.take_admissions();
  const auto mem = arena.memory();
  std::vector<double> req_us, leave_us;
  for (int r = 0; r < rounds; ++r) {
    const arena::SessionId id = next++;
    auto t0 = Clock::now();
    arena.request(id, Need{0, (60 + static_cast<Bytes>(r % 90)) * M}, r);
    req_us.push_back(us_since(t0));
    (void)arena.take_admissions();
    t0 = Clock::now();
    arena.leave(id, r);
    leave_us.push_back(us_since(t0));
  }
  fmt::print("assign sessions={} lanes={} queued={} rounds={}\n", sessions, mem.lanes, mem.queued,
             rounds);
  fmt::print("  request (assignment decision)  p50 {:.2f} us  p99 {:.2f} us  (target p50 <= 10)\n",
             percentile(req_us, 0.5), percentile(req_us, 0.99));
  fmt::print("  leave (reassignment)           p50 {:.2f} us  p99 {:.2f} us\n",
             percentile(leave_us, 0.5), percentile(leave_us, 0.99));
#ifndef NDEBUG
  fmt::print(
      "  note: assertions are on (every call also checks all invariants); build with "
      "-Db_ndebug=true for decision cost\n");
#endif
  return 0;
}

// Scheduler decisions with many sessions in one lane: pick + the dispatch and
// completion bookkeeping that follow every decision.
int bench_decide(int sessions, int rounds, const std::string& policy_name) {
  using namespace salus;
  const auto policy = sched::policy_from_string(policy_name);
  if (!policy) die("unknown policy " + policy_name);
  constexpr arena::Bytes M = 1u << 20;
  sched::GpuScheduler s(M + M / 2, *policy);  // room for exactly one 1M lane
  for (int i = 1; i <= sessions; ++i) {
    s.arrive(static_cast<arena::SessionId>(i), arena::Need{0, M}, i % 7,
             static_cast<std::uint64_t>(1000 + i % 500), 0);
  }
  const auto adm = s.take_admissions();
  if (adm.size() != static_cast<std::size_t>(sessions)) die("not every session was admitted");
  for (const auto& a : adm) s.set_runnable(a.session, true);
  const arena::LaneId lane = adm.front().lane;
  std::vector<double> pick_us, cycle_us;
  std::uint64_t ns = 1;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    const auto id = s.pick(lane);
    pick_us.push_back(us_since(t0));
    s.iteration_dispatched(*id);
    s.iteration_done(*id, static_cast<std::int64_t>(1000 + (ns++ * 7919) % 5000));
    cycle_us.push_back(us_since(t0));
  }
  fmt::print("decide policy={} sessions={} (one lane) rounds={}\n", policy_name, sessions, rounds);
  fmt::print("  pick                        p50 {:.3f} us  p99 {:.3f} us  (target p50 <= 5)\n",
             percentile(pick_us, 0.5), percentile(pick_us, 0.99));
  fmt::print("  pick + dispatched + done    p50 {:.3f} us  p99 {:.3f} us\n",
             percentile(cycle_us, 0.5), percentile(cycle_us, 0.99));
  return 0;
}

// Memory utilization: the Salus workload mix arriving in a seeded random order on
// one 16 GiB GPU, nobody leaving. Lanes (Algorithm 1) against static partitioning
// (each job an exclusive region of its peak), as admitted peak memory / capacity.
int bench_memutil(int seeds) {
  using namespace salus;
  const auto mix = sched::salus_workloads();
  constexpr arena::Bytes kCap = 16ull << 30;
  constexpr double M = 1 << 20;
  double lanes_sum = 0, static_sum = 0;
  std::size_t lanes_jobs = 0, static_jobs = 0;
  for (int seed = 1; seed <= seeds; ++seed) {
    std::vector<std::size_t> order(mix.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
    std::shuffle(order.begin(), order.end(), rng);
    arena::GpuArena ar(kCap);
    double static_used = 0, lane_peaks = 0, static_peaks = 0;
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto& w = mix[order[i]];
      const auto p = static_cast<arena::Bytes>(w.persistent_mb * M);
      const auto e = static_cast<arena::Bytes>((w.peak_mb - w.persistent_mb) * M);
      ar.request(i + 1, arena::Need{p, e}, 0);
      if (static_used + w.peak_mb * M <= static_cast<double>(kCap)) {
        static_used += w.peak_mb * M;
        static_peaks += w.peak_mb * M;
        ++static_jobs;
      }
    }
    for (const auto& a : ar.take_admissions()) {
      const auto& w = mix[order[a.session - 1]];
      lane_peaks += w.peak_mb * M;
      ++lanes_jobs;
    }
    lanes_sum += lane_peaks / static_cast<double>(kCap);
    static_sum += static_peaks / static_cast<double>(kCap);
  }
  fmt::print("memutil workloads={} gpu=16GiB seeds={}\n", mix.size(), seeds);
  fmt::print("  lanes (Algorithm 1)    admitted peaks / capacity {:.2f}  jobs admitted {:.1f}\n",
             lanes_sum / seeds, static_cast<double>(lanes_jobs) / seeds);
  fmt::print("  static partitioning    admitted peaks / capacity {:.2f}  jobs admitted {:.1f}\n",
             static_sum / seeds, static_cast<double>(static_jobs) / seeds);
  fmt::print("  ratio lanes/static     {:.2f}\n", lanes_sum / static_sum);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"salus-bench: benchmarks salusd through /salus"};
  std::string mount, salusd = "build/tools/salusd";
  int n = 20000, sessions = 1, scale = 1000;
  long iters = 100000;
  app.add_option("--mount", mount, "Use a running salusd mounted here");
  app.add_option("--salusd", salusd, "salusd binary to start (sim backend) when --mount is absent");
  app.require_subcommand(1);
  auto* ctl = app.add_subcommand("ctl", "ctl round trip against a pread of version");
  ctl->add_option("-n", n, "Round trips");
  auto* disp = app.add_subcommand("dispatch", "Broker-side dispatch rate of empty iterations");
  disp->add_option("--iterations", iters, "Total iterations");
  disp->add_option("--sessions", sessions, "Sessions sharing them");
  std::string body;
  disp->add_option("--body", body, "Iteration body, e.g. 'spin 0' (default: empty)");
  auto* sc = app.add_subcommand("scale", "ls and stats latency and RSS with many idle sessions");
  sc->add_option("--sessions", scale, "Idle sessions");
  auto* asg = app.add_subcommand("assign", "Arena admission decision time (pure, no daemon)");
  int assign_sessions = 1000, rounds = 20000;
  asg->add_option("--sessions", assign_sessions, "Sessions admitted first");
  asg->add_option("--rounds", rounds, "Timed request/leave pairs");
  auto* dec = app.add_subcommand("decide", "Scheduler decision time (pure, no daemon)");
  int decide_sessions = 10000, decide_rounds = 100000;
  std::string decide_policy = "fair";
  dec->add_option("--sessions", decide_sessions, "Sessions sharing one lane");
  dec->add_option("--rounds", decide_rounds, "Timed decisions");
  dec->add_option("--policy", decide_policy, "fifo, pack, srtf, fair or priority");
  auto* mu = app.add_subcommand("memutil", "Lanes vs static partitioning memory utilization");
  int memutil_seeds = 100;
  mu->add_option("--seeds", memutil_seeds, "Random arrival orders");
  CLI11_PARSE(app, argc, argv);
  if (*asg) return bench_assign(assign_sessions, rounds);
  if (*dec) return bench_decide(decide_sessions, decide_rounds, decide_policy);
  if (*mu) return bench_memutil(memutil_seeds);

  std::unique_ptr<Daemon> d;
  pid_t pid = -1;
  if (mount.empty()) {
    d = std::make_unique<Daemon>(
        salusd, std::vector<std::string>{"--sim-memory", "4G", "--quota-sessions", "100000"});
    mount = d->mnt;
    pid = d->pid;
  }
  if (*ctl) return bench_ctl(mount, n);
  if (*disp) return bench_dispatch(mount, iters, sessions, body);
  if (*sc) return bench_scale(mount, pid, scale);
  return 0;
}
