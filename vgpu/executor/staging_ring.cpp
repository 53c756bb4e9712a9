#include "vgpu/executor/staging_ring.hpp"

namespace salus::vgpu::executor {

bool StagingRing::allocate(std::uint64_t length, std::uint64_t& offset) {
  const std::uint64_t n = length == 0 ? kAlign : (length + kAlign - 1) / kAlign * kAlign;
  if (n > capacity_ || n < length) return false;
  if (live_.empty()) {
    head_ = 0;
    offset = 0;
  } else {
    const std::uint64_t tail = live_.front().offset;
    if (head_ > tail) {
      // In use: [tail, head). Free: [head, capacity) then [0, tail).
      if (capacity_ - head_ >= n) {
        offset = head_;
      } else if (tail >= n) {
        offset = 0;  // wrap; the end of the ring stays unused until the front passes it
      } else {
        return false;
      }
    } else {
      // Wrapped (or full when head == tail): free is [head, tail).
      if (tail - head_ < n) return false;
      offset = head_;
    }
  }
  head_ = offset + n;
  live_.push_back(Slot{offset, n, false});
  return true;
}

void StagingRing::free(std::uint64_t offset) {
  // Completions come roughly in allocation order: the slot is near the front.
  for (Slot& s : live_) {
    if (s.offset == offset && !s.freed) {
      s.freed = true;
      break;
    }
  }
  while (!live_.empty() && live_.front().freed) live_.pop_front();
  if (live_.empty()) head_ = 0;
}

}  // namespace salus::vgpu::executor
