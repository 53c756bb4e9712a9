#include "arena/gpu_arena.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

#include "arena/admission_queue.hpp"
#include "arena/lane_assignment.hpp"
#include "arena/lane_table.hpp"
#include "arena/persistent_heap.hpp"
#include "arena/space_map.hpp"

namespace salus::arena {

const char* to_string(ArenaError e) {
  switch (e) {
    case ArenaError::ok:
      return "ok";
    case ArenaError::too_large:
      return "too_large";
    case ArenaError::unknown_session:
      return "unknown_session";
    case ArenaError::not_admitted:
      return "not_admitted";
    case ArenaError::duplicate:
      return "duplicate";
    case ArenaError::no_memory:
      return "no_memory";
    case ArenaError::fragmented:
      return "fragmented";
    case ArenaError::swapped_out:
      return "swapped_out";
  }
  return "unknown";
}

namespace {

struct SessionState {
  Need declared;
  Bytes p = 0;    // aligned declared persistent
  Bytes e = 0;    // aligned declared ephemeral
  Bytes pin = 0;  // aligned declared unswappable, at most p
  std::uint64_t arrival = 0;
  bool admitted = false;
  std::optional<LaneId> lane;
  Bytes used = 0;  // live persistent bytes
  Residency res = Residency::resident;
  bool on_gpu() const { return res != Residency::swapped; }

  // P_i of the safety condition. A re-queued session has given up its declared P but
  // still holds its buffers, and those bytes are on the GPU all the same.
  Bytes reserved() const { return admitted ? std::max(p, used) : used; }
  // What admission adds to the persistent sum.
  Bytes p_new() const { return std::max(p, used) - used; }
  // The session's share of the resident set: all of P_i on the GPU, the part no
  // swap moves when it is swapped out.
  Bytes on_card() const { return on_gpu() ? reserved() : std::min(pin, reserved()); }
  Bytes movable() const { return reserved() - std::min(pin, reserved()); }
  void set_need(const Need& need) {
    declared = need;
    p = align_up(need.persistent);
    e = align_up(need.ephemeral);
    pin = align_up(std::min(need.unswappable, p));
  }
};

}  // namespace

struct GpuArena::Impl {
  Impl(Bytes cap, ArenaOptions opts)
      : capacity(cap),
        usable(cap & ~(kAlignment - 1)),
        admit_usable(scaled(usable, opts.oversubscribe)),
        options(opts),
        space(usable),
        heap(usable) {}

  Bytes capacity;
  Bytes usable;        // capacity rounded down to kAlignment: the top of the persistent region
  Bytes admit_usable;  // usable x oversubscribe: the bound of the admission accounting
  ArenaOptions options;
  SpaceMap space;
  PersistentHeap heap;
  LaneTable lanes;
  AdmissionQueue queue;
  std::unordered_map<SessionId, SessionState> sessions;
  std::uint64_t next_arrival = 0;
  Bytes reserved = 0;           // sum of SessionState::reserved()
  Bytes resident_reserved = 0;  // the same over sessions whose memory is on the GPU
  Bytes lane_room_wanted = 0;   // a lane waits for this much physical room (oversubscription)
  // Buffers of swapped sessions: they hold no range, their handles stay valid.
  std::unordered_map<BufferHandle, std::pair<SessionId, Bytes>> swapped_buffers;
  Bytes swapped_bytes = 0;
  // (lane, session): the session left the lane by a need change while the lane was busy,
  // so its work may still be in flight there until that lane's boundary. Usually empty.
  std::vector<std::pair<LaneId, SessionId>> draining;
  std::vector<Admitted> admissions;
  ArenaStats stats;
  mutable std::uint64_t verify_calls = 0;  // for verify()'s sampling

  // Admission room (the accounting, C x oversubscribe) and physical room (resident set).
  Bytes slack() const { return admit_usable - reserved - lanes.total(); }
  Bytes phys_slack() const { return usable - resident_reserved - lanes.total(); }
  // Runs `change` on `s` and carries what it did to the session's P_i and resident
  // share into the two sums (the differences may wrap as negatives; the sums do not).
  template <class Change>
  void update(SessionState& s, Change&& change) {
    const Bytes r0 = s.reserved(), c0 = s.on_card();
    change();
    reserved += s.reserved() - r0;
    resident_reserved += s.on_card() - c0;
  }
  static Bytes scaled(Bytes b, double ratio) {
    if (!(ratio > 1.0)) return b;
    const long double v = static_cast<long double>(b) * ratio;
    const long double cap = static_cast<long double>(~Bytes{0} >> 2);
    return (v >= cap ? static_cast<Bytes>(cap) : static_cast<Bytes>(v)) & ~(kAlignment - 1);
  }
  bool too_large(const Need& need, Bytes used) const;
  std::optional<Bytes> lane_growth_left(SessionId id, Bytes p_new) const;
  LaneDecision decide(SessionId id, Bytes p_new, Bytes e, std::uint32_t group, bool& held,
                      Bytes& room_wanted) const;
  bool try_admit(const QueuedRequest& q);
  void sync_passable(SessionId session);
  AdmissionBounds bounds() const;
  bool may_admit() const;
  bool settle_lanes();
  void reconcile(bool assign);
  void verify() const;
  std::string check() const;
  std::string check_sessions() const;
  std::string check_queue() const;
  std::string check_lanes() const;
  std::string check_layout() const;
  std::vector<PhysicalRegion> regions() const;
};

bool GpuArena::Impl::too_large(const Need& need, Bytes used) const {
  if (need.persistent > usable || need.ephemeral > usable) return true;
  const Bytes p = std::max(align_up(need.persistent), used), e = align_up(need.ephemeral);
  return p > usable || e > usable - p;
}

// Every Algorithm-1 step needs p_new <= slack, and p_new + E <= slack + (the largest
// lane a request may join or grow). A request outside these bounds cannot be admitted
// whatever else happens in the pass: the queue's index never offers it, and a pass in
// which no queued request meets both is skipped. The queue may be long.
AdmissionBounds GpuArena::Impl::bounds() const {
  const Bytes room = slack();
  return {room, room + lanes.largest()};
}

bool GpuArena::Impl::may_admit() const {
  if (queue.empty()) return false;
  const AdmissionBounds b = bounds();
  return queue.min_persistent() <= b.room && queue.min_total() <= b.total;
}

// Oversubscribed, a session runs only with its movable bytes on the card beside every
// lane and every session's unswappable part, the others swapped out. Lanes are for
// life, so a step after which that would not fit for some admitted session (or the
// request, `id` with `p_new` new bytes) could leave every session swapped out and none
// able to come back: salus-sim found a GPU idle for ever, its lanes holding all but
// 504M and each of its sessions needing more. This is how much the lanes may still
// grow with the request admitted (nullopt: not even by nothing); swapping cannot help
// past it. O(sessions here), only oversubscribed: at ratio 1 every P is resident
// beside the lanes, so physical slack says the same.
std::optional<Bytes> GpuArena::Impl::lane_growth_left(SessionId id, Bytes p_new) const {
  if (!(options.oversubscribe > 1.0)) return ~Bytes{0};
  Bytes pinned = 0, largest = 0;
  auto count = [&](Bytes reserved, Bytes pin) {
    pin = std::min(pin, reserved);
    pinned += pin;
    largest = std::max(largest, reserved - pin);
  };
  bool known = false;
  for (const auto& [sid, s] : sessions) {
    if (sid == id) {
      known = true;
      count(s.used + p_new, s.pin);
    } else if (s.admitted) {
      count(s.reserved(), s.pin);
    }
  }
  if (!known) count(p_new, 0);
  const Bytes needed = lanes.total() + pinned + largest;
  if (needed > usable) return std::nullopt;
  return usable - needed;
}

// Where a request of `id` (0: a session not yet known) would go now: the lane step, or
// none. `held` is set when the step needs bytes above the lane region that are still
// held, so the request must wait for them.
LaneDecision GpuArena::Impl::decide(SessionId id, Bytes p_new, Bytes e, std::uint32_t group,
                                    bool& held, Bytes& room_wanted) const {
  held = false;
  room_wanted = 0;
  LaneDecision d;
  if (p_new > slack()) return d;  // the common refusal, without a lookup
  if (group != 0) {
    // Join a lane of the group that is large enough; the request adds only p_new.
    for (const auto& [other, o] : sessions) {
      if (other == id || !o.admitted || !o.lane || o.declared.group != group) continue;
      const Lane* l = lanes.find(*o.lane);
      if (l && l->size >= e) {
        d = {LaneStep::join, *o.lane, 0};
        break;
      }
    }
  }
  // Oversubscribed, lanes also stop where a session could no longer run beside them
  // (a join adds no lane, but the request's P must still fit beside the lanes).
  const std::optional<Bytes> growth = lane_growth_left(id, p_new);
  if (!growth) return LaneDecision{};
  const Bytes live_slack = *growth > ~Bytes{0} - p_new ? ~Bytes{0} : *growth + p_new;
  // Oversubscribed, P may start swapped but a lane is physical: Algorithm 1 runs on
  // min(admission slack, physical slack + p), which asks both of every step (at ratio 1
  // the two slacks are equal and this is plain Algorithm 1), and on the bound above.
  if (d.step == LaneStep::none)
    d = find_lane(lanes, std::min({slack(), phys_slack() + p_new, live_slack}), p_new, e,
                  options.lane_mode);
  if (d.step == LaneStep::none) {
    // The accounting would open a lane but the card has no room for it: the residency
    // planner may swap sessions out for it, if every session could still run after.
    if (p_new + e <= slack() && e > phys_slack() &&
        find_lane(lanes, std::min(slack(), live_slack), p_new, e, options.lane_mode).step !=
            LaneStep::none)
      room_wanted = e;
    return d;
  }
  if (d.room > 0 && d.room > phys_slack()) {
    // Oversubscribed: lanes are physical, so the resident set must shrink first.
    room_wanted = d.room;
    return LaneDecision{};
  }
  if (d.room == 0) return d;
  // Opening or growing a lane takes the bytes right above the lane region. Algorithm 1
  // only looks at the accounting; when those bytes are still held (by a busy lane that
  // has not slid down yet, or by persistent buffers) the request waits for them rather
  // than falling through to a later step, because a lane, once joined, is for life.
  const Bytes top = lanes.total();
  held = !space.is_free(top, top + d.room);
  return d;
}

bool GpuArena::Impl::try_admit(const QueuedRequest& q) {
  if (q.persistent > slack()) return false;  // the common refusal, without a lookup
  const SessionId id = q.session;
  SessionState& s = sessions.at(id);
  const Bytes p_new = q.persistent;
  bool held = false;
  Bytes want = 0;
  const LaneDecision d = decide(id, p_new, s.e, s.declared.group, held, want);
  lane_room_wanted = std::max(lane_room_wanted, want);
  if (d.step == LaneStep::none) return false;
  // A re-queued session that holds its buffers on the GPU must fit there.
  const bool resident = s.on_gpu() && p_new + d.room <= phys_slack();
  if (s.on_gpu() && !resident && s.used != 0) return false;
  // Admitted swapped, it still puts its unswappable part on the card.
  if (!resident && std::min(s.pin, std::max(s.p, s.used)) - s.on_card() + d.room > phys_slack())
    return false;
  if (held) {
    const Bytes top = lanes.total();
    if (heap.intersects(top, top + d.room)) heap.request_room(d.room);
    return false;
  }
  LaneId lane = d.lane;
  switch (d.step) {
    case LaneStep::open:
      lane = lanes.open(id, s.e);
      ++stats.lanes_opened;
      break;
    case LaneStep::join:
      lanes.join(lane, id, s.e);
      break;
    case LaneStep::grow:
      lanes.grow(lane, id, s.e);
      ++stats.lanes_grown;
      break;
    case LaneStep::none:
      return false;
  }
  // A session whose P does not fit beside the resident set starts swapped: it holds
  // nothing yet, and the residency planner brings it in before it runs.
  update(s, [&] {
    if (!resident) s.res = Residency::swapped;
    s.admitted = true;
  });
  s.lane = lane;
  ++stats.admissions;
  admissions.push_back({id, lane});
  return true;
}

// A re-queued session whose old lane is still busy holds that lane's bytes itself; while
// that lasts its refusal is its own doing, not something the sessions admitted meanwhile
// cause, so the queue counts no bypasses on it (AdmissionQueue::set_passable).
void GpuArena::Impl::sync_passable(SessionId session) {
  bool drains = false;
  for (const auto& [lane, s] : draining) drains = drains || s == session;
  queue.set_passable(session, drains);
}

// True when bytes were given back, i.e. room may have appeared for the queue.
bool GpuArena::Impl::settle_lanes() {
  const LaneTable::SettleResult r = lanes.settle(space);
  stats.lane_moves += r.moved;
  stats.lanes_closed += r.deleted;
  return r.released;
}

void GpuArena::Impl::reconcile(bool assign) {
  bool run = settle_lanes() || assign;
  if (queue.empty()) lane_room_wanted = 0;
  while (run && may_admit()) {
    lane_room_wanted = 0;  // try_admit asks again for what it still lacks
    const std::size_t admitted = queue.admit(
        options.queue_mode, options.max_bypass, [this] { return bounds(); },
        [this](const QueuedRequest& q) { return try_admit(q); });
    // Admissions only take room, so another pass is useful only if placing the new lanes
    // moved others (a grown lane shifts the lanes above it).
    run = admitted > 0 && settle_lanes();
  }
  heap.settle_compaction(lanes.total());
  verify();
}

void GpuArena::Impl::verify() const {
#ifndef NDEBUG
  // check() is O((sessions + queue) log queue) and runs after every change, so with
  // thousands of sessions waiting it alone made a long queue quadratic (salus-sim, issue
  // 19). Check every change of a small arena, which is what the tests build, and a larger
  // one at every (size / kShare)-th change: O(kShare log n) per change on average, and a
  // broken invariant is still caught within size / kShare changes. Tests call
  // check_invariants() for a full check whenever they want one.
  constexpr std::size_t kAlways = 64, kShare = 4;
  const std::size_t size = sessions.size() + queue.size();
  if (size > kAlways && ++verify_calls % (size / kShare) != 0) return;
  const std::string problem = check();
  if (!problem.empty()) {
    std::fprintf(stderr, "salus arena: invariant violated: %s\n", problem.c_str());
    std::abort();
  }
#endif
}

std::vector<PhysicalRegion> GpuArena::Impl::regions() const {
  std::vector<PhysicalRegion> out;
  for (const auto& [id, l] : lanes.all())
    if (l.offset) out.push_back({PhysicalRegion::Kind::lane, *l.offset, l.held, id});
  heap.for_each_buffer([&](const PersistentBuffer& b) {
    out.push_back({PhysicalRegion::Kind::persistent, b.offset, b.size, b.handle});
    for (const auto& [begin, end] : b.holds)
      out.push_back({PhysicalRegion::Kind::reserved, begin, end - begin, b.handle});
  });
  std::sort(out.begin(), out.end(), [](const PhysicalRegion& a, const PhysicalRegion& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.size < b.size;
  });
  return out;
}

std::string GpuArena::Impl::check() const {
  std::string problem = check_sessions();
  if (problem.empty()) problem = check_queue();
  if (problem.empty()) problem = check_lanes();
  if (problem.empty()) problem = check_layout();
  return problem;
}

// Each session's accounting, its buffers, and where it is: in a lane or in the queue.
std::string GpuArena::Impl::check_sessions() const {
  Bytes sum_reserved = 0, sum_used = 0, sum_resident = 0;
  std::size_t waiting = 0;
  for (const auto& [id, s] : sessions) {
    sum_reserved += s.reserved();
    sum_resident += s.on_card();
    sum_used += s.used;
    if (s.p % kAlignment != 0 || s.e % kAlignment != 0)
      return fmt::format("session {}: need not aligned", id);
    Bytes owned = 0;
    if (const auto* handles = heap.buffers_of(id)) {
      if (!s.on_gpu()) return fmt::format("swapped session {} holds GPU ranges", id);
      for (BufferHandle h : *handles) owned += heap.find(h)->size;
    }
    for (const auto& [h, b] : swapped_buffers)
      if (b.first == id) {
        if (s.on_gpu()) return fmt::format("resident session {} has a swapped buffer", id);
        owned += b.second;
      }
    if (owned != s.used)
      return fmt::format("session {}: used {} but its buffers hold {}", id, s.used, owned);
    if (s.admitted) {
      const Lane* l = s.lane ? lanes.find(*s.lane) : nullptr;
      if (!l || !l->has_member(id)) return fmt::format("admitted session {} is in no lane", id);
      if (queue.contains(id)) return fmt::format("admitted session {} is still queued", id);
    } else {
      ++waiting;
      if (s.lane) return fmt::format("queued session {} has a lane", id);
      if (!queue.contains(id)) return fmt::format("session {} is neither admitted nor queued", id);
    }
  }
  if (waiting != queue.size())
    return fmt::format("queue holds {} requests, {} sessions wait", queue.size(), waiting);
  if (sum_reserved != reserved)
    return fmt::format("reserved is {} but sessions reserve {}", reserved, sum_reserved);
  if (sum_resident != resident_reserved)
    return fmt::format("resident reserved is {} but resident sessions reserve {}",
                       resident_reserved, sum_resident);
  Bytes sum_swapped = 0;
  for (const auto& [h, b] : swapped_buffers) sum_swapped += b.second;
  if (sum_swapped != swapped_bytes)
    return fmt::format("swapped bytes {} but swapped buffers hold {}", swapped_bytes, sum_swapped);
  if (sum_used != heap.used() + swapped_bytes)
    return fmt::format("heap holds {} (+{} swapped) but sessions use {}", heap.used(),
                       swapped_bytes, sum_used);
  return {};
}

// The queue's index, its order (key, then arrival), and each request's need and drain
// state against its session's.
std::string GpuArena::Impl::check_queue() const {
  if (std::string problem = queue.check(); !problem.empty()) return problem;
  std::string problem;
  std::optional<std::pair<double, std::uint64_t>> last;
  queue.for_each([&](const QueuedRequest& q) {
    if (!problem.empty()) return;
    if (last && !(*last < std::pair{q.key, q.arrival})) problem = "queue out of key order";
    last = std::pair{q.key, q.arrival};
    auto it = sessions.find(q.session);
    bool drains = false;
    for (const auto& [lane, s] : draining) drains = drains || s == q.session;
    if (it == sessions.end() || it->second.arrival != q.arrival)
      problem = fmt::format("queued session {} unknown or misplaced", q.session);
    else if (q.persistent != it->second.p_new() || q.ephemeral != it->second.e)
      problem = fmt::format("queued session {} has a stale need", q.session);
    else if (q.passable != drains)
      problem = fmt::format("queued session {}: drain state {} but passable {}", q.session, drains,
                            q.passable);
  });
  return problem;
}

// Lane sizes, members, layout targets, and the safety condition.
std::string GpuArena::Impl::check_lanes() const {
  Bytes total = 0;
  std::size_t with_members = 0;
  for (const auto& [id, l] : lanes.all()) {
    Bytes largest = 0;
    for (const LaneMember& m : l.members) {
      auto it = sessions.find(m.session);
      if (it == sessions.end() || !it->second.admitted || it->second.lane != id ||
          it->second.e != m.ephemeral)
        return fmt::format("lane {}: member {} is stale", id, m.session);
      largest = std::max(largest, m.ephemeral);
    }
    if (!l.busy && l.kept != 0) return fmt::format("lane {}: idle but keeps bytes", id);
    const Bytes want = l.busy ? std::max(largest, l.kept) : largest;
    if (l.size != want)
      return fmt::format("lane {}: size {} but largest E {} (held {}, busy {})", id, l.size,
                         largest, l.held, l.busy);
    if (l.target != total)
      return fmt::format("lane {}: target {} but layout says {}", id, l.target, total);
    total += l.size;
    if (!l.members.empty()) ++with_members;
    if (l.busy && !l.offset) return fmt::format("lane {}: busy without a place", id);
    if (l.busy && (!l.running || l.used > l.held))
      return fmt::format("lane {}: busy state inconsistent", id);
    if (!l.busy && l.offset && !l.in_place())
      return fmt::format("lane {}: idle but not at its place in the layout", id);
    if (!l.busy && !l.offset && space.is_free(l.target, l.target + l.size))
      return fmt::format("lane {}: waits for room that is free", id);
    if (!l.busy && l.members.empty()) return fmt::format("lane {}: idle and empty", id);
  }
  if (total != lanes.total())
    return fmt::format("lane total {} but lanes sum {}", lanes.total(), total);
  if (with_members != lanes.indexed()) return "lane index out of date";
  if (resident_reserved > usable || lanes.total() > usable - resident_reserved)
    return fmt::format("safety condition broken: resident P {} + L {} > C {}", resident_reserved,
                       lanes.total(), usable);
  if (reserved > admit_usable || lanes.total() > admit_usable - reserved)
    return fmt::format("admission bound broken: P {} + L {} > C x ratio {}", reserved,
                       lanes.total(), admit_usable);
  return {};
}

// The physical layout: buffers above the lanes, no overlaps, and the free map exactly
// the complement of what is held.
std::string GpuArena::Impl::check_layout() const {
  std::string buffer_problem;
  heap.for_each_buffer([&](const PersistentBuffer& b) {
    if (!buffer_problem.empty()) return;
    if (b.offset < lanes.total())
      buffer_problem = fmt::format("buffer {} at {} is inside the lane region", b.handle, b.offset);
    if (b.move_to && !heap.has_outstanding(b.owner))
      buffer_problem = fmt::format("buffer {} has a move nobody will finish", b.handle);
    if (b.holds.empty() != (!b.move_to && !b.then_to))
      buffer_problem =
          fmt::format("buffer {} holds ranges without a move, or the reverse", b.handle);
  });
  if (!buffer_problem.empty()) return buffer_problem;
  const std::vector<PhysicalRegion> held = regions();
  Bytes end = 0, held_bytes = 0;
  std::vector<std::pair<Bytes, Bytes>> gaps;
  for (const PhysicalRegion& r : held) {
    if (r.offset % kAlignment != 0 || r.size % kAlignment != 0)
      return fmt::format("region at {} size {} not aligned", r.offset, r.size);
    if (r.size == 0) continue;
    if (r.offset < end) return fmt::format("regions overlap at {}", r.offset);
    if (r.offset + r.size > usable) return fmt::format("region at {} runs past the top", r.offset);
    if (r.kind != PhysicalRegion::Kind::lane && r.offset < lanes.total())
      return fmt::format("persistent region at {} is inside the lane region", r.offset);
    if (r.offset > end) gaps.emplace_back(end, r.offset);
    end = r.offset + r.size;
    held_bytes += r.size;
  }
  if (end < usable) gaps.emplace_back(end, usable);
  std::vector<std::pair<Bytes, Bytes>> holes;
  space.for_each_hole([&](Bytes b, Bytes e) { holes.emplace_back(b, e); });
  if (holes != gaps) return "free map does not match the held regions";
  if (space.free_bytes() != usable - held_bytes) return "free byte count is off";
  return {};
}

// ---------------------------------------------------------------- GpuArena

GpuArena::GpuArena(Bytes capacity, ArenaOptions options)
    : impl_(std::make_unique<Impl>(capacity, options)) {}
GpuArena::~GpuArena() = default;
GpuArena::GpuArena(GpuArena&&) noexcept = default;
GpuArena& GpuArena::operator=(GpuArena&&) noexcept = default;

Bytes GpuArena::capacity() const {
  return impl_->capacity;
}
const ArenaOptions& GpuArena::options() const {
  return impl_->options;
}

void GpuArena::set_queue_mode(QueueMode mode) {
  impl_->options.queue_mode = mode;
  impl_->reconcile(true);
}

bool GpuArena::set_oversubscribe(double ratio) {
  Impl& m = *impl_;
  if (!(ratio >= 1.0)) return false;
  const Bytes bound = Impl::scaled(m.usable, ratio);
  if (m.reserved + m.lanes.total() > bound) return false;
  if (!(ratio > 1.0)) {
    if (m.resident_reserved != m.reserved || m.swapped_bytes != 0) return false;
    for (const auto& [id, s] : m.sessions)
      if (!s.on_gpu()) return false;
  }
  m.options.oversubscribe = ratio;
  m.admit_usable = bound;
  m.reconcile(true);
  return true;
}

ArenaError GpuArena::request(SessionId session, Need need, TimeNs now, double key) {
  Impl& m = *impl_;
  if (m.sessions.count(session)) return ArenaError::duplicate;
  if (m.too_large(need, 0)) return ArenaError::too_large;
  SessionState s;
  s.set_need(need);
  s.arrival = m.next_arrival++;
  m.queue.push(session, s.arrival, now, s.p_new(), s.e, key);
  m.sessions.emplace(session, s);
  m.reconcile(true);
  return ArenaError::ok;
}

ArenaError GpuArena::change_need(SessionId session, Need need, TimeNs now, double key) {
  Impl& m = *impl_;
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return ArenaError::unknown_session;
  SessionState& s = it->second;
  if (m.too_large(need, s.used)) return ArenaError::too_large;
  const bool was_admitted = s.admitted;
  m.update(s, [&] {
    s.admitted = false;  // a re-queued session keeps only what its buffers hold
    s.set_need(need);
  });
  if (was_admitted) {
    if (const Lane* l = m.lanes.find(*s.lane); l && l->busy)
      m.draining.emplace_back(*s.lane, session);
    m.lanes.remove_member(*s.lane, session, true);
    s.lane.reset();
    m.queue.push(session, s.arrival, now, 0, 0, key);
    m.sync_passable(session);
  }
  m.queue.set_need(session, s.p_new(), s.e);
  m.queue.set_key(session, key);
  m.reconcile(true);
  return ArenaError::ok;
}

AdmissionBounds GpuArena::admission_bounds() const {
  return impl_->bounds();
}

bool GpuArena::would_admit(const Need& need) const {
  const Impl& m = *impl_;
  if (!m.queue.empty() || m.too_large(need, 0)) return false;
  bool held = false;
  Bytes want = 0;
  const LaneDecision d =
      m.decide(0, align_up(need.persistent), align_up(need.ephemeral), need.group, held, want);
  return d.step != LaneStep::none && !held;
}

bool GpuArena::set_admission_key(SessionId session, double key, TimeNs /*now*/) {
  Impl& m = *impl_;
  const std::optional<QueuedRequest> q = m.queue.find(session);
  if (!q) return false;
  if (q->key == key) return true;
  m.queue.set_key(session, key);
  m.reconcile(true);
  return true;
}

void GpuArena::leave(SessionId session, TimeNs /*now*/) {
  Impl& m = *impl_;
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return;
  SessionState& s = it->second;
  m.reserved -= s.reserved();
  m.resident_reserved -= s.on_card();
  if (s.lane) m.lanes.remove_member(*s.lane, session);
  m.queue.remove(session);
  std::erase_if(m.draining, [session](const auto& d) { return d.second == session; });
  if (m.heap.release_all(m.space, session) > 0) m.lanes.mark_dirty();
  if (s.res == Residency::swapped)
    std::erase_if(m.swapped_buffers, [&](const auto& b) {
      if (b.second.first != session) return false;
      m.swapped_bytes -= b.second.second;
      return true;
    });
  m.sessions.erase(it);
  m.reconcile(true);
}

std::vector<Admitted> GpuArena::take_admissions() {
  std::vector<Admitted> out;
  out.swap(impl_->admissions);
  return out;
}

bool GpuArena::has_admissions() const {
  return !impl_->admissions.empty();
}

bool GpuArena::lane_ready(LaneId lane) const {
  return impl_->lanes.ready(lane);
}

Bytes GpuArena::lane_offset(LaneId lane) const {
  const Lane* l = impl_->lanes.find(lane);
  return l && l->offset ? *l->offset : 0;
}

Bytes GpuArena::lane_size(LaneId lane) const {
  const Lane* l = impl_->lanes.find(lane);
  return l ? l->size : 0;
}

void GpuArena::begin_iteration(LaneId lane, SessionId session, Bytes ephemeral_used) {
  impl_->lanes.begin(lane, session, ephemeral_used);
  impl_->verify();
}

void GpuArena::end_iteration(LaneId lane, TimeNs /*now*/) {
  Impl& m = *impl_;
  if (!m.lanes.end(lane)) return;
  // Sessions that left this lane while it ran have drained: they count in the queue again,
  // and a pass must offer them what they waited for.
  bool drained = false;
  if (!m.draining.empty()) {  // usually empty: end_iteration is on salus-sim's hot path
    std::vector<SessionId> done;
    std::erase_if(m.draining, [&](const auto& d) {
      if (d.first == lane) done.push_back(d.second);
      return d.first == lane;
    });
    for (SessionId s : done) m.sync_passable(s);
    drained = !done.empty();
  }
  m.reconcile(drained);
}

void GpuArena::lane_running(LaneId lane, SessionId session) {
  impl_->lanes.now_running(lane, session);
}

AllocResult GpuArena::alloc_persistent(SessionId session, Bytes size) {
  Impl& m = *impl_;
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return {ArenaError::unknown_session};
  SessionState& s = it->second;
  if (!s.admitted) return {ArenaError::not_admitted};
  if (!s.on_gpu() || s.res == Residency::swapping_out) return {ArenaError::swapped_out};
  if (size > m.usable) return {ArenaError::no_memory};
  const Bytes rounded = align_up(std::max<Bytes>(size, 1));
  const Bytes before = s.reserved();
  const Bytes after = std::max(s.p, s.used + rounded);
  if (after - before > std::min(m.slack(), m.phys_slack())) return {ArenaError::no_memory};
  const std::optional<BufferHandle> h = m.heap.allocate(m.space, session, rounded, m.lanes.total());
  if (!h) {
    m.heap.request_room(rounded);
    m.heap.settle_compaction(m.lanes.total());
    m.verify();
    return {ArenaError::fragmented};
  }
  m.update(s, [&] { s.used += rounded; });
  m.heap.settle_compaction(m.lanes.total());
  m.verify();
  return {ArenaError::ok, *h, m.heap.find(*h)->offset};
}

void GpuArena::free_persistent(BufferHandle buffer) {
  Impl& m = *impl_;
  std::optional<PersistentBuffer> b = m.heap.release(m.space, buffer);
  if (!b) {
    auto sw = m.swapped_buffers.find(buffer);
    if (sw == m.swapped_buffers.end()) return;
    b = PersistentBuffer{buffer, sw->second.first, 0, sw->second.second, {}, {}, {}};
    m.swapped_bytes -= sw->second.second;
    m.swapped_buffers.erase(sw);
  }
  SessionState& s = m.sessions.at(b->owner);
  m.update(s, [&] { s.used -= b->size; });
  if (!s.admitted) m.queue.set_need(b->owner, s.p_new(), s.e);
  m.lanes.mark_dirty();
  m.reconcile(true);
}

bool GpuArena::buffer_on_gpu(BufferHandle buffer) const {
  return impl_->heap.find(buffer) != nullptr;
}

Bytes GpuArena::buffer_offset(BufferHandle buffer) const {
  const PersistentBuffer* b = impl_->heap.find(buffer);
  return b ? b->offset : 0;
}

Bytes GpuArena::buffer_size(BufferHandle buffer) const {
  const PersistentBuffer* b = impl_->heap.find(buffer);
  return b ? b->size : 0;
}

std::vector<PersistentMove> GpuArena::session_idle(SessionId session) {
  Impl& m = *impl_;
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return {};
  if (const Lane* l = it->second.lane ? m.lanes.find(*it->second.lane) : nullptr;
      l && l->busy && l->running == session)
    return {};  // not idle after all: its iteration is in flight
  if (it->second.res != Residency::resident) return {};  // its memory is leaving or gone
  for (const auto& [lane, s] : m.draining)
    if (s == session) return {};  // its work may still run in the lane it left
  std::vector<PersistentMove> moves = m.heap.plan_moves(m.space, session, m.lanes.total());
  m.verify();
  return moves;
}

void GpuArena::finish_moves(SessionId session, TimeNs /*now*/) {
  Impl& m = *impl_;
  const PersistentHeap::Finished f = m.heap.finish_moves(m.space, session);
  if (!f.had_moves) return;
  m.stats.persistent_moves += f.buffers;
  m.stats.persistent_bytes_moved += f.bytes;
  m.lanes.mark_dirty();
  m.reconcile(true);
}

bool GpuArena::compaction_pending() const {
  return impl_->heap.compaction_pending(impl_->lanes.total());
}

void GpuArena::compaction_owners(std::vector<SessionId>& out) const {
  impl_->heap.owners_to_move(impl_->space, impl_->lanes.total(), out);
}

Residency GpuArena::residency(SessionId session) const {
  auto it = impl_->sessions.find(session);
  return it == impl_->sessions.end() ? Residency::resident : it->second.res;
}

Bytes GpuArena::resident_room() const {
  return impl_->phys_slack();
}

Bytes GpuArena::swap_in_bytes(SessionId session) const {
  auto it = impl_->sessions.find(session);
  return it == impl_->sessions.end() ? 0 : it->second.movable();
}

Bytes GpuArena::lane_room_wanted() const {
  return impl_->lane_room_wanted;
}

bool GpuArena::begin_swap_out(SessionId session, std::vector<SwapBuffer>& out) {
  Impl& m = *impl_;
  out.clear();
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return false;
  SessionState& s = it->second;
  if (!s.admitted || s.res != Residency::resident || m.heap.has_outstanding(session)) return false;
  if (const Lane* l = s.lane ? m.lanes.find(*s.lane) : nullptr;
      l && l->busy && l->running == session)
    return false;
  for (const auto& [lane, d] : m.draining)
    if (d == session) return false;
  if (const auto* handles = m.heap.buffers_of(session))
    for (BufferHandle h : *handles) {
      const PersistentBuffer* b = m.heap.find(h);
      if (b->then_to) return false;  // half of a two-step move: finish it first
      out.push_back({h, b->offset, b->size});
    }
  s.res = Residency::swapping_out;
  m.verify();
  return true;
}

void GpuArena::finish_swap_out(SessionId session, TimeNs /*now*/) {
  Impl& m = *impl_;
  auto it = m.sessions.find(session);
  if (it == m.sessions.end() || it->second.res != Residency::swapping_out) return;
  SessionState& s = it->second;
  if (const auto* handles = m.heap.buffers_of(session)) {
    const std::vector<BufferHandle> hs(handles->begin(), handles->end());
    for (BufferHandle h : hs) {
      const std::optional<PersistentBuffer> b = m.heap.release(m.space, h);
      m.swapped_buffers.emplace(h, std::make_pair(session, b->size));
      m.swapped_bytes += b->size;
    }
  }
  m.update(s, [&] { s.res = Residency::swapped; });
  m.lanes.mark_dirty();
  m.reconcile(true);
}

void GpuArena::cancel_swap_out(SessionId session) {
  auto it = impl_->sessions.find(session);
  if (it != impl_->sessions.end() && it->second.res == Residency::swapping_out)
    it->second.res = Residency::resident;
  impl_->verify();
}

bool GpuArena::set_unswappable(SessionId session, Bytes bytes) {
  auto it = impl_->sessions.find(session);
  if (it == impl_->sessions.end() || !it->second.on_gpu()) return false;
  SessionState& s = it->second;
  s.pin = align_up(std::min(bytes, s.p));  // p is aligned: so is the cap
  impl_->verify();
  return true;
}

Bytes GpuArena::raise_unswappable(SessionId session, Bytes bytes) {
  Impl& m = *impl_;
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return 0;
  SessionState& s = it->second;
  Bytes want = align_up(std::min(bytes, s.p));
  // Swapped, the growth lands in the resident set: only as far as there is room
  // (phys_slack is a multiple of the alignment: so is the cap).
  if (!s.on_gpu()) want = std::min(want, s.pin + m.phys_slack());
  if (want > s.pin) m.update(s, [&] { s.pin = want; });
  m.verify();
  return s.pin;
}

Bytes GpuArena::on_card_bytes(SessionId session) const {
  auto it = impl_->sessions.find(session);
  return it == impl_->sessions.end() ? 0 : it->second.on_card();
}

ArenaError GpuArena::swap_in(SessionId session, std::vector<SwapBuffer>& out) {
  Impl& m = *impl_;
  out.clear();
  auto it = m.sessions.find(session);
  if (it == m.sessions.end()) return ArenaError::unknown_session;
  SessionState& s = it->second;
  if (s.res != Residency::swapped) return ArenaError::ok;
  if (s.reserved() - s.on_card() > m.phys_slack()) return ArenaError::no_memory;
  std::vector<std::pair<BufferHandle, Bytes>> mine;
  for (const auto& [h, b] : m.swapped_buffers)
    if (b.first == session) mine.emplace_back(h, b.second);
  // Largest first packs best; handle order breaks ties so the layout is deterministic.
  std::sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  for (const auto& [h, size] : mine) {
    if (!m.heap.allocate(m.space, session, size, m.lanes.total(), h)) {
      for (const SwapBuffer& placed : out) m.heap.release(m.space, placed.buffer);
      out.clear();
      m.heap.request_room(size);
      m.heap.settle_compaction(m.lanes.total());
      m.verify();
      return ArenaError::fragmented;
    }
    out.push_back({h, m.heap.find(h)->offset, size});
  }
  for (const SwapBuffer& b : out) {
    m.swapped_buffers.erase(b.buffer);
    m.swapped_bytes -= b.size;
  }
  m.update(s, [&] { s.res = Residency::resident; });
  m.heap.settle_compaction(m.lanes.total());
  m.verify();
  return ArenaError::ok;
}

MemorySummary GpuArena::memory() const {
  const Impl& m = *impl_;
  MemorySummary s;
  s.capacity = m.capacity;
  s.admit_capacity = m.options.oversubscribe > 1.0 ? m.admit_usable : m.capacity;
  s.resident_reserved = m.resident_reserved;
  s.swapped = m.swapped_bytes;
  s.persistent_used = m.heap.used() + m.swapped_bytes;
  s.persistent_reserved = m.reserved;
  s.lane_total = m.lanes.total();
  s.free = s.admit_capacity - std::min(s.admit_capacity, m.reserved + m.lanes.total());
  s.largest_hole = m.space.largest_hole();
  const Bytes physically_free = m.space.free_bytes();
  s.fragmentation = physically_free == 0 ? 0.0
                                         : 1.0 - static_cast<double>(s.largest_hole) /
                                                     static_cast<double>(physically_free);
  s.lanes = static_cast<std::uint32_t>(m.lanes.count());
  s.queued = static_cast<std::uint32_t>(m.queue.size());
  return s;
}

std::vector<LaneView> GpuArena::lanes() const {
  std::vector<LaneView> out;
  out.reserve(impl_->lanes.count());
  for (const auto& [id, l] : impl_->lanes.all()) {
    LaneView v{id, l.offset, l.size, l.used, l.busy, l.busy && !l.in_place(), l.running, {}};
    v.sessions.reserve(l.members.size());
    for (const LaneMember& mb : l.members) v.sessions.push_back(mb.session);
    out.push_back(std::move(v));
  }
  // Placed lanes by offset, then the ones waiting for room, by id (the map's order).
  std::stable_sort(out.begin(), out.end(), [](const LaneView& a, const LaneView& b) {
    if (a.offset.has_value() != b.offset.has_value()) return a.offset.has_value();
    return a.offset && *a.offset < *b.offset;
  });
  return out;
}

std::vector<QueueEntry> GpuArena::queue() const {
  std::vector<QueueEntry> out;
  out.reserve(impl_->queue.size());
  impl_->queue.for_each([&](const QueuedRequest& q) {
    out.push_back(
        {q.session, impl_->sessions.at(q.session).declared, q.waiting_since, q.bypassed, q.key});
  });
  return out;
}

std::optional<Placement> GpuArena::placement(SessionId session) const {
  auto it = impl_->sessions.find(session);
  if (it == impl_->sessions.end()) return std::nullopt;
  const SessionState& s = it->second;
  Placement p;
  p.admitted = s.admitted;
  p.lane = s.lane;
  if (const Lane* l = s.lane ? impl_->lanes.find(*s.lane) : nullptr) {
    p.lane_offset = l->offset;
    p.lane_size = l->size;
  }
  p.declared = s.declared;
  p.persistent_used = s.used;
  return p;
}

const ArenaStats& GpuArena::stats() const {
  return impl_->stats;
}

std::string GpuArena::check_invariants() const {
  return impl_->check();
}

std::uint64_t GpuArena::layout_version() const {
  return impl_->space.version();
}

std::vector<PhysicalRegion> GpuArena::physical_regions() const {
  return impl_->regions();
}

}  // namespace salus::arena
