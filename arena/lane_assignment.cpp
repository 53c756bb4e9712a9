#include "arena/lane_assignment.hpp"

namespace salus::arena {

LaneDecision find_lane(const LaneTable& lanes, Bytes slack, Bytes p_new, Bytes e, LaneMode mode) {
  // Every step adds p_new to the persistent sum and never shrinks the lane sum.
  if (p_new > slack) return {};
  const Bytes left = slack - p_new;  // what the lane sum may still grow by
  if (e <= left) return {LaneStep::open, 0, e};
  if (mode == LaneMode::lane_per_session) return {};
  if (const Lane* l = lanes.best_match(e)) return {LaneStep::join, l->id, 0};
  // Growing lane r to e costs e - L_r, so it fits iff L_r >= e - left. No lane reaches e
  // here (step 2 found none), so the smallest such lane is the first r in ascending L_r
  // order that Algorithm 1 would accept.
  if (const Lane* r = lanes.smallest_at_least(e - left))
    return {LaneStep::grow, r->id, e - r->size};
  return {};
}

}  // namespace salus::arena
