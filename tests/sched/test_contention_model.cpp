#include "sched/contention_model.hpp"

#include <gtest/gtest.h>

#include <map>
#include <random>

using salus::sched::ContentionModel;

TEST(ContentionModel, AloneKernelTakesItsAloneTime) {
  ContentionModel m;
  auto id = m.start(0, 0.5, 1000);
  EXPECT_EQ(m.next_completion(), 1000);
  EXPECT_TRUE(m.advance(999).empty());
  auto done = m.advance(1000);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0], id);
  EXPECT_EQ(m.active(), 0u);
  EXPECT_EQ(m.busy_ns(), 1000);
}

TEST(ContentionModel, UtilsUnderOneDoNotSlowDown) {
  ContentionModel m;
  m.start(0, 0.3, 1000);
  m.start(0, 0.7, 1000);
  EXPECT_DOUBLE_EQ(m.slowdown(), 1.0);
  EXPECT_EQ(m.advance(1000).size(), 2u);
}

TEST(ContentionModel, OversubscribedKernelsShareProportionally) {
  ContentionModel m;
  auto a = m.start(0, 1.0, 1000);
  auto b = m.start(0, 1.0, 1000);
  EXPECT_DOUBLE_EQ(m.slowdown(), 2.0);
  EXPECT_EQ(m.predicted_finish(a), 2000);
  EXPECT_TRUE(m.advance(1999).empty());
  auto done = m.advance(2000);
  EXPECT_EQ(done.size(), 2u);
  (void)b;
}

TEST(ContentionModel, RateChangesWhenAKernelLeaves) {
  ContentionModel m;
  auto shortk = m.start(0, 1.0, 500);
  auto longk = m.start(0, 1.0, 1500);
  // Both at half speed: the short one finishes at 1000, the long one has 1000 left alone.
  EXPECT_EQ(m.next_completion(), 1000);
  auto done = m.advance(1000);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0], shortk);
  EXPECT_EQ(m.predicted_finish(longk), 2000);
  EXPECT_EQ(m.advance(2000).size(), 1u);
}

TEST(ContentionModel, CancelRemovesKernelAndItsLoad) {
  ContentionModel m;
  auto a = m.start(0, 1.0, 1000);
  auto b = m.start(0, 1.0, 1000);
  m.cancel(a, 500);
  EXPECT_FALSE(m.running(a));
  EXPECT_DOUBLE_EQ(m.total_util(), 1.0);
  // b did 250 of alone-work in 500 ns at half speed; 750 left at full speed.
  EXPECT_EQ(m.predicted_finish(b), 1250);
}

// Work conservation: with random kernels, total alone-work done equals the sum of
// each kernel's alone time, and no kernel ever finishes faster than alone.
TEST(ContentionModel, RandomizedNeverFasterThanAloneAndAllFinish) {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 200; ++round) {
    ContentionModel m;
    std::map<ContentionModel::KernelId, std::pair<long, long>> started;  // id -> (start, alone)
    long now = 0;
    std::size_t finished = 0;
    for (int i = 0; i < 50; ++i) {
      now += static_cast<long>(rng() % 500);
      for (auto id : m.advance(now)) {
        auto [s, alone] = started.at(id);
        EXPECT_GE(now - s, alone) << "kernel finished faster than alone";
        ++finished;
      }
      double util = 0.05 + static_cast<double>(rng() % 95) / 100.0;
      long alone = 1 + static_cast<long>(rng() % 2000);
      started[m.start(now, util, alone)] = {now, alone};
    }
    while (auto next = m.next_completion()) {
      now = std::max(now, *next);
      for (auto id : m.advance(now)) {
        auto [s, alone] = started.at(id);
        EXPECT_GE(now - s, alone);
        ++finished;
      }
    }
    EXPECT_EQ(finished, started.size());
  }
}
