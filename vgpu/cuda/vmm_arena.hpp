// The cuda arena backed on demand: one virtual address reservation the size of
// the arena, with physical memory (one cuMemCreate handle per chunk) mapped only
// where salusd holds memory. What salusd does not hold stays with the card, for
// attached programs, whose memory is their own (docs/design.md, "The arena backed
// on demand"). One caller at a time maps and unmaps (CudaDevice::set_backing, or
// the context's rebuild); it makes its driver calls with no lock held, so that
// readers of which chunks are backed (a discard's check, gpus/N/memory) never
// wait for the driver: the bookkeeping they read has a lock of its own.
#pragma once

#include <cuda.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "arena/backing_plan.hpp"
#include "vgpu/cuda/cuda_driver.hpp"
#include "vgpu/device.hpp"

namespace salus::vgpu::cuda {

class VmmArena {
 public:
  // Whether the driver and the GPU can back an arena on demand (the VMM calls and
  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED).
  static bool supported(const CudaDriver& drv, CUdevice device);

  VmmArena(const CudaDriver& drv, CUdevice device, Bytes chunk);
  // Frees nothing: release() first while the context is healthy; after a lost
  // context the driver's teardown took everything.
  ~VmmArena() = default;
  VmmArena(const VmmArena&) = delete;
  VmmArena& operator=(const VmmArena&) = delete;

  // Reserves `size` bytes (rounded up to the chunk) of address space, nothing backed.
  CUresult reserve(Bytes size);
  CUdeviceptr base() const { return base_; }
  Bytes chunk() const { return chunk_; }
  // Which chunks are backed (a copy), and whether all of [first, last] are.
  std::vector<bool> backed() const;
  bool all_backed(std::uint64_t first, std::uint64_t last) const;
  Bytes backed_bytes() const { return backed_count_.load(std::memory_order_relaxed) * chunk_; }

  // Backs the run's chunks: cuMemCreate, cuMemMap, cuMemSetAccess. Stops at the
  // first failure; the chunks mapped before it stay mapped (`mapped` says how
  // many, from run.first). Fresh memory holds anything: the caller clears it.
  CUresult map(const arena::ChunkRun& run, std::uint64_t& mapped);
  // Unmaps and releases the run's chunks. Work that used them must be over.
  void unmap(const arena::ChunkRun& run);
  // Unmaps everything and frees the reservation (a healthy context).
  void release();
  // After a context reset: the handles and the reservation went with the context;
  // nothing is backed, and the return value says what was.
  std::vector<bool> forget();

 private:
  const CudaDriver& drv_;
  const CUdevice device_;
  const Bytes chunk_;
  CUdeviceptr base_ = 0;
  Bytes size_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;  // per chunk; 0: not backed (the mapper's)
  mutable std::mutex mu_;                              // guards backed_
  std::vector<bool> backed_;
  std::atomic<std::uint64_t> backed_count_{0};
};

}  // namespace salus::vgpu::cuda
