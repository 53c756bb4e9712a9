#include "vgpu/cuda/vmm_arena.hpp"

namespace salus::vgpu::cuda {

bool VmmArena::supported(const CudaDriver& drv, CUdevice device) {
  if (drv.mem_create == nullptr || drv.mem_release == nullptr ||
      drv.mem_address_reserve == nullptr || drv.mem_address_free == nullptr ||
      drv.mem_map == nullptr || drv.mem_unmap == nullptr || drv.mem_set_access == nullptr)
    return false;
  int v = 0;
  return drv.device_get_attribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  device) == CUDA_SUCCESS &&
         v != 0;
}

VmmArena::VmmArena(const CudaDriver& drv, CUdevice device, Bytes chunk)
    : drv_(drv), device_(device), chunk_(chunk) {}

CUresult VmmArena::reserve(Bytes size) {
  CUdeviceptr p = 0;
  size = (size + chunk_ - 1) / chunk_ * chunk_;
  const CUresult r = drv_.mem_address_reserve(&p, size, chunk_, 0, 0);
  if (r != CUDA_SUCCESS) return r;
  base_ = p;
  size_ = size;
  handles_.assign(size / chunk_, 0);
  std::lock_guard lk(mu_);
  backed_.assign(size / chunk_, false);
  backed_count_ = 0;
  return CUDA_SUCCESS;
}

std::vector<bool> VmmArena::backed() const {
  std::lock_guard lk(mu_);
  return backed_;
}

bool VmmArena::all_backed(std::uint64_t first, std::uint64_t last) const {
  std::lock_guard lk(mu_);
  for (std::uint64_t i = first; i <= last; ++i)
    if (i >= backed_.size() || !backed_[i]) return false;
  return true;
}

CUresult VmmArena::map(const arena::ChunkRun& run, std::uint64_t& mapped) {
  mapped = 0;
  if (run.first > handles_.size() || run.count > handles_.size() - run.first)
    return CUDA_ERROR_INVALID_VALUE;  // past the reservation
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_;
  CUresult r = CUDA_SUCCESS;
  for (std::uint64_t i = run.first; i < run.first + run.count && r == CUDA_SUCCESS; ++i) {
    CUmemGenericAllocationHandle h = 0;
    r = drv_.mem_create(&h, chunk_, &prop, 0);
    if (r != CUDA_SUCCESS) break;
    r = drv_.mem_map(base_ + i * chunk_, chunk_, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      drv_.mem_release(h);
      break;
    }
    handles_[i] = h;
    ++mapped;
  }
  if (mapped == 0) return r;
  // Access for what was mapped, in one call; without it the chunks cannot be used.
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult a = drv_.mem_set_access(base_ + run.first * chunk_, mapped * chunk_, &access, 1);
  if (a != CUDA_SUCCESS) {
    for (std::uint64_t i = run.first; i < run.first + mapped; ++i) {
      if (handles_[i] == 0) continue;
      drv_.mem_unmap(base_ + i * chunk_, chunk_);
      drv_.mem_release(handles_[i]);
      handles_[i] = 0;
    }
    mapped = 0;
    return a;
  }
  std::lock_guard lk(mu_);
  for (std::uint64_t i = run.first; i < run.first + mapped; ++i) backed_[i] = true;
  backed_count_ += mapped;
  return r;
}

void VmmArena::unmap(const arena::ChunkRun& run) {
  for (std::uint64_t i = run.first; i < run.first + run.count && i < handles_.size(); ++i) {
    if (handles_[i] == 0) continue;
    {
      // Not backed as far as readers know before the driver unmaps it.
      std::lock_guard lk(mu_);
      backed_[i] = false;
      --backed_count_;
    }
    drv_.mem_unmap(base_ + i * chunk_, chunk_);
    drv_.mem_release(handles_[i]);
    handles_[i] = 0;
  }
}

void VmmArena::release() {
  if (base_ == 0) return;
  unmap({0, handles_.size()});
  drv_.mem_address_free(base_, size_);
  base_ = 0;
  size_ = 0;
}

std::vector<bool> VmmArena::forget() {
  std::lock_guard lk(mu_);
  std::vector<bool> was = std::move(backed_);
  handles_.clear();
  backed_.clear();
  backed_count_ = 0;
  base_ = 0;
  size_ = 0;
  return was;
}

}  // namespace salus::vgpu::cuda
