// The shim's side of the shared lane (SALUS_SHARED_LANE=1 or alloc,
// client/salus_gate.h): the socket pair named at attach, the lane memory
// received from salusd (SCM_RIGHTS), imported and mapped while the program
// holds the lane, and the first-fit allocator that serves salus_lane_alloc
// and, with SALUS_SHARED_LANE=alloc, cuMemAlloc_v2 (also cuMemAllocPitch_v2 and
// cuMemAllocAsync) from it. A salus_lane_alloc
// block is ephemeral: valid from its allocation inside an iteration to the
// program's next boundary, where it ends, freed or not. A cuMemAlloc block
// still live at the boundary is promoted instead: the allocation-granularity
// granules it touches become memory of the program's own (cuMemCreate,
// charged to its budget), mapped at the same addresses with the bytes copied,
// and the lane moves to a fresh reservation (lane_promotion.cpp). If promotion
// cannot be charged or a driver call fails, the blocks stay where they are and
// the program keeps the lane memory mapped (it does not yield it; salusd abandons it to the
// program after 2 s and makes fresh memory for the lane). The lane is given
// back (synchronize, unmap, report `lane_held` = 0) only while the program
// waits at its gate, never on a launch.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "client/shim/lane_state.hpp"
#include "client/shim/shim.hpp"

#define SALUS_EXPORT __attribute__((visibility("default")))

namespace salus::shim {
namespace lane_detail {

const LaneDriver& lane_driver() {
  static const LaneDriver v = [] {
    LaneDriver r;
    bool ok = true;
    auto get = [&](const char* name, auto& out) {
      void* p = driver_proc(name);
      if (p == nullptr) ok = false;
      out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(p);
    };
    get("cuMemImportFromShareableHandle", r.import);
    get("cuMemAddressReserve", r.reserve);
    get("cuMemAddressFree", r.addr_free);
    get("cuMemRelease", r.release);
    get("cuMemMap", r.map);
    get("cuMemUnmap", r.unmap);
    get("cuMemSetAccess", r.set_access);
    get("cuCtxGetDevice", r.ctx_get_device);
    get("cuCtxSynchronize", r.ctx_synchronize);
    r.ok = ok && driver().ok;
    get("cuMemCreate", r.create);
    get("cuMemGetAllocationGranularity", r.granularity);
    get("cuMemcpyDtoD", r.copy);
    r.promote_ok = ok && r.ok;
    get("cuEventCreate", r.event_create);
    get("cuEventRecord", r.event_record);
    get("cuEventQuery", r.event_query);
    get("cuEventSynchronize", r.event_synchronize);
    get("cuEventDestroy", r.event_destroy);
    r.events_ok = ok && r.ok;
    get("cuMemsetD8Async", r.memset_async);
    return r;
  }();
  return v;
}

Outlived& outlived() {
  static Outlived* o = new Outlived;
  return *o;
}

// Read and write access for `dev` to [p, p + n), mapped a moment before.
CUresult grant_access(const LaneDriver& d, CUdeviceptr p, std::size_t n, CUdevice dev) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return d.set_access(p, n, &access, 1);
}

}  // namespace lane_detail

namespace {

using namespace lane_detail;

Lane g_lane;  // trivially destructible: hooks may run after static destructors

enum class Mode { kOff, kExplicit, kAlloc, kSegments };
Mode mode() {
  static const Mode m = [] {
    const char* v = std::getenv("SALUS_SHARED_LANE");
    if (v == nullptr) return Mode::kOff;
    if (std::strcmp(v, "1") == 0) return Mode::kExplicit;
    if (std::strcmp(v, "alloc") == 0) return Mode::kAlloc;
    if (std::strcmp(v, "segments") == 0) return Mode::kSegments;
    return Mode::kOff;
  }();
  return m;
}
bool wanted() {
  return mode() != Mode::kOff;
}

bool has_hooked_locked(const Lane& L) {
  for (std::size_t i = 0; i < L.nblocks; ++i)
    if (L.blocks[i].hooked && L.blocks[i].freed == nullptr) return true;
  return false;
}

// Ends the blocks whose stream-ordered free has happened on the device; with
// `wait`, all of them, waiting for their streams (before a boundary promotes the
// live blocks or the lane is given up: a freed block is never the program's again).
void reclaim_locked(Lane& L, bool wait) {
  const LaneDriver& d = lane_driver();
  const bool any = std::any_of(L.blocks, L.blocks + L.nblocks,
                               [](const Block& b) { return b.freed != nullptr; });
  if (!any) return;
  CtxScope scope(L.ctx);
  std::size_t kept = 0;
  for (std::size_t i = 0; i < L.nblocks; ++i) {
    Block& b = L.blocks[i];
    if (b.freed != nullptr) {
      const CUresult r = wait ? d.event_synchronize(b.freed) : d.event_query(b.freed);
      if (r != CUDA_ERROR_NOT_READY) {  // done, or the context is gone: either way over
        d.event_destroy(b.freed);
        continue;
      }
    }
    L.blocks[kept++] = b;
  }
  L.nblocks = kept;
}

void note_once(Lane& L, const char* what, CUresult r) {
  if (L.reported_fail) return;
  L.reported_fail = true;
  char line[160];
  std::snprintf(line, sizeof line, "shared lane: %s failed (CUresult %d); running without it", what,
                static_cast<int>(r));
  post_note(line);
}

// Takes every message waiting on the socket; keeps the newest memory.
void receive_locked(Lane& L) {
  for (;;) {
    salus_lane_msg msg{};
    iovec iov{&msg, sizeof msg};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(L.sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n <= 0) return;
    int fd = -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
        std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
    if (fd < 0) continue;
    if (n != static_cast<ssize_t>(sizeof msg) || msg.magic != SALUS_LANE_MAGIC || msg.bytes == 0) {
      ::close(fd);
      continue;
    }
    if (L.mem_fd >= 0) ::close(L.mem_fd);
    L.mem_fd = fd;
    L.mem_gen = msg.generation;
    L.mem_bytes = msg.bytes;
  }
}

// Synchronizes the mapping's context and unmaps the lane memory. The handle
// and the reservation stay for the next turn.
void unmap_locked(Lane& L) {
  if (L.mapped_gen == 0) return;
  const LaneDriver& d = lane_driver();
  {
    CtxScope scope(L.ctx);
    d.ctx_synchronize();  // the lane's bytes are the next session's once reported
    reclaim_locked(L, true);
    d.unmap(L.base, L.reserved);
  }
  L.mapped_gen = 0;
  L.nblocks = 0;
}

// The lane memory holds cuMemAlloc blocks that could not be promoted, and the
// program can no longer hold it as the lane (salusd abandoned it, or let go):
// the mapping stays where it is as a kept region of the program's, and the
// handle, the reservation and the generation are forgotten by the lane.
void keep_locked(Lane& L) {
  Region& r = outlived().regions[L.base];
  r.size = L.reserved;
  r.kept = true;
  for (std::size_t i = 0; i < L.nblocks; ++i) {
    const Block& b = L.blocks[i];
    if (!b.hooked) continue;
    outlived().owned[L.base + b.off] = Owned{L.base, b.len};
    ++r.kept_live;
  }
  lane_driver().release(L.handle);  // the mapping keeps the memory alive
  char line[200];
  std::snprintf(line, sizeof line,
                "shared lane: %zu allocation(s) stay in lane memory of %zu bytes that the program "
                "keeps (not promoted); it is given back when they are freed",
                r.kept_live, L.reserved);
  post_note(line);
  L.handle = 0;
  L.handle_gen = 0;
  L.base = 0;
  L.reserved = 0;
  L.mapped_gen = 0;
  L.nblocks = 0;
}

// Gives up the current mapping: kept if cuMemAlloc blocks live in it.
void let_go_locked(Lane& L) {
  if (L.mapped_gen != 0) reclaim_locked(L, true);
  if (L.mapped_gen != 0 && has_hooked_locked(L))
    keep_locked(L);
  else
    unmap_locked(L);
}

void drop_handle_locked(Lane& L) {
  const LaneDriver& d = lane_driver();
  if (L.handle != 0) d.release(L.handle);
  L.handle = 0;
  L.handle_gen = 0;
  if (L.reserved != 0) d.addr_free(L.base, L.reserved);
  L.base = 0;
  L.reserved = 0;
}

// Maps generation `gen` (what lane_grant says) if salusd sent it. True if mapped.
bool map_locked(Lane& L, salus_gate* g, std::uint32_t gen) {
  if (L.mapped_gen == gen) return true;
  if (L.mapped_gen != 0) {
    // An older memory (salusd abandoned it to us): never used as the lane again.
    let_go_locked(L);
    __atomic_store_n(&g->lane_held, 0u, __ATOMIC_SEQ_CST);
    ring_bell();
  }
  receive_locked(L);
  if (L.mem_gen != gen || L.mem_fd < 0) return false;
  const LaneDriver& d = lane_driver();
  CUcontext ctx = nullptr;
  if (!d.ok || driver().ctx_get_current(&ctx) != CUDA_SUCCESS || ctx == nullptr) return false;
  CUresult r = CUDA_SUCCESS;
  if (L.handle_gen != gen) {
    drop_handle_locked(L);
    r = d.import(&L.handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(L.mem_fd)),
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) return note_once(L, "cuMemImportFromShareableHandle", r), false;
    L.handle_gen = gen;
    r = d.reserve(&L.base, L.mem_bytes, 0, 0, 0);
    if (r != CUDA_SUCCESS) return note_once(L, "cuMemAddressReserve", r), false;
    L.reserved = L.mem_bytes;
  }
  CUdevice dev = 0;
  d.ctx_get_device(&dev);
  r = d.map(L.base, L.reserved, 0, L.handle, 0);
  if (r != CUDA_SUCCESS) return note_once(L, "cuMemMap", r), false;
  r = grant_access(d, L.base, L.reserved, dev);
  if (r != CUDA_SUCCESS) {
    d.unmap(L.base, L.reserved);
    return note_once(L, "cuMemSetAccess", r), false;
  }
  L.mapped_gen = gen;
  L.ctx = ctx;
  L.gate = g;
  L.nblocks = 0;
  // Sequentially consistent against salusd's store of lane_grant = 0 and its
  // load of lane_held (broker_lanes.cpp): if salusd took the lane back while
  // we mapped, it may already have handed it on seeing lane_held 0, so give
  // it back now, before the program touches it.
  __atomic_store_n(&g->lane_held, gen, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&g->lane_grant, __ATOMIC_SEQ_CST) != gen) {
    unmap_locked(L);
    __atomic_store_n(&g->lane_held, 0u, __ATOMIC_SEQ_CST);
    ring_bell();
    return false;
  }
  return true;
}

// First fit in the gaps between the sorted blocks.
int alloc_locked(Lane& L, std::size_t n, CUdeviceptr* p, bool hooked) {
  reclaim_locked(L, false);
  if (L.nblocks == kMaxBlocks) return -ENOMEM;
  const std::size_t len = (n + kAlign - 1) / kAlign * kAlign;
  std::size_t at = 0, i = 0;
  for (; i < L.nblocks; ++i) {
    if (L.blocks[i].off - at >= len) break;
    at = L.blocks[i].off + L.blocks[i].len;
  }
  if (len > L.reserved - at) return -ENOMEM;
  for (std::size_t j = L.nblocks; j > i; --j) L.blocks[j] = L.blocks[j - 1];
  L.blocks[i] = Block{at, len, hooked, nullptr};
  ++L.nblocks;
  *p = L.base + at;
  return 0;
}

// Ends the salus_lane_alloc blocks, keeping the cuMemAlloc ones. Returns how
// many ended.
std::size_t drop_explicit_locked(Lane& L) {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < L.nblocks; ++i)
    if (L.blocks[i].hooked) L.blocks[kept++] = L.blocks[i];
  const std::size_t ended = L.nblocks - kept;
  L.nblocks = kept;
  return ended;
}

}  // namespace

int lane_socket_for_attach() {
  Lane& L = g_lane;
  if (!wanted()) return -1;
  std::lock_guard lk(L.mu);
  if (L.sock >= 0) ::close(L.sock);
  L.sock = -1;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) return -1;
  L.sock = fds[0];
  L.peer = fds[1];
  L.on.store(true, std::memory_order_release);
  return L.peer;
}

void lane_attach_done(bool ok) {
  Lane& L = g_lane;
  std::lock_guard lk(L.mu);
  // salusd took its own copy of its end with pidfd_getfd during the write.
  if (L.peer >= 0) ::close(L.peer);
  L.peer = -1;
  if (!ok && L.sock >= 0) {
    L.on.store(false, std::memory_order_release);
    ::close(L.sock);
    L.sock = -1;
  }
}

void serve_lane(salus_gate* g, bool granted) {
  Lane& L = g_lane;
  if (!L.on.load(std::memory_order_acquire)) return;  // not opted in
  if (mode() == Mode::kSegments) return room_serve(g);
  std::lock_guard lk(L.mu);
  const std::uint32_t grant = __atomic_load_n(&g->lane_grant, __ATOMIC_ACQUIRE);
  if (L.mapped_gen != 0 && grant != L.mapped_gen) {
    // salusd gives the lane to another session: the yield report. cuMemAlloc
    // blocks made since the boundary (by another thread) are promoted first;
    // while any that could not be live in it, it is not given back: their
    // bytes stay mapped until salusd abandons the memory to the program (2 s).
    if (has_hooked_locked(L)) {
      drop_explicit_locked(L);
      promote_locked(L);
    }
    if (!has_hooked_locked(L)) {
      unmap_locked(L);
      __atomic_store_n(&g->lane_held, 0u, __ATOMIC_RELEASE);
      ring_bell();
    }
  }
  if (granted && grant != 0) map_locked(L, g, grant);
}

std::size_t lane_boundary() {
  Lane& L = g_lane;
  if (!L.on.load(std::memory_order_acquire)) return 0;
  if (mode() == Mode::kSegments) return room_boundary(), 0;
  std::lock_guard lk(L.mu);
  // Every salus_lane_alloc block ends at the boundary; cuMemAlloc blocks are
  // promoted (or, if that fails, stay, and so does the mapping).
  const std::size_t ended = drop_explicit_locked(L);
  if (L.mapped_gen != 0) reclaim_locked(L, true);
  if (L.nblocks > 0 && L.mapped_gen != 0) promote_locked(L);
  return ended;
}

bool lane_room_mode() {
  return mode() == Mode::kSegments;
}

bool lane_room_active() {
  return mode() == Mode::kSegments && g_lane.on.load(std::memory_order_acquire);
}

bool lane_serves_allocs() {
  return mode() == Mode::kAlloc && g_lane.on.load(std::memory_order_acquire);
}

bool lane_try_alloc(CUdeviceptr* p, std::size_t n) {
  Lane& L = g_lane;
  if (mode() != Mode::kAlloc || !L.on.load(std::memory_order_acquire)) return false;
  note_gpu_use();  // lane memory counts: no descendant takes this session over
  std::lock_guard lk(L.mu);
  salus_gate* g = gate();
  const std::uint32_t grant = __atomic_load_n(&g->lane_grant, __ATOMIC_ACQUIRE);
  if (grant == 0 || (L.mapped_gen != grant && !map_locked(L, g, grant))) return false;
  if (alloc_locked(L, n, p, true) != 0) return false;  // full: the charged path
  L.ever_hooked.store(true, std::memory_order_release);
  return true;
}

bool lane_try_free(CUdeviceptr p, CUresult* r) {
  Lane& L = g_lane;
  if (!L.ever_hooked.load(std::memory_order_acquire)) return false;
  std::lock_guard lk(L.mu);
  if (L.mapped_gen != 0 && p >= L.base && p < L.base + L.reserved) {
    for (std::size_t i = 0; i < L.nblocks; ++i) {
      if (L.base + L.blocks[i].off != p || !L.blocks[i].hooked || L.blocks[i].freed != nullptr)
        continue;
      // As the driver's cuMemFree: work still using the block ends first, so
      // the next allocation that gets its room cannot race with it.
      {
        CtxScope scope(L.ctx);
        lane_driver().ctx_synchronize();
      }
      std::copy(L.blocks + i + 1, L.blocks + L.nblocks, L.blocks + i);
      --L.nblocks;
      *r = CUDA_SUCCESS;
      return true;
    }
    return false;
  }
  auto it = outlived().owned.find(p);
  if (it == outlived().owned.end()) return false;
  *r = free_owned_locked(L, it);
  return true;
}

bool lane_try_free_async(CUdeviceptr p, CUstream stream, CUresult* r) {
  Lane& L = g_lane;
  if (!L.ever_hooked.load(std::memory_order_acquire)) return false;
  const LaneDriver& d = lane_driver();
  {
    std::lock_guard lk(L.mu);
    if (L.mapped_gen != 0 && p >= L.base && p < L.base + L.reserved && d.events_ok) {
      for (std::size_t i = 0; i < L.nblocks; ++i) {
        Block& b = L.blocks[i];
        if (L.base + b.off != p || !b.hooked || b.freed != nullptr) continue;
        // Stream-ordered, as the driver's: the room is free once the stream
        // gets here, and nothing waits for it now (PyTorch's cudaMallocAsync
        // backend frees this way after every tensor).
        CtxScope scope(L.ctx);
        CUevent ev = nullptr;
        if (d.event_create(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS &&
            d.event_record(ev, stream) == CUDA_SUCCESS) {
          b.freed = ev;
          *r = CUDA_SUCCESS;
          return true;
        }
        if (ev != nullptr) d.event_destroy(ev);
        break;  // no event: free it at once, waiting as cuMemFree does
      }
    }
  }
  return lane_try_free(p, r);
}

void lane_detach(salus_gate* g) {
  Lane& L = g_lane;
  if (mode() == Mode::kSegments && L.on.load(std::memory_order_acquire)) room_detach(g);
  std::lock_guard lk(L.mu);
  let_go_locked(L);
  drop_handle_locked(L);
  if (g != nullptr) __atomic_store_n(&g->lane_held, 0u, __ATOMIC_RELEASE);
  if (L.mem_fd >= 0) ::close(L.mem_fd);
  L.mem_fd = -1;
  L.mem_gen = 0;
  L.on.store(false, std::memory_order_release);
  if (L.sock >= 0) ::close(L.sock);
  L.sock = -1;
}

void lane_forget_in_child() {
  // A forked child never holds the parent's lane (it runs ungated).
  Lane& L = g_lane;
  L.on.store(false);
  L.sock = -1;
  L.peer = -1;
  L.mapped_gen = 0;
  L.nblocks = 0;
  room_forget_in_child();
}

}  // namespace salus::shim

using salus::shim::g_lane;

extern "C" SALUS_EXPORT int salus_lane_alloc(unsigned long long* p, size_t n) {
  if (p == nullptr || n == 0) return -EINVAL;
  auto& L = g_lane;
  if (!L.on.load(std::memory_order_acquire)) return -ENOTCONN;
  std::lock_guard lk(L.mu);
  salus_gate* g = salus::shim::gate();
  const std::uint32_t grant = __atomic_load_n(&g->lane_grant, __ATOMIC_ACQUIRE);
  if (grant == 0 || (L.mapped_gen != grant && !salus::shim::map_locked(L, g, grant)))
    return -ENOTCONN;
  CUdeviceptr d = 0;
  const int r = salus::shim::alloc_locked(L, n, &d, false);
  if (r == 0) *p = d;
  return r;
}

extern "C" SALUS_EXPORT int salus_lane_free(unsigned long long p) {
  auto& L = g_lane;
  std::lock_guard lk(L.mu);
  for (std::size_t i = 0; i < L.nblocks; ++i) {
    if (L.base + L.blocks[i].off != p) continue;
    for (std::size_t j = i + 1; j < L.nblocks; ++j) L.blocks[j - 1] = L.blocks[j];
    --L.nblocks;
    return 0;
  }
  return -EINVAL;
}

extern "C" SALUS_EXPORT uint64_t salus_lane_bytes(void) {
  auto& L = g_lane;
  std::lock_guard lk(L.mu);
  return L.mapped_gen != 0 ? L.reserved : 0;
}
