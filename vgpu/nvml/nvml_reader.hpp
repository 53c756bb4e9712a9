// Per-GPU utilization, power, energy and temperature from NVML. libnvidia-ml.so.1
// is loaded at run time, so salusd builds and runs where NVIDIA's software is absent.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "vgpu/gpu_telemetry.hpp"
#include "vgpu/nvml/nvml_abi.hpp"

namespace salus::vgpu::nvml {

class NvmlReader {
 public:
  static constexpr const char* kLibrary = "libnvidia-ml.so.1";

  // Loads `library`, initializes NVML and looks up each GPU by its UUID, the
  // "GPU-..." string CUDA reports (cuDeviceGetUuid), because CUDA and NVML may
  // number the same GPUs differently (CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES).
  // Never throws for a missing library or driver: the GPUs concerned are then
  // unavailable, each with a one-line reason.
  explicit NvmlReader(std::vector<std::string> uuids, const std::string& library = kLibrary);
  ~NvmlReader();
  NvmlReader(const NvmlReader&) = delete;
  NvmlReader& operator=(const NvmlReader&) = delete;

  std::size_t size() const { return gpus_.size(); }
  bool available(std::size_t gpu) const { return gpu < gpus_.size() && gpus_[gpu].handle; }
  // Why `gpu` has no readings ("" when it has).
  std::string why_not(std::size_t gpu) const;

  // Asks NVML for every reading of `gpu`. Each call goes to the driver and can
  // take a millisecond or more, so callers keep it off FUSE threads and out of
  // the broker's lock. A reading the GPU does not support (NOT_SUPPORTED, or an
  // entry point the library lacks) is absent and never asked for again. Any
  // other failure leaves that reading absent this time and is described in
  // `error` ("" when every call succeeded or was unsupported).
  GpuReadings read(std::size_t gpu, std::string& error);

 private:
  struct Entry {
    abi::Device handle = nullptr;
    std::string why_not;
    // Learned from NOT_SUPPORTED: readings this GPU will never give.
    bool no_util = false;
    bool no_power = false;
    bool no_energy = false;
    bool no_temperature = false;
    bool no_processes = false;
  };
  // nvmlErrorString's text for `r`, or its number when the library has none.
  std::string describe(abi::Return r) const;

  bool initialized_ = false;
  abi::Shutdown shutdown_ = nullptr;
  abi::ErrorString error_string_ = nullptr;
  abi::DeviceGetUtilizationRates get_utilization_ = nullptr;
  abi::DeviceGetPowerUsage get_power_ = nullptr;
  abi::DeviceGetTotalEnergyConsumption get_energy_ = nullptr;
  abi::DeviceGetTemperature get_temperature_ = nullptr;
  abi::DeviceGetComputeRunningProcesses get_processes_ = nullptr;
  std::vector<Entry> gpus_;
};

}  // namespace salus::vgpu::nvml
