#include "vgpu/sim/realtime_contention.hpp"

#include <algorithm>
#include <cmath>

namespace salus::vgpu::sim {

sched::TimeNs RealTimeContention::now() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - epoch_).count();
}

RealTimeContention::Started RealTimeContention::start(std::int64_t alone_ns, double util,
                                                      sched::TimeNs ready_at, std::uint64_t tag) {
  std::lock_guard lock(mu_);
  const sched::TimeNs t = now();
  Started r;
  r.span = {std::min(ready_at, t), t};
  if (aborted_) {
    r.finished = true;
    return r;
  }
  // Kernels that ended before this one starts end at their own time, at the
  // rates they had, not at the rates this one brings.
  reap_until(t);
  alone_ns = std::max<std::int64_t>(alone_ns, 0);
  if (r.span.start < t) {
    // The model clamps util the same way when the kernel starts.
    const double slowdown = std::max(1.0, model_.total_util() + std::clamp(util, 1e-6, 1.0));
    const double credit = static_cast<double>(t - r.span.start) / slowdown;
    if (credit >= static_cast<double>(alone_ns)) {
      // Already over on the GPU's timeline: the host got to it after it would have ended.
      r.finished = true;
      r.span.finish = r.span.start + std::llround(static_cast<double>(alone_ns) * slowdown);
      if (!done_.empty()) changed_.notify_all();
      return r;
    }
    alone_ns -= std::llround(credit);
  }
  if (alone_ns == 0) {
    r.finished = true;
    if (!done_.empty()) changed_.notify_all();
    return r;
  }
  const auto id = model_.start(t, util, alone_ns);
  pending_.emplace(id, Pending{tag, r.span.start});
  changed_.notify_all();
  return r;
}

void RealTimeContention::reap_until(sched::TimeNs at) {
  for (;;) {
    const auto next = model_.next_completion();
    if (!next || *next > at) return;
    for (const auto id : model_.advance(*next)) {
      auto it = pending_.find(id);
      if (it == pending_.end()) continue;  // unreachable: every model kernel is pending
      done_.push_back(
          Finished{it->second.tag, {it->second.start, std::max(it->second.start, *next)}});
      pending_.erase(it);
    }
  }
}

bool RealTimeContention::wait_finished(std::vector<Finished>& out) {
  std::unique_lock lock(mu_);
  for (;;) {
    if (stopped_) return false;
    const sched::TimeNs at = now();
    if (aborted_) {
      for (const auto& [id, p] : pending_) {
        model_.cancel(id, at);
        done_.push_back(Finished{p.tag, {p.start, std::max(p.start, at)}});
      }
      pending_.clear();
    } else {
      reap_until(at);
    }
    if (!done_.empty()) {
      out.insert(out.end(), done_.begin(), done_.end());
      done_.clear();
      return true;
    }
    if (const auto next = model_.next_completion())
      changed_.wait_until(lock, epoch_ + std::chrono::nanoseconds(*next));
    else
      changed_.wait(lock);
  }
}

void RealTimeContention::stop() {
  {
    std::lock_guard lock(mu_);
    stopped_ = true;
  }
  changed_.notify_all();
}

void RealTimeContention::abort() {
  {
    std::lock_guard lock(mu_);
    aborted_ = true;
  }
  changed_.notify_all();
}

}  // namespace salus::vgpu::sim
