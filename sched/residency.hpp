// Oversubscription's residency planner: which admitted sessions of one GPU keep their
// persistent memory on the card, who is swapped out to make room for whom, and what a
// swap costs. One GPU may admit sessions whose needs add up to more than its memory
// (ArenaOptions::oversubscribe); only the resident set must fit. Swaps happen at
// iteration boundaries, so memory moves in bulk ahead of a session's turn.
//
// The cost model is measured (bytes / measured bandwidth) and bounds thrashing: a
// session swapped in stays resident for at least a quantum in which its swap time is
// at most `max_swap_share` of GPU time. Pure and clock-injected: salusd's broker and
// salus-sim make the same decisions from the same calls (design.md, "Oversubscription").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "arena/gpu_arena.hpp"

namespace salus::sched {

using arena::Bytes;
using arena::SessionId;
using arena::TimeNs;

// Who timed a swap: salusd, copying a hosted session's buffers itself, or an
// attached program, whose gate reports the bytes it moved and whose answer
// salusd times. A program may lie in either, so its report moves the GPU's
// estimate at most 2x either way (else one program could set every session's
// quantum: an instant answer makes swaps look free and everyone thrash).
enum class SwapSource : std::uint8_t { measured, reported };

struct SwapCostModel {
  // Measured host<->device swap bandwidth, bytes per second, averaged (EWMA). Starts at
  // a PCIe-4 x16-like prior until the first swap is measured.
  double bytes_per_s = 12.0e9;
  std::uint64_t measured = 0;  // swaps that fed the average
  // Swap time (out and back in) at most this share of the GPU time between swaps.
  double max_swap_share = 0.10;
  TimeNs min_quantum_ns = 50'000'000;  // floor, so tiny sessions do not ping-pong

  // Time to move `bytes` one way.
  TimeNs swap_ns(Bytes bytes) const;
  // How long a session holding `bytes` stays resident once swapped in, at least.
  TimeNs quantum_ns(Bytes bytes) const;
  void observe(Bytes bytes, TimeNs ns, SwapSource source = SwapSource::measured);
};

struct ResidencyStats {
  std::uint64_t swaps_out = 0;
  std::uint64_t swaps_in = 0;
  TimeNs swap_ns = 0;  // time spent in swaps, both ways
  Bytes bytes_out = 0;
  Bytes bytes_in = 0;
};

struct SessionResidency {
  TimeNs resident_since = 0;  // when it last became resident (admission or swap-in)
  TimeNs last_ran = 0;        // last dispatch
  bool evicting = false;      // chosen to leave: not dispatched until it is out
  bool swapping = false;      // a swap of its memory is in progress (either way)
  TimeNs step_since = 0;      // when it was chosen to leave, or its swap started
  ResidencyStats stats;
};

// What the caller must start now.
struct ResidencyPlan {
  std::vector<SessionId> swap_out;   // resident victims; swap each out once idle
  std::optional<SessionId> swap_in;  // a swapped session that fits now
};

class ResidencyPlanner {
 public:
  SwapCostModel& cost() { return cost_; }
  const SwapCostModel& cost() const { return cost_; }

  void add(SessionId id, TimeNs now);
  void remove(SessionId id);
  void ran(SessionId id, TimeNs now);
  bool evicting(SessionId id) const;
  const SessionResidency* find(SessionId id) const;
  const ResidencyStats& totals() const { return totals_; }
  // Off: a resident session may be chosen as a victim however recently it came
  // in. For salusd's stop, when the save of named sessions must bring each one
  // in once and thrashing no longer costs anything that matters. On by default.
  void set_quanta(bool on) { quanta_ = on; }
  // How long the plan waits for a chosen swap to land before it goes on around it
  // (see plan). 30 s by default, salusd's --attach-hold-limit default.
  void set_stuck_after(TimeNs ns) { stuck_after_ = ns; }
  TimeNs stuck_after() const { return stuck_after_; }

  // The swap the caller started at `now` (`swapping` until swap_*_done).
  void swap_started(SessionId id, TimeNs now);
  // A swap finished after `ns`, moving `bytes`: counted and fed to the cost model.
  void swap_out_done(SessionId id, Bytes bytes, TimeNs ns, TimeNs now, bool ok,
                     SwapSource source = SwapSource::measured);
  void swap_in_done(SessionId id, Bytes bytes, TimeNs ns, TimeNs now,
                    SwapSource source = SwapSource::measured);

  // The decision. `wanted`: swapped sessions that a lane would run next, best first.
  // `swappable(id)`: whether that resident session's kind can be swapped at all (an
  // attached program without a movable-memory path cannot). A swapped session that
  // fits is swapped in; otherwise resident sessions whose quantum is over are chosen,
  // least recently run first, until it would fit. Nothing is chosen while earlier
  // victims are still leaving (for stuck_after() at most: a victim that does not
  // come to its boundary must not stop every swap), and a session that cannot be
  // made to fit yet waits: the ones behind it do not overtake it (no starvation by
  // smaller sessions), unless no ending quantum could make it fit (then the next
  // wanted one that can comes in).
  ResidencyPlan plan(const arena::GpuArena& arena, const std::vector<SessionId>& wanted,
                     const std::function<bool(SessionId)>& swappable, TimeNs now);

 private:
  // Victims for `need` more resident bytes, or empty when there are not enough (with
  // `quanta`: whose quanta are over).
  std::vector<SessionId> victims(const arena::GpuArena& arena, Bytes need, SessionId keep,
                                 const std::function<bool(SessionId)>& swappable, TimeNs now,
                                 bool quanta) const;

  SwapCostModel cost_;
  std::unordered_map<SessionId, SessionResidency> sessions_;
  ResidencyStats totals_;
  bool quanta_ = true;
  TimeNs stuck_after_ = 30'000'000'000;
};

}  // namespace salus::sched
