// Persistent buffers of one GPU: best-fit placement growing down from the top, and the
// compaction plans that move them aside when holes between them block lanes or allocations.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "arena/space_map.hpp"

namespace salus::arena {

struct PersistentBuffer {
  BufferHandle handle = 0;
  SessionId owner = 0;
  Bytes offset = 0;
  Bytes size = 0;
  std::optional<Bytes> move_to;  // the copy handed to the owner and not finished yet
  // A two-step move: once at move_to (a staging place), the buffer goes here next.
  std::optional<Bytes> then_to;
  // Ranges held for its moves, besides its own [offset, offset + size).
  std::vector<std::pair<Bytes, Bytes>> holds;
};

class PersistentHeap {
 public:
  // Buffers live below `top` in a SpaceMap the heap shares with the lanes, so every
  // call that changes placement takes that map.
  explicit PersistentHeap(Bytes top);

  // Best fit at or above `floor`. `size` must be a nonzero multiple of kAlignment.
  // `reuse` (nonzero) places a buffer that was released earlier under its old handle:
  // a swapped-out session's buffers come back with the handles its work is bound to.
  std::optional<BufferHandle> allocate(SpaceMap& space, SessionId owner, Bytes size, Bytes floor,
                                       BufferHandle reuse = 0);
  // Frees the buffer and whatever is held for its moves. nullopt for an unknown handle.
  std::optional<PersistentBuffer> release(SpaceMap& space, BufferHandle handle);
  // Frees every buffer of `owner`, moves in flight included; returns the bytes freed.
  Bytes release_all(SpaceMap& space, SessionId owner);

  const PersistentBuffer* find(BufferHandle handle) const;
  Bytes used() const { return used_; }
  std::size_t count() const { return buffers_.size(); }
  Bytes top() const { return top_; }
  // Whether a buffer or a range held for a move overlaps [begin, end).
  bool intersects(Bytes begin, Bytes end) const;
  // Every buffer packed against the top with no hole in between.
  bool contiguous() const;

  // ---- Compaction ----
  // Compaction works toward one goal: clear [floor, floor + size) of persistent buffers,
  // where floor is the top of the lane region. That is where a new or grown lane needs
  // room, and clearing it also opens a hole of `size` for an allocation. Asks combine to
  // the largest; the goal is dropped once that range is clear (see settle_compaction).
  void request_room(Bytes size) { goal_ = std::max(goal_, size); }
  // The goal's range is still blocked, moves are out, or a two-step move is half done.
  bool compaction_pending(Bytes floor) const;
  // Forgets a goal that has been reached; call after anything that may reach it.
  void settle_compaction(Bytes floor);
  // Moves of `owner`'s buffers whose destinations are free now; they stay held in
  // `space` until finish_moves. Every move goes toward the top, and from cheapest to
  // dearest:
  //  - a blocking buffer that fits whole in a hole above the range moves there in one
  //    copy (best fit, largest buffer first);
  //  - if some do not fit, the lowest buffers slide up, packed under a buffer that can
  //    stay, far enough to clear the range. A slide shorter than the buffer would overlap
  //    itself, so such a buffer rather moves whole to a hole above it; failing that, it
  //    makes two copies through a free staging place (the second at its next visit);
  //    failing that, it is split into chunks no longer than the distance, listed top
  //    chunk first: each chunk's source and destination are disjoint, and copying the
  //    chunks in the listed order moves the whole buffer.
  // Empty while `owner` has moves out.
  std::vector<PersistentMove> plan_moves(SpaceMap& space, SessionId owner, Bytes floor);
  // The owners of the buffers compaction may have to move before its goal is
  // reached, in ascending order and once each, into `out`; empty while nothing
  // is pending: second copies still due, and the buffers blocking the goal when
  // best fit places them all (as plan_moves then does), else every buffer the
  // slide could move. Such an owner must reach an idle moment for its moves to
  // be planned.
  void owners_to_move(const SpaceMap& space, Bytes floor, std::vector<SessionId>& out) const;
  bool has_outstanding(SessionId owner) const { return outstanding_.count(owner) != 0; }
  bool any_outstanding() const { return !outstanding_.empty(); }
  struct Finished {
    std::uint64_t buffers = 0;
    Bytes bytes = 0;
    bool had_moves = false;
  };
  // The owner copied everything plan_moves gave it: buffers take their new offsets.
  Finished finish_moves(SpaceMap& space, SessionId owner);

  template <typename F>
  void for_each_buffer(F&& f) const {
    for (const auto& [offset, handle] : by_offset_) f(buffers_.at(handle));
  }
  // Buffers of one owner, lowest handle first.
  const std::set<BufferHandle>* buffers_of(SessionId owner) const;

 private:
  void hold(SpaceMap& space, PersistentBuffer& b, Bytes begin, Bytes end);
  void drop_holds(SpaceMap& space, PersistentBuffer& b);
  void forget_outstanding(const PersistentBuffer& b);
  // The range the goal asks for, shrunk to what the free bytes above the floor can give.
  std::pair<Bytes, Bytes> goal_range(Bytes floor) const;
  bool goal_blocked(Bytes floor) const;
  // Holds `to` for `b` and appends its copies to `moves`.
  void plan_one(SpaceMap& space, PersistentBuffer& b, Bytes to, std::vector<PersistentMove>& moves);
  void plan_staged(SpaceMap& space, PersistentBuffer& b, Bytes stage, Bytes to,
                   std::vector<PersistentMove>& moves);
  // Where best fit puts each buffer that blocks `range` and is not moving yet
  // (largest first, into the smallest hole above the range that takes it), and
  // whether every one of them found a place. Shared by plan_best_fit and
  // owners_to_move, so that the owners named are the owners planned.
  struct BestFit {
    std::vector<std::pair<BufferHandle, Bytes>> placed;
    bool all = true;
  };
  BestFit best_fit(const SpaceMap& space, std::pair<Bytes, Bytes> range) const;
  bool plan_best_fit(SpaceMap& space, SessionId owner, std::pair<Bytes, Bytes> range,
                     std::vector<PersistentMove>& moves);
  void plan_slide(SpaceMap& space, SessionId owner, std::pair<Bytes, Bytes> range,
                  std::vector<PersistentMove>& moves);

  Bytes top_;
  BufferHandle next_handle_ = 1;
  Bytes used_ = 0;
  Bytes goal_ = 0;             // size of the range above the floor to clear; 0: none
  std::size_t half_done_ = 0;  // two-step moves waiting for their second copy
  std::unordered_map<BufferHandle, PersistentBuffer> buffers_;
  std::map<Bytes, BufferHandle> by_offset_;
  std::map<Bytes, Bytes> held_;  // every hold, begin -> end
  std::unordered_map<SessionId, std::set<BufferHandle>> by_owner_;
  std::unordered_map<SessionId, std::vector<BufferHandle>> outstanding_;
};

}  // namespace salus::arena
