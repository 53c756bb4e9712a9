// salus-sim's engine: replays a job trace in virtual time through the real GpuScheduler
// and ContentionModel, driven as salusd's broker drives them. Pure and deterministic.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "sched/gpu_scheduler.hpp"
#include "sched/placement.hpp"
#include "sched/policy.hpp"
#include "sched/trace.hpp"

namespace salus::sched {

// How the jobs of one GPU are laid out in lanes (see docs/simulation.md).
enum class LaneModel : std::uint8_t {
  automatic,   // per policy: fifo exclusive, pack algorithm1, srtf/fair/priority shared
  exclusive,   // one job per GPU at a time (TensorFlow without Salus); implies exclusive placement
  algorithm1,  // Salus Algorithm 1 as the arena implements it (salusd's behaviour)
  shared,      // every admitted job of a GPU joins one lane and time-shares it
};
std::string_view to_string(LaneModel m);
std::optional<LaneModel> lane_model_from_string(std::string_view name);

// Where a simulation stands, for a progress line: what is done of the whole trace's
// work (alone-equivalent ns, credited as runs end) and of its jobs.
struct SimProgress {
  arena::TimeNs now = 0;  // virtual time
  double work_done_ns = 0;
  double work_total_ns = 0;
  std::size_t jobs_done = 0;
  std::size_t jobs_total = 0;
  std::uint64_t events = 0;
};

struct SimConfig {
  PolicyKind policy = PolicyKind::fifo;
  std::uint32_t gpus = 1;
  arena::Bytes gpu_memory = arena::Bytes{16} << 30;
  Placement placement = Placement::magm;
  // CARMA's interference filter for magm and lug; the compute activity is the contention
  // model's summed util (capped at 1), sampled once a virtual second over the window.
  // The model has no memory-bandwidth figure, so max_mem does not apply here.
  RiskFilter risk;
  LaneModel lanes = LaneModel::automatic;
  // Runs of iterations whose scheduling cannot change before the next event are simulated
  // as one kernel and replayed into the scheduler, boundary by boundary, at their end.
  // Off: one kernel per iteration. Both make the same decisions; the per-iteration mode
  // rounds every kernel up to a nanosecond, so times under contention drift apart slightly.
  bool coalesce = true;
  // Records each job's cumulative GPU work over time, for share_windows().
  bool track_work = false;
  // A real broker's cost per iteration boundary (completion, decision, dispatch), during
  // which the lane is idle. Modeled as part of each iteration's lane time; the time the
  // scheduler is told (SRTF's mean, FAIR's charge) leaves it out, as salusd measures
  // device time only. 0: an ideal broker (the paper's tables).
  arena::TimeNs iteration_overhead_ns = 0;
  // Oversubscription (design.md): admit up to this many times each GPU's memory; the
  // residency planner salusd uses swaps sessions. A swap takes bytes / swap_gbps on the
  // GPU's swap stream, one after another, beside the other lanes' kernels (a copy engine
  // beside the SMs, as salusd copies); its session waits for it. Runs are not
  // coalesced then.
  double oversubscribe = 1.0;
  double swap_gbps = 12.0;
  // How FAIR divides a lane, as salusd --fair-share: per user (the trace's user column;
  // the default, like salusd's) or per job. A trace without users is one user's, where
  // the two are the same. Per user with two users or more, runs are not coalesced.
  FairShare fair_share = FairShare::owner;
  // Called every `progress_every` events (and once at the end) when set. The engine
  // keeps no clock; the caller decides what to print and when.
  std::function<void(const SimProgress&)> progress;
  std::uint64_t progress_every = 1024;
};

struct JobResult {
  std::size_t index = 0;  // position in the trace
  arena::TimeNs arrival = 0;
  arena::TimeNs admit = 0;   // the arena gave it a lane
  arena::TimeNs start = 0;   // first iteration began
  arena::TimeNs finish = 0;  // last iteration ended
  std::uint32_t gpu = 0;
  arena::LaneId lane = 0;
  std::int64_t device_ns = 0;  // measured (contention-stretched) device time, summed
  arena::TimeNs queue() const { return start - arrival; }
  arena::TimeNs jct() const { return finish - arrival; }
};

struct Summary {
  double makespan_s = 0;  // last finish minus first arrival
  double avg_queue_s = 0;
  double avg_jct_s = 0;
  double p95_jct_s = 0;  // nearest rank
};

struct SimCounters {
  std::uint64_t iterations = 0;
  std::uint64_t kernels = 0;  // kernel runs in the contention model (one per coalesced run)
  std::uint64_t events = 0;   // instants processed
  std::uint64_t decisions = 0;
  std::uint64_t switches = 0;
  std::uint64_t preemptions = 0;
  std::uint64_t max_lanes = 0;  // most lanes one GPU had at once
  // Placements where the risk filter left a GPU out.
  std::uint64_t risky_skips = 0;
  std::uint64_t swaps_out = 0;  // oversubscription
  std::uint64_t swaps_in = 0;
  std::int64_t swap_ns = 0;  // time the swap streams spent copying
};

// A job's cumulative work (alone-equivalent device nanoseconds) at the times its rate
// changed; linear in between.
using WorkTimeline = std::vector<std::pair<arena::TimeNs, double>>;

struct SimResult {
  SimConfig config;
  LaneModel lanes = LaneModel::exclusive;  // what `automatic` resolved to
  std::vector<JobResult> jobs;             // in trace order
  Summary summary;
  SimCounters counters;
  std::vector<WorkTimeline> work;  // per job, when config.track_work
};

class SimError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The lane model a policy runs with: `requested`, or the policy's default for `automatic`.
LaneModel resolve_lanes(PolicyKind policy, LaneModel requested);

// Runs the whole trace. Throws SimError if a job can never fit one GPU, naming its line.
SimResult simulate(const std::vector<TraceJob>& trace, const SimConfig& config);

Summary summarize(const std::vector<JobResult>& jobs);

// Each job's share of the GPU work done in sliding windows of `window` ns, stepped by
// `step`, over the span in which every job of the trace is present (after the last
// arrival, before the first finish). Needs config.track_work.
struct ShareWindow {
  arena::TimeNs begin = 0, end = 0;
  std::vector<double> work;   // per job, alone-equivalent ns in the window
  std::vector<double> share;  // per job, work / total work in the window
};
std::vector<ShareWindow> share_windows(const SimResult& result, arena::TimeNs window,
                                       arena::TimeNs step);

}  // namespace salus::sched
