// A GPU idle while sessions wait for it: time the card could have worked and
// did not. It is counted per GPU (gpus/N/info, salus_gpu_idle_waiting_seconds_total)
// and an episode longer than --idle-warn is reported once, in salusd's log and
// in each waiting session's, with why each waits and what holds the memory.
//
// Most episodes have a cause an admin can act on: admitted sessions that hold
// their memory and run nothing (an idle notebook, a job between phases) while
// others wait for admission, or a FIFO front session that holds the GPU
// without work. An episode with sessions runnable and resident and nothing
// else explaining it is a scheduler stall, which salus-sim stops on as a bug;
// salusd says so instead of staying silent.
//
// Sessions waiting host-wide (gpu=any, bound to no GPU yet) count as waiting
// for every idle GPU they could fit.
//
// Sampled from the gate tick every kIdleWatchTicks (250 ms): one pass over the
// sessions, never on a dispatch path.
#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {

// Admitted sessions named as holding memory in a report, the largest first.
constexpr std::size_t kHoldersShown = 5;

double seconds(std::int64_t ns) {
  return static_cast<double>(ns) / 1e9;
}

}  // namespace

bool Broker::gpu_working(const Gpu& g) const {
  // Iterations in flight, or memory on the move (swaps, compaction, the
  // arena's backing, the shared lane made or cleared): the card is busy, or
  // about to be, for the sessions that wait.
  if (!g.swap_jobs.empty() || !g.move_tokens.empty() || g.backing_busy || g.shared_lane.busy)
    return true;
  for (const auto& [id, sp] : sessions_) {
    const Session& s = *sp;
    if (s.gpu != static_cast<int>(g.index) || s.dead) continue;
    if (s.in_flight > 0 || s.swapping || (s.gate && s.gate->swap_pending)) return true;
  }
  return false;
}

std::vector<std::pair<Session*, std::string>> Broker::idle_waiters(const Gpu& g) {
  std::vector<std::pair<Session*, std::string>> out;
  const auto m = g.sched.arena().memory();
  const DeviceHealth health = g.device->health();
  for (auto& [id, sp] : sessions_) {
    Session& s = *sp;
    if (s.gpu != static_cast<int>(g.index) || s.dead) continue;
    if (s.state == SessionState::queued) {
      out.emplace_back(
          &s, fmt::format("waits for admission: needs {} + {}, {} free",
                          arena::format_size(s.need.persistent),
                          arena::format_size(s.need.ephemeral), arena::format_size(m.free)));
      continue;
    }
    if (std::find(g.alloc_waiters.begin(), g.alloc_waiters.end(), s.id) != g.alloc_waiters.end()) {
      out.emplace_back(&s, "waits for room for an alloc (no hole is big enough yet)");
      continue;
    }
    const sched::SessionSched* ss = g.sched.find(s.id);
    if (s.state != SessionState::admitted || !ss || !ss->runnable) continue;
    if (!health.usable)
      out.emplace_back(
          &s, fmt::format("is runnable on a GPU out of service ({})", health.unusable_why));
    else if (g.sched.arena().residency(s.id) != arena::Residency::resident)
      out.emplace_back(&s, "is runnable and swapped out, waiting to be swapped in");
    else
      out.emplace_back(&s, fmt::format("is runnable and resident but was not dispatched under "
                                       "{} (a scheduler stall: please report it with this "
                                       "log)",
                                       sched::to_string(g.sched.policy())));
  }
  add_host_waiters(g, out);
  return out;
}

// Sessions opened with gpu=any that no GPU has taken yet wait for this one too,
// if they could ever fit it: memory that idle holders keep here is what stops
// them, and this GPU's idle time is what they lose.
void Broker::add_host_waiters(const Gpu& g, std::vector<std::pair<Session*, std::string>>& out) {
  const auto m = g.sched.arena().memory();
  host_queue_.for_each([&](const arena::QueuedRequest& q) {
    Session* s = get(q.session);
    if (!s || s->dead || s->need.persistent + s->need.ephemeral > m.capacity) return;
    out.emplace_back(
        s, fmt::format("waits for a GPU (gpu=any, no GPU has taken it yet): needs "
                       "{} + {}, gpu {} has {} free",
                       arena::format_size(s->need.persistent),
                       arena::format_size(s->need.ephemeral), g.index, arena::format_size(m.free)));
  });
}

void Broker::warn_idle(const Gpu& g, TimeNs idle_ns,
                       const std::vector<std::pair<Session*, std::string>>& waiting) {
  // What holds the card: admitted sessions that run nothing now.
  std::vector<const Session*> holders;
  for (const auto& [id, sp] : sessions_) {
    const Session& s = *sp;
    const sched::SessionSched* ss = g.sched.find(s.id);
    if (s.gpu == static_cast<int>(g.index) && !s.dead && s.state == SessionState::admitted &&
        s.in_flight == 0 && !(ss && ss->runnable))
      holders.push_back(&s);
  }
  const auto held = [](const Session* s) { return s->need.persistent + s->need.ephemeral; };
  std::sort(holders.begin(), holders.end(),
            [&](const Session* a, const Session* b) { return held(a) > held(b); });
  std::string idle_holders;
  for (std::size_t i = 0; i < holders.size() && i < kHoldersShown; ++i)
    idle_holders += fmt::format("{}session {} (uid {}, {})", i ? ", " : "", holders[i]->id,
                                holders[i]->uid, arena::format_size(held(holders[i])));
  if (holders.size() > kHoldersShown)
    idle_holders += fmt::format(" and {} more", holders.size() - kHoldersShown);
  const std::string held_by = holders.empty()
                                  ? "no admitted session is idle"
                                  : fmt::format("admitted and running nothing: {}", idle_holders);
  spdlog::warn("gpu {} has been idle for {:.1f} s while {} session(s) wait for it; {}", g.index,
               seconds(idle_ns), waiting.size(), held_by);
  for (const auto& [s, why] : waiting) {
    spdlog::warn("gpu {}: session {} (uid {}) {}", g.index, s->id, s->uid, why);
    log(*s, fmt::format("gpu {} has been idle for {:.1f} s while this session {}; {} (salusd "
                        "--idle-warn)",
                        g.index, seconds(idle_ns), why, held_by));
  }
}

void Broker::watch_idle(Gpu& g, TimeNs t) {
  const TimeNs last = g.idle_watched_at;
  g.idle_watched_at = t;
  std::vector<std::pair<Session*, std::string>> waiting;
  if (!gpu_working(g)) waiting = idle_waiters(g);
  if (waiting.empty()) {
    g.idle_waiting_since = 0;
    g.idle_warned = false;
    return;
  }
  if (g.idle_waiting_since == 0) {
    g.idle_waiting_since = t;
    return;
  }
  g.idle_waiting_ns += t - last;
  const std::int64_t idle = t - g.idle_waiting_since;
  if (g.idle_warned || config_.idle_warn_ns <= 0 || idle < config_.idle_warn_ns) return;
  g.idle_warned = true;
  ++g.idle_warnings;
  warn_idle(g, idle, waiting);
}

}  // namespace salus::vgpu
