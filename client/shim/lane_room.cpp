// The shared lane as room (SALUS_SHARED_LANE=segments): the lane served to a
// program that builds its memory from VMM handles of its own (cuMemCreate,
// cuMemMap: PyTorch's expandable segments).
//
// The memory lane (lane.cpp) cannot serve cuMemCreate: the lane is one
// physical handle and cuMemMap maps a handle whole. So for such a program
// salusd holds no lane memory while it holds the lane, and the lane is room
// instead: the program's cuMemCreate of plain device memory is made by the
// driver as usual but charged to the lane's size (gate lane_bytes), not to the
// session's budget, while the program holds the lane. A handle the program
// releases (and unmaps) is kept here, not released, and serves its next
// cuMemCreate of the same size and kind, so the automark's empty_cache at
// every boundary costs no driver allocation while the program keeps the lane.
// At a boundary, handles still live (tensors kept across iterations) are
// charged to the session's budget, as persistent memory, at the same address:
// nothing moves, the charge does. When salusd asks for the lane back, the
// kept handles are zeroed (through a mapping of the shim's) and released,
// then the yield is reported (lane_held = 0). If the live ones do not fit the
// budget they stay charged to the lane and the program does not yield; salusd
// abandons the room to it after 2 s and they become the program's, uncharged.
//
// Not on the launch path: these calls come per segment.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "client/shim/lane_state.hpp"
#include "client/shim/shim.hpp"

namespace salus::shim {
namespace {

using lane_detail::CtxScope;
using lane_detail::lane_driver;
using lane_detail::LaneDriver;

struct RoomHandle {
  std::uint64_t bytes = 0;
  int refs = 1;  // the program's references; the driver's last one is the shim's to drop
  int maps = 0;
  CUmemAllocationProp prop{};
};
struct Spare {  // released by the program, kept for its next cuMemCreate
  CUmemGenericAllocationHandle handle;
  std::uint64_t bytes;
  CUmemAllocationProp prop;
};
struct RoomMap {
  CUmemGenericAllocationHandle handle;
  std::size_t size;
};

// Under `mu`. Heap-allocated and never destroyed: hooks may run after static
// destructors.
struct Room {
  std::mutex mu;
  std::atomic<bool> any{false};  // handles tracked: cuMemRelease and cuMemUnmap look here
  std::unordered_map<CUmemGenericAllocationHandle, RoomHandle> live;
  std::map<CUdeviceptr, RoomMap> mappings;
  std::vector<Spare> spares;
  std::uint64_t used = 0;    // bytes of live handles and spares: at most the lane's size
  std::uint32_t gen = 0;     // the lane grant they were taken under
  CUcontext ctx = nullptr;   // where they were made (clearing maps them there)
  std::uint64_t failed = 0;  // the live bytes a charge last failed for: not noted again
  bool clear_noted = false;
};
Room& room() {
  static Room* r = new Room;
  return *r;
}

// What a spare must share with a request to serve it.
bool same_kind(const CUmemAllocationProp& a, const CUmemAllocationProp& b) {
  return a.location.id == b.location.id && a.requestedHandleTypes == b.requestedHandleTypes;
}

// Plain device memory, the kind expandable segments make.
bool room_serves(const CUmemAllocationProp* prop, unsigned long long flags) {
  if (prop == nullptr || flags != 0 || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return false;
  const auto types = prop->requestedHandleTypes;
  if (types != CU_MEM_HANDLE_TYPE_NONE && types != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return false;
  return prop->allocFlags.compressionType == 0 && prop->allocFlags.gpuDirectRDMACapable == 0 &&
         prop->allocFlags.usage == 0;
}

CUresult real_release(CUmemGenericAllocationHandle h) {
  auto f = real<PFN_cuMemRelease_v10020>(kMemRelease);
  return f == nullptr ? CUDA_ERROR_NOT_INITIALIZED : f(h);
}

void sync_all(Room& R) {
  if (R.ctx == nullptr) return;
  CtxScope scope(R.ctx);
  lane_driver().ctx_synchronize();
}

// Zeroes the spares through mappings of the shim's, side by side in one
// reservation (one synchronize for all), and releases them: the bytes go back
// to the driver, for anyone, only cleared. Caller holds R.mu and synchronized
// the context.
void clear_and_release_spares(Room& R) {
  if (R.spares.empty()) return;
  const LaneDriver& d = lane_driver();
  std::uint64_t total = 0;
  for (const Spare& s : R.spares) total += s.bytes;
  CtxScope scope(R.ctx);
  CUdeviceptr base = 0;
  const bool reserved =
      d.memset_async != nullptr && d.reserve(&base, total, 0, 0, 0) == CUDA_SUCCESS;
  std::vector<bool> mapped(R.spares.size(), false), cleared(R.spares.size(), false);
  CUdeviceptr at = base;
  for (std::size_t i = 0; reserved && i < R.spares.size(); at += R.spares[i].bytes, ++i) {
    const Spare& s = R.spares[i];
    mapped[i] = d.map(at, s.bytes, 0, s.handle, 0) == CUDA_SUCCESS;
    cleared[i] = mapped[i] &&
                 lane_detail::grant_access(d, at, s.bytes, s.prop.location.id) == CUDA_SUCCESS &&
                 d.memset_async(at, 0, s.bytes, nullptr) == CUDA_SUCCESS;
  }
  const bool synced = !reserved || d.ctx_synchronize() == CUDA_SUCCESS;
  std::size_t uncleared = 0;
  at = base;
  for (std::size_t i = 0; i < R.spares.size(); ++i) {
    const Spare& s = R.spares[i];
    if (mapped[i]) d.unmap(at, s.bytes);
    at += s.bytes;
    if (!cleared[i] || !synced) ++uncleared;
    real_release(s.handle);
    R.used -= s.bytes;
  }
  if (reserved) d.addr_free(base, total);
  R.spares.clear();
  if (uncleared > 0 && !R.clear_noted) {
    R.clear_noted = true;
    char line[200];
    std::snprintf(line, sizeof line,
                  "shared lane: %zu segment(s) could not be zeroed before going back to the "
                  "driver; their bytes are left as the driver leaves a program's",
                  uncleared);
    post_note(line);
  }
}

// A handle the program is done with (released, unmapped): kept as a spare.
void to_spare(Room& R, CUmemGenericAllocationHandle h) {
  auto it = R.live.find(h);
  R.spares.push_back({h, it->second.bytes, it->second.prop});
  R.live.erase(it);
}

// The live handles become memory of the program's own, charged to its budget
// (persistent), where they are mapped. False if the budget cannot take them.
bool promote_live(Room& R) {
  if (R.live.empty()) return true;
  std::uint64_t total = 0;
  for (const auto& [h, rh] : R.live) total += rh.bytes;
  // A refusal is noted once for the same bytes (charge without a `what` is quiet).
  const char* what = total == R.failed
                         ? nullptr
                         : "shared lane: segments that outlive their iteration, charged as "
                           "persistent";
  if (!charge(total, what)) {
    R.failed = total;
    return false;
  }
  R.failed = 0;
  for (const auto& [h, rh] : R.live) {
    std::vector<CUdeviceptr> at;
    for (const auto& [p, m] : R.mappings)
      if (m.handle == h) at.push_back(p);
    vmm_adopt(h, rh.bytes, rh.refs, at);
    if (rh.refs == 0) real_release(h);  // the program released it: its mappings keep it
  }
  for (auto it = R.mappings.begin(); it != R.mappings.end();)
    it = R.live.count(it->second.handle) ? R.mappings.erase(it) : std::next(it);
  R.used -= total;
  R.live.clear();
  return true;
}

// The live handles stay the program's, uncharged: the lane's room was
// abandoned to it (or salusd is gone). They leave the room's books.
void forget_live(Room& R) {
  if (R.live.empty()) return;
  std::uint64_t total = 0;
  for (const auto& [h, rh] : R.live) {
    total += rh.bytes;
    if (rh.refs == 0) real_release(h);
  }
  R.mappings.clear();
  char line[200];
  std::snprintf(line, sizeof line,
                "shared lane: %zu segment(s) of %" PRIu64
                " bytes stay the program's, uncharged: the lane's room was given up with them",
                R.live.size(), total);
  post_note(line);
  R.used -= total;
  R.live.clear();
  R.failed = 0;
}

}  // namespace

bool room_create(CUmemGenericAllocationHandle* h, std::size_t n, const CUmemAllocationProp* prop,
                 unsigned long long flags, CUresult* r) {
  if (h == nullptr || n == 0 || !lane_room_active() || !room_serves(prop, flags)) return false;
  note_gpu_use();
  Room& R = room();
  std::lock_guard lk(R.mu);
  salus_gate* g = gate();
  const std::uint32_t grant = __atomic_load_n(&g->lane_grant, __ATOMIC_SEQ_CST);
  const std::uint64_t size = __atomic_load_n(&g->lane_bytes, __ATOMIC_ACQUIRE);
  if (grant == 0 || size < n) return false;
  if (R.gen != 0 && R.gen != grant) forget_live(R);  // an abandoned room: not the lane's now
  // Spares of other sizes give way (the program's own bytes: not cleared).
  while (R.used + n > size && !R.spares.empty()) {
    auto it = std::find_if(R.spares.begin(), R.spares.end(), [&](const Spare& s) {
      return s.bytes != n || !same_kind(s.prop, *prop);
    });
    if (it == R.spares.end()) break;
    real_release(it->handle);
    R.used -= it->bytes;
    R.spares.erase(it);
  }
  auto spare = std::find_if(R.spares.begin(), R.spares.end(), [&](const Spare& s) {
    return s.bytes == n && same_kind(s.prop, *prop);
  });
  if (spare == R.spares.end() && R.used + n > size) return false;  // full: the charged path
  // As map_locked's: either salusd sees the room held, or we see its grant gone.
  if (__atomic_load_n(&g->lane_held, __ATOMIC_SEQ_CST) != grant) {
    __atomic_store_n(&g->lane_held, grant, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&g->lane_grant, __ATOMIC_SEQ_CST) != grant) {
      if (R.live.empty() && R.spares.empty()) {
        __atomic_store_n(&g->lane_held, 0u, __ATOMIC_SEQ_CST);
        ring_bell();
      }
      return false;
    }
  }
  if (spare != R.spares.end()) {
    *h = spare->handle;
    R.spares.erase(spare);
  } else {
    auto f = real<PFN_cuMemCreate_v10020>(kMemCreate);
    if (f == nullptr) return false;
    // The room was promised by admission, but salusd's lane memory, dropped
    // at this grant, may still be on its way back to the card (the executor
    // frees it off salusd's lock): tried again for a moment, as the charged
    // path does. A failure then is the driver's answer: the charged path
    // would find the card as full.
    *r = with_driver_oom_retry(n, "cuMemCreate in the shared lane's room",
                               [&] { return f(h, n, prop, flags); });
    if (*r != CUDA_SUCCESS) return true;
    R.used += n;
  }
  if (R.ctx == nullptr) driver().ctx_get_current(&R.ctx);
  R.gen = grant;
  R.live[*h] = RoomHandle{n, 1, 0, *prop};
  R.any.store(true, std::memory_order_release);
  *r = CUDA_SUCCESS;
  return true;
}

bool room_release(CUmemGenericAllocationHandle h, CUresult* r) {
  Room& R = room();
  if (!R.any.load(std::memory_order_acquire)) return false;
  std::lock_guard lk(R.mu);
  auto it = R.live.find(h);
  if (it == R.live.end()) return false;
  RoomHandle& rh = it->second;
  if (rh.refs > 1) {
    *r = real_release(h);  // a reference of cuMemRetainAllocationHandle's
    if (*r == CUDA_SUCCESS) --rh.refs;
    return true;
  }
  rh.refs = 0;
  if (rh.maps == 0) to_spare(R, h);
  *r = CUDA_SUCCESS;
  return true;
}

void room_retained(CUmemGenericAllocationHandle h) {
  Room& R = room();
  if (!R.any.load(std::memory_order_acquire)) return;
  std::lock_guard lk(R.mu);
  if (auto it = R.live.find(h); it != R.live.end()) ++it->second.refs;
}

bool room_mapped(CUdeviceptr p, std::size_t n, CUmemGenericAllocationHandle h) {
  Room& R = room();
  if (!R.any.load(std::memory_order_acquire)) return false;
  std::lock_guard lk(R.mu);
  auto it = R.live.find(h);
  if (it == R.live.end()) return false;
  ++it->second.maps;
  R.mappings[p] = RoomMap{h, n};
  return true;
}

void room_unmapped(CUdeviceptr p, std::size_t n) {
  Room& R = room();
  if (!R.any.load(std::memory_order_acquire)) return;
  std::lock_guard lk(R.mu);
  for (auto it = R.mappings.lower_bound(p); it != R.mappings.end() && it->first < p + n;) {
    auto h = R.live.find(it->second.handle);
    if (h != R.live.end() && --h->second.maps == 0 && h->second.refs == 0) to_spare(R, h->first);
    it = R.mappings.erase(it);
  }
}

void room_boundary() {
  if (!lane_room_active()) return;
  Room& R = room();
  std::lock_guard lk(R.mu);
  promote_live(R);
}

void room_serve(salus_gate* g) {
  Room& R = room();
  std::lock_guard lk(R.mu);
  const std::uint32_t held = __atomic_load_n(&g->lane_held, __ATOMIC_SEQ_CST);
  const std::uint32_t grant = __atomic_load_n(&g->lane_grant, __ATOMIC_SEQ_CST);
  if (held == 0 || grant == held) return;
  // A new grant while an older one is still reported: salusd abandoned that
  // room to the program (no yield within 2 s) and grants the lane afresh.
  if (grant != 0) forget_live(R);
  // Else salusd wants the lane for another session: the room goes back to the
  // driver, cleared, and what is still live becomes persistent memory.
  sync_all(R);
  clear_and_release_spares(R);
  if (!promote_live(R)) return;  // no yield: salusd abandons the room to us in 2 s
  R.gen = 0;
  __atomic_store_n(&g->lane_held, 0u, __ATOMIC_SEQ_CST);
  ring_bell();
}

void room_detach(salus_gate* g) {
  Room& R = room();
  std::lock_guard lk(R.mu);
  sync_all(R);
  clear_and_release_spares(R);
  forget_live(R);
  R.gen = 0;
  if (g != nullptr) __atomic_store_n(&g->lane_held, 0u, __ATOMIC_RELEASE);
}

void room_forget_in_child() {
  // A forked child never holds the parent's lane (lane_room_active is false
  // there); the handles it inherited the books of are the parent's.
  room().any.store(false);
}

}  // namespace salus::shim
