// The GPU-contention model shared by the sim backend (in real time) and salus-sim
// (in virtual time): kernels that run together and whose utilizations sum past 1
// share the GPU proportionally, each slowed by that sum.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sched/activity_window.hpp"

namespace salus::sched {

using TimeNs = std::int64_t;

class ContentionModel {
 public:
  using KernelId = std::uint64_t;

  // A kernel that would take `alone_ns` if it ran alone, occupying `util` (0, 1]
  // of the GPU, starts at `now`. Kernels already running are first advanced to now.
  KernelId start(TimeNs now, double util, TimeNs alone_ns);
  // Advances every kernel to `now` and returns the ids that have finished (in
  // completion order), removing them from the model.
  std::vector<KernelId> advance(TimeNs now);
  // Removes a kernel before it finished (its stream was torn down).
  void cancel(KernelId id, TimeNs now);

  // Earliest completion time of any running kernel at the current rates.
  std::optional<TimeNs> next_completion() const;
  // Predicted completion time of one kernel at the current rates (nullopt if unknown).
  std::optional<TimeNs> predicted_finish(KernelId id) const;
  bool running(KernelId id) const;

  std::size_t active() const { return kernels_.size(); }
  double total_util() const { return total_util_; }
  // The slowdown every running kernel currently sees: max(1, sum of utils).
  double slowdown() const { return total_util_ > 1.0 ? total_util_ : 1.0; }
  // Time during which at least one kernel ran, up to the last advance.
  TimeNs busy_ns() const { return busy_ns_; }

  // Records min(1, total util) over time from now on, keeping `keep_ns` of history, for
  // CARMA's risk filter (salus-sim --risk-filter): the compute activity that NVML's
  // utilization.gpu and dcgm's SMACT stand for on a real GPU. Off (and free) by default.
  void track_activity(TimeNs keep_ns) { activity_.emplace(keep_ns); }
  const ActivityWindow* activity() const { return activity_ ? &*activity_ : nullptr; }

 private:
  struct Kernel {
    KernelId id;
    double util;
    double remaining_ns;  // alone-time still to do
  };
  void progress_to(TimeNs now);
  void note_activity() {
    if (activity_) activity_->set(last_, total_util_ < 1.0 ? total_util_ : 1.0);
  }

  std::vector<Kernel> kernels_;
  KernelId next_id_ = 1;
  double total_util_ = 0.0;
  TimeNs last_ = 0;
  bool started_ = false;
  TimeNs busy_ns_ = 0;
  std::optional<ActivityWindow> activity_;
};

}  // namespace salus::sched
