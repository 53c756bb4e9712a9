// The one interface through which salusd drives a GPU, whatever the backend:
// an arena of device memory addressed by offset, streams (one per lane), async
// ops on a stream, and completion notification.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "arena/size_units.hpp"

namespace salus::vgpu {

using arena::Bytes;
using DevOffset = Bytes;  // offset within the device's arena
using StreamId = std::uint32_t;

struct DeviceInfo {
  int index = 0;
  std::string name;            // "Salus simulated GPU" / "NVIDIA H100 80GB HBM3"
  std::string uuid;            // "GPU-…" on CUDA; a stable fake for sim
  std::string backend;         // "sim" or "cuda"
  Bytes total_memory = 0;      // physical memory of the device
  Bytes arena_size = 0;        // what salusd manages (<= total_memory)
  std::uint32_t sm_count = 0;
  std::string driver_version;  // "sim" for the sim backend
};

// Receives completions. Called on a backend-owned thread; must not block for long.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  // All ops enqueued on `stream` before the matching notify() have finished.
  // status is 0 or an errno (e.g. EFAULT after a device fault). device_ns is the
  // time the device spent on those ops since the previous notify on the stream.
  virtual void on_complete(StreamId stream, std::uint64_t token, int status,
                           std::int64_t device_ns) = 0;
};

// Every offset/length passed here has already been bounds-checked by the caller
// against the arena and the buffer; a backend may assert but need not re-check.
class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceInfo& info() const = 0;
  virtual void set_sink(CompletionSink* sink) = 0;  // before the first op

  virtual StreamId create_stream() = 0;
  // Waits for the stream's queued ops to finish, then destroys it.
  virtual void destroy_stream(StreamId stream) = 0;

  // Sets `length` bytes at `dst` to a repeating element of `width` (1 or 4) bytes.
  virtual void fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
                    unsigned width) = 0;
  virtual void copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) = 0;
  // A kernel that keeps `util` of the GPU busy for `usec` microseconds when alone.
  virtual void spin(StreamId stream, std::uint64_t usec, double util) = 0;
  // C[MxN] = A[MxK] * B[KxN], fp32, row-major.
  virtual void gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k,
                    DevOffset a, DevOffset b, DevOffset c) = 0;
  // Host memory must stay valid until the next notify() on the stream completes.
  virtual void copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) = 0;
  virtual void copy_from_host(StreamId stream, DevOffset dst, const void* host,
                              Bytes length) = 0;
  // Asks for sink->on_complete(stream, token, ...) once every op enqueued so far
  // on the stream has finished.
  virtual void notify(StreamId stream, std::uint64_t token) = 0;

  // Nothing lives in [offset, offset+length) any more. Afterwards the range reads
  // as zero, so memory never carries data from one owner to the next.
  virtual void discard(DevOffset offset, Bytes length) = 0;

  // Fraction of wall time since the device started during which at least one op
  // was executing (for utilization metrics).
  virtual std::int64_t busy_ns() const = 0;
};

}  // namespace salus::vgpu
