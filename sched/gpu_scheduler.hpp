// One GPU's scheduling state: the arena (admission, lanes, memory) plus, per lane,
// the ranked set of runnable sessions that decides whose iteration runs next.
// Event-driven with times passed in, so salusd and salus-sim share it.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "sched/policy.hpp"
#include "sched/residency.hpp"

namespace salus::sched {

using arena::LaneId;
using arena::SessionId;

// How FAIR divides the GPU: equal shares per session; equal shares of a lane per
// owner (a uid), each owner's share split among its sessions that compete in the
// lane; or that, and per owner across the lanes of the GPU too, which run side by
// side (pick). Named session, user and user-across-lanes in salusd's
// and salus-sim's flags and in /salus/policy.
enum class FairShare : std::uint8_t { session, owner, owner_across_lanes };
// Whether shares follow owners (both owner modes).
constexpr bool by_owner(FairShare f) {
  return f != FairShare::session;
}
std::string_view to_string(FairShare f);
std::optional<FairShare> fair_share_from_string(std::string_view name);

struct SessionSched {
  SessionId id = 0;
  std::uint32_t owner = 0;  // FairShare::owner: whose share the session draws on
  RankInputs in;
  std::optional<LaneId> lane;
  bool runnable = false;
  std::uint32_t in_flight = 0;       // iterations dispatched and not yet done
  std::int64_t gpu_ns = 0;           // device time of finished iterations
  std::deque<std::int64_t> charged;  // FAIR: estimates charged for iterations in flight
  // The same estimates unscaled, as charged to its owner's service (see pick).
  std::deque<std::int64_t> service_charged;
  RankKey key;  // valid while runnable
};

struct SchedStats {
  std::uint64_t decisions = 0;
  std::uint64_t switches = 0;     // a lane ran a different session than its previous one
  std::uint64_t preemptions = 0;  // ... while the previous one still had work
};

class GpuScheduler {
 public:
  GpuScheduler(arena::Bytes capacity, PolicyKind policy, arena::ArenaOptions options = {});

  arena::GpuArena& arena() { return arena_; }
  const arena::GpuArena& arena() const { return arena_; }
  PolicyKind policy() const { return policy_; }
  // Sessions already admitted continue under the new policy: every lane is re-ranked, and
  // the admission queue re-ordered by the new policy's key (sched::admission_key).
  void set_policy(PolicyKind policy);

  arena::ArenaError arrive(SessionId id, arena::Need need, std::int32_t priority,
                           std::optional<std::uint64_t> iters, TimeNs now, std::uint32_t owner = 0);
  // FairShare::owner makes FAIR charge each iteration times the number of its
  // owner's sessions competing in its lane (fair_factor), so that an owner's
  // sessions together get one owner's share: weighted fair queueing whose
  // weights follow who is runnable. It also admits, among waiting sessions, the
  // owner with the fewest admitted here first (queue_key). owner_across_lanes
  // adds holding owners back across lanes (pick). Set before sessions arrive; the default here is
  // FairShare::session (salusd and salus-sim default to owner).
  void set_fair_share(FairShare share);
  FairShare fair_share() const { return fair_share_; }
  // Under FairShare::owner, while sessions of two owners or more compete in s's
  // lane: the sessions of s's owner that are runnable there, itself included
  // whether runnable or not. Otherwise 1, so that a lane of one owner's sessions
  // is shared exactly as under FairShare::session.
  std::int64_t fair_factor(const SessionSched& s) const;
  arena::ArenaError change_need(SessionId id, arena::Need need, std::optional<std::uint64_t> iters,
                                TimeNs now);
  // Re-ranks the session, in its lane or in the admission queue (which may admit).
  void set_priority(SessionId id, std::int32_t priority);
  void leave(SessionId id, TimeNs now);
  // Admissions since the last call; lane membership is updated before returning.
  std::vector<arena::Admitted> take_admissions();

  // Whether the session has dispatchable work; only runnable sessions are picked.
  void set_runnable(SessionId id, bool runnable);
  // Whether a lane may start an iteration now. FIFO runs one session at a time
  // on the whole GPU (the earliest arrival with work, to completion), so only
  // that session's lane may dispatch. A session whose last queued iteration is
  // still running holds the GPU until it ends, so the next job does not start
  // under it. The other policies run every lane (FAIR by owner across lanes
  // holds owners back in pick()).
  bool lane_may_dispatch(LaneId lane) const;
  // Whether pick() passes over the session now because its owner is held.
  bool held_for_owner(const SessionSched& s) const;
  // The sessions the last pick() passed over for their owners and re-ranked (their
  // keys changed: salus-sim re-sorts its copy of the lane).
  const std::vector<SessionId>& reranked_by_pick() const { return passed_held_; }
  // Whether pick() may pass over the best-ranked runnable session of a lane
  // (oversubscribed: swapped sessions; FAIR by owner: held owners).
  bool passes_over_ranks() const { return oversubscribed() || owners_gated(); }
  // Device time received on this GPU by the owner's sessions (settled), for status.
  std::int64_t owner_service_ns(std::uint32_t owner) const;
  // The decision: the lane's best-ranked runnable session, counted in stats. When
  // oversubscribed, only a resident session that is not leaving or arriving is picked;
  // swapped sessions ranked ahead of it are noted as wanted for plan_residency.
  //
  // FairShare::owner_across_lanes, across the lanes of this GPU, which run side
  // by side: while two owners or more have sessions runnable or running here, an
  // owner is ahead when it has received more device time here (settled, plus
  // estimates in flight) than the least-served other such owner, by more than
  // one of the session's iterations. A session of an owner ahead is held (passed
  // over; nullopt when the lane has no other) while another of its owner's
  // iterations runs in another lane, and in any lane goes after the sessions of
  // owners not ahead (first_eligible). One lane per owner always runs, so the GPU
  // never idles for it, and pipelining inside a lane is untouched; a user who
  // opens many sessions in many lanes gets about one user's share.
  std::optional<SessionId> pick(LaneId lane);
  // Oversubscription: which swaps to start now, for the sessions picks found swapped.
  ResidencyPlan plan_residency(const std::function<bool(SessionId)>& swappable, TimeNs now);
  // A swapped session needs its memory for something other than a dispatch (an
  // allocation, a transfer): plan_residency treats it as wanted.
  void want_resident(SessionId id);
  ResidencyPlanner& residency() { return residency_; }
  const ResidencyPlanner& residency() const { return residency_; }
  bool oversubscribed() const { return arena_.options().oversubscribe > 1.0; }
  // An iteration was handed to the device. FAIR charges its expected cost now
  // (the measured mean) so that a pipelined lane still alternates sessions;
  // iteration_done replaces the estimate with the measurement.
  void iteration_dispatched(SessionId id);
  // Work finished after `device_ns` of device time: GPU time and FAIR's virtual
  // time always count; only a real iteration (`iteration`) advances the done
  // count and the mean that SRTF ranks by. Then the session is re-ranked.
  void iteration_done(SessionId id, std::int64_t device_ns, bool iteration = true);
  // iteration_dispatched then iteration_done of one iteration, re-ranking once:
  // the same state as the two calls, for salus-sim's replay of a coalesced run,
  // where nothing looks at the ranking in between.
  void iteration_cycle(SessionId id, std::int64_t device_ns);
  // `count` more iterations of the session its lane last picked, each picked again at the
  // boundary before it, together `device_ns` of device time (each at least 1 ns), the
  // last of them `last_ns`: the state `count` iteration_cycle calls with their picks
  // leave, in O(1). For salus-sim's coalesced runs, whose forecast guarantees the picks.
  void iterations_repeated(SessionId id, std::uint64_t count, std::int64_t device_ns,
                           std::int64_t last_ns);
  // Iterations of several sessions of one lane in turn, none of them dispatched before:
  // each `turns[i]` session `count` more iterations, together `device_ns`, in an order that
  // made `picks` decisions, `switches` of them to a different session, each a preemption
  // (no session runs out of work inside), the last pick `last` at virtual time
  // `last_vtime`. The state those iteration_cycle calls with their picks leave, in
  // O(sessions). For salus-sim's FAIR runs, whose closed form guarantees the picks.
  struct Turns {
    SessionId id = 0;
    std::uint64_t count = 0;
    std::int64_t device_ns = 0;
  };
  void turns_repeated(LaneId lane, const std::vector<Turns>& turns, std::uint64_t picks,
                      std::uint64_t switches, SessionId last, std::int64_t last_vtime);
  // What FAIR charges at dispatch: the measured mean, rounded, at least 1 ns.
  static std::int64_t charge_estimate(const RankInputs& in);

  const SessionSched* find(SessionId id) const;
  const SchedStats& stats() const { return stats_; }
  std::size_t runnable_in_lane(LaneId lane) const;

 private:
  using RankSet = std::set<std::pair<RankKey, SessionId>>;
  struct LaneQueue {
    RankSet runnable;
    std::optional<SessionId> last;
    std::int64_t vclock = 0;  // FAIR: virtual time of the session last put in service
    // FairShare::owner: runnable sessions per owner (entries are kept at 0, so a
    // lane allocates once per owner it has seen).
    std::unordered_map<std::uint32_t, std::uint32_t> runnable_by_owner;
    std::uint32_t owners_runnable = 0;  // owners with a runnable session here
  };
  struct OwnerCount;
  void account_done(SessionSched& s, std::int64_t device_ns, bool iteration, int in_flight = 0);
  // `counts`: also the owner's runnable counts (not for a re-rank, which
  // removes and inserts the same session).
  void unlink(SessionSched& s, bool counts = true);
  void link(SessionSched& s, bool counts = true);
  // The owner's side of an iteration dispatched (estimate charged) or done (device
  // time settled), its iterations in flight moved by `in_flight`.
  void charge_owner(SessionSched& s, std::int64_t estimate, int in_flight);
  void settle_owner(SessionSched& s, std::int64_t device_ns, int in_flight);
  void owner_moved(std::uint32_t owner, int runnable, int in_flight);
  void owner_moved(std::uint32_t owner, OwnerCount& o, int runnable, int in_flight);
  void rerank(SessionSched& s);
  void forget_in_flight(SessionSched& s);
  void requeue_key(const SessionSched& s);
  bool admits_by_owner() const;
  bool owners_gated() const;
  enum class OwnerTier : std::uint8_t { behind, ahead, held };  // see pick
  // The two least-served competing owners' device time here (received: settled
  // plus in flight), for owner_tier; owner_view also fills running_elsewhere_.
  struct OwnerView {
    std::int64_t least = INT64_MAX, second = INT64_MAX;
    std::uint32_t least_owner = 0;
  };
  // Sessions a decision looks at in a lane for their owners (first_eligible).
  static constexpr std::size_t kOwnerScan = 64;
  OwnerView owner_view(LaneId lane) const;
  OwnerTier owner_tier(const SessionSched& s, const OwnerView& v) const;
  std::optional<SessionId> first_eligible(const LaneQueue& q, LaneId lane);
  double queue_key(const RankInputs& in, std::uint32_t owner) const;
  // A runnable session's rank among other lanes' (plan_residency's order).
  RankKey cross_lane_key(const SessionSched& s) const;
  void count_owner(std::uint32_t owner, int present, int admitted);

  arena::GpuArena arena_;
  PolicyKind policy_;
  FairShare fair_share_ = FairShare::session;
  // Per owner with sessions here: how many, and how many admitted (with a lane),
  // for FAIR by owner's admission order.
  struct OwnerCount {
    std::uint32_t present = 0;
    std::uint32_t admitted = 0;
    std::uint32_t runnable = 0;   // its sessions runnable in a lane here
    std::uint32_t in_flight = 0;  // its iterations in flight here
    bool active() const { return runnable > 0 || in_flight > 0; }
    std::int64_t service_ns = 0;        // device time its sessions received here, settled
    std::int64_t charged_ns = 0;        // estimates of its iterations in flight here
    std::int64_t last_estimate_ns = 0;  // the estimate of its latest iteration here
  };
  std::unordered_map<std::uint32_t, OwnerCount> owners_;
  std::uint32_t owners_active_ = 0;     // owners with a session runnable or running here
  std::vector<SessionId> passed_held_;  // scratch for pick(): sessions passed over for owners
  // Scratch for owner_view: owners with an iteration in flight in another lane.
  mutable std::vector<std::uint32_t> running_elsewhere_;
  std::uint64_t next_arrival_ = 0;
  std::unordered_map<SessionId, SessionSched> sessions_;
  std::unordered_map<LaneId, LaneQueue> lanes_;
  // Sessions with an iteration in flight: at most lanes x pipeline depth, so FIFO's
  // lane_may_dispatch scans it.
  std::vector<SessionId> in_flight_;
  SchedStats stats_;
  ResidencyPlanner residency_;
  std::vector<SessionId> wanted_;  // swapped sessions picks passed over, best first
};

}  // namespace salus::sched
