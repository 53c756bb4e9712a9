// A count moved by a signed delta that never goes below zero, for the per-owner
// tallies of the scheduler and the host-wide queue: a caller's extra -1 must not
// wrap an unsigned count to four billion.
#pragma once

#include <cstdint>

namespace salus::sched {

inline std::uint32_t count_moved(std::uint32_t n, int delta) {
  if (delta < 0 && n < static_cast<std::uint32_t>(-static_cast<std::int64_t>(delta))) return 0;
  return static_cast<std::uint32_t>(static_cast<std::int64_t>(n) + delta);
}

}  // namespace salus::sched
