#include "sched/residency.hpp"

#include <algorithm>
#include <cmath>

namespace salus::sched {

TimeNs SwapCostModel::swap_ns(Bytes bytes) const {
  const double bw = bytes_per_s > 1.0 ? bytes_per_s : 1.0;
  return static_cast<TimeNs>(std::ceil(static_cast<double>(bytes) / bw * 1e9));
}

TimeNs SwapCostModel::quantum_ns(Bytes bytes) const {
  // Out and back in: the whole price of one eviction of this session.
  const double share = max_swap_share > 0.0 ? max_swap_share : 0.10;
  const double q = static_cast<double>(2 * swap_ns(bytes)) / share;
  return std::max(min_quantum_ns, static_cast<TimeNs>(std::min(q, 9.0e18)));
}

void SwapCostModel::observe(Bytes bytes, TimeNs ns, SwapSource source) {
  // Small swaps are dominated by fixed latency and would understate the bandwidth.
  if (bytes < (Bytes{1} << 20) || ns <= 0) return;
  double bw = static_cast<double>(bytes) / (static_cast<double>(ns) / 1e9);
  if (source == SwapSource::reported && bytes_per_s > 1.0)
    bw = std::clamp(bw, bytes_per_s / 2, bytes_per_s * 2);
  bytes_per_s = measured == 0 ? bw : 0.75 * bytes_per_s + 0.25 * bw;
  ++measured;
}

void ResidencyPlanner::add(SessionId id, TimeNs now) {
  SessionResidency& r = sessions_[id];
  r.resident_since = now;
  r.last_ran = now;
}

void ResidencyPlanner::remove(SessionId id) {
  sessions_.erase(id);
}

void ResidencyPlanner::ran(SessionId id, TimeNs now) {
  if (auto it = sessions_.find(id); it != sessions_.end()) it->second.last_ran = now;
}

bool ResidencyPlanner::evicting(SessionId id) const {
  auto it = sessions_.find(id);
  return it != sessions_.end() && it->second.evicting;
}

const SessionResidency* ResidencyPlanner::find(SessionId id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

void ResidencyPlanner::swap_started(SessionId id, TimeNs now) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionResidency& r = it->second;
  r.swapping = true;
  // A victim's wait counts from when the plan chose it; any other swap's from now.
  if (!r.evicting) r.step_since = now;
}

void ResidencyPlanner::swap_out_done(SessionId id, Bytes bytes, TimeNs ns, TimeNs now, bool ok,
                                     SwapSource source) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionResidency& r = it->second;
  r.swapping = false;
  r.evicting = false;
  if (!ok) {
    r.resident_since = now;  // stays resident: do not choose it again at once
    return;
  }
  ++r.stats.swaps_out;
  r.stats.swap_ns += ns;
  r.stats.bytes_out += bytes;
  ++totals_.swaps_out;
  totals_.swap_ns += ns;
  totals_.bytes_out += bytes;
  cost_.observe(bytes, ns, source);
}

void ResidencyPlanner::swap_in_done(SessionId id, Bytes bytes, TimeNs ns, TimeNs now,
                                    SwapSource source) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionResidency& r = it->second;
  r.swapping = false;
  r.resident_since = now;
  ++r.stats.swaps_in;
  r.stats.swap_ns += ns;
  r.stats.bytes_in += bytes;
  ++totals_.swaps_in;
  totals_.swap_ns += ns;
  totals_.bytes_in += bytes;
  cost_.observe(bytes, ns, source);
}

std::vector<SessionId> ResidencyPlanner::victims(const arena::GpuArena& arena, Bytes need,
                                                 SessionId keep,
                                                 const std::function<bool(SessionId)>& swappable,
                                                 TimeNs now, bool quanta) const {
  struct Candidate {
    TimeNs last_ran;
    SessionId id;
    Bytes bytes;
  };
  std::vector<Candidate> cands;
  for (const auto& [id, r] : sessions_) {
    if (id == keep || r.swapping || r.evicting) continue;
    if (arena.residency(id) != arena::Residency::resident) continue;
    const auto p = arena.placement(id);
    if (!p || !p->admitted) continue;
    const Bytes bytes = arena.swap_in_bytes(id);
    if (bytes == 0) continue;  // holds nothing: evicting it frees nothing
    if (quanta && now - r.resident_since < cost_.quantum_ns(bytes)) continue;
    if (!swappable(id)) continue;
    cands.push_back({r.last_ran, id, bytes});
  }
  std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
    return a.last_ran != b.last_ran ? a.last_ran < b.last_ran : a.id < b.id;
  });
  std::vector<SessionId> out;
  Bytes freed = 0;
  for (const Candidate& c : cands) {
    if (freed >= need) break;
    out.push_back(c.id);
    freed += c.bytes;
  }
  if (freed < need) out.clear();
  return out;
}

ResidencyPlan ResidencyPlanner::plan(const arena::GpuArena& arena,
                                     const std::vector<SessionId>& wanted,
                                     const std::function<bool(SessionId)>& swappable, TimeNs now) {
  ResidencyPlan out;
  // One step at a time: let the swaps under way land first, but not for ever. A
  // victim is asked to leave at its iteration boundary, and an attached program that
  // does not come to one (a notebook gone idle after a cell, a hung collective, a
  // hostile program) would otherwise stop every swap on the GPU for everyone. Past
  // stuck_after_ the plan goes on around it: it stays chosen, and its bytes count as
  // held until they are out, so the room below is still exact.
  for (const auto& [id, r] : sessions_)
    if ((r.evicting || r.swapping) && now - r.step_since < stuck_after_) return out;
  auto evict = [&](const std::vector<SessionId>& victims) {
    for (SessionId v : victims) {
      sessions_[v].evicting = true;
      sessions_[v].step_since = now;
    }
  };
  const Bytes room = arena.resident_room();
  // A lane that waits for physical room (an admission) is served like a wanted session.
  if (const Bytes lane = arena.lane_room_wanted(); lane > room) {
    out.swap_out = victims(arena, lane - room, 0, swappable, now, quanta_);
    evict(out.swap_out);
    if (!out.swap_out.empty()) return out;
  }
  for (SessionId w : wanted) {
    if (arena.residency(w) != arena::Residency::swapped) continue;
    const Bytes need = arena.swap_in_bytes(w);
    if (need <= room) {
      out.swap_in = w;
      return out;
    }
    out.swap_out = victims(arena, need - room, w, swappable, now, quanta_);
    evict(out.swap_out);
    // The first wanted session waits for its room and nobody overtakes it, so that
    // small sessions do not starve a large one; but only while quanta ending can
    // make that room. When even every resident, swappable session would not (the
    // others are swapped out too, or cannot be swapped), waiting changes nothing and
    // may hold the GPU idle: the next wanted session that can come in does, and once
    // resident it is a victim that can make the room.
    if (!out.swap_out.empty() || !victims(arena, need - room, w, swappable, now, false).empty())
      return out;
  }
  return out;
}

}  // namespace salus::sched
