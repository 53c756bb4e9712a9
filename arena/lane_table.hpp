// The lanes of one GPU: which sessions share each lane, each lane's size (the largest
// ephemeral need among its members), and where each lane sits in memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "arena/space_map.hpp"

namespace salus::arena {

struct LaneMember {
  SessionId session = 0;
  Bytes ephemeral = 0;  // aligned
};

struct Lane {
  LaneId id = 0;
  // Max ephemeral of the members (0 once empty); while busy, at least `kept`.
  Bytes size = 0;
  std::vector<LaneMember> members;  // admission order
  // Physical state. `held` bytes at `offset` belong to the lane; they differ from
  // [target, target + size) only while a busy lane waits for its boundary.
  std::optional<Bytes> offset;
  Bytes held = 0;
  Bytes target = 0;                  // where the compact layout puts it
  std::optional<Bytes> last_offset;  // where it last sat, to count moves
  bool busy = false;
  // What a busy lane keeps until its boundary for members that left it by a need
  // change (their work may still run in it); 0 when idle.
  Bytes kept = 0;
  std::optional<SessionId> running;
  Bytes used = 0;

  bool in_place() const { return offset && *offset == target && held == size; }
  bool has_member(SessionId s) const;
};

class LaneTable {
 public:
  // Lane region layout order is lane id order, i.e. creation order: new lanes go on top.
  LaneId open(SessionId session, Bytes ephemeral);
  // Adds a member whose need fits the lane.
  void join(LaneId lane, SessionId session, Bytes ephemeral);
  // Adds a member whose need is larger than the lane: the lane grows to it in place,
  // so every lane above it shifts up.
  void grow(LaneId lane, SessionId session, Bytes ephemeral);
  // Drops a member; the lane shrinks to its remaining largest need (0 when empty; an
  // empty lane is deleted by settle once it is idle). With keep_until_boundary (the
  // member's own work may still run there), a busy lane shrinks only at its boundary
  // (end). False if it was not a member.
  bool remove_member(LaneId lane, SessionId session, bool keep_until_boundary = false);

  // Algorithm 1, step 2: the smallest lane with size >= e; ties go to the lane with fewer
  // members, then the lower id. Lanes without members are never offered.
  const Lane* best_match(Bytes e) const;
  // Algorithm 1, step 3: the smallest lane with size >= min_size (same tie-breaks).
  const Lane* smallest_at_least(Bytes min_size) const;

  Bytes total() const { return total_; }
  // The largest lane with members (0 if none).
  Bytes largest() const { return index_.empty() ? 0 : std::get<0>(*index_.rbegin()); }
  std::size_t count() const { return lanes_.size(); }
  const Lane* find(LaneId lane) const;
  const std::map<LaneId, Lane>& all() const { return lanes_; }
  std::size_t indexed() const { return index_.size(); }

  // ---- Iterations ----
  // An iteration may start: placed where the layout wants it at its full size.
  bool ready(LaneId lane) const;
  bool begin(LaneId lane, SessionId session, Bytes used);
  bool end(LaneId lane);
  // A busy lane moved on to `session`'s iteration, queued behind the running one.
  void now_running(LaneId lane, SessionId session);

  // ---- Physical layout ----
  struct SettleResult {
    bool released = false;  // some lane gave bytes back: room may have appeared
    std::uint32_t moved = 0;
    std::uint32_t deleted = 0;
  };
  // Brings the physical layout as close to the compact one as busy lanes allow: deletes
  // idle empty lanes, gives back the space of idle lanes that are not in place, and puts
  // every idle unplaced lane whose target is free there. Busy lanes never move.
  SettleResult settle(SpaceMap& space);
  // Free space appeared outside the lanes (a persistent buffer went away).
  void mark_dirty() { dirty_ = true; }
  bool dirty() const { return dirty_; }

 private:
  using Key = std::tuple<Bytes, std::size_t, LaneId>;  // (size, members, id)
  static Key key(const Lane& l) { return {l.size, l.members.size(), l.id}; }
  void unindex(const Lane& l);
  void index(const Lane& l);
  void resize(Lane& l);  // size and total_ after the members or the busy state changed

  std::map<LaneId, Lane> lanes_;
  std::set<Key> index_;  // lanes with members
  Bytes total_ = 0;
  LaneId next_id_ = 1;
  bool dirty_ = false;
};

}  // namespace salus::arena
