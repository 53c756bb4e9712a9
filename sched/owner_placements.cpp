#include "sched/owner_placements.hpp"

namespace salus::sched {

namespace {
// A count moved by delta, never below zero: a caller's extra -1 must not wrap.
std::uint32_t moved(std::uint32_t n, int delta) {
  if (delta < 0 && n < static_cast<std::uint32_t>(-delta)) return 0;
  return static_cast<std::uint32_t>(static_cast<std::int64_t>(n) + delta);
}
}  // namespace

void OwnerPlacements::add(std::uint32_t owner, int placed, int waiting) {
  Count& c = counts_[owner];
  c.placed = moved(c.placed, placed);
  c.waiting = moved(c.waiting, waiting);
  if (c.placed == 0 && c.waiting == 0) counts_.erase(owner);
}

std::optional<double> OwnerPlacements::key(std::uint32_t owner) const {
  if (counts_.size() < 2) return std::nullopt;
  const auto c = counts_.find(owner);
  return c == counts_.end() ? 0.0 : static_cast<double>(c->second.placed);
}

}  // namespace salus::sched
