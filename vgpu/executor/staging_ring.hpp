// Hands out slots of the staging area that salusd and an executor share for host
// copies: allocated in order like a ring, freed in any order (streams complete
// independently), with no allocation per slot once warm.
#pragma once

#include <cstdint>
#include <deque>

namespace salus::vgpu::executor {

class StagingRing {
 public:
  static constexpr std::uint64_t kAlign = 64;  // a cache line: no false sharing between slots

  explicit StagingRing(std::uint64_t capacity) : capacity_(capacity / kAlign * kAlign) {}

  std::uint64_t capacity() const { return capacity_; }
  // Space between the oldest live slot and the newest is not reused until the
  // oldest is freed, so a slot held long blocks the ring behind it; the biggest
  // slot that can ever be had is the whole capacity.
  // Returns false (and leaves the ring alone) when `length` bytes do not fit now.
  bool allocate(std::uint64_t length, std::uint64_t& offset);
  // Frees a slot returned by allocate (any order). Unknown offsets are ignored.
  void free(std::uint64_t offset);
  bool empty() const { return live_.empty(); }
  std::size_t slots() const { return live_.size(); }

 private:
  struct Slot {
    std::uint64_t offset;
    std::uint64_t length;
    bool freed;
  };
  std::uint64_t capacity_;
  std::uint64_t head_ = 0;  // where the next slot starts, if it fits before the end
  std::deque<Slot> live_;   // in allocation order; the front is the oldest
};

}  // namespace salus::vgpu::executor
