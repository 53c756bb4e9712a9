// Promotion (SALUS_SHARED_LANE=alloc): cuMemAlloc blocks still live at the
// boundary become memory of the program's own at the same addresses (one
// cuMemCreate per touched granule, charged), the lane moving to a fresh
// reservation; and the frees of such blocks later. See lane.cpp.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <vector>

#include "client/shim/lane_state.hpp"
#include "client/shim/shim.hpp"

namespace salus::shim::lane_detail {
namespace {

// The granules [first, last] that `len` bytes at `off` touch.
struct GranuleSpan {
  std::size_t first, last;
};
GranuleSpan granules_of(std::size_t off, std::size_t len, std::size_t gran) {
  return {off / gran, (off + len - 1) / gran};
}

std::size_t granularity_of(const LaneDriver& d, CUdevice dev) {
  const CUmemAllocationProp prop = device_prop(dev);
  std::size_t n = 0;
  if (d.granularity(&n, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || n == 0)
    n = std::size_t{2} << 20;
  return n;
}

// One promotion: the granules (indices from the lane's base) that live
// cuMemAlloc blocks touch, their new handles, and the lane's new reservation.
struct Promotion {
  CUdevice dev = 0;
  std::size_t gran = 0;
  std::vector<std::size_t> idx;
  std::vector<CUmemGenericAllocationHandle> handles;
  CUdeviceptr new_base = 0;
  bool new_mapped = false;
  bool old_unmapped = false;   // the lane is no longer mapped at the old base
  std::size_t old_mapped = 0;  // own granules mapped at the old base so far
  const char* failed = nullptr;
  CUresult result = CUDA_SUCCESS;
};

bool fail(Promotion& P, const char* what, CUresult r) {
  P.failed = what;
  P.result = r;
  return false;
}

// Undoes whatever of P was done, the lane mapped at its old base again.
void undo(Lane& L, const LaneDriver& d, Promotion& P) {
  for (std::size_t k = 0; k < P.old_mapped; ++k) d.unmap(L.base + P.idx[k] * P.gran, P.gran);
  if (P.old_unmapped && (d.map(L.base, L.reserved, 0, L.handle, 0) != CUDA_SUCCESS ||
                         grant_access(d, L.base, L.reserved, P.dev) != CUDA_SUCCESS))
    post_note(
        "shared lane: a failed promotion could not be undone; the program's lane "
        "allocations are unmapped");
  if (P.new_mapped) d.unmap(P.new_base, L.reserved);
  if (P.new_base != 0) d.addr_free(P.new_base, L.reserved);
  for (CUmemGenericAllocationHandle h : P.handles) d.release(h);
}

// The driver's part of a promotion; false (nothing undone yet) on a failure.
bool promote_driver(Lane& L, const LaneDriver& d, Promotion& P) {
  if (CUresult r = d.ctx_synchronize(); r != CUDA_SUCCESS) return fail(P, "cuCtxSynchronize", r);
  const CUmemAllocationProp prop = device_prop(P.dev);
  for (std::size_t k = 0; k < P.idx.size(); ++k) {
    CUmemGenericAllocationHandle h = 0;
    if (CUresult r = d.create(&h, P.gran, &prop, 0); r != CUDA_SUCCESS)
      return fail(P, "cuMemCreate", r);
    P.handles.push_back(h);
  }
  // The lane handle at a fresh reservation too, where the lane lives on.
  if (CUresult r = d.reserve(&P.new_base, L.reserved, 0, 0, 0); r != CUDA_SUCCESS)
    return fail(P, "cuMemAddressReserve", r);
  if (CUresult r = d.map(P.new_base, L.reserved, 0, L.handle, 0); r != CUDA_SUCCESS)
    return fail(P, "cuMemMap", r);
  P.new_mapped = true;
  if (CUresult r = grant_access(d, P.new_base, L.reserved, P.dev); r != CUDA_SUCCESS)
    return fail(P, "cuMemSetAccess", r);
  // The old base gives the lane up (a mapping is unmapped whole), and takes
  // the program's granules, filled from the lane's new address.
  if (CUresult r = d.unmap(L.base, L.reserved); r != CUDA_SUCCESS) return fail(P, "cuMemUnmap", r);
  P.old_unmapped = true;
  for (std::size_t k = 0; k < P.idx.size(); ++k) {
    const CUdeviceptr at = L.base + P.idx[k] * P.gran;
    if (CUresult r = d.map(at, P.gran, 0, P.handles[k], 0); r != CUDA_SUCCESS)
      return fail(P, "cuMemMap", r);
    ++P.old_mapped;
    if (CUresult r = grant_access(d, at, P.gran, P.dev); r != CUDA_SUCCESS)
      return fail(P, "cuMemSetAccess", r);
    if (CUresult r = d.copy(at, P.new_base + P.idx[k] * P.gran, P.gran); r != CUDA_SUCCESS)
      return fail(P, "cuMemcpyDtoD", r);
  }
  // Device-to-device copies may return before they are done.
  if (CUresult r = d.ctx_synchronize(); r != CUDA_SUCCESS) return fail(P, "cuCtxSynchronize", r);
  return true;
}

// The old base becomes a region of promoted granules; the lane lives on at
// the new base, with the salus_lane_alloc blocks gone and no cuMemAlloc ones.
void commit(Lane& L, Promotion& P) {
  Region& r = outlived().regions[L.base];
  r.size = L.reserved;
  r.gran = P.gran;
  for (std::size_t k = 0; k < P.idx.size(); ++k) r.granules[P.idx[k]] = Granule{P.handles[k], 0};
  for (std::size_t i = 0; i < L.nblocks; ++i) {
    const Block& b = L.blocks[i];
    outlived().owned[L.base + b.off] = Owned{L.base, b.len};
    const GranuleSpan span = granules_of(b.off, b.len, P.gran);
    for (std::size_t g = span.first; g <= span.last; ++g) ++r.granules[g].live;
  }
  L.base = P.new_base;
  L.nblocks = 0;
}

// Notes a failed promotion once until one succeeds. Returns false.
bool promotion_failed(Lane& L, const char* line) {
  if (!L.promote_failed) post_note(line);
  L.promote_failed = true;
  return false;
}

}  // namespace

// At the boundary, with only cuMemAlloc blocks left in L.blocks (at least
// one): promotes them. False: they stay in the lane (a note says why).
bool promote_locked(Lane& L) {
  const LaneDriver& d = lane_driver();
  CtxScope scope(L.ctx);
  Promotion P;
  if (d.ctx_get_device(&P.dev) != CUDA_SUCCESS) P.dev = 0;
  P.gran = granularity_of(d, P.dev);
  for (std::size_t i = 0; i < L.nblocks; ++i) {
    const GranuleSpan span = granules_of(L.blocks[i].off, L.blocks[i].len, P.gran);
    for (std::size_t g = span.first; g <= span.last; ++g) P.idx.push_back(g);
  }
  P.idx.erase(std::unique(P.idx.begin(), P.idx.end()), P.idx.end());  // blocks are sorted
  const std::uint64_t bytes = std::uint64_t{P.idx.size()} * P.gran;
  char line[320];
  if (!d.promote_ok) {
    std::snprintf(line, sizeof line,
                  "shared lane: cannot promote %zu live cuMemAlloc allocation(s): the driver lacks "
                  "cuMemCreate, cuMemGetAllocationGranularity or cuMemcpyDtoD; they stay in the "
                  "lane memory, which the program keeps",
                  L.nblocks);
    return promotion_failed(L, line);
  }
  if (!charge(bytes, nullptr)) {
    std::snprintf(line, sizeof line,
                  "shared lane: cannot promote %zu live cuMemAlloc allocation(s) at the boundary "
                  "(%" PRIu64 " bytes of granules): budget %" PRIu64 ", charged %" PRIu64
                  "; they stay in the lane memory, which the program keeps (salusd gives the "
                  "lane fresh memory)",
                  L.nblocks, bytes, __atomic_load_n(&gate()->budget_bytes, __ATOMIC_ACQUIRE),
                  charged_now());
    return promotion_failed(L, line);
  }
  if (!promote_driver(L, d, P)) {
    undo(L, d, P);
    refund(bytes);
    std::snprintf(line, sizeof line,
                  "shared lane: promoting %" PRIu64
                  " bytes failed at %s (CUresult %d); the "
                  "allocations stay in the lane memory, which the program keeps",
                  bytes, P.failed, static_cast<int>(P.result));
    return promotion_failed(L, line);
  }
  commit(L, P);
  L.promote_failed = false;
  return true;
}

// Frees a block that outlived the lane (caller holds L.mu).
CUresult free_owned_locked(Lane& L, std::map<CUdeviceptr, Owned>::iterator it) {
  const LaneDriver& d = lane_driver();
  const CUdeviceptr p = it->first, base = it->second.region;
  const std::size_t len = it->second.len;
  auto rit = outlived().regions.find(base);
  outlived().owned.erase(it);
  if (rit == outlived().regions.end()) return CUDA_SUCCESS;
  Region& r = rit->second;
  CtxScope scope(L.ctx);
  bool synced = false;
  auto sync = [&] {
    // cuMemFree synchronizes before it frees; cuMemUnmap does not.
    if (!synced) d.ctx_synchronize();
    synced = true;
  };
  if (r.kept) {
    if (--r.kept_live > 0) return CUDA_SUCCESS;
    sync();
    d.unmap(base, r.size);
  } else {
    const GranuleSpan span = granules_of(p - base, len, r.gran);
    for (std::size_t g = span.first; g <= span.last; ++g) {
      auto git = r.granules.find(g);
      if (git == r.granules.end() || --git->second.live > 0) continue;
      sync();
      d.unmap(base + g * r.gran, r.gran);
      d.release(git->second.handle);
      refund(r.gran);
      r.granules.erase(git);
    }
    if (!r.granules.empty()) return CUDA_SUCCESS;
  }
  d.addr_free(base, r.size);
  outlived().regions.erase(rit);
  return CUDA_SUCCESS;
}

}  // namespace salus::shim::lane_detail
