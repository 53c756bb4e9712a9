// libsalus-shim's internals, shared by its parts:
//   interpose.cpp    how a program reaches the driver: dlsym, cuGetProcAddress(_v2),
//                    the exported cu* symbols, and the real libcuda behind them
//   hooks.cpp        what the hooked entry points do: memory accounting against the
//                    session's budget, and the launch counter with its yield check
//   gate_client.cpp  the gate of client/salus_gate.h: attach, iteration boundaries,
//                    completion of iterations on the GPU, re-attach
//   swap.cpp         movable memory (SALUS_SWAP=1): swapped out and in at boundaries;
//                    program_handles.cpp: the program's own cuMemCreate handles, movable too
//   lane.cpp         the shared lane (SALUS_SHARED_LANE): its memory and allocator;
//                    lane_promotion.cpp: blocks that outlive an iteration, promoted
// The shim depends on nothing of salusd's: it is loaded into arbitrary programs.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "client/salus_gate.h"

namespace salus::shim {

// Every hooked driver function, one signature each (a `_v2` and its `_ptsz`
// twin share an id and differ by slot).
enum Fn : int {
  kInit,
  kGetProcAddress,     // v1 (CUDA 11.3), 4 arguments
  kGetProcAddress_v2,  // CUDA 12.0, 5 arguments
  kMemAlloc,
  kMemAllocPitch,
  kMemFree,
  kMemGetInfo,
  kMemAllocAsync,
  kMemAllocFromPoolAsync,
  kMemFreeAsync,
  kMemCreate,
  kMemRelease,
  kMemMap,
  kMemUnmap,
  kMemSetAccess,
  kMemGetAccess,
  kMemRetainAllocationHandle,
  kMemGetAllocationPropertiesFromHandle,
  kMemExportToShareableHandle,
  kMemGetHandleForAddressRange,
  kMulticastBindMem,
  kMulticastBindAddr,
  kMemAllocManaged,
  kLaunchKernel,
  kLaunchKernelEx,
  kLaunchCooperativeKernel,
  kGraphLaunch,
  kMemcpyHtoDAsync,
  kMemcpyDtoHAsync,
  kMemcpyDtoDAsync,
  kMemcpyAsync,
  kMemsetD8Async,
  kMemsetD32Async,
  kFnCount
};
// Slot 0: the legacy-default-stream function; slot 1: its per-thread (_ptsz) twin.
constexpr int kSlots = 2;

// The real driver function behind each hook, set when the hook is handed out
// (from the driver's own answer) or on the first direct call (from libcuda's
// exported symbol). Read with a relaxed load on every call.
extern std::atomic<void*> g_real[kFnCount][kSlots];
void* resolve_real(Fn f, int slot);  // slow path: the exported symbol, or null

template <typename F>
inline F real(Fn f, int slot = 0) {
  void* p = g_real[f][slot].load(std::memory_order_relaxed);
  if (__builtin_expect(p == nullptr, 0)) p = resolve_real(f, slot);
  return reinterpret_cast<F>(p);
}

// The driver functions the shim calls for itself (events, contexts), resolved
// once through the real cuGetProcAddress_v2 at CUDA 12.0. `ok` is false without
// a driver (CPU-only programs): then iterations are timed by wall clock.
struct Driver {
  bool ok = false;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*event_synchronize)(CUevent) = nullptr;
  CUresult (*event_elapsed)(float*, CUevent, CUevent) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*stream_is_capturing)(CUstream, CUstreamCaptureStatus*) = nullptr;
};
const Driver& driver();
void* driver_handle();                             // libcuda, dlopened once; null if none
void* driver_proc(const char* name);               // the real driver's answer at CUDA 12.0
void* real_dlsym(void* handle, const char* name);  // glibc's dlsym

// One hooked entry point as cuGetProcAddress knows it: `name` answers with this
// signature for requested versions from `version` up to the next entry of the
// same name. `symbol` is libcuda's exported name of each slot (null: no _ptsz).
struct HookEntry {
  const char* name;
  int version;
  Fn fn;
  void* hook[kSlots];
  const char* symbol[kSlots];
};
const HookEntry* find_hook(const char* name, int version);
const HookEntry* find_hook_by_symbol(const char* symbol, int* slot);
const HookEntry* find_hook_by_fn(Fn f);

// ---- gate_client.cpp ----

// The gate the hooks count into: the attached session's shared page, or a
// private one while not attached (budget unlimited until a first attach).
// Never null, never unmapped (hooks on other threads may still hold it).
extern std::atomic<salus_gate*> g_gate;
inline salus_gate* gate() {
  return g_gate.load(std::memory_order_acquire);
}
void after_cuinit();  // first successful cuInit: attach
// Before each device allocation of the program (charge() with a `what`, a lane
// allocation); past the first, one relaxed load. The first sets the gate's
// uses_gpu and makes the attach a launcher's worker was refused before.
void note_gpu_use();
void implicit_boundary(CUstream stream);  // a launch saw yield_requested
void post_note(const char* text);         // the note line, note_seq, doorbell
void ring_bell();                         // the current gate's doorbell, if attached

// ---- hooks.cpp ----

std::uint64_t charged_now();  // process-wide bytes charged (for a new gate)
void publish();               // mirrors charged, peak and the swap figures into the gate
// Charges n bytes to the budget; false (nothing charged) if that would pass it.
// With `what` a refusal also posts the out-of-memory note; null: the caller does.
bool charge(std::uint64_t n, const char* what);
void refund(std::uint64_t n);

// ---- driver_oom.cpp ----

// A driver out-of-memory on an allocation the budget allowed, tried again for a
// moment (the card may still be freeing what admission promised): wait() sleeps
// before the next try, false once the window is over or nothing was promised;
// finish() posts the note. Built on the failure path only.
class DriverOomRetry {
 public:
  DriverOomRetry(std::uint64_t bytes, const char* what);
  bool wait();
  void finish(CUresult last);

 private:
  std::uint64_t bytes_;
  const char* what_;
  std::int64_t start_ns_;
  std::int64_t sleep_ns_ = 1'000'000;
  unsigned tries_ = 0;
};
// `call`, an allocation of `bytes` already charged, tried again while the driver
// has no memory for it (one compare when it succeeds).
template <typename Call>
CUresult with_driver_oom_retry(std::uint64_t bytes, const char* what, Call call) {
  CUresult r = call();
  if (__builtin_expect(r != CUDA_ERROR_OUT_OF_MEMORY, 1)) return r;
  DriverOomRetry retry(bytes, what);
  while (r == CUDA_ERROR_OUT_OF_MEMORY && retry.wait()) r = call();
  retry.finish(r);
  return r;
}

// ---- swap.cpp: movable memory (SALUS_SWAP=1) ----
// Pinned device memory of `dev`: how the shim's own VMM allocations are made
// (movable memory here, promoted lane blocks in lane_promotion.cpp).
CUmemAllocationProp device_prop(CUdevice dev);

// Whether cuMemAlloc_v2 / cuMemAllocPitch_v2 are served from driver VMM, which
// the shim can move off the GPU and back to the same address.
bool swap_enabled();
std::size_t swap_granularity();  // allocations are rounded up to this
// A movable allocation of exactly n bytes (a multiple of swap_granularity()).
CUresult movable_alloc(CUdeviceptr* p, std::size_t n);
// If p is a movable allocation, frees it (on the device or its host copy) and
// returns true with the driver's answer in *r; false: not ours.
bool movable_free(CUdeviceptr p, CUresult* r);
// cuMemFreeAsync of a movable allocation: released once the work queued on
// `stream` before the free has completed (an event; checked at the next
// allocation and at the gate). True with the answer in *r; false: not ours.
bool movable_free_async(CUdeviceptr p, CUstream stream, CUresult* r);
bool stream_capturing(CUstream stream);  // true also when the driver cannot tell
std::uint64_t movable_bytes();           // charged bytes the shim can move
std::uint64_t swapped_bytes();           // of those, now off the GPU
// At the gate, while the program waits: carries out a new swap request of g,
// if any. `running`: the program holds a grant (a swap-out is refused then).
void serve_swap(salus_gate* g, bool running);
// Before the program runs: brings swapped memory back. False if it could not
// (device memory not free yet; the result and a note are in the gate).
bool ensure_resident(salus_gate* g);

// ---- program_handles.cpp: the program's own physical allocations (SALUS_SWAP=1) ----
// A cuMemCreate of plain device memory gives the program a handle of the
// shim's standing for the driver's (which a swap releases and makes again at
// the same addresses); every entry point that takes or returns a handle
// translates it. The tag is in bits no driver handle uses; a tagged value the
// shim does not know is answered as the driver answers an unknown handle.
constexpr CUmemGenericAllocationHandle kProgramHandleTag = 0x5a15000000000000ULL;
inline bool is_program_handle(CUmemGenericAllocationHandle h) {
  return (h & 0xffff000000000000ULL) == kProgramHandleTag;
}
// Whether a cuMemCreate of `prop` gets a handle of the shim's: SALUS_SWAP=1,
// pinned device memory, no special usage (tile pools stay the driver's).
bool program_handle_wanted(const CUmemAllocationProp* prop, unsigned long long flags);
CUresult program_handle_create(CUmemGenericAllocationHandle* h, std::size_t n,
                               const CUmemAllocationProp* prop);
CUresult program_handle_release(CUmemGenericAllocationHandle h);
CUresult program_handle_map(CUdeviceptr p, std::size_t n, std::size_t off,
                            CUmemGenericAllocationHandle h, unsigned long long flags);
// cuMemUnmap / cuMemSetAccess of a range holding mappings of the program's
// handles: true with the answer in *r; false: none there, the caller passes
// the call on to the driver.
bool program_handles_unmap(CUdeviceptr p, std::size_t n, CUresult* r);
bool program_handles_set_access(CUdeviceptr p, std::size_t n, const CUmemAccessDesc* desc,
                                std::size_t count, CUresult* r);
// cuMemRetainAllocationHandle of an address a program handle is mapped at:
// true with *h set (one more reference); false: not one of them.
bool program_handle_retain(CUmemGenericAllocationHandle* h, void* addr);
CUresult program_handle_properties(CUmemAllocationProp* prop, CUmemGenericAllocationHandle h);
// cuMemGetAccess of a program mapping that is off the GPU: true with what the
// program set there; false: the driver answers.
bool program_handle_access(unsigned long long* flags, const CUmemLocation* where, CUdeviceptr p);
// The driver's handle behind h, which is being shared with the world
// (exported, bound to a multicast object): it stays on the GPU from now on.
// CUDA_ERROR_NOT_PERMITTED while it is swapped out (with a note).
CUresult program_handle_pin(CUmemGenericAllocationHandle h, CUmemGenericAllocationHandle* real);
void program_handles_pin_range(CUdeviceptr p, std::size_t n);  // a dma-buf, a multicast bind

// ---- lane.cpp: the shared lane (SALUS_SHARED_LANE=1 or alloc) ----

// At attach: a fresh socket pair; returns salusd's end (named in lane=), or
// -1 when the program did not opt in. lane_attach_done closes that end once
// the attach write is done (salusd took its copy) and, if it failed, ours too.
int lane_socket_for_attach();
void lane_attach_done(bool ok);
// In wait_grant, while the program waits (never on a launch): gives the lane
// back when salusd asked (synchronize, unmap, lane_held = 0, ring) and maps it
// when `granted` and salusd grants it.
void serve_lane(salus_gate* g, bool granted);
// At every boundary: the iteration's salus_lane_alloc allocations end (returns
// how many were still live); with SALUS_SHARED_LANE=alloc, cuMemAlloc blocks
// still live are promoted to memory of the program's own at the same address.
std::size_t lane_boundary();
// SALUS_SHARED_LANE=alloc: serves cuMemAlloc_v2 (also cuMemAllocPitch_v2 and,
// outside stream capture, cuMemAllocAsync) from the lane while the program
// holds it and it has room (true, *p set, nothing charged); false: the caller
// takes the normal path.
bool lane_try_alloc(CUdeviceptr* p, std::size_t n);
// If p is a block lane_try_alloc gave (still in the lane, promoted, or kept),
// frees it and returns true with the answer in *r; false: not the lane's.
bool lane_try_free(CUdeviceptr p, CUresult* r);
// The same for cuMemFreeAsync: the block's room is reused once `stream` has
// reached the free (an event; a synchronous free where events fail).
bool lane_try_free_async(CUdeviceptr p, CUstream stream, CUresult* r);
// Whether lane_try_alloc may serve allocations now (mode alloc, attached): a
// hook that must ask the driver something first asks only then.
bool lane_serves_allocs();
// salusd let go: unmap and drop everything of the lane.
void lane_detach(salus_gate* g);
void lane_forget_in_child();
// SALUS_SHARED_LANE=segments: the lane is room, not memory (lane_room.cpp).
bool lane_room_mode();    // opted in so (attach says lane_room=1)
bool lane_room_active();  // and attached with the lane socket

// ---- lane_room.cpp: the shared lane as room for the program's cuMemCreate ----
// A cuMemCreate of plain device memory while the program holds the lane:
// made (or a spare reused) uncharged, within the lane's size. True with *r
// set (the driver's answer, after the out-of-memory retry); false: not the
// room's to serve (not held, full, or not plain device memory): the ordinary,
// charged path.
bool room_create(CUmemGenericAllocationHandle* h, std::size_t n, const CUmemAllocationProp* prop,
                 unsigned long long flags, CUresult* r);
// The program's cuMemRelease of a room handle (true, *r: the answer): the
// last reference is kept as a spare, not released.
bool room_release(CUmemGenericAllocationHandle h, CUresult* r);
void room_retained(CUmemGenericAllocationHandle h);  // after the driver's retain
// After the driver mapped h at p: true if h is the room's (recorded there).
bool room_mapped(CUdeviceptr p, std::size_t n, CUmemGenericAllocationHandle h);
void room_unmapped(CUdeviceptr p, std::size_t n);  // after the driver's unmap
void room_boundary();                              // live room handles are charged as persistent
void room_serve(salus_gate* g);   // salusd asked for the lane: clear, release, yield
void room_detach(salus_gate* g);  // salusd let go
void room_forget_in_child();
// hooks.cpp: a handle made elsewhere, charged `bytes` already, is accounted as
// the program's own from now on (refs references, mapped at those addresses).
void vmm_adopt(CUmemGenericAllocationHandle h, std::uint64_t bytes, int refs,
               const std::vector<CUdeviceptr>& mapped_at);

}  // namespace salus::shim
