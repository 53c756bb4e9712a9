// The staging pool: size classes, reuse of returned blocks, the cache bound and
// the accounting that /salus/stats reports.
#include "vgpu/transfer/staging_pool.hpp"

#include <gtest/gtest.h>

#include <cstring>

#include "vgpu/sim/sim_device.hpp"

using namespace salus::vgpu;

namespace {

constexpr Bytes kKiB = 1024, kMiB = 1024 * 1024;

TEST(StagingPool, RoundsUpToPowerOfTwoClasses) {
  EXPECT_EQ(StagingPool::size_class(1), StagingPool::kMinBlock);
  EXPECT_EQ(StagingPool::size_class(64 * kKiB), 64 * kKiB);
  EXPECT_EQ(StagingPool::size_class(64 * kKiB + 1), 128 * kKiB);
  EXPECT_EQ(StagingPool::size_class(8 * kMiB), 8 * kMiB);
  EXPECT_EQ(StagingPool::size_class(5 * kMiB), 8 * kMiB);
}

TEST(StagingPool, ReusesReturnedBlocksUpToTheCacheLimit) {
  SimDevice dev(0, 64 * kMiB);
  {
    StagingPool pool(dev, 1 * kMiB);
    char* first = nullptr;
    {
      auto b = pool.acquire(100 * kKiB);
      ASSERT_TRUE(b);
      EXPECT_EQ(b.capacity(), 128 * kKiB);
      std::memset(b.data(), 0xab, b.capacity());  // usable memory
      first = b.data();
      EXPECT_EQ(pool.stats().in_use, 128 * kKiB);
    }
    EXPECT_EQ(pool.stats().in_use, 0u);
    EXPECT_EQ(pool.stats().cached, 128 * kKiB);
    auto again = pool.acquire(128 * kKiB);
    EXPECT_EQ(again.data(), first) << "the cached block comes back";
    EXPECT_EQ(pool.stats().allocations, 1u);
    // Beyond the cache limit, returned blocks are freed at once.
    auto big = pool.acquire(2 * kMiB);
    ASSERT_TRUE(big);
    big.reset();
    EXPECT_EQ(pool.stats().cached, 0u) << "freed, not cached";
    EXPECT_EQ(pool.stats().in_use, 128 * kKiB);
    // Moves hand the block over without returning it twice.
    StagingPool::Block moved = std::move(again);
    EXPECT_FALSE(again);
    EXPECT_EQ(pool.stats().in_use, 128 * kKiB);
    moved = StagingPool::Block();
    EXPECT_EQ(pool.stats().in_use, 0u);
    EXPECT_EQ(pool.stats().cached, 128 * kKiB);
    EXPECT_EQ(pool.stats().allocations, 2u);
  }
}

}  // namespace
