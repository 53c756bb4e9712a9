// A growable FIFO ring for stream op queues: after the first few ops it never
// allocates, unlike std::deque, which allocates and frees blocks as it moves.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace salus::vgpu::sim {

template <typename T>
class OpRing {
 public:
  bool empty() const { return count_ == 0; }
  std::size_t size() const { return count_; }

  void push(T value) {
    if (count_ == slots_.size()) grow();
    slots_[(head_ + count_) & (slots_.size() - 1)] = std::move(value);
    ++count_;
  }

  // Precondition: !empty().
  T& front() { return slots_[head_]; }

  // Precondition: !empty().
  T pop() {
    T value = std::move(slots_[head_]);
    head_ = (head_ + 1) & (slots_.size() - 1);
    --count_;
    return value;
  }

 private:
  // Capacity stays a power of two so wrapping is a mask.
  void grow() {
    std::vector<T> bigger(slots_.empty() ? 64 : slots_.size() * 2);
    for (std::size_t i = 0; i < count_; ++i)
      bigger[i] = std::move(slots_[(head_ + i) & (slots_.size() - 1)]);
    slots_ = std::move(bigger);
    head_ = 0;
  }

  std::vector<T> slots_;
  std::size_t head_ = 0;
  std::size_t count_ = 0;
};

}  // namespace salus::vgpu::sim
