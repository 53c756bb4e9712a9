// What the hooked driver entry points do before they reach libcuda.
//
// Memory: every allocation path is charged to the session before the driver
// sees it and refunded when it is freed, so the session never holds more than
// its budget (gate->budget_bytes). Charges are tracked by device pointer
// (cuMemAlloc*, stream-ordered allocations) or by physical handle (cuMemCreate:
// the charge follows the handle until it is released *and* unmapped, which is
// when the driver gives the memory back). Managed memory is refused: the driver
// can place it on any device and evict it at will, so it cannot be held to a
// budget. The device comes from the allocation itself (prop->location), never
// from cuCtxGetDevice, which fails on threads without a context. The one
// exception: with SALUS_SHARED_LANE=alloc, a cuMemAlloc made while the program
// holds the shared lane comes from the lane, which admission counted once for
// the GPU's group, and is charged only if it outlives its iteration (lane.cpp).
//
// Launches: a relaxed increment of gate->launches and a relaxed load of
// gate->yield_requested; nothing else on that path.
#include <cinttypes>
#include <cstdio>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "client/shim/shim.hpp"

#define SALUS_EXPORT __attribute__((visibility("default")))

namespace salus::shim {
namespace {

std::atomic<std::uint64_t> g_charged{0};
std::atomic<std::uint64_t> g_peak{0};

// Device pointer -> bytes charged, sharded so that allocating threads rarely
// meet on one lock. Heap-allocated and never destroyed: hooks may run from
// other libraries' constructors and destructors.
struct Shard {
  std::mutex mu;
  std::unordered_map<CUdeviceptr, std::uint64_t> bytes;
};
constexpr std::size_t kShards = 64;
Shard* shards() {
  alignas(Shard) static unsigned char storage[sizeof(Shard) * kShards];
  static Shard* s = [] {
    for (std::size_t i = 0; i < kShards; ++i) new (storage + i * sizeof(Shard)) Shard;
    return reinterpret_cast<Shard*>(storage);
  }();
  return s;
}
Shard& shard_of(CUdeviceptr p) {
  return shards()[(p >> 9) % kShards];  // allocations are at least 512-byte aligned
}

// VMM: physical handles and where they are mapped.
struct Handle {
  std::uint64_t bytes = 0;  // charged (0 for host-located handles)
  int refs = 1;             // cuMemCreate, cuMemRetainAllocationHandle; cuMemRelease drops one
  int maps = 0;
  bool released = false;
};
struct Vmm {
  std::mutex mu;
  std::unordered_map<CUmemGenericAllocationHandle, Handle> handles;
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> mappings;
};
Vmm& vmm() {
  static Vmm* v = new Vmm;
  return *v;
}

}  // namespace

// Mirrors the process's figures into the gate. A thread that stored a value
// another thread has since changed stores again, so the gate ends up exact.
// resident and unswappable follow from charged, movable and swapped (swap.cpp).
void publish() {
  salus_gate* g = gate();
  std::uint64_t v, m, sw;
  do {
    v = g_charged.load(std::memory_order_acquire);
    m = movable_bytes();
    sw = swapped_bytes();
    __atomic_store_n(&g->charged_bytes, v, __ATOMIC_RELAXED);
    __atomic_store_n(&g->resident_bytes, v > sw ? v - sw : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g->swapped_bytes, sw, __ATOMIC_RELAXED);
    __atomic_store_n(&g->unswappable_bytes, v > m ? v - m : 0, __ATOMIC_RELAXED);
  } while (g_charged.load(std::memory_order_acquire) != v || movable_bytes() != m ||
           swapped_bytes() != sw);
  do {
    v = g_peak.load(std::memory_order_acquire);
    __atomic_store_n(&g->peak_bytes, v, __ATOMIC_RELAXED);
  } while (g_peak.load(std::memory_order_acquire) != v);
}

namespace {

void refuse(salus_gate* g, std::uint64_t budget, std::uint64_t charged, std::uint64_t n,
            const char* what) {
  __atomic_fetch_add(&g->oom_refusals, 1, __ATOMIC_RELAXED);
  char line[320];
  std::snprintf(line, sizeof line,
                "out of memory: budget %" PRIu64 ", charged %" PRIu64 ", request %" PRIu64 " (%s)",
                budget, charged, n, what);
  post_note(line);
}

void track(CUdeviceptr p, std::uint64_t n) {
  Shard& s = shard_of(p);
  std::lock_guard lk(s.mu);
  s.bytes[p] = n;
}
// The bytes charged for p, forgotten; 0 if p is not ours (e.g. allocated
// before the shim saw the driver, or through an unhooked newer entry point).
std::uint64_t untrack(CUdeviceptr p) {
  Shard& s = shard_of(p);
  std::lock_guard lk(s.mu);
  auto it = s.bytes.find(p);
  if (it == s.bytes.end()) return 0;
  const std::uint64_t n = it->second;
  s.bytes.erase(it);
  return n;
}

// An allocation of n bytes through `call`: charged first, refunded on failure.
template <typename Call>
CUresult charged_alloc(CUdeviceptr* p, std::uint64_t n, const char* what, Call call) {
  if (!charge(n, what)) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUresult r = with_driver_oom_retry(n, what, call);
  if (r != CUDA_SUCCESS || p == nullptr) {
    refund(n);
    return r;
  }
  track(*p, n);
  return r;
}

inline void on_launch(CUstream stream) {
  salus_gate* g = gate();
  __atomic_fetch_add(&g->launches, 1, __ATOMIC_RELAXED);
  if (__builtin_expect(__atomic_load_n(&g->yield_requested, __ATOMIC_RELAXED) != 0, 0))
    implicit_boundary(stream);
}

// Drops one mapping of h; refunds h once it is released and mapped nowhere. Caller holds v.mu.
std::uint64_t unmap_locked(Vmm& v, CUmemGenericAllocationHandle h) {
  auto it = v.handles.find(h);
  if (it == v.handles.end()) return 0;
  if (it->second.maps > 0) --it->second.maps;
  if (!it->second.released || it->second.maps > 0) return 0;
  const std::uint64_t n = it->second.bytes;
  v.handles.erase(it);
  return n;
}

}  // namespace

std::uint64_t charged_now() {
  return g_charged.load(std::memory_order_acquire);
}

void vmm_adopt(CUmemGenericAllocationHandle h, std::uint64_t bytes, int refs,
               const std::vector<CUdeviceptr>& mapped_at) {
  Vmm& v = vmm();
  std::lock_guard lk(v.mu);
  Handle& rec = v.handles[h];
  rec = Handle{bytes, refs, static_cast<int>(mapped_at.size()), refs == 0};
  for (CUdeviceptr p : mapped_at) v.mappings[p] = h;
}

// Charges n bytes, or refuses if that would pass the budget: with `what`, a
// refusal is an out-of-memory note and counts in oom_refusals; without, the
// caller says why (the lane's promotion, lane.cpp).
bool charge(std::uint64_t n, const char* what) {
  if (what != nullptr) note_gpu_use();  // may attach: gate() is read after it
  salus_gate* g = gate();
  const std::uint64_t budget = __atomic_load_n(&g->budget_bytes, __ATOMIC_ACQUIRE);
  std::uint64_t cur = g_charged.load(std::memory_order_relaxed);
  do {
    if (budget != UINT64_MAX && (n > budget || cur > budget - n)) {
      if (what != nullptr) refuse(g, budget, cur, n, what);
      return false;
    }
  } while (!g_charged.compare_exchange_weak(cur, cur + n, std::memory_order_acq_rel));
  std::uint64_t peak = g_peak.load(std::memory_order_relaxed);
  while (cur + n > peak && !g_peak.compare_exchange_weak(peak, cur + n)) {
  }
  publish();
  return true;
}

void refund(std::uint64_t n) {
  if (n == 0) return;
  g_charged.fetch_sub(n, std::memory_order_acq_rel);
  publish();
}

}  // namespace salus::shim

using namespace salus::shim;

// ---- memory ----

namespace {
std::uint64_t round_up(std::uint64_t n, std::uint64_t to) {
  return (n + to - 1) / to * to;
}
// Movable (SALUS_SWAP=1): the allocation is the driver's VMM, rounded up to
// its granularity, and charged at the rounded size (what the GPU gives up).
CUresult movable_charged(CUdeviceptr* p, std::uint64_t n, const char* what) {
  if (n == 0 || p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const std::uint64_t taken = round_up(n, swap_granularity());
  const CUresult r = charged_alloc(p, taken, what, [&] { return movable_alloc(p, taken); });
  if (r == CUDA_SUCCESS) publish();  // movable_bytes changed after the charge
  return r;
}
}  // namespace

extern "C" SALUS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t n) {
  // SALUS_SHARED_LANE=alloc: from the lane while the program holds it (not charged).
  if (p != nullptr && n != 0 && lane_try_alloc(p, n)) return CUDA_SUCCESS;
  if (swap_enabled()) return movable_charged(p, n, "cuMemAlloc");
  auto f = real<PFN_cuMemAlloc_v3020>(kMemAlloc);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return charged_alloc(p, n, "cuMemAlloc", [&] { return f(p, n); });
}

extern "C" SALUS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* p, std::size_t* pitch,
                                                    std::size_t width, std::size_t height,
                                                    unsigned elem) {
  const bool pitch_ok = (elem == 4 || elem == 8 || elem == 16) && pitch != nullptr;
  // Rows padded to 512 bytes, which meets every GPU's texture pitch alignment.
  if (pitch_ok && p != nullptr && width != 0 && height != 0 &&
      lane_try_alloc(p, round_up(width, 512) * height)) {
    *pitch = round_up(width, 512);
    return CUDA_SUCCESS;
  }
  if (swap_enabled()) {
    // Rows padded to 512 bytes, which meets every GPU's texture pitch alignment.
    if ((elem != 4 && elem != 8 && elem != 16) || pitch == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const std::uint64_t row = round_up(width, 512);
    const CUresult r = movable_charged(p, row * height, "cuMemAllocPitch");
    if (r == CUDA_SUCCESS) *pitch = row;
    return r;
  }
  auto f = real<PFN_cuMemAllocPitch_v3020>(kMemAllocPitch);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  // The pitch is the driver's choice: charge width*height first, then the padding.
  const std::uint64_t base = std::uint64_t{width} * height;
  if (!charge(base, "cuMemAllocPitch")) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUresult r = with_driver_oom_retry(base, "cuMemAllocPitch",
                                           [&] { return f(p, pitch, width, height, elem); });
  if (r != CUDA_SUCCESS) {
    refund(base);
    return r;
  }
  const std::uint64_t total = std::uint64_t{*pitch} * height;
  if (total > base && !charge(total - base, "cuMemAllocPitch")) {
    if (auto fr = real<PFN_cuMemFree_v3020>(kMemFree)) fr(*p);
    refund(base);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  track(*p, total > base ? total : base);
  return r;
}

extern "C" SALUS_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  if (CUresult lr; lane_try_free(p, &lr)) return lr;  // a lane block, or a promoted one
  if (CUresult mr; movable_free(p, &mr)) {
    if (mr == CUDA_SUCCESS) refund(untrack(p));
    return mr;
  }
  auto f = real<PFN_cuMemFree_v3020>(kMemFree);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = f(p);
  if (r == CUDA_SUCCESS) refund(untrack(p));
  return r;
}

// The session's view: its budget is the card. PyTorch sizes its allocator
// (and the cudaMallocAsync backend checks free <= total) from this.
extern "C" SALUS_EXPORT CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
  auto f = real<PFN_cuMemGetInfo_v3020>(kMemGetInfo);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = f(free, total);
  const std::uint64_t budget = __atomic_load_n(&gate()->budget_bytes, __ATOMIC_ACQUIRE);
  if (r != CUDA_SUCCESS || budget == UINT64_MAX || free == nullptr || total == nullptr) return r;
  const std::uint64_t charged = charged_now();
  const std::uint64_t left = charged >= budget ? 0 : budget - charged;
  *total = budget;
  if (*free > left) *free = left;
  return r;
}

namespace {
// The stream a _ptsz entry point's null stream means, for calls the shim makes itself.
template <int Slot>
CUstream own_stream(CUstream s) {
  return Slot == 1 && s == nullptr ? CU_STREAM_PER_THREAD : s;
}
template <int Slot>
CUresult alloc_async(CUdeviceptr* p, std::size_t n, CUstream s) {
  // From the lane, unless captured into a graph (whose allocation node must stay
  // the driver's): at once, which is also in the stream's order.
  if (p != nullptr && n != 0 && lane_serves_allocs() && !stream_capturing(own_stream<Slot>(s)) &&
      lane_try_alloc(p, n))
    return CUDA_SUCCESS;
  // Movable (SALUS_SWAP=1), unless captured into a graph: the graph's own
  // allocation node must stay the driver's.
  if (swap_enabled() && !stream_capturing(own_stream<Slot>(s)))
    return movable_charged(p, n, "cuMemAllocAsync");
  auto f = real<PFN_cuMemAllocAsync_v11020>(kMemAllocAsync, Slot);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return charged_alloc(p, n, "cuMemAllocAsync", [&] { return f(p, n, s); });
}
template <int Slot>
CUresult alloc_from_pool_async(CUdeviceptr* p, std::size_t n, CUmemoryPool pool, CUstream s) {
  auto f = real<PFN_cuMemAllocFromPoolAsync_v11020>(kMemAllocFromPoolAsync, Slot);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return charged_alloc(p, n, "cuMemAllocFromPoolAsync", [&] { return f(p, n, pool, s); });
}
// Refunded when the free is enqueued: the pool may keep the pages reserved
// (until cuMemPoolTrimTo), but the session no longer holds them, and the
// driver's own free figure in cuMemGetInfo still bounds what is left.
template <int Slot>
CUresult free_async(CUdeviceptr p, CUstream s) {
  if (CUresult lr; lane_try_free_async(p, own_stream<Slot>(s), &lr)) return lr;
  if (CUresult mr; movable_free_async(p, own_stream<Slot>(s), &mr)) {
    if (mr == CUDA_SUCCESS) refund(untrack(p));
    return mr;
  }
  auto f = real<PFN_cuMemFreeAsync_v11020>(kMemFreeAsync, Slot);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = f(p, s);
  if (r == CUDA_SUCCESS) refund(untrack(p));
  return r;
}
}  // namespace

extern "C" SALUS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr* p, std::size_t n, CUstream s) {
  return alloc_async<0>(p, n, s);
}
extern "C" SALUS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr* p, std::size_t n, CUstream s) {
  return alloc_async<1>(p, n, s);
}
extern "C" SALUS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, std::size_t n,
                                                         CUmemoryPool pool, CUstream s) {
  return alloc_from_pool_async<0>(p, n, pool, s);
}
extern "C" SALUS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* p, std::size_t n,
                                                              CUmemoryPool pool, CUstream s) {
  return alloc_from_pool_async<1>(p, n, pool, s);
}
extern "C" SALUS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
  return free_async<0>(p, s);
}
extern "C" SALUS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
  return free_async<1>(p, s);
}

extern "C" SALUS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* h, std::size_t n,
                                             const CUmemAllocationProp* prop,
                                             unsigned long long flags) {
  auto f = real<PFN_cuMemCreate_v10020>(kMemCreate);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  // Only device-located memory counts against the GPU budget (host VMM does not).
  const bool on_device = prop != nullptr && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
  const std::uint64_t bytes = on_device ? n : 0;
  // SALUS_SHARED_LANE=segments: made uncharged in the lane's room while the
  // program holds it (lane_room.cpp).
  if (CUresult rr; on_device && room_create(h, n, prop, flags, &rr)) return rr;
  // With a shared lane the budget is the persistent need alone: say why
  // memory the program means as ephemeral (expandable segments) ran out.
  const char* what =
      lane_serves_allocs() ? "cuMemCreate, which SALUS_SHARED_LANE=alloc does not serve "
                             "(=segments does): PyTorch's expandable_segments memory is charged "
                             "as persistent"
      : lane_room_active() ? "cuMemCreate past the shared lane's room, or while the lane is not "
                             "held: charged as persistent"
                           : "cuMemCreate";
  if (bytes > 0 && !charge(bytes, what)) return CUDA_ERROR_OUT_OF_MEMORY;
  // Movable (SALUS_SWAP=1): the program gets a handle of the shim's.
  const bool own = program_handle_wanted(prop, flags);
  auto create = [&] { return own ? program_handle_create(h, n, prop) : f(h, n, prop, flags); };
  const CUresult r = on_device ? with_driver_oom_retry(n, "cuMemCreate", create) : create();
  if (r != CUDA_SUCCESS || h == nullptr) {
    refund(bytes);
    return r;
  }
  Vmm& v = vmm();
  std::lock_guard lk(v.mu);
  v.handles[*h] = Handle{bytes};
  return r;
}

extern "C" SALUS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  CUresult r;
  if (room_release(h, &r)) return r;  // the lane's room keeps it
  if (is_program_handle(h)) {
    r = program_handle_release(h);
  } else {
    auto f = real<PFN_cuMemRelease_v10020>(kMemRelease);
    if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
    r = f(h);
  }
  if (r != CUDA_SUCCESS) return r;
  std::uint64_t n = 0;
  {
    Vmm& v = vmm();
    std::lock_guard lk(v.mu);
    auto it = v.handles.find(h);
    if (it != v.handles.end() && --it->second.refs == 0) {
      it->second.released = true;
      if (it->second.maps == 0) {
        n = it->second.bytes;
        v.handles.erase(it);
      }
    }
  }
  refund(n);
  return r;
}

// Another reference to the handle mapped at addr: the charge stays until the
// last one is released.
extern "C" SALUS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* h,
                                                             void* addr) {
  CUresult r = CUDA_SUCCESS;
  if (!program_handle_retain(h, addr)) {
    auto f = real<PFN_cuMemRetainAllocationHandle_v11000>(kMemRetainAllocationHandle);
    if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
    r = f(h, addr);
  }
  if (r != CUDA_SUCCESS || h == nullptr) return r;
  room_retained(*h);
  Vmm& v = vmm();
  std::lock_guard lk(v.mu);
  if (auto it = v.handles.find(*h); it != v.handles.end()) ++it->second.refs;
  return r;
}

extern "C" SALUS_EXPORT CUresult cuMemMap(CUdeviceptr p, std::size_t n, std::size_t off,
                                          CUmemGenericAllocationHandle h,
                                          unsigned long long flags) {
  CUresult r;
  if (is_program_handle(h)) {
    r = program_handle_map(p, n, off, h, flags);
  } else {
    auto f = real<PFN_cuMemMap_v10020>(kMemMap);
    if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
    r = f(p, n, off, h, flags);
  }
  if (r != CUDA_SUCCESS || room_mapped(p, n, h)) return r;
  Vmm& v = vmm();
  std::lock_guard lk(v.mu);
  auto it = v.handles.find(h);
  if (it != v.handles.end()) {
    ++it->second.maps;
    v.mappings[p] = h;
  }
  return r;
}

extern "C" SALUS_EXPORT CUresult cuMemUnmap(CUdeviceptr p, std::size_t n) {
  CUresult r;
  if (!program_handles_unmap(p, n, &r)) {
    auto f = real<PFN_cuMemUnmap_v10020>(kMemUnmap);
    if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
    r = f(p, n);
  }
  if (r != CUDA_SUCCESS) return r;
  room_unmapped(p, n);
  std::uint64_t refunded = 0;
  {
    Vmm& v = vmm();
    std::lock_guard lk(v.mu);
    for (auto it = v.mappings.lower_bound(p); it != v.mappings.end() && it->first < p + n;) {
      refunded += unmap_locked(v, it->second);
      it = v.mappings.erase(it);
    }
  }
  refund(refunded);
  return r;
}

extern "C" SALUS_EXPORT CUresult cuMemSetAccess(CUdeviceptr p, std::size_t n,
                                                const CUmemAccessDesc* desc, std::size_t count) {
  if (CUresult r; program_handles_set_access(p, n, desc, count, &r)) return r;
  auto f = real<PFN_cuMemSetAccess_v10020>(kMemSetAccess);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return f(p, n, desc, count);
}

extern "C" SALUS_EXPORT CUresult cuMemGetAccess(unsigned long long* flags,
                                                const CUmemLocation* where, CUdeviceptr p) {
  if (program_handle_access(flags, where, p)) return CUDA_SUCCESS;
  auto f = real<PFN_cuMemGetAccess_v10020>(kMemGetAccess);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return f(flags, where, p);
}

extern "C" SALUS_EXPORT CUresult
cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle h) {
  if (is_program_handle(h)) return program_handle_properties(prop, h);
  auto f = real<PFN_cuMemGetAllocationPropertiesFromHandle_v10020>(
      kMemGetAllocationPropertiesFromHandle);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return f(prop, h);
}

// Sharing memory with the world (another process, a multicast team, a dma-buf
// importer) pins a program handle on the GPU: the shim cannot move what others map.
extern "C" SALUS_EXPORT CUresult cuMemExportToShareableHandle(void* out,
                                                              CUmemGenericAllocationHandle h,
                                                              CUmemAllocationHandleType type,
                                                              unsigned long long flags) {
  auto f = real<PFN_cuMemExportToShareableHandle_v10020>(kMemExportToShareableHandle);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  if (is_program_handle(h))
    if (CUresult r = program_handle_pin(h, &h); r != CUDA_SUCCESS) return r;
  return f(out, h, type, flags);
}

extern "C" SALUS_EXPORT CUresult cuMemGetHandleForAddressRange(void* out, CUdeviceptr p,
                                                               std::size_t n,
                                                               CUmemRangeHandleType type,
                                                               unsigned long long flags) {
  auto f = real<PFN_cuMemGetHandleForAddressRange_v11070>(kMemGetHandleForAddressRange);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  program_handles_pin_range(p, n);
  return f(out, p, n, type, flags);
}

extern "C" SALUS_EXPORT CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mc,
                                                    std::size_t mc_off,
                                                    CUmemGenericAllocationHandle h, std::size_t off,
                                                    std::size_t n, unsigned long long flags) {
  auto f = real<PFN_cuMulticastBindMem_v12010>(kMulticastBindMem);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  if (is_program_handle(h))
    if (CUresult r = program_handle_pin(h, &h); r != CUDA_SUCCESS) return r;
  return f(mc, mc_off, h, off, n, flags);
}

extern "C" SALUS_EXPORT CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mc,
                                                     std::size_t mc_off, CUdeviceptr p,
                                                     std::size_t n, unsigned long long flags) {
  auto f = real<PFN_cuMulticastBindAddr_v12010>(kMulticastBindAddr);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  program_handles_pin_range(p, n);
  return f(mc, mc_off, p, n, flags);
}

extern "C" SALUS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr*, std::size_t n, unsigned) {
  char line[160];
  std::snprintf(line, sizeof line,
                "cuMemAllocManaged of %zu bytes refused: managed memory is not supported under "
                "salus (it cannot be held to the session's budget)",
                n);
  post_note(line);
  return CUDA_ERROR_NOT_SUPPORTED;
}

// ---- launches and the async copies and sets (the gate's fallback net) ----

#define SALUS_LAUNCH_HOOK(SYM, SLOT, FN, PFN, PARAMS, ARGS, STREAM) \
  extern "C" SALUS_EXPORT CUresult SYM PARAMS {                     \
    on_launch(STREAM);                                              \
    auto real_fn = real<PFN>(FN, SLOT);                             \
    if (real_fn == nullptr) return CUDA_ERROR_NOT_INITIALIZED;      \
    return real_fn ARGS;                                            \
  }
#define SALUS_LAUNCH_HOOKS(SYM, FN, PFN, PARAMS, ARGS, STREAM) \
  SALUS_LAUNCH_HOOK(SYM, 0, FN, PFN, PARAMS, ARGS, STREAM)     \
  SALUS_LAUNCH_HOOK(SYM##_ptsz, 1, FN, PFN, PARAMS, ARGS, STREAM)

SALUS_LAUNCH_HOOKS(cuLaunchKernel, kLaunchKernel, PFN_cuLaunchKernel_v4000,
                   (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                    unsigned bz, unsigned smem, CUstream s, void** params, void** extra),
                   (f, gx, gy, gz, bx, by, bz, smem, s, params, extra), s)
SALUS_LAUNCH_HOOKS(cuLaunchKernelEx, kLaunchKernelEx, PFN_cuLaunchKernelEx_v11060,
                   (const CUlaunchConfig* c, CUfunction f, void** params, void** extra),
                   (c, f, params, extra), c != nullptr ? c->hStream : nullptr)
SALUS_LAUNCH_HOOKS(cuLaunchCooperativeKernel, kLaunchCooperativeKernel,
                   PFN_cuLaunchCooperativeKernel_v9000,
                   (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                    unsigned bz, unsigned smem, CUstream s, void** params),
                   (f, gx, gy, gz, bx, by, bz, smem, s, params), s)
SALUS_LAUNCH_HOOKS(cuGraphLaunch, kGraphLaunch, PFN_cuGraphLaunch_v10000,
                   (CUgraphExec e, CUstream s), (e, s), s)
SALUS_LAUNCH_HOOKS(cuMemcpyHtoDAsync_v2, kMemcpyHtoDAsync, PFN_cuMemcpyHtoDAsync_v3020,
                   (CUdeviceptr d, const void* h, std::size_t n, CUstream s), (d, h, n, s), s)
SALUS_LAUNCH_HOOKS(cuMemcpyDtoHAsync_v2, kMemcpyDtoHAsync, PFN_cuMemcpyDtoHAsync_v3020,
                   (void* h, CUdeviceptr d, std::size_t n, CUstream s), (h, d, n, s), s)
SALUS_LAUNCH_HOOKS(cuMemcpyDtoDAsync_v2, kMemcpyDtoDAsync, PFN_cuMemcpyDtoDAsync_v3020,
                   (CUdeviceptr d, CUdeviceptr src, std::size_t n, CUstream s), (d, src, n, s), s)
SALUS_LAUNCH_HOOKS(cuMemcpyAsync, kMemcpyAsync, PFN_cuMemcpyAsync_v4000,
                   (CUdeviceptr d, CUdeviceptr src, std::size_t n, CUstream s), (d, src, n, s), s)
SALUS_LAUNCH_HOOKS(cuMemsetD8Async, kMemsetD8Async, PFN_cuMemsetD8Async_v3020,
                   (CUdeviceptr d, unsigned char v, std::size_t n, CUstream s), (d, v, n, s), s)
SALUS_LAUNCH_HOOKS(cuMemsetD32Async, kMemsetD32Async, PFN_cuMemsetD32Async_v3020,
                   (CUdeviceptr d, unsigned v, std::size_t n, CUstream s), (d, v, n, s), s)

// ---- the table cuGetProcAddress and dlsym answer from ----

#undef cuGetProcAddress
extern "C" CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t);  // interpose.cpp

namespace salus::shim {
namespace {

#define H(x) reinterpret_cast<void*>(&x)
#define ONE(name, version, fn, hook)         \
  {                                          \
    name, version, fn, {H(hook), nullptr}, { \
#hook, nullptr                         \
    }                                        \
  }
#define TWO(name, version, fn, hook)                \
  {                                                 \
    name, version, fn, {H(hook), H(hook##_ptsz)}, { \
#hook, #hook "_ptsz"                          \
    }                                               \
  }

// Sorted by name, then version. Versions below an entry's first one are older
// signatures (e.g. 32-bit cuMemAlloc before CUDA 3.2) and pass through unhooked.
const HookEntry kHooks[] = {
    ONE("cuGetProcAddress", 11030, kGetProcAddress, cuGetProcAddress),
    ONE("cuGetProcAddress", 12000, kGetProcAddress_v2, cuGetProcAddress_v2),
    TWO("cuGraphLaunch", 10000, kGraphLaunch, cuGraphLaunch),
    ONE("cuInit", 2000, kInit, cuInit),
    TWO("cuLaunchCooperativeKernel", 9000, kLaunchCooperativeKernel, cuLaunchCooperativeKernel),
    TWO("cuLaunchKernel", 4000, kLaunchKernel, cuLaunchKernel),
    TWO("cuLaunchKernelEx", 11060, kLaunchKernelEx, cuLaunchKernelEx),
    ONE("cuMemAlloc", 3020, kMemAlloc, cuMemAlloc_v2),
    TWO("cuMemAllocAsync", 11020, kMemAllocAsync, cuMemAllocAsync),
    TWO("cuMemAllocFromPoolAsync", 11020, kMemAllocFromPoolAsync, cuMemAllocFromPoolAsync),
    ONE("cuMemAllocManaged", 6000, kMemAllocManaged, cuMemAllocManaged),
    ONE("cuMemAllocPitch", 3020, kMemAllocPitch, cuMemAllocPitch_v2),
    ONE("cuMemCreate", 10020, kMemCreate, cuMemCreate),
    ONE("cuMemExportToShareableHandle", 10020, kMemExportToShareableHandle,
        cuMemExportToShareableHandle),
    ONE("cuMemFree", 3020, kMemFree, cuMemFree_v2),
    TWO("cuMemFreeAsync", 11020, kMemFreeAsync, cuMemFreeAsync),
    ONE("cuMemGetAccess", 10020, kMemGetAccess, cuMemGetAccess),
    ONE("cuMemGetAllocationPropertiesFromHandle", 10020, kMemGetAllocationPropertiesFromHandle,
        cuMemGetAllocationPropertiesFromHandle),
    ONE("cuMemGetHandleForAddressRange", 11070, kMemGetHandleForAddressRange,
        cuMemGetHandleForAddressRange),
    ONE("cuMemGetInfo", 3020, kMemGetInfo, cuMemGetInfo_v2),
    ONE("cuMemMap", 10020, kMemMap, cuMemMap),
    ONE("cuMemRelease", 10020, kMemRelease, cuMemRelease),
    ONE("cuMemRetainAllocationHandle", 11000, kMemRetainAllocationHandle,
        cuMemRetainAllocationHandle),
    ONE("cuMemSetAccess", 10020, kMemSetAccess, cuMemSetAccess),
    ONE("cuMemUnmap", 10020, kMemUnmap, cuMemUnmap),
    TWO("cuMemcpyAsync", 4000, kMemcpyAsync, cuMemcpyAsync),
    TWO("cuMemcpyDtoDAsync", 3020, kMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2),
    TWO("cuMemcpyDtoHAsync", 3020, kMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2),
    TWO("cuMemcpyHtoDAsync", 3020, kMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2),
    TWO("cuMemsetD32Async", 3020, kMemsetD32Async, cuMemsetD32Async),
    TWO("cuMemsetD8Async", 3020, kMemsetD8Async, cuMemsetD8Async),
    ONE("cuMulticastBindAddr", 12010, kMulticastBindAddr, cuMulticastBindAddr),
    ONE("cuMulticastBindMem", 12010, kMulticastBindMem, cuMulticastBindMem),
};
#undef H
#undef ONE
#undef TWO

}  // namespace

const HookEntry* find_hook(const char* name, int version) {
  const HookEntry* best = nullptr;
  for (const HookEntry& e : kHooks)
    if (__builtin_strcmp(e.name, name) == 0 && e.version <= version) best = &e;
  return best;
}

const HookEntry* find_hook_by_symbol(const char* symbol, int* slot) {
  for (const HookEntry& e : kHooks)
    for (int s = 0; s < kSlots; ++s)
      if (e.symbol[s] != nullptr && __builtin_strcmp(e.symbol[s], symbol) == 0) {
        *slot = s;
        return &e;
      }
  return nullptr;
}

const HookEntry* find_hook_by_fn(Fn f) {
  for (const HookEntry& e : kHooks)
    if (e.fn == f) return &e;
  return nullptr;
}

}  // namespace salus::shim

// GCC 12's container headers call this GLIBCXX_3.4.29 (GCC 11) function on an
// impossible allocation size. Defined here (kept local by the version script), so that the shim
// needs no libstdc++ newer than GCC 7's and loads into older images (Ubuntu 20.04, RHEL 8). The
// shim is built without exceptions: such a size is a bug, so abort.
namespace std {
[[noreturn]] void __throw_bad_array_new_length() {
  __builtin_trap();
}
}  // namespace std
