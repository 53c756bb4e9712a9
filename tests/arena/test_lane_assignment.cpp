// Algorithm 1 as a pure decision, and the admission queue's ordering rules.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "arena/admission_queue.hpp"
#include "arena/lane_assignment.hpp"
#include "arena/lane_table.hpp"

namespace salus::arena {
namespace {

constexpr Bytes G = Bytes{1} << 30;

TEST(FindLane, OpensANewLaneWhenTheRequestFits) {
  LaneTable lanes;
  lanes.open(1, 4 * G);
  const LaneDecision d = find_lane(lanes, 6 * G, 2 * G, 4 * G, LaneMode::salus);
  EXPECT_EQ(d.step, LaneStep::open);
  EXPECT_EQ(d.room, 4 * G);
}

TEST(FindLane, PersistentMemoryAloneCanBlock) {
  LaneTable lanes;
  lanes.open(1, 8 * G);
  EXPECT_EQ(find_lane(lanes, 2 * G, 3 * G, 1 * G, LaneMode::salus).step, LaneStep::none);
}

TEST(FindLane, JoinsTheSmallestLaneThatHoldsE) {
  LaneTable lanes;
  lanes.open(1, 2 * G);
  const LaneId five = lanes.open(2, 5 * G);
  const LaneId three = lanes.open(3, 3 * G);
  (void)five;
  const LaneDecision d = find_lane(lanes, 1 * G, 0, 3 * G, LaneMode::salus);
  EXPECT_EQ(d.step, LaneStep::join);
  EXPECT_EQ(d.lane, three);
  EXPECT_EQ(d.room, 0u);
}

TEST(FindLane, JoinTieGoesToFewerMembersThenLowerId) {
  LaneTable lanes;
  const LaneId a = lanes.open(1, 3 * G);
  const LaneId b = lanes.open(2, 3 * G);
  EXPECT_EQ(find_lane(lanes, 0, 0, 3 * G, LaneMode::salus).lane, a);
  lanes.join(a, 3, 1 * G);
  EXPECT_EQ(find_lane(lanes, 0, 0, 3 * G, LaneMode::salus).lane, b);
  lanes.join(b, 4, 1 * G);
  EXPECT_EQ(find_lane(lanes, 0, 0, 2 * G, LaneMode::salus).lane, a);
}

TEST(FindLane, GrowsTheSmallestLaneThatKeepsTheSafetyCondition) {
  LaneTable lanes;
  const LaneId two = lanes.open(1, 2 * G);
  const LaneId three = lanes.open(2, 3 * G);
  // slack 5G, P 3G: 2G left for the lane sum, so E=4G needs L_r >= 2G: the 2G lane.
  LaneDecision d = find_lane(lanes, 5 * G, 3 * G, 4 * G, LaneMode::salus);
  EXPECT_EQ(d.step, LaneStep::grow);
  EXPECT_EQ(d.lane, two);
  EXPECT_EQ(d.room, 2 * G);
  // P 4G: 1G left, so L_r >= 3G.
  d = find_lane(lanes, 5 * G, 4 * G, 4 * G, LaneMode::salus);
  EXPECT_EQ(d.step, LaneStep::grow);
  EXPECT_EQ(d.lane, three);
  EXPECT_EQ(d.room, 1 * G);
  // P 5G: nothing left, and growing never shrinks the lane sum.
  EXPECT_EQ(find_lane(lanes, 5 * G, 5 * G, 4 * G, LaneMode::salus).step, LaneStep::none);
}

TEST(FindLane, LanePerSessionOnlyOpens) {
  LaneTable lanes;
  lanes.open(1, 8 * G);
  EXPECT_EQ(find_lane(lanes, 2 * G, 0, 4 * G, LaneMode::lane_per_session).step, LaneStep::none);
  EXPECT_EQ(find_lane(lanes, 2 * G, 0, 4 * G, LaneMode::salus).step, LaneStep::join);
  EXPECT_EQ(find_lane(lanes, 2 * G, 0, 2 * G, LaneMode::lane_per_session).step, LaneStep::open);
}

TEST(FindLane, EmptyLanesAreNeverJoined) {
  LaneTable lanes;
  const LaneId a = lanes.open(1, 8 * G);
  lanes.remove_member(a, 1);
  EXPECT_EQ(lanes.find(a)->size, 0u);
  EXPECT_EQ(find_lane(lanes, 0, 0, 1 * G, LaneMode::salus).step, LaneStep::none);
}

TEST(LaneTable, ShrinksToTheLargestRemainingNeed) {
  LaneTable lanes;
  const LaneId a = lanes.open(1, 6 * G);
  lanes.join(a, 2, 3 * G);
  lanes.join(a, 3, 4 * G);
  EXPECT_EQ(lanes.total(), 6 * G);
  lanes.remove_member(a, 1);
  EXPECT_EQ(lanes.find(a)->size, 4 * G);
  EXPECT_EQ(lanes.total(), 4 * G);
  EXPECT_FALSE(lanes.remove_member(a, 1));
}

// ---- the queue ----

std::vector<SessionId> run(AdmissionQueue& q, QueueMode mode, std::uint32_t max_bypass,
                           const std::set<SessionId>& fits) {
  std::vector<SessionId> admitted;
  q.admit(mode, max_bypass, [&](const QueuedRequest& r) {
    if (!fits.count(r.session)) return false;
    admitted.push_back(r.session);
    return true;
  });
  return admitted;
}

TEST(AdmissionQueue, StrictFifoStopsAtTheFirstRefusal) {
  AdmissionQueue q;
  for (SessionId s = 1; s <= 4; ++s) q.push(s, s, 0, 0, 0);
  EXPECT_EQ(run(q, QueueMode::strict_fifo, 16, {1, 3, 4}), (std::vector<SessionId>{1}));
  EXPECT_EQ(q.find(2)->bypassed, 0u);
  EXPECT_EQ(q.size(), 3u);
}

TEST(AdmissionQueue, BypassIsCountedOnEveryRefusedEarlierRequest) {
  AdmissionQueue q;
  for (SessionId s = 1; s <= 5; ++s) q.push(s, s, 0, 0, 0);
  EXPECT_EQ(run(q, QueueMode::bounded_bypass, 16, {3, 5}), (std::vector<SessionId>{3, 5}));
  EXPECT_EQ(q.find(1)->bypassed, 2u);
  EXPECT_EQ(q.find(2)->bypassed, 2u);
  EXPECT_EQ(q.find(4)->bypassed, 1u);
}

TEST(AdmissionQueue, NothingPassesARequestBypassedMaxTimes) {
  AdmissionQueue q;
  for (SessionId s = 1; s <= 5; ++s) q.push(s, s, 0, 0, 0);
  // Session 1 never fits; max_bypass 2 lets exactly two later requests pass it.
  EXPECT_EQ(run(q, QueueMode::bounded_bypass, 2, {2, 3, 4, 5}), (std::vector<SessionId>{2, 3}));
  EXPECT_EQ(q.find(1)->bypassed, 2u);
  EXPECT_TRUE(run(q, QueueMode::bounded_bypass, 2, {4, 5}).empty());
  EXPECT_EQ(run(q, QueueMode::bounded_bypass, 2, {1, 4, 5}), (std::vector<SessionId>{1, 4, 5}));
}

TEST(AdmissionQueue, ARequestAheadOfTheCappedOneMayStillGo) {
  AdmissionQueue q;
  for (SessionId s = 1; s <= 4; ++s) q.push(s, s, 0, 0, 0);
  EXPECT_EQ(run(q, QueueMode::bounded_bypass, 1, {3}), (std::vector<SessionId>{3}));
  // 1 and 2 were both passed once: nothing behind 1 may go, but 1 itself may.
  EXPECT_TRUE(run(q, QueueMode::bounded_bypass, 1, {2, 4}).empty());
  EXPECT_EQ(run(q, QueueMode::bounded_bypass, 1, {1, 4}), (std::vector<SessionId>{1}));
  // 2 is now at the head and capped: 4 still waits for it.
  EXPECT_TRUE(run(q, QueueMode::bounded_bypass, 1, {4}).empty());
}

TEST(AdmissionQueue, ReQueuedRequestKeepsItsArrivalPosition) {
  AdmissionQueue q;
  q.push(5, 5, 0, 0, 0);
  q.push(9, 9, 0, 0, 0);
  EXPECT_TRUE(q.push(2, 2, 100, 0, 0));
  EXPECT_FALSE(q.push(2, 2, 100, 0, 0));
  std::vector<SessionId> order;
  q.for_each([&](const QueuedRequest& r) { order.push_back(r.session); });
  EXPECT_EQ(order, (std::vector<SessionId>{2, 5, 9}));
  EXPECT_EQ(q.find(2)->waiting_since, 100);
}

TEST(AdmissionQueue, TracksTheSmallestNeedsForSkippingPasses) {
  AdmissionQueue q;
  EXPECT_EQ(q.min_persistent(), AdmissionQueue::kNone);
  q.push(1, 1, 0, 5 * G, 1 * G);
  q.push(2, 2, 0, 3 * G, 4 * G);
  EXPECT_EQ(q.min_persistent(), 3 * G);
  EXPECT_EQ(q.min_total(), 6 * G);
  q.set_need(2, 1 * G, 1 * G);
  EXPECT_EQ(q.min_persistent(), 1 * G);
  EXPECT_EQ(q.min_total(), 2 * G);
  run(q, QueueMode::bounded_bypass, 16, {2});
  EXPECT_EQ(q.min_persistent(), 5 * G);
  q.remove(1);
  EXPECT_EQ(q.min_total(), AdmissionQueue::kNone);
}

}  // namespace
}  // namespace salus::arena
