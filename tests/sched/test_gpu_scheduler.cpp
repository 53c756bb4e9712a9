// Per-lane decisions of each policy, on the pure scheduler with a fake clock.
#include "sched/gpu_scheduler.hpp"

#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <random>
#include <vector>

using namespace salus;
using namespace salus::sched;

namespace {
constexpr arena::Bytes M = 1u << 20;

// Three sessions that must share one lane (E fills the GPU).
struct OneLane {
  GpuScheduler s;
  explicit OneLane(PolicyKind p) : s(24 * M, p) {}
  LaneId add(SessionId id, std::int32_t prio = 0, std::optional<std::uint64_t> iters = {}) {
    EXPECT_EQ(s.arrive(id, arena::Need{M, 16 * M}, prio, iters, 0), arena::ArenaError::ok);
    auto adm = s.take_admissions();
    EXPECT_EQ(adm.size(), 1u);
    s.set_runnable(id, true);
    return adm.at(0).lane;
  }
};
// Sessions 1 and 2, each in a lane of its own, both runnable.
struct TwoLanes {
  GpuScheduler s;
  std::vector<arena::Admitted> adm;
  explicit TwoLanes(PolicyKind p) : s(64 * M, p) {
    EXPECT_EQ(s.arrive(1, arena::Need{M, 8 * M}, 0, {}, 0), arena::ArenaError::ok);
    EXPECT_EQ(s.arrive(2, arena::Need{M, 8 * M}, 0, {}, 0), arena::ArenaError::ok);
    adm = s.take_admissions();
    EXPECT_EQ(adm.size(), 2u);
    EXPECT_NE(adm.at(0).lane, adm.at(1).lane);  // room for two lanes
    s.set_runnable(1, true);
    s.set_runnable(2, true);
  }
};
}  // namespace

TEST(GpuScheduler, FifoRunsInArrivalOrder) {
  OneLane t(PolicyKind::fifo);
  const LaneId lane = t.add(3);
  EXPECT_EQ(t.add(1), lane);
  EXPECT_EQ(t.add(2), lane);
  EXPECT_EQ(t.s.pick(lane), 3u);
  t.s.iteration_done(3, 1000);
  EXPECT_EQ(t.s.pick(lane), 3u);  // still first: runs to completion
  t.s.set_runnable(3, false);
  EXPECT_EQ(t.s.pick(lane), 1u);
}

TEST(GpuScheduler, PriorityPreemptsAtBoundariesAndIsFifoWithinALevel) {
  OneLane t(PolicyKind::priority);
  const LaneId lane = t.add(1, 0);
  t.add(2, 5);
  t.add(3, 5);
  EXPECT_EQ(t.s.pick(lane), 2u);
  t.s.set_priority(1, 9);
  EXPECT_EQ(t.s.pick(lane), 1u);
  EXPECT_GE(t.s.stats().preemptions, 1u);
  t.s.set_runnable(1, false);
  t.s.set_runnable(2, false);
  EXPECT_EQ(t.s.pick(lane), 3u);
}

TEST(GpuScheduler, SrtfPrefersLeastRemainingAndRanksUnknownLast) {
  OneLane t(PolicyKind::srtf);
  const LaneId lane = t.add(1, 0, std::nullopt);  // no iters=: last
  t.add(2, 0, 1000);
  t.add(3, 0, 10);
  EXPECT_EQ(t.s.pick(lane), 3u);
  // Measured means change the estimate: 2 is fast, 3 is slow.
  t.s.iteration_done(2, 1);
  t.s.iteration_done(3, 10'000'000);
  EXPECT_EQ(t.s.pick(lane), 2u);  // 999 x 1 ns < 9 x 10 ms
  t.s.set_runnable(2, false);
  t.s.set_runnable(3, false);
  EXPECT_EQ(t.s.pick(lane), 1u);
}

// A job that declares fewer iterations than it runs must not keep the 0 remaining
// of a finished estimate: past its declaration it ranks with the undeclared.
TEST(GpuScheduler, SrtfRanksAJobPastItsDeclaredItersWithTheUndeclared) {
  OneLane t(PolicyKind::srtf);
  const LaneId lane = t.add(1, 0, std::nullopt);  // undeclared, earlier arrival
  t.add(2, 0, 1);                                 // declares one iteration
  t.add(3, 0, 50);
  EXPECT_EQ(t.s.pick(lane), 2u);
  t.s.iteration_done(2, 1000);
  EXPECT_EQ(t.s.pick(lane), 2u);  // done == iters: 0 remaining, still first
  t.s.iteration_done(2, 1000);    // now past its declaration
  EXPECT_EQ(t.s.pick(lane), 3u);
  t.s.set_runnable(3, false);
  EXPECT_EQ(t.s.pick(lane), 1u);  // among the undeclared, arrival order
  t.s.set_runnable(1, false);
  EXPECT_EQ(t.s.pick(lane), 2u);
}

TEST(GpuScheduler, FairEqualizesGpuTimeWithPipelinedDispatch) {
  OneLane t(PolicyKind::fair);
  const LaneId lane = t.add(1);
  t.add(2);
  std::map<SessionId, std::int64_t> time;
  std::mt19937 rng(7);
  // Session 1's iterations cost 3x session 2's; two are in flight at a time.
  std::deque<SessionId> in_flight;
  for (int i = 0; i < 4000; ++i) {
    while (in_flight.size() < 2) {
      const SessionId id = *t.s.pick(lane);
      t.s.iteration_dispatched(id);
      in_flight.push_back(id);
    }
    const SessionId done = in_flight.front();
    in_flight.pop_front();
    const std::int64_t cost = (done == 1 ? 3000 : 1000) + static_cast<std::int64_t>(rng() % 100);
    time[done] += cost;
    t.s.iteration_done(done, cost);
  }
  const double share = static_cast<double>(time[1]) / static_cast<double>(time[1] + time[2]);
  EXPECT_NEAR(share, 0.5, 0.02);
}

// Owner 1 runs three sessions in a lane, owner 2 one; iterations cost 500 to
// 3500 ns (seeded), two in flight at a time. Returns owner 2's share of the time.
double second_owners_share(FairShare share, std::uint32_t seed) {
  GpuScheduler s(24 * M, PolicyKind::fair);  // E fills the GPU: one lane
  s.set_fair_share(share);
  const std::uint32_t owners[] = {1, 1, 1, 2};
  for (SessionId id = 1; id <= 4; ++id)
    EXPECT_EQ(s.arrive(id, arena::Need{M, 16 * M}, 0, {}, 0, owners[id - 1]),
              arena::ArenaError::ok);
  const auto adm = s.take_admissions();
  EXPECT_EQ(adm.size(), 4u);
  for (const auto& a : adm) EXPECT_EQ(a.lane, adm.at(0).lane);  // one lane
  for (SessionId id = 1; id <= 4; ++id) s.set_runnable(id, true);
  std::mt19937 rng(seed);
  std::map<std::uint32_t, std::int64_t> time;
  std::deque<SessionId> in_flight;
  for (int i = 0; i < 6000; ++i) {
    while (in_flight.size() < 2) {
      const SessionId id = *s.pick(adm.at(0).lane);
      s.iteration_dispatched(id);
      in_flight.push_back(id);
    }
    const SessionId done = in_flight.front();
    in_flight.pop_front();
    const std::int64_t cost = 500 + static_cast<std::int64_t>(rng() % 3001);
    time[owners[done - 1]] += cost;
    s.iteration_done(done, cost);
  }
  return static_cast<double>(time[2]) / static_cast<double>(time[1] + time[2]);
}

TEST(GpuScheduler, FairByOwnerGivesEachOwnerAnEqualShareWhateverItsSessions) {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    EXPECT_NEAR(second_owners_share(FairShare::owner, seed), 0.5, 0.03) << "seed " << seed;
    EXPECT_NEAR(second_owners_share(FairShare::session, seed), 0.25, 0.03) << "seed " << seed;
  }
}

// Owner 1 runs `sessions` sessions, owner 2 one, each in a lane of its own, always
// runnable; lanes run side by side and share the GPU equally (processor sharing:
// with m iterations running, each progresses at 1/m), each iteration 500 to 3500
// ns alone (seeded) and charged the wall time it took. With `one_at_a_time`, owner
// 2's session is runnable only while none of its iterations runs, as an attached
// program waits at its gate. Returns owner 2's share of the work done
// (alone-equivalent), after checking that the GPU never idled.
double second_owners_work_across_lanes(FairShare share, std::uint32_t seed, int sessions,
                                       bool one_at_a_time = false) {
  GpuScheduler s(256 * M, PolicyKind::fair);
  s.set_fair_share(share);
  std::map<SessionId, std::uint32_t> owner;
  for (SessionId id = 1; id <= static_cast<SessionId>(sessions) + 1; ++id) {
    owner[id] = id <= static_cast<SessionId>(sessions) ? 1 : 2;
    EXPECT_EQ(s.arrive(id, arena::Need{M, 8 * M}, 0, {}, 0, owner[id]), arena::ArenaError::ok);
  }
  std::map<SessionId, LaneId> lane;
  for (const auto& a : s.take_admissions()) lane[a.session] = a.lane;
  EXPECT_EQ(lane.size(), owner.size());
  for (const auto& [id, l] : lane) s.set_runnable(id, true);
  std::mt19937 rng(seed);
  struct Running {
    double left, alone;  // alone-equivalent ns
    std::int64_t started;
  };
  std::map<SessionId, Running> running;
  std::map<std::uint32_t, double> work;
  double now = 0;
  for (int done = 0; done < 4000; ++done) {
    for (const auto& [id, l] : lane) {
      if (running.count(id) || !s.lane_may_dispatch(l)) continue;
      const auto picked = s.pick(l);
      if (!picked) continue;
      s.iteration_dispatched(*picked);
      if (one_at_a_time && owner[*picked] == 2) s.set_runnable(*picked, false);
      const double alone = 500 + static_cast<double>(rng() % 3001);
      running[*picked] = {alone, alone, static_cast<std::int64_t>(now)};
    }
    EXPECT_FALSE(running.empty()) << "the GPU idled";
    if (running.empty()) return -1;
    auto next = running.begin();
    for (auto it = running.begin(); it != running.end(); ++it)
      if (it->second.left < next->second.left) next = it;
    const double m = static_cast<double>(running.size()), step = next->second.left;
    now += step * m;
    for (auto& [id, r] : running) r.left -= step;
    const SessionId id = next->first;
    work[owner[id]] += next->second.alone;
    const std::int64_t took = static_cast<std::int64_t>(now) - next->second.started;
    running.erase(next);
    s.iteration_done(id, std::max<std::int64_t>(took, 1));
    if (one_at_a_time && owner[id] == 2) s.set_runnable(id, true);
  }
  return work[2] / (work[1] + work[2]);
}

// Only FairShare::owner_across_lanes holds an owner back across lanes: FairShare::owner
// shares inside a lane, and these sessions have a lane each.
TEST(GpuScheduler, FairByOwnerAcrossLanesHoldsBackAnOwnerAhead) {
  for (std::uint32_t seed = 1; seed <= 10; ++seed) {
    for (int sessions : {2, 3, 5}) {
      const double across =
          second_owners_work_across_lanes(FairShare::owner_across_lanes, seed, sessions);
      const double in_lane = second_owners_work_across_lanes(FairShare::owner, seed, sessions);
      const double by_session = second_owners_work_across_lanes(FairShare::session, seed, sessions);
      EXPECT_NEAR(across, 0.5, 0.03) << "seed " << seed << ", " << sessions << " sessions";
      // Owner 2 not runnable while its iteration runs still counts as competing.
      EXPECT_NEAR(
          second_owners_work_across_lanes(FairShare::owner_across_lanes, seed, sessions, true), 0.5,
          0.03)
          << "seed " << seed << ", " << sessions << " sessions, one at a time";
      EXPECT_NEAR(in_lane, 1.0 / (sessions + 1), 0.05) << "seed " << seed;
      EXPECT_NEAR(by_session, 1.0 / (sessions + 1), 0.05) << "seed " << seed;
    }
  }
}

TEST(GpuScheduler, FairShareNames) {
  for (const FairShare f : {FairShare::session, FairShare::owner, FairShare::owner_across_lanes})
    EXPECT_EQ(fair_share_from_string(to_string(f)), f);
  EXPECT_EQ(to_string(FairShare::owner), "user");
  EXPECT_EQ(to_string(FairShare::owner_across_lanes), "user-across-lanes");
  EXPECT_FALSE(fair_share_from_string("owner").has_value());
  EXPECT_FALSE(by_owner(FairShare::session));
  EXPECT_TRUE(by_owner(FairShare::owner_across_lanes));
}

TEST(GpuScheduler, TheFairFactorCountsTheOwnersRunnableSessionsInTheLane) {
  OneLane t(PolicyKind::fair);
  t.s.set_fair_share(FairShare::owner);
  EXPECT_EQ(t.s.arrive(1, arena::Need{M, 16 * M}, 0, {}, 0, 7), arena::ArenaError::ok);
  EXPECT_EQ(t.s.arrive(2, arena::Need{M, 16 * M}, 0, {}, 0, 7), arena::ArenaError::ok);
  EXPECT_EQ(t.s.arrive(3, arena::Need{M, 16 * M}, 0, {}, 0, 8), arena::ArenaError::ok);
  EXPECT_EQ(t.s.take_admissions().size(), 3u);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(1)), 1);  // not runnable: itself
  t.s.set_runnable(1, true);
  t.s.set_runnable(2, true);
  t.s.set_runnable(3, true);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(1)), 2);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(3)), 1);
  t.s.set_runnable(2, false);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(1)), 1);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(2)), 2);  // itself and 1
  t.s.set_runnable(3, false);                   // owner 7 alone: per-session shares
  EXPECT_EQ(t.s.fair_factor(*t.s.find(2)), 1);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(3)), 1);  // itself and owner 7
  t.s.set_runnable(2, true);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(3)), 1);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(1)), 1);
  t.s.set_runnable(3, true);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(1)), 2);
  t.s.set_fair_share(FairShare::session);
  EXPECT_EQ(t.s.fair_factor(*t.s.find(1)), 1);
}

// A lane of one owner's sessions is shared exactly as under FairShare::session:
// the same picks, whatever comes and goes.
TEST(GpuScheduler, FairByOwnerWithOneOwnerPicksAsPerSession) {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    std::vector<SessionId> picked[2];
    for (int mode = 0; mode < 2; ++mode) {
      GpuScheduler s(24 * M, PolicyKind::fair);
      s.set_fair_share(mode == 0 ? FairShare::session : FairShare::owner);
      for (SessionId id = 1; id <= 4; ++id) s.arrive(id, arena::Need{M, 16 * M}, 0, {}, 0, 42);
      const auto adm = s.take_admissions();
      std::mt19937 rng(seed);
      for (int i = 0; i < 2000; ++i) {
        s.set_runnable(1 + rng() % 4, rng() % 3 != 0);
        const auto id = s.pick(adm.at(0).lane);
        if (!id) continue;
        picked[mode].push_back(*id);
        s.iteration_dispatched(*id);
        s.iteration_done(*id, 100 + static_cast<std::int64_t>(rng() % 5000));
      }
    }
    EXPECT_EQ(picked[0], picked[1]) << "seed " << seed;
  }
}

// Room for two sessions: owner 1 queues four, owner 2 one after them. When one
// of owner 1's leaves, FAIR by owner admits owner 2's (no session admitted yet)
// before owner 1's next; per session, arrival order admits owner 1's.
TEST(GpuScheduler, FairByOwnerAdmitsTheOwnerWithFewestAdmittedFirst) {
  for (const FairShare share : {FairShare::owner, FairShare::session}) {
    GpuScheduler s(24 * M, PolicyKind::fair);
    s.set_fair_share(share);
    for (SessionId id = 1; id <= 4; ++id)
      EXPECT_EQ(s.arrive(id, arena::Need{10 * M, M}, 0, {}, 0, 1), arena::ArenaError::ok);
    EXPECT_EQ(s.arrive(5, arena::Need{10 * M, M}, 0, {}, 0, 2), arena::ArenaError::ok);
    auto adm = s.take_admissions();
    ASSERT_EQ(adm.size(), 2u);
    EXPECT_EQ(adm.at(0).session, 1u);
    EXPECT_EQ(adm.at(1).session, 2u);
    s.leave(1, 1);
    adm = s.take_admissions();
    ASSERT_EQ(adm.size(), 1u);
    EXPECT_EQ(adm.at(0).session, share == FairShare::owner ? 5u : 3u);
    s.leave(2, 2);  // owner 1 has none admitted now, or one per session
    adm = s.take_admissions();
    ASSERT_EQ(adm.size(), 1u);
    EXPECT_EQ(adm.at(0).session, share == FairShare::owner ? 3u : 4u);
  }
}

TEST(GpuScheduler, FairNewcomerStartsAtTheLaneClock) {
  OneLane t(PolicyKind::fair);
  const LaneId lane = t.add(1);
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(t.s.pick(lane), 1u);
    t.s.iteration_dispatched(1);
    t.s.iteration_done(1, 1000);
  }
  t.add(2);  // must not get 100 iterations of catch-up, nor wait behind them
  int runs2 = 0;
  for (int i = 0; i < 10; ++i) {
    const SessionId id = *t.s.pick(lane);
    runs2 += id == 2;
    t.s.iteration_dispatched(id);
    t.s.iteration_done(id, 1000);
  }
  EXPECT_GE(runs2, 4);
  EXPECT_LE(runs2, 6);
}

TEST(GpuScheduler, PolicySwitchReranksAdmittedSessions) {
  OneLane t(PolicyKind::fifo);
  const LaneId lane = t.add(1, 0);
  t.add(2, 7);
  EXPECT_EQ(t.s.pick(lane), 1u);
  t.s.set_policy(PolicyKind::priority);
  EXPECT_EQ(t.s.pick(lane), 2u);
}

TEST(GpuScheduler, LeaveRemovesFromLaneAndArena) {
  OneLane t(PolicyKind::fair);
  const LaneId lane = t.add(1);
  t.add(2);
  t.s.leave(1, 10);
  EXPECT_EQ(t.s.pick(lane), 2u);
  EXPECT_EQ(t.s.find(1), nullptr);
  t.s.leave(2, 20);
  EXPECT_EQ(t.s.arena().memory().lanes, 0u);
}

TEST(GpuScheduler, FifoRunsOneSessionAtATimeAcrossLanesPackRunsAll) {
  for (PolicyKind p : {PolicyKind::fifo, PolicyKind::pack}) {
    TwoLanes t(p);
    GpuScheduler& s = t.s;
    const auto& adm = t.adm;
    ASSERT_EQ(adm.size(), 2u);
    EXPECT_TRUE(s.lane_may_dispatch(adm[0].lane));
    EXPECT_EQ(s.lane_may_dispatch(adm[1].lane), p == PolicyKind::pack);
    s.set_runnable(1, false);  // the first one finished its work
    EXPECT_TRUE(s.lane_may_dispatch(adm[1].lane));
  }
}

TEST(GpuScheduler, FairLaneClockSurvivesAnotherSessionLeaving) {
  GpuScheduler s(36 * M, PolicyKind::fair);
  // Sessions 1 and 2 share a 16M lane; session 3 has its own small lane.
  ASSERT_EQ(s.arrive(1, arena::Need{M, 16 * M}, 0, {}, 0), arena::ArenaError::ok);
  ASSERT_EQ(s.arrive(3, arena::Need{M, 4 * M}, 0, {}, 0), arena::ArenaError::ok);
  ASSERT_EQ(s.arrive(2, arena::Need{M, 16 * M}, 0, {}, 0), arena::ArenaError::ok);
  auto adm = s.take_admissions();
  ASSERT_EQ(adm.size(), 3u);
  const LaneId lane = adm[0].lane;
  ASSERT_EQ(adm[2].lane, lane);
  s.set_runnable(1, true);
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(s.pick(lane), 1u);
    s.iteration_dispatched(1);
    s.iteration_done(1, 1000);
  }
  s.set_runnable(1, false);  // between submissions: nobody in the lane is runnable
  s.leave(3, 1);
  s.set_runnable(2, true);  // a newcomer starts at the lane's clock, not at zero
  s.set_runnable(1, true);
  int runs2 = 0;
  for (int i = 0; i < 10; ++i) {
    const SessionId id = *s.pick(lane);
    runs2 += id == 2;
    s.iteration_dispatched(id);
    s.iteration_done(id, 1000);
  }
  EXPECT_LE(runs2, 6);
}

TEST(GpuScheduler, FifoHoldsTheGpuUntilTheLastIterationEnds) {
  TwoLanes t(PolicyKind::fifo);
  GpuScheduler& s = t.s;
  const auto& adm = t.adm;
  ASSERT_EQ(adm.size(), 2u);
  ASSERT_EQ(s.pick(adm[0].lane), 1u);
  s.iteration_dispatched(1);
  // Its last iteration is on the device and nothing more is queued: the second job
  // must not start under it, as it would on an idle GPU.
  s.set_runnable(1, false);
  EXPECT_FALSE(s.lane_may_dispatch(adm[1].lane));
  EXPECT_FALSE(s.lane_may_dispatch(adm[0].lane));
  s.iteration_done(1, 1000);
  EXPECT_TRUE(s.lane_may_dispatch(adm[1].lane));
  // An older job that becomes runnable while a younger one runs takes over at once;
  // the younger one's lane waits.
  ASSERT_EQ(s.pick(adm[1].lane), 2u);
  s.iteration_dispatched(2);
  s.set_runnable(1, true);
  EXPECT_TRUE(s.lane_may_dispatch(adm[0].lane));
  EXPECT_FALSE(s.lane_may_dispatch(adm[1].lane));
  // Leaving with work in flight releases the hold.
  s.leave(1, 10);
  EXPECT_TRUE(s.lane_may_dispatch(adm[1].lane));
}

// Salus's own FAIR resets every session's service counter when a job arrives. With a
// newcomer every 25 ms and a 30 ms iteration at the head of the tie order, that rule
// runs A first after every reset and B never; virtual time keeps A's and B's debts
// across arrivals, and starts each newcomer at the lane clock. A one-lane model of
// the reset rule runs beside GpuScheduler on the same arrivals.
TEST(GpuScheduler, FairKeepsSharesUnderFrequentArrivalsWhereResetOnArrivalStarves) {
  constexpr std::int64_t kArrivalEvery = 25'000, kEnd = 5'000'000;
  const auto cost = [](SessionId id) -> std::int64_t {
    return id == 1 ? 30'000 : id == 2 ? 10'000 : 1'000;  // A, B, then one-iteration newcomers
  };

  // Ours.
  OneLane t(PolicyKind::fair);
  const LaneId lane = t.add(1);
  t.add(2);
  std::map<SessionId, std::int64_t> ours;
  SessionId next_id = 3;
  std::int64_t next_arrival = kArrivalEvery;
  for (std::int64_t now = 0; now < kEnd;) {
    for (; next_arrival <= now; next_arrival += kArrivalEvery) t.add(next_id++);
    const SessionId id = *t.s.pick(lane);
    t.s.iteration_dispatched(id);
    now += cost(id);
    t.s.iteration_done(id, cost(id));
    ours[id] += cost(id);
    if (id > 2) t.s.leave(id, now);  // a newcomer's one iteration is all it has
  }

  // The reset rule: least service since the last arrival, ties to the earliest session.
  std::map<SessionId, std::int64_t> service, reset;
  service[1] = service[2] = 0;
  next_id = 3;
  next_arrival = kArrivalEvery;
  for (std::int64_t now = 0; now < kEnd;) {
    for (; next_arrival <= now; next_arrival += kArrivalEvery) {
      for (auto& [id, s] : service) s = 0;
      service[next_id++] = 0;
    }
    SessionId id = service.begin()->first;
    for (const auto& [sid, s] : service)
      if (s < service[id]) id = sid;
    now += cost(id);
    service[id] += cost(id);
    reset[id] += cost(id);
    if (id > 2) service.erase(id);
  }

  const auto share_of_b = [](std::map<SessionId, std::int64_t>& m) {
    return static_cast<double>(m[2]) / static_cast<double>(m[1] + m[2]);
  };
  EXPECT_NEAR(share_of_b(ours), 0.5, 0.02);
  EXPECT_LT(share_of_b(reset), 0.01);
  // And no newcomer waits behind the old sessions' history: all but the last ran.
  EXPECT_GE(ours.size(), static_cast<std::size_t>(kEnd / kArrivalEvery));
}

// ---- admission follows the policy (issue 19 item 7) ----

namespace {
// A lane per session. One job holds the GPU (16 of 24 MiB); three wait, each needing
// 14 MiB, so one fits at a time once the first leaves. Returns the order in which the
// waiting ones are admitted.
const arena::ArenaOptions kOwnLanes{arena::QueueMode::bounded_bypass, 16,
                                    arena::LaneMode::lane_per_session};
std::vector<SessionId> admission_order(PolicyKind p, bool reprioritize = false) {
  GpuScheduler s(24 * M, p, kOwnLanes);
  EXPECT_EQ(s.arrive(1, arena::Need{M, 15 * M}, 0, 10, 0), arena::ArenaError::ok);
  s.take_admissions();
  // Arrival order 2, 3, 4; remaining work 300, 100, 200 iterations; priority 1, 3, 2.
  const std::uint64_t iters[] = {300, 100, 200};
  const std::int32_t prio[] = {1, 3, 2};
  for (SessionId id = 2; id <= 4; ++id)
    EXPECT_EQ(s.arrive(id, arena::Need{2 * M, 12 * M}, prio[id - 2], iters[id - 2], 1),
              arena::ArenaError::ok);
  if (reprioritize) s.set_priority(2, 9);
  EXPECT_TRUE(s.take_admissions().empty());
  std::vector<SessionId> order;
  SessionId leaving = 1;
  for (int i = 0; i < 3; ++i) {
    s.leave(leaving, 2 + i);
    const auto adm = s.take_admissions();
    EXPECT_EQ(adm.size(), 1u);
    if (adm.empty()) break;
    order.push_back(adm[0].session);
    leaving = adm[0].session;
  }
  return order;
}
}  // namespace

TEST(Admission, FollowsThePolicyKey) {
  EXPECT_EQ(admission_order(PolicyKind::fifo), (std::vector<SessionId>{2, 3, 4}));
  EXPECT_EQ(admission_order(PolicyKind::pack), (std::vector<SessionId>{2, 3, 4}));
  EXPECT_EQ(admission_order(PolicyKind::srtf), (std::vector<SessionId>{3, 4, 2}));
  EXPECT_EQ(admission_order(PolicyKind::priority), (std::vector<SessionId>{3, 4, 2}));
  EXPECT_EQ(admission_order(PolicyKind::fair), (std::vector<SessionId>{2, 3, 4}));
  // A new priority moves a waiting session in the queue.
  EXPECT_EQ(admission_order(PolicyKind::priority, true), (std::vector<SessionId>{2, 3, 4}));
}

TEST(Admission, APolicyChangeReordersTheQueue) {
  GpuScheduler s(24 * M, PolicyKind::fifo, kOwnLanes);
  EXPECT_EQ(s.arrive(1, arena::Need{M, 15 * M}, 0, 10, 0), arena::ArenaError::ok);
  s.take_admissions();
  EXPECT_EQ(s.arrive(2, arena::Need{2 * M, 12 * M}, 0, 500, 1), arena::ArenaError::ok);
  EXPECT_EQ(s.arrive(3, arena::Need{2 * M, 12 * M}, 0, 50, 1), arena::ArenaError::ok);
  std::vector<SessionId> queued;
  for (const auto& q : s.arena().queue()) queued.push_back(q.session);
  EXPECT_EQ(queued, (std::vector<SessionId>{2, 3}));
  s.set_policy(PolicyKind::srtf);
  queued.clear();
  for (const auto& q : s.arena().queue()) queued.push_back(q.session);
  EXPECT_EQ(queued, (std::vector<SessionId>{3, 2}));
}
