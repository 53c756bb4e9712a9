// A memory mapping that unmaps itself: the executor's staging area and staging
// blocks are shared-file mappings whose lifetime follows their owner, on every
// path (a constructor that throws half-way, a block freed while in a map).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <utility>

namespace salus::vgpu {

class Mapping {
 public:
  Mapping() = default;
  // Maps `size` bytes of `fd` shared, readable and writable. An empty Mapping
  // (check with bool) means mmap failed and errno says why.
  static Mapping shared(int fd, std::size_t size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? Mapping{} : Mapping(static_cast<char*>(p), size);
  }
  Mapping(Mapping&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  char* data() const { return data_; }
  std::size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }
  void reset() {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }

 private:
  Mapping(char* data, std::size_t size) : data_(data), size_(size) {}

  char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace salus::vgpu
