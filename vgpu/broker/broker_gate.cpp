// Attached sessions: the `attach` command, grants as dispatches, the gate
// service thread (doorbells, program exits, heartbeats and fallback slices),
// and swap requests to the program (issue 15).
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {

// Every attached session of a GPU is in this arena lane group (gpu_arena.hpp).
constexpr std::uint32_t kAttachedGroup = 1;
constexpr std::int64_t kTickNs = 25'000'000;  // heartbeat and slice check period
constexpr std::uint64_t kStopKey = ~std::uint64_t{0};
constexpr std::uint64_t kTimerKey = ~std::uint64_t{0} - 1;

// epoll keys: the session id, doubled, plus 1 for its pidfd.
std::uint64_t bell_key(SessionId id) {
  return id << 1;
}
std::uint64_t exit_key(SessionId id) {
  return (id << 1) | 1;
}

// The program's note, made safe for a one-line log: bounded, printable ASCII.
std::string sanitize_note(const salus_gate& g) {
  std::string out;
  for (std::size_t i = 0; i < SALUS_GATE_NOTE_BYTES - 1; ++i) {
    const char c = std::atomic_ref<const char>(g.note[i]).load(std::memory_order_relaxed);
    if (c == '\0') break;
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return out;
}

}  // namespace

arena::Need Broker::arena_need(const Session& s, Bytes persistent, Bytes ephemeral, int gpu) const {
  if (!will_attach(s)) return {persistent, ephemeral};
  // The program's CUDA context is on the card beside whatever it allocates, and
  // no swap moves it.
  const Bytes context = context_for(s, persistent, ephemeral, gpu);
  // Opted into the shared lane: its ephemeral memory is the lane's, counted
  // once for the lane as for hosted sessions (broker_lanes.cpp).
  if (shares_lane(s)) return {persistent + context, ephemeral, kAttachedGroup, context};
  // The program's memory is its own (no lane sharing of physical memory for
  // attached sessions): its whole need is persistent, and its lane, shared with
  // the GPU's other attached sessions, holds no ephemeral bytes.
  return {persistent + ephemeral + context, 0, kAttachedGroup, context};
}

// Attached, or declared with `need ... kind=attached` for a program that will
// attach (salus-run): placed and admitted as attached from the first need.
bool Broker::will_attach(const Session& s) {
  return s.gate != nullptr || s.need.attached.value_or(false);
}

// A need that fits the GPU is never refused for an estimate: a whole-GPU need
// (salus-run --retry-on-oom on an older salus-run, a Slurm step) keeps what the
// card has left for the context, and the session log says so (exec_need).
Bytes Broker::context_for(const Session& s, Bytes persistent, Bytes ephemeral, int gpu) const {
  if (!will_attach(s)) return 0;
  const Bytes reserve = context_reserve_on(gpu);
  if (gpu < 0 || static_cast<std::size_t>(gpu) >= gpus_.size()) return reserve;
  const Bytes cap = gpus_[static_cast<std::size_t>(gpu)]->sched.arena().capacity();
  const Bytes need = persistent + ephemeral;  // callers checked it does not overflow
  return std::min(reserve, cap > need ? cap - need : 0);
}

// How admission counts an attached program's CUDA context, for the attach
// lines of the session log ("" when it counts none).
std::string Broker::context_reserve_note(const Session& s) const {
  const Bytes r = context_reserve_on(s.gpu);
  if (r == 0) return {};
  const Bytes counted = context_of(s);
  const bool learned = r > config_.attach_context_reserve;
  return fmt::format(
      " (admission also counts {} for the program's CUDA context: "
      "--attach-context-reserve{}{})",
      arena::format_size(counted), learned ? " auto, the largest measured on this GPU" : "",
      counted < r
          ? fmt::format(" {}, cut to what the need leaves of the GPU", arena::format_size(r))
          : std::string());
}

Bytes Broker::context_reserve_on(int gpu) const {
  const Bytes configured = config_.attach_context_reserve;
  if (gpu < 0 || static_cast<std::size_t>(gpu) >= gpus_.size()) {
    Bytes most = configured;  // not placed yet: the largest any GPU counts
    for (const auto& g : gpus_) most = std::max(most, g->context_learned);
    return most;
  }
  return std::max(configured, gpus_[static_cast<std::size_t>(gpu)]->context_learned);
}

void Broker::learn_context(Gpu& g, Bytes bytes) {
  if (!config_.attach_context_learn || bytes == 0) return;
  const Bytes units = (bytes + kLearnedContextUnit - 1) / kLearnedContextUnit;
  const Bytes learned = std::min(units * kLearnedContextUnit, kMostLearnedContext);
  const Bytes was = context_reserve_on(static_cast<int>(g.index));
  if (learned <= was) return;
  g.context_learned = learned;
  spdlog::warn(
      "gpu {}: an attached program's CUDA context measures {}, past the {} admission "
      "counted: new attached sessions there count {} (--attach-context-reserve auto{})",
      g.index, arena::format_size(bytes), arena::format_size(was), arena::format_size(learned),
      learned == kMostLearnedContext
          ? fmt::format(", which learns at most {}", arena::format_size(learned))
          : std::string());
}

void Broker::set_budget(Session& s) {
  if (!s.gate) return;
  // A session sharing the lane allocates its ephemeral memory from the lane's,
  // which is charged to no one's budget: its own allocations are persistent.
  const Bytes declared = s.need.persistent + s.need.ephemeral;
  const Bytes own = shares_lane(s) ? s.need.persistent : declared;
  gate_store(s.gate->g().budget_bytes, declared == 0 ? UINT64_MAX : std::uint64_t{own});
  s.gate->wake();
}

// On the cuda backend without VMM the arena holds its share of the card from
// the start, and attached programs allocate in their own contexts beside it (design.md,
// *Placement in the arena*): admission counts their needs against the arena,
// but the bytes must also be free outside it, or the driver refuses an
// allocation that the budget allows. Said once per attach, where the user
// reads it, with the flag that fixes it.
void Broker::note_memory_outside_arena(const Gpu& g, Session& s, std::uint32_t ln) {
  const DeviceInfo& d = g.device->info();
  if (d.backend != "cuda") return;  // sim: attached programs use another driver's memory
  // Backed on demand, the arena takes only what salusd holds, and admission keeps
  // that plus the budgets within the arena's size, so the card has room for both.
  if (d.backs_on_demand) return;
  Bytes budgets = 0;
  for (const SessionId id : attached_) {
    const Session* o = get(id);
    if (o == nullptr || !o->gate || o->gpu != static_cast<int>(g.index)) continue;
    budgets += o->need.persistent + (shares_lane(*o) ? 0 : o->need.ephemeral) + context_of(*o);
  }
  const Bytes outside = d.total_memory > d.arena_size ? d.total_memory - d.arena_size : 0;
  if (budgets <= outside) return;
  log(s, fmt::format("line {}: attach: warning: the attached programs on gpu {} have budgets "
                     "and context reserves of {} in all, but only {} of the card lies outside "
                     "salusd's arena ({} of {}, "
                     "--cuda-memory-fraction): an allocation past that fails in the driver "
                     "(CUDA_ERROR_OUT_OF_MEMORY) although the budget allows it; start salusd "
                     "with a smaller fraction for attached jobs",
                     ln, g.index, arena::format_size(budgets), arena::format_size(outside),
                     arena::format_size(d.arena_size), arena::format_size(d.total_memory)));
}

int Broker::exec_attach(Session& s, const AttachCmd& c, PendingWrite& w, std::uint32_t ln,
                        Deferred& later) {
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: attach: {}", ln, msg));
    return err;
  };
  if (s.recording) return fail(EINVAL, "not allowed inside begin/end");
  auto taken = w.attach_gates.find(w.next);
  if (taken == w.attach_gates.end()) return fail(EIO, "internal: the gate was not taken");
  const AttachedGate* incoming = taken->second.error ? nullptr : taken->second.gate.get();
  if (s.gate && !(incoming && hand_over_gate(s, *incoming, ln, later)))
    return fail(EBUSY, fmt::format("the session is already attached (pid {})", s.gate->pid));
  if (s.gpu < 0 || s.state == SessionState::idle)
    return fail(ENXIO,
                "no GPU yet: declare needs first with `need persistent=SIZE ephemeral=SIZE`");
  if (!s.queue.empty() || s.in_flight > 0 || s.transferring)
    return fail(EBUSY, "hosted work of this session is still queued or running; `sync` first");
  if (taken->second.error) return fail(taken->second.error, taken->second.why);
  std::unique_ptr<AttachedGate> gate = std::move(taken->second.gate);
  Gpu& g = *gpu_of(s);
  salus_gate& G = gate->g();
  gate->note_seq_seen = gate_load(G.note_seq);
  // A program attaching again (salusd restarted) continues its numbering:
  // `granted` never goes down, and what it ran ungated is not accounted.
  gate->completed_seen = gate_load(G.completed);
  gate->granted = std::max(gate_load(G.granted), gate->completed_seen);
  gate->gpu_ns_seen = gate_load(G.gpu_ns_total);
  gate->gpu_ns_at_attach = gate->gpu_ns_seen;
  gate->attached_at = now();
  gate_store(G.granted, gate->granted);
  gate_store(G.gpu, static_cast<std::uint32_t>(g.index));
  gate_store(G.quantum_ns, static_cast<std::uint64_t>(config_.quantum_ns));
  gate_store(G.yield_requested, 0u);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = bell_key(s.id);
  int rc = ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_ADD, gate->bell.get(), &ev);
  ev.data.u64 = exit_key(s.id);
  if (rc == 0) rc = ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_ADD, gate->pidfd.get(), &ev);
  if (rc != 0) {
    const int e = errno;
    ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_DEL, gate->bell.get(), nullptr);
    return fail(e, fmt::format("cannot watch the gate: {}", std::strerror(e)));
  }
  s.gate = std::move(gate);
  attached_.insert(s.id);
  // Re-placed below as an attached need, with its context reserve.
  const arena::Need need = arena_need(s, s.need.persistent, s.need.ephemeral, s.gpu);
  const Bytes counted_before = s.context_counted;
  s.context_counted = need.unswappable;
  set_budget(s);
  const std::uint64_t heartbeat = gate_load(G.heartbeat);
  gate_store(G.heartbeat, heartbeat + 1);
  gate_store(G.state, SALUS_GATE_ATTACHED);
  s.gate->wake();
  const Bytes own = s.need.persistent + (shares_lane(s) ? 0 : s.need.ephemeral);
  log(s, fmt::format(
             "line {}: attached gate={} bell={} of pid {}: gpu {}, budget {}{}{}", ln, c.gate_fd,
             c.bell_fd, s.gate->pid, g.index,
             own == 0 ? std::string("unlimited") : arena::format_size(own), context_reserve_note(s),
             shares_lane(s) ? fmt::format(", shared lane lane={} ({} ephemeral{})", c.lane_fd,
                                          arena::format_size(s.need.ephemeral),
                                          c.lane_room ? ", as room for its cuMemCreate" : "")
                            : std::string()));
  note_memory_outside_arena(g, s, ln);
  // Re-place the need as an attached one; admission may wait.
  const arena::ArenaError err = g.sched.change_need(s.id, need, std::nullopt, now());
  if (err != arena::ArenaError::ok) {
    const std::string note = context_reserve_note(s);
    detach_gate(s, later);
    s.gate.reset();
    s.context_counted = counted_before;
    return fail(ENOMEM,
                fmt::format("rejected by gpu {}: {}{}", g.index, arena::to_string(err), note));
  }
  s.lane.reset();
  if (s.state == SessionState::admitted) {
    s.state = SessionState::queued;
    s.queued_at = now();
  }
  update_runnable(g, s);
  handle_admissions(g, later);
  if (s.state != SessionState::admitted)
    log(s, fmt::format("line {}: attach: waiting for admission on gpu {}; grants start once "
                       "admitted",
                       ln, g.index));
  return 0;
}

bool Broker::hand_over_gate(Session& s, const AttachedGate& incoming, std::uint32_t ln,
                            Deferred& later) {
  AttachedGate& held = *s.gate;
  // A version 2 gate has no uses_gpu (its program's shim is older): never
  // taken over, whatever its reserved word says.
  if (held.exited || gate_load(held.g().version) < 3 || gate_load(held.g().uses_gpu) != 0 ||
      gate_load(incoming.g().uses_gpu) != 1 ||
      std::find(incoming.ancestors.begin(), incoming.ancestors.end(), held.pid) ==
          incoming.ancestors.end())
    return false;
  const pid_t from = held.pid;
  detach_gate(s, later, SALUS_GATE_HANDED_OVER);  // it never attaches again
  s.launcher_pidfd = std::move(held.pidfd);
  s.launcher_pid = from;
  s.gate.reset();
  log(s, fmt::format("line {}: attach: pid {}, which uses the GPU, takes the session over from "
                     "pid {}, its ancestor, which does not (a launcher); pid {} runs on ungated",
                     ln, incoming.pid, from, from));
  return true;
}

bool Broker::must_drain(const Lane& lane, const Session& next) const {
  if (lane.in_flight == 0) return false;
  for (const Lane::InFlight& f : lane.tokens) {
    if (f.session == next.id) continue;
    if (next.gate) return true;
    const Session* other = get(f.session);
    if (other && other->gate) return true;
  }
  return false;
}

bool Broker::grant_one(Gpu& g, LaneId lane_id, Lane& lane, Session& s, Deferred& later) {
  // Separate processes share no stream: a switch drains the lane first.
  if (must_drain(lane, s)) return false;
  if (!lane_ready(g, s, later)) return false;
  AttachedGate& gt = *s.gate;
  // Never grant into an unanswered swap-out (update_runnable keeps the session
  // out of the pick meanwhile): the program would move its memory out and
  // straight back in.
  if (gt.swap_pending && gt.swap_request == SALUS_SWAP_REQ_OUT) return false;
  if (lane.in_flight == 0) g.sched.arena().begin_iteration(lane_id, s.id, 0);
  g.sched.iteration_dispatched(s.id);
  const TimeNs t = now();
  lane.tokens.push_back(Lane::InFlight{next_token_++, s.id, t});
  ++lane.in_flight;
  ++s.in_flight;
  s.in_flight_lane = lane_id;
  ++gt.granted;
  gt.granted_at = t;
  salus_gate& G = gt.g();
  gate_store(G.yield_requested, 0u);
  gate_store(G.granted, gt.granted);
  gt.wake();
  update_runnable(g, s);
  return true;
}

void Broker::finish_grant(Gpu& g, Session& s, std::int64_t device_ns, std::int64_t charge_ns,
                          bool counts, Deferred& later) {
  // The oldest grants complete first: one the hold limit took off the lane
  // (release_long_hold) has no token left there.
  if (s.gate && s.gate->released_in_flight > 0) {
    --s.gate->released_in_flight;
  } else if (s.in_flight_lane) {
    auto it = g.lanes.find(*s.in_flight_lane);
    if (it != g.lanes.end()) {
      Lane& lane = it->second;
      for (auto f = lane.tokens.begin(); f != lane.tokens.end(); ++f) {
        if (f->session != s.id) continue;
        lane.tokens.erase(f);
        if (lane.in_flight > 0) --lane.in_flight;
        if (lane.in_flight == 0) {
          g.sched.arena().end_iteration(it->first, now());
          // Every caller dispatches (or kicks the worker) right after.
          handle_admissions(g, later, false);
        }
        break;
      }
    }
  }
  if (s.in_flight > 0) --s.in_flight;
  s.gpu_ns += device_ns;
  if (counts) {
    ++s.iterations_done;
    s.iteration_gpu_ns += device_ns;
    ++stats_.iterations;
  }
  g.sched.iteration_done(s.id, charge_ns, counts);
}

// The lane time a batch of completions seen now ends: from the grant of the
// first of them, or from the last completion charged when the session held the
// lane since (pipelined grants), to now. Measured by salusd, whatever the
// program reports.
std::int64_t Broker::lane_held_since_charged(const Gpu& g, Session& s, TimeNs t) const {
  TimeNs from = t;
  if (s.in_flight_lane)
    if (auto it = g.lanes.find(*s.in_flight_lane); it != g.lanes.end())
      for (const Lane::InFlight& f : it->second.tokens)
        if (f.session == s.id) {
          from = std::max(f.started, s.gate->hold_charged_to);
          break;
        }
  return std::max<std::int64_t>(t - from, 0);
}

// An attached iteration that has held its lane past --attach-hold-limit while
// other sessions of the lane wait loses the lane: its grants leave the lane's
// in-flight list (the program runs on, time-sliced by the driver beside the
// others) and complete later without a token. Its hold so far is charged with
// its completion. Without it, one program that never came to a boundary, hung or
// hostile, would keep every other session of the lane waiting for ever.
void Broker::release_long_hold(Gpu& g, Session& s, TimeNs t, Deferred& later) {
  AttachedGate& gt = *s.gate;
  if (config_.attach_hold_limit_ns <= 0 || !s.in_flight_lane) return;
  auto it = g.lanes.find(*s.in_flight_lane);
  if (it == g.lanes.end()) return;
  Lane& lane = it->second;
  const auto first = std::find_if(lane.tokens.begin(), lane.tokens.end(),
                                  [&](const Lane::InFlight& f) { return f.session == s.id; });
  if (first == lane.tokens.end() || t - first->started < config_.attach_hold_limit_ns) return;
  const bool self_waits = gate_load(gt.g().requested) > gt.granted;
  if (g.sched.runnable_in_lane(it->first) <= (self_waits ? 1u : 0u)) return;  // nobody waits
  gt.released_hold_ns += static_cast<std::uint64_t>(lane_held_since_charged(g, s, t));
  gt.hold_charged_to = t;
  const auto mine = [&](const Lane::InFlight& f) { return f.session == s.id; };
  const auto released = static_cast<std::uint32_t>(std::erase_if(lane.tokens, mine));
  gt.released_in_flight += released;
  lane.in_flight = lane.in_flight > released ? lane.in_flight - released : 0;
  s.in_flight_lane.reset();
  ++gt.hold_releases;
  const std::string text = fmt::format(
      "iteration {} has held the lane for {} s (salusd --attach-hold-limit) while "
      "other sessions wait: they now run beside it, time-sliced by the driver, "
      "and it waits for its turn again at its next boundary",
      gt.completed_seen + 1, (t - first->started) / 1'000'000'000);
  log(s, text);
  // For the operator too: a program that stops stepping is often a hung job.
  spdlog::warn("session {} (pid {}): {}", s.dir_name, gt.pid, text);
  if (lane.in_flight == 0) {
    g.sched.arena().end_iteration(it->first, t);
    handle_admissions(g, later, false);
  }
  dispatch(g, later);
}

// The most device time a program's gate may have reported by `t`: its
// iterations run one after another on one GPU, so their event-timed spans add
// up to about the wall time since it attached; twice that and a second is room
// for spans that overlap. Past it the figure is a lie (or garbage): charging it
// would only cost the program itself, but summed into int64 device times it
// would wrap, and a wrapped FAIR virtual time ranks first for ever.
std::uint64_t Broker::device_time_ceiling(const AttachedGate& gt, TimeNs t) {
  const auto wall = static_cast<std::uint64_t>(std::max<TimeNs>(t - gt.attached_at, 0));
  const std::uint64_t room = 2 * wall + 1'000'000'000;
  const std::uint64_t base = gt.gpu_ns_at_attach;  // the program's figure: may be anything
  return base > UINT64_MAX - room ? UINT64_MAX : base + room;
}

void Broker::serve_gate(Gpu& g, Session& s, Deferred& later) {
  AttachedGate& gt = *s.gate;
  salus_gate& G = gt.g();
  // Completions, in order; a program cannot complete what was not granted.
  const std::uint64_t completed = std::min(gate_load(G.completed), gt.granted);
  if (completed > gt.completed_seen) {
    const std::uint64_t n = completed - gt.completed_seen;
    const TimeNs t = now();
    const std::uint64_t total = std::min(gate_load(G.gpu_ns_total), device_time_ceiling(gt, t));
    const std::uint64_t delta = total > gt.gpu_ns_seen ? total - gt.gpu_ns_seen : 0;
    gt.gpu_ns_seen = std::max(gt.gpu_ns_seen, total);
    gt.completed_seen = completed;
    // What the hold limit already measured, and, when this batch reaches grants
    // still on the lane, their hold up to now.
    std::uint64_t held = std::exchange(gt.released_hold_ns, 0);
    if (n > gt.released_in_flight) {
      held += static_cast<std::uint64_t>(lane_held_since_charged(g, s, t));
      gt.hold_charged_to = t;
    }
    s.lane_held_ns += static_cast<std::int64_t>(held);
    // The program reports device time per batch of completions: split evenly, as
    // is the lane time salusd measured. The policy is charged the larger: a
    // program that reported less than it held the lane would otherwise take more
    // than its share under fair, and rank first under srtf.
    auto share = [n](std::uint64_t sum, std::uint64_t i) {
      const std::uint64_t each = sum / n;
      return static_cast<std::int64_t>(
          std::min<std::uint64_t>(i + 1 == n ? each + sum % n : each, INT64_MAX / 2));
    };
    for (std::uint64_t i = 0; i < n && s.in_flight > 0; ++i) {
      const std::int64_t device_ns = share(delta, i);
      finish_grant(g, s, device_ns, std::max(device_ns, share(held, i)), true, later);
    }
  }
  const std::uint32_t seq = gate_load(G.note_seq);
  if (seq != gt.note_seq_seen) {
    gt.note_seq_seen = seq;
    log(s, "program: " + sanitize_note(G));
  }
  if (gt.swap_pending && gate_load(G.swap_done_seq) == gt.swap_seq) attached_swap_done(g, s);
  lane_serve(g, s);
  check_waiters(s, later);
  update_runnable(g, s);
}

void Broker::detach_gate(Session& s, Deferred& later, std::uint32_t state) {
  if (!s.gate) return;
  AttachedGate& gt = *s.gate;
  // salusd holds nothing of a swap (the copies are the program's own memory),
  // so a program gone in the middle of one leaves nothing behind here.
  if (gt.swap_pending)
    log(s, fmt::format("swap-{} unanswered: the program left the gate during it",
                       gt.swap_request == SALUS_SWAP_REQ_OUT ? "out" : "in"));
  gt.swap_pending = false;
  if (gt.swap_for_residency) {  // the residency bookkeeping ends as a failed swap
    gt.swap_error = ENOTCONN;
    if (Gpu* g = gpu_of(s)) attached_residency_done(*g, s);
  }
  lane_detach(s);
  ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_DEL, gt.bell.get(), nullptr);
  ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_DEL, gt.pidfd.get(), nullptr);
  gate_store(gt.g().state, state);
  gt.wake();
  // Its iterations in flight are the program's own now: the lane is free.
  if (Gpu* g = gpu_of(s)) {
    while (s.in_flight > 0) finish_grant(*g, s, 0, 0, false, later);
    kick(*g);
  }
  s.in_flight = 0;
  gt.exited = true;  // nothing more is read from the gate
  attached_.erase(s.id);
}

int Broker::request_attached_swap(Session& s, bool out) {
  if (!s.gate || s.gate->exited) return ENOTCONN;
  AttachedGate& gt = *s.gate;
  salus_gate& G = gt.g();
  if (gt.swap_pending) return EBUSY;  // one request at a time
  // Only at a boundary: the program's granted iterations have all completed.
  if (out && (s.in_flight > 0 || gt.granted > gate_load(G.completed))) return EBUSY;
  const std::uint32_t state = gate_load(G.swap_state);
  if (out && state == SALUS_SWAP_SWAPPED) return EALREADY;
  if (!out && state == SALUS_SWAP_RESIDENT) return EALREADY;
  gt.swap_request = out ? SALUS_SWAP_REQ_OUT : SALUS_SWAP_REQ_IN;
  gt.swap_pending = true;
  gt.swap_asked_at = now();
  gate_store(G.swap_request, gt.swap_request);
  gate_store(G.swap_seq, ++gt.swap_seq);  // after the request: the program reads seq first
  gt.wake();
  if (Gpu* g = gpu_of(s)) update_runnable(*g, s);  // not granted until the answer
  return 0;
}

void Broker::attached_swap_done(Gpu& g, Session& s) {
  AttachedGate& gt = *s.gate;
  salus_gate& G = gt.g();
  gt.swap_pending = false;
  const std::int32_t result = gate_load(G.swap_result);
  // A program may only report an errno (0 or -1..-4095); anything else is noise.
  gt.swap_error = result < 0 && result > -4096 ? -result : (result == 0 ? 0 : EIO);
  const char* what = gt.swap_request == SALUS_SWAP_REQ_OUT ? "out" : "in";
  const double took_ms = static_cast<double>(now() - gt.swap_asked_at) / 1e6;
  if (gt.swap_error == 0) {
    log(s, fmt::format("swap-{} done in {:.3f} ms: {} swapped, {} resident", what, took_ms,
                       arena::format_size(gate_load(G.swapped_bytes)),
                       arena::format_size(gate_load(G.resident_bytes))));
  } else {
    log(s, fmt::format("swap-{} failed: {} ({}); {}", what, strerrorname_np(gt.swap_error),
                       std::strerror(gt.swap_error),
                       gt.swap_error == ENOTSUP
                           ? "its memory is not movable (started without SALUS_SWAP=1)"
                           : "its memory stays where it was"));
  }
  // The residency decision (the oversub core) takes the answer from here: on
  // success the session's resident bytes are gate_load(G.resident_bytes); a
  // swapped session comes back at its next grant (grant_one needs nothing
  // more: the shim brings it back before the program runs). grant_one held
  // the session back while the swap-out was unanswered: dispatch again.
  if (gt.swap_for_residency) attached_residency_done(g, s);
  update_runnable(g, s);
  kick(g);
}

int Broker::admin_swap(const std::string& name, bool out, std::string& reply, std::string& why) {
  const auto id = find_session(name);
  if (!id) {
    why = fmt::format("no session {}", name);
    return ENOENT;
  }
  std::lock_guard lk(mu_);
  Session* s = get(*id);
  if (!s || s->dead) {
    why = fmt::format("no session {}", name);
    return ENOENT;
  }
  if (!s->gate || s->gate->exited) {
    why = fmt::format("session {} is not an attached program: only those swap on request", name);
    return ENOTCONN;
  }
  // Swapped out by the residency planner: its room on the GPU is not held, so
  // asking the program directly would put its memory back beside the resident
  // set. The planner brings it back when it fits (a prefetch, like any wanted one).
  Gpu* g = gpu_of(*s);
  if (!out && g && g->sched.arena().residency(s->id) == arena::Residency::swapped) {
    want_resident(*g, *s);
    log(*s, "swap-in asked by admin: the residency planner brings it back when it fits");
    reply += fmt::format("swap-in of {} queued: it comes back when the GPU has room\n", name);
    return 0;
  }
  const int err = request_attached_swap(*s, out);
  if (err != 0) {
    why = fmt::format("swap-{} of {} not asked: {}", out ? "out" : "in", name,
                      err == EBUSY      ? "an iteration or an earlier request is in flight"
                      : err == EALREADY ? "its memory is already there"
                                        : strerrorname_np(err));
    return err;
  }
  log(*s, fmt::format("swap-{} asked by admin", out ? "out" : "in"));
  reply += fmt::format("swap-{} of {} asked; see its status\n", out ? "out" : "in", name);
  return 0;
}

std::string Broker::outlives_its_program(Gpu& g, const Session& s) {
  // A program whose memory is swapped out leaves residency bookkeeping that a
  // new program could not answer: its session ends, as any other's.
  if (g.sched.arena().residency(s.id) == arena::Residency::swapped) return {};
  if (s.need.attached.value_or(false)) return "its creator ends it (kind=attached)";
  if (s.launcher_pidfd && !process_exited(s.launcher_pidfd.get()))
    return fmt::format("pid {}, the launcher it was taken over from, runs", s.launcher_pid);
  return {};
}

void Broker::gate_event(std::uint64_t key) {
  const SessionId id = key >> 1;
  const bool exited = key & 1;
  Deferred later;
  bool end = false;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || !s->gate || s->gate->exited) return;
    Gpu* g = gpu_of(*s);
    if (!g) return;
    if (!exited) {
      std::uint64_t rings = 0;
      while (::read(s->gate->bell.get(), &rings, sizeof rings) > 0) {
      }
    }
    serve_gate(*g, *s, later);
    const std::string stays = exited ? outlives_its_program(*g, *s) : std::string();
    if (!stays.empty()) {
      log(*s, fmt::format("the program (pid {}) exited; the session stays for the job's next "
                          "process to attach, as {}",
                          s->gate->pid, stays));
      detach_gate(*s, later);
      s->gate.reset();
    } else if (exited) {
      log(*s, fmt::format("the program (pid {}) exited; the session ends", s->gate->pid));
      detach_gate(*s, later);
      end = !s->dead;
    } else {
      // Grant right here rather than through the worker: one thread hop less.
      dispatch(*g, later);
    }
  }
  run_deferred(later);
  if (end) end_session(id);
}

// Once a second an attached program's driver figure (NVML) is compared with what
// admission counts for it: on the card, with its charge and the context reserve;
// swapped out, with what it said stays there.
void Broker::check_attached_contexts(const std::vector<GpuTelemetrySnapshot>& telemetry) {
  // NVML has one figure per process: a process attached to several sessions (a
  // test harness, an odd program) cannot be held to any one of them.
  std::vector<pid_t> pids;
  for (SessionId id : attached_)
    if (const Session* s = get(id); s && s->gate && !s->gate->exited) pids.push_back(s->gate->pid);
  std::sort(pids.begin(), pids.end());
  for (SessionId id : attached_) {
    Session* s = get(id);
    if (!s || !s->gate || s->gate->exited) continue;
    if (s->gpu < 0 || static_cast<std::size_t>(s->gpu) >= telemetry.size()) continue;
    const auto same = std::equal_range(pids.begin(), pids.end(), s->gate->pid);
    if (same.second - same.first > 1) continue;
    Gpu* g = gpu_of(*s);
    if (!g) continue;
    const std::optional<Bytes> used = process_gpu_bytes(s->gate->pid, &telemetry[s->gpu]);
    if (g->sched.arena().residency(s->id) == arena::Residency::swapped) {
      check_swapped_program(*g, *s, used);
    } else {
      s->gate->swapped_checks = s->gate->leftover_over = 0;
      check_context(*g, *s, used);
    }
  }
}

// The driver's figure less the charge is what the program's CUDA context and the
// rest outside the shim take, which admission counts as the context reserve.
// Past it, the card holds more than admission knows of; said once per session,
// with the figure to set.
void Broker::check_context(Gpu& g, Session& s, std::optional<Bytes> used) {
  AttachedGate& gt = *s.gate;
  // NVML's sample is up to a second old: compare it with the larger charge of
  // this check and the last, so that memory freed since is not taken for context.
  const std::uint64_t now_charged = gate_load(gt.g().charged_bytes);
  const std::uint64_t charged = std::max(now_charged, gt.charged_at_check);
  gt.charged_at_check = now_charged;
  if (!used || *used <= charged) {
    gt.context_over = 0;
    gt.context_last = 0;
    return;
  }
  gt.context_seen = std::max<std::uint64_t>(gt.context_seen, *used - charged);
  g.context_measured = std::max<Bytes>(g.context_measured, gt.context_seen);
  learn_context(g, std::min<std::uint64_t>(gt.context_last, *used - charged));
  gt.context_last = *used - charged;
  const Bytes reserve = context_of(s);  // as admitted (possibly cut)
  if (*used - charged <= reserve) {
    gt.context_over = 0;
    return;
  }
  if (++gt.context_over < 2) return;
  // A kill must not rest on a sample taken between an allocation and its free:
  // the program's highest charge ever bounds what the shim let it hold.
  const std::uint64_t peak = std::max(charged, gate_load(gt.g().peak_bytes));
  if (kill_overrun(s, *used, peak + reserve) || gt.context_warned) return;
  gt.context_warned = true;
  const std::string text = fmt::format(
      "warning: the driver counts {} on gpu {} for pid {}, {} more than its charged {}: "
      "its CUDA context and memory outside the shim take more than the {} admission "
      "counts for them (--attach-context-reserve); the card may run out before the "
      "budgets do",
      arena::format_size(*used), s.gpu, gt.pid, arena::format_size(*used - charged),
      arena::format_size(charged), arena::format_size(reserve));
  log(s, text);
  spdlog::warn("session {}: {}", s.id, text);
}

// The program's pidfd names it however its pid is reused; the exit it causes
// ends the session as any exit does (gate_event).
bool Broker::kill_overrun(Session& s, Bytes used, Bytes counted) {
  AttachedGate& gt = *s.gate;
  if (!config_.attach_overrun_kill || used <= counted + kDriverFigureSlack) return false;
  if (gt.overrun_killed) return true;
  gt.overrun_killed = true;
  overrun_kill(s, gt.pidfd.get(), gt.pid,
               fmt::format("the driver counts {} on gpu {} for it, past the {} admission counts "
                           "for it",
                           arena::format_size(used), s.gpu, arena::format_size(counted)));
  return true;
}

void Broker::overrun_kill(Session& s, int pidfd, pid_t pid, const std::string& why) {
  const bool sent = ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0) == 0;
  const std::string text =
      fmt::format("{} pid {} (--attach-overrun kill): {}{}", sent ? "killed" : "could not kill",
                  pid, why, sent ? "" : fmt::format(": {}", std::strerror(errno)));
  log(s, text);
  spdlog::warn("session {}: {}", s.id, text);
}

void Broker::gate_tick() {
  Deferred later;
  {
    std::lock_guard lk(mu_);
    ++gate_ticks_;
    const TimeNs t = now();
    for (auto& g : gpus_) lane_tick(*g, t);
    for (SessionId id : attached_) tick_attached(id, t, later);
    if (gate_ticks_ % kIdleWatchTicks == 0)
      for (auto& g : gpus_) watch_idle(*g, t);
  }
  run_deferred(later);
}

// One attached session's share of the gate tick: its heartbeat, the hold limit,
// and the slice of an unmarked program.
void Broker::tick_attached(SessionId id, TimeNs t, Deferred& later) {
  Session* sp = get(id);
  if (!sp || !sp->gate || sp->gate->exited) return;
  Session& s = *sp;
  AttachedGate& gt = *s.gate;
  salus_gate& G = gt.g();
  std::atomic_ref<std::uint64_t>(G.heartbeat).fetch_add(1, std::memory_order_relaxed);
  Gpu* g = gpu_of(s);
  if (!g) return;
  release_long_hold(*g, s, t, later);
  // The fallback for unmarked programs: a slice of quantum_ns (wall time: the
  // device time of a running iteration is not reported before its boundary).
  if (gate_load(G.marking) == SALUS_MARK_EXPLICIT || s.in_flight == 0 || !s.in_flight_lane) return;
  if (gate_load(G.requested) > gt.granted || gate_load(G.yield_requested) != 0) return;
  if (g->sched.runnable_in_lane(*s.in_flight_lane) == 0) return;
  if (t - gt.granted_at < config_.quantum_ns) return;
  gate_store(G.yield_requested, 1u);
  ++gt.yields;
}

void Broker::gate_loop() {
  epoll_event events[64];
  for (;;) {
    const int n = ::epoll_wait(gate_epoll_.get(), events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("gate service: epoll_wait: {}", std::strerror(errno));
      return;
    }
    for (int i = 0; i < n; ++i) {
      const std::uint64_t key = events[i].data.u64;
      if (key == kStopKey) return;
      try {
        if (key == kTimerKey) {
          std::uint64_t expirations = 0;
          if (::read(gate_timer_.get(), &expirations, sizeof expirations) < 0) continue;
          gate_tick();
        } else {
          gate_event(key);
        }
      } catch (const std::exception& e) {
        spdlog::error("gate service: {}", e.what());
      } catch (...) {
        spdlog::error("gate service: a non-standard exception");
      }
    }
  }
}

void Broker::start_gate_service() {
  gate_epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  gate_timer_.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  gate_stop_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!gate_epoll_ || !gate_timer_ || !gate_stop_)
    throw std::runtime_error(fmt::format("gate service: {}", std::strerror(errno)));
  itimerspec period{};
  period.it_interval.tv_nsec = kTickNs;
  period.it_value.tv_nsec = kTickNs;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kTimerKey;
  bool ok = ::timerfd_settime(gate_timer_.get(), 0, &period, nullptr) == 0 &&
            ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_ADD, gate_timer_.get(), &ev) == 0;
  ev.data.u64 = kStopKey;
  ok = ok && ::epoll_ctl(gate_epoll_.get(), EPOLL_CTL_ADD, gate_stop_.get(), &ev) == 0;
  if (!ok) throw std::runtime_error(fmt::format("gate service: {}", std::strerror(errno)));
  gate_thread_ = std::thread([this] { gate_loop(); });
  if (telemetry_) census_thread_ = std::thread([this] { census_loop(); });
}

void Broker::stop_gate_service() {
  if (census_thread_.joinable()) {
    {
      std::lock_guard lk(census_mu_);
      census_stop_ = true;
    }
    census_cv_.notify_one();
    census_thread_.join();
  }
  if (!gate_thread_.joinable()) return;
  const std::uint64_t one = 1;
  if (::write(gate_stop_.get(), &one, sizeof one) < 0)
    spdlog::error("gate service: cannot signal stop: {}", std::strerror(errno));
  gate_thread_.join();
}

}  // namespace salus::vgpu
