// The shim's shared-lane state (lane.cpp) and the promotion of blocks that
// outlive their iteration (lane_promotion.cpp): the types both share. Internal
// to libsalus-shim.so; nothing here is exported.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "client/salus_gate.h"
#include "client/shim/shim.hpp"

namespace salus::shim::lane_detail {

struct LaneDriver {
  bool ok = false;
  CUresult (*import)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                      unsigned long long) = nullptr;
  CUresult (*addr_free)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*map)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*ctx_synchronize)() = nullptr;
  // For promotion (SALUS_SHARED_LANE=alloc); promote_ok says all are there.
  bool promote_ok = false;
  CUresult (*create)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;
  CUresult (*granularity)(std::size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*copy)(CUdeviceptr, CUdeviceptr, std::size_t) = nullptr;  // cuMemcpyDtoD_v2
  // For clearing the room's spares (lane_room.cpp), on the context's NULL
  // stream, then a synchronize; null: they go back uncleared (noted).
  CUresult (*memset_async)(CUdeviceptr, unsigned char, std::size_t, CUstream) = nullptr;
  // For stream-ordered frees of lane blocks (cuMemFreeAsync); events_ok says all
  // are there, else such a free is a synchronous one.
  bool events_ok = false;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*event_query)(CUevent) = nullptr;
  CUresult (*event_synchronize)(CUevent) = nullptr;
  CUresult (*event_destroy)(CUevent) = nullptr;
};
const LaneDriver& lane_driver();

constexpr std::size_t kMaxBlocks = 1024;  // live lane allocations per iteration
constexpr std::size_t kAlign = 512;       // what cudaMalloc guarantees, and more

struct Block {
  std::size_t off;
  std::size_t len;
  bool hooked;  // cuMemAlloc (promoted at the boundary), not salus_lane_alloc
  // Freed with cuMemFreeAsync: the block's room is free once this event, recorded
  // on the freeing stream, has completed (reclaim_locked).
  CUevent freed = nullptr;
};

// A former lane reservation that holds promoted blocks: each granule with a
// live block is a handle of the program's own (charged), mapped there. Or,
// `kept`: the old lane memory itself stays mapped there (promotion failed and
// salusd abandoned that memory to the program); `kept_live` blocks in it.
// The reservation is freed once its last block is.
struct Granule {
  CUmemGenericAllocationHandle handle;
  std::size_t live;  // blocks that touch it
};
struct Region {
  std::size_t size = 0;
  std::size_t gran = 0;
  std::map<std::size_t, Granule> granules;  // by index from the base
  bool kept = false;
  std::size_t kept_live = 0;
};
struct Owned {
  CUdeviceptr region;  // its base
  std::size_t len;
};

// All state under `mu`: salus_lane_alloc may come from any thread.
struct Lane {
  std::mutex mu;
  std::atomic<bool> on{false};  // opted in and attached: read without the lock
  int sock = -1;                // the program's end of the socket pair
  int peer = -1;                // salusd's end, until the attach write is done
  // The latest memory salusd sent.
  int mem_fd = -1;
  std::uint32_t mem_gen = 0;
  std::size_t mem_bytes = 0;
  // What is imported, reserved and mapped.
  CUmemGenericAllocationHandle handle = 0;
  std::uint32_t handle_gen = 0;
  CUdeviceptr base = 0;
  std::size_t reserved = 0;
  std::uint32_t mapped_gen = 0;  // 0: not mapped
  CUcontext ctx = nullptr;       // of the mapping (the yield synchronizes it)
  salus_gate* gate = nullptr;    // where lane_held was reported
  Block blocks[kMaxBlocks];      // sorted by offset
  std::size_t nblocks = 0;
  bool reported_fail = false;
  std::atomic<bool> ever_hooked{false};  // a cuMemAlloc was served: cuMemFree looks here
  bool promote_failed = false;           // noted; quiet until a promotion succeeds
};

// SALUS_SHARED_LANE=alloc: the blocks that outlived the lane, by address, and
// their regions (under the lane's mutex). Heap-allocated and never destroyed.
struct Outlived {
  std::map<CUdeviceptr, Region> regions;
  std::map<CUdeviceptr, Owned> owned;
};
Outlived& outlived();

// The lane's context current on this thread for its lifetime (the hooks may
// run on a thread with another, or none).
class CtxScope {
 public:
  explicit CtxScope(CUcontext ctx) : ctx_(ctx) {
    driver().ctx_get_current(&prev_);
    if (ctx_ != nullptr && prev_ != ctx_) driver().ctx_set_current(ctx_);
  }
  ~CtxScope() {
    if (ctx_ != nullptr && prev_ != ctx_) driver().ctx_set_current(prev_);
  }
  CtxScope(const CtxScope&) = delete;
  CtxScope& operator=(const CtxScope&) = delete;

 private:
  CUcontext ctx_;
  CUcontext prev_ = nullptr;
};

// Read and write access for `dev` to [p, p + n), mapped a moment before.
CUresult grant_access(const LaneDriver& d, CUdeviceptr p, std::size_t n, CUdevice dev);

// At the boundary, with only cuMemAlloc blocks left in L.blocks (at least
// one): promotes them to memory of the program's own at the same addresses.
// False: they stay in the lane (a note says why). Caller holds L.mu.
bool promote_locked(Lane& L);
// Frees a block that outlived the lane (caller holds L.mu).
CUresult free_owned_locked(Lane& L, std::map<CUdeviceptr, Owned>::iterator it);

}  // namespace salus::shim::lane_detail
