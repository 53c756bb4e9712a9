#include "vgpu/sim/realtime_contention.hpp"

#include <algorithm>
#include <cmath>

namespace salus::vgpu::sim {

sched::TimeNs RealTimeContention::now() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - epoch_).count();
}

RealTimeContention::Span RealTimeContention::run_kernel(std::int64_t alone_ns, double util,
                                                        sched::TimeNs ready_at) {
  std::unique_lock lock(mu_);
  const sched::TimeNs t = now();
  Span span{std::min(ready_at, t), t};
  if (aborted_) return span;
  alone_ns = std::max<std::int64_t>(alone_ns, 0);
  if (span.start < t) {
    // The model clamps util the same way when the kernel starts.
    const double slowdown = std::max(1.0, model_.total_util() + std::clamp(util, 1e-6, 1.0));
    const double credit = static_cast<double>(t - span.start) / slowdown;
    if (credit >= static_cast<double>(alone_ns)) {
      // Already over on the GPU's timeline: the thread woke after it would have ended.
      span.finish = span.start + std::llround(static_cast<double>(alone_ns) * slowdown);
      return span;
    }
    alone_ns -= std::llround(credit);
  }
  const auto id = model_.start(t, util, alone_ns);
  changed_.notify_all();
  for (;;) {
    // Whoever advances the model reaps every finished kernel, ours or not; the
    // owners notice by their id no longer running.
    const sched::TimeNs at = now();
    if (aborted_) {
      model_.cancel(id, at);
      span.finish = std::max(span.start, at);
      return span;
    }
    if (!model_.advance(at).empty()) changed_.notify_all();
    if (!model_.running(id)) {
      // It ended at the last prediction, unless that was made before a change of rate.
      span.finish = std::clamp(span.finish, span.start, at);
      return span;
    }
    const auto finish = model_.predicted_finish(id);
    if (!finish) return span;  // unreachable while running(id)
    span.finish = *finish;
    changed_.wait_until(lock, epoch_ + std::chrono::nanoseconds(*finish));
  }
}

void RealTimeContention::abort() {
  {
    std::lock_guard lock(mu_);
    aborted_ = true;
  }
  changed_.notify_all();
}

}  // namespace salus::vgpu::sim
