// Wall time during which a device had at least one op executing on any stream:
// the numerator of GPU utilization. Overlapping ops count once.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace salus::vgpu::sim {

class BusyMeter {
 public:
  using Clock = std::chrono::steady_clock;

  // Mark an op starting / ending and return the time of that edge, so the caller
  // can time the op with the same reading. The clock is read under the lock so
  // edges from different threads are ordered consistently.
  Clock::time_point begin();
  Clock::time_point end();
  // Includes the still-open busy interval, if any.
  std::int64_t busy_ns() const;

 private:
  mutable std::mutex mu_;
  int active_ = 0;
  Clock::time_point since_{};  // when active_ last went from 0 to 1
  Clock::duration closed_{};   // sum of finished busy intervals
};

}  // namespace salus::vgpu::sim
