// The program's own physical allocations made movable (SALUS_SWAP=1).
//
// A program that builds its memory from VMM pieces itself (cuMemCreate,
// cuMemMap, cuMemSetAccess: PyTorch's expandable segments) holds a physical
// handle that a swap-out must release and a swap-in must make again, at the
// same addresses. The driver's handle cannot outlive that, so the program is
// given a handle of the shim's instead (tagged, never a value the driver
// hands out) and every entry point that takes or returns a handle translates
// it: cuMemMap, cuMemRelease, cuMemRetainAllocationHandle,
// cuMemGetAllocationPropertiesFromHandle, cuMemExportToShareableHandle,
// cuMulticastBindMem; and the address-range calls (cuMemUnmap,
// cuMemSetAccess) keep the mappings and access the swap replays.
//
// A handle moves only when a swap can put everything back as the program left
// it: a mapping of the whole handle that the program made readable and
// writable on its device (how expandable segments map), and nothing shared
// with the world. Exporting it (another process may map it), binding it to a
// multicast object or handing out a dma-buf of its range pins it on the GPU
// for good, counted as unswappable, as is a handle never mapped. While the
// program is swapped out (its threads may still call the driver), mapping,
// unmapping, access and release of a handle that is off the GPU are recorded
// and carried out at the swap-in.
//
// Nothing here is on the launch path: these calls come per segment, and take
// the registry's mutex like the shim's own movable allocations.
#include <algorithm>
#include <cstdio>

#include "client/shim/swap_state.hpp"

namespace salus::shim {
namespace swap_detail {
namespace {

bool grants_rw(const Mapping& m, CUdevice dev) {
  bool rw = false;
  for (const Access& e : m.access)
    for (const CUmemAccessDesc& x : e.descs)
      if (x.location.type == CU_MEM_LOCATION_TYPE_DEVICE && x.location.id == dev) {
        if (x.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
          rw = false;
        else if (e.off == 0 && e.size == m.size)
          rw = true;
      }
  return rw;
}

// The mapping a swap-out copies the handle from, or null if none will do.
const Mapping* source(const ProgramHandle& h) {
  for (const Mapping& m : h.maps)
    if (m.size == h.mem.size && grants_rw(m, h.mem.dev)) return &m;
  return nullptr;
}

std::uint64_t movable_size(const ProgramHandle& h) {
  if (h.mem.handle == 0) return h.mem.size;  // off the GPU now
  if (h.pinned || h.mem.ctx == nullptr) return 0;
  return source(h) != nullptr ? h.mem.size : 0;
}

// Keeps h's bytes in g_movable (and the gate's figures) true after a change.
void recount(ProgramHandle& h) {
  const std::uint64_t now = movable_size(h);
  if (now == h.counted) return;
  if (now > h.counted)
    g_movable.fetch_add(now - h.counted);
  else
    g_movable.fetch_sub(h.counted - now);
  h.counted = now;
}

ProgramHandle* find(Registry& R, CUmemGenericAllocationHandle id) {
  auto it = R.handles.find(id);
  return it == R.handles.end() ? nullptr : &it->second;
}

// The handle mapped over addr and that mapping, or null.
ProgramHandle* mapped_at(Registry& R, CUdeviceptr addr, Mapping** mapping,
                         CUmemGenericAllocationHandle* id = nullptr) {
  auto it = R.handle_at.upper_bound(addr);
  if (it == R.handle_at.begin()) return nullptr;
  --it;
  ProgramHandle* h = find(R, it->second);
  if (h == nullptr) return nullptr;
  for (Mapping& m : h->maps)
    if (m.va == it->first && addr < m.va + m.size) {
      *mapping = &m;
      if (id != nullptr) *id = it->second;
      return h;
    }
  return nullptr;
}

// The program's mappings that overlap [p, p + n), in address order.
struct Overlap {
  CUmemGenericAllocationHandle id;
  ProgramHandle* h;
  Mapping* m;  // valid until h's mappings change
};
std::vector<Overlap> overlapping(Registry& R, CUdeviceptr p, std::size_t n) {
  std::vector<Overlap> out;
  auto it = R.handle_at.upper_bound(p);
  if (it != R.handle_at.begin()) --it;
  for (; it != R.handle_at.end() && it->first < p + n; ++it) {
    ProgramHandle* h = find(R, it->second);
    if (h == nullptr) continue;
    for (Mapping& m : h->maps)
      if (m.va == it->first && m.va + m.size > p) out.push_back({it->second, h, &m});
  }
  return out;
}

// Does a range call (cuMemUnmap, cuMemSetAccess) on the driver for [p, p + n),
// whose program mappings are `hit`: the driver's own answer for the whole range
// when they are all on the GPU (other mappings in it too); else piece by piece
// for what is on the GPU and what lies between, skipping what is off it (the
// swap-in does its part). A CUresult.
template <typename Call>
CUresult on_driver(const std::vector<Overlap>& hit, CUdeviceptr p, std::size_t n, Call call) {
  if (std::all_of(hit.begin(), hit.end(), [](const Overlap& o) { return o.h->mem.handle != 0; }))
    return call(p, n);
  CUdeviceptr at = p;
  for (const Overlap& o : hit) {
    const CUdeviceptr lo = std::max(p, o.m->va), hi = std::min(p + n, o.m->va + o.m->size);
    if (lo > at) call(at, lo - at);
    if (o.h->mem.handle != 0) call(lo, hi - lo);
    at = hi;
  }
  if (at < p + n) call(at, p + n - at);
  return CUDA_SUCCESS;
}

// Forgets h once the program released it and nothing maps it: the driver's
// handle goes (or the copy, while it is off the GPU). Caller holds the registry.
void forget_if_done(const VmmDriver& d, Registry& R, CUmemGenericAllocationHandle id) {
  ProgramHandle* h = find(R, id);
  if (h == nullptr || h->refs > 0 || !h->maps.empty()) return;
  if (h->mem.handle != 0) {
    d.release(h->mem.handle);
  } else {
    g_swapped.fetch_sub(h->mem.size);
    drop_copy(d, R, h->mem, false);  // a spilled copy's bytes are left in the file until swap-in
  }
  g_movable.fetch_sub(h->counted);
  R.handles.erase(id);
}

// Records one cuMemSetAccess on part of a mapping; earlier settings it
// replaces wholly (same range or inside it, no other location) are dropped.
void record_access(Mapping& m, std::size_t off, std::size_t size, const CUmemAccessDesc* desc,
                   std::size_t count) {
  const auto covered = [&](const Access& e) {
    if (e.off < off || e.off + e.size > off + size) return false;
    return std::all_of(e.descs.begin(), e.descs.end(), [&](const CUmemAccessDesc& x) {
      return std::any_of(desc, desc + count, [&](const CUmemAccessDesc& y) {
        return x.location.type == y.location.type && x.location.id == y.location.id;
      });
    });
  };
  m.access.erase(std::remove_if(m.access.begin(), m.access.end(), covered), m.access.end());
  m.access.push_back({off, size, std::vector<CUmemAccessDesc>(desc, desc + count)});
}

// Maps h's driver handle at m and sets the program's access there. A CUresult.
CUresult map_again(const VmmDriver& d, const ProgramHandle& h, const Mapping& m) {
  if (CUresult r = d.map(m.va, m.size, 0, h.mem.handle, 0); r != CUDA_SUCCESS) return r;
  for (const Access& e : m.access)
    if (CUresult r = d.set_access(m.va + e.off, e.size, e.descs.data(), e.descs.size());
        r != CUDA_SUCCESS) {
      d.unmap(m.va, m.size);
      return r;
    }
  return CUDA_SUCCESS;
}

// Copies the contents back through a mapping of the shim's own, for a handle
// the program keeps but mapped nowhere while it was off the GPU. 0 or -errno.
int copy_in_unmapped(const VmmDriver& d, const ProgramHandle& h,
                     const std::function<int(CUdeviceptr)>& copy_in) {
  CUdeviceptr va = 0;
  if (d.reserve(&va, h.mem.size, 0, 0, 0) != CUDA_SUCCESS) return -ENOMEM;
  int rc = -EIO;
  if (d.map(va, h.mem.size, 0, h.mem.handle, 0) == CUDA_SUCCESS) {
    CUmemAccessDesc rw{};
    rw.location = h.prop.location;
    rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (d.set_access(va, h.mem.size, &rw, 1) == CUDA_SUCCESS) rc = copy_in(va);
    d.unmap(va, h.mem.size);
  }
  d.addr_free(va, h.mem.size);
  return rc;
}

CUresult not_ours() {
  return CUDA_ERROR_INVALID_VALUE;  // what the driver says of a handle it never made
}

}  // namespace

void program_handles_to_move(Registry& R, std::vector<Piece>& out) {
  for (auto& [id, h] : R.handles)
    if (h.mem.handle != 0 && movable_size(h) != 0) out.push_back({source(h)->va, &h.mem, &h});
}

void program_handles_to_restore(Registry& R, std::vector<Piece>& out) {
  for (auto& [id, h] : R.handles)
    if (h.mem.handle == 0) out.push_back({0, &h.mem, &h});
}

void program_handle_out(const VmmDriver& d, ProgramHandle& h) {
  for (const Mapping& m : h.maps) d.unmap(m.va, m.size);
  d.release(h.mem.handle);
  h.mem.handle = 0;
  recount(h);
}

int program_handle_in(const VmmDriver& d, ProgramHandle& h,
                      const std::function<int(CUdeviceptr)>& copy_in) {
  CUresult r = d.create(&h.mem.handle, h.mem.size, &h.prop, 0);
  if (r != CUDA_SUCCESS) {
    h.mem.handle = 0;
    return r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
  }
  std::size_t mapped = 0;
  for (; mapped < h.maps.size(); ++mapped)
    if (r = map_again(d, h, h.maps[mapped]); r != CUDA_SUCCESS) break;
  int rc = r == CUDA_SUCCESS ? 0 : r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
  if (rc == 0) {
    const Mapping* from = source(h);
    rc = from != nullptr ? copy_in(from->va) : copy_in_unmapped(d, h, copy_in);
  }
  if (rc != 0) {
    for (std::size_t i = 0; i < mapped; ++i) d.unmap(h.maps[i].va, h.maps[i].size);
    d.release(h.mem.handle);
    h.mem.handle = 0;
  }
  recount(h);
  return rc;
}

}  // namespace swap_detail

using namespace swap_detail;

bool program_handle_wanted(const CUmemAllocationProp* prop, unsigned long long flags) {
  return prop != nullptr && flags == 0 && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->allocFlags.usage == 0 &&
         swap_enabled();
}

CUresult program_handle_create(CUmemGenericAllocationHandle* out, std::size_t n,
                               const CUmemAllocationProp* prop) {
  if (out == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const VmmDriver& d = vmm_driver();
  ProgramHandle h;
  if (CUresult r = d.create(&h.mem.handle, n, prop, 0); r != CUDA_SUCCESS) return r;
  h.mem.size = n;
  h.mem.dev = prop->location.id;
  driver().ctx_get_current(&h.mem.ctx);
  h.prop = *prop;
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  const CUmemGenericAllocationHandle id = kProgramHandleTag | ++R.handles_made;
  R.handles.emplace(id, std::move(h));
  *out = id;
  return CUDA_SUCCESS;
}

CUresult program_handle_release(CUmemGenericAllocationHandle id) {
  Registry& R = registry();
  {
    std::lock_guard lk(R.mu);
    ProgramHandle* h = find(R, id);
    if (h == nullptr || h->refs == 0) return not_ours();
    --h->refs;
    forget_if_done(vmm_driver(), R, id);
  }
  publish();
  return CUDA_SUCCESS;
}

CUresult program_handle_map(CUdeviceptr p, std::size_t n, std::size_t off,
                            CUmemGenericAllocationHandle id, unsigned long long flags) {
  const VmmDriver& d = vmm_driver();
  Registry& R = registry();
  {
    std::lock_guard lk(R.mu);
    ProgramHandle* h = find(R, id);
    if (h == nullptr || h->refs == 0) return not_ours();
    if (off != 0 || flags != 0 || n == 0 || n > h->mem.size) return CUDA_ERROR_INVALID_VALUE;
    if (h->mem.handle != 0) {
      if (CUresult r = d.map(p, n, off, h->mem.handle, flags); r != CUDA_SUCCESS) return r;
    } else if (Mapping* other = nullptr; mapped_at(R, p, &other) != nullptr) {
      return CUDA_ERROR_INVALID_VALUE;  // off the GPU: checked here, mapped at the swap-in
    }
    if (h->mem.ctx == nullptr) driver().ctx_get_current(&h->mem.ctx);
    h->maps.push_back({p, n, {}});
    R.handle_at[p] = id;
    recount(*h);
  }
  publish();
  return CUDA_SUCCESS;
}

bool program_handles_unmap(CUdeviceptr p, std::size_t n, CUresult* r) {
  if (!swap_enabled()) return false;
  const VmmDriver& d = vmm_driver();
  Registry& R = registry();
  {
    std::lock_guard lk(R.mu);
    const std::vector<Overlap> hit = overlapping(R, p, n);
    if (hit.empty()) return false;
    for (const Overlap& o : hit)
      if (o.m->va < p || o.m->va + o.m->size > p + n) {
        *r = CUDA_ERROR_INVALID_VALUE;  // a mapping is unmapped whole, as the driver wants
        return true;
      }
    if (*r =
            on_driver(hit, p, n, [&](CUdeviceptr at, std::size_t len) { return d.unmap(at, len); });
        *r != CUDA_SUCCESS)
      return true;
    std::vector<std::pair<CUmemGenericAllocationHandle, CUdeviceptr>> gone;
    for (const Overlap& o : hit) gone.emplace_back(o.id, o.m->va);
    for (const auto& [id, va] : gone) {
      R.handle_at.erase(va);
      ProgramHandle& h = R.handles.at(id);
      h.maps.erase(std::remove_if(h.maps.begin(), h.maps.end(),
                                  [va = va](const Mapping& m) { return m.va == va; }),
                   h.maps.end());
      recount(h);
    }
    for (const auto& [id, va] : gone) forget_if_done(d, R, id);
    *r = CUDA_SUCCESS;
  }
  publish();
  return true;
}

bool program_handles_set_access(CUdeviceptr p, std::size_t n, const CUmemAccessDesc* desc,
                                std::size_t count, CUresult* r) {
  if (!swap_enabled() || desc == nullptr || count == 0) return false;
  const VmmDriver& d = vmm_driver();
  Registry& R = registry();
  {
    std::lock_guard lk(R.mu);
    const std::vector<Overlap> hit = overlapping(R, p, n);
    if (hit.empty()) return false;
    if (*r = on_driver(
            hit, p, n,
            [&](CUdeviceptr at, std::size_t len) { return d.set_access(at, len, desc, count); });
        *r != CUDA_SUCCESS)
      return true;
    // Recorded for every mapping: those off the GPU get it at the swap-in.
    for (const Overlap& o : hit) {
      const CUdeviceptr lo = std::max(p, o.m->va), hi = std::min(p + n, o.m->va + o.m->size);
      record_access(*o.m, lo - o.m->va, hi - lo, desc, count);
      recount(*o.h);
    }
    *r = CUDA_SUCCESS;
  }
  publish();
  return true;
}

bool program_handle_retain(CUmemGenericAllocationHandle* out, void* addr) {
  if (!swap_enabled() || out == nullptr) return false;
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  Mapping* m = nullptr;
  CUmemGenericAllocationHandle id = 0;
  ProgramHandle* h = mapped_at(R, reinterpret_cast<CUdeviceptr>(addr), &m, &id);
  if (h == nullptr) return false;
  ++h->refs;
  *out = id;
  return true;
}

bool program_handle_access(unsigned long long* flags, const CUmemLocation* where, CUdeviceptr p) {
  if (!swap_enabled() || flags == nullptr || where == nullptr) return false;
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  Mapping* m = nullptr;
  const ProgramHandle* h = mapped_at(R, p, &m);
  if (h == nullptr || h->mem.handle != 0) return false;  // on the GPU: the driver knows
  // Off the GPU: what the program set last on that byte for that location.
  unsigned long long got = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  for (const Access& e : m->access)
    if (p - m->va >= e.off && p - m->va < e.off + e.size)
      for (const CUmemAccessDesc& x : e.descs)
        if (x.location.type == where->type && x.location.id == where->id) got = x.flags;
  *flags = got;
  return true;
}

CUresult program_handle_properties(CUmemAllocationProp* prop, CUmemGenericAllocationHandle id) {
  if (prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Registry& R = registry();
  std::lock_guard lk(R.mu);
  const ProgramHandle* h = find(R, id);
  if (h == nullptr || h->refs == 0) return not_ours();
  *prop = h->prop;
  return CUDA_SUCCESS;
}

CUresult program_handle_pin(CUmemGenericAllocationHandle id, CUmemGenericAllocationHandle* real) {
  Registry& R = registry();
  {
    std::lock_guard lk(R.mu);
    ProgramHandle* h = find(R, id);
    if (h == nullptr || h->refs == 0) return not_ours();
    if (h->mem.handle == 0) {
      post_note(
          "a handle of the program's was shared (exported or bound) while its session "
          "was swapped out: refused, share it within an iteration");
      return CUDA_ERROR_NOT_PERMITTED;
    }
    h->pinned = true;
    recount(*h);
    *real = h->mem.handle;
  }
  publish();
  return CUDA_SUCCESS;
}

void program_handles_pin_range(CUdeviceptr p, std::size_t n) {
  if (!swap_enabled()) return;
  Registry& R = registry();
  {
    std::lock_guard lk(R.mu);
    for (const Overlap& o : overlapping(R, p, n)) {
      o.h->pinned = true;
      recount(*o.h);
    }
  }
  publish();
}

}  // namespace salus::shim
