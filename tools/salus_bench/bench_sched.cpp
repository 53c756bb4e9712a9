// salus-bench subcommands that time the pure cores (arena/ and sched/) with no
// daemon: admission decisions, scheduler decisions and memory utilization.
#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "arena/gpu_arena.hpp"
#include "sched/gpu_scheduler.hpp"
#include "sched/trace_generator.hpp"
#include "tools/salus_bench/bench_common.hpp"

namespace salus::bench {
namespace {

// Admission decisions of the pure arena at scale (no daemon involved): ~1,000
// sessions in ~100 lanes, then request/leave pairs, timing each call.
int bench_assign(int sessions, int rounds) {
  using namespace salus::arena;
  constexpr Bytes M = 1u << 20;
  GpuArena arena(16ull << 30);
  arena::SessionId next = 1;
  for (int i = 0; i < sessions; ++i) {
    // 100 big lanes first; the rest carry no persistent memory so they can all be
    // admitted into existing lanes once no new lane fits.
    const Bytes e = i < 100 ? 150 * M : (50 + static_cast<Bytes>(i % 100)) * M;
    arena.request(next++, Need{i < 100 ? M : 0, e}, 0);
  }
  (void)arena.take_admissions();
  const auto mem = arena.memory();
  std::vector<double> req_us, leave_us;
  for (int r = 0; r < rounds; ++r) {
    const arena::SessionId id = next++;
    auto t0 = Clock::now();
    arena.request(id, Need{0, (60 + static_cast<Bytes>(r % 90)) * M}, r);
    req_us.push_back(us_since(t0));
    (void)arena.take_admissions();
    t0 = Clock::now();
    arena.leave(id, r);
    leave_us.push_back(us_since(t0));
  }
  fmt::print("assign sessions={} lanes={} queued={} rounds={}\n", sessions, mem.lanes, mem.queued,
             rounds);
  fmt::print("  request (assignment decision)  p50 {:.2f} us  p99 {:.2f} us  (target p50 <= 10)\n",
             percentile(req_us, 0.5), percentile(req_us, 0.99));
  fmt::print("  leave (reassignment)           p50 {:.2f} us  p99 {:.2f} us\n",
             percentile(leave_us, 0.5), percentile(leave_us, 0.99));
#ifndef NDEBUG
  fmt::print(
      "  note: assertions are on (every call also checks all invariants); build with "
      "-Db_ndebug=true for decision cost\n");
#endif
  return 0;
}

// Scheduler decisions with many sessions in one lane: pick + the dispatch and
// completion bookkeeping that follow every decision. With `owners` > 1 the
// sessions belong to that many owners and FAIR shares per owner
// (FairShare::owner, salusd's default), timed beside the same lane shared per
// session in the same run.
struct DecideTimes {
  std::vector<double> pick_us, cycle_us;
};

DecideTimes time_decisions(int sessions, int rounds, sched::PolicyKind policy, int owners) {
  constexpr arena::Bytes M = 1u << 20;
  sched::GpuScheduler s(M + M / 2, policy);  // room for exactly one 1M lane
  if (owners > 1) s.set_fair_share(sched::FairShare::owner);
  for (int i = 1; i <= sessions; ++i) {
    s.arrive(static_cast<arena::SessionId>(i), arena::Need{0, M}, i % 7,
             static_cast<std::uint64_t>(1000 + i % 500), 0, static_cast<std::uint32_t>(i % owners));
  }
  const auto adm = s.take_admissions();
  if (adm.size() != static_cast<std::size_t>(sessions)) die("not every session was admitted");
  for (const auto& a : adm) s.set_runnable(a.session, true);
  const arena::LaneId lane = adm.front().lane;
  DecideTimes t;
  std::uint64_t ns = 1;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    const auto id = s.pick(lane);
    t.pick_us.push_back(us_since(t0));
    s.iteration_dispatched(*id);
    s.iteration_done(*id, static_cast<std::int64_t>(1000 + (ns++ * 7919) % 5000));
    t.cycle_us.push_back(us_since(t0));
  }
  return t;
}

// Decisions on a GPU of `lanes` lanes that run side by side, one iteration in
// flight each, sessions of `owners` owners spread over them, FAIR shared as
// `share`: after each completion every idle lane is offered a dispatch, as the
// broker does; timed is lane_may_dispatch + pick, per decision made.
std::vector<double> time_lane_decisions(int sessions, int rounds, int lanes, int owners,
                                        sched::FairShare share) {
  constexpr arena::Bytes M = 1u << 20;
  sched::GpuScheduler s(static_cast<arena::Bytes>(lanes) * M + M / 2, sched::PolicyKind::fair);
  s.set_fair_share(share);
  for (int i = 1; i <= sessions; ++i)
    s.arrive(static_cast<arena::SessionId>(i), arena::Need{0, M}, 0, {}, 0,
             static_cast<std::uint32_t>(i % owners));
  const auto adm = s.take_admissions();
  if (adm.size() != static_cast<std::size_t>(sessions)) die("not every session was admitted");
  std::vector<arena::LaneId> ids;
  for (const auto& a : adm) {
    s.set_runnable(a.session, true);
    if (std::find(ids.begin(), ids.end(), a.lane) == ids.end()) ids.push_back(a.lane);
  }
  std::vector<std::optional<arena::SessionId>> running(ids.size());
  std::vector<double> us;
  std::uint64_t ns = 1;
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t l = 0; l < ids.size(); ++l) {
      if (running[l]) continue;
      auto t0 = Clock::now();
      const auto id = s.lane_may_dispatch(ids[l]) ? s.pick(ids[l]) : std::nullopt;
      const double took = us_since(t0);
      if (!id) continue;
      us.push_back(took);
      s.iteration_dispatched(*id);
      running[l] = id;
    }
    const std::size_t done = static_cast<std::size_t>(r) % ids.size();
    if (running[done]) {
      s.iteration_done(*running[done], static_cast<std::int64_t>(1000 + (ns++ * 7919) % 5000));
      running[done].reset();
    }
  }
  return us;
}

int bench_decide_lanes(int sessions, int rounds, int lanes, int owners) {
  fmt::print("decide policy=fair sessions={} lanes={} owners={} rounds={}\n", sessions, lanes,
             owners, rounds);
  for (const auto share :
       {sched::FairShare::session, sched::FairShare::owner, sched::FairShare::owner_across_lanes}) {
    const std::vector<double> us = time_lane_decisions(sessions, rounds, lanes, owners, share);
    fmt::print("  {:18} lane_may_dispatch + pick p50 {:.3f} us  p99 {:.3f} us  ({} decisions)\n",
               sched::to_string(share), percentile(us, 0.5), percentile(us, 0.99), us.size());
  }
  return 0;
}

int bench_decide(int sessions, int rounds, const std::string& policy_name, int owners) {
  const auto policy = sched::policy_from_string(policy_name);
  if (!policy) die("unknown policy " + policy_name);
  auto lines = [](const char* what, const DecideTimes& t) {
    fmt::print(
        "  {:30} pick p50 {:.3f} us  p99 {:.3f} us (target p50 <= 5); "
        "pick + dispatched + done p50 {:.3f} us  p99 {:.3f} us\n",
        what, percentile(t.pick_us, 0.5), percentile(t.pick_us, 0.99), percentile(t.cycle_us, 0.5),
        percentile(t.cycle_us, 0.99));
  };
  fmt::print("decide policy={} sessions={} (one lane) rounds={} owners={}\n", policy_name, sessions,
             rounds, owners);
  const DecideTimes alone = time_decisions(sessions, rounds, *policy, 1);
  lines("shared per session", alone);
  if (owners > 1) {
    const DecideTimes shared = time_decisions(sessions, rounds, *policy, owners);
    lines("shared per owner", shared);
    fmt::print("  ratio per owner / per session  pick + dispatched + done p50 {:.2f}\n",
               percentile(shared.cycle_us, 0.5) / percentile(alone.cycle_us, 0.5));
  }
  return 0;
}

// Memory utilization: the Salus workload mix arriving in a seeded random order on
// one 16 GiB GPU, nobody leaving. Lanes (Algorithm 1) against static partitioning
// (each job an exclusive region of its peak), as admitted peak memory / capacity.
int bench_memutil(int seeds) {
  using namespace salus;
  const auto mix = sched::salus_workloads();
  constexpr arena::Bytes kCap = 16ull << 30;
  constexpr double M = 1 << 20;
  double lanes_sum = 0, static_sum = 0;
  std::size_t lanes_jobs = 0, static_jobs = 0, shared_jobs = 0, own_jobs = 0;
  for (int seed = 1; seed <= seeds; ++seed) {
    std::vector<std::size_t> order(mix.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
    std::shuffle(order.begin(), order.end(), rng);
    arena::GpuArena ar(kCap);
    // Attached sessions (salusd's arena_need): all in the GPU's one attached
    // lane group; with the shared lane their ephemeral need counts once (the
    // lane's size), without it each holds P + E as its own.
    arena::GpuArena shared(kCap), own(kCap);
    double static_used = 0, lane_peaks = 0, static_peaks = 0;
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto& w = mix[order[i]];
      const auto p = static_cast<arena::Bytes>(w.persistent_mb * M);
      const auto e = static_cast<arena::Bytes>((w.peak_mb - w.persistent_mb) * M);
      ar.request(i + 1, arena::Need{p, e}, 0);
      shared.request(i + 1, arena::Need{p, e, 1}, 0);
      own.request(i + 1, arena::Need{p + e, 0, 1}, 0);
      if (static_used + w.peak_mb * M <= static_cast<double>(kCap)) {
        static_used += w.peak_mb * M;
        static_peaks += w.peak_mb * M;
        ++static_jobs;
      }
    }
    for (const auto& a : ar.take_admissions()) {
      const auto& w = mix[order[a.session - 1]];
      lane_peaks += w.peak_mb * M;
      ++lanes_jobs;
    }
    shared_jobs += shared.take_admissions().size();
    own_jobs += own.take_admissions().size();
    lanes_sum += lane_peaks / static_cast<double>(kCap);
    static_sum += static_peaks / static_cast<double>(kCap);
  }
  fmt::print("memutil workloads={} gpu=16GiB seeds={}\n", mix.size(), seeds);
  fmt::print("  lanes (Algorithm 1)    admitted peaks / capacity {:.2f}  jobs admitted {:.1f}\n",
             lanes_sum / seeds, static_cast<double>(lanes_jobs) / seeds);
  fmt::print("  static partitioning    admitted peaks / capacity {:.2f}  jobs admitted {:.1f}\n",
             static_sum / seeds, static_cast<double>(static_jobs) / seeds);
  fmt::print("  ratio lanes/static     {:.2f}\n", lanes_sum / static_sum);
  fmt::print("  attached, shared lane  jobs admitted {:.1f}\n",
             static_cast<double>(shared_jobs) / seeds);
  fmt::print("  attached, own memory   jobs admitted {:.1f}\n",
             static_cast<double>(own_jobs) / seeds);
  return 0;
}

}  // namespace

void add_sched_benches(CLI::App& app, Registry& r) {
  auto* asg = app.add_subcommand("assign", "Arena admission decision time (pure, no daemon)");
  auto assign_sessions = std::make_shared<int>(1000);
  auto rounds = std::make_shared<int>(20000);
  asg->add_option("--sessions", *assign_sessions, "Sessions admitted first");
  asg->add_option("--rounds", *rounds, "Timed request/leave pairs");
  r.add(asg, [=](Target&) { return bench_assign(*assign_sessions, *rounds); });

  auto* dec = app.add_subcommand("decide", "Scheduler decision time (pure, no daemon)");
  auto decide_sessions = std::make_shared<int>(10000);
  auto decide_rounds = std::make_shared<int>(100000);
  auto decide_policy = std::make_shared<std::string>("fair");
  dec->add_option("--sessions", *decide_sessions, "Sessions sharing one lane");
  dec->add_option("--rounds", *decide_rounds, "Timed decisions");
  dec->add_option("--policy", *decide_policy, "fifo, pack, srtf, fair or priority");
  auto decide_owners = std::make_shared<int>(1);
  dec->add_option("--owners", *decide_owners,
                  "Owners of the sessions: above 1, also timed with FAIR shared per owner")
      ->check(CLI::Range(1, 1 << 20));
  auto decide_lanes = std::make_shared<int>(1);
  dec->add_option("--lanes", *decide_lanes,
                  "Lanes side by side: above 1, FAIR per session, user and user-across-lanes "
                  "(--policy is fair)")
      ->check(CLI::Range(1, 4096));
  r.add(dec, [=](Target&) {
    if (*decide_lanes > 1)
      return bench_decide_lanes(*decide_sessions, *decide_rounds, *decide_lanes, *decide_owners);
    return bench_decide(*decide_sessions, *decide_rounds, *decide_policy, *decide_owners);
  });

  auto* mu = app.add_subcommand("memutil", "Lanes vs static partitioning memory utilization");
  auto seeds = std::make_shared<int>(100);
  mu->add_option("--seeds", *seeds, "Random arrival orders");
  r.add(mu, [seeds](Target&) { return bench_memutil(*seeds); });
}

}  // namespace salus::bench
