// salus-bench subcommands that time salusd itself through /salus on the sim
// backend: the ctl round trip, the dispatch rate and behaviour with many sessions.
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

  auto* sc = app.add_subcommand("scale", "ls and stats latency and RSS with many idle sessions");
  auto scale = std::make_shared<int>(1000);
  sc->add_option("--sessions", *scale, "Idle sessions");
  r.add(sc, [scale](Target& t) {
    const std::string& mnt = t.start(kSimArgs);
    return bench_scale(mnt, t.pid(), *scale);
  });
}

}  // namespace salus::bench
