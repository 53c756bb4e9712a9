// Opening the cuda backend: what salusd calls to get one Device per NVIDIA GPU.
// Deliberately free of cuda.h, so callers build without the CUDA include path.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vgpu/device.hpp"

namespace salus::vgpu {

struct CudaOptions {
  // Fraction of the memory free at start-up that each GPU's arena spans. The rest
  // is left for the driver: kernel code, local memory (stacks) of user kernels,
  // per-stream scratch for overlapping copies.
  double memory_fraction = 0.9;
  // Back the arena on demand: reserve its addresses only and map physical memory
  // (VMM, one handle per 2 MiB chunk) where salusd holds lanes and buffers, so
  // the memory attached programs were admitted with is really theirs. Off, or on
  // a driver or GPU without VMM: one cuMemAlloc of the whole arena up front.
  bool back_on_demand = true;
  // Host-to-device and device-to-host copies up to this size go through pinned
  // staging buffers, so enqueueing them never blocks; larger ones copy straight
  // from the caller's (pageable) memory, which blocks the enqueuing thread until
  // the stream reaches the copy.
  Bytes staging_limit = Bytes{64} << 20;
  // Pinned staging memory kept cached for reuse, per GPU.
  Bytes staging_cache = Bytes{256} << 20;
  // Wake the completion thread from the stream (cuLaunchHostFunc) as soon as a
  // notify point is reached. Without it completions are found by polling alone.
  bool host_func_wakeup = true;
  // How often pending notifies are polled (and a device fault noticed) when no
  // wake-up arrives.
  std::chrono::microseconds poll_interval{2000};
  // The arena's exact size in bytes; 0: memory_fraction of the free memory. An
  // executor restarted after a fault asks for the size its predecessor had,
  // because the broker's memory layout depends on it.
  Bytes arena_bytes = 0;
  // After a sticky error (a kernel hit an illegal address, ...), reset and
  // rebuild the primary context in this process. The driver does not always let
  // a process recover from one (CUDA 13 on an H100 keeps the error for the life
  // of the process), so the executor process turns this off: the device then
  // completes everything pending with errors, goes out of service (ENODEV) and
  // leaves it to the process to exit, which frees the context for good.
  bool recover_in_process = true;
  // With recover_in_process off: called on the completion thread when a sticky
  // error is handled, once before the errored completions go to the sink (with
  // `delivered` false; `cause` is e.g. "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal
  // memory access was encountered)"; `kernel_fault` whether a kernel caused it
  // rather than the device failing) and once after (`delivered` true).
  std::function<void(const std::string& cause, bool kernel_fault, bool delivered)> on_sticky_fault;
};

// One Device per visible CUDA GPU (CUDA_VISIBLE_DEVICES applies), in ordinal
// order, with DeviceInfo::index 0, 1, ... Returns an empty vector and a one-line
// reason in `why` when there is nothing to use, e.g.
//   "libcuda.so.1 not found: no NVIDIA driver (...)"
//   "cuInit failed: CUDA_ERROR_NO_DEVICE"
//   "gpu0: cannot reserve the arena: CUDA_ERROR_OUT_OF_MEMORY"
// If only some GPUs fail to open, the others are returned and the failures are
// logged. Only one Device per GPU may exist in a process (they share the primary
// context, which fault recovery resets).
std::vector<std::unique_ptr<Device>> open_cuda_devices(const CudaOptions& options,
                                                       std::string& why);

// For process isolation, where each GPU is opened in its own executor process.
// The number of visible CUDA GPUs, without creating a context (cuInit and
// cuDeviceGetCount only); -1 with a one-line reason in `why` when the driver
// cannot be used.
int cuda_device_count(std::string& why);
// Opens CUDA GPU `ordinal` alone (DeviceInfo::index = `index`); nullptr with a
// one-line reason, e.g. "gpu1: cannot reserve the arena: CUDA_ERROR_OUT_OF_MEMORY".
std::unique_ptr<Device> open_cuda_device(const CudaOptions& options, int ordinal, int index,
                                         std::string& why);

// Whether this build carries the built-in kernels (spin, gemm); if not, `why`
// says so ("built-in ops unavailable: salusd was built without nvcc").
bool cuda_builtins_built(std::string& why);

}  // namespace salus::vgpu
