// Golden scenarios from the Salus paper (MLSys'20): the Figure 6 deadlock that lanes
// avoid, and the Figure 7 auto-defragmentation at an iteration boundary.
#include <gtest/gtest.h>

#include <vector>

#include "arena/gpu_arena.hpp"

namespace salus::arena {
namespace {

constexpr Bytes M = Bytes{1} << 20;
constexpr Bytes G = Bytes{1} << 30;

const LaneView* view(const std::vector<LaneView>& lanes, LaneId id) {
  for (const LaneView& v : lanes)
    if (v.id == id) return &v;
  return nullptr;
}

// Figure 6: two jobs with P = 1G and E = 7G on a 12G GPU. Running their iterations side
// by side deadlocks once both have allocated part of their 7G. Algorithm 1 gives them
// one lane, so their iterations take turns and each has all 7G when it runs.
TEST(PaperGolden, Figure6JobsShareOneLaneInsteadOfDeadlocking) {
  GpuArena a(12 * G);
  ASSERT_EQ(a.request(1, {1 * G, 7 * G}, 0), ArenaError::ok);
  ASSERT_EQ(a.request(2, {1 * G, 7 * G}, 1), ArenaError::ok);
  const auto adm = a.take_admissions();
  ASSERT_EQ(adm.size(), 2u);
  ASSERT_EQ(adm[0].lane, adm[1].lane);
  const LaneId lane = adm[0].lane;
  ASSERT_EQ(a.lanes().size(), 1u);
  EXPECT_EQ(a.lane_size(lane), 7 * G);
  EXPECT_EQ(a.memory().lane_total + a.memory().persistent_reserved, 9 * G);

  ASSERT_EQ(a.alloc_persistent(1, 1 * G).error, ArenaError::ok);
  ASSERT_EQ(a.alloc_persistent(2, 1 * G).error, ArenaError::ok);
  TimeNs now = 2;
  for (int round = 0; round < 10; ++round) {
    for (SessionId s : {SessionId{1}, SessionId{2}}) {
      const SessionId other = s == 1 ? 2 : 1;
      ASSERT_TRUE(a.lane_ready(lane));
      a.begin_iteration(lane, s, 7 * G);      // the whole 7G, however it is handed out
      a.begin_iteration(lane, other, 7 * G);  // serialized: the other waits its turn
      const LaneView v = a.lanes().at(0);
      EXPECT_TRUE(v.busy);
      EXPECT_EQ(v.running, s);
      EXPECT_EQ(v.used, 7 * G);
      EXPECT_EQ(a.lanes().size(), 1u);
      a.end_iteration(lane, now++);
      EXPECT_EQ(a.check_invariants(), "");
    }
  }
  a.leave(1, now++);
  EXPECT_EQ(a.lanes().size(), 1u);
  EXPECT_EQ(a.lane_size(lane), 7 * G);
  a.begin_iteration(lane, 2, 7 * G);
  a.end_iteration(lane, now++);
  a.leave(2, now++);
  EXPECT_TRUE(a.lanes().empty());
  const MemorySummary m = a.memory();
  EXPECT_EQ(m.free, 12 * G);
  EXPECT_EQ(m.largest_hole, 12 * G);
  EXPECT_EQ(a.stats().lanes_opened, 1u);
  EXPECT_EQ(a.stats().lanes_closed, 1u);
  EXPECT_EQ(a.check_invariants(), "");
}

// Figure 7: three lanes; the job in the middle one stops while the top lane is running.
// The top lane keeps its place until its iteration ends, then slides down into the gap,
// and the job that was waiting for that room is admitted right after.
TEST(PaperGolden, Figure7TopLaneSlidesDownAtItsBoundaryAndFreesRoom) {
  GpuArena a(16 * G);
  const Bytes half = 512 * M;
  for (SessionId s : {1, 2, 3}) {
    ASSERT_EQ(a.request(s, {half, 4 * G}, 0), ArenaError::ok);
    ASSERT_EQ(a.alloc_persistent(s, half).error, ArenaError::ok);
  }
  const auto adm = a.take_admissions();
  ASSERT_EQ(adm.size(), 3u);
  const LaneId bottom = adm[0].lane, middle = adm[1].lane, top = adm[2].lane;
  EXPECT_EQ(a.lane_offset(bottom), 0u);
  EXPECT_EQ(a.lane_offset(middle), 4 * G);
  EXPECT_EQ(a.lane_offset(top), 8 * G);

  // 2.5G of slack: a new 6.5G lane does not fit, nor does growing a 4G lane.
  ASSERT_EQ(a.request(4, {half, 6 * G + half}, 1), ArenaError::ok);
  EXPECT_TRUE(a.take_admissions().empty());

  a.begin_iteration(top, 3, 3 * G);
  a.begin_iteration(bottom, 1, 1 * G);
  a.leave(2, 2);
  EXPECT_EQ(view(a.lanes(), middle), nullptr);
  // The accounting now has room for session 4's lane at [8G, 14.5G), but the busy top
  // lane still sits at [8G, 12G).
  EXPECT_EQ(a.lane_offset(top), 8 * G);
  EXPECT_FALSE(a.lane_ready(top));
  EXPECT_TRUE(view(a.lanes(), top)->move_pending);
  EXPECT_TRUE(a.take_admissions().empty());
  EXPECT_EQ(a.queue().size(), 1u);
  EXPECT_EQ(a.check_invariants(), "");

  a.end_iteration(top, 3);
  EXPECT_EQ(a.lane_offset(top), 4 * G);
  EXPECT_TRUE(a.lane_ready(top));
  EXPECT_EQ(a.stats().lane_moves, 1u);
  const auto late = a.take_admissions();
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].session, 4u);
  EXPECT_EQ(a.lane_offset(late[0].lane), 8 * G);
  EXPECT_TRUE(a.lane_ready(late[0].lane));
  EXPECT_EQ(a.lane_offset(bottom), 0u);  // the busy bottom lane never moved
  EXPECT_TRUE(view(a.lanes(), bottom)->busy);
  EXPECT_EQ(a.memory().free, 0u);
  EXPECT_EQ(a.check_invariants(), "");
}

}  // namespace
}  // namespace salus::arena
