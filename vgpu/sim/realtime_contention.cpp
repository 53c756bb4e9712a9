#include "vgpu/sim/realtime_contention.hpp"

namespace salus::vgpu::sim {

sched::TimeNs RealTimeContention::now() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - epoch_).count();
}

void RealTimeContention::run_kernel(std::int64_t alone_ns, double util) {
  std::unique_lock lock(mu_);
  const auto id = model_.start(now(), util, alone_ns);
  changed_.notify_all();
  for (;;) {
    // Whoever advances the model reaps every finished kernel, ours or not; the
    // owners notice by their id no longer running.
    if (!model_.advance(now()).empty()) changed_.notify_all();
    if (!model_.running(id)) return;
    const auto finish = model_.predicted_finish(id);
    if (!finish) return;  // unreachable while running(id)
    changed_.wait_until(lock, epoch_ + std::chrono::nanoseconds(*finish));
  }
}

}  // namespace salus::vgpu::sim
