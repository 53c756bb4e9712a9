// Movable memory of an attached program (SALUS_SWAP=1): cuMemAlloc_v2,
// cuMemAllocPitch_v2 and cuMemAllocAsync are served from the driver's VMM (an
// address range reserved for good, a physical handle mapped into it), so the
// shim owns the physical memory and can move it; the program's own cuMemCreate
// handles move with them (program_handles.cpp). Swap-out, asked by salusd while the program
// waits at the gate: synchronize, copy every allocation to pinned host memory
// (past SALUS_SWAP_HOST_LIMIT, to an unlinked spill file in SALUS_SWAP_DIR),
// and only once *every* copy is safe unmap and release the device memory; the
// address stays reserved. Swap-in: create, map at the same address, set access,
// copy back, then free the host copies. A failure on the way out frees the
// copies and leaves everything on the GPU; on the way in it undoes what it
// mapped and keeps the copies. Why VMM rather than managed memory:
// docs/design.md, "Movable memory of attached sessions".
//
// Nothing here is on the launch path. Allocation and free take the registry's
// mutex; a swap holds it throughout (another thread's allocation waits).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "client/shim/swap_state.hpp"

namespace salus::shim {

CUmemAllocationProp device_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

namespace swap_detail {

const VmmDriver& vmm_driver() {
  static const VmmDriver v = [] {
    VmmDriver r;
    bool ok = true;
    auto get = [&](const char* name, auto& out) {
      void* p = driver_proc(name);
      if (p == nullptr) ok = false;
      out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(p);
    };
    get("cuMemAddressReserve", r.reserve);
    get("cuMemAddressFree", r.addr_free);
    get("cuMemCreate", r.create);
    get("cuMemRelease", r.release);
    get("cuMemMap", r.map);
    get("cuMemUnmap", r.unmap);
    get("cuMemSetAccess", r.set_access);
    get("cuMemGetAllocationGranularity", r.granularity);
    get("cuCtxGetDevice", r.ctx_get_device);
    get("cuCtxSynchronize", r.ctx_synchronize);
    get("cuMemHostAlloc", r.host_alloc);
    get("cuMemFreeHost", r.free_host);
    get("cuMemcpyDtoH", r.dtoh);
    get("cuMemcpyHtoD", r.htod);
    get("cuEventQuery", r.event_query);
    get("cuEventDestroy", r.event_destroy);
    const bool required = ok;
    get("cuMemcpyDtoHAsync", r.dtoh_async);
    get("cuStreamCreate", r.stream_create);
    get("cuStreamSynchronize", r.stream_sync);
    get("cuStreamDestroy", r.stream_destroy);
    if (!ok) r.dtoh_async = nullptr;  // all four or none
    r.ok = required && driver().ok;
    return r;
  }();
  return v;
}

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: hooks may run at exit
  return *r;
}
std::atomic<std::uint64_t> g_movable{0};
std::atomic<std::uint64_t> g_swapped{0};

}  // namespace swap_detail

namespace {

using namespace swap_detail;
using Clock = std::chrono::steady_clock;

std::uint64_t env_bytes(const char* name, std::uint64_t dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  return end == v ? dflt : n;
}

// Maps a fresh handle at a.va-to-be: create, map, access. 0 or a CUresult.
CUresult map_new(const VmmDriver& d, CUdeviceptr va, Alloc& a) {
  const CUmemAllocationProp prop = device_prop(a.dev);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d.create(&h, a.size, &prop, 0);
  if (r != CUDA_SUCCESS) return r;
  r = d.map(va, a.size, 0, h, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc acc{};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d.set_access(va, a.size, &acc, 1);
    if (r != CUDA_SUCCESS) d.unmap(va, a.size);
  }
  if (r != CUDA_SUCCESS) {
    d.release(h);
    return r;
  }
  a.handle = h;
  return CUDA_SUCCESS;
}

// Gives the device memory of a back (its address stays reserved).
void unmap_release(const VmmDriver& d, CUdeviceptr va, Alloc& a) {
  d.unmap(va, a.size);
  d.release(a.handle);
  a.handle = 0;
}

// Releases what cuMemFreeAsync freed and its stream has finished with.
// Caller holds the registry; `cur`: the thread's current context, switched to
// each allocation's own (null: the caller's context is theirs already).
void reap_locked(const VmmDriver& d, Registry& R, CUcontext* cur = nullptr) {
  for (std::size_t i = 0; i < R.freed.size();) {
    Registry::Freed& f = R.freed[i];
    if (cur != nullptr) use_ctx(f.a.ctx, *cur);
    if (d.event_query(f.done) == CUDA_ERROR_NOT_READY) {
      ++i;
      continue;
    }
    unmap_release(d, f.va, f.a);
    d.addr_free(f.va, f.a.size);
    d.event_destroy(f.done);
    R.freed[i] = R.freed.back();
    R.freed.pop_back();
  }
}

// Pinned buffers are kept for the next swap-out (SALUS_SWAP_KEEP_PINNED, on
// by default): pinning gigabytes costs more than copying them, and an
// iteration-granular swap moves the same allocations again and again.
bool keep_pinned() {
  static const bool keep = [] {
    const char* v = std::getenv("SALUS_SWAP_KEEP_PINNED");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return keep;
}

void free_spare(const VmmDriver& d, Registry& R, std::multimap<std::size_t, void*>::iterator it) {
  d.free_host(it->second);
  R.pinned -= it->first;
  R.spare.erase(it);
}

// A pinned buffer of n bytes for a copy: a kept one of that size, or a new one
// within the host limit (kept ones of other sizes give way). Caller holds the registry.
void* take_pinned(const VmmDriver& d, Registry& R, std::size_t n, std::uint64_t limit) {
  if (auto it = R.spare.find(n); it != R.spare.end()) {
    void* p = it->second;
    R.spare.erase(it);
    return p;
  }
  while (R.pinned + n > limit && !R.spare.empty()) free_spare(d, R, R.spare.begin());
  if (R.pinned + n > limit) return nullptr;
  void* p = nullptr;
  if (d.host_alloc(&p, n, 0) != CUDA_SUCCESS) {
    if (R.spare.empty()) return nullptr;
    while (!R.spare.empty()) free_spare(d, R, R.spare.begin());
    if (d.host_alloc(&p, n, 0) != CUDA_SUCCESS) return nullptr;
  }
  R.pinned += n;
  return p;
}

}  // namespace

namespace swap_detail {

void use_ctx(CUcontext ctx, CUcontext& cur) {
  if (ctx != cur && driver().ctx_set_current(ctx) == CUDA_SUCCESS) cur = ctx;
}

void drop_copy(const VmmDriver& d, Registry& R, Alloc& a, bool keep) {
  if (a.host != nullptr) {
    if (keep && keep_pinned()) {
      R.spare.emplace(a.size, a.host);
    } else {
      d.free_host(a.host);
      R.pinned -= a.size;
    }
    a.host = nullptr;
  }
  a.spill_at = -1;
}

}  // namespace swap_detail

namespace {

constexpr std::size_t kChunk = std::size_t{8} << 20;  // spill file I/O unit

// What spill_out copies through: two pinned chunks and a stream of its own, so
// that the next chunk comes off the GPU (cuMemcpyDtoHAsync) while this one is
// written; or, without them (no pinned memory, an old driver), one malloc'd
// chunk, copied and written in turns. Freed by its owner (copy_out).
struct Bounce {
  char* buf[2] = {nullptr, nullptr};
  bool pinned = false;
  CUstream stream = nullptr;
  bool ok() const { return buf[0] != nullptr; }
  void make(const VmmDriver& d) {
    if (d.dtoh_async && d.stream_create(&stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
      void* p[2] = {nullptr, nullptr};
      if (d.host_alloc(&p[0], kChunk, 0) == CUDA_SUCCESS &&
          d.host_alloc(&p[1], kChunk, 0) == CUDA_SUCCESS) {
        buf[0] = static_cast<char*>(p[0]);
        buf[1] = static_cast<char*>(p[1]);
        pinned = true;
        return;
      }
      if (p[0]) d.free_host(p[0]);
      d.stream_destroy(stream);
      stream = nullptr;
    }
    buf[0] = static_cast<char*>(std::malloc(kChunk));
  }
  void drop(const VmmDriver& d) {
    if (pinned) {
      d.stream_sync(stream);  // nothing may still be copying into them
      d.stream_destroy(stream);
      d.free_host(buf[0]);
      d.free_host(buf[1]);
    } else {
      std::free(buf[0]);
    }
    *this = Bounce{};
  }
};

int write_all(int fd, const char* p, std::size_t n, off_t at) {
  for (std::size_t w = 0; w < n;) {
    const ssize_t k = ::pwrite(fd, p + w, n - w, at + static_cast<off_t>(w));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? -errno : -ENOSPC;
    w += static_cast<std::size_t>(k);
  }
  return 0;
}

// Copies a to the spill file through the bounce buffers. 0 or -errno.
int spill_out(const VmmDriver& d, Registry& R, CUdeviceptr va, Alloc& a, Bounce& b) {
  if (R.spill_fd < 0) {
    const char* dir = std::getenv("SALUS_SWAP_DIR");
    if (dir == nullptr || *dir == '\0') return -ENOMEM;  // no spill place: host memory is all
    // Unlinked from the start: a killed program leaves nothing on disk.
    R.spill_fd = ::open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (R.spill_fd < 0) return -errno;
    R.spill_end = 0;
  }
  a.spill_at = R.spill_end;
  if (!b.pinned) {
    for (std::size_t done = 0; done < a.size; done += kChunk) {
      const std::size_t n = std::min(kChunk, a.size - done);
      if (d.dtoh(b.buf[0], va + done, n) != CUDA_SUCCESS) return -EIO;
      if (const int rc = write_all(R.spill_fd, b.buf[0], n, a.spill_at + static_cast<off_t>(done)))
        return rc;
    }
  } else {
    // Chunk k is in buf[k % 2]: it is written while chunk k + 1 is on its way.
    if (d.dtoh_async(b.buf[0], va, std::min(kChunk, a.size), b.stream) != CUDA_SUCCESS) return -EIO;
    for (std::size_t done = 0, k = 0; done < a.size; done += kChunk, ++k) {
      const std::size_t n = std::min(kChunk, a.size - done);
      if (d.stream_sync(b.stream) != CUDA_SUCCESS) return -EIO;
      const std::size_t next = done + kChunk;
      if (next < a.size && d.dtoh_async(b.buf[(k + 1) % 2], va + next,
                                        std::min(kChunk, a.size - next), b.stream) != CUDA_SUCCESS)
        return -EIO;
      if (const int rc =
              write_all(R.spill_fd, b.buf[k % 2], n, a.spill_at + static_cast<off_t>(done)))
        return rc;  // Bounce::drop waits for the copy still on its way
    }
  }
  R.spill_end += static_cast<off_t>(a.size);
  return 0;
}

int spill_in(const VmmDriver& d, Registry& R, CUdeviceptr va, const Alloc& a, char* bounce) {
  for (std::size_t done = 0; done < a.size; done += kChunk) {
    const std::size_t n = std::min(kChunk, a.size - done);
    for (std::size_t got = 0; got < n;) {
      const ssize_t k =
          ::pread(R.spill_fd, bounce + got, n - got, a.spill_at + static_cast<off_t>(done + got));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return k < 0 ? -errno : -EIO;
      got += static_cast<std::size_t>(k);
    }
    if (d.htod(va + done, bounce, n) != CUDA_SUCCESS) return -EIO;
  }
  return 0;
}

void close_spill(Registry& R) {
  if (R.spill_fd >= 0) ::close(R.spill_fd);
  R.spill_fd = -1;
  R.spill_end = 0;
}

// Copies each piece off the GPU. 0 or -errno (copies made so far are dropped
// by the caller). Caller holds the registry.
int copy_out(const VmmDriver& d, Registry& R, const std::vector<Piece>& pieces, CUcontext& cur,
             std::string& why) {
  const std::uint64_t limit = env_bytes("SALUS_SWAP_HOST_LIMIT", UINT64_MAX);
  Bounce bounce;
  int rc = 0;
  for (const Piece& p : pieces) {
    Alloc& a = *p.a;
    use_ctx(a.ctx, cur);
    a.host = take_pinned(d, R, a.size, limit);
    if (a.host != nullptr) {
      if (d.dtoh(a.host, p.va, a.size) != CUDA_SUCCESS) {
        why = "cuMemcpyDtoH failed";
        rc = -EIO;
        break;
      }
      continue;
    }
    if (!bounce.ok()) bounce.make(d);
    rc = !bounce.ok() ? -ENOMEM : spill_out(d, R, p.va, a, bounce);
    if (rc != 0) {
      why = rc == -ENOMEM ? "pinned host memory ran out and no SALUS_SWAP_DIR is set"
                          : std::string("spill file: ") + std::strerror(-rc);
      break;
    }
  }
  if (bounce.ok()) bounce.drop(d);
  return rc;
}

// Puts a piece's copy back at va (mapped already). 0 or -errno.
int copy_in(const VmmDriver& d, Registry& R, CUdeviceptr va, const Alloc& a, char*& bounce) {
  if (a.host != nullptr) return d.htod(va, a.host, a.size) == CUDA_SUCCESS ? 0 : -EIO;
  if (bounce == nullptr) bounce = static_cast<char*>(std::malloc(kChunk));
  return bounce == nullptr ? -ENOMEM : spill_in(d, R, va, a, bounce);
}

void report(salus_gate* g, std::uint32_t seq, int result, std::uint32_t state) {
  __atomic_store_n(&g->swap_result, result, __ATOMIC_RELAXED);
  __atomic_store_n(&g->swap_state, state, __ATOMIC_RELAXED);
  publish();
  __atomic_store_n(&g->swap_done_seq, seq, __ATOMIC_RELEASE);
}

void note_failure(const char* what, int rc, const std::string& why) {
  char line[300];
  std::snprintf(line, sizeof line, "swap %s failed (%s): %s; %s", what, std::strerror(-rc),
                why.c_str(),
                std::strcmp(what, "out") == 0 ? "everything stays on the GPU"
                                              : "the memory stays on the host");
  post_note(line);
}

// What a swap-out moves now: the shim's allocations and the program's own
// handles that are on the GPU.
std::vector<Piece> resident_pieces(Registry& R) {
  std::vector<Piece> out;
  for (auto& [va, a] : R.allocs)
    if (a.handle != 0) out.push_back({va, &a, nullptr});
  program_handles_to_move(R, out);
  return out;
}

// Swap-out, all or nothing. Caller holds the registry. 0 or -errno.
int swap_out_locked(Registry& R, salus_gate* g) {
  const VmmDriver& d = vmm_driver();
  const auto t0 = Clock::now();
  CUcontext prev = nullptr, cur = nullptr;
  driver().ctx_get_current(&prev);
  cur = prev;
  __atomic_store_n(&g->swap_state, SALUS_SWAP_OUT_BUSY, __ATOMIC_RELAXED);
  const std::vector<Piece> pieces = resident_pieces(R);
  // Nothing of the program's may still run on memory about to move: one
  // synchronize per context (allocations come in runs of the same one).
  CUcontext synced = nullptr;
  for (const Piece& p : pieces)
    if (synced == nullptr || p.a->ctx != synced) {
      use_ctx(p.a->ctx, cur);
      d.ctx_synchronize();
      synced = p.a->ctx;
    }
  reap_locked(d, R, &cur);  // what was freed in stream order is free now
  std::string why;
  int rc = copy_out(d, R, pieces, cur, why);
  if (rc != 0) {
    for (const Piece& p : pieces) drop_copy(d, R, *p.a);
    close_spill(R);
    note_failure("out", rc, why);
  } else {
    std::uint64_t moved = 0;
    for (const Piece& p : pieces) {
      if (p.program != nullptr)
        program_handle_out(d, *p.program);
      else
        unmap_release(d, p.va, *p.a);
      moved += p.a->size;
    }
    g_swapped.fetch_add(moved);
    R.swapped = true;
    __atomic_fetch_add(&g->swaps_out, 1, __ATOMIC_RELAXED);
  }
  if (cur != prev) driver().ctx_set_current(prev);
  __atomic_fetch_add(&g->swap_ns, static_cast<std::uint64_t>((Clock::now() - t0).count()),
                     __ATOMIC_RELAXED);
  return rc;
}

// Brings one piece back: mapped again (at its address, or wherever the
// program's handle was mapped) and its copy put back. 0 or -errno.
int restore(const VmmDriver& d, Registry& R, const Piece& p, char*& bounce, std::string& why) {
  Alloc& a = *p.a;
  bool copying = false;
  const auto put_back = [&](CUdeviceptr va) {
    copying = true;
    return copy_in(d, R, va, a, bounce);
  };
  int rc = 0;
  if (p.program != nullptr) {
    rc = program_handle_in(d, *p.program, put_back);
  } else if (const CUresult r = map_new(d, p.va, a); r != CUDA_SUCCESS) {
    rc = r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
  } else if (rc = put_back(p.va); rc != 0) {
    unmap_release(d, p.va, a);
  }
  if (rc != 0)
    why = copying         ? "copying back failed"
          : rc == -ENOMEM ? "the GPU has no room for it yet"
                          : "cuMemCreate/cuMemMap failed";
  return rc;
}

// Swap-in, all or nothing. Caller holds the registry. 0 or -errno.
int swap_in_locked(Registry& R, salus_gate* g) {
  const VmmDriver& d = vmm_driver();
  const auto t0 = Clock::now();
  CUcontext prev = nullptr, cur = nullptr;
  driver().ctx_get_current(&prev);
  cur = prev;
  __atomic_store_n(&g->swap_state, SALUS_SWAP_IN_BUSY, __ATOMIC_RELAXED);
  std::vector<Piece> pieces;
  for (auto& [va, a] : R.allocs)
    if (a.handle == 0) pieces.push_back({va, &a, nullptr});
  program_handles_to_restore(R, pieces);
  char* bounce = nullptr;
  int rc = 0;
  std::string why;
  std::size_t done = 0;
  for (; done < pieces.size() && rc == 0; ++done) {
    use_ctx(pieces[done].a->ctx, cur);
    rc = restore(d, R, pieces[done], bounce, why);
  }
  std::free(bounce);
  if (rc != 0) {
    // Undo: what was mapped again goes (the failed piece undid itself), the copies stay.
    for (std::size_t i = 0; i + 1 < done; ++i) {
      use_ctx(pieces[i].a->ctx, cur);
      if (pieces[i].program != nullptr)
        program_handle_out(d, *pieces[i].program);
      else
        unmap_release(d, pieces[i].va, *pieces[i].a);
    }
    note_failure("in", rc, why);
  } else {
    for (const Piece& p : pieces) drop_copy(d, R, *p.a);
    close_spill(R);
    g_swapped.store(0);
    R.swapped = false;
    __atomic_fetch_add(&g->swaps_in, 1, __ATOMIC_RELAXED);
  }
  if (cur != prev) driver().ctx_set_current(prev);
  __atomic_fetch_add(&g->swap_ns, static_cast<std::uint64_t>((Clock::now() - t0).count()),
                     __ATOMIC_RELAXED);
  return rc;
}

}  // namespace

bool swap_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SALUS_SWAP");
    if (v == nullptr || std::strcmp(v, "1") != 0) return false;
    if (vmm_driver().ok) return true;
    std::fprintf(stderr,
                 "salus-shim: SALUS_SWAP=1, but the driver has no VMM: memory stays "
                 "unmovable\n");
    return false;
  }();
  return on;
}

std::size_t swap_granularity() {
  static const std::size_t gran = [] {
    const VmmDriver& d = vmm_driver();
    CUdevice dev = 0;
    std::size_t n = 0;
    if (d.ctx_get_device(&dev) != CUDA_SUCCESS) dev = 0;
    const CUmemAllocationProp prop = device_prop(dev);
    if (d.granularity(&n, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || n == 0)
      n = d.gran;
    return n;
  }();
  return gran;
}

CUresult movable_alloc(CUdeviceptr* p, std::size_t n) {
  const VmmDriver& d = vmm_driver();
  Alloc a;
  a.size = n;
  if (CUresult r = d.ctx_get_device(&a.dev); r != CUDA_SUCCESS) return r;
  driver().ctx_get_current(&a.ctx);
  CUdeviceptr va = 0;
  if (CUresult r = d.reserve(&va, n, 0, 0, 0); r != CUDA_SUCCESS) return r;
  if (CUresult r = map_new(d, va, a); r != CUDA_SUCCESS) {
    d.addr_free(va, n);
    return r;
  }
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  reap_locked(d, R);
  R.allocs[va] = a;
  g_movable.fetch_add(n);
  *p = va;
  return CUDA_SUCCESS;
}

bool movable_free(CUdeviceptr p, CUresult* r) {
  if (!swap_enabled()) return false;
  const VmmDriver& d = vmm_driver();
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  auto it = R.allocs.find(p);
  if (it == R.allocs.end()) return false;
  Alloc& a = it->second;
  if (a.handle != 0) {
    // cuMemFree synchronizes the device before it frees; cuMemUnmap and
    // cuMemRelease do not (work still queued may use the memory), so do it here.
    if (CUresult sr = d.ctx_synchronize(); sr != CUDA_SUCCESS) {
      *r = sr;
      return true;
    }
    *r = d.unmap(p, a.size);
    if (*r != CUDA_SUCCESS) return true;
    d.release(a.handle);
  } else {
    g_swapped.fetch_sub(a.size);
    drop_copy(d, R, a, false);  // a spilled copy's bytes are left in the file until swap-in
  }
  d.addr_free(p, a.size);
  g_movable.fetch_sub(a.size);
  R.allocs.erase(it);
  *r = CUDA_SUCCESS;
  return true;
}

bool movable_free_async(CUdeviceptr p, CUstream stream, CUresult* r) {
  if (!swap_enabled()) return false;
  const VmmDriver& d = vmm_driver();
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  auto it = R.allocs.find(p);
  if (it == R.allocs.end()) return false;
  Alloc& a = it->second;
  if (a.handle != 0) {
    // The stream may still use it: release it after what is queued there.
    CUevent done = nullptr;
    *r = driver().event_create(&done, CU_EVENT_DISABLE_TIMING);
    if (*r == CUDA_SUCCESS) *r = driver().event_record(done, stream);
    if (*r != CUDA_SUCCESS) {
      if (done != nullptr) d.event_destroy(done);
      return true;  // not freed: the program sees the driver's error
    }
    R.freed.push_back({p, a, done});
  } else {
    // Swapped out: no work can be using it.
    g_swapped.fetch_sub(a.size);
    drop_copy(d, R, a, false);
    d.addr_free(p, a.size);
  }
  g_movable.fetch_sub(a.size);
  R.allocs.erase(it);
  *r = CUDA_SUCCESS;
  return true;
}

bool stream_capturing(CUstream stream) {
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  const Driver& d = driver();
  return !d.ok || d.stream_is_capturing(stream, &st) != CUDA_SUCCESS ||
         st != CU_STREAM_CAPTURE_STATUS_NONE;
}

std::uint64_t movable_bytes() {
  return g_movable.load(std::memory_order_acquire);
}
std::uint64_t swapped_bytes() {
  return g_swapped.load(std::memory_order_acquire);
}

void serve_swap(salus_gate* g, bool running) {
  const std::uint32_t seq = __atomic_load_n(&g->swap_seq, __ATOMIC_ACQUIRE);
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  if (R.seq_gate != g) {
    R.seq_gate = g;
    R.done_seq = 0;
  }
  if (seq == R.done_seq) return;
  R.done_seq = seq;
  const std::uint32_t req = __atomic_load_n(&g->swap_request, __ATOMIC_ACQUIRE);
  int rc = 0;
  if (req == SALUS_SWAP_REQ_OUT) {
    if (!swap_enabled() || !vmm_driver().ok)
      rc = -ENOTSUP;  // nothing is movable: the program was started without SALUS_SWAP=1
    else if (running)
      rc = -EBUSY;  // only a program waiting at its boundary may lose its memory
    else if (!R.swapped)
      rc = swap_out_locked(R, g);
  } else if (req == SALUS_SWAP_REQ_IN) {
    if (R.swapped) rc = swap_in_locked(R, g);
  } else {
    rc = -EINVAL;
  }
  report(g, seq, rc, R.swapped ? SALUS_SWAP_SWAPPED : SALUS_SWAP_RESIDENT);
  ring_bell();
}

bool ensure_resident(salus_gate* g) {
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  if (!R.swapped) return true;
  const int rc = swap_in_locked(R, g);
  __atomic_store_n(&g->swap_result, rc, __ATOMIC_RELAXED);
  __atomic_store_n(&g->swap_state, R.swapped ? SALUS_SWAP_SWAPPED : SALUS_SWAP_RESIDENT,
                   __ATOMIC_RELEASE);
  publish();
  ring_bell();
  return rc == 0;
}

}  // namespace salus::shim
