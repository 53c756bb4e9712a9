#include "tools/salus_bench/native_cuda_loop.hpp"

#include <chrono>
#include <vector>

#include <fmt/format.h>

#include "vgpu/cuda/builtin_kernels.hpp"
#include "vgpu/cuda/cuda_driver.hpp"
#include "vgpu/cuda/cuda_plans.hpp"

namespace salus::bench {
namespace {

using vgpu::cuda::CudaDriver;

// Everything one loop needs on GPU 0, released in the destructor.
class NativeGpu {
 public:
  NativeGpu(const CudaDriver& drv, const NativeSpec& spec) : drv_(drv), spec_(spec) {}
  ~NativeGpu() {
    if (ctx_ == nullptr) return;
    drv_.ctx_set_current(ctx_);
    if (stream_ != nullptr) drv_.stream_synchronize(stream_);
    for (CUdeviceptr p : {a_, b_, c_})
      if (p != 0) drv_.mem_free(p);
    if (stream_ != nullptr) drv_.stream_destroy(stream_);
    if (module_ != nullptr) drv_.module_unload(module_);
    drv_.primary_ctx_release(dev_);
  }
  NativeGpu(const NativeGpu&) = delete;
  NativeGpu& operator=(const NativeGpu&) = delete;

  bool open(std::string& why) {
    if (vgpu::cuda::builtin_fatbin_size == 0) {
      why = vgpu::cuda::kNoBuiltinsReason;
      return false;
    }
    if (!ok(drv_.device_get(&dev_, 0), "cuDeviceGet", why) ||
        !ok(drv_.primary_ctx_retain(&ctx_, dev_), "cuDevicePrimaryCtxRetain", why) ||
        !ok(drv_.ctx_set_current(ctx_), "cuCtxSetCurrent", why) ||
        !ok(drv_.stream_create(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate", why) ||
        !ok(drv_.module_load_data_ex(&module_, vgpu::cuda::builtin_fatbin, 0, nullptr, nullptr),
            "cuModuleLoadDataEx", why))
      return false;
    int sms = 0, threads = 0, clock_khz = 0;
    drv_.device_get_attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev_);
    drv_.device_get_attribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev_);
    drv_.device_get_attribute(&clock_khz, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev_);
    if (spec_.kind == "gemm") {
      if (!ok(drv_.module_get_function(&fn_, module_, "salus_gemm"), "salus_gemm", why))
        return false;
      const std::size_t bytes = std::size_t{spec_.size} * spec_.size * 4;
      for (CUdeviceptr* p : {&a_, &b_, &c_})
        if (!ok(drv_.mem_alloc(p, bytes), "cuMemAlloc", why)) return false;
      drv_.memset_d32_async(a_, 0x3f800000u, bytes / 4, stream_);  // 1.0f
      drv_.memset_d32_async(b_, 0x40000000u, bytes / 4, stream_);  // 2.0f
      if (!vgpu::cuda::gemm_grid(spec_.size, spec_.size, a_, b_, c_, grid_, why)) return false;
      dims_ = spec_.size;
      params_ = {&dims_, &dims_, &dims_, &a_, &b_, &c_};
      block_ = vgpu::cuda::kGemmBlockThreads;
    } else {
      if (!ok(drv_.module_get_function(&fn_, module_, "salus_spin"), "salus_spin", why))
        return false;
      double rate = spec_.spin_cycles_per_usec;
      if (rate <= 0 && !calibrate(clock_khz, rate, why)) return false;
      cycles_ = vgpu::cuda::spin_cycles(spec_.usec, rate);
      grid_[0] = vgpu::cuda::spin_blocks(1.0, static_cast<std::uint32_t>(sms),
                                         static_cast<std::uint32_t>(threads));
      grid_[1] = 1;
      params_ = {&cycles_};
      block_ = vgpu::cuda::kSpinBlockThreads;
    }
    return ok(drv_.stream_synchronize(stream_), "setup", why);
  }

  bool launch(std::string& why) {
    return ok(drv_.launch_kernel(fn_, grid_[0], grid_[1], 1, block_, 1, 1, 0, stream_,
                                 params_.data(), nullptr),
              "cuLaunchKernel", why);
  }
  bool sync(std::string& why) { return ok(drv_.stream_synchronize(stream_), "sync", why); }

 private:
  bool ok(CUresult r, const char* what, std::string& why) {
    if (r == CUDA_SUCCESS) return true;
    why = fmt::format("{}: {}", what, drv_.describe(r));
    return false;
  }
  // As salusd does: time a long single-block spin with events.
  bool calibrate(int clock_khz, double& rate, std::string& why) {
    rate = clock_khz / 1000.0;
    CUevent e0 = nullptr, e1 = nullptr;
    if (!ok(drv_.event_create(&e0, CU_EVENT_DEFAULT), "cuEventCreate", why) ||
        !ok(drv_.event_create(&e1, CU_EVENT_DEFAULT), "cuEventCreate", why))
      return false;
    unsigned long long cycles = 200'000'000;
    void* p[] = {&cycles};
    drv_.event_record(e0, stream_);
    drv_.launch_kernel(fn_, 1, 1, 1, 32, 1, 1, 0, stream_, p, nullptr);
    drv_.event_record(e1, stream_);
    float ms = 0;
    if (drv_.event_synchronize(e1) == CUDA_SUCCESS &&
        drv_.event_elapsed_time(&ms, e0, e1) == CUDA_SUCCESS && ms > 0)
      rate = static_cast<double>(cycles) / (ms * 1e3);
    drv_.event_destroy(e0);
    drv_.event_destroy(e1);
    return true;
  }

  const CudaDriver& drv_;
  NativeSpec spec_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  CUmodule module_ = nullptr;
  CUfunction fn_ = nullptr;
  CUdeviceptr a_ = 0, b_ = 0, c_ = 0;
  unsigned dims_ = 0;
  unsigned long long cycles_ = 0;
  std::uint32_t grid_[2] = {1, 1};
  unsigned block_ = 1;
  std::vector<void*> params_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

bool native_loop(const NativeSpec& spec, long n, long warmup, NativeResult& out, std::string& why) {
  const CudaDriver* drv = CudaDriver::get(why);
  if (drv == nullptr) return false;
  NativeGpu gpu(*drv, spec);
  if (!gpu.open(why)) return false;
  for (long i = 0; i < warmup; ++i)
    if (!gpu.launch(why)) return false;
  if (!gpu.sync(why)) return false;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i)
    if (!gpu.launch(why)) return false;
  if (!gpu.sync(why)) return false;
  out.seconds = seconds_since(t0);
  out.iterations = n;
  return true;
}

bool native_timed_loop(const NativeSpec& spec, double seconds, NativeResult& out,
                       std::string& why) {
  const CudaDriver* drv = CudaDriver::get(why);
  if (drv == nullptr) return false;
  NativeGpu gpu(*drv, spec);
  if (!gpu.open(why)) return false;
  const auto t0 = std::chrono::steady_clock::now();
  long n = 0;
  // Keep a few launches queued so the GPU never waits for this thread.
  while (seconds_since(t0) < seconds) {
    for (int i = 0; i < 4; ++i)
      if (!gpu.launch(why)) return false;
    if (!gpu.sync(why)) return false;
    n += 4;
  }
  out.seconds = seconds_since(t0);
  out.iterations = n;
  return true;
}

}  // namespace salus::bench
