// salus_shm.hpp: shared-memory transfers for the salus C++ client (salus.hpp).
// A SharedSegment is a POSIX shared-memory object, /dev/shm/NAME, made with
// Boost.Interprocess (header-only; glibc 2.34+ needs no -lrt), mapped read-write,
// private to this uid (0600) and removed when the object goes. salusd accepts a
// segment only from the uid that owns it.
//
//   salus::SharedSegment seg(n);
//   std::memcpy(seg.data(), weights, n);
//   s.upload_shm("w", seg.name(), n);                // or salus::upload(s, "w", weights, n)
//   salus::download(s, "w", out, n);                 // through a temporary segment
#pragma once

#include <unistd.h>

#include <atomic>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/permissions.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>

#include "salus.hpp"

namespace salus {

class SharedSegment {
 public:
  // A new segment of `bytes` bytes (zero-filled). `name` must be one path
  // component of [A-Za-z0-9_.-]; the default is unique to this process.
  // Throws std::system_error (EEXIST, ENOSPC, ...) when it cannot be made.
  explicit SharedSegment(std::size_t bytes, std::string name = {})
      : name_(name.empty() ? unique_name() : std::move(name)), size_(bytes) {
    namespace bip = boost::interprocess;
    try {
      bip::permissions mode;
      mode.set_permissions(0600);
      shm_ = bip::shared_memory_object(bip::create_only, name_.c_str(), bip::read_write, mode);
      created_ = true;
      // A mapping cannot be empty: a 0-byte segment maps one byte.
      shm_.truncate(static_cast<bip::offset_t>(bytes ? bytes : 1));
      region_ = bip::mapped_region(shm_, bip::read_write);
    } catch (const bip::interprocess_exception& e) {
      if (created_) bip::shared_memory_object::remove(name_.c_str());
      const int err = e.get_native_error() ? e.get_native_error() : EIO;
      throw std::system_error(err, std::generic_category(),
                              "salus: shared-memory segment " + name_ + ": " + e.what());
    }
  }
  ~SharedSegment() {
    region_ = boost::interprocess::mapped_region();
    if (created_) boost::interprocess::shared_memory_object::remove(name_.c_str());
  }
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  void* data() { return region_.get_address(); }
  const void* data() const { return region_.get_address(); }
  std::size_t size() const { return size_; }
  // The name salusd takes after shm: (no leading slash).
  const std::string& name() const { return name_; }

 private:
  static std::string unique_name() {
    static std::atomic<unsigned> counter{0};
    const auto t = std::chrono::steady_clock::now().time_since_epoch().count();
    return "salus-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
           std::to_string(static_cast<unsigned long long>(t) % 1000000007ULL);
  }

  std::string name_;
  std::size_t size_;
  bool created_ = false;
  boost::interprocess::shared_memory_object shm_;
  boost::interprocess::mapped_region region_;
};

// Copies `bytes` from `data` into buffer `buf` at `offset` through a temporary
// segment, and returns once salusd has done it.
inline void upload(Session& s, const std::string& buf, const void* data, std::size_t bytes,
                   std::uint64_t offset = 0) {
  SharedSegment seg(bytes);
  if (bytes) std::memcpy(seg.data(), data, bytes);
  s.upload_shm(buf, seg.name(), bytes, offset);
}

// Copies `bytes` of buffer `buf` from `offset` into `data` through a temporary
// segment.
inline void download(Session& s, const std::string& buf, void* data, std::size_t bytes,
                     std::uint64_t offset = 0) {
  SharedSegment seg(bytes);
  s.download_shm(buf, seg.name(), bytes, offset);
  if (bytes) std::memcpy(data, seg.data(), bytes);
}

}  // namespace salus
