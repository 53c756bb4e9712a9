// Readings about each GPU that come from outside salusd's own bookkeeping (NVML
// on the cuda backend), refreshed in the background so that views never wait.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace salus::vgpu {

// One sample of a GPU's counters. Each reading is absent when the device, the
// driver or the backend cannot give it.
struct GpuReadings {
  std::optional<double> sm_util;        // 0..1: time a kernel ran, last sample period
  std::optional<double> mem_util;       // 0..1: time device memory was read or written
  std::optional<double> power_w;        // board power draw
  std::optional<double> energy_j;       // consumed since the driver was loaded
  std::optional<double> temperature_c;  // GPU die
  // Compute processes on the GPU and the device memory each uses (pids as the
  // driver sees them: the host's pid namespace). A process whose figure the
  // driver cannot give has no bytes.
  struct Process {
    std::int64_t pid = 0;
    std::optional<std::uint64_t> bytes;
  };
  std::optional<std::vector<Process>> processes;
};

struct GpuTelemetrySnapshot {
  bool available = false;
  std::string why_not;  // when !available: "libnvidia-ml.so.1 not found", ...
  GpuReadings readings;
  std::string error;  // when available: why the last sample lacked a reading, or ""
};

// CARMA's risk scores (sched::risk_score) of the readings over the sampler's window, for
// the placement's risk filter. Absent until a reading has been sampled.
struct GpuRisk {
  std::optional<double> sm;   // of sm_util
  std::optional<double> mem;  // of mem_util
};

// The broker asks for snapshots when it renders gpus/N/info and metrics; an
// implementation must answer from a cache, without calling into the driver,
// because a FUSE thread is waiting. Thread-safe.
class GpuTelemetry {
 public:
  virtual ~GpuTelemetry() = default;
  // `gpu` is the broker's index (DeviceInfo::index).
  virtual GpuTelemetrySnapshot snapshot(std::size_t gpu) const = 0;
  // Answered from the cache too, without allocating: placement asks under the broker's lock.
  virtual GpuRisk risk(std::size_t /*gpu*/) const { return {}; }
};

}  // namespace salus::vgpu
