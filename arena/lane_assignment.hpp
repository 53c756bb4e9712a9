// Salus Algorithm 1 (GPU lane assignment) as a pure decision over the current lanes
// and the safety-condition slack; the arena carries the decision out.
#pragma once

#include "arena/gpu_arena.hpp"
#include "arena/lane_table.hpp"

namespace salus::arena {

enum class LaneStep : std::uint8_t {
  none,  // step 4: stay queued
  open,  // step 1: a new lane of size E
  join,  // step 2: the best-matching lane with L >= E
  grow,  // step 3: grow the smallest lane that keeps the safety condition to E
};

struct LaneDecision {
  LaneStep step = LaneStep::none;
  LaneId lane = 0;  // join and grow
  Bytes room = 0;   // how much the lane region grows: E for open, E - L for grow
};

// slack = capacity - sum of P over sessions - sum of L over lanes (the safety condition's
// headroom); p_new is the persistent memory the request adds, e its ephemeral need.
LaneDecision find_lane(const LaneTable& lanes, Bytes slack, Bytes p_new, Bytes e, LaneMode mode);

}  // namespace salus::arena
