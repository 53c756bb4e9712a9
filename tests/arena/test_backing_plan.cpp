// The on-demand backing plan against a chunk-by-chunk reference on seeded random
// layouts, plus the cases a reader checks by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <random>
#include <set>

#include "arena/backing_plan.hpp"

namespace salus::arena {
namespace {

constexpr Bytes kChunk = Bytes{2} << 20;

std::set<std::uint64_t> expand(const std::vector<ChunkRun>& runs) {
  std::set<std::uint64_t> out;
  for (const ChunkRun& r : runs)
    for (std::uint64_t i = r.first; i < r.first + r.count; ++i) out.insert(i);
  return out;
}

// Runs must be sorted, non-empty, and neither overlap nor touch.
void expect_canonical(const std::vector<ChunkRun>& runs) {
  for (std::size_t i = 0; i < runs.size(); ++i) {
    EXPECT_GT(runs[i].count, 0u);
    if (i > 0) {
      EXPECT_GT(runs[i].first, runs[i - 1].first + runs[i - 1].count);
    }
  }
}

TEST(BackingPlan, MergesTouchingAndOverlappingRanges) {
  const auto m = merge_ranges({{100, 50}, {0, 100}, {300, 0}, {120, 10}, {400, 8}});
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], (ByteRange{0, 150}));
  EXPECT_EQ(m[1], (ByteRange{400, 8}));
}

TEST(BackingPlan, MergeToAtMostBridgesTheSmallestGapsAndCoversEveryByte) {
  const std::vector<ByteRange> four = {{0, 10}, {12, 10}, {100, 10}, {111, 10}};
  EXPECT_EQ(merge_to_at_most(four, 4), four);
  EXPECT_EQ(merge_to_at_most(four, 2), (std::vector<ByteRange>{{0, 22}, {100, 21}}));
  EXPECT_EQ(merge_to_at_most(four, 1), (std::vector<ByteRange>{{0, 121}}));
  for (std::uint64_t seed = 1; seed <= 500; ++seed) {
    std::mt19937_64 rng(seed);
    std::vector<ByteRange> raw;
    for (int n = 1 + static_cast<int>(rng() % 40); n > 0; --n)
      raw.push_back({rng() % 100'000, 1 + rng() % 500});
    const auto ranges = merge_ranges(raw);
    const std::size_t limit = 1 + rng() % 10;
    const auto out = merge_to_at_most(ranges, limit);
    ASSERT_LE(out.size(), std::max(limit, std::size_t{1})) << "seed " << seed;
    ASSERT_EQ(merge_ranges(out), out) << "seed " << seed;  // sorted, disjoint
    for (const ByteRange& r : ranges) {
      const bool covered = std::any_of(out.begin(), out.end(), [&](const ByteRange& o) {
        return o.offset <= r.offset && r.offset + r.size <= o.offset + o.size;
      });
      ASSERT_TRUE(covered) << "seed " << seed;
    }
  }
}

TEST(BackingPlan, ChunksCoverPartialChunksWhole) {
  // One byte in chunk 0, a range across chunks 2-3, one in chunk 4 (adjacent: merged).
  const auto runs =
      chunks_covering({{kChunk - 1, 1}, {2 * kChunk + 5, kChunk}, {4 * kChunk, 1}}, kChunk);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], (ChunkRun{0, 1}));
  EXPECT_EQ(runs[1], (ChunkRun{2, 3}));
  EXPECT_TRUE(chunks_covering({}, kChunk).empty());
}

TEST(BackingPlan, ChangeMapsTheMissingAndUnmapsTheUnwanted) {
  std::vector<bool> backed = {true, true, false, false, true, false};
  const auto c = backing_change(backed, {{1, 3}, {7, 1}});
  EXPECT_EQ(c.map, (std::vector<ChunkRun>{{2, 2}, {7, 1}}));
  EXPECT_EQ(c.unmap, (std::vector<ChunkRun>{{0, 1}, {4, 1}}));
  const auto none = backing_change(backed, {{0, 2}, {4, 1}});
  EXPECT_TRUE(none.map.empty());
  EXPECT_TRUE(none.unmap.empty());
}

TEST(BackingPlan, SplitRunCutsIntoConsecutivePiecesOfAtMostN) {
  EXPECT_EQ(split_run({10, 7}, 3), (std::vector<ChunkRun>{{10, 3}, {13, 3}, {16, 1}}));
  EXPECT_EQ(split_run({0, 6}, 3), (std::vector<ChunkRun>{{0, 3}, {3, 3}}));
  EXPECT_EQ(split_run({5, 2}, 64), (std::vector<ChunkRun>{{5, 2}}));
  EXPECT_TRUE(split_run({5, 0}, 4).empty());
  EXPECT_EQ(split_run({1, 2}, 0), (std::vector<ChunkRun>{{1, 1}, {2, 1}}));
}

// covers and intersect_ranges against a byte-by-byte reference on seeded
// random merged lists.
TEST(BackingPlan, CoversAndIntersectAgreeWithAByteReference) {
  constexpr Bytes kSpace = 256;
  auto random_list = [](std::mt19937_64& rng) {
    std::vector<ByteRange> v;
    for (int n = static_cast<int>(rng() % 6); n > 0; --n)
      v.push_back({rng() % kSpace, 1 + rng() % 40});
    for (ByteRange& r : v) r.size = std::min(r.size, kSpace - r.offset);
    return merge_ranges(std::move(v));
  };
  auto bytes = [](const std::vector<ByteRange>& v) {
    std::set<Bytes> out;
    for (const ByteRange& r : v)
      for (Bytes b = r.offset; b < r.offset + r.size; ++b) out.insert(b);
    return out;
  };
  for (std::uint64_t seed = 1; seed <= 2000; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    const auto a = random_list(rng);
    auto b = rng() % 3 == 0 ? intersect_ranges(a, random_list(rng)) : random_list(rng);
    const auto ba = bytes(a), bb = bytes(b);
    const bool inside = std::includes(ba.begin(), ba.end(), bb.begin(), bb.end());
    ASSERT_EQ(covers(a, b), inside);
    const auto both = intersect_ranges(a, b);
    ASSERT_EQ(both, merge_ranges(both)) << "not merged";
    std::set<Bytes> ref;
    std::set_intersection(ba.begin(), ba.end(), bb.begin(), bb.end(),
                          std::inserter(ref, ref.end()));
    ASSERT_EQ(bytes(both), ref);
  }
}

TEST(BackingPlan, AgreesWithAChunkByChunkReferenceOnRandomLayouts) {
  for (std::uint64_t seed = 1; seed <= 2000; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    const std::uint64_t chunks = 1 + rng() % 64;
    std::vector<ByteRange> held;
    for (int n = static_cast<int>(rng() % 12); n > 0; --n) {
      const Bytes at = rng() % (chunks * kChunk);
      const Bytes size = std::min<Bytes>(rng() % (3 * kChunk), chunks * kChunk - at);
      held.push_back({at, rng() % 8 == 0 ? 0 : size});
    }
    std::set<std::uint64_t> want_ref;
    for (const ByteRange& r : held)
      if (r.size > 0)
        for (std::uint64_t i = r.offset / kChunk; i <= (r.offset + r.size - 1) / kChunk; ++i)
          want_ref.insert(i);
    const auto wanted = chunks_covering(held, kChunk);
    expect_canonical(wanted);
    ASSERT_EQ(expand(wanted), want_ref);

    std::vector<bool> backed(chunks);
    for (std::uint64_t i = 0; i < chunks; ++i) backed[i] = rng() % 2 == 1;
    const auto c = backing_change(backed, wanted);
    expect_canonical(c.map);
    expect_canonical(c.unmap);
    std::set<std::uint64_t> map_ref, unmap_ref;
    for (std::uint64_t i = 0; i < chunks; ++i) {
      if (want_ref.count(i) && !backed[i]) map_ref.insert(i);
      if (!want_ref.count(i) && backed[i]) unmap_ref.insert(i);
    }
    ASSERT_EQ(expand(c.map), map_ref);
    ASSERT_EQ(expand(c.unmap), unmap_ref);
  }
}

}  // namespace
}  // namespace salus::arena
