// The few NVML declarations salusd needs, written out here so that it builds
// where nvml.h is absent: libnvidia-ml.so.1 is dlopen'ed and these must match
// the library's public C ABI exactly (nvml.h, NVML API reference).
#pragma once

namespace salus::vgpu::nvml::abi {

// nvmlReturn_t is a C enum: passed and returned as an int.
using Return = int;
inline constexpr Return kSuccess = 0;                 // NVML_SUCCESS
inline constexpr Return kErrorNotSupported = 3;       // NVML_ERROR_NOT_SUPPORTED
inline constexpr Return kErrorInsufficientSize = 7;   // NVML_ERROR_INSUFFICIENT_SIZE
inline constexpr Return kErrorFunctionNotFound = 13;  // NVML_ERROR_FUNCTION_NOT_FOUND

// nvmlDevice_t: an opaque pointer (typedef struct nvmlDevice_st* nvmlDevice_t).
struct DeviceSt;
using Device = DeviceSt*;

// nvmlUtilization_t: percentages over the driver's last sample period (1/6 s
// to 1 s depending on the product).
struct Utilization {
  unsigned int gpu;     // a kernel was executing
  unsigned int memory;  // device memory was being read or written
};

// nvmlProcessInfo_t (the _v3 entry points' layout): one compute process on a
// GPU and the device memory it uses (kValueNotAvailable when the driver cannot
// tell, e.g. Windows WDDM or without permission).
struct ProcessInfo {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
inline constexpr unsigned long long kValueNotAvailable = ~0ull;

// nvmlTemperatureSensors_t: NVML_TEMPERATURE_GPU, the die sensor.
inline constexpr int kTemperatureGpu = 0;

// The entry points, by the exported symbol they are looked up under.
using InitV2 = Return (*)();                  // nvmlInit_v2
using Shutdown = Return (*)();                // nvmlShutdown
using ErrorString = const char* (*)(Return);  // nvmlErrorString
using DeviceGetHandleByUUID = Return (*)(const char* uuid, Device* device);
using DeviceGetUtilizationRates = Return (*)(Device device, Utilization* utilization);
using DeviceGetPowerUsage = Return (*)(Device device, unsigned int* milliwatts);
using DeviceGetTotalEnergyConsumption = Return (*)(Device device, unsigned long long* millijoules);
using DeviceGetTemperature = Return (*)(Device device, int sensor, unsigned int* celsius);
// nvmlDeviceGetComputeRunningProcesses_v3: *count is the room in `infos` on
// entry and the number of processes on return.
using DeviceGetComputeRunningProcesses = Return (*)(Device device, unsigned int* count,
                                                    ProcessInfo* infos);

}  // namespace salus::vgpu::nvml::abi
