#include "vgpu/transfer/staging_pool.hpp"

#include <bit>

namespace salus::vgpu {

void StagingPool::Block::reset() {
  if (pool_ && data_) pool_->release(data_, capacity_);
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

StagingPool::StagingPool(Device& device, Bytes cache_limit)
    : device_(device), cache_limit_(cache_limit) {}

StagingPool::~StagingPool() {
  for (auto& [cls, blocks] : free_)
    for (char* p : blocks) device_.free_staging(p, cls);
}

Bytes StagingPool::size_class(Bytes size) {
  if (size <= kMinBlock) return kMinBlock;
  return std::bit_ceil(size);
}

StagingPool::Block StagingPool::acquire(Bytes size) {
  const Bytes cls = size_class(size);
  {
    std::lock_guard lk(mu_);
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      char* p = it->second.back();
      it->second.pop_back();
      stats_.cached -= cls;
      stats_.in_use += cls;
      return Block(this, p, cls);
    }
  }
  // Allocated outside the lock: pinning memory on cuda takes milliseconds.
  auto* p = static_cast<char*>(device_.alloc_staging(cls));
  if (!p) return Block();
  std::lock_guard lk(mu_);
  ++stats_.allocations;
  stats_.in_use += cls;
  return Block(this, p, cls);
}

void StagingPool::release(char* data, Bytes capacity) {
  {
    std::lock_guard lk(mu_);
    stats_.in_use -= capacity;
    if (stats_.cached + capacity <= cache_limit_) {
      free_[capacity].push_back(data);
      stats_.cached += capacity;
      return;
    }
  }
  device_.free_staging(data, capacity);
}

StagingPool::Stats StagingPool::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

}  // namespace salus::vgpu
