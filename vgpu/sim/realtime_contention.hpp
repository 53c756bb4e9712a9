// The GPU-contention model run against the wall clock: stream threads block in
// run_kernel() for as long as the shared model says their simulated kernel takes,
// so concurrent kernels on one sim device slow each other down as on a real GPU.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

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

  // Blocks the calling thread until a kernel occupying `util` of the GPU, which
  // would take `alone_ns` by itself, has finished under contention with every other
  // kernel running on this device. Thread-safe.
  //
  // `ready_at` is when a GPU would have started it: the end of the stream's
  // previous kernel, or its launch if later. A GPU starts a queued kernel the
  // moment the one before it ends, but a stream thread wakes some 0.1 ms after
  // its deadline on a busy host (timer slack, scheduling); a kernel that starts
  // late is credited the work it would have done since `ready_at` (at the rate
  // it would run at now), so back-to-back kernels keep the model's timeline
  // instead of each losing a wake-up. Returns the kernel's model span, which is
  // its device time.
  Span run_kernel(std::int64_t alone_ns, double util, sched::TimeNs ready_at = kNow);

  // Ends every kernel now and every later one at once (salusd is stopping and
  // its grace is over): a spin of an hour must not hold the shutdown up.
  void abort();

  // Nanoseconds since construction: the model's time axis.
  sched::TimeNs now() const;

 private:
  mutable std::mutex mu_;
  // Signalled whenever the set of running kernels changes, since that changes
  // every kernel's rate and so its predicted finish.
  std::condition_variable changed_;
  sched::ContentionModel model_;
  bool aborted_ = false;
  const Clock::time_point epoch_;
};

}  // namespace salus::vgpu::sim
