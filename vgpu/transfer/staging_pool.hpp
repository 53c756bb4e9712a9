// Staging blocks of one device: host memory the device copies to and from
// directly (Device::alloc_staging), kept for reuse so that a small mem/ write or
// a transfer does not pay for an allocation, and on cuda a pinning, each time.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <vector>

#include "vgpu/device.hpp"

namespace salus::vgpu {

class StagingPool {
 public:
  // Blocks come in power-of-two size classes from kMinBlock up; at most
  // `cache_limit` bytes of returned blocks are kept for reuse.
  static constexpr Bytes kMinBlock = Bytes{64} << 10;

  StagingPool(Device& device, Bytes cache_limit);
  ~StagingPool();  // frees the cached blocks; every block must have been returned
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // A block of at least `size` bytes, returned to its pool when destroyed. Empty
  // (data() == nullptr) when none was given: out of host memory.
  class Block {
   public:
    Block() = default;
    Block(Block&& o) noexcept { swap(o); }
    Block& operator=(Block&& o) noexcept {
      if (this != &o) {
        reset();
        swap(o);
      }
      return *this;
    }
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    ~Block() { reset(); }

    char* data() const { return data_; }
    Bytes capacity() const { return capacity_; }
    explicit operator bool() const { return data_ != nullptr; }
    void reset();

   private:
    friend class StagingPool;
    Block(StagingPool* pool, char* data, Bytes capacity)
        : pool_(pool), data_(data), capacity_(capacity) {}
    void swap(Block& o) noexcept {
      std::swap(pool_, o.pool_);
      std::swap(data_, o.data_);
      std::swap(capacity_, o.capacity_);
    }
    StagingPool* pool_ = nullptr;
    char* data_ = nullptr;
    Bytes capacity_ = 0;
  };

  Block acquire(Bytes size);

  struct Stats {
    Bytes in_use = 0;               // held by mem/ copies and transfers right now
    Bytes cached = 0;               // returned, kept for reuse
    std::uint64_t allocations = 0;  // blocks the device allocated, ever
  };
  Stats stats() const;
  static Bytes size_class(Bytes size);

 private:
  void release(char* data, Bytes capacity);

  Device& device_;
  const Bytes cache_limit_;
  mutable std::mutex mu_;
  std::map<Bytes, std::vector<char*>> free_;  // by size class
  Stats stats_;
};

}  // namespace salus::vgpu
