// The physically free ranges of one GPU's memory: bytes that no lane, persistent
// buffer or reserved move destination holds. Holes coalesce; lookups are best fit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "arena/size_units.hpp"

namespace salus::arena {

class SpaceMap {
 public:
  // All of [0, size) starts free.
  explicit SpaceMap(Bytes size);

  Bytes size() const { return size_; }
  Bytes free_bytes() const { return free_; }
  Bytes largest_hole() const;
  std::size_t hole_count() const { return holes_.size(); }
  // Counts the changes (a take or give that did something): a caller that keeps
  // something derived from the held ranges knows when to look again.
  std::uint64_t version() const { return version_; }

  // Empty ranges are always free and taking or giving them does nothing.
  bool is_free(Bytes begin, Bytes end) const;
  // False (and no change) unless the whole range is free.
  bool take(Bytes begin, Bytes end);
  // False (and no change) unless no byte of the range is free and it lies inside the map.
  bool give(Bytes begin, Bytes end);

  // Where a block of `size` bytes goes: the top end of the smallest hole whose part at
  // or above `floor` holds it. The top end, because persistent memory grows down and
  // whatever is left of the hole then stays next to the lanes below. Among equally
  // good holes the higher one wins, for the same reason.
  std::optional<Bytes> best_fit_top(Bytes size, Bytes floor) const;

  template <typename F>
  void for_each_hole(F&& f) const {
    for (const auto& [begin, end] : holes_) f(begin, end);
  }

 private:
  // Length ascending, then begin descending, so the first fit is also the highest.
  struct BySize {
    bool operator()(const std::pair<Bytes, Bytes>& a, const std::pair<Bytes, Bytes>& b) const {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    }
  };

  void add_hole(Bytes begin, Bytes end);
  void drop_hole(std::map<Bytes, Bytes>::iterator it);

  Bytes size_;
  Bytes free_ = 0;
  std::uint64_t version_ = 0;
  std::map<Bytes, Bytes> holes_;                       // begin -> end
  std::set<std::pair<Bytes, Bytes>, BySize> by_size_;  // (length, begin)
};

}  // namespace salus::arena
