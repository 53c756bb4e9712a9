// The simulated GPU: device memory is host memory, streams are threads, built-in ops
// run on the CPU, and spin kernels take time under the shared contention model, so
// salusd and its scheduling policies behave meaningfully on machines without a GPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "vgpu/device.hpp"
#include "vgpu/sim/busy_meter.hpp"
#include "vgpu/sim/host_mapping.hpp"
#include "vgpu/sim/realtime_contention.hpp"
#include "vgpu/sim/sim_stream.hpp"

namespace salus::vgpu {

class SimDevice final : public Device {
 public:
  // Like a P100, the GPU of the Salus paper whose 2 x 16 GiB salusd mimics by default.
  static constexpr std::uint32_t kSmCount = 56;

  // Reserves `memory_bytes` of address space (no RSS until touched). Throws
  // std::system_error if the mapping fails, e.g. for 0 bytes or under strict
  // overcommit.
  SimDevice(int index, Bytes memory_bytes, std::string name = "Salus simulated GPU");
  // Finishes every stream's queued ops, then releases the memory.
  ~SimDevice() override;
  SimDevice(const SimDevice&) = delete;
  SimDevice& operator=(const SimDevice&) = delete;

  const DeviceInfo& info() const override { return info_; }
  void set_sink(CompletionSink* sink) override;

  // Ids are the smallest free ones, so they are reused after destroy_stream returns.
  StreamId create_stream() override;
  // Must not be called from a completion callback of the same stream (it would
  // join its own thread): that throws std::logic_error.
  void destroy_stream(StreamId stream) override;

  // The op calls below throw std::invalid_argument for a stream id that does not
  // exist. Ranges outside device memory complete with EFAULT on the next notify.
  void fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
            unsigned width) override;
  void copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) override;
  void spin(StreamId stream, std::uint64_t usec, double util) override;
  void gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k, DevOffset a,
            DevOffset b, DevOffset c) override;
  void copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) override;
  void copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) override;
  void notify(StreamId stream, std::uint64_t token) override;

  // Takes effect immediately, not in stream order: the caller has already made
  // sure no queued op still uses the range.
  void discard(DevOffset offset, Bytes length) override;

  // Wall time during which at least one data or kernel op was executing on any
  // stream (notify markers do not count).
  std::int64_t busy_ns() const override { return busy_.busy_ns(); }

 private:
  // A slot stays reserved while its stream drains, so a concurrent create_stream
  // cannot hand out an id whose old completions are still arriving.
  struct Slot {
    std::unique_ptr<sim::SimStream> stream;
    bool retiring = false;
  };

  void enqueue(StreamId stream, const sim::SimOp& op);

  DeviceInfo info_;
  sim::HostMapping memory_;
  sim::RealTimeContention contention_;
  sim::BusyMeter busy_;
  std::atomic<CompletionSink*> sink_{nullptr};

  mutable std::shared_mutex streams_mu_;
  std::vector<Slot> slots_;  // indexed by StreamId
};

}  // namespace salus::vgpu
