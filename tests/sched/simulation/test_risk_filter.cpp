// CARMA's risk filter in salus-sim (SimConfig::risk): placement leaves out a GPU whose
// compute activity over the window is high, even when magm would pick it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sched/simulation.hpp"
#include "sched/trace.hpp"

namespace sc = salus::sched;

namespace {

sc::TraceJob job(std::string name, double arrival_s, double util, double p_mb, double e_mb,
                 std::uint64_t iters) {
  sc::TraceJob j;
  j.name = std::move(name);
  j.arrival_s = arrival_s;
  j.model = "test";
  j.persistent_mb = p_mb;
  j.ephemeral_mb = e_mb;
  j.iter_ms = 1000;
  j.iters = iters;
  j.util = util;
  return j;
}

// GPU 0 runs `busy` (util 1, little memory); GPU 1 runs `calm` (util 0.05, much memory).
// At t=60 s `late` arrives: magm alone picks GPU 0 (more memory available); with the
// filter, GPU 0's activity (1.0 over the last 30 s) is past 0.8, so it goes to GPU 1.
std::vector<sc::TraceJob> trace() {
  return {job("busy", 0, 1.0, 100, 100, 200), job("calm", 1, 0.05, 4000, 4000, 200),
          job("late", 60, 0.5, 100, 100, 10)};
}

// PACK: lanes run side by side, so sharing the busy GPU slows the late job down.
sc::SimResult run(bool filter, sc::Placement placement, bool coalesce = true) {
  sc::SimConfig c;
  c.policy = sc::PolicyKind::pack;
  c.gpus = 2;
  c.placement = placement;
  c.coalesce = coalesce;
  c.risk.enabled = filter;
  return sc::simulate(trace(), c);
}

TEST(RiskFilter, SkipsTheBusyGpuThatMagmWouldPick) {
  for (bool coalesce : {true, false}) {
    const sc::SimResult off = run(false, sc::Placement::magm, coalesce);
    ASSERT_EQ(off.jobs[0].gpu, 0u);
    ASSERT_EQ(off.jobs[1].gpu, 1u);
    EXPECT_EQ(off.jobs[2].gpu, 0u);
    EXPECT_EQ(off.counters.risky_skips, 0u);
    const sc::SimResult on = run(true, sc::Placement::magm, coalesce);
    EXPECT_EQ(on.jobs[0].gpu, 0u);
    EXPECT_EQ(on.jobs[1].gpu, 1u);
    EXPECT_EQ(on.jobs[2].gpu, 1u) << "coalesce " << coalesce;
    EXPECT_GE(on.counters.risky_skips, 1u);
    // Away from the busy GPU (contention 1.5 there, 0.55 here) the late job finishes sooner.
    EXPECT_LT(on.jobs[2].finish, off.jobs[2].finish);
  }
}

TEST(RiskFilter, RoundRobinIgnoresIt) {
  const sc::SimResult off = run(false, sc::Placement::rr);
  const sc::SimResult on = run(true, sc::Placement::rr);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(on.jobs[i].gpu, off.jobs[i].gpu);
  EXPECT_EQ(on.counters.risky_skips, 0u);
}

TEST(RiskFilter, TakesARiskyGpuWhenEveryGpuIsRisky) {
  sc::SimConfig c;
  c.policy = sc::PolicyKind::fair;
  c.gpus = 2;
  c.risk.enabled = true;
  const std::vector<sc::TraceJob> t = {job("a", 0, 1.0, 100, 100, 200),
                                       job("b", 0, 1.0, 100, 100, 200),
                                       job("c", 60, 0.5, 100, 100, 10)};
  const sc::SimResult r = sc::simulate(t, c);
  EXPECT_GT(r.jobs[2].finish, 0);  // placed, and finished
  EXPECT_GE(r.counters.risky_skips, 1u);
}

TEST(RiskFilter, RejectsABadWindow) {
  sc::SimConfig c;
  c.gpus = 2;
  c.risk.enabled = true;
  c.risk.window_s = 0.5;
  EXPECT_THROW(sc::simulate(trace(), c), sc::SimError);
}

}  // namespace
