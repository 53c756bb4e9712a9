// salus-bench census: what the once-a-second census of GPU processes
// (vgpu/broker/broker_processes.cpp) costs the attached sessions' gate. A broker
// runs in this process on a sim GPU whose NVML stand-in lists N real processes,
// each at the bottom of a chain of D parents, as containers and launchers make
// them; the census reads every listed process's parents from /proc. This process
// is an attached program and passes boundaries for a few seconds, as
// `salus-bench gate` does; baseline in the same run: the same broker with no
// process listed but its own.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <future>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "tools/salus_bench/bench_common.hpp"
#include "tools/salus_bench/gate_program.hpp"
#include "vgpu/attach/attach_gate.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/gpu_telemetry.hpp"
#include "vgpu/sim/sim_device.hpp"

namespace salus::bench {
namespace {

using vgpu::Broker;

// N chains of D processes under a process group of their own, killed with it.
class ProcessChains {
 public:
  ProcessChains(int chains, int depth) {
    for (int c = 0; c < chains; ++c) {
      int ends[2];
      if (::pipe(ends) != 0) die("pipe");
      const pid_t top = ::fork();
      if (top < 0) die("fork");
      if (top == 0) chain(depth, ends[1]);
      ::close(ends[1]);
      pid_t leaf = 0;
      if (::read(ends[0], &leaf, sizeof leaf) != sizeof leaf) die("chain: no leaf");
      ::close(ends[0]);
      tops_.push_back(top);
      leaves_.push_back(leaf);
    }
  }
  ~ProcessChains() {
    for (pid_t t : tops_) ::kill(-t, SIGKILL);
    for (pid_t t : tops_) ::waitpid(t, nullptr, 0);
  }
  const std::vector<pid_t>& leaves() const { return leaves_; }

 private:
  // In the child: a process group of its own, then `depth` - 1 more levels; the
  // leaf reports its pid. Each level dies with its parent.
  [[noreturn]] static void chain(int depth, int report) {
    ::setpgid(0, 0);
    for (int level = 1; level < depth; ++level) {
      const pid_t child = ::fork();
      if (child != 0) {
        ::pause();
        ::_exit(0);
      }
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    }
    const pid_t me = ::getpid();
    if (::write(report, &me, sizeof me) != sizeof me) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  std::vector<pid_t> tops_, leaves_;
};

// NVML as the census reads it: this process and the listed ones, 64 MiB each.
class ListedProcesses final : public vgpu::GpuTelemetry {
 public:
  explicit ListedProcesses(std::vector<pid_t> pids) : pids_(std::move(pids)) {}
  vgpu::GpuTelemetrySnapshot snapshot(std::size_t) const override {
    vgpu::GpuTelemetrySnapshot t;
    t.available = true;
    t.readings.processes.emplace();
    t.readings.processes->push_back({::getpid(), std::uint64_t{64} << 20});
    for (pid_t p : pids_) t.readings.processes->push_back({p, std::uint64_t{64} << 20});
    return t;
  }

 private:
  std::vector<pid_t> pids_;
};

int submit(Broker& b, vgpu::SessionId id, vgpu::Command cmd) {
  std::promise<int> done;
  std::vector<vgpu::CommandLine> lines;
  lines.push_back({1, std::move(cmd)});
  b.submit(id, vgpu::Caller{0, 0, ::getpid(), true}, 64, std::move(lines), std::nullopt,
           [&done](int err, std::string) { done.set_value(err); });
  return done.get_future().get();
}

// Boundaries for `seconds`: long enough for that many censuses (one a second).
std::vector<double> gate_beside(std::vector<pid_t> listed, int seconds) {
  std::vector<std::unique_ptr<vgpu::Device>> devs;
  devs.push_back(std::make_unique<vgpu::SimDevice>(0, std::uint64_t{1} << 30));
  Broker b(std::move(devs), vgpu::BrokerConfig{},
           std::make_unique<ListedProcesses>(std::move(listed)));
  const auto id = static_cast<vgpu::SessionId>(b.create_session({0, 0, ::getpid(), true}, ""));
  GateProgram program;
  vgpu::NeedCmd need;
  need.persistent = std::uint64_t{1} << 20;
  if (submit(b, id, need) != 0) die("census bench: need");
  if (submit(b, id, vgpu::AttachCmd{program.memfd(), program.bell(), -1}) != 0)
    die("census bench: attach");
  program.start();
  return program.boundaries(1, 1000, SIZE_MAX, Clock::now() + std::chrono::seconds(seconds));
}

// What the census reads, timed alone: every listed process's parents.
double ancestry_ms(const std::vector<pid_t>& pids) {
  const auto t0 = Clock::now();
  std::size_t levels = 0;
  for (pid_t p : pids) levels += vgpu::ancestors_of(p).size();
  const double ms = us_since(t0) / 1000.0;
  if (levels == 0 && !pids.empty()) die("census bench: no parents read");
  return ms;
}

int bench_census(int chains, int depth, int seconds) {
  spdlog::set_level(spdlog::level::err);  // the census names every listed process once
  ProcessChains procs(chains, depth);
  std::vector<double> reads;
  for (int i = 0; i < 20; ++i) reads.push_back(ancestry_ms(procs.leaves()));
  const auto with = gate_beside(procs.leaves(), seconds);
  const auto without = gate_beside({}, seconds);
  auto line = [](const char* what, const std::vector<double>& v) {
    fmt::print("  {:34} n {:7}  p50 {:7.1f} us  p99 {:7.1f} us  p99.9 {:8.1f} us  max {:8.1f} us\n",
               what, v.size(), percentile(v, 0.5), percentile(v, 0.99), percentile(v, 0.999),
               percentile(v, 1.0));
  };
  fmt::print("census processes={} depth={} seconds={}\n", chains, depth, seconds);
  fmt::print("  reading their parents from /proc   p50 {:.2f} ms  max {:.2f} ms (20 censuses)\n",
             percentile(reads, 0.5), percentile(reads, 1.0));
  line("gate, census of those processes", with);
  line("gate, census of this process only", without);
  fmt::print("  ratio max / baseline max  {:.2f}   p99.9 / baseline p99.9  {:.2f}\n",
             percentile(with, 1.0) / percentile(without, 1.0),
             percentile(with, 0.999) / percentile(without, 0.999));
  return 0;
}

}  // namespace

void add_census_benches(CLI::App& app, Registry& r) {
  auto* census = app.add_subcommand(
      "census", "what the census of GPU processes costs the attached sessions' gate");
  auto chains = std::make_shared<int>(64);
  auto depth = std::make_shared<int>(6);
  auto seconds = std::make_shared<int>(5);
  census->add_option("--processes", *chains, "Processes NVML lists")->check(CLI::Range(1, 4096));
  census->add_option("--depth", *depth, "Parents of each, own chain")->check(CLI::Range(1, 32));
  census->add_option("--seconds", *seconds, "Gate boundaries for this long, each way")
      ->check(CLI::Range(1, 600));
  r.add(census, [=](Target&) { return bench_census(*chains, *depth, *seconds); });
}

}  // namespace salus::bench
