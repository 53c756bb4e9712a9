// sched::choose_gpu against a brute-force reference on seeded random GPU states, the
// risk score, and the activity window salus-sim feeds the risk filter from.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "sched/activity_window.hpp"
#include "sched/owner_placements.hpp"
#include "sched/placement.hpp"

namespace salus::sched {
namespace {

// The rules of placement.hpp written the slow, obvious way: collect the candidates, sort
// them by the policy's order, take the first.
std::optional<std::uint32_t> reference(const std::vector<GpuView>& gpus, std::uint64_t need,
                                       const PlacementOptions& o, std::size_t cursor, bool filter) {
  std::vector<std::uint32_t> c;
  const std::size_t n = gpus.size();
  for (std::uint32_t i = 0; i < n; ++i) {
    const GpuView& g = gpus[i];
    if (!g.eligible || g.draining || need > g.capacity) continue;
    if (o.policy == Placement::exclusive && g.placed != 0) continue;
    const bool magm_lug = o.policy == Placement::magm || o.policy == Placement::lug;
    if (filter && magm_lug && o.risk.risky(g)) continue;
    c.push_back(i);
  }
  if (c.empty()) return std::nullopt;
  auto order = [&](std::uint32_t a, std::uint32_t b) {
    const GpuView &x = gpus[a], &y = gpus[b];
    switch (o.policy) {
      case Placement::lug:
        if (x.load != y.load) return x.load < y.load;
        [[fallthrough]];
      case Placement::magm:
        if (x.available != y.available) return x.available > y.available;
        return a < b;
      case Placement::rr:
        return (a + n - cursor % n) % n < (b + n - cursor % n) % n;
      case Placement::exclusive:
        return a < b;
    }
    return a < b;
  };
  std::sort(c.begin(), c.end(), order);
  return c.front();
}

std::optional<std::uint32_t> reference(const std::vector<GpuView>& gpus, std::uint64_t need,
                                       const PlacementOptions& o, std::size_t cursor) {
  auto r = reference(gpus, need, o, cursor, o.risk.enabled);
  if (!r && o.risk.enabled && o.risk.place_when_all_risky)
    r = reference(gpus, need, o, cursor, false);
  return r;
}

GpuView random_gpu(std::mt19937_64& rng) {
  GpuView g;
  g.capacity = (std::uint64_t{1} + rng() % 4) << 30;
  // Few distinct values, so that ties (broken by index) are common.
  g.available =
      static_cast<std::int64_t>(rng() % 5) * (std::int64_t{1} << 29) - (std::int64_t{1} << 29);
  g.load = static_cast<double>(rng() % 4) * 0.25;
  g.placed = static_cast<std::uint32_t>(rng() % 3);
  g.draining = rng() % 8 == 0;
  g.eligible = rng() % 6 != 0;
  if (rng() % 3 != 0) g.sm_activity = static_cast<double>(rng() % 11) / 10;
  if (rng() % 3 != 0) g.mem_activity = static_cast<double>(rng() % 11) / 10;
  return g;
}

TEST(Placement, MatchesBruteForceOnRandomStates) {
  std::mt19937_64 rng(19);
  const Placement policies[] = {Placement::magm, Placement::lug, Placement::rr,
                                Placement::exclusive};
  int placed = 0, none = 0, risky = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const std::size_t n = 1 + rng() % 6;
    std::vector<GpuView> gpus(n);
    for (GpuView& g : gpus) g = random_gpu(rng);
    PlacementOptions o;
    o.policy = policies[rng() % 4];
    o.risk.enabled = rng() % 2 == 0;
    o.risk.place_when_all_risky = rng() % 2 == 0;
    const std::uint64_t need = (rng() % 5) << 29;
    const std::size_t cursor = rng() % 17;
    const PlacementChoice c = choose_gpu(gpus, need, o, cursor);
    const auto want = reference(gpus, need, o, cursor);
    ASSERT_EQ(c.gpu, want) << "iteration " << iter << " policy " << to_string(o.policy);
    if (c.gpu) {
      ++placed;
      if (o.policy == Placement::rr) {
        EXPECT_EQ(c.next_rr, *c.gpu + 1);
      }
    } else {
      ++none;
      EXPECT_EQ(c.next_rr, cursor);  // the cursor moves only on a choice
    }
    risky += c.risky > 0;
    if (c.risk_ignored) {
      ASSERT_TRUE(c.gpu);
      EXPECT_TRUE(o.risk.risky(gpus[*c.gpu]));
    }
  }
  // The generator reaches every outcome.
  EXPECT_GT(placed, 1000);
  EXPECT_GT(none, 1000);
  EXPECT_GT(risky, 1000);
}

TEST(Placement, MagmCountsWhatWaits) {
  // GPU 0 has more free memory, but more already waits there: magm takes GPU 1.
  std::vector<GpuView> gpus(2);
  gpus[0].capacity = gpus[1].capacity = 16ull << 30;
  gpus[0].available = (12ll << 30) - (8ll << 30);
  gpus[1].available = 10ll << 30;
  EXPECT_EQ(choose_gpu(gpus, 1 << 30, {}, 0).gpu, 1u);
}

TEST(Placement, RoundRobinSkipsIneligibleAndWraps) {
  std::vector<GpuView> gpus(3);
  for (auto& g : gpus) g.capacity = 1 << 20;
  gpus[1].eligible = false;
  PlacementOptions o{Placement::rr, {}};
  std::size_t cur = 0;
  std::vector<std::uint32_t> got;
  for (int k = 0; k < 4; ++k) {
    const auto c = choose_gpu(gpus, 1, o, cur);
    got.push_back(*c.gpu);
    cur = c.next_rr;
  }
  EXPECT_EQ(got, (std::vector<std::uint32_t>{0, 2, 0, 2}));
}

TEST(Placement, RiskFilterSkipsBusyGpuUnlessAllAreBusy) {
  std::vector<GpuView> gpus(2);
  for (auto& g : gpus) g.capacity = 1 << 20;
  gpus[0].available = 100;
  gpus[1].available = 10;
  gpus[0].sm_activity = 0.9;
  PlacementOptions o;
  o.risk.enabled = true;
  auto c = choose_gpu(gpus, 1, o, 0);
  EXPECT_EQ(c.gpu, 1u);
  EXPECT_EQ(c.risky, 1u);
  gpus[1].mem_activity = 0.5;  // above max_mem 0.40
  c = choose_gpu(gpus, 1, o, 0);
  EXPECT_EQ(c.gpu, 0u);
  EXPECT_TRUE(c.risk_ignored);
  o.risk.place_when_all_risky = false;
  EXPECT_FALSE(choose_gpu(gpus, 1, o, 0).gpu);
  o.risk.enabled = false;
  EXPECT_EQ(choose_gpu(gpus, 1, o, 0).gpu, 0u);
}

TEST(RiskScore, WeightsOfCarma) {
  EXPECT_FALSE(risk_score({}));
  const std::vector<double> flat(30, 0.5);
  EXPECT_NEAR(*risk_score(flat), 0.5, 1e-12);
  // 0..1 in 11 steps: mean 0.5, median 0.5, p95 0.95, EMA (alpha 1/6) by hand.
  std::vector<double> ramp;
  for (int i = 0; i <= 10; ++i) ramp.push_back(i / 10.0);
  double ema = 0;
  for (int i = 1; i <= 10; ++i) ema = ramp[i] / 6 + ema * 5 / 6;
  EXPECT_NEAR(*risk_score(ramp), 0.2 * 0.5 + 0.3 * 0.5 + 0.3 * 0.95 + 0.2 * ema, 1e-12);
}

TEST(ActivityWindow, MeansOverPeriods) {
  ActivityWindow w(10'000);
  EXPECT_DOUBLE_EQ(w.mean(0, 100), 0.0);  // idle before any record
  w.set(100, 1.0);
  w.set(200, 0.5);
  w.set(200, 0.25);  // the same instant: the last value lasts
  EXPECT_DOUBLE_EQ(w.mean(0, 200), 0.5);
  EXPECT_DOUBLE_EQ(w.mean(200, 300), 0.25);
  std::vector<double> s;
  w.samples(300, 100, 3, s);
  EXPECT_EQ(s, (std::vector<double>{0.0, 1.0, 0.25}));
  // Old steps go once they are wholly before the window.
  w.set(50'000, 0.0);
  EXPECT_LE(w.steps(), 2u);
  EXPECT_DOUBLE_EQ(w.mean(45'000, 50'000), 0.25);
}

}  // namespace
}  // namespace salus::sched

// The host-wide queue's order under FAIR by owner (sched/owner_placements.hpp), which
// salusd's broker and salus-sim both use.
TEST(OwnerPlacements, OrdersByPlacedOnlyOnceTwoOwnersAreCounted) {
  salus::sched::OwnerPlacements o;
  EXPECT_FALSE(o.key(1).has_value());
  o.placed(1, +1);
  o.waiting(1, +1);
  EXPECT_FALSE(o.key(1).has_value()) << "one owner: the policy's own key";
  o.waiting(2, +1);
  ASSERT_TRUE(o.key(2).has_value());
  EXPECT_EQ(*o.key(1), 1.0);
  EXPECT_EQ(*o.key(2), 0.0);
  EXPECT_EQ(*o.key(3), 0.0) << "an owner not counted has nothing placed";
  o.waiting(2, -1);
  EXPECT_FALSE(o.key(1).has_value()) << "owner 2 gone: one owner again";
  o.placed(1, -5);  // more than counted: floors at zero, no wrap
  o.waiting(1, -1);
  EXPECT_EQ(o.owners(), 0u);
}
