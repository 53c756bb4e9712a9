// A GPU's activity over a sliding window of (virtual or real) time, for CARMA's risk
// filter in salus-sim: the contention model records its compute activity each time it
// changes, and placement reads it back as one sample per period, the way CARMA's
// monitor reads dcgm once a second over its 30-second window.
#pragma once

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace salus::sched {

class ActivityWindow {
 public:
  using TimeNs = std::int64_t;

  // Keeps enough history to answer about the last `keep_ns` before the latest record.
  explicit ActivityWindow(TimeNs keep_ns) : keep_(keep_ns) {}

  // From `t` on, the activity is `value`. Times must not decrease; before the first
  // record the activity is 0 (an idle GPU).
  void set(TimeNs t, double value);
  // The time-average of the activity over [from, to) (to > from).
  double mean(TimeNs from, TimeNs to) const;
  // `count` samples ending at `now`, each the mean over one `period`, oldest first.
  void samples(TimeNs now, TimeNs period, std::size_t count, std::vector<double>& out) const;

  std::size_t steps() const { return steps_.size(); }

 private:
  TimeNs keep_;
  std::deque<std::pair<TimeNs, double>> steps_;  // (from, value), in time order
};

}  // namespace salus::sched
