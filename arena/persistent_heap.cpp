#include "arena/persistent_heap.hpp"

#include <iterator>

namespace salus::arena {

PersistentHeap::PersistentHeap(Bytes top) : top_(top) {}

std::optional<BufferHandle> PersistentHeap::allocate(SpaceMap& space, SessionId owner, Bytes size,
                                                     Bytes floor, BufferHandle reuse) {
  const std::optional<Bytes> at = space.best_fit_top(size, floor);
  if (!at || *at + size > top_) return std::nullopt;
  space.take(*at, *at + size);
  const BufferHandle handle = reuse != 0 ? reuse : next_handle_++;
  PersistentBuffer& b = buffers_[handle];
  b.handle = handle;
  b.owner = owner;
  b.offset = *at;
  b.size = size;
  by_offset_.emplace(*at, handle);
  by_owner_[owner].insert(handle);
  used_ += size;
  return handle;
}

void PersistentHeap::hold(SpaceMap& space, PersistentBuffer& b, Bytes begin, Bytes end) {
  if (begin >= end) return;
  space.take(begin, end);
  held_.emplace(begin, end);
  b.holds.emplace_back(begin, end);
}

void PersistentHeap::drop_holds(SpaceMap& space, PersistentBuffer& b) {
  for (const auto& [begin, end] : b.holds) {
    space.give(begin, end);
    held_.erase(begin);
  }
  b.holds.clear();
}

void PersistentHeap::forget_outstanding(const PersistentBuffer& b) {
  auto out = outstanding_.find(b.owner);
  if (out == outstanding_.end()) return;
  std::erase(out->second, b.handle);
  if (out->second.empty()) outstanding_.erase(out);
}

std::optional<PersistentBuffer> PersistentHeap::release(SpaceMap& space, BufferHandle handle) {
  auto it = buffers_.find(handle);
  if (it == buffers_.end()) return std::nullopt;
  PersistentBuffer& b = it->second;
  drop_holds(space, b);
  if (b.move_to) forget_outstanding(b);
  if (b.then_to && !b.move_to) --half_done_;
  space.give(b.offset, b.offset + b.size);
  by_offset_.erase(b.offset);
  auto owned = by_owner_.find(b.owner);
  owned->second.erase(handle);
  if (owned->second.empty()) by_owner_.erase(owned);
  used_ -= b.size;
  PersistentBuffer gone = std::move(b);
  buffers_.erase(it);
  return gone;
}

Bytes PersistentHeap::release_all(SpaceMap& space, SessionId owner) {
  auto owned = by_owner_.find(owner);
  if (owned == by_owner_.end()) return 0;
  const std::vector<BufferHandle> handles(owned->second.begin(), owned->second.end());
  Bytes freed = 0;
  for (BufferHandle h : handles) freed += release(space, h)->size;
  return freed;
}

const PersistentBuffer* PersistentHeap::find(BufferHandle handle) const {
  auto it = buffers_.find(handle);
  return it == buffers_.end() ? nullptr : &it->second;
}

const std::set<BufferHandle>* PersistentHeap::buffers_of(SessionId owner) const {
  auto it = by_owner_.find(owner);
  return it == by_owner_.end() ? nullptr : &it->second;
}

bool PersistentHeap::intersects(Bytes begin, Bytes end) const {
  if (begin >= end) return false;
  // Ranges in each map are disjoint, so the last one starting before `end` reaches furthest.
  auto it = by_offset_.lower_bound(end);
  if (it != by_offset_.begin()) {
    const PersistentBuffer& b = buffers_.at(std::prev(it)->second);
    if (b.offset + b.size > begin) return true;
  }
  auto h = held_.lower_bound(end);
  return h != held_.begin() && std::prev(h)->second > begin;
}

bool PersistentHeap::contiguous() const {
  return by_offset_.empty() || by_offset_.begin()->first == top_ - used_;
}

std::pair<Bytes, Bytes> PersistentHeap::goal_range(Bytes floor) const {
  const Bytes free_above = top_ >= floor + used_ ? top_ - floor - used_ : 0;
  return {floor, floor + std::min(goal_, free_above)};
}

bool PersistentHeap::goal_blocked(Bytes floor) const {
  if (goal_ == 0) return false;
  const auto [begin, end] = goal_range(floor);
  return intersects(begin, end);
}

bool PersistentHeap::compaction_pending(Bytes floor) const {
  return goal_blocked(floor) || !outstanding_.empty() || half_done_ != 0;
}

void PersistentHeap::settle_compaction(Bytes floor) {
  if (goal_ != 0 && !goal_blocked(floor)) goal_ = 0;
}

void PersistentHeap::plan_one(SpaceMap& space, PersistentBuffer& b, Bytes to,
                              std::vector<PersistentMove>& moves) {
  // Only the part of the destination outside the buffer's own range needs holding.
  if (to >= b.offset + b.size || to + b.size <= b.offset) {
    hold(space, b, to, to + b.size);
  } else if (to > b.offset) {
    hold(space, b, b.offset + b.size, to + b.size);
  } else {
    hold(space, b, to, b.offset);
  }
  b.move_to = to;
  outstanding_[b.owner].push_back(b.handle);
  const Bytes distance = to > b.offset ? to - b.offset : b.offset - to;
  if (distance >= b.size) {
    moves.push_back({b.handle, b.owner, b.offset, to, b.size});
    return;
  }
  // Only upward slides are planned; chunks go top first so none overwrites unread bytes.
  for (Bytes hi = b.offset + b.size; hi > b.offset;) {
    const Bytes lo = hi - b.offset > distance ? hi - distance : b.offset;
    moves.push_back({b.handle, b.owner, lo, lo + distance, hi - lo});
    hi = lo;
  }
}

void PersistentHeap::plan_staged(SpaceMap& space, PersistentBuffer& b, Bytes stage, Bytes to,
                                 std::vector<PersistentMove>& moves) {
  // The final place is held from now on, so nothing can take it between the two copies.
  hold(space, b, stage, stage + b.size);
  hold(space, b, b.offset + b.size, to + b.size);
  b.move_to = stage;
  b.then_to = to;
  outstanding_[b.owner].push_back(b.handle);
  moves.push_back({b.handle, b.owner, b.offset, stage, b.size});
}

PersistentHeap::BestFit PersistentHeap::best_fit(const SpaceMap& space,
                                                 std::pair<Bytes, Bytes> range) const {
  std::vector<const PersistentBuffer*> blocking;
  for (auto it = by_offset_.begin(); it != by_offset_.end() && it->first < range.second; ++it) {
    const PersistentBuffer& b = buffers_.at(it->second);
    if (b.offset + b.size > range.first && !b.move_to && !b.then_to) blocking.push_back(&b);
  }
  std::sort(blocking.begin(), blocking.end(),
            [](const PersistentBuffer* a, const PersistentBuffer* b) {
              return a->size != b->size ? a->size > b->size : a->offset < b->offset;
            });
  BestFit fit;
  // Holes above the range, as (begin, end); placements shrink them from the top.
  std::vector<std::pair<Bytes, Bytes>> holes;
  space.for_each_hole([&](Bytes begin, Bytes end) {
    if (end > range.second) holes.emplace_back(std::max(begin, range.second), end);
  });
  // Every blocking buffer has to leave the range anyway, so those that fit somewhere go
  // even when others do not; those others are left to plan_slide.
  for (const PersistentBuffer* b : blocking) {
    std::pair<Bytes, Bytes>* best = nullptr;
    for (auto& h : holes) {
      const Bytes len = h.second - h.first;
      if (len < b->size) continue;
      if (!best || len < best->second - best->first ||
          (len == best->second - best->first && h.first > best->first))
        best = &h;
    }
    if (!best) {
      fit.all = false;
      continue;
    }
    best->second -= b->size;
    fit.placed.emplace_back(b->handle, best->second);
  }
  return fit;
}

bool PersistentHeap::plan_best_fit(SpaceMap& space, SessionId owner, std::pair<Bytes, Bytes> range,
                                   std::vector<PersistentMove>& moves) {
  const BestFit fit = best_fit(space, range);
  for (const auto& [handle, to] : fit.placed)
    if (PersistentBuffer& b = buffers_.at(handle); b.owner == owner) plan_one(space, b, to, moves);
  return fit.all;
}

namespace {

// The smallest free range of at least `size` at or above `lowest`, outside [skip_begin,
// skip_end), as the offset of its top `size` bytes.
std::optional<Bytes> best_hole(const SpaceMap& space, Bytes size, Bytes lowest, Bytes skip_begin,
                               Bytes skip_end) {
  std::optional<std::pair<Bytes, Bytes>> best;
  const auto consider = [&](Bytes begin, Bytes end) {
    begin = std::max(begin, lowest);
    if (end <= begin || end - begin < size) return;
    if (!best || end - begin < best->second - best->first ||
        (end - begin == best->second - best->first && begin > best->first))
      best = std::pair{begin, end};
  };
  space.for_each_hole([&](Bytes begin, Bytes end) {
    if (end <= skip_begin || begin >= skip_end) return consider(begin, end);
    consider(begin, skip_begin);
    consider(skip_end, end);
  });
  if (!best) return std::nullopt;
  return best->second - size;
}

// The heap's buffers from the top down, as slide_start takes them. `Buffer` is
// PersistentBuffer, const for a const heap.
template <typename Buffer, typename Buffers, typename ByOffset>
std::vector<Buffer*> top_down(Buffers& buffers, const ByOffset& by_offset) {
  std::vector<Buffer*> down;
  down.reserve(by_offset.size());
  for (auto it = by_offset.rbegin(); it != by_offset.rend(); ++it)
    down.push_back(&buffers.at(it->second));
  return down;
}

// Buffers from the top down. Packing buffers k.. under buffer k - 1 (or under the top)
// clears the range once they end up at or above its end. The largest such k moves the
// fewest buffers; a smaller k moves more, but each by more (the holes above k add up),
// and a short slide costs a copy per chunk. So among the largest few valid k, take the
// one with the fewest copies. k = 0 (pack everything) is always valid: the range was
// sized to the free bytes above the floor. `Buffer` is PersistentBuffer, const or not.
template <typename Buffer>
std::size_t slide_start(const std::vector<Buffer*>& down, Bytes top,
                        std::pair<Bytes, Bytes> range) {
  const auto anchor = [&](std::size_t k) { return k == 0 ? top : down[k - 1]->offset; };
  std::size_t k_max = down.size();
  Bytes packed = 0;
  while (k_max > 0) {
    --k_max;
    packed += down[k_max]->size;
    if (anchor(k_max) >= range.second + packed) break;
  }
  constexpr std::size_t kCandidates = 32;
  std::size_t k = k_max;
  std::uint64_t best_copies = ~std::uint64_t{0};
  for (std::size_t c = k_max + 1; c-- > 0 && k_max - c < kCandidates;) {
    std::uint64_t copies = 0;
    Bytes place = anchor(c);
    for (std::size_t i = c; i < down.size(); ++i) {
      place -= down[i]->size;
      const Bytes distance = place - down[i]->offset;
      if (distance != 0) copies += (down[i]->size + distance - 1) / distance;
    }
    if (copies < best_copies) {
      best_copies = copies;
      k = c;
    }
  }
  return k;
}

}  // namespace

void PersistentHeap::plan_slide(SpaceMap& space, SessionId owner, std::pair<Bytes, Bytes> range,
                                std::vector<PersistentMove>& moves) {
  const std::vector<PersistentBuffer*> down = top_down<PersistentBuffer>(buffers_, by_offset_);
  const std::size_t k = slide_start(down, top_, range);
  // The packed place of each of those buffers is never below it: the ones between it and
  // the anchor fit in the space between.
  Bytes place = k == 0 ? top_ : down[k - 1]->offset;
  for (std::size_t i = k; i < down.size(); ++i) {
    PersistentBuffer& b = *down[i];
    place -= b.size;
    if (b.owner != owner || b.offset == place || b.move_to || b.then_to) continue;
    const Bytes end = b.offset + b.size;
    if (place < end) {
      // Sliding by less than its size would overlap itself. A hole above both the range
      // and the buffer that takes it whole is one copy, and still moves it up, so rounds
      // of planning cannot go around in circles; the next round packs around it.
      if (const auto hop = best_hole(space, b.size, std::max(range.second, end), 0, 0)) {
        plan_one(space, b, *hop, moves);
        continue;
      }
      if (!space.is_free(end, place + b.size)) continue;  // a later round
      // Two copies through any free place above the floor beat three or more chunks.
      const Bytes distance = place - b.offset;
      if ((b.size + distance - 1) / distance > 2) {
        if (const auto stage = best_hole(space, b.size, range.first, end, place + b.size)) {
          plan_staged(space, b, *stage, place, moves);
          continue;
        }
      }
    } else if (!space.is_free(place, place + b.size)) {
      continue;  // a later round
    }
    plan_one(space, b, place, moves);
  }
}

void PersistentHeap::owners_to_move(const SpaceMap& space, Bytes floor,
                                    std::vector<SessionId>& out) const {
  out.clear();
  if (half_done_ != 0)
    for (const auto& [handle, b] : buffers_)
      if (b.then_to && !b.move_to) out.push_back(b.owner);
  if (goal_blocked(floor)) {
    // Best fit moves only buffers in the range, and is all plan_moves does when
    // it places them all; otherwise a slide moves buffers up to the anchor it
    // packs under, which is never below the range's end.
    const std::pair<Bytes, Bytes> range = goal_range(floor);
    const BestFit fit = best_fit(space, range);
    for (const auto& [handle, to] : fit.placed) out.push_back(buffers_.at(handle).owner);
    if (!fit.all) {
      const auto down = top_down<const PersistentBuffer>(buffers_, by_offset_);
      const std::size_t k = slide_start(down, top_, range);
      for (std::size_t i = k; i < down.size(); ++i)
        if (!down[i]->move_to) out.push_back(down[i]->owner);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
}

std::vector<PersistentMove> PersistentHeap::plan_moves(SpaceMap& space, SessionId owner,
                                                       Bytes floor) {
  std::vector<PersistentMove> moves;
  if (has_outstanding(owner)) return moves;
  auto owned = by_owner_.find(owner);
  if (owned == by_owner_.end()) return moves;
  // Second copies of two-step moves first: their final places are held already.
  for (BufferHandle h : owned->second) {
    PersistentBuffer& b = buffers_.at(h);
    if (!b.then_to || b.move_to) continue;
    b.move_to = *b.then_to;
    b.then_to.reset();
    --half_done_;
    outstanding_[owner].push_back(h);
    moves.push_back({h, owner, b.offset, *b.move_to, b.size});
  }
  if (!goal_blocked(floor)) return moves;
  const std::pair<Bytes, Bytes> range = goal_range(floor);
  if (!plan_best_fit(space, owner, range, moves)) plan_slide(space, owner, range, moves);
  return moves;
}

PersistentHeap::Finished PersistentHeap::finish_moves(SpaceMap& space, SessionId owner) {
  Finished done;
  auto out = outstanding_.find(owner);
  if (out == outstanding_.end()) return done;
  done.had_moves = true;
  for (BufferHandle h : out->second) {
    PersistentBuffer& b = buffers_.at(h);
    const Bytes from = b.offset, to = *b.move_to, size = b.size;
    // What was held for this copy is the buffer's own range now (or, for the first copy
    // of two, partly the final place, held again below).
    for (const auto& [begin, end] : b.holds) held_.erase(begin);
    b.holds.clear();
    if (b.then_to) {
      // Staged: the final place [then_to, +size) overlaps the old range from below;
      // keep that overlap and the extension above it held, give back the rest.
      const Bytes final_at = *b.then_to;
      space.give(from, final_at);
      held_.emplace(final_at, final_at + size);
      b.holds.emplace_back(final_at, final_at + size);
      ++half_done_;
    } else if (to >= from + size || to + size <= from) {
      space.give(from, from + size);
    } else if (to > from) {
      space.give(from, to);
    } else {
      space.give(to + size, from + size);
    }
    by_offset_.erase(from);
    by_offset_.emplace(to, h);
    b.offset = to;
    b.move_to.reset();
    ++done.buffers;
    done.bytes += size;
  }
  outstanding_.erase(out);
  return done;
}

}  // namespace salus::arena
