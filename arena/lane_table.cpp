#include "arena/lane_table.hpp"

#include <algorithm>

namespace salus::arena {

bool Lane::has_member(SessionId s) const {
  return std::any_of(members.begin(), members.end(),
                     [s](const LaneMember& m) { return m.session == s; });
}

void LaneTable::unindex(const Lane& l) {
  if (!l.members.empty()) index_.erase(key(l));
}

void LaneTable::index(const Lane& l) {
  if (!l.members.empty()) index_.insert(key(l));
}

LaneId LaneTable::open(SessionId session, Bytes ephemeral) {
  const LaneId id = next_id_++;
  Lane& l = lanes_[id];
  l.id = id;
  l.size = ephemeral;
  l.members.push_back({session, ephemeral});
  total_ += ephemeral;
  index(l);
  dirty_ = true;
  return id;
}

void LaneTable::join(LaneId lane, SessionId session, Bytes ephemeral) {
  Lane& l = lanes_.at(lane);
  unindex(l);
  l.members.push_back({session, ephemeral});
  if (ephemeral > l.size) {
    total_ += ephemeral - l.size;
    l.size = ephemeral;
    dirty_ = true;
  }
  index(l);
}

void LaneTable::grow(LaneId lane, SessionId session, Bytes ephemeral) {
  join(lane, session, ephemeral);
}

bool LaneTable::remove_member(LaneId lane, SessionId session, bool keep_until_boundary) {
  auto it = lanes_.find(lane);
  if (it == lanes_.end()) return false;
  Lane& l = it->second;
  auto m = std::find_if(l.members.begin(), l.members.end(),
                        [session](const LaneMember& x) { return x.session == session; });
  if (m == l.members.end()) return false;
  unindex(l);
  l.members.erase(m);
  // Its size as counted now, never more: the lane sum must not grow without admission.
  if (keep_until_boundary && l.busy) l.kept = std::max(l.kept, l.size);
  resize(l);
  index(l);
  dirty_ = true;
  return true;
}

void LaneTable::resize(Lane& l) {
  Bytes size = 0;
  for (const LaneMember& x : l.members) size = std::max(size, x.ephemeral);
  // Work of a member that left by a need change may still run in the lane until its
  // boundary: the lane keeps those bytes until then, so the lane sum of the safety
  // condition counts them and lanes opened meanwhile go above, into free space.
  if (l.busy) size = std::max(size, l.kept);
  total_ = total_ - l.size + size;
  l.size = size;
}

const Lane* LaneTable::best_match(Bytes e) const {
  auto it = index_.lower_bound({e, 0, 0});
  return it == index_.end() ? nullptr : &lanes_.at(std::get<2>(*it));
}

const Lane* LaneTable::smallest_at_least(Bytes min_size) const {
  return best_match(min_size);
}

const Lane* LaneTable::find(LaneId lane) const {
  auto it = lanes_.find(lane);
  return it == lanes_.end() ? nullptr : &it->second;
}

bool LaneTable::ready(LaneId lane) const {
  const Lane* l = find(lane);
  return l && l->in_place();
}

bool LaneTable::begin(LaneId lane, SessionId session, Bytes used) {
  auto it = lanes_.find(lane);
  if (it == lanes_.end()) return false;
  Lane& l = it->second;
  if (l.busy || !l.in_place() || used > l.size || !l.has_member(session)) return false;
  l.busy = true;
  l.running = session;
  l.used = used;
  return true;
}

void LaneTable::now_running(LaneId lane, SessionId session) {
  auto it = lanes_.find(lane);
  if (it != lanes_.end() && it->second.busy) it->second.running = session;
}

bool LaneTable::end(LaneId lane) {
  auto it = lanes_.find(lane);
  if (it == lanes_.end() || !it->second.busy) return false;
  Lane& l = it->second;
  l.busy = false;
  l.running.reset();
  l.used = 0;
  l.kept = 0;
  unindex(l);
  resize(l);  // members that left while it ran give their bytes back now
  index(l);
  dirty_ = true;
  return true;
}

LaneTable::SettleResult LaneTable::settle(SpaceMap& space) {
  SettleResult r;
  if (!dirty_) return r;
  dirty_ = false;
  for (auto it = lanes_.begin(); it != lanes_.end();) {
    Lane& l = it->second;
    if (!l.members.empty() || l.busy) {
      ++it;
      continue;
    }
    if (l.offset) space.give(*l.offset, *l.offset + l.held);
    r.released = true;
    ++r.deleted;
    it = lanes_.erase(it);
  }
  Bytes target = 0;
  for (auto& [id, l] : lanes_) {
    l.target = target;
    target += l.size;
  }
  // Release first, place second: an idle lane may move into space that another idle
  // lane is leaving in the same settle.
  for (auto& [id, l] : lanes_) {
    if (l.busy || !l.offset || l.in_place()) continue;
    space.give(*l.offset, *l.offset + l.held);
    l.offset.reset();
    l.held = 0;
    r.released = true;
  }
  for (auto& [id, l] : lanes_) {
    if (l.busy || l.offset) continue;
    if (!space.take(l.target, l.target + l.size)) continue;  // waits for room
    l.offset = l.target;
    l.held = l.size;
    if (l.last_offset && *l.last_offset != l.target) ++r.moved;
    l.last_offset = l.target;
  }
  return r;
}

}  // namespace salus::arena
