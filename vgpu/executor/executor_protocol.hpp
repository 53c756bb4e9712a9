// The messages between salusd and a GPU executor process: fixed-layout records,
// several to a datagram, over a SOCK_SEQPACKET socketpair (one send, one message).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "vgpu/device.hpp"

namespace salus::vgpu::executor {

// Both ends are the same binary (salusd re-executes itself), so the version
// only guards against a salusd replaced on disk while it runs.
constexpr std::uint32_t kProtocolVersion = 3;
// Largest datagram either side sends. Requests are batched up to this size; a
// launch's arguments (64 at most, see the command parser) and a get_function
// reply (up to 4096 parameter sizes) fit with room to spare.
constexpr std::size_t kMaxDatagram = 64 * 1024;
constexpr std::size_t kRecordAlign = 8;

enum class Msg : std::uint16_t {
  // salusd -> executor. Stream ids, module and function handles are salusd's:
  // the executor maps them to its device's, so they survive a restart.
  create_stream = 1,
  destroy_stream,  // replied to once the stream has drained
  fill,
  copy,
  spin,
  gemm,
  copy_to_host,    // into a staging slot; salusd copies out at the notify
  copy_from_host,  // from a staging slot salusd filled
  notify,
  discard,
  load_module,  // the image comes as a memfd (SCM_RIGHTS), alone in its datagram
  unload_module,
  get_function,
  launch,
  shutdown,    // drain, then exit 0
  map_region,  // a file's pages for direct copies: the fd comes alone in its datagram
  unmap_region,
  copy_from_region,
  copy_to_region,
  // Shared-lane memory of attached sessions: made and cleared by the executor's
  // device; salusd takes the fd named in the reply with pidfd_getfd.
  lane_make,   // replied to: status, and the executor's fd number as the one param
  lane_clear,  // replied to once the zeroes are on the device
  lane_drop,
  // The arena backed on demand: the held ranges follow; replied to once they are
  // backed (the one param: MiB backed now), or why not.
  set_backing,
  // executor -> salusd
  hello = 64,  // first message: the device, or why it could not be opened
  reply,       // to destroy_stream, load_module, get_function
  complete,    // a notify's completion
  busy,        // the device's busy_ns, sent periodically
  fault,       // a sticky fault: the executor sends its completions, then exits
};

struct RecordHeader {
  Msg type;
  std::uint16_t reserved = 0;
  std::uint32_t size;  // header included, a multiple of kRecordAlign
};

// ---- requests

struct CreateStreamMsg {
  StreamId stream;
};
struct DestroyStreamMsg {
  std::uint64_t request;
  StreamId stream;
};
struct FillMsg {
  StreamId stream;
  std::uint32_t pattern;
  std::uint32_t width;
  DevOffset dst;
  Bytes length;
};
struct CopyMsg {
  StreamId stream;
  DevOffset dst;
  DevOffset src;
  Bytes length;
};
struct SpinMsg {
  StreamId stream;
  std::uint64_t usec;
  double util;
};
struct GemmMsg {
  StreamId stream;
  std::uint32_t m, n, k;
  DevOffset a, b, c;
};
struct ToHostMsg {
  StreamId stream;
  std::uint64_t slot;  // offset into the staging area
  DevOffset src;
  Bytes length;
};
struct FromHostMsg {
  StreamId stream;
  DevOffset dst;
  std::uint64_t slot;
  Bytes length;
};
struct NotifyMsg {
  StreamId stream;
  std::uint64_t ticket;  // echoed in the completion
};
struct DiscardMsg {
  DevOffset offset;
  Bytes length;
};
struct LoadModuleMsg {
  std::uint64_t request;
  ModuleHandle module;
  std::uint64_t size;  // bytes of the memfd that carries the image
};
struct UnloadModuleMsg {
  ModuleHandle module;
};
// Followed by the function's name (name_length bytes, no NUL).
struct GetFunctionMsg {
  std::uint64_t request;
  ModuleHandle module;
  FunctionHandle function;
  std::uint32_t name_length;
};
// Followed by arg_count u32 sizes, then their arg_bytes bytes back to back.
struct LaunchMsg {
  StreamId stream;
  FunctionHandle function;
  LaunchDims dims;
  std::uint32_t arg_count;
  std::uint32_t arg_bytes;
};

// Replied to. Region ids are salusd's, like stream ids.
struct MapRegionMsg {
  std::uint64_t request;
  RegionId region;
  std::uint32_t writable;
  Bytes size;
};
struct UnmapRegionMsg {
  RegionId region;
};
struct LaneMakeMsg {
  std::uint64_t request;
  Bytes size;
};
struct LaneClearMsg {
  std::uint64_t request;
  std::int32_t fd;  // the executor's, from lane_make's reply
  std::uint32_t reserved = 0;
  Bytes size;
};
struct SetBackingMsg {
  std::uint64_t request;
  std::uint32_t count;  // arena::ByteRange records follow
  std::uint32_t reserved = 0;
};
// The most ranges one set_backing carries (its datagram stays well under
// kMaxDatagram); salusd merges the closest ranges of a longer list.
constexpr std::size_t kMaxBackingRanges = 3000;
struct LaneDropMsg {
  std::int32_t fd;
  std::uint32_t reserved = 0;
};
struct RegionCopyMsg {  // copy_from_region and copy_to_region
  StreamId stream;
  RegionId region;
  Bytes offset;  // within the region
  DevOffset device;
  Bytes length;
};

// ---- executor -> salusd

struct HelloMsg {
  std::uint32_t version;
  std::int32_t status;  // 0, or an errno: the device did not open (why follows)
  std::int64_t pid;
  std::uint64_t arena_base;  // device_address(0)
  Bytes total_memory;
  Bytes arena_size;
  std::uint32_t sm_count;
  std::uint32_t backs_on_demand;  // 1: set_backing decides where memory lies
  double spin_cycles_per_usec;
  char name[128];
  char uuid[64];
  char backend[16];
  char driver_version[32];
  char why[512];  // NUL-terminated
};
// Followed by why_length bytes of text, then param_count u32 parameter sizes.
struct ReplyMsg {
  std::uint64_t request;
  std::int32_t status;
  std::uint32_t why_length;
  std::uint32_t param_count;
  std::uint32_t reserved = 0;
};
struct CompleteMsg {
  std::uint64_t ticket;
  std::int32_t status;
  std::int64_t device_ns;
  std::int64_t busy_ns;
};
struct BusyMsg {
  std::int64_t busy_ns;
};
struct FaultMsg {
  std::int32_t kernel_fault;  // a kernel's doing (bad address, trap), not the device failing
  char cause[508];            // NUL-terminated, e.g. "CUDA_ERROR_ILLEGAL_ADDRESS (...)"
};
struct ShutdownMsg {
  std::uint64_t reserved = 0;
};

// Copies a string into a fixed, NUL-terminated field, truncating.
template <std::size_t N>
void put_text(char (&field)[N], const std::string& text) {
  const std::size_t n = text.size() < N - 1 ? text.size() : N - 1;
  std::memcpy(field, text.data(), n);
  std::memset(field + n, 0, N - n);
}
template <std::size_t N>
std::string get_text(const char (&field)[N]) {
  std::size_t n = 0;
  while (n < N && field[n] != '\0') ++n;
  return std::string(field, n);
}

constexpr std::size_t record_size(std::size_t body) {
  return (sizeof(RecordHeader) + body + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}

// Encodes a datagram of one small record into `out` (at least record_size(sizeof(T))
// bytes); returns its size. For the hot single-record sends (completions).
template <class T>
std::size_t encode_one(char* out, Msg type, const T& fixed) {
  static_assert(std::is_trivially_copyable_v<T>);
  const std::size_t size = record_size(sizeof(T));
  RecordHeader h{type, 0, static_cast<std::uint32_t>(size)};
  std::memcpy(out, &h, sizeof h);
  std::memcpy(out + sizeof h, &fixed, sizeof(T));
  std::memset(out + sizeof h + sizeof(T), 0, size - sizeof h - sizeof(T));
  return size;
}

// Appends records to a datagram being built. The storage is reused from one
// datagram to the next, so building one allocates nothing once warm.
class RecordWriter {
 public:
  RecordWriter() { buf_.reserve(kMaxDatagram); }
  // Whether a record with `body` bytes fits into the current datagram.
  bool fits(std::size_t body) const { return buf_.size() + record_size(body) <= kMaxDatagram; }
  // Appends a record: `fixed`, then the `tail` pieces. The caller checked fits().
  template <class T>
  void put(Msg type, const T& fixed,
           std::initializer_list<std::pair<const void*, std::size_t>> tail = {}) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::size_t body = sizeof(T);
    for (const auto& [p, n] : tail) body += n;
    const std::size_t at = buf_.size();
    const std::size_t size = record_size(body);
    buf_.resize(at + size);
    RecordHeader h{type, 0, static_cast<std::uint32_t>(size)};
    std::memcpy(buf_.data() + at, &h, sizeof h);
    std::size_t off = at + sizeof h;
    std::memcpy(buf_.data() + off, &fixed, sizeof(T));
    off += sizeof(T);
    for (const auto& [p, n] : tail) {
      if (n != 0) std::memcpy(buf_.data() + off, p, n);
      off += n;
    }
    std::memset(buf_.data() + off, 0, at + size - off);  // padding: no stray heap bytes
  }
  bool empty() const { return buf_.empty(); }
  const char* data() const { return buf_.data(); }
  std::size_t size() const { return buf_.size(); }
  void clear() { buf_.clear(); }

 private:
  std::vector<char> buf_;
};

// Walks the records of a received datagram. A malformed record (a size that is
// not aligned or runs past the end) stops the walk and sets error().
class RecordReader {
 public:
  RecordReader(const char* data, std::size_t size) : p_(data), end_(data + size) {}
  // The next record's type and body; false at the end or on a malformed record.
  bool next(Msg& type, const char*& body, std::size_t& body_size) {
    if (p_ == end_) return false;
    RecordHeader h;
    if (static_cast<std::size_t>(end_ - p_) < sizeof h) return bad();
    std::memcpy(&h, p_, sizeof h);
    if (h.size < sizeof h || h.size % kRecordAlign != 0 ||
        h.size > static_cast<std::size_t>(end_ - p_))
      return bad();
    type = h.type;
    body = p_ + sizeof h;
    body_size = h.size - sizeof h;
    p_ += h.size;
    return true;
  }
  bool error() const { return error_; }

 private:
  bool bad() {
    error_ = true;
    return false;
  }
  const char* p_;
  const char* end_;
  bool error_ = false;
};

// Reads a fixed-layout message from the front of a record body; false if the
// body is too short.
template <class T>
bool read_fixed(const char* body, std::size_t size, T& out) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (size < sizeof(T)) return false;
  std::memcpy(&out, body, sizeof(T));
  return true;
}

}  // namespace salus::vgpu::executor
