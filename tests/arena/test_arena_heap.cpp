// The free map and the persistent heap on their own: best fit, coalescing, alignment,
// and the shape of compaction plans.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "arena/persistent_heap.hpp"
#include "arena/space_map.hpp"

namespace salus::arena {
namespace {

constexpr Bytes K = 1024;

std::vector<std::pair<Bytes, Bytes>> holes(const SpaceMap& m) {
  std::vector<std::pair<Bytes, Bytes>> out;
  m.for_each_hole([&](Bytes b, Bytes e) { out.emplace_back(b, e); });
  return out;
}

TEST(SpaceMap, TakeSplitsAndGiveCoalescesBothSides) {
  SpaceMap m(64 * K);
  EXPECT_TRUE(m.take(16 * K, 32 * K));
  EXPECT_EQ(holes(m), (std::vector<std::pair<Bytes, Bytes>>{{0, 16 * K}, {32 * K, 64 * K}}));
  EXPECT_TRUE(m.take(0, 16 * K));
  EXPECT_TRUE(m.take(32 * K, 48 * K));
  EXPECT_EQ(m.free_bytes(), 16 * K);
  // Freeing the middle piece first leaves it alone; freeing its neighbours merges all three.
  EXPECT_TRUE(m.give(16 * K, 32 * K));
  EXPECT_EQ(m.hole_count(), 2u);
  EXPECT_TRUE(m.give(0, 16 * K));
  EXPECT_EQ(m.hole_count(), 2u);
  EXPECT_TRUE(m.give(32 * K, 48 * K));
  EXPECT_EQ(holes(m), (std::vector<std::pair<Bytes, Bytes>>{{0, 64 * K}}));
  EXPECT_EQ(m.largest_hole(), 64 * K);
}

TEST(SpaceMap, RejectsTakingHeldBytesAndGivingFreeOnes) {
  SpaceMap m(64 * K);
  ASSERT_TRUE(m.take(8 * K, 16 * K));
  EXPECT_FALSE(m.take(12 * K, 20 * K));
  EXPECT_FALSE(m.give(4 * K, 12 * K));   // partly free already
  EXPECT_FALSE(m.give(60 * K, 72 * K));  // past the end
  EXPECT_EQ(m.free_bytes(), 56 * K);
  EXPECT_FALSE(m.is_free(15 * K, 17 * K));
  EXPECT_TRUE(m.is_free(16 * K, 17 * K));
  EXPECT_TRUE(m.is_free(9 * K, 9 * K));  // empty ranges are free
}

TEST(SpaceMap, BestFitPicksTheSmallestHoleAndItsTopEnd) {
  SpaceMap m(100 * K);
  ASSERT_TRUE(m.take(0, 100 * K));
  ASSERT_TRUE(m.give(10 * K, 30 * K));  // 20K
  ASSERT_TRUE(m.give(40 * K, 48 * K));  // 8K
  ASSERT_TRUE(m.give(60 * K, 72 * K));  // 12K
  EXPECT_EQ(m.best_fit_top(8 * K, 0), 40 * K);
  EXPECT_EQ(m.best_fit_top(9 * K, 0), 72 * K - 9 * K);
  EXPECT_EQ(m.best_fit_top(13 * K, 0), 30 * K - 13 * K);
  EXPECT_EQ(m.best_fit_top(21 * K, 0), std::nullopt);
}

TEST(SpaceMap, BestFitTieGoesToTheHigherHole) {
  SpaceMap m(100 * K);
  ASSERT_TRUE(m.take(0, 100 * K));
  ASSERT_TRUE(m.give(10 * K, 20 * K));
  ASSERT_TRUE(m.give(50 * K, 60 * K));
  EXPECT_EQ(m.best_fit_top(4 * K, 0), 56 * K);
}

TEST(SpaceMap, BestFitOnlyUsesBytesAboveTheFloor) {
  SpaceMap m(100 * K);
  ASSERT_TRUE(m.take(0, 100 * K));
  ASSERT_TRUE(m.give(10 * K, 40 * K));               // straddles a floor at 30K: 10K usable
  ASSERT_TRUE(m.give(60 * K, 76 * K));               // 16K
  ASSERT_TRUE(m.give(2 * K, 6 * K));                 // wholly below the floor
  EXPECT_EQ(m.best_fit_top(8 * K, 30 * K), 32 * K);  // the straddling hole is the tighter fit
  EXPECT_EQ(m.best_fit_top(12 * K, 30 * K), 64 * K);
  EXPECT_EQ(m.best_fit_top(4 * K, 50 * K), 72 * K);
  EXPECT_EQ(m.best_fit_top(17 * K, 30 * K), std::nullopt);
}

TEST(PersistentHeap, GrowsDownFromTheTopAndCoalescesOnFree) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  const auto a = heap.allocate(space, 1, 4 * K, 0);
  const auto b = heap.allocate(space, 1, 4 * K, 0);
  const auto c = heap.allocate(space, 2, 4 * K, 0);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(heap.find(*a)->offset, 60 * K);
  EXPECT_EQ(heap.find(*b)->offset, 56 * K);
  EXPECT_EQ(heap.find(*c)->offset, 52 * K);
  EXPECT_TRUE(heap.contiguous());
  ASSERT_TRUE(heap.release(space, *b));
  EXPECT_FALSE(heap.contiguous());
  EXPECT_EQ(space.hole_count(), 2u);
  ASSERT_TRUE(heap.release(space, *a));
  EXPECT_EQ(space.hole_count(), 2u);  // [56K, 64K) is one hole now
  EXPECT_EQ(space.best_fit_top(8 * K, 0), 56 * K);
  EXPECT_FALSE(heap.release(space, *a));  // double free: nothing happens
  EXPECT_EQ(heap.used(), 4 * K);
}

TEST(PersistentHeap, BestFitFillsTheTightestHole) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  std::vector<BufferHandle> h;
  for (Bytes size : {2 * K, 8 * K, 4 * K, 8 * K, 2 * K})
    h.push_back(*heap.allocate(space, 1, size, 0));
  // From the top: 2K, 8K, 4K, 8K, 2K, then 40K free. Freeing both 8K buffers leaves two
  // 8K holes; above a 32K floor the 40K hole only offers 8K as well.
  heap.release(space, h[1]);  // [54K, 62K)
  heap.release(space, h[3]);  // [42K, 50K)
  const auto small = heap.allocate(space, 1, 4 * K, 32 * K);
  ASSERT_TRUE(small);
  // Both 8K holes fit; the higher one is used, at its top end.
  EXPECT_EQ(heap.find(*small)->offset, 58 * K);
}

TEST(PersistentHeap, NeverPlacesBelowTheFloor) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  ASSERT_TRUE(space.take(48 * K, 64 * K));  // the top is taken by something else
  EXPECT_FALSE(heap.allocate(space, 1, 20 * K, 30 * K));
  const auto h = heap.allocate(space, 1, 16 * K, 30 * K);
  ASSERT_TRUE(h);
  EXPECT_EQ(heap.find(*h)->offset, 32 * K);
}

TEST(PersistentHeap, CompactionMovesBlockingBuffersIntoHolesAbove) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  const auto top = *heap.allocate(space, 1, 8 * K, 0);  // [56K, 64K)
  const auto mid = *heap.allocate(space, 2, 8 * K, 0);  // [48K, 56K)
  const auto low = *heap.allocate(space, 1, 8 * K, 0);  // [40K, 48K)
  heap.release(space, top);
  EXPECT_TRUE(heap.plan_moves(space, 1, 0).empty());  // nobody asked for room yet
  heap.request_room(40 * K);
  EXPECT_FALSE(heap.compaction_pending(0));  // [0, 40K) is clear already
  heap.settle_compaction(0);
  heap.request_room(44 * K);
  EXPECT_TRUE(heap.compaction_pending(0));
  EXPECT_TRUE(heap.plan_moves(space, 2, 0).empty());  // its buffer is not in the way
  const auto moves = heap.plan_moves(space, 1, 0);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].buffer, low);
  EXPECT_EQ(moves[0].from, 40 * K);
  EXPECT_EQ(moves[0].to, 56 * K);
  EXPECT_EQ(moves[0].size, 8 * K);
  EXPECT_EQ(heap.find(low)->offset, 40 * K);          // unchanged until finish
  EXPECT_TRUE(heap.plan_moves(space, 1, 0).empty());  // already out
  EXPECT_TRUE(heap.compaction_pending(0));
  const auto done = heap.finish_moves(space, 1);
  EXPECT_EQ(done.buffers, 1u);
  EXPECT_EQ(done.bytes, 8 * K);
  EXPECT_EQ(heap.find(low)->offset, 56 * K);
  EXPECT_EQ(heap.find(mid)->offset, 48 * K);  // never moved: it was not in the way
  EXPECT_FALSE(heap.compaction_pending(0));
  heap.settle_compaction(0);
  EXPECT_EQ(space.largest_hole(), 48 * K);
}

TEST(PersistentHeap, WhenNoHoleTakesABlockerTheLowestBuffersSlide) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  const auto a = *heap.allocate(space, 1, 8 * K, 0);  // [56K, 64K)
  const auto gap1 = *heap.allocate(space, 1, 4 * K, 0);
  const auto b = *heap.allocate(space, 1, 8 * K, 0);  // [44K, 52K)
  const auto gap2 = *heap.allocate(space, 1, 4 * K, 0);
  const auto c = *heap.allocate(space, 1, 8 * K, 0);  // [32K, 40K)
  heap.release(space, gap1);
  heap.release(space, gap2);
  heap.request_room(36 * K);  // C is in the way and neither 4K hole takes it
  const auto moves = heap.plan_moves(space, 1, 0);
  // Only C slides, up under B: 4K at a time, top chunk first.
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0].buffer, c);
  EXPECT_EQ(moves[0].from, 36 * K);
  EXPECT_EQ(moves[0].to, 40 * K);
  EXPECT_EQ(moves[1].from, 32 * K);
  EXPECT_EQ(moves[1].to, 36 * K);
  heap.finish_moves(space, 1);
  EXPECT_EQ(heap.find(c)->offset, 36 * K);
  EXPECT_EQ(heap.find(b)->offset, 44 * K);
  EXPECT_EQ(heap.find(a)->offset, 56 * K);
  EXPECT_FALSE(heap.compaction_pending(0));
}

TEST(PersistentHeap, ShortSlideIsChunkedTopFirst) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  const auto a = *heap.allocate(space, 1, 1 * K, 0);   // [63K, 64K)
  const auto b = *heap.allocate(space, 1, 10 * K, 0);  // [53K, 63K)
  heap.release(space, a);
  // A floor at 44K leaves no free place outside the slide for a two-step move.
  heap.request_room(10 * K);
  const auto moves = heap.plan_moves(space, 1, 44 * K);
  ASSERT_EQ(moves.size(), 10u);
  Bytes total = 0;
  for (std::size_t i = 0; i < moves.size(); ++i) {
    const PersistentMove& m = moves[i];
    EXPECT_EQ(m.buffer, b);
    EXPECT_EQ(m.to - m.from, 1 * K);
    EXPECT_LE(m.size, m.to - m.from);  // source and destination are disjoint
    if (i > 0) {
      EXPECT_EQ(m.from + m.size, moves[i - 1].from);  // top chunk first
    }
    total += m.size;
  }
  EXPECT_EQ(total, 10 * K);
  // Copying in the listed order carries every byte of the buffer one K up.
  std::vector<int> mem(64, -1);
  for (int i = 53; i < 63; ++i) mem[i] = i;
  for (const PersistentMove& m : moves)
    for (Bytes k = 0; k < m.size / K; ++k) mem[m.to / K + k] = mem[m.from / K + k];
  for (int i = 54; i < 64; ++i) EXPECT_EQ(mem[i], i - 1);
  heap.finish_moves(space, 1);
  EXPECT_EQ(heap.find(b)->offset, 54 * K);
  EXPECT_TRUE(heap.contiguous());
}

TEST(PersistentHeap, ShortSlideGoesThroughAStagingPlaceWhenThereIsOne) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  const auto a = *heap.allocate(space, 1, 1 * K, 0);   // [63K, 64K)
  const auto b = *heap.allocate(space, 1, 10 * K, 0);  // [53K, 63K)
  heap.release(space, a);
  heap.request_room(54 * K);
  auto moves = heap.plan_moves(space, 1, 0);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].from, 53 * K);
  EXPECT_EQ(moves[0].to, 43 * K);  // the top of the free space below, whole
  EXPECT_EQ(moves[0].size, 10 * K);
  heap.finish_moves(space, 1);
  EXPECT_EQ(heap.find(b)->offset, 43 * K);
  EXPECT_TRUE(heap.compaction_pending(0));
  EXPECT_TRUE(heap.intersects(54 * K, 64 * K));  // the final place stays held
  EXPECT_FALSE(space.is_free(54 * K, 55 * K));
  moves = heap.plan_moves(space, 1, 0);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].from, 43 * K);
  EXPECT_EQ(moves[0].to, 54 * K);
  heap.finish_moves(space, 1);
  EXPECT_EQ(heap.find(b)->offset, 54 * K);
  EXPECT_FALSE(heap.compaction_pending(0));
  EXPECT_EQ(space.free_bytes(), 54 * K);
}

TEST(PersistentHeap, GoalIsLimitedToTheFreeBytesAboveTheFloor) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  heap.allocate(space, 1, 8 * K, 0);  // [56K, 64K)
  const auto mid = *heap.allocate(space, 1, 8 * K, 0);
  heap.allocate(space, 1, 8 * K, 0);  // [40K, 48K)
  heap.request_room(1000 * K);
  EXPECT_FALSE(heap.compaction_pending(0));  // packed: [0, 40K), all there is, is clear
  heap.release(space, mid);
  EXPECT_TRUE(heap.compaction_pending(0));       // [0, 48K) could be clear now
  EXPECT_TRUE(heap.compaction_pending(30 * K));  // [30K, 48K)
  heap.settle_compaction(0);
  EXPECT_TRUE(heap.compaction_pending(0));  // not reached: the goal stays
}

TEST(PersistentHeap, FreeingABufferWithAMoveOutReleasesItsDestination) {
  SpaceMap space(64 * K);
  PersistentHeap heap(64 * K);
  const auto a = *heap.allocate(space, 1, 8 * K, 0);
  const auto b = *heap.allocate(space, 1, 8 * K, 0);
  heap.release(space, a);
  heap.request_room(56 * K);
  ASSERT_EQ(heap.plan_moves(space, 1, 0).size(), 1u);
  EXPECT_TRUE(heap.intersects(56 * K, 64 * K));  // the destination is held
  heap.release(space, b);
  EXPECT_FALSE(heap.any_outstanding());
  EXPECT_EQ(space.free_bytes(), 64 * K);
  EXPECT_FALSE(heap.finish_moves(space, 1).had_moves);
  EXPECT_FALSE(heap.compaction_pending(0));
}

}  // namespace
}  // namespace salus::arena
