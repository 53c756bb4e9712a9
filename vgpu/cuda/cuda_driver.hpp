// The CUDA Driver API as salusd uses it, loaded at run time: libcuda.so.1 is
// dlopen'ed and every entry point is resolved through cuGetProcAddress at one
// explicit ABI version, so salusd links and starts on machines without a driver
// and keeps calling the same ABI whatever newer driver is installed.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace salus::vgpu::cuda {

class CudaDriver {
 public:
  // The ABI every entry point is requested at: the CUDA 12.0 signatures. A newer
  // driver still hands out these versions; an older one than this is refused.
  static constexpr int kAbiVersion = 12000;

  // Loads and initializes the driver once per process (cuInit(0) included) and
  // returns it, or nullptr with a one-line reason in `why`, e.g. "libcuda.so.1 not
  // found: no NVIDIA driver (...)" or "cuInit failed: CUDA_ERROR_NO_DEVICE". The
  // result, success or failure, is cached; the library is never unloaded.
  // Thread-safe.
  static const CudaDriver* get(std::string& why);

  // "CUDA_ERROR_ILLEGAL_ADDRESS", or "CUresult 1234" for a code the driver cannot
  // name.
  std::string error_name(CUresult r) const;
  // The name plus the driver's sentence for it.
  std::string describe(CUresult r) const;

  int version() const { return version_; }  // cuDriverGetVersion, e.g. 12040

  // ---- entry points (never null after get() succeeded, except where noted) ----
  // Named without the cu prefix: cuda.h #defines many cu* names to their _v2
  // symbols, which would silently rename members.
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuInit_v2000 init = nullptr;
  PFN_cuDriverGetVersion_v2020 driver_get_version = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetCount_v2000 device_get_count = nullptr;
  PFN_cuDeviceGetName_v2000 device_get_name = nullptr;
  PFN_cuDeviceGetUuid_v11040 device_get_uuid = nullptr;
  PFN_cuDeviceTotalMem_v3020 device_total_mem = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_ctx_retain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 primary_ctx_release = nullptr;
  PFN_cuDevicePrimaryCtxReset_v11000 primary_ctx_reset = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
  PFN_cuCtxSynchronize_v2000 ctx_synchronize = nullptr;
  PFN_cuMemGetInfo_v3020 mem_get_info = nullptr;
  PFN_cuMemAlloc_v3020 mem_alloc = nullptr;
  PFN_cuMemFree_v3020 mem_free = nullptr;
  PFN_cuMemHostAlloc_v2020 mem_host_alloc = nullptr;
  PFN_cuMemFreeHost_v2000 mem_free_host = nullptr;
  PFN_cuMemHostRegister_v6050 mem_host_register = nullptr;
  PFN_cuMemHostUnregister_v4000 mem_host_unregister = nullptr;
  PFN_cuMemcpyHtoDAsync_v3020 memcpy_htod_async = nullptr;
  PFN_cuMemcpyDtoHAsync_v3020 memcpy_dtoh_async = nullptr;
  PFN_cuMemcpyDtoDAsync_v3020 memcpy_dtod_async = nullptr;
  PFN_cuMemsetD8Async_v3020 memset_d8_async = nullptr;
  PFN_cuMemsetD32Async_v3020 memset_d32_async = nullptr;
  PFN_cuStreamCreate_v2000 stream_create = nullptr;
  PFN_cuStreamDestroy_v4000 stream_destroy = nullptr;
  PFN_cuStreamSynchronize_v2000 stream_synchronize = nullptr;
  PFN_cuStreamWaitEvent_v3020 stream_wait_event = nullptr;
  PFN_cuEventCreate_v2000 event_create = nullptr;
  PFN_cuEventDestroy_v4000 event_destroy = nullptr;
  PFN_cuEventRecord_v2000 event_record = nullptr;
  PFN_cuEventQuery_v2000 event_query = nullptr;
  PFN_cuEventSynchronize_v2000 event_synchronize = nullptr;
  PFN_cuEventElapsedTime_v2000 event_elapsed_time = nullptr;
  PFN_cuModuleLoadDataEx_v2010 module_load_data_ex = nullptr;
  PFN_cuModuleUnload_v2000 module_unload = nullptr;
  PFN_cuModuleGetFunction_v2000 module_get_function = nullptr;
  PFN_cuLaunchKernel_v4000 launch_kernel = nullptr;
  PFN_cuLaunchHostFunc_v10000 launch_host_func = nullptr;
  PFN_cuFuncGetAttribute_v2020 func_get_attribute = nullptr;
  // Drivers before 12.4 lack it; get_function then reports no parameter sizes.
  PFN_cuFuncGetParamInfo_v12040 func_get_param_info = nullptr;
  // Optional (all or none): VMM with POSIX-fd handles, for the shared lane of
  // attached sessions (make_lane_memory). Null where the driver lacks one.
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;

 private:
  CudaDriver() = default;
  bool load(std::string& why);

  int version_ = 0;
};

// True for the errors after which the context is unusable until it is reset
// (CUDA_ERROR_ILLEGAL_ADDRESS and its kin): every later call fails the same way.
bool is_sticky(CUresult r);
// True for the sticky errors a kernel causes by what it does (bad address, trap,
// assert, timeout), as opposed to the device failing (ECC, lost device).
bool is_kernel_fault(CUresult r);
// The errno a failed call becomes in a completion: ENOMEM for out-of-memory,
// EINVAL for bad arguments, images and launch configurations, EFAULT for kernel
// faults, EIO otherwise.
int to_errno(CUresult r);

}  // namespace salus::vgpu::cuda
