// Oversubscription's core: GpuArena's residency (swap out/in, the two bounds) and
// ResidencyPlanner's decisions (quantum from the swap cost, no thrash, no overtaking),
// with seeded random event streams checking the invariants after every event.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "sched/gpu_scheduler.hpp"
#include "sched/residency.hpp"

namespace salus::sched {
namespace {

using arena::ArenaError;
using arena::ArenaOptions;
using arena::GpuArena;
using arena::Need;
using arena::Residency;
using arena::SwapBuffer;

constexpr Bytes M = Bytes{1} << 20;

ArenaOptions oversub(double r) {
  ArenaOptions o;
  o.oversubscribe = r;
  return o;
}

TEST(ArenaResidency, RatioOneKeepsEverySessionResident) {
  GpuArena a(100 * M);
  ASSERT_EQ(a.request(1, {60 * M, 10 * M}, 0), ArenaError::ok);
  ASSERT_EQ(a.request(2, {60 * M, 10 * M}, 0), ArenaError::ok);
  EXPECT_EQ(a.take_admissions().size(), 1u);
  EXPECT_EQ(a.residency(1), Residency::resident);
  EXPECT_EQ(a.memory().admit_capacity, 100 * M);
}

TEST(ArenaResidency, OversubscribedAdmitsBeyondCapacityAndSwaps) {
  GpuArena a(100 * M, oversub(2.0));
  ASSERT_EQ(a.request(1, {60 * M, 10 * M}, 0), ArenaError::ok);
  ASSERT_EQ(a.request(2, {60 * M, 10 * M}, 0), ArenaError::ok);
  EXPECT_EQ(a.take_admissions().size(), 2u);  // 140 MiB admitted on a 100 MiB card
  EXPECT_EQ(a.residency(1), Residency::resident);
  EXPECT_EQ(a.residency(2), Residency::swapped);  // its P did not fit beside session 1
  EXPECT_EQ(a.alloc_persistent(2, M).error, ArenaError::swapped_out);
  const auto b1 = a.alloc_persistent(1, 50 * M);
  ASSERT_EQ(b1.error, ArenaError::ok);
  std::vector<SwapBuffer> out;
  EXPECT_EQ(a.swap_in(2, out), ArenaError::no_memory);
  ASSERT_TRUE(a.begin_swap_out(1, out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].buffer, b1.handle);
  EXPECT_EQ(a.alloc_persistent(1, M).error, ArenaError::swapped_out);
  a.finish_swap_out(1, 1);
  EXPECT_EQ(a.residency(1), Residency::swapped);
  EXPECT_EQ(a.memory().swapped, 50 * M);
  ASSERT_EQ(a.swap_in(2, out), ArenaError::ok);
  EXPECT_TRUE(out.empty());  // it held nothing yet
  ASSERT_EQ(a.alloc_persistent(2, 55 * M).error, ArenaError::ok);
  // Session 1 comes back under the same handle once session 2 is out.
  ASSERT_TRUE(a.begin_swap_out(2, out));
  a.finish_swap_out(2, 2);
  ASSERT_EQ(a.swap_in(1, out), ArenaError::ok);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].buffer, b1.handle);
  EXPECT_EQ(out[0].size, 50 * M);
  EXPECT_EQ(a.buffer_offset(b1.handle), out[0].offset);
  EXPECT_EQ(a.check_invariants(), "");
}

// Oversubscribed, a lane may open only if every admitted session could still run
// beside all the lanes, the others swapped out: lanes are for life, and lanes that
// left no session room would hold the GPU idle with everyone swapped out.
TEST(ArenaResidency, ALaneOpensOnlyIfEverySessionCouldStillRunBesideTheLanes) {
  GpuArena a(100 * M, oversub(2.0));
  ASSERT_EQ(a.request(1, {40 * M, 10 * M}, 0), ArenaError::ok);
  ASSERT_EQ(a.request(2, {40 * M, 10 * M}, 0), ArenaError::ok);
  EXPECT_EQ(a.take_admissions().size(), 2u);
  const Bytes lanes = a.memory().lane_total;
  // 55M more of lanes would leave 100 - lanes - 55 < 40M for session 1 or 2.
  ASSERT_LT(100 * M - lanes - 55 * M, 40 * M);
  ASSERT_EQ(a.request(3, {10 * M, 55 * M}, 0), ArenaError::ok);
  EXPECT_TRUE(a.take_admissions().empty());
  EXPECT_EQ(a.lane_room_wanted(), 0u);  // swapping cannot make that room
  EXPECT_EQ(a.check_invariants(), "");
  // When session 2 leaves, 3 may grow 1's lane: 55M of lanes and 40M of P fit.
  a.leave(2, 1);
  EXPECT_EQ(a.take_admissions().size(), 1u);
  EXPECT_LE(a.memory().lane_total + 40 * M, 100 * M);

  // A lane that leaves room for the largest P beside every lane is room worth
  // swapping for.
  GpuArena b(100 * M, oversub(2.0));
  ASSERT_EQ(b.request(1, {40 * M, 10 * M}, 0), ArenaError::ok);
  ASSERT_EQ(b.request(2, {40 * M, 10 * M}, 0), ArenaError::ok);
  b.take_admissions();
  const Bytes e = 100 * M - lanes - 40 * M;
  ASSERT_EQ(b.request(3, {10 * M, e}, 0), ArenaError::ok);
  EXPECT_TRUE(b.take_admissions().empty());  // 1 and 2 are resident
  EXPECT_EQ(b.lane_room_wanted(), e);
}

TEST(ArenaResidency, FreeOfASwappedBufferAndLeave) {
  GpuArena a(100 * M, oversub(1.5));
  ASSERT_EQ(a.request(1, {40 * M, 10 * M}, 0), ArenaError::ok);
  const auto b = a.alloc_persistent(1, 30 * M);
  std::vector<SwapBuffer> out;
  ASSERT_TRUE(a.begin_swap_out(1, out));
  a.cancel_swap_out(1);  // the copy failed: nothing moved
  EXPECT_EQ(a.residency(1), Residency::resident);
  ASSERT_TRUE(a.begin_swap_out(1, out));
  a.finish_swap_out(1, 0);
  a.free_persistent(b.handle);
  EXPECT_EQ(a.memory().swapped, 0u);
  a.leave(1, 0);
  EXPECT_EQ(a.check_invariants(), "");
}

TEST(ArenaResidency, RunningSessionIsNotSwappedOut) {
  GpuArena a(100 * M, oversub(2.0));
  ASSERT_EQ(a.request(1, {40 * M, 10 * M}, 0), ArenaError::ok);
  const auto adm = a.take_admissions();
  a.begin_iteration(adm[0].lane, 1, M);
  std::vector<SwapBuffer> out;
  EXPECT_FALSE(a.begin_swap_out(1, out));
  a.end_iteration(adm[0].lane, 1);
  EXPECT_TRUE(a.begin_swap_out(1, out));
}

// An attached program's CUDA context stays on the card when its memory is swapped
// out: the unswappable part of P counts in the resident set whatever the residency.
TEST(ArenaResidency, TheUnswappablePartStaysOnTheCard) {
  GpuArena a(100 * M, oversub(3.0));
  Need pinned{40 * M, 4 * M};
  pinned.unswappable = 16 * M;
  ASSERT_EQ(a.request(1, pinned, 0), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  EXPECT_EQ(a.swap_in_bytes(1), 24 * M);  // what a swap-out frees
  const Bytes lanes = a.memory().lane_total;
  // 2 does not fit beside 1 and starts swapped; it could run beside 1's 16M.
  ASSERT_EQ(a.request(2, {72 * M, lanes}, 1), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  EXPECT_EQ(a.residency(2), Residency::swapped);
  std::vector<SwapBuffer> out;
  ASSERT_TRUE(a.begin_swap_out(1, out));
  a.finish_swap_out(1, 1);
  EXPECT_EQ(a.residency(1), Residency::swapped);
  EXPECT_EQ(a.memory().resident_reserved, 16 * M);
  EXPECT_EQ(a.resident_room(), 100 * M - 16 * M - a.memory().lane_total);
  ASSERT_EQ(a.swap_in(2, out), ArenaError::ok);
  EXPECT_EQ(a.resident_room(), 100 * M - 16 * M - 72 * M - a.memory().lane_total);
  // A session whose unswappable part cannot sit beside 16M + lanes is never
  // admitted; nor is one after which 2 could no longer run.
  Need big = {85 * M, lanes};
  big.unswappable = 90 * M;
  ASSERT_EQ(a.request(3, big, 3), ArenaError::ok);
  EXPECT_TRUE(a.take_admissions().empty());
  a.leave(3, 4);
  big = {30 * M, lanes};
  big.unswappable = 10 * M;
  ASSERT_EQ(a.request(4, big, 5), ArenaError::ok);
  EXPECT_TRUE(a.take_admissions().empty());
  a.leave(4, 6);
  // With 2 out, admitted swapped (its P does not fit beside the others), a session
  // still puts its unswappable part on the card.
  ASSERT_TRUE(a.begin_swap_out(2, out));
  a.finish_swap_out(2, 7);
  ASSERT_EQ(a.swap_in(1, out), ArenaError::ok);
  EXPECT_EQ(a.memory().resident_reserved, 40 * M);
  big = {60 * M, lanes};
  big.unswappable = 12 * M;
  ASSERT_EQ(a.request(5, big, 8), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 0u);  // 2 could not run beside 16M + 12M
  a.leave(5, 9);
  big = {60 * M, lanes};
  big.unswappable = 4 * M;
  ASSERT_EQ(a.request(6, big, 10), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  EXPECT_EQ(a.residency(6), Residency::swapped);
  EXPECT_EQ(a.memory().resident_reserved, 44 * M);
  EXPECT_EQ(a.swap_in_bytes(6), 56 * M);
  // Swapping 1 out and back in needs room for its movable 24M only.
  ASSERT_TRUE(a.begin_swap_out(1, out));
  a.finish_swap_out(1, 11);
  EXPECT_EQ(a.memory().resident_reserved, 20 * M);
  EXPECT_EQ(a.swap_in(1, out), ArenaError::ok);
  EXPECT_EQ(a.memory().resident_reserved, 44 * M);
  EXPECT_EQ(a.check_invariants(), "");
  for (SessionId id : {1, 2, 6}) a.leave(id, 12);
  EXPECT_EQ(a.memory().resident_reserved, 0u);
  EXPECT_EQ(a.check_invariants(), "");
}

// What stays on the card is learned at a swap-out (an attached program reports
// what its shim cannot move); it can be changed only while the session is on the
// GPU, where it changes nothing in the resident set.
TEST(ArenaResidency, TheUnswappablePartIsLearnedAtASwapOut) {
  GpuArena a(100 * M, oversub(2.0));
  Need n{40 * M, 0};
  n.unswappable = 4 * M;
  ASSERT_EQ(a.request(1, n, 0), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  std::vector<SwapBuffer> out;
  ASSERT_TRUE(a.begin_swap_out(1, out));
  const Bytes before = a.memory().resident_reserved;
  ASSERT_TRUE(a.set_unswappable(1, 12 * M));
  EXPECT_EQ(a.memory().resident_reserved, before);
  EXPECT_EQ(a.swap_in_bytes(1), 28 * M);
  a.finish_swap_out(1, 1);
  EXPECT_EQ(a.memory().resident_reserved, 12 * M);
  EXPECT_FALSE(a.set_unswappable(1, 0));  // swapped: it would change the resident set
  EXPECT_EQ(a.memory().resident_reserved, 12 * M);
  ASSERT_EQ(a.swap_in(1, out), ArenaError::ok);
  EXPECT_EQ(a.memory().resident_reserved, 40 * M);
  ASSERT_TRUE(a.set_unswappable(1, 1000 * M));  // capped at P: a swap frees nothing
  EXPECT_EQ(a.swap_in_bytes(1), 0u);
  EXPECT_EQ(a.check_invariants(), "");
}

// The driver shows a swapped program holding more than it reported: the part
// grows as far as the card has room (what is there cannot be refused, only
// counted), never past P, and never shrinks by this path.
TEST(ArenaResidency, TheUnswappablePartGrowsToWhatTheDriverShows) {
  GpuArena a(100 * M, oversub(2.0));
  Need n{60 * M, 0};
  n.unswappable = 4 * M;
  ASSERT_EQ(a.request(1, n, 0), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  EXPECT_EQ(a.on_card_bytes(1), 60 * M);
  EXPECT_EQ(a.raise_unswappable(1, 10 * M), 10 * M);  // on the GPU: no change to the set
  EXPECT_EQ(a.memory().resident_reserved, 60 * M);
  std::vector<SwapBuffer> out;
  ASSERT_TRUE(a.begin_swap_out(1, out));
  a.finish_swap_out(1, 1);
  EXPECT_EQ(a.on_card_bytes(1), 10 * M);
  ASSERT_EQ(a.request(2, {50 * M, 0}, 0), ArenaError::ok);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  ASSERT_EQ(a.residency(2), Residency::resident);
  EXPECT_EQ(a.memory().resident_reserved, 60 * M);
  EXPECT_EQ(a.raise_unswappable(1, 5 * M), 10 * M) << "never lowered";
  EXPECT_EQ(a.raise_unswappable(1, 30 * M), 30 * M);
  EXPECT_EQ(a.memory().resident_reserved, 80 * M);
  EXPECT_EQ(a.swap_in_bytes(1), 30 * M);
  // Past the room left (100M usable, 80M counted): capped at what fits, below P.
  EXPECT_EQ(a.raise_unswappable(1, 1000 * M), 50 * M);
  EXPECT_EQ(a.memory().resident_reserved, 100 * M);
  EXPECT_EQ(a.check_invariants(), "");
  // A session admitted now stays swapped: the card is full.
  ASSERT_EQ(a.request(3, {10 * M, 0}, 0), ArenaError::ok);
  EXPECT_EQ(a.take_admissions().size(), 1u);
  EXPECT_EQ(a.residency(3), Residency::swapped);
  EXPECT_EQ(a.raise_unswappable(99, 1), 0u);
  EXPECT_EQ(a.check_invariants(), "");
}

TEST(SwapCost, QuantumKeepsSwapUnderTenPercent) {
  SwapCostModel c;
  c.observe(1024 * M, 100'000'000);  // 1 GiB in 100 ms
  EXPECT_NEAR(c.bytes_per_s, 1024.0 * M / 0.1, 1.0);
  EXPECT_EQ(c.swap_ns(1024 * M), 100'000'000);
  EXPECT_EQ(c.quantum_ns(1024 * M), 2'000'000'000);  // 200 ms of swap per 2 s
  EXPECT_EQ(c.quantum_ns(1), c.min_quantum_ns);
  c.observe(1024, 1);  // too small to say anything about bandwidth
  EXPECT_EQ(c.measured, 1u);
}

// A program's swap report (attached sessions: its gate says the bytes, it
// decides when to answer) moves the GPU's estimate at most 2x either way, so
// that one program cannot make swaps look free (every quantum at its floor:
// thrash for all) or endless (every quantum huge). salusd's own copies move it
// freely.
TEST(SwapCost, AProgramsReportMovesTheEstimateAtMostTwofold) {
  SwapCostModel c;
  const double prior = c.bytes_per_s;
  c.observe(1024 * M, 1, SwapSource::reported);  // 1 GiB "in 1 ns"
  EXPECT_DOUBLE_EQ(c.bytes_per_s, 2 * prior);
  c.observe(1024 * M, 3'600'000'000'000, SwapSource::reported);  // "in an hour"
  EXPECT_DOUBLE_EQ(c.bytes_per_s, 0.75 * 2 * prior + 0.25 * prior);
  for (int i = 0; i < 3; ++i) c.observe(1024 * M, 1, SwapSource::reported);
  EXPECT_LE(c.bytes_per_s, 1.25 * 1.25 * 1.25 * 1.75 * prior * (1 + 1e-12));
  // salusd's own copy, under half the estimate now, is taken as measured.
  const double before = c.bytes_per_s;
  ASSERT_GT(before / 2, 1024.0 * M / 0.1);
  c.observe(1024 * M, 100'000'000);
  EXPECT_NEAR(c.bytes_per_s, 0.75 * before + 0.25 * 1024.0 * M / 0.1, 1.0);
}

// Three sessions of 45M + 5M on 100M at ratio 3: 1 and 2 resident with their
// buffers, 3 swapped.
void two_resident_one_swapped(GpuArena& a, ResidencyPlanner& p) {
  for (SessionId id : {1, 2, 3}) {
    ASSERT_EQ(a.request(id, {45 * M, 5 * M}, 0), ArenaError::ok);
    p.add(id, 0);
  }
  a.take_admissions();
  ASSERT_EQ(a.alloc_persistent(1, 45 * M).error, ArenaError::ok);
  ASSERT_EQ(a.alloc_persistent(2, 45 * M).error, ArenaError::ok);
}

// Swaps `id` out at `now` as the planner's caller does: the arena's copy, then the
// planner's bookkeeping of a swap that took `took`.
void swap_out_now(GpuArena& a, ResidencyPlanner& p, SessionId id, TimeNs now, TimeNs took) {
  const Bytes bytes = a.swap_in_bytes(id);
  std::vector<SwapBuffer> out;
  ASSERT_TRUE(a.begin_swap_out(id, out));
  p.swap_started(id, now);
  a.finish_swap_out(id, now);
  p.swap_out_done(id, bytes, took, now, true);
}

TEST(ResidencyPlanner, WaitsForTheQuantumThenEvictsLeastRecentlyRun) {
  GpuArena a(100 * M, oversub(3.0));
  ResidencyPlanner p;
  two_resident_one_swapped(a, p);
  if (HasFatalFailure()) return;
  ASSERT_EQ(a.residency(3), Residency::swapped);
  p.ran(1, 10);
  p.ran(2, 5);
  auto yes = [](SessionId) { return true; };
  const TimeNs q = p.cost().quantum_ns(45 * M);
  EXPECT_TRUE(p.plan(a, {3}, yes, q - 1).swap_out.empty());  // too soon: no thrash
  const ResidencyPlan plan = p.plan(a, {3}, yes, q);
  ASSERT_EQ(plan.swap_out, std::vector<SessionId>{2});  // ran longest ago
  EXPECT_TRUE(p.evicting(2));
  EXPECT_TRUE(p.plan(a, {3}, yes, q).swap_out.empty());  // one step at a time
  swap_out_now(a, p, 2, q, 10'000'000);
  if (HasFatalFailure()) return;
  const ResidencyPlan next = p.plan(a, {3}, yes, q);
  ASSERT_EQ(next.swap_in, std::optional<SessionId>{3});
  // A kind that cannot swap (attached without movable memory) is never a victim.
  EXPECT_TRUE(p.plan(
                   a, {2}, [](SessionId) { return false; }, 100 * q)
                  .swap_out.empty());
}

// The first wanted session waits for victims' quanta, and those behind it do not
// overtake it; but one that no eviction could make room for (the others are out
// already, or cannot be swapped: an attached program without movable memory) must
// not hold back one that fits, or the GPU may idle for ever.
TEST(ResidencyPlanner, NobodyOvertakesUnlessNoEvictionCouldMakeRoom) {
  GpuArena a(100 * M, oversub(3.0));
  ResidencyPlanner p;
  two_resident_one_swapped(a, p);
  if (HasFatalFailure()) return;
  ASSERT_EQ(a.request(4, {60 * M, 5 * M}, 0), ArenaError::ok);
  p.add(4, 0);
  ASSERT_EQ(a.take_admissions().size(), 1u);
  ASSERT_EQ(a.residency(4), Residency::swapped);
  swap_out_now(a, p, 2, 1, 1'000'000);
  if (HasFatalFailure()) return;
  const TimeNs q = p.cost().quantum_ns(45 * M);
  ASSERT_LT(a.resident_room(), 60 * M);
  ASSERT_GE(a.resident_room(), 45 * M);
  // 4 fits once 1's quantum is over: 3, which fits now, waits behind it.
  auto yes = [](SessionId) { return true; };
  const ResidencyPlan waiting = p.plan(a, {4, 3}, yes, q - 1);
  EXPECT_TRUE(waiting.swap_out.empty());
  EXPECT_FALSE(waiting.swap_in);
  // 1 cannot be swapped at all: waiting cannot make 4's room, so 3 comes in.
  const ResidencyPlan plan = p.plan(
      a, {4, 3}, [](SessionId id) { return id != 1; }, q - 1);
  EXPECT_TRUE(plan.swap_out.empty());
  EXPECT_EQ(plan.swap_in, std::optional<SessionId>{3});
  EXPECT_EQ(a.check_invariants(), "");
}

// A victim leaves at its iteration boundary. One that never comes to it (an attached
// notebook gone idle after a cell, a hung program) holds up the planner for
// stuck_after() at most; then another victim makes the room, and the stuck one,
// still chosen, is not chosen twice.
TEST(ResidencyPlanner, AVictimThatNeverLeavesHoldsUpTheOthersOnlyForAWhile) {
  GpuArena a(100 * M, oversub(3.0));
  ResidencyPlanner p;
  two_resident_one_swapped(a, p);
  if (HasFatalFailure()) return;
  p.ran(1, 10);
  p.ran(2, 5);
  auto yes = [](SessionId) { return true; };
  const TimeNs q = p.cost().quantum_ns(45 * M);
  ASSERT_EQ(p.plan(a, {3}, yes, q).swap_out, std::vector<SessionId>{2});
  // 2 never starts its swap-out (its iteration never ends).
  const TimeNs stuck = q + p.stuck_after();
  EXPECT_TRUE(p.plan(a, {3}, yes, stuck - 1).swap_out.empty());
  EXPECT_EQ(p.plan(a, {3}, yes, stuck).swap_out, std::vector<SessionId>{1});
  EXPECT_TRUE(p.evicting(2));
  swap_out_now(a, p, 1, stuck, 10'000'000);
  if (HasFatalFailure()) return;
  EXPECT_EQ(p.plan(a, {3}, yes, stuck).swap_in, std::optional<SessionId>{3});
  EXPECT_EQ(a.check_invariants(), "");
}

TEST(ResidencyPlanner, WithQuantaOffAStopDoesNotWaitForThem) {
  GpuArena a(100 * M, oversub(3.0));
  ResidencyPlanner p;
  two_resident_one_swapped(a, p);
  if (HasFatalFailure()) return;
  auto yes = [](SessionId) { return true; };
  EXPECT_TRUE(p.plan(a, {3}, yes, 1).swap_out.empty());  // within the quanta
  p.set_quanta(false);  // salusd is stopping: the save must bring 3 in now
  EXPECT_EQ(p.plan(a, {3}, yes, 1).swap_out.size(), 1u);
}

// Seeded random streams: every call of the residency API in every order, with the
// arena's invariants (the physical safety condition over the resident set, the
// admission bound, exact accounting, no overlap) checked after each event, and each
// buffer's handle and size kept exactly through any number of swaps.
class RandomStream : public ::testing::TestWithParam<std::uint64_t> {};

TEST_P(RandomStream, InvariantsHold) {
  const std::uint64_t seed = GetParam();
  std::mt19937_64 rng(seed);
  const double ratios[] = {1.0, 1.5, 2.0, 3.0};
  const double ratio = ratios[seed % 4];
  GpuArena a(256 * M, oversub(ratio));
  std::map<SessionId, std::set<arena::BufferHandle>> owned;
  std::map<arena::BufferHandle, Bytes> sizes;
  std::map<arena::LaneId, SessionId> busy;
  std::map<SessionId, Bytes> pins;  // each session's unswappable bytes (1 MiB multiples)
  SessionId next = 1;
  std::uint64_t swaps = 0;
  auto pick = [&]() -> SessionId {
    if (owned.empty()) return 0;
    auto it = owned.begin();
    std::advance(it, rng() % owned.size());
    return it->first;
  };
  for (int ev = 0; ev < 3000; ++ev) {
    const int op = static_cast<int>(rng() % 9);
    const SessionId s = pick();
    std::vector<SwapBuffer> out;
    switch (op) {
      case 0:
        if (owned.size() < 12) {
          Need n{(rng() % 96) * M, (rng() % 32 + 1) * M};
          if (rng() % 3 == 0) n.unswappable = (rng() % 48) * M;  // may exceed P: capped
          if (a.request(next, n, ev) == ArenaError::ok) {
            owned[next];
            pins[next] = std::min(n.unswappable, n.persistent);
          }
          ++next;
        }
        break;
      case 1:
        if (s && std::none_of(busy.begin(), busy.end(), [&](auto& b) { return b.second == s; })) {
          a.leave(s, ev);
          for (auto h : owned[s]) sizes.erase(h);
          owned.erase(s);
        }
        break;
      case 2:
      case 3:
        if (s) {
          const auto r = a.alloc_persistent(s, (rng() % 24 + 1) * M);
          if (r.error == ArenaError::ok) {
            owned[s].insert(r.handle);
            sizes[r.handle] = 1;
          }
        }
        break;
      case 4:
        if (s && !owned[s].empty() && a.residency(s) != Residency::swapping_out) {
          auto h = *owned[s].begin();
          a.free_persistent(h);
          owned[s].erase(h);
        }
        break;
      case 5:
        // salusd swaps only when oversubscribed; at ratio 1 nothing ever leaves the card.
        if (s && ratio > 1.0 && a.begin_swap_out(s, out)) {
          ASSERT_EQ(out.size(), owned[s].size());
          if (rng() % 3 == 0) {  // learned at the swap-out
            const Bytes learned = (rng() % 48) * M;
            ASSERT_TRUE(a.set_unswappable(s, learned));
            const auto p = a.placement(s);
            pins[s] = std::min(learned, p->declared.persistent);
          }
          if (rng() % 4 == 0) {
            a.cancel_swap_out(s);
          } else {
            a.finish_swap_out(s, ev);
            ++swaps;
          }
        }
        break;
      case 6:
        if (s && a.residency(s) == Residency::swapped && rng() % 4 == 0) {
          // The driver shows it holding more than its part: counted as far as there is room.
          const Bytes shown = (rng() % 64) * M;
          const Bytes room = a.resident_room();
          const Bytes p = a.placement(s)->declared.persistent;
          const Bytes expect = std::max(pins[s], std::min({shown, p, pins[s] + room}));
          ASSERT_EQ(a.raise_unswappable(s, shown), expect) << "seed " << seed << " event " << ev;
          pins[s] = expect;
        } else if (s && a.residency(s) == Residency::swapped) {
          const Bytes need = a.swap_in_bytes(s);
          const Bytes room = a.resident_room();
          const ArenaError e = a.swap_in(s, out);
          if (e == ArenaError::ok) {
            ASSERT_LE(need, room);
            std::set<arena::BufferHandle> back;
            for (const auto& b : out) back.insert(b.buffer);
            ASSERT_EQ(back, owned[s]) << "seed " << seed;  // same handles come back
          } else {
            ASSERT_TRUE(e == ArenaError::no_memory || e == ArenaError::fragmented);
          }
        }
        break;
      case 7:
        for (const auto& l : a.lanes())
          if (!l.busy && a.lane_ready(l.id) && !l.sessions.empty()) {
            a.begin_iteration(l.id, l.sessions.front(), 0);
            busy[l.id] = l.sessions.front();
            break;
          }
        break;
      case 8:
        if (!busy.empty()) {
          a.end_iteration(busy.begin()->first, ev);
          busy.erase(busy.begin());
        }
        break;
    }
    a.take_admissions();
    // Compaction the broker would run for idle sessions.
    for (auto& [id, hs] : owned)
      if (!a.session_idle(id).empty()) a.finish_moves(id, ev);
    const std::string problem = a.check_invariants();
    ASSERT_EQ(problem, "") << "seed " << seed << " event " << ev;
    const arena::MemorySummary m = a.memory();
    ASSERT_LE(m.resident_reserved + m.lane_total, m.capacity) << "seed " << seed;
    // Swapped sessions' unswappable parts stay in the resident set, and a swap
    // moves only the rest.
    Bytes pinned_out = 0;
    for (const auto& [id, hs] : owned) {
      const auto p = a.placement(id);
      if (!p || !p->admitted || a.residency(id) != Residency::swapped) continue;
      pinned_out += pins[id];
      ASSERT_EQ(a.swap_in_bytes(id),
                std::max(p->declared.persistent, p->persistent_used) - pins[id]);
    }
    ASSERT_GE(m.resident_reserved, pinned_out) << "seed " << seed << " event " << ev;
    if (ratio == 1.0) {
      ASSERT_EQ(m.swapped, 0u);
    }
  }
  if (ratio > 1.0) {
    EXPECT_GT(swaps, 0u) << "seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomStream, ::testing::Range<std::uint64_t>(1, 41));

}  // namespace
}  // namespace salus::sched
