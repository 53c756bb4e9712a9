// The shim's side of the shared lane (SALUS_SHARED_LANE=1, client/salus_gate.h):
// the socket pair named at attach, the lane memory received from salusd
// (SCM_RIGHTS), imported and mapped while the program holds the lane, and
// the ephemeral allocator salus_lane_alloc serves from it. Ephemeral means:
// valid from its allocation inside an iteration to the program's next
// boundary; every lane allocation ends there, freed or not. The lane is given
// back (synchronize, unmap, report `lane_held` = 0) only while the program
// waits at its gate, never on a launch.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "client/shim/shim.hpp"

#define SALUS_EXPORT __attribute__((visibility("default")))

namespace salus::shim {
namespace {

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
};
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
    return r;
  }();
  return v;
}

constexpr std::size_t kMaxBlocks = 1024;  // live lane allocations per iteration
constexpr std::size_t kAlign = 512;       // what cudaMalloc guarantees, and more

struct Block {
  std::size_t off;
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
};
Lane g_lane;

bool wanted() {
  static const bool on = [] {
    const char* v = std::getenv("SALUS_SHARED_LANE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
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
  CUcontext cur = nullptr;
  driver().ctx_get_current(&cur);
  if (L.ctx != nullptr && cur != L.ctx) driver().ctx_set_current(L.ctx);
  d.ctx_synchronize();  // the lane's bytes are the next session's once reported
  d.unmap(L.base, L.reserved);
  if (L.ctx != nullptr && cur != L.ctx) driver().ctx_set_current(cur);
  L.mapped_gen = 0;
  L.nblocks = 0;
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
    // An older memory (salusd abandoned it to us): never used again.
    unmap_locked(L);
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
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.set_access(L.base, L.reserved, &access, 1);
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
int alloc_locked(Lane& L, std::size_t n, CUdeviceptr* p) {
  if (L.nblocks == kMaxBlocks) return -ENOMEM;
  const std::size_t len = (n + kAlign - 1) / kAlign * kAlign;
  std::size_t at = 0, i = 0;
  for (; i < L.nblocks; ++i) {
    if (L.blocks[i].off - at >= len) break;
    at = L.blocks[i].off + L.blocks[i].len;
  }
  if (len > L.reserved - at) return -ENOMEM;
  for (std::size_t j = L.nblocks; j > i; --j) L.blocks[j] = L.blocks[j - 1];
  L.blocks[i] = Block{at, len};
  ++L.nblocks;
  *p = L.base + at;
  return 0;
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
  std::lock_guard lk(L.mu);
  const std::uint32_t grant = __atomic_load_n(&g->lane_grant, __ATOMIC_ACQUIRE);
  if (L.mapped_gen != 0 && grant != L.mapped_gen) {
    // salusd gives the lane to another session: the yield report.
    unmap_locked(L);
    __atomic_store_n(&g->lane_held, 0u, __ATOMIC_RELEASE);
    ring_bell();
  }
  if (granted && grant != 0) map_locked(L, g, grant);
}

std::size_t lane_boundary() {
  Lane& L = g_lane;
  if (!L.on.load(std::memory_order_acquire)) return 0;
  std::lock_guard lk(L.mu);
  const std::size_t live = L.nblocks;
  L.nblocks = 0;  // every lane allocation ends at the boundary
  return live;
}

void lane_detach(salus_gate* g) {
  Lane& L = g_lane;
  std::lock_guard lk(L.mu);
  unmap_locked(L);
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
  const int r = salus::shim::alloc_locked(L, n, &d);
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
