#include "sched/contention_model.hpp"

#include <algorithm>
#include <cmath>

namespace salus::sched {

void ContentionModel::progress_to(TimeNs now) {
  if (!started_) {
    started_ = true;
    last_ = now;
    return;
  }
  if (now <= last_) return;
  const double elapsed = static_cast<double>(now - last_);
  if (!kernels_.empty()) {
    busy_ns_ += now - last_;
    const double rate = 1.0 / slowdown();
    for (Kernel& k : kernels_) k.remaining_ns -= elapsed * rate;
  }
  last_ = now;
}

ContentionModel::KernelId ContentionModel::start(TimeNs now, double util, TimeNs alone_ns) {
  progress_to(now);
  util = std::clamp(util, 1e-6, 1.0);
  const KernelId id = next_id_++;
  kernels_.push_back(Kernel{id, util, static_cast<double>(std::max<TimeNs>(alone_ns, 0))});
  total_util_ += util;
  note_activity();
  return id;
}

std::vector<ContentionModel::KernelId> ContentionModel::advance(TimeNs now) {
  progress_to(now);
  std::vector<Kernel> done;
  // Sub-nanosecond leftovers from floating point count as finished.
  auto finished = [](const Kernel& k) { return k.remaining_ns < 0.5; };
  for (const Kernel& k : kernels_)
    if (finished(k)) done.push_back(k);
  if (done.empty()) return {};
  std::erase_if(kernels_, finished);
  std::sort(done.begin(), done.end(),
            [](const Kernel& a, const Kernel& b) { return a.remaining_ns < b.remaining_ns; });
  std::vector<KernelId> ids;
  ids.reserve(done.size());
  for (const Kernel& k : done) {
    total_util_ -= k.util;
    ids.push_back(k.id);
  }
  if (kernels_.empty()) total_util_ = 0.0;  // no drift once idle
  note_activity();
  return ids;
}

void ContentionModel::cancel(KernelId id, TimeNs now) {
  progress_to(now);
  auto it =
      std::find_if(kernels_.begin(), kernels_.end(), [id](const Kernel& k) { return k.id == id; });
  if (it == kernels_.end()) return;
  total_util_ -= it->util;
  kernels_.erase(it);
  if (kernels_.empty()) total_util_ = 0.0;
  note_activity();
}

std::optional<TimeNs> ContentionModel::next_completion() const {
  if (kernels_.empty()) return std::nullopt;
  double least = kernels_.front().remaining_ns;
  for (const Kernel& k : kernels_) least = std::min(least, k.remaining_ns);
  return last_ + static_cast<TimeNs>(std::ceil(std::max(least, 0.0) * slowdown()));
}

std::optional<TimeNs> ContentionModel::predicted_finish(KernelId id) const {
  for (const Kernel& k : kernels_)
    if (k.id == id)
      return last_ + static_cast<TimeNs>(std::ceil(std::max(k.remaining_ns, 0.0) * slowdown()));
  return std::nullopt;
}

bool ContentionModel::running(KernelId id) const {
  return std::any_of(kernels_.begin(), kernels_.end(),
                     [id](const Kernel& k) { return k.id == id; });
}

}  // namespace salus::sched
