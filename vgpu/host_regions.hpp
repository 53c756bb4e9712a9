// Host regions: the pages of a file (a client's shared-memory segment, a staging
// block shared with an executor process) mapped into this process so a device
// copies to and from them directly, with no bounce through staging.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "arena/size_units.hpp"

namespace salus::vgpu {

using arena::Bytes;
using RegionId = std::uint32_t;  // 0 is never a region

// The mappings of one device, by id. Thread-safe.
//
// A client may shrink its segment while salusd copies from it; touching the
// vanished pages would raise SIGBUS. Every mapping made here is therefore
// guarded: a process-wide SIGBUS handler puts zero-filled anonymous memory in
// place of a guarded mapping that faults, so the copy finishes (with zeros)
// instead of killing the daemon. Whoever owns the transfer notices the shrink
// afterwards (fstat) and fails it; a fault outside every guarded mapping keeps
// its default effect.
class HostRegions {
 public:
  struct Region {
    char* base = nullptr;
    Bytes size = 0;
    bool writable = false;
    // For the backend: whether the pages are registered with the driver, and
    // under which context generation.
    bool pinned = false;
    std::uint64_t pin_generation = 0;
  };

  HostRegions() = default;
  ~HostRegions();  // unmaps whatever is left
  HostRegions(const HostRegions&) = delete;
  HostRegions& operator=(const HostRegions&) = delete;

  // Maps `size` bytes of `fd` (shared), readable and, if `writable`,
  // writable; the fd may be closed afterwards. Returns 0 or an errno with the
  // reason in `why`.
  int map(int fd, Bytes size, bool writable, RegionId& out, std::string& why);
  // The region, if it exists.
  std::optional<Region> find(RegionId id) const;
  // [offset, offset+length) of the region as a pointer; throws
  // std::invalid_argument for an unknown region, a range past its end, or a
  // write into a read-only one.
  char* at(RegionId id, Bytes offset, Bytes length, bool for_write) const;
  // Records the backend's pinning of a region.
  void set_pinned(RegionId id, bool pinned, std::uint64_t generation);
  // Takes a region out of the table; the caller unpins it if need be and then
  // calls unmap(). nullopt for an unknown id.
  std::optional<Region> remove(RegionId id);
  static void unmap(const Region& r);

 private:
  mutable std::mutex mu_;
  std::map<RegionId, Region> regions_;
  RegionId next_ = 1;
};

// How many guarded mappings have been replaced after a SIGBUS, process-wide
// (for logs and tests).
std::uint64_t host_region_faults();

}  // namespace salus::vgpu
