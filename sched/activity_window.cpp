#include "sched/activity_window.hpp"

#include <algorithm>

namespace salus::sched {

void ActivityWindow::set(TimeNs t, double value) {
  if (!steps_.empty() && steps_.back().first >= t) {
    // Several changes in one instant: only the last one lasts.
    steps_.back().second = value;
    if (steps_.size() >= 2 && steps_[steps_.size() - 2].second == value) steps_.pop_back();
    return;
  }
  if (!steps_.empty() && steps_.back().second == value) return;
  steps_.emplace_back(t, value);
  // Drop steps wholly before the window; the one in force at its start stays.
  while (steps_.size() >= 2 && steps_[1].first <= t - keep_) steps_.pop_front();
}

double ActivityWindow::mean(TimeNs from, TimeNs to) const {
  if (to <= from) return 0.0;
  // The first step that starts after `from`; the one before it is in force at `from`.
  auto it = std::upper_bound(steps_.begin(), steps_.end(), from,
                             [](TimeNs t, const auto& s) { return t < s.first; });
  double area = 0.0;
  TimeNs at = from;
  double value = it == steps_.begin() ? 0.0 : std::prev(it)->second;
  for (; it != steps_.end() && it->first < to; ++it) {
    area += value * static_cast<double>(it->first - at);
    at = it->first;
    value = it->second;
  }
  area += value * static_cast<double>(to - at);
  return area / static_cast<double>(to - from);
}

void ActivityWindow::samples(TimeNs now, TimeNs period, std::size_t count,
                             std::vector<double>& out) const {
  out.clear();
  for (std::size_t k = count; k > 0; --k) {
    const TimeNs end = now - static_cast<TimeNs>(k - 1) * period;
    out.push_back(mean(end - period, end));
  }
}

}  // namespace salus::sched
