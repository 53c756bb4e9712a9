#include "vgpu/sim/host_mapping.hpp"

#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include <fmt/format.h>

namespace salus::vgpu::sim {

HostMapping::HostMapping(std::size_t size) : size_(size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw std::system_error(err, std::generic_category(),
                            fmt::format("cannot map {} bytes of simulated GPU memory", size));
  }
  base_ = static_cast<std::byte*>(p);
}

HostMapping::~HostMapping() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

int HostMapping::discard(std::uint64_t offset, std::uint64_t length) {
  if (!contains(offset, length)) return EFAULT;
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  // The mapping itself is page-aligned, so page boundaries of offsets are page
  // boundaries of addresses.
  const std::uint64_t begin = (offset + page - 1) / page * page;
  const std::uint64_t end = (offset + length) / page * page;
  // Freed memory must read as zero for its next owner, who may be another uid:
  // whole pages are dropped, the partial pages at either end are cleared.
  if (end <= begin) {
    std::memset(base_ + offset, 0, length);
    return 0;
  }
  std::memset(base_ + offset, 0, begin - offset);
  std::memset(base_ + end, 0, offset + length - end);
  if (::madvise(base_ + begin, end - begin, MADV_DONTNEED) != 0) return errno;
  return 0;
}

}  // namespace salus::vgpu::sim
