// The shared lane of attached sessions (issue 15): who holds the GPU's lane
// memory, the hand-over (only after the holder's yield report or its exit),
// and clearing between uids. The rules are in vgpu/attach/shared_lane.hpp.
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {

// A holder asked to yield that does not report within this (it is not at its
// gate: CPU work, or a hang) loses the memory: salusd drops its reference and
// makes fresh memory for the others; the holder's mapping keeps the old alive.
constexpr std::int64_t kLaneReleaseLimitNs = 2'000'000'000;
// A claim on the lane (lane_claimed_against) lapses unless its session renews
// it, by trying again, within this: twice the worker's longest sleep.
constexpr std::int64_t kClaimFreshNs = 200'000'000;
// Whose bytes fresh memory may hold: nobody's we know, so it is cleared first.
constexpr uid_t kUnknownUid = static_cast<uid_t>(-1);

// salusd lets go of the lane memory (the device first, then the fd).
void drop_memory(Device& dev, SharedLane& L) {
  if (L.memory) dev.drop_lane_memory(L.memory.get());
  L.memory.reset();
  L.bytes = 0;
}

}  // namespace

namespace {
std::uint32_t lane_held_of(const Session& s) {
  return std::atomic_ref<std::uint32_t>(s.gate->g().lane_held).load(std::memory_order_seq_cst);
}
}  // namespace

bool Broker::lane_asked_for(const SharedLane& L, SessionId other_than) const {
  if (L.asker == 0 || L.asker == other_than) return false;
  const Session* w = get(L.asker);
  return w && w->gate && !w->gate->exited && !w->gate->lane_off &&
         gate_load(w->gate->g().requested) > w->gate->granted;
}

void Broker::ask_to_yield(SharedLane& L, Session& h) {
  L.release_asked = true;
  L.release_asked_at = now();
  // Sequentially consistent against the shim's store of lane_held and its
  // load of lane_grant (client/shim/lane.cpp, map_locked): either we see it
  // mapped, or it sees the grant gone and unmaps at once.
  std::atomic_ref<std::uint32_t>(h.gate->g().lane_grant).store(0u, std::memory_order_seq_cst);
  h.gate->wake();
}

// Whether a session of another arena lane asked for the lane first and still
// waits for it: s lets it go first. A claim must be one the scheduler would
// serve, or the lane stalls for good, since only the asker's pick could let it
// run:
//  - within one arena lane the policy's pick decides who is next, so a claim
//    there never holds back the session picked (a newcomer ranked ahead of the
//    asker, a tie it loses);
//  - the asker's arena lane must be allowed to dispatch (FIFO lets one lane
//    run);
//  - and the asker must still be trying: a claim not renewed within
//    kClaimFreshNs (every dispatch pass that picks the asker renews it, and
//    the worker passes every 100 ms at least) is one the policy no longer
//    picks there (held for its owner, a policy switch).
// Found by the gate-scribbling and random-policy tests.
bool Broker::lane_claimed_against(const Gpu& g, const Session& s) const {
  const SharedLane& L = g.shared_lane;
  if (!lane_asked_for(L, s.id)) return false;
  const Session* asker = get(L.asker);
  if (!asker || !asker->lane || asker->lane == s.lane) return false;
  // Freshness first: lane_may_dispatch walks the GPU's lanes under FIFO.
  return now() - L.asked_at < kClaimFreshNs && g.sched.lane_may_dispatch(*asker->lane);
}

bool Broker::lane_free_for(Gpu& g, Session& s) {
  SharedLane& L = g.shared_lane;
  if (L.asker == s.id) L.asked_at = now();  // still trying: the claim stands
  if (L.holder == s.id && (L.release_asked || lane_claimed_against(g, s))) {
    // Another session waits for the lane (sessions of other arena lanes of the
    // group are dispatched on their own): the holder gets no more grants
    // until it has yielded, or the two could keep it from each other forever.
    if (!L.release_asked && s.in_flight == 0) ask_to_yield(L, s);
    if (lane_held_of(s) != 0 || s.in_flight > 0) return false;
    L.holder = 0;
    L.release_asked = false;
  }
  if (L.holder != 0 && L.holder != s.id) {
    Session* h = get(L.holder);
    if (h && h->gate && !h->gate->exited) {
      // Never taken back in the middle of an iteration: the holder may map it
      // only after its grant, and uses it until its boundary. Asked once that
      // iteration completed (its completion dispatches again).
      if (L.asker != s.id && !lane_claimed_against(g, s)) {
        L.asker = s.id;
        L.asked_at = now();
      }
      if (h->in_flight > 0) return false;
      if (!L.release_asked) ask_to_yield(L, *h);
      // A holder that never mapped it (or gave it back) owes no report.
      if (lane_held_of(*h) != 0) return false;
      L.release_wait_ns += now() - L.release_asked_at;
    }
    L.holder = 0;
    L.release_asked = false;
  }
  // The session that asked for the lane gets it before the sessions of other
  // arena lanes, while it still waits for a grant.
  if (lane_claimed_against(g, s)) return false;
  if (L.asker != s.id) L.asker = 0;
  return true;
}

bool Broker::lane_ready(Gpu& g, Session& s, Deferred& later) {
  if (!shares_lane(s)) return true;
  SharedLane& L = g.shared_lane;
  AttachedGate& gt = *s.gate;
  if (gt.lane_off) return true;
  if (L.holder == s.id && gate_load(gt.g().lane_grant) == L.generation &&
      !lane_claimed_against(g, s))
    return true;
  if (L.busy) return false;
  if (!lane_free_for(g, s)) return false;
  // Sized for the largest ephemeral need of the GPU's sharing sessions.
  Bytes want = 0;
  for (SessionId id : attached_) {
    const Session* o = get(id);
    if (o && o->gpu == s.gpu && shares_lane(*o)) want = std::max(want, o->need.ephemeral);
  }
  want = lane_bytes_for(std::max<Bytes>(want, 1));
  if (gt.lane_room) return grant_lane_room(g, s, want);
  Gpu* gp = &g;
  const SessionId next = s.id;
  if (!L.memory || L.bytes < want) {
    // Made (and cleared: fresh memory holds nobody knows whose bytes) off the
    // lock: on the cuda backend it is a round trip to the GPU's executor.
    L.busy = true;
    later.push_back([this, gp, want, next] { make_lane(*gp, want, next); });
    return false;
  }
  if (L.dirty_uid && *L.dirty_uid != s.uid) {
    // Another uid's bytes: zeroed before s may map them.
    L.busy = true;
    const int fd = L.memory.get();
    const Bytes bytes = L.bytes;
    later.push_back([this, gp, fd, bytes, next] { clear_lane(*gp, fd, bytes, next); });
    return false;
  }
  std::string why;
  if (gt.lane_sent != L.generation) {
    if (int e = send_lane_memory(gt.lane_sock.get(), L.memory.get(), L.bytes, L.generation, why)) {
      lane_off(s, fmt::format("{} ({})", why, strerrorname_np(e)));
      return true;
    }
    gt.lane_sent = L.generation;
  }
  hand_lane_to(L, s, L.bytes);
  L.dirty_uid = s.uid;
  return true;
}

void Broker::hand_lane_to(SharedLane& L, Session& s, Bytes bytes) {
  if (L.holder != s.id) ++L.handovers;
  L.holder = s.id;
  if (L.asker == s.id) L.asker = 0;
  L.release_asked = false;
  gate_store(s.gate->g().lane_bytes, std::uint64_t{bytes});
  gate_store(s.gate->g().lane_grant, L.generation);
}

bool Broker::grant_lane_room(Gpu& g, Session& s, Bytes room) {
  // The holder makes its own memory within `room` (its cuMemCreate, charged
  // to the lane by its shim) and clears it before its yield report: salusd
  // holds none meanwhile, or the lane would be on the card twice. Nobody maps
  // salusd's memory now (lane_free_for), so it goes; the next memory holder
  // gets fresh, cleared memory.
  SharedLane& L = g.shared_lane;
  drop_memory(*g.device, L);
  if (L.generation == 0) L.generation = 1;
  hand_lane_to(L, s, room);
  L.dirty_uid.reset();
  return true;
}

void Broker::clear_lane(Gpu& g, int fd, Bytes bytes, SessionId next) {
  // Off the broker lock: the device zeroes the memory and synchronizes.
  std::string why;
  const auto t0 = std::chrono::steady_clock::now();
  const int e = g.device->clear_lane_memory(fd, bytes, why);
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  Deferred later;
  {
    std::lock_guard lk(mu_);
    SharedLane& L = g.shared_lane;
    L.busy = false;
    if (e == 0) {
      L.dirty_uid.reset();
      ++L.clears;
      L.clear_ns += ns;
    } else {
      // Never hand over uncleared bytes: drop this memory; the next try makes
      // fresh memory (cleared in turn).
      drop_memory(*g.device, L);
      if (Session* s = get(next))
        log(*s, fmt::format("shared lane: clearing failed: {} ({}); making fresh memory", why,
                            strerrorname_np(e)));
    }
    dispatch(g, later);
  }
  run_deferred(later);
}

void Broker::make_lane(Gpu& g, Bytes bytes, SessionId next) {
  // Off the broker lock: new memory from the device, cleared before anyone maps it.
  UniqueFd fd;
  std::string why;
  int e = g.device->make_lane_memory(bytes, fd, why);
  const auto t0 = std::chrono::steady_clock::now();
  if (e == 0) e = g.device->clear_lane_memory(fd.get(), bytes, why);
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  if (e != 0 && fd) g.device->drop_lane_memory(fd.get());
  Deferred later;
  {
    std::lock_guard lk(mu_);
    SharedLane& L = g.shared_lane;
    L.busy = false;
    if (e == 0) {
      drop_memory(*g.device, L);
      L.memory = std::move(fd);
      L.bytes = bytes;
      ++L.generation;
      L.dirty_uid.reset();
      ++L.clears;
      L.clear_ns += ns;
    } else if (Session* s = get(next); s && s->gate && !s->gate->exited) {
      lane_off(*s, fmt::format("no lane memory of {} on gpu {}: {} ({})", arena::format_size(bytes),
                               g.index, why, strerrorname_np(e)));
    }
    dispatch(g, later);
  }
  run_deferred(later);
}

void Broker::lane_off(Session& s, const std::string& why) {
  // Its admission counted the lane, so it keeps its budget (persistent only):
  // salus_lane_alloc answers -ENOTCONN and its log says why.
  s.gate->lane_off = true;
  log(s, fmt::format("shared lane: {}; the session runs without the lane's memory", why));
}

void Broker::lane_serve(Gpu& g, Session& s) {
  SharedLane& L = g.shared_lane;
  if (L.holder != s.id || !L.release_asked || gate_load(s.gate->g().lane_held) != 0) return;
  L.holder = 0;
  L.release_asked = false;
  L.release_wait_ns += now() - L.release_asked_at;
  kick(g);
}

void Broker::lane_detach(Session& s) {
  Gpu* g = gpu_of(s);
  if (!g || !shares_lane(s)) return;
  SharedLane& L = g->shared_lane;
  if (L.holder == s.id) {
    L.holder = 0;
    L.release_asked = false;
    const bool gone = process_exited(s.gate->pidfd.get());
    if (!gone && gate_load(s.gate->g().lane_held) != 0) {
      // Alive and maybe still mapped: never hand this memory to anyone again.
      drop_memory(*g->device, L);
      ++L.generation;  // a room holder's next grant tells it its room was given up
      ++L.abandoned;
      log(s,
          "shared lane: the program let go of the gate with the lane mapped; its memory "
          "is abandoned to it and the lane gets fresh memory");
    }
  }
  bool others = false;
  for (SessionId id : attached_) {
    const Session* o = get(id);
    others = others || (o && o != &s && o->gpu == s.gpu && shares_lane(*o));
  }
  if (!others && !L.busy) {
    drop_memory(*g->device, L);  // nobody shares the lane any more: give it back
  }
  kick(*g);
}

void Broker::lane_tick(Gpu& g, TimeNs t) {
  SharedLane& L = g.shared_lane;
  if (!L.release_asked || t - L.release_asked_at < kLaneReleaseLimitNs) return;
  Session* h = get(L.holder);
  if (h && h->gate && h->gate->lane_room)
    log(*h, fmt::format("shared lane: no yield report within {} s; the room this program holds "
                        "in the lane is abandoned to it (its segments stay its own, uncharged)",
                        kLaneReleaseLimitNs / 1'000'000'000));
  else if (h)
    log(*h, fmt::format("shared lane: no yield report within {} s; the lane memory is abandoned "
                        "to this program and the lane gets fresh memory",
                        kLaneReleaseLimitNs / 1'000'000'000));
  drop_memory(*g.device, L);
  ++L.generation;  // a room holder's next grant tells it its room was given up
  ++L.abandoned;
  L.holder = 0;
  L.release_asked = false;
  kick(g);
}

}  // namespace salus::vgpu
