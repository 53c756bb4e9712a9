// GpuArena through its public API: Algorithm 1's steps, the queue, lane shrink and
// delete with sliding, re-admission, the persistent limits, and compaction.
#include "arena/gpu_arena.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

namespace salus::arena {
namespace {

constexpr Bytes M = Bytes{1} << 20;
constexpr Bytes G = Bytes{1} << 30;

// Requests and returns the lane it was admitted to (nullopt if queued).
std::optional<LaneId> admit(GpuArena& a, SessionId s, Bytes p, Bytes e) {
  EXPECT_EQ(a.request(s, {p, e}, 0), ArenaError::ok);
  const auto pl = a.placement(s);
  EXPECT_TRUE(pl.has_value());
  return pl && pl->admitted ? pl->lane : std::nullopt;
}

std::vector<SessionId> queued(const GpuArena& a) {
  std::vector<SessionId> out;
  for (const QueueEntry& q : a.queue()) out.push_back(q.session);
  return out;
}

const LaneView* view(const std::vector<LaneView>& lanes, LaneId id) {
  for (const LaneView& v : lanes)
    if (v.id == id) return &v;
  return nullptr;
}

#define EXPECT_CLEAN(arena) EXPECT_EQ((arena).check_invariants(), "")

TEST(GpuArena, Step1OpensLanesBottomUp) {
  GpuArena a(16 * G);
  const auto l1 = admit(a, 1, 1 * G, 4 * G);
  const auto l2 = admit(a, 2, 1 * G, 3 * G);
  ASSERT_TRUE(l1 && l2);
  EXPECT_NE(*l1, *l2);
  EXPECT_EQ(a.lane_offset(*l1), 0u);
  EXPECT_EQ(a.lane_offset(*l2), 4 * G);
  EXPECT_TRUE(a.lane_ready(*l1));
  EXPECT_EQ(a.stats().lanes_opened, 2u);
  const auto adm = a.take_admissions();
  ASSERT_EQ(adm.size(), 2u);
  EXPECT_EQ(adm[0].session, 1u);
  EXPECT_EQ(adm[1].lane, *l2);
  EXPECT_TRUE(a.take_admissions().empty());
  const MemorySummary m = a.memory();
  EXPECT_EQ(m.persistent_reserved, 2 * G);
  EXPECT_EQ(m.lane_total, 7 * G);
  EXPECT_EQ(m.free, 7 * G);
  EXPECT_EQ(m.lanes, 2u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, Step2JoinsTheBestMatchingLane) {
  GpuArena a(20 * G);
  const auto l1 = admit(a, 1, 0, 2 * G);
  admit(a, 2, 0, 5 * G);
  const auto l3 = admit(a, 3, 0, 3 * G);
  const auto l4 = admit(a, 4, 0, 3 * G);
  // 13G of lanes; P=6G leaves no room for a new 3G lane.
  EXPECT_EQ(admit(a, 5, 6 * G, 3 * G), l3);  // 3G lanes tie: lower id
  EXPECT_EQ(admit(a, 6, 0, 3 * G), l4);      // 3G lanes tie: fewer members
  EXPECT_EQ(admit(a, 7, 1 * G, 1 * G), l1);  // the smallest lane that holds E
  EXPECT_EQ(a.stats().lanes_opened, 4u);
  EXPECT_EQ(a.memory().free, 0u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, Step3GrowsTheSmallestSufficientLaneAndShiftsTheOnesAbove) {
  GpuArena a(10 * G);
  const auto l1 = admit(a, 1, 0, 2 * G);
  const auto l2 = admit(a, 2, 0, 3 * G);
  EXPECT_EQ(a.lane_offset(*l2), 2 * G);
  // Slack 5G, P 3G: a new 4G lane does not fit, no lane holds 4G, growing the 2G lane does.
  EXPECT_EQ(admit(a, 3, 3 * G, 4 * G), l1);
  EXPECT_EQ(a.lane_size(*l1), 4 * G);
  EXPECT_EQ(a.lane_offset(*l2), 4 * G);
  EXPECT_TRUE(a.lane_ready(*l1));
  EXPECT_TRUE(a.lane_ready(*l2));
  EXPECT_EQ(a.stats().lanes_grown, 1u);
  EXPECT_EQ(a.stats().lane_moves, 1u);
  EXPECT_EQ(a.memory().free, 0u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, Step3SkipsLanesTooSmallToKeepTheSafetyCondition) {
  GpuArena a(10 * G);
  admit(a, 1, 0, 2 * G);
  const auto l2 = admit(a, 2, 0, 3 * G);
  EXPECT_EQ(admit(a, 3, 4 * G, 4 * G), l2);  // only 1G to spare: the 2G lane would need 2G
  EXPECT_EQ(a.lane_size(*l2), 4 * G);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, Step4QueuesWhenNothingFits) {
  GpuArena a(10 * G);
  admit(a, 1, 0, 2 * G);
  admit(a, 2, 0, 3 * G);
  EXPECT_EQ(admit(a, 3, 5 * G, 4 * G), std::nullopt);
  EXPECT_EQ(queued(a), (std::vector<SessionId>{3}));
  EXPECT_EQ(a.memory().queued, 1u);
  a.leave(2, 0);
  EXPECT_TRUE(a.placement(3)->admitted);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, LanePerSessionNeverShares) {
  GpuArena a(10 * G, {QueueMode::bounded_bypass, 16, LaneMode::lane_per_session});
  admit(a, 1, 1 * G, 4 * G);
  EXPECT_EQ(admit(a, 2, 3 * G, 3 * G), std::nullopt);  // Salus would join lane 1
  EXPECT_EQ(a.lanes().size(), 1u);
  a.leave(1, 0);
  EXPECT_TRUE(a.placement(2)->admitted);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, RejectsDuplicatesAndRequestsThatCanNeverFit) {
  GpuArena a(10 * G);
  EXPECT_EQ(a.request(1, {6 * G, 5 * G}, 0), ArenaError::too_large);
  EXPECT_EQ(a.request(1, {~Bytes{0}, 1}, 0), ArenaError::too_large);
  EXPECT_EQ(a.request(1, {5 * G, 5 * G}, 0), ArenaError::ok);
  EXPECT_EQ(a.request(1, {1, 1}, 0), ArenaError::duplicate);
  EXPECT_EQ(a.change_need(2, {1, 1}, 0), ArenaError::unknown_session);
  EXPECT_EQ(a.change_need(1, {10 * G, 1}, 0), ArenaError::too_large);
  EXPECT_EQ(a.placement(1)->declared.persistent, 5 * G);  // a rejected change changes nothing
  a.leave(42, 0);                                         // unknown: nothing happens
  EXPECT_CLEAN(a);
}

TEST(GpuArena, StrictFifoAdmitsOnlyTheHead) {
  GpuArena a(10 * G, {QueueMode::strict_fifo, 16, LaneMode::salus});
  admit(a, 1, 0, 8 * G);
  EXPECT_EQ(admit(a, 2, 5 * G, 1 * G), std::nullopt);
  EXPECT_EQ(admit(a, 3, 1 * G, 1 * G), std::nullopt);  // fits, but 2 is ahead
  EXPECT_EQ(queued(a), (std::vector<SessionId>{2, 3}));
  EXPECT_EQ(a.queue()[0].bypassed, 0u);
  a.set_queue_mode(QueueMode::bounded_bypass);  // switching lets 3 through at once
  EXPECT_TRUE(a.placement(3)->admitted);
  EXPECT_EQ(a.queue()[0].bypassed, 1u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, BypassIsBoundedPerBlockedRequest) {
  GpuArena a(10 * G, {QueueMode::bounded_bypass, 2, LaneMode::salus});
  admit(a, 1, 0, 6 * G);
  EXPECT_EQ(admit(a, 2, 5 * G, 0), std::nullopt);  // 4G of slack: blocked
  for (SessionId s : {3, 4}) {
    EXPECT_TRUE(admit(a, s, 1 * G, 0).has_value());
    a.leave(s, 0);
  }
  EXPECT_EQ(a.queue()[0].bypassed, 2u);
  EXPECT_EQ(admit(a, 5, 1 * G, 0), std::nullopt);  // would fit, but 2 was passed twice
  EXPECT_EQ(queued(a), (std::vector<SessionId>{2, 5}));
  EXPECT_EQ(a.queue()[1].bypassed, 0u);
  a.take_admissions();
  a.leave(1, 0);
  const auto adm = a.take_admissions();
  ASSERT_EQ(adm.size(), 2u);
  EXPECT_EQ(adm[0].session, 2u);
  EXPECT_EQ(adm[1].session, 5u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, LaneShrinksWhenItsLargestMemberLeavesAndLanesAboveSlide) {
  GpuArena a(16 * G);
  const auto l1 = admit(a, 1, 0, 2 * G);
  const auto l2 = admit(a, 2, 0, 6 * G);
  const auto l3 = admit(a, 4, 0, 2 * G);
  EXPECT_EQ(admit(a, 3, 5 * G, 3 * G), l2);
  EXPECT_EQ(a.lane_offset(*l3), 8 * G);
  a.leave(2, 0);
  EXPECT_EQ(a.lane_size(*l2), 3 * G);
  EXPECT_EQ(a.lane_offset(*l3), 5 * G);
  EXPECT_EQ(a.memory().lane_total, 7 * G);
  EXPECT_EQ(a.stats().lane_moves, 1u);
  a.leave(3, 0);
  EXPECT_EQ(view(a.lanes(), *l2), nullptr);
  EXPECT_EQ(a.stats().lanes_closed, 1u);
  EXPECT_EQ(a.lane_offset(*l3), 2 * G);
  EXPECT_EQ(a.lane_offset(*l1), 0u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, BusyLaneKeepsItsBytesUntilItsBoundary) {
  GpuArena a(16 * G);
  admit(a, 1, 0, 2 * G);
  const auto l2 = admit(a, 2, 0, 6 * G);
  const auto l3 = admit(a, 4, 0, 2 * G);
  EXPECT_EQ(admit(a, 3, 5 * G, 3 * G), l2);
  a.begin_iteration(*l2, 3, 3 * G);
  a.leave(2, 0);  // l2 shrinks to 3G, but its iteration still runs in 6G
  EXPECT_EQ(a.lane_size(*l2), 3 * G);
  EXPECT_TRUE(a.lane_ready(*l2) == false);  // a move (the shrink) is pending
  std::vector<LaneView> lanes = a.lanes();
  EXPECT_TRUE(view(lanes, *l2)->move_pending);
  EXPECT_EQ(view(lanes, *l3)->offset, std::nullopt);  // its new place is still held
  EXPECT_FALSE(a.lane_ready(*l3));
  EXPECT_EQ(lanes.back().id, *l3);  // unplaced lanes come last
  a.end_iteration(*l2, 1);
  EXPECT_TRUE(a.lane_ready(*l2));
  EXPECT_TRUE(a.lane_ready(*l3));
  EXPECT_EQ(a.lane_offset(*l3), 5 * G);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, EmptyBusyLaneIsDeletedAtItsBoundary) {
  GpuArena a(16 * G);
  const auto l1 = admit(a, 1, 0, 4 * G);
  const auto l2 = admit(a, 2, 0, 4 * G);
  a.begin_iteration(*l1, 1, 1 * G);
  a.leave(1, 0);
  std::vector<LaneView> lanes = a.lanes();
  ASSERT_NE(view(lanes, *l1), nullptr);
  EXPECT_EQ(view(lanes, *l1)->size, 0u);
  EXPECT_TRUE(view(lanes, *l1)->sessions.empty());
  EXPECT_EQ(view(lanes, *l1)->running, 1u);
  EXPECT_EQ(a.memory().lane_total, 4 * G);
  EXPECT_EQ(view(lanes, *l2)->offset, std::nullopt);  // its place is still held by l1
  a.end_iteration(*l1, 1);
  EXPECT_EQ(view(a.lanes(), *l1), nullptr);
  EXPECT_EQ(a.lane_offset(*l2), 0u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, BusyLaneInPlaceStaysReadyForPipelining) {
  GpuArena a(16 * G);
  const auto l1 = admit(a, 1, 0, 4 * G);
  a.begin_iteration(*l1, 1, 4 * G);
  EXPECT_TRUE(a.lane_ready(*l1));
  EXPECT_TRUE(a.lanes()[0].busy);
  EXPECT_EQ(a.lanes()[0].used, 4 * G);
  a.begin_iteration(*l1, 1, 1 * G);  // already busy: ignored
  EXPECT_EQ(a.lanes()[0].used, 4 * G);
  a.end_iteration(*l1, 1);
  EXPECT_FALSE(a.lanes()[0].busy);
  a.begin_iteration(*l1, 1, 5 * G);  // more than the lane: ignored
  a.begin_iteration(*l1, 7, 1 * G);  // not a member: ignored
  EXPECT_FALSE(a.lanes()[0].busy);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, ChangeNeedReQueuesAtTheOriginalPositionAndKeepsBuffers) {
  GpuArena a(10 * G, {QueueMode::strict_fifo, 16, LaneMode::salus});
  const auto l1 = admit(a, 1, 1 * G, 3 * G);
  admit(a, 2, 4 * G, 2 * G);
  const AllocResult buf = a.alloc_persistent(1, 1 * G);
  ASSERT_EQ(buf.error, ArenaError::ok);
  EXPECT_EQ(admit(a, 3, 1 * G, 1 * G), std::nullopt);
  a.take_admissions();
  EXPECT_EQ(a.change_need(1, {3 * G, 6 * G}, 5), ArenaError::ok);
  EXPECT_EQ(queued(a), (std::vector<SessionId>{1, 3}));  // 1 arrived first
  EXPECT_EQ(a.queue()[0].waiting_since, 5);
  EXPECT_EQ(view(a.lanes(), *l1), nullptr);  // its lane emptied and went away
  const auto pl = a.placement(1);
  EXPECT_FALSE(pl->admitted);
  EXPECT_EQ(pl->persistent_used, 1 * G);
  EXPECT_EQ(a.buffer_offset(buf.handle), buf.offset);
  EXPECT_EQ(a.alloc_persistent(1, 1).error, ArenaError::not_admitted);
  // The buffers it holds still count while it waits.
  EXPECT_EQ(a.memory().persistent_reserved, 1 * G + 4 * G);
  a.leave(2, 0);
  const auto adm = a.take_admissions();
  ASSERT_EQ(adm.size(), 2u);
  EXPECT_EQ(adm[0].session, 1u);
  EXPECT_EQ(adm[1].session, 3u);
  EXPECT_EQ(a.lane_size(adm[0].lane), 6 * G);
  EXPECT_EQ(a.buffer_offset(buf.handle), buf.offset);
  EXPECT_EQ(a.memory().persistent_reserved, 3 * G + 1 * G);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, ChangeNeedOfAQueuedRequestKeepsItsPlace) {
  GpuArena a(10 * G);
  admit(a, 1, 0, 9 * G);
  admit(a, 2, 2 * G, 1 * G);
  admit(a, 3, 2 * G, 1 * G);
  EXPECT_EQ(queued(a), (std::vector<SessionId>{2, 3}));
  EXPECT_EQ(a.change_need(2, {1 * G, 0}, 0), ArenaError::ok);
  EXPECT_TRUE(a.placement(2)->admitted);
  EXPECT_EQ(queued(a), (std::vector<SessionId>{3}));
  EXPECT_CLEAN(a);
}

TEST(GpuArena, PersistentBeyondTheDeclaredAmountUntilTheSafetyConditionBreaks) {
  GpuArena a(10 * G);
  admit(a, 1, 1 * G, 4 * G);
  EXPECT_EQ(a.alloc_persistent(1, 1 * G).error, ArenaError::ok);
  EXPECT_EQ(a.alloc_persistent(1, 1 * G).error, ArenaError::ok);  // past P: counts in
  EXPECT_EQ(a.memory().persistent_reserved, 2 * G);
  EXPECT_EQ(a.alloc_persistent(1, 5 * G).error, ArenaError::no_memory);
  EXPECT_EQ(a.alloc_persistent(1, 4 * G).error, ArenaError::ok);
  EXPECT_EQ(a.alloc_persistent(1, 1).error, ArenaError::no_memory);
  EXPECT_EQ(a.alloc_persistent(1, 100 * G).error, ArenaError::no_memory);
  EXPECT_EQ(a.alloc_persistent(9, 1).error, ArenaError::unknown_session);
  EXPECT_EQ(a.memory().free, 0u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, AllocationsAreAligned) {
  GpuArena a(64 * M + 100);  // the unaligned tail is never used
  admit(a, 1, 1 * M, 1 * M);
  for (Bytes size : {Bytes{1}, Bytes{0}, Bytes{255}, Bytes{257}, Bytes{1000}}) {
    const AllocResult r = a.alloc_persistent(1, size);
    ASSERT_EQ(r.error, ArenaError::ok);
    EXPECT_EQ(r.offset % kAlignment, 0u);
    EXPECT_LE(r.offset + std::max<Bytes>(align_up(size), kAlignment), 64 * M);
  }
  EXPECT_EQ(a.placement(1)->persistent_used, 256u + 256 + 256 + 512 + 1024);
  EXPECT_EQ(a.request(2, {1, 1}, 0), ArenaError::ok);
  EXPECT_EQ(a.lane_size(a.placement(2)->lane.value()), kAlignment);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, FreeingUnknownOrFreedHandlesIsHarmless) {
  GpuArena a(16 * M);
  admit(a, 1, 4 * M, 4 * M);
  const AllocResult r = a.alloc_persistent(1, 1 * M);
  a.free_persistent(r.handle);
  a.free_persistent(r.handle);
  a.free_persistent(12345);
  EXPECT_EQ(a.memory().persistent_used, 0u);
  EXPECT_EQ(a.buffer_offset(r.handle), 0u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, FragmentedAllocationCompactsAndThenSucceeds) {
  GpuArena a(16 * M);
  admit(a, 1, 8 * M, 8 * M);  // lane [0, 8M)
  std::vector<AllocResult> b;
  for (int i = 0; i < 4; ++i) b.push_back(a.alloc_persistent(1, 2 * M));
  EXPECT_EQ(b[3].offset, 8 * M);
  a.free_persistent(b[0].handle);  // [14M, 16M)
  a.free_persistent(b[2].handle);  // [10M, 12M)
  EXPECT_FALSE(a.compaction_pending());
  EXPECT_EQ(a.alloc_persistent(1, 4 * M).error, ArenaError::fragmented);
  EXPECT_TRUE(a.compaction_pending());
  EXPECT_GT(a.memory().fragmentation, 0.0);
  // The buffer at [8M, 10M) is in the way of [8M, 12M) and fits the hole at the top.
  const auto moves = a.session_idle(1);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].owner, 1u);
  EXPECT_EQ(moves[0].buffer, b[3].handle);
  EXPECT_EQ(moves[0].from, 8 * M);
  EXPECT_EQ(moves[0].to, 14 * M);
  EXPECT_EQ(a.buffer_offset(b[3].handle), 8 * M);  // unchanged until finish
  EXPECT_TRUE(a.session_idle(1).empty());          // already handed out
  EXPECT_TRUE(a.compaction_pending());
  EXPECT_CLEAN(a);
  a.finish_moves(1, 1);
  EXPECT_FALSE(a.compaction_pending());
  EXPECT_EQ(a.buffer_offset(b[3].handle), 14 * M);
  EXPECT_EQ(a.buffer_offset(b[1].handle), 12 * M);
  EXPECT_EQ(a.stats().persistent_moves, 1u);
  EXPECT_EQ(a.stats().persistent_bytes_moved, 2 * M);
  const AllocResult r = a.alloc_persistent(1, 4 * M);
  ASSERT_EQ(r.error, ArenaError::ok);
  EXPECT_EQ(r.offset, 8 * M);
  EXPECT_EQ(a.memory().fragmentation, 0.0);
  EXPECT_CLEAN(a);
}

// Who must reach an idle moment for compaction to go on, and that a session is
// idle once its lane runs another session's iteration queued behind its own.
TEST(GpuArena, CompactionNamesTheOwnersItWaitsForAndTakesThemBetweenTheirIterations) {
  GpuArena a(16 * M);
  const auto lane = admit(a, 1, 8 * M, 8 * M);  // lane [0, 8M)
  ASSERT_TRUE(lane);
  ASSERT_EQ(admit(a, 2, 0, 8 * M), lane);  // no room for a lane of its own: joins
  std::vector<SessionId> owners;
  std::vector<AllocResult> b;
  for (int i = 0; i < 4; ++i) b.push_back(a.alloc_persistent(1, 2 * M));
  a.free_persistent(b[0].handle);
  a.free_persistent(b[2].handle);
  a.compaction_owners(owners);
  EXPECT_TRUE(owners.empty());
  EXPECT_EQ(a.alloc_persistent(1, 4 * M).error, ArenaError::fragmented);
  a.compaction_owners(owners);
  EXPECT_EQ(owners, std::vector<SessionId>{1});  // 2 owns nothing
  a.begin_iteration(*lane, 1, 1 * M);
  EXPECT_TRUE(a.session_idle(1).empty());  // its iteration runs
  a.lane_running(*lane, 2);                // 2's is queued behind it and runs now
  const auto moves = a.session_idle(1);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].from, 8 * M);
  a.finish_moves(1, 1);
  a.compaction_owners(owners);
  EXPECT_TRUE(owners.empty());
  a.end_iteration(*lane, 2);
  EXPECT_EQ(a.alloc_persistent(1, 4 * M).error, ArenaError::ok);
  EXPECT_CLEAN(a);
}

// When best fit places every buffer in the way, only their owners are named: a
// session whose buffer a slide would have moved keeps its pipelining.
TEST(GpuArena, CompactionNamesOnlyTheOwnersBestFitMovesWhenItPlacesThemAll) {
  GpuArena a(16 * M);
  const auto lane = admit(a, 1, 6 * M, 8 * M);  // lane [0, 8M)
  ASSERT_TRUE(lane);
  ASSERT_EQ(admit(a, 2, 2 * M, 8 * M), lane);
  // From the top: [14M, 16M) 1's, [12M, 14M) 2's, [10M, 12M) and [8M, 10M) 1's.
  std::vector<AllocResult> b;
  for (SessionId owner : {1u, 2u, 1u, 1u}) b.push_back(a.alloc_persistent(owner, 2 * M));
  ASSERT_EQ(b[1].offset, 12 * M);
  a.free_persistent(b[0].handle);
  a.free_persistent(b[2].handle);
  // [8M, 12M) is wanted; 1's buffer at [8M, 10M) fits the hole at the top. A
  // slide would pack 2's and 1's under the top, moving 2's too.
  EXPECT_EQ(a.alloc_persistent(1, 4 * M).error, ArenaError::fragmented);
  std::vector<SessionId> owners;
  a.compaction_owners(owners);
  EXPECT_EQ(owners, std::vector<SessionId>{1});
  EXPECT_TRUE(a.session_idle(2).empty());
  const auto moves = a.session_idle(1);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].to, 14 * M);
  a.finish_moves(1, 1);
  EXPECT_EQ(a.alloc_persistent(1, 4 * M).error, ArenaError::ok);
  EXPECT_CLEAN(a);
}

// Seeded layouts of four sessions' buffers with holes, then an allocation that
// fits the free bytes but no hole: the sessions compaction_owners names at the
// start (whose pipelining the broker holds) are sessions the compaction then
// moves buffers of, round after round until the goal is reached, and every
// session that gets moves was named in its round. Over-naming would cost a
// bystander its overlap; under-naming, progress.
TEST(GpuArena, CompactionHoldsExactlyTheOwnersItMoves) {
  int compactions = 0, slides = 0;
  for (std::uint32_t seed = 1; seed <= 2000; ++seed) {
    std::mt19937 rng(seed);
    GpuArena a(64 * M);
    for (SessionId id = 1; id <= 4; ++id) ASSERT_TRUE(admit(a, id, 10 * M, 8 * M));
    std::vector<std::pair<SessionId, AllocResult>> live;
    for (int i = 0; i < 40; ++i) {
      const SessionId owner = 1 + rng() % 4;
      const AllocResult r = a.alloc_persistent(owner, (1 + rng() % 3) * M);
      if (r.error == ArenaError::ok) live.push_back({owner, r});
    }
    std::shuffle(live.begin(), live.end(), rng);
    for (std::size_t i = 0; i < live.size() / 2; ++i) a.free_persistent(live[i].second.handle);
    // The asker asks for all it may still hold, which the holes rarely give at once.
    const SessionId asker = 1 + rng() % 4;
    Bytes held = 0;
    for (std::size_t i = live.size() / 2; i < live.size(); ++i)
      if (live[i].first == asker) held += a.buffer_size(live[i].second.handle);
    if (held > 7 * M) continue;
    const AllocResult ask = a.alloc_persistent(asker, 10 * M - held);
    if (ask.error != ArenaError::fragmented) continue;
    ++compactions;
    std::vector<SessionId> first, named;
    a.compaction_owners(first);
    std::set<SessionId> moved;
    std::uint64_t t = 1;
    for (int round = 0; round < 64 && a.compaction_pending(); ++round) {
      a.compaction_owners(named);
      for (SessionId id = 1; id <= 4; ++id) {
        const auto moves = a.session_idle(id);
        if (moves.empty()) continue;
        EXPECT_TRUE(std::binary_search(named.begin(), named.end(), id)) << "seed " << seed;
        moved.insert(id);
        slides += moves.size() > 1;
        a.finish_moves(id, t++);
      }
    }
    EXPECT_FALSE(a.compaction_pending()) << "seed " << seed;
    for (SessionId id : first)
      EXPECT_TRUE(moved.count(id))
          << "seed " << seed << ": session " << id << " was held but none of its buffers moved";
    EXPECT_CLEAN(a);
  }
  EXPECT_GT(compactions, 200);  // the layouts do fragment (377 of 2000 seeds)
  EXPECT_GT(slides, 0);
}

TEST(GpuArena, PersistentBuffersBlockingANewLaneGetCompacted) {
  GpuArena a(16 * M);
  admit(a, 1, 0, 4 * M);
  admit(a, 2, 4 * M, 0);
  std::vector<AllocResult> b;
  for (int i = 0; i < 3; ++i) b.push_back(a.alloc_persistent(2, 2 * M));
  ASSERT_EQ(b[2].offset, 10 * M);
  a.free_persistent(b[0].handle);
  a.free_persistent(b[1].handle);
  // Session 3's new 8M lane would cover [4M, 12M): the accounting fits, but the buffer at
  // 10M is in the way, so 3 waits and compaction is planned.
  EXPECT_EQ(admit(a, 3, 0, 8 * M), std::nullopt);
  EXPECT_TRUE(a.compaction_pending());
  EXPECT_TRUE(a.session_idle(3).empty());  // owns nothing
  const auto moves = a.session_idle(2);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].from, 10 * M);
  EXPECT_EQ(moves[0].to, 14 * M);
  a.take_admissions();
  a.finish_moves(2, 1);
  const auto adm = a.take_admissions();
  ASSERT_EQ(adm.size(), 1u);
  EXPECT_EQ(adm[0].session, 3u);
  EXPECT_EQ(a.lane_offset(adm[0].lane), 4 * M);
  EXPECT_TRUE(a.lane_ready(adm[0].lane));
  EXPECT_FALSE(a.compaction_pending());
  EXPECT_EQ(a.stats().persistent_moves, 1u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, LeavingWithMovesOutDropsThem) {
  GpuArena a(16 * M);
  admit(a, 1, 8 * M, 8 * M);
  std::vector<AllocResult> b;
  for (int i = 0; i < 4; ++i) b.push_back(a.alloc_persistent(1, 2 * M));
  a.free_persistent(b[0].handle);
  a.free_persistent(b[2].handle);
  ASSERT_EQ(a.alloc_persistent(1, 4 * M).error, ArenaError::fragmented);
  ASSERT_FALSE(a.session_idle(1).empty());
  a.leave(1, 0);
  EXPECT_FALSE(a.compaction_pending());
  a.finish_moves(1, 0);  // too late: nothing happens
  EXPECT_EQ(a.memory().largest_hole, 16 * M);
  EXPECT_TRUE(a.physical_regions().empty());
  EXPECT_CLEAN(a);
}

TEST(GpuArena, SessionIdleRefusesWhileItsIterationRuns) {
  GpuArena a(16 * M);
  const auto l = admit(a, 1, 8 * M, 8 * M);
  std::vector<AllocResult> b;
  for (int i = 0; i < 2; ++i) b.push_back(a.alloc_persistent(1, 2 * M));
  a.free_persistent(b[0].handle);
  ASSERT_EQ(a.alloc_persistent(1, 6 * M).error, ArenaError::fragmented);
  a.begin_iteration(*l, 1, 1 * M);
  EXPECT_TRUE(a.session_idle(1).empty());
  a.end_iteration(*l, 1);
  EXPECT_EQ(a.session_idle(1).size(), 1u);
  EXPECT_CLEAN(a);
}

TEST(GpuArena, MovedOutGpuArenaStillWorks) {
  GpuArena a(16 * M);
  admit(a, 1, 1 * M, 1 * M);
  GpuArena b = std::move(a);
  EXPECT_TRUE(b.placement(1)->admitted);
  EXPECT_EQ(b.capacity(), 16 * M);
  EXPECT_CLEAN(b);
}

TEST(GpuArena, ErrorNamesAreStable) {
  EXPECT_STREQ(to_string(ArenaError::fragmented), "fragmented");
  EXPECT_STREQ(to_string(ArenaError::no_memory), "no_memory");
}

// Issue 17 item 4: a session that sends `need` again while its iteration runs must not
// hold up the admission of others while that iteration drains.
TEST(GpuArena, ReNeedDuringAnIterationDoesNotBlockOthers) {
  GpuArena a(256 * M);
  const auto l1 = admit(a, 1, 0, 1 * M);
  ASSERT_TRUE(l1);
  a.begin_iteration(*l1, 1, 1 * M);
  EXPECT_EQ(a.change_need(1, {0, 1 * M}, 0), ArenaError::ok);
  for (SessionId s = 2; s < 40; ++s) {
    EXPECT_TRUE(admit(a, s, 0, 1 * M).has_value()) << "session " << s;
    EXPECT_CLEAN(a);
  }
  a.end_iteration(*l1, 1);
  EXPECT_TRUE(a.placement(1)->admitted);
  EXPECT_CLEAN(a);
}

// The same when the new need cannot be placed beside the lane its iteration still holds:
// while it waits on its own drain it is passed over without using up the bypass bound,
// and once drained it is admitted before the newcomers that arrive after that.
TEST(GpuArena, ReNeedWaitingOnItsOwnDrainIsNotAHeadOthersWaitBehind) {
  for (QueueMode mode : {QueueMode::bounded_bypass, QueueMode::strict_fifo}) {
    GpuArena a(256 * M, {mode, 2, LaneMode::lane_per_session});
    const auto l1 = admit(a, 1, 0, 200 * M);
    ASSERT_TRUE(l1);
    a.begin_iteration(*l1, 1, 1 * M);
    EXPECT_EQ(a.change_need(1, {0, 200 * M}, 0), ArenaError::ok);
    EXPECT_FALSE(a.placement(1)->admitted);
    for (SessionId s = 2; s < 20; ++s) {
      EXPECT_TRUE(admit(a, s, 0, 1 * M).has_value()) << "session " << s;
      EXPECT_CLEAN(a);
    }
    for (SessionId s = 2; s < 20; ++s) a.leave(s, 0);
    a.end_iteration(*l1, 1);
    EXPECT_TRUE(a.placement(1)->admitted);
    EXPECT_CLEAN(a);
  }
}

}  // namespace
}  // namespace salus::arena
