#include "sched/gpu_scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "sched/saturating_count.hpp"

namespace salus::sched {

std::string_view to_string(FairShare f) {
  switch (f) {
    case FairShare::session:
      return "session";
    case FairShare::owner:
      return "user";
    case FairShare::owner_across_lanes:
      return "user-across-lanes";
  }
  return "?";
}

std::optional<FairShare> fair_share_from_string(std::string_view name) {
  for (const FairShare f : {FairShare::session, FairShare::owner, FairShare::owner_across_lanes})
    if (name == to_string(f)) return f;
  return std::nullopt;
}

GpuScheduler::GpuScheduler(arena::Bytes capacity, PolicyKind policy, arena::ArenaOptions options)
    : arena_(capacity, options), policy_(policy) {}

void GpuScheduler::set_policy(PolicyKind policy) {
  if (policy == policy_) return;
  policy_ = policy;
  for (auto& [id, s] : sessions_) rerank(s);
  for (auto& [id, s] : sessions_) requeue_key(s);
}

// A waiting session's place in the admission queue follows the policy's key.
void GpuScheduler::requeue_key(const SessionSched& s) {
  if (!s.lane) arena_.set_admission_key(s.id, queue_key(s.in, s.owner), 0);
}

// FAIR by owner, while sessions of two owners or more are here, admits the
// owner with the fewest sessions admitted here first (arrival order among
// equals), so that one user's queue of jobs does not keep another's first job
// waiting. Otherwise (one owner, or other policies) the policy's admission key.
bool GpuScheduler::admits_by_owner() const {
  return policy_ == PolicyKind::fair && by_owner(fair_share_) && owners_.size() >= 2;
}

double GpuScheduler::queue_key(const RankInputs& in, std::uint32_t owner) const {
  if (!admits_by_owner()) return admission_key(policy_, in);
  const auto c = owners_.find(owner);
  return c == owners_.end() ? 0.0 : static_cast<double>(c->second.admitted);
}

// An owner's sessions here (`present`) or admitted ones (`admitted`) changed by
// `delta`; the queue keys that follow from it move.
void GpuScheduler::count_owner(std::uint32_t owner, int present, int admitted) {
  const bool by_owner = admits_by_owner();
  OwnerCount& c = owners_[owner];
  c.present = static_cast<std::uint32_t>(static_cast<int>(c.present) + present);
  c.admitted = static_cast<std::uint32_t>(static_cast<int>(c.admitted) + admitted);
  if (c.present == 0) owners_.erase(owner);
  if (admits_by_owner() != by_owner) {  // a second owner came, or went: every key
    for (const auto& [id, s] : sessions_) requeue_key(s);
  } else if (by_owner && admitted != 0) {
    for (const auto& [id, s] : sessions_)
      if (s.owner == owner) requeue_key(s);
  }
}

void GpuScheduler::set_fair_share(FairShare share) {
  if (share == fair_share_) return;
  for (auto& [id, s] : sessions_) unlink(s);
  fair_share_ = share;
  for (auto& [id, s] : sessions_) link(s);
  for (auto& [id, s] : sessions_) requeue_key(s);
}

namespace {
// A charge times FAIR's factor, saturating far below the int64 range: a
// session's virtual time sums them.
std::int64_t scaled(std::int64_t ns, std::int64_t factor) {
  constexpr std::int64_t kMost = INT64_MAX / 4;
  return factor <= 1 ? ns : (ns > kMost / factor ? kMost : ns * factor);
}
}  // namespace

std::int64_t GpuScheduler::fair_factor(const SessionSched& s) const {
  if (!by_owner(fair_share_) || !s.lane) return 1;
  const auto q = lanes_.find(*s.lane);
  if (q == lanes_.end()) return 1;
  const auto c = q->second.runnable_by_owner.find(s.owner);
  const std::uint32_t mine = c == q->second.runnable_by_owner.end() ? 0 : c->second;
  // The session counts for its owner even between its iterations.
  const std::uint32_t owners = q->second.owners_runnable + (!s.runnable && mine == 0 ? 1 : 0);
  const std::uint32_t sessions = mine + (s.runnable ? 0 : 1);
  // One owner in the lane: plain per-session shares, exactly as FairShare::session.
  return owners < 2 ? 1 : static_cast<std::int64_t>(sessions);
}

arena::ArenaError GpuScheduler::arrive(SessionId id, arena::Need need, std::int32_t priority,
                                       std::optional<std::uint64_t> iters, TimeNs now,
                                       std::uint32_t owner) {
  if (sessions_.count(id)) return arena::ArenaError::duplicate;
  RankInputs in;
  in.arrival = next_arrival_;
  in.priority = priority;
  in.iters = iters;
  // Counted before the arena's pass, whose order may depend on it; undone if refused.
  count_owner(owner, +1, 0);
  const arena::ArenaError err = arena_.request(id, need, now, queue_key(in, owner));
  if (err != arena::ArenaError::ok) {
    count_owner(owner, -1, 0);
    return err;
  }
  ++next_arrival_;
  SessionSched& s = sessions_[id];
  s.id = id;
  s.owner = owner;
  residency_.add(id, now);
  s.in = in;
  return err;
}

arena::ArenaError GpuScheduler::change_need(SessionId id, arena::Need need,
                                            std::optional<std::uint64_t> iters, TimeNs now) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return arena::ArenaError::unknown_session;
  SessionSched& s = it->second;
  RankInputs in = s.in;
  if (iters) in.iters = iters;
  // Re-queued, it no longer counts as admitted, before the arena's pass.
  const bool was_admitted = s.lane.has_value();
  if (was_admitted) count_owner(s.owner, 0, -1);
  const arena::ArenaError err = arena_.change_need(id, need, now, queue_key(in, s.owner));
  if (err != arena::ArenaError::ok) {
    if (was_admitted) count_owner(s.owner, 0, +1);
    return err;
  }
  unlink(s);
  s.lane.reset();  // re-admission decides the lane again
  s.in = in;
  return err;
}

void GpuScheduler::set_priority(SessionId id, std::int32_t priority) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  it->second.in.priority = priority;
  rerank(it->second);
  requeue_key(it->second);
}

void GpuScheduler::leave(SessionId id, TimeNs now) {
  auto it = sessions_.find(id);
  if (it != sessions_.end()) {
    // Its iterations in flight no longer count for its owner.
    if (auto c = owners_.find(it->second.owner); c != owners_.end())
      for (std::int64_t e : it->second.service_charged) c->second.charged_ns -= e;
    owner_moved(it->second.owner, 0, -static_cast<int>(it->second.in_flight));
    // Its owner's waiting sessions move up before the arena's pass admits into the room.
    unlink(it->second);
    count_owner(it->second.owner, -1, it->second.lane ? -1 : 0);
    forget_in_flight(it->second);
    if (it->second.lane) {
      auto lq = lanes_.find(*it->second.lane);
      if (lq != lanes_.end() && lq->second.last == id) lq->second.last.reset();
    }
    sessions_.erase(it);
  }
  residency_.remove(id);
  std::erase(wanted_, id);
  arena_.leave(id, now);
  // Drop the queues of lanes the arena deleted, and only those: a live lane's
  // FAIR clock must survive moments when none of its sessions is runnable.
  if (!lanes_.empty()) {
    std::vector<LaneId> live;
    for (const auto& l : arena_.lanes()) live.push_back(l.id);
    std::erase_if(lanes_, [&](const auto& kv) {
      return std::find(live.begin(), live.end(), kv.first) == live.end();
    });
  }
}

std::vector<arena::Admitted> GpuScheduler::take_admissions() {
  std::vector<arena::Admitted> admitted = arena_.take_admissions();
  for (const arena::Admitted& a : admitted) {
    auto it = sessions_.find(a.session);
    if (it == sessions_.end()) continue;
    SessionSched& s = it->second;
    const bool newly = !s.lane;
    unlink(s);
    s.lane = a.lane;
    link(s);
    if (newly) count_owner(s.owner, 0, +1);
  }
  return admitted;
}

void GpuScheduler::set_runnable(SessionId id, bool runnable) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionSched& s = it->second;
  if (s.runnable == runnable) return;
  unlink(s);
  s.runnable = runnable;
  link(s);
}

bool GpuScheduler::lane_may_dispatch(LaneId lane) const {
  if (policy_ != PolicyKind::fifo) return true;
  // The earliest arrival among sessions with work, queued or running. FIFO ranks by
  // arrival alone, so runnable keys and in-flight arrivals compare directly.
  const SessionSched* best = nullptr;
  for (const auto& [id, q] : lanes_) {
    if (q.runnable.empty()) continue;
    const SessionSched& head = sessions_.at(q.runnable.begin()->second);
    if (!best || head.in.arrival < best->in.arrival) best = &head;
  }
  for (SessionId id : in_flight_) {
    const SessionSched& s = sessions_.at(id);
    if (s.lane && (!best || s.in.arrival < best->in.arrival)) best = &s;
  }
  // Held by a session with nothing queued: no lane starts until its iteration ends.
  return !best || (best->runnable && best->lane == lane);
}

bool GpuScheduler::owners_gated() const {
  return policy_ == PolicyKind::fair && fair_share_ == FairShare::owner_across_lanes &&
         owners_active_ >= 2;
}

// Gathered once per decision, so that each session looked at costs O(1) plus the
// owners running elsewhere (at most lanes x pipeline depth of them), whatever the
// number of owners.
GpuScheduler::OwnerView GpuScheduler::owner_view(LaneId lane) const {
  OwnerView v;
  for (const auto& [owner, c] : owners_) {
    if (!c.active()) continue;
    const std::int64_t received = c.service_ns + c.charged_ns;
    if (received < v.least) {
      v.second = v.least;
      v.least = received;
      v.least_owner = owner;
    } else if (received < v.second) {
      v.second = received;
    }
  }
  running_elsewhere_.clear();
  for (SessionId id : in_flight_) {
    const SessionSched& f = sessions_.at(id);
    if (f.lane != lane && std::find(running_elsewhere_.begin(), running_elsewhere_.end(),
                                    f.owner) == running_elsewhere_.end())
      running_elsewhere_.push_back(f.owner);
  }
  return v;
}

GpuScheduler::OwnerTier GpuScheduler::owner_tier(const SessionSched& s, const OwnerView& v) const {
  const auto mine = owners_.find(s.owner);
  if (mine == owners_.end()) return OwnerTier::behind;
  const std::int64_t least = s.owner == v.least_owner ? v.second : v.least;
  const std::int64_t received = mine->second.service_ns + mine->second.charged_ns;
  if (least == INT64_MAX || received - least <= charge_estimate(s.in)) return OwnerTier::behind;
  // Ahead: one lane of its owner's may still run (none of its iterations elsewhere).
  return std::find(running_elsewhere_.begin(), running_elsewhere_.end(), s.owner) !=
                 running_elsewhere_.end()
             ? OwnerTier::held
             : OwnerTier::ahead;
}

bool GpuScheduler::held_for_owner(const SessionSched& s) const {
  if (!owners_gated() || !s.runnable || !s.lane) return false;
  return owner_tier(s, owner_view(*s.lane)) == OwnerTier::held;
}

std::int64_t GpuScheduler::owner_service_ns(std::uint32_t owner) const {
  const auto c = owners_.find(owner);
  return c == owners_.end() ? 0 : c->second.service_ns;
}

std::optional<SessionId> GpuScheduler::pick(LaneId lane) {
  auto it = lanes_.find(lane);
  if (it == lanes_.end() || it->second.runnable.empty()) return std::nullopt;
  LaneQueue& q = it->second;
  SessionId chosen = q.runnable.begin()->second;
  passed_held_.clear();
  if (passes_over_ranks()) {
    const std::optional<SessionId> found = first_eligible(q, lane);
    if (!found) return std::nullopt;
    chosen = *found;
  }
  ++stats_.decisions;
  if (q.last && *q.last != chosen) {
    ++stats_.switches;
    auto prev = sessions_.find(*q.last);
    if (prev != sessions_.end() && prev->second.runnable) ++stats_.preemptions;
  }
  q.last = chosen;
  if (policy_ == PolicyKind::fair) q.vclock = std::max(q.vclock, sessions_.at(chosen).in.vtime);
  // A session passed over because its owner is held competes with its owner, not
  // in the lane: like one that was idle, it starts again at the lane's clock
  // (link lifts it), so the lane does not pay it back for the turns it missed.
  for (SessionId id : passed_held_) rerank(sessions_.at(id));
  return chosen;
}

// The lane's best-ranked session that may run now: resident when oversubscribed
// (swapped ones are noted as wanted); under FAIR by owner across lanes, first
// among sessions whose owner is not ahead, then among those whose owner is ahead
// but runs in no other lane, never one whose owner is held, each pass looking at
// the lane's first kOwnerScan sessions at most (a lane of thousands then costs
// what a lane of kOwnerScan does; one whose first kOwnerScan are all held waits
// for one of their owners' iterations elsewhere to end). Sessions ranked before
// the one chosen and passed over for their owner are noted in passed_held_.
std::optional<SessionId> GpuScheduler::first_eligible(const LaneQueue& q, LaneId lane) {
  const bool gated = owners_gated();
  const OwnerView v = gated ? owner_view(lane) : OwnerView{};
  for (const OwnerTier tier : {OwnerTier::behind, OwnerTier::ahead}) {
    passed_held_.clear();
    std::size_t looked = 0;
    for (const auto& [key, id] : q.runnable) {
      if (gated && ++looked > kOwnerScan) break;
      if (gated && owner_tier(sessions_.at(id), v) > tier) {
        passed_held_.push_back(id);
        continue;
      }
      if (!oversubscribed()) return id;
      const arena::Residency r = arena_.residency(id);
      const SessionResidency* sr = residency_.find(id);
      if (r == arena::Residency::resident && sr && !sr->evicting && !sr->swapping) return id;
      if (r == arena::Residency::swapped &&
          std::find(wanted_.begin(), wanted_.end(), id) == wanted_.end())
        wanted_.push_back(id);
    }
    if (!gated) break;
  }
  passed_held_.clear();
  return std::nullopt;
}

void GpuScheduler::want_resident(SessionId id) {
  if (std::find(wanted_.begin(), wanted_.end(), id) == wanted_.end()) wanted_.push_back(id);
}

ResidencyPlan GpuScheduler::plan_residency(const std::function<bool(SessionId)>& swappable,
                                           TimeNs now) {
  if (!oversubscribed()) return {};
  // Best-ranked first across lanes, so that the policy, not the lane order, says who
  // comes back next (a session just swapped out ranks behind the one it made room for).
  // Sessions wanted for an allocation or a transfer, not for a dispatch, come last.
  auto key = [&](SessionId id) {
    auto it = sessions_.find(id);
    if (it == sessions_.end() || !it->second.runnable)
      return std::make_pair(1, RankKey{0.0, it != sessions_.end() ? it->second.in.arrival : 0});
    return std::make_pair(0, cross_lane_key(it->second));
  };
  std::stable_sort(wanted_.begin(), wanted_.end(),
                   [&](SessionId a, SessionId b) { return key(a) < key(b); });
  // FIFO runs one job to completion: the session holding the GPU is never a victim.
  std::optional<SessionId> holder;
  if (policy_ == PolicyKind::fifo) {
    const SessionSched* best = nullptr;
    for (const auto& [id, s] : sessions_)
      if ((s.runnable || s.in_flight > 0) && s.lane && (!best || s.in.arrival < best->in.arrival))
        best = &s;
    if (best) holder = best->id;
  }
  ResidencyPlan plan = residency_.plan(
      arena_, wanted_, [&](SessionId id) { return id != holder && swappable(id); }, now);
  wanted_.clear();
  return plan;
}

// FAIR's keys are virtual times on each lane's own clock, and lanes' clocks run
// apart (a lane made later starts at 0, a lane that waits on swaps runs slower), so
// across lanes a session ranks by how far it is behind its lane's clock: how much
// of its lane's service it is owed. Raw virtual times let the lane with the slowest
// clock take every swap-in while the others' swapped sessions waited (a newcomer
// waited 32 s for 0.3 s turns in salus-sim). The other policies' keys are global.
RankKey GpuScheduler::cross_lane_key(const SessionSched& s) const {
  RankKey k = s.key;
  if (policy_ != PolicyKind::fair || !s.lane) return k;
  if (const auto q = lanes_.find(*s.lane); q != lanes_.end())
    k.primary -= static_cast<double>(q->second.vclock);
  return k;
}

std::int64_t GpuScheduler::charge_estimate(const RankInputs& in) {
  return std::max<std::int64_t>(1, std::llround(in.mean_iter_ns));
}

void GpuScheduler::iterations_repeated(SessionId id, std::uint64_t count, std::int64_t device_ns,
                                       std::int64_t last_ns) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || count == 0) return;
  SessionSched& s = it->second;
  // Each round: pick (the same session: no switch), charge, done. The charges cancel.
  stats_.decisions += count;
  s.gpu_ns += device_ns;
  s.in.done += count;
  s.in.measured_ns += device_ns;
  s.in.mean_iter_ns = static_cast<double>(s.in.measured_ns) / static_cast<double>(s.in.done);
  s.in.vtime += device_ns;
  if (auto c = owners_.find(s.owner); c != owners_.end()) c->second.service_ns += device_ns;
  if (s.lane && policy_ == PolicyKind::fair) {
    // The last pick put it in service at its virtual time before its last iteration.
    auto lq = lanes_.find(*s.lane);
    if (lq != lanes_.end()) lq->second.vclock = std::max(lq->second.vclock, s.in.vtime - last_ns);
  }
  if (policy_ == PolicyKind::fair || policy_ == PolicyKind::srtf) rerank(s);
}

void GpuScheduler::turns_repeated(LaneId lane, const std::vector<Turns>& turns, std::uint64_t picks,
                                  std::uint64_t switches, SessionId last, std::int64_t last_vtime) {
  stats_.decisions += picks;
  stats_.switches += switches;
  stats_.preemptions += switches;
  for (const Turns& t : turns) {
    auto it = sessions_.find(t.id);
    if (it == sessions_.end() || t.count == 0) continue;
    SessionSched& s = it->second;
    // Each iteration was charged at dispatch and settled at its end: the charges cancel.
    s.gpu_ns += t.device_ns;
    s.in.done += t.count;
    s.in.measured_ns += t.device_ns;
    s.in.mean_iter_ns = static_cast<double>(s.in.measured_ns) / static_cast<double>(s.in.done);
    s.in.vtime += t.device_ns;
    if (auto c = owners_.find(s.owner); c != owners_.end()) c->second.service_ns += t.device_ns;
  }
  auto lq = lanes_.find(lane);
  if (lq != lanes_.end()) {
    if (picks > 0) lq->second.last = last;
    if (policy_ == PolicyKind::fair) lq->second.vclock = std::max(lq->second.vclock, last_vtime);
  }
  // Re-ranked once the lane's clock is final: no session's time is behind it (each one's
  // next iteration comes after the last pick), so the clock moves no one.
  for (const Turns& t : turns) {
    auto it = sessions_.find(t.id);
    if (it != sessions_.end() && t.count > 0) rerank(it->second);
  }
}

void GpuScheduler::iteration_dispatched(SessionId id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionSched& s = it->second;
  const std::int64_t unscaled = charge_estimate(s.in);
  charge_owner(s, unscaled, +1);
  const std::int64_t estimate = scaled(unscaled, fair_factor(s));
  s.charged.push_back(estimate);
  s.in.vtime += estimate;
  if (s.in_flight++ == 0) in_flight_.push_back(id);
  if (policy_ == PolicyKind::fair) rerank(s);
}

void GpuScheduler::iteration_cycle(SessionId id, std::int64_t device_ns) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionSched& s = it->second;
  const std::int64_t unscaled = charge_estimate(s.in);
  charge_owner(s, unscaled, 0);  // dispatched and done at once: in_flight stays
  const std::int64_t estimate = scaled(unscaled, fair_factor(s));
  s.charged.push_back(estimate);
  s.in.vtime += estimate;
  account_done(s, device_ns, true);
}

void GpuScheduler::iteration_done(SessionId id, std::int64_t device_ns, bool iteration) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionSched& s = it->second;
  const int ended = s.in_flight > 0 ? 1 : 0;
  if (ended && --s.in_flight == 0) forget_in_flight(s);
  account_done(s, device_ns, iteration, -ended);
}

void GpuScheduler::account_done(SessionSched& s, std::int64_t device_ns, bool iteration,
                                int in_flight) {
  s.gpu_ns += device_ns;
  settle_owner(s, device_ns, in_flight);
  if (iteration) {
    s.in.done += 1;
    s.in.measured_ns += device_ns;
    s.in.mean_iter_ns = static_cast<double>(s.in.measured_ns) / static_cast<double>(s.in.done);
  }
  // Equal shares per session, or per owner (fair_factor). A 1 ns floor keeps
  // empty iterations from being free.
  const std::int64_t actual = scaled(std::max<std::int64_t>(device_ns, 1), fair_factor(s));
  std::int64_t charged = 0;
  if (!s.charged.empty()) {
    charged = s.charged.front();
    s.charged.pop_front();
  }
  s.in.vtime += actual - charged;
  // Only FAIR's and SRTF's keys move with progress.
  if (policy_ == PolicyKind::fair || policy_ == PolicyKind::srtf) rerank(s);
}

const SessionSched* GpuScheduler::find(SessionId id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

std::size_t GpuScheduler::runnable_in_lane(LaneId lane) const {
  auto it = lanes_.find(lane);
  return it == lanes_.end() ? 0 : it->second.runnable.size();
}

void GpuScheduler::unlink(SessionSched& s, bool counts) {
  if (!s.runnable || !s.lane) return;
  if (counts) owner_moved(s.owner, -1, 0);
  auto it = lanes_.find(*s.lane);
  if (it == lanes_.end()) return;
  it->second.runnable.erase({s.key, s.id});
  if (counts && by_owner(fair_share_) && --it->second.runnable_by_owner[s.owner] == 0)
    --it->second.owners_runnable;
}

void GpuScheduler::link(SessionSched& s, bool counts) {
  if (!s.runnable || !s.lane) return;
  LaneQueue& q = lanes_[*s.lane];
  // FAIR: a session that was idle or is new starts at the lane's virtual clock,
  // so it neither claims credit for time it was absent nor waits behind it.
  if (policy_ == PolicyKind::fair) s.in.vtime = std::max(s.in.vtime, q.vclock);
  s.key = rank(policy_, s.in);
  q.runnable.insert({s.key, s.id});
  if (!counts) return;
  if (by_owner(fair_share_) && ++q.runnable_by_owner[s.owner] == 1) ++q.owners_runnable;
  owner_moved(s.owner, +1, 0);
}

// An owner's runnable sessions or iterations in flight here changed by the deltas;
// it competes (is active) while it has either. An owner that becomes active starts
// no further behind the least service of the others active than two of its last
// iterations, as a session starts at its lane's clock: it banks no credit for the
// time it was away, and loses none for a gap between one iteration and the next
// (an attached program between its boundary and its next grant).
void GpuScheduler::owner_moved(std::uint32_t owner, int runnable, int in_flight) {
  if (const auto c = owners_.find(owner); c != owners_.end())
    owner_moved(owner, c->second, runnable, in_flight);
}

void GpuScheduler::owner_moved(std::uint32_t owner, OwnerCount& o, int runnable, int in_flight) {
  const bool was = o.active();
  o.runnable = count_moved(o.runnable, runnable);
  o.in_flight = count_moved(o.in_flight, in_flight);
  if (was == o.active()) return;
  if (was) {
    --owners_active_;
    return;
  }
  ++owners_active_;
  std::int64_t least = INT64_MAX;
  for (const auto& [other, oc] : owners_)
    if (other != owner && oc.active()) least = std::min(least, oc.service_ns);
  if (least != INT64_MAX) o.service_ns = std::max(o.service_ns, least - 2 * o.last_estimate_ns);
}

void GpuScheduler::charge_owner(SessionSched& s, std::int64_t estimate, int in_flight) {
  const auto c = owners_.find(s.owner);
  if (c == owners_.end()) return;
  c->second.charged_ns += estimate;
  c->second.last_estimate_ns = estimate;
  s.service_charged.push_back(estimate);
  if (in_flight != 0) owner_moved(s.owner, c->second, 0, in_flight);
}

void GpuScheduler::settle_owner(SessionSched& s, std::int64_t device_ns, int in_flight) {
  const auto c = owners_.find(s.owner);
  if (c == owners_.end()) return;
  c->second.service_ns += std::max<std::int64_t>(device_ns, 1);
  if (!s.service_charged.empty()) {
    c->second.charged_ns -= s.service_charged.front();
    s.service_charged.pop_front();
  }
  if (in_flight != 0) owner_moved(s.owner, c->second, 0, in_flight);
}

void GpuScheduler::forget_in_flight(SessionSched& s) {
  const auto it = std::find(in_flight_.begin(), in_flight_.end(), s.id);
  if (it == in_flight_.end()) return;
  *it = in_flight_.back();
  in_flight_.pop_back();
}

void GpuScheduler::rerank(SessionSched& s) {
  unlink(s, false);
  link(s, false);
}

}  // namespace salus::sched
