#include "vgpu/sim/busy_meter.hpp"

namespace salus::vgpu::sim {

BusyMeter::Clock::time_point BusyMeter::begin() {
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  if (active_++ == 0) since_ = now;
  return now;
}

BusyMeter::Clock::time_point BusyMeter::end() {
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  if (--active_ == 0) closed_ += now - since_;
  return now;
}

std::int64_t BusyMeter::busy_ns() const {
  std::lock_guard lock(mu_);
  Clock::duration total = closed_;
  if (active_ > 0) total += Clock::now() - since_;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(total).count();
}

}  // namespace salus::vgpu::sim
