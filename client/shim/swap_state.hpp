// The shim's movable memory (SALUS_SWAP=1): the types shared by the swap
// itself (swap.cpp: the protocol, the copies, the shim's own allocations) and
// the program's own physical allocations (program_handles.cpp: cuMemCreate
// handles of the shim's standing for the driver's, so that a swap can move
// them too). Internal to libsalus-shim.so; nothing here is exported.
#pragma once

#include <cuda.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "client/salus_gate.h"
#include "client/shim/shim.hpp"

namespace salus::shim::swap_detail {

// The VMM and copy entry points, the real driver's (never the hooks: the
// shim's own memory is charged once, by the allocation hook that asked).
struct VmmDriver {
  bool ok = false;
  CUresult (*reserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                      unsigned long long) = nullptr;
  CUresult (*addr_free)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*map)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) = nullptr;
  CUresult (*granularity)(std::size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*ctx_synchronize)() = nullptr;
  CUresult (*host_alloc)(void**, std::size_t, unsigned) = nullptr;
  CUresult (*free_host)(void*) = nullptr;
  CUresult (*dtoh)(void*, CUdeviceptr, std::size_t) = nullptr;
  CUresult (*htod)(CUdeviceptr, const void*, std::size_t) = nullptr;
  CUresult (*event_query)(CUevent) = nullptr;
  CUresult (*event_destroy)(CUevent) = nullptr;
  // Optional (the spill file's overlapped copy; without them it copies in turns).
  CUresult (*dtoh_async)(void*, CUdeviceptr, std::size_t, CUstream) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_sync)(CUstream) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  std::size_t gran = std::size_t{2} << 20;
};
const VmmDriver& vmm_driver();

// One piece of movable device memory: the physical handle behind it (0 while
// swapped out) and, while swapped (or being swapped), where its copy is.
struct Alloc {
  std::size_t size = 0;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmemGenericAllocationHandle handle = 0;
  void* host = nullptr;  // pinned copy while swapped (or being swapped)
  off_t spill_at = -1;   // else its offset in the spill file
};

// What the program set with cuMemSetAccess on part of a mapping, replayed in
// order when the mapping is made again.
struct Access {
  std::size_t off = 0, size = 0;
  std::vector<CUmemAccessDesc> descs;
};
struct Mapping {
  CUdeviceptr va = 0;
  std::size_t size = 0;
  std::vector<Access> access;
};

// A physical allocation the program made with cuMemCreate (PyTorch's
// expandable segments), known to the program by a handle of the shim's.
// `mem.handle` is the driver's handle, 0 while swapped out. The driver's
// handle is released when the program has released its handle and unmapped
// every mapping of it, as the driver would release the memory.
struct ProgramHandle {
  Alloc mem;
  CUmemAllocationProp prop{};
  int refs = 1;               // cuMemCreate, cuMemRetainAllocationHandle; cuMemRelease drops one
  bool pinned = false;        // shared with the world (exported, bound): never moves
  std::uint64_t counted = 0;  // its bytes in g_movable now
  std::vector<Mapping> maps;
};

struct Registry {
  std::mutex mu;
  std::map<CUdeviceptr, Alloc> allocs;  // the shim's own movable allocations
  std::map<CUmemGenericAllocationHandle, ProgramHandle> handles;  // by the program's handle
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> handle_at;  // mapping address -> handle
  std::uint64_t handles_made = 0;
  bool swapped = false;  // the last swap-out succeeded and no swap-in since
  int spill_fd = -1;
  off_t spill_end = 0;
  std::uint64_t pinned = 0;                 // host bytes held for copies, spare buffers included
  std::multimap<std::size_t, void*> spare;  // pinned buffers kept for the next swap-out
  // Freed with cuMemFreeAsync, released once its event (recorded on the
  // freeing stream) has completed.
  struct Freed {
    CUdeviceptr va;
    Alloc a;
    CUevent done;
  };
  std::vector<Freed> freed;
  const salus_gate* seq_gate = nullptr;  // the gate done_seq counts on (each attach starts at 0)
  std::uint32_t done_seq = 0;
};
Registry& registry();

extern std::atomic<std::uint64_t> g_movable;  // charged bytes a swap can move
extern std::atomic<std::uint64_t> g_swapped;  // of those, now off the GPU

// Sets ctx current if it is not; the caller restores what was current.
void use_ctx(CUcontext ctx, CUcontext& cur);
// Drops a's host copy, if any, keeping its buffer for reuse when `keep`.
// Caller holds the registry.
void drop_copy(const VmmDriver& d, Registry& R, Alloc& a, bool keep = true);

// ---- program_handles.cpp, for the swap (caller holds the registry) ----

// One thing a swap moves: the address it is copied at and its memory; `program`
// is set for a program's own handle (null: one of the shim's allocations).
struct Piece {
  CUdeviceptr va;
  Alloc* a;
  ProgramHandle* program;
};
// Appends the program's handles a swap-out can move now: on the GPU, not
// pinned, and mapped whole somewhere the program may read and write.
void program_handles_to_move(Registry& R, std::vector<Piece>& out);
// Appends the program's handles that are off the GPU (their va: 0).
void program_handles_to_restore(Registry& R, std::vector<Piece>& out);
// After its copy is safe: unmaps every mapping and releases the driver's handle.
void program_handle_out(const VmmDriver& d, ProgramHandle& h);
// Back on the GPU: a new driver handle mapped where the program's was, with
// the program's access, and the contents put back by `copy_in(va)` (0 or
// -errno) through one of them (or a mapping of its own, when the program has
// none). 0 or -errno; on failure nothing of it stays mapped.
int program_handle_in(const VmmDriver& d, ProgramHandle& h,
                      const std::function<int(CUdeviceptr)>& copy_in);

}  // namespace salus::shim::swap_detail
