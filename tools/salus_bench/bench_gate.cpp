// salus-bench gate: the round trip of an attached session's gate through a
// real salusd (sim backend). This process is the program: it attaches a sealed
// memfd gate and an eventfd bell to a clone session, then at every boundary
// reports the finished iteration, asks for the next, rings and waits on the
// futex until salusd grants it. Baselines in the same run: the same two
// wake-ups between two threads of this process, with no salusd in between.
#include <linux/futex.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "tools/salus_bench/bench_common.hpp"
#include "tools/salus_bench/gate_program.hpp"

namespace salus::bench {
namespace {

const std::vector<std::string> kSimArgs = {"--backend", "sim", "--log-level", "warn"};

template <class T>
std::atomic_ref<T> at(T& f) {
  return std::atomic_ref<T>(f);
}

void futex_wait(std::uint32_t* word, std::uint32_t seen) {
  ::syscall(SYS_futex, word, FUTEX_WAIT, seen, nullptr, nullptr, 0);
}
void futex_wake(std::uint32_t* word) {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
void ring(int fd) {
  const std::uint64_t one = 1;
  if (::write(fd, &one, sizeof one) != sizeof one) die("eventfd write");
}

// At each boundary the program reports an iteration done and waits for the
// next grant (GateProgram::boundaries): lag 1 is the pipelined case, lag 0 the
// drained one.
std::vector<double> gate_through_salusd(const std::string& mnt, int n, std::uint64_t lag) {
  GateProgram program;
  Clone c(mnt);
  char buf[256];
  write_all(c.fd, "need persistent=0 ephemeral=0\n");
  while (::read(c.fd, buf, sizeof buf) > 0) {
  }
  write_all(c.fd, program.attachment());
  while (::read(c.fd, buf, sizeof buf) > 0) {
  }
  program.start();
  const auto count = static_cast<std::size_t>(n);
  return program.boundaries(lag, count / 10, count, Clock::time_point::max());
}

// Baseline 1: futex ping-pong between two threads (FUTEX_WAKE/WAIT both ways).
std::vector<double> futex_pingpong(int n) {
  alignas(64) std::uint32_t ask = 0, answer = 0;
  std::atomic<bool> stop{false};
  std::thread peer([&] {
    std::uint32_t seen = 0;
    while (!stop.load()) {
      while (at(ask).load() == seen && !stop.load()) futex_wait(&ask, seen);
      seen = at(ask).load();
      at(answer).store(seen);
      futex_wake(&answer);
    }
  });
  std::vector<double> rt;
  for (std::uint32_t i = 1; i <= static_cast<std::uint32_t>(n + n / 10); ++i) {
    const auto t0 = Clock::now();
    at(ask).store(i);
    futex_wake(&ask);
    while (at(answer).load() != i) futex_wait(&answer, i - 1);
    if (i > static_cast<std::uint32_t>(n / 10)) rt.push_back(us_since(t0));
  }
  stop = true;
  at(ask).store(0);
  futex_wake(&ask);
  peer.join();
  return rt;
}

// Baseline 2: the gate's own mechanism without salusd: eventfd to a thread
// waiting in epoll, futex back.
std::vector<double> eventfd_futex_pingpong(int n) {
  const int bell = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, bell, &ev);
  alignas(64) std::uint32_t word = 0;
  std::uint64_t granted = 0;
  std::atomic<bool> stop{false};
  std::thread peer([&] {
    epoll_event e;
    while (!stop.load()) {
      if (::epoll_wait(ep, &e, 1, -1) <= 0) continue;
      std::uint64_t v;
      while (::read(bell, &v, sizeof v) > 0) {
      }
      at(granted).fetch_add(1);
      at(word).fetch_add(1);
      futex_wake(&word);
    }
  });
  std::vector<double> rt;
  for (std::uint64_t k = 1; k <= static_cast<std::uint64_t>(n + n / 10); ++k) {
    const auto t0 = Clock::now();
    ring(bell);
    for (;;) {
      const std::uint32_t w = at(word).load();
      if (at(granted).load() >= k) break;
      futex_wait(&word, w);
    }
    if (k > static_cast<std::uint64_t>(n / 10)) rt.push_back(us_since(t0));
  }
  stop = true;
  ring(bell);
  peer.join();
  ::close(ep);
  ::close(bell);
  return rt;
}

int bench_gate(const std::string& mnt, int n) {
  const auto gate = gate_through_salusd(mnt, n, 1);
  const auto drained = gate_through_salusd(mnt, n, 0);
  const auto futex = futex_pingpong(n);
  const auto evfd = eventfd_futex_pingpong(n);
  auto line = [](const char* what, const std::vector<double>& v) {
    fmt::print("  {:32} p50 {:8.1f} us  p99 {:8.1f} us\n", what, percentile(v, 0.5),
               percentile(v, 0.99));
  };
  fmt::print("gate-roundtrip n={}\n", n);
  line("gate through salusd, pipelined", gate);
  line("gate through salusd, drained", drained);
  line("futex ping-pong (2 threads)", futex);
  line("eventfd -> epoll, futex back", evfd);
  fmt::print("  ratio to futex ping-pong     p50 {:8.2f}     p99 {:8.2f}\n",
             percentile(gate, 0.5) / percentile(futex, 0.5),
             percentile(gate, 0.99) / percentile(futex, 0.99));
  fmt::print(
      "  ratio to eventfd+futex       p50 {:8.2f}     p99 {:8.2f}   (target: gate p50 <= "
      "10 us)\n",
      percentile(gate, 0.5) / percentile(evfd, 0.5),
      percentile(gate, 0.99) / percentile(evfd, 0.99));
  return 0;
}

}  // namespace

void add_gate_benches(CLI::App& app, Registry& r) {
  auto* gate = app.add_subcommand("gate", "attached-session gate round trip through salusd");
  auto n = std::make_shared<int>(20000);
  gate->add_option("-n", *n, "Boundaries");
  r.add(gate, [n](Target& t) { return bench_gate(t.start(kSimArgs), *n); });
}

}  // namespace salus::bench
