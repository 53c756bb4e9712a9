// The sim backend's "device memory": one lazily backed anonymous host mapping, so a
// default 2 x 16 GiB configuration costs RSS only for the pages sessions touch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace salus::vgpu::sim {

class HostMapping {
 public:
  // Maps `size` bytes readable and writable, with no swap reservation.
  // Throws std::system_error if the kernel refuses (including size 0).
  explicit HostMapping(std::size_t size);
  ~HostMapping();
  HostMapping(const HostMapping&) = delete;
  HostMapping& operator=(const HostMapping&) = delete;

  std::byte* data() const { return base_; }
  std::size_t size() const { return size_; }
  // True if [offset, offset+length) lies inside the mapping (overflow-safe).
  bool contains(std::uint64_t offset, std::uint64_t length) const {
    return offset <= size_ && length <= size_ - offset;
  }

  // Returns the whole pages inside [offset, offset+length) to the kernel; they read
  // back as zeros. Partial pages at either end are left alone because other
  // buffers may share them. Returns 0 or an errno.
  int discard(std::uint64_t offset, std::uint64_t length);

 private:
  std::byte* base_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace salus::vgpu::sim
