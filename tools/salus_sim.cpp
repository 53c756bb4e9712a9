// salus-sim: replays a job trace through Salus's real scheduler, arena and contention
// model in virtual time and prints makespan, queueing and completion-time statistics.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "arena/size_units.hpp"
#include "sched/simulation.hpp"
#include "sched/trace.hpp"

namespace {

using salus::sched::PolicyKind;
namespace sc = salus::sched;

// Exit codes: 2 for anything wrong with the input (trace, flags), 1 for I/O failures,
// 3 for an internal error (a bug, or out of memory): never an abort.
constexpr int kInputError = 2;
constexpr int kIoError = 1;
constexpr int kInternalError = 3;

struct Options {
  std::string trace;
  std::string policy = "all";
  std::uint32_t gpus = 1;
  std::string gpu_memory = "16G";
  std::string placement = "magm";
  bool risk_filter = false;
  double risk_max_sm = 0.80;
  double risk_window_s = 30;
  std::string lanes = "auto";
  std::string jobs_out;
  double share_window_s = 0;
  double share_step_s = 0;
  std::string share_out;
  double iteration_overhead_us = 0;
  double oversubscribe = 1.0;
  double swap_gbps = 12.0;
  std::string fair_share = "user";
  bool no_coalesce = false;
  bool stats = false;
  bool progress = false;
};

std::string duration(double s) {
  if (s < 120) return fmt::format("{:.1f} s", s);
  if (s < 7200) return fmt::format("{:.1f} min", s / 60);
  if (s < 2 * 86400) return fmt::format("{:.1f} h", s / 3600);
  return fmt::format("{:.1f} d", s / 86400);
}

// The progress line on stderr: on a terminal one line rewritten in place, otherwise one
// line per interval. The time left extrapolates the wall time per unit of work done.
class ProgressLine {
 public:
  ProgressLine(std::string policy, bool tty)
      : policy_(std::move(policy)), tty_(tty), start_(std::chrono::steady_clock::now()) {}
  void update(const salus::sched::SimProgress& p, bool final = false) {
    const auto now = std::chrono::steady_clock::now();
    if (!final && printed_ && now - last_ < std::chrono::milliseconds(tty_ ? 200 : 1000)) return;
    last_ = now;
    printed_ = true;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double f = p.work_total_ns > 0 ? std::min(1.0, p.work_done_ns / p.work_total_ns) : 0.0;
    std::string left = "time left unknown";
    if (final) {
      left = "done";
    } else if (f > 0) {
      left = fmt::format("about {} left", duration(elapsed * (1 - f) / f));
    }
    const std::string line = fmt::format(
        "salus-sim: {}: {:.1f}% of the work, {}/{} jobs done, virtual time {}, {} elapsed, {}",
        policy_, 100 * f, p.jobs_done, p.jobs_total, duration(static_cast<double>(p.now) / 1e9),
        duration(elapsed), left);
    if (tty_) {
      std::fprintf(stderr, "\r%s\x1b[K%s", line.c_str(), final ? "\n" : "");
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }

 private:
  std::string policy_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_;
  bool printed_ = false;
};

std::string seconds(salus::arena::TimeNs ns) {
  return fmt::format("{:.6f}", static_cast<double>(ns) / 1e9);
}

// The paper's Table 2 order.
const std::vector<PolicyKind> kAll{PolicyKind::fifo, PolicyKind::srtf, PolicyKind::pack,
                                   PolicyKind::fair};

}  // namespace

namespace {

// Every command-line option, into `o`.
void add_flags(CLI::App& app, Options& o) {
  app.add_option("--trace", o.trace, "trace CSV file")->required();
  app.add_option("--policy", o.policy,
                 "fifo, pack, srtf, fair, priority, or all (fifo srtf pack fair)")
      ->capture_default_str();
  app.add_option("--gpus", o.gpus, "number of GPUs")
      ->capture_default_str()
      ->check(CLI::Range(1u, 4096u));
  app.add_option("--gpu-memory", o.gpu_memory, "memory of each GPU (K/M/G suffixes)")
      ->capture_default_str();
  app.add_option(
         "--placement", o.placement,
         "GPU placement: magm, lug, rr, or exclusive (one job per GPU; implied by exclusive lanes)")
      ->capture_default_str();
  app.add_flag("--risk-filter", o.risk_filter,
               "CARMA's risk filter for magm and lug: skip GPUs whose compute activity over "
               "the window scores at or above --risk-max-sm");
  app.add_option("--risk-max-sm", o.risk_max_sm, "the risk filter's compute threshold (0 to 1)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--risk-window-s", o.risk_window_s,
                 "the risk filter's window in virtual seconds (1 to 3600)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option(
         "--lanes", o.lanes,
         "lane model: auto (fifo: exclusive, pack: algorithm1, srtf/fair/priority: shared), "
         "exclusive (one job per GPU), algorithm1 (salusd), shared (one lane per GPU)")
      ->capture_default_str();
  app.add_option(
      "--jobs-out", o.jobs_out,
      "write per-job results: job,policy,arrival_s,start_s,finish_s,jct_s,queue_s,gpu,lane,"
      "admit_s,user");
  app.add_option("--share-window", o.share_window_s,
                 "measure each job's share of GPU work in sliding windows of this many seconds, "
                 "between the last arrival and the first finish")
      ->check(CLI::PositiveNumber);
  app.add_option("--share-step", o.share_step_s, "step between share windows (default: window/10)")
      ->check(CLI::PositiveNumber);
  app.add_option("--share-out", o.share_out,
                 "write the share windows: policy,window_start_s,window_end_s,job,work_s,share");
  app.add_option("--iteration-overhead-us", o.iteration_overhead_us,
                 "host-side cost of each iteration boundary (completion, decision, dispatch), "
                 "added to every iteration's time; 0 models an ideal broker. Measure it with "
                 "tools/replay-bench.sh to predict a real salusd")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option(
         "--oversubscribe", o.oversubscribe,
         "admit jobs whose memory adds up to RATIO x each GPU's (1 to 16); idle jobs are "
         "swapped out as salusd does, each swap taking bytes / --swap-gbps on the GPU's swap "
         "stream beside the other lanes' kernels")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 16.0));
  app.add_option("--swap-gbps", o.swap_gbps,
                 "host<->GPU swap bandwidth in GB/s for --oversubscribe (measure it on salusd: "
                 "policy's swap_bandwidth_gbps)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 10000.0));
  app.add_option("--fair-share", o.fair_share,
                 "how fair shares the GPU, as salusd's flag: user (equally per user of the "
                 "trace's user column in a lane), user-across-lanes (and across lanes), or "
                 "session (equally per job)")
      ->capture_default_str()
      ->check(CLI::IsMember({"user", "user-across-lanes", "session"}));
  app.add_flag("--no-coalesce", o.no_coalesce,
               "simulate every iteration as its own event (slower; same decisions)");
  app.add_flag("--stats", o.stats, "print event counts and wall time per policy to stderr");
  app.add_flag("--progress", o.progress,
               "print a progress line with an estimate of the time left to stderr (the default "
               "when stderr is a terminal)");
}

int usage(const std::string& why) {
  std::fprintf(stderr, "salus-sim: %s\n", why.c_str());
  return kInputError;
}

// The policies to run and the configuration they share, from the options: 0, or
// the exit status after a message.
int make_config(const Options& o, std::vector<PolicyKind>& policies, sc::SimConfig& base) {
  if (o.policy == "all") {
    policies = kAll;
  } else if (auto p = sc::policy_from_string(o.policy)) {
    policies = {*p};
  } else {
    return usage(
        fmt::format("unknown policy '{}' (fifo, pack, srtf, fair, priority, all)", o.policy));
  }
  base.gpus = o.gpus;
  const auto memory = salus::arena::parse_size(o.gpu_memory);
  if (!memory || *memory < salus::arena::kAlignment)
    return usage(fmt::format("bad --gpu-memory '{}'", o.gpu_memory));
  base.gpu_memory = *memory;
  const auto placement = sc::placement_from_string(o.placement);
  if (!placement)
    return usage(fmt::format("unknown placement '{}' (magm, lug, rr, exclusive)", o.placement));
  base.placement = *placement;
  base.risk.enabled = o.risk_filter;
  base.risk.max_sm = o.risk_max_sm;
  base.risk.window_s = o.risk_window_s;
  const auto lanes = sc::lane_model_from_string(o.lanes);
  if (!lanes)
    return usage(
        fmt::format("unknown lane model '{}' (auto, exclusive, algorithm1, shared)", o.lanes));
  base.lanes = *lanes;
  base.coalesce = !o.no_coalesce;
  base.iteration_overhead_ns = std::llround(o.iteration_overhead_us * 1e3);
  base.oversubscribe = o.oversubscribe;
  base.swap_gbps = o.swap_gbps;
  base.fair_share = *sc::fair_share_from_string(o.fair_share);
  if (!o.share_out.empty() && o.share_window_s <= 0)
    return usage("--share-out needs --share-window");
  base.track_work = o.share_window_s > 0;

  return 0;
}

// Opens --jobs-out and --share-out with their headers: 0, or the exit status.
int open_outputs(const Options& o, std::ofstream& jobs_out, std::ofstream& share_out) {
  if (!o.jobs_out.empty()) {
    jobs_out.open(o.jobs_out);
    if (!jobs_out) {
      std::fprintf(stderr, "salus-sim: cannot write '%s'\n", o.jobs_out.c_str());
      return kIoError;
    }
    jobs_out << "job,policy,arrival_s,start_s,finish_s,jct_s,queue_s,gpu,lane,admit_s,user\n";
  }
  if (!o.share_out.empty()) {
    share_out.open(o.share_out);
    if (!share_out) {
      std::fprintf(stderr, "salus-sim: cannot write '%s'\n", o.share_out.c_str());
      return kIoError;
    }
    share_out << "policy,window_start_s,window_end_s,job,work_s,share\n";
  }

  return 0;
}

void print_stats(PolicyKind policy, const sc::SimResult& res, double wall) {
  const sc::SimCounters& c = res.counters;
  std::fprintf(
      stderr,
      "salus-sim: %s: lanes %s, placement %s, %zu jobs, %llu iterations, %llu kernels, "
      "%llu events, %llu decisions, %llu preemptions, max %llu lanes, %llu risky skips, %.3f s "
      "wall\n",
      std::string(sc::to_string(policy)).c_str(), std::string(sc::to_string(res.lanes)).c_str(),
      std::string(sc::to_string(res.config.placement)).c_str(), res.jobs.size(),
      static_cast<unsigned long long>(c.iterations), static_cast<unsigned long long>(c.kernels),
      static_cast<unsigned long long>(c.events), static_cast<unsigned long long>(c.decisions),
      static_cast<unsigned long long>(c.preemptions), static_cast<unsigned long long>(c.max_lanes),
      static_cast<unsigned long long>(c.risky_skips), wall);
  if (res.config.oversubscribe > 1.0)
    std::fprintf(stderr, "salus-sim: %s: %llu swaps out, %llu swaps in, %.3f s swapping\n",
                 std::string(sc::to_string(policy)).c_str(),
                 static_cast<unsigned long long>(c.swaps_out),
                 static_cast<unsigned long long>(c.swaps_in), static_cast<double>(c.swap_ns) / 1e9);
}

// --share-window: each job's share of GPU work per window, summarised on
// stderr and written to --share-out.
void report_shares(const Options& o, PolicyKind policy, const std::vector<sc::TraceJob>& trace,
                   const sc::SimResult& res, std::ofstream& share_out) {
  const auto window = static_cast<salus::arena::TimeNs>(o.share_window_s * 1e9);
  const auto step = static_cast<salus::arena::TimeNs>(
      (o.share_step_s > 0 ? o.share_step_s : o.share_window_s / 10) * 1e9);
  const std::vector<sc::ShareWindow> windows =
      sc::share_windows(res, window, std::max<salus::arena::TimeNs>(step, 1));
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const sc::ShareWindow& w : windows) {
    for (std::size_t i = 0; i < w.share.size(); ++i) {
      lo = std::min(lo, w.share[i]);
      hi = std::max(hi, w.share[i]);
      if (share_out.is_open())
        share_out << fmt::format("{},{},{},{},{:.6f},{:.6f}\n", sc::to_string(policy),
                                 seconds(w.begin), seconds(w.end), trace[i].name, w.work[i] / 1e9,
                                 w.share[i]);
    }
  }
  if (windows.empty())
    std::fprintf(
        stderr,
        "salus-sim: %s: no %.3f s window fits between the last arrival and the first finish\n",
        std::string(sc::to_string(policy)).c_str(), o.share_window_s);
  else
    std::fprintf(
        stderr,
        "salus-sim: %s: %zu windows of %.3f s from %.3f s: job shares between %.4f and %.4f "
        "(equal share %.4f)\n",
        std::string(sc::to_string(policy)).c_str(), windows.size(), o.share_window_s,
        static_cast<double>(windows.front().begin) / 1e9, lo, hi,
        1.0 / static_cast<double>(trace.size()));
}

}  // namespace

static int run(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Replays a job trace (CSV: job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,"
      "util[,priority]) through Salus's scheduler in virtual time and prints, per policy: "
      "policy makespan_s avg_queue_s avg_jct_s p95_jct_s",
      "salus-sim"};
  add_flags(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kInputError;
  }

  std::vector<PolicyKind> policies;
  sc::SimConfig base;
  if (const int rc = make_config(o, policies, base)) return rc;

  std::vector<sc::TraceJob> trace;
  {
    std::ifstream in(o.trace);
    if (!in) return usage(fmt::format("cannot open trace '{}': {}", o.trace, std::strerror(errno)));
    try {
      trace = sc::parse_trace(in);
    } catch (const sc::TraceError& e) {
      return usage(fmt::format("{}:{}", o.trace, e.what()));
    }
  }

  std::ofstream jobs_out, share_out;
  if (const int rc = open_outputs(o, jobs_out, share_out)) return rc;

  std::cout << "policy makespan_s avg_queue_s avg_jct_s p95_jct_s\n";
  for (PolicyKind policy : policies) {
    sc::SimConfig cfg = base;
    cfg.policy = policy;
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<ProgressLine> line;
    if (o.progress || isatty(STDERR_FILENO)) {
      line.emplace(std::string(sc::to_string(policy)), isatty(STDERR_FILENO) != 0);
      cfg.progress = [&line](const sc::SimProgress& p) { line->update(p); };
    }
    sc::SimResult res;
    try {
      res = sc::simulate(trace, cfg);
    } catch (const sc::SimError& e) {
      if (line && isatty(STDERR_FILENO)) std::fputc('\n', stderr);
      return usage(fmt::format("{}:{}", o.trace, e.what()));
    }
    if (line) {
      sc::SimProgress p;
      p.work_done_ns = p.work_total_ns = 1;
      p.jobs_done = p.jobs_total = res.jobs.size();
      for (const sc::JobResult& j : res.jobs) p.now = std::max(p.now, j.finish);
      line->update(p, true);
    }
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const sc::Summary& s = res.summary;
    std::cout << fmt::format("{} {:.3f} {:.3f} {:.3f} {:.3f}\n", sc::to_string(policy),
                             s.makespan_s, s.avg_queue_s, s.avg_jct_s, s.p95_jct_s)
              << std::flush;
    if (o.stats) print_stats(policy, res, wall);
    if (jobs_out.is_open()) {
      for (const sc::JobResult& j : res.jobs)
        jobs_out << fmt::format("{},{},{},{},{},{},{},{},{},{},{}\n", trace[j.index].name,
                                sc::to_string(policy), seconds(j.arrival), seconds(j.start),
                                seconds(j.finish), seconds(j.jct()), seconds(j.queue()), j.gpu,
                                j.lane, seconds(j.admit), trace[j.index].user);
    }
    if (base.track_work) report_shares(o, policy, trace, res, share_out);
  }
  if (jobs_out.is_open() && !jobs_out.flush()) {
    std::fprintf(stderr, "salus-sim: writing '%s' failed\n", o.jobs_out.c_str());
    return kIoError;
  }
  if (share_out.is_open() && !share_out.flush()) {
    std::fprintf(stderr, "salus-sim: writing '%s' failed\n", o.share_out.c_str());
    return kIoError;
  }
  return 0;
}

int main(int argc, char** argv) {
  // Whatever goes wrong inside, the user gets a message and an exit status, not an abort.
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "salus-sim: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "salus-sim: internal error (please report it with the trace): %s\n",
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "salus-sim: internal error (please report it with the trace)\n");
  }
  return kInternalError;
}
