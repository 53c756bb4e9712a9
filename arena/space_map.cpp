#include "arena/space_map.hpp"

#include <iterator>
#include <limits>

namespace salus::arena {

SpaceMap::SpaceMap(Bytes size) : size_(size) {
  add_hole(0, size);
}

Bytes SpaceMap::largest_hole() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

void SpaceMap::add_hole(Bytes begin, Bytes end) {
  if (begin >= end) return;
  holes_.emplace(begin, end);
  by_size_.emplace(end - begin, begin);
  free_ += end - begin;
}

void SpaceMap::drop_hole(std::map<Bytes, Bytes>::iterator it) {
  by_size_.erase({it->second - it->first, it->first});
  free_ -= it->second - it->first;
  holes_.erase(it);
}

bool SpaceMap::is_free(Bytes begin, Bytes end) const {
  if (begin >= end) return true;
  auto it = holes_.upper_bound(begin);
  if (it == holes_.begin()) return false;
  --it;
  return it->second >= end;
}

bool SpaceMap::take(Bytes begin, Bytes end) {
  if (begin >= end) return true;
  auto it = holes_.upper_bound(begin);
  if (it == holes_.begin()) return false;
  --it;
  if (it->second < end) return false;
  const Bytes hole_begin = it->first, hole_end = it->second;
  ++version_;
  drop_hole(it);
  add_hole(hole_begin, begin);
  add_hole(end, hole_end);
  return true;
}

bool SpaceMap::give(Bytes begin, Bytes end) {
  if (begin >= end) return true;
  if (end > size_) return false;
  auto next = holes_.lower_bound(begin);
  if (next != holes_.end() && next->first < end) return false;
  Bytes new_begin = begin, new_end = end;
  if (next != holes_.begin()) {
    auto prev = std::prev(next);
    if (prev->second > begin) return false;
    if (prev->second == begin) {
      new_begin = prev->first;
      drop_hole(prev);
    }
  }
  if (next != holes_.end() && next->first == end) {
    new_end = next->second;
    drop_hole(next);
  }
  add_hole(new_begin, new_end);
  ++version_;
  return true;
}

std::optional<Bytes> SpaceMap::best_fit_top(Bytes size, Bytes floor) const {
  if (size == 0) return std::nullopt;
  std::optional<std::pair<Bytes, Bytes>> best;  // (usable length, hole end)
  // Holes entirely at or above the floor, smallest first. Holes below the floor lie in
  // the lane region, where lanes are kept compact, so few are ever skipped here.
  for (auto it = by_size_.lower_bound({size, std::numeric_limits<Bytes>::max()});
       it != by_size_.end(); ++it) {
    if (it->second >= floor) {
      best = std::pair{it->first, it->second + it->first};
      break;
    }
  }
  // The one hole that may straddle the floor: only its upper part counts. It lies below
  // every hole found above, so it only wins when strictly smaller.
  auto it = holes_.upper_bound(floor);
  if (it != holes_.begin()) {
    --it;
    if (it->first < floor && it->second > floor) {
      const Bytes usable = it->second - floor;
      if (usable >= size && (!best || usable < best->first)) best = std::pair{usable, it->second};
    }
  }
  if (!best) return std::nullopt;
  return best->second - size;
}

}  // namespace salus::arena
