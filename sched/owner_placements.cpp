#include "sched/owner_placements.hpp"

#include "sched/saturating_count.hpp"

namespace salus::sched {

void OwnerPlacements::add(std::uint32_t owner, int placed, int waiting) {
  Count& c = counts_[owner];
  c.placed = count_moved(c.placed, placed);
  c.waiting = count_moved(c.waiting, waiting);
  if (c.placed == 0 && c.waiting == 0) counts_.erase(owner);
}

std::optional<double> OwnerPlacements::key(std::uint32_t owner) const {
  if (counts_.size() < 2) return std::nullopt;
  const auto c = counts_.find(owner);
  return c == counts_.end() ? 0.0 : static_cast<double>(c->second.placed);
}

double host_queue_key(PolicyKind policy, bool exclusive, const OwnerPlacements* owners,
                      std::uint32_t owner, const RankInputs& in) {
  if (exclusive) return static_cast<double>(in.arrival);
  if (owners)
    if (const std::optional<double> k = owners->key(owner)) return *k;
  return admission_key(policy, in);
}

}  // namespace salus::sched
