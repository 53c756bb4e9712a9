// The GPU-contention model run against the wall clock, as timed events: a sim
// kernel (a spin) is started here and reported back when the shared model says
// it has finished under contention with every other kernel on the device, so
// concurrent kernels slow each other down as on a real GPU while no thread
// waits for any one of them (one clock thread per device collects them all).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "sched/contention_model.hpp"

namespace salus::vgpu::sim {

class RealTimeContention {
 public:
  using Clock = std::chrono::steady_clock;

  RealTimeContention() : epoch_(Clock::now()) {}

  // A kernel's extent on the model's time axis.
  struct Span {
    sched::TimeNs start = 0;
    sched::TimeNs finish = 0;
  };
  static constexpr sched::TimeNs kNow = INT64_MAX;

  struct Started {
    bool finished = false;  // already over: `span` is its extent, no event follows
    Span span;
  };
  // Starts a kernel occupying `util` of the GPU that would take `alone_ns` by
  // itself. Unless it is over at once, wait_finished reports it with `tag` when
  // it has finished under contention. Thread-safe; never blocks for long.
  //
  // `ready_at` is when a GPU would have started it: the end of the stream's
  // previous kernel, or its launch if later. A GPU starts a queued kernel the
  // moment the one before it ends, but the host gets to it some 0.1 ms after
  // (wake-up latency on a busy host); a kernel that starts late is credited the
  // work it would have done since `ready_at` (at the rate it would run at now),
  // so back-to-back kernels keep the model's timeline instead of each losing a
  // wake-up.
  Started start(std::int64_t alone_ns, double util, sched::TimeNs ready_at, std::uint64_t tag);

  struct Finished {
    std::uint64_t tag = 0;
    Span span;  // its device time: start to the model's exact finish
  };
  // For the device's clock thread: blocks until at least one kernel has finished,
  // appends each one (in completion order) to `out` and returns true; returns
  // false once stop() was called.
  bool wait_finished(std::vector<Finished>& out);
  // wait_finished returns false from now on (the device is being destroyed).
  void stop();

  // Ends every kernel now and every later one at once (salusd is stopping and
  // its grace is over): a spin of an hour must not hold the shutdown up.
  void abort();

  // Nanoseconds since construction: the model's time axis.
  sched::TimeNs now() const;

 private:
  struct Pending {
    std::uint64_t tag;
    sched::TimeNs start;
  };
  // Moves every kernel finished by `at` into done_, each with the model time it
  // finished at (the model is stepped from one completion to the next, so an
  // event noticed late still gets its exact finish). Under mu_.
  void reap_until(sched::TimeNs at);

  mutable std::mutex mu_;
  // Signalled whenever the set of running kernels changes, since that changes
  // every kernel's rate and so the next completion.
  std::condition_variable changed_;
  sched::ContentionModel model_;
  std::unordered_map<sched::ContentionModel::KernelId, Pending> pending_;  // running kernels
  std::vector<Finished> done_;  // finished, not yet collected by wait_finished
  bool aborted_ = false;
  bool stopped_ = false;
  const Clock::time_point epoch_;
};

}  // namespace salus::vgpu::sim
