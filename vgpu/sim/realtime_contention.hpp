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

  // Blocks the calling thread until a kernel occupying `util` of the GPU, which
  // would take `alone_ns` by itself, has finished under contention with every other
  // kernel running on this device. Thread-safe.
  void run_kernel(std::int64_t alone_ns, double util);

  // Nanoseconds since construction: the model's time axis.
  sched::TimeNs now() const;

 private:
  mutable std::mutex mu_;
  // Signalled whenever the set of running kernels changes, since that changes
  // every kernel's rate and so its predicted finish.
  std::condition_variable changed_;
  sched::ContentionModel model_;
  const Clock::time_point epoch_;
};

}  // namespace salus::vgpu::sim
