// salus-bench subcommands that time salusd itself through /salus on the sim
// backend: the ctl round trip, the dispatch rate, behaviour with many sessions,
// and how long an allocation waits for compaction beside a busy session.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "tools/salus_bench/bench_common.hpp"

namespace salus::bench {
namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kSimArgs = {"--backend",    "sim", "--log-level",      "warn",
                                           "--sim-memory", "4G",  "--quota-sessions", "100000"};

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

// One round of `compaction`: an owner whose 6M buffers leave no 7M hole on a
// 64M GPU, and a second session's 7M alloc that needs them moved. With
// `busy`, the owner runs `iters` 1 ms iterations (pipelined) meanwhile.
struct CompactionRound {
  double alloc_ms = 0;     // the alloc write, until it returned
  long owner_during = 0;   // the owner's iterations done when it returned
  double owner_run_s = 0;  // the owner's whole run (busy only)
};
CompactionRound compaction_round(const std::string& mnt, bool busy, long iters) {
  Clone owner(mnt);
  std::string setup = "need persistent=48M ephemeral=8M gpu=0\n";
  for (int i = 1; i <= 9; ++i) setup += fmt::format("alloc a{} 6M\n", i);
  owner.run_and_wait(setup + "free a2\nfree a4\nfree a6\nfree a8\n");
  const auto t_run = Clock::now();
  if (busy) {
    write_all(owner.fd, fmt::format("begin\nspin 1000\nend x{}\n", iters));
    ::usleep(20000);  // its lane is busy, the next iteration queued behind
  }
  Clone other(mnt);
  write_all(other.fd, "need persistent=7M ephemeral=8M gpu=0\n");
  CompactionRound r;
  const auto moved = [&] {
    return std::stoll(field(read_file(mnt + "/gpus/0/memory"), "persistent_bytes_moved"));
  };
  const long long moved_before = moved();
  const auto t0 = Clock::now();
  write_all(other.fd, "alloc big 7M\n");  // returns once the buffers in the way moved
  r.alloc_ms = us_since(t0) / 1e3;
  r.owner_during = std::stol(field(owner.status(), "iterations_done"));
  if (moved() == moved_before)
    die("the alloc did not need compaction: the bench no longer measures it");
  if (busy) {
    wait_done(mnt, owner.id);
    r.owner_run_s = us_since(t_run) / 1e6;
  }
  return r;
}

int bench_compaction(const std::string& mnt, int rounds, long iters) {
  std::vector<double> idle_ms, busy_ms, run_s;
  long during = 0;
  for (int i = 0; i < rounds; ++i) {
    idle_ms.push_back(compaction_round(mnt, false, iters).alloc_ms);
    const CompactionRound b = compaction_round(mnt, true, iters);
    busy_ms.push_back(b.alloc_ms);
    run_s.push_back(b.owner_run_s);
    during = std::max(during, b.owner_during);
  }
  fmt::print("compaction rounds={} owner iterations={} x 1 ms\n", rounds, iters);
  fmt::print("  alloc beside an idle owner      p50 {:.2f} ms  max {:.2f} ms\n",
             percentile(idle_ms, 0.5), percentile(idle_ms, 1.0));
  fmt::print(
      "  alloc beside a pipelining owner p50 {:.2f} ms  max {:.2f} ms  (owner's iterations by "
      "then: at most {}; the owner's run alone would take {:.0f} ms)\n",
      percentile(busy_ms, 0.5), percentile(busy_ms, 1.0), during, static_cast<double>(iters));
  fmt::print("  owner's run with the compaction p50 {:.3f} s for {:.3f} s of spins\n",
             percentile(run_s, 0.5), static_cast<double>(iters) / 1e3);
  return 0;
}

}  // namespace

void add_broker_benches(CLI::App& app, Registry& r) {
  auto* ctl = app.add_subcommand("ctl", "ctl round trip against a pread of version");
  auto n = std::make_shared<int>(20000);
  ctl->add_option("-n", *n, "Round trips");
  r.add(ctl, [n](Target& t) { return bench_ctl(t.start(kSimArgs), *n); });

  auto* disp = app.add_subcommand("dispatch", "Broker-side dispatch rate of empty iterations");
  auto iters = std::make_shared<long>(100000);
  auto sessions = std::make_shared<int>(1);
  auto body = std::make_shared<std::string>();
  disp->add_option("--iterations", *iters, "Total iterations");
  disp->add_option("--sessions", *sessions, "Sessions sharing them");
  disp->add_option("--body", *body, "Iteration body, e.g. 'spin 0' (default: empty)");
  r.add(disp,
        [=](Target& t) { return bench_dispatch(t.start(kSimArgs), *iters, *sessions, *body); });

  auto* cp = app.add_subcommand("compaction",
                                "How long an alloc waits for compaction beside a pipelining owner");
  auto rounds = std::make_shared<int>(5);
  auto owner_iters = std::make_shared<long>(1000);
  cp->add_option("--rounds", *rounds, "Rounds (each: the owner idle, then busy)");
  cp->add_option("--iterations", *owner_iters, "The busy owner's 1 ms iterations");
  r.add(cp, [=](Target& t) {
    return bench_compaction(
        t.start({"--backend", "sim", "--log-level", "warn", "--sim-memory", "64M"}), *rounds,
        *owner_iters);
  });

  auto* sc = app.add_subcommand("scale", "ls and stats latency and RSS with many idle sessions");
  auto scale = std::make_shared<int>(1000);
  sc->add_option("--sessions", *scale, "Idle sessions");
  r.add(sc, [scale](Target& t) {
    const std::string& mnt = t.start(kSimArgs);
    return bench_scale(mnt, t.pid(), *scale);
  });
}

}  // namespace salus::bench
