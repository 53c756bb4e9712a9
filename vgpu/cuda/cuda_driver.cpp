#include "vgpu/cuda/cuda_driver.hpp"

#include <dlfcn.h>

#include <cerrno>
#include <mutex>

#include <fmt/format.h>

namespace salus::vgpu::cuda {
namespace {

// The 12.0+ export takes a CUdriverProcAddressQueryResult* that tells "no such
// symbol" from "symbol newer than the version asked for"; 11.3-11.8 drivers only
// export the four-argument form under the plain name.
using GetProcV2 = PFN_cuGetProcAddress_v12000;
using GetProcV1 = PFN_cuGetProcAddress_v11030;

struct Resolver {
  GetProcV2 v2 = nullptr;
  GetProcV1 v1 = nullptr;

  // Returns "" on success, else why the symbol is unavailable.
  template <typename Fn>
  std::string operator()(const char* name, Fn& out, int version) const {
    void* p = nullptr;
    CUresult r;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    if (v2 != nullptr)
      r = v2(name, &p, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    else
      r = v1(name, &p, version, CU_GET_PROC_ADDRESS_DEFAULT);
    if (r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && p != nullptr) {
      out = reinterpret_cast<Fn>(p);
      return {};
    }
    if (status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
      return fmt::format("{} needs a newer driver (asked for the CUDA {}.{} version)", name,
                         version / 1000, version % 1000 / 10);
    return fmt::format("{} not found in libcuda.so.1 (cuGetProcAddress returned {})", name,
                       static_cast<int>(r));
  }
};

// The entry points salusd can run without: each is nulled when the driver
// lacks it, and its feature checks that pointer.
void resolve_optional(CudaDriver& d, const Resolver& resolve) {
  // Optional: parameter sizes for checking launches; introduced in CUDA 12.4.
  if (d.version() >= 12040 && !resolve("cuFuncGetParamInfo", d.func_get_param_info, 12040).empty())
    d.func_get_param_info = nullptr;
  // Optional: VMM for the shared lane; all or none.
  bool vmm = true;
  auto opt = [&](const char* name, auto& out) {
    if (vmm && !resolve(name, out, 10020).empty()) vmm = false;
  };
  opt("cuMemCreate", d.mem_create);
  opt("cuMemRelease", d.mem_release);
  opt("cuMemExportToShareableHandle", d.mem_export);
  opt("cuMemImportFromShareableHandle", d.mem_import);
  opt("cuMemAddressReserve", d.mem_address_reserve);
  opt("cuMemAddressFree", d.mem_address_free);
  opt("cuMemMap", d.mem_map);
  opt("cuMemUnmap", d.mem_unmap);
  opt("cuMemSetAccess", d.mem_set_access);
  if (!vmm) d.mem_create = nullptr;  // make_lane_memory checks this one
}

std::once_flag g_once;
const CudaDriver* g_driver = nullptr;
std::string g_why;

}  // namespace

const CudaDriver* CudaDriver::get(std::string& why) {
  std::call_once(g_once, [] {
    auto* d = new CudaDriver();  // lives for the process, like the library itself
    std::string reason;
    if (d->load(reason)) {
      g_driver = d;
    } else {
      delete d;
      g_why = reason;
    }
  });
  if (g_driver == nullptr) why = g_why;
  return g_driver;
}

bool CudaDriver::load(std::string& why) {
  // RTLD_LOCAL: nothing else in salusd should bind to driver symbols by accident.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    why = fmt::format("libcuda.so.1 not found: no NVIDIA driver ({})", e ? e : "dlopen failed");
    return false;
  }
  // cuGetProcAddress is the one symbol taken from dlsym; everything else goes
  // through it so the ABI version is explicit rather than whatever the export
  // table's unversioned name happens to mean in this driver.
  Resolver resolve;
  resolve.v2 = reinterpret_cast<GetProcV2>(::dlsym(lib, "cuGetProcAddress_v2"));
  if (resolve.v2 == nullptr)
    resolve.v1 = reinterpret_cast<GetProcV1>(::dlsym(lib, "cuGetProcAddress"));
  if (resolve.v2 == nullptr && resolve.v1 == nullptr) {
    why = "libcuda.so.1 has no cuGetProcAddress: the NVIDIA driver is older than CUDA 11.3";
    return false;
  }

  std::string err;
  auto need = [&](const char* name, auto& out, int version = kAbiVersion) {
    if (!err.empty()) return;
    err = resolve(name, out, version);
  };
  need("cuDriverGetVersion", driver_get_version);
  if (err.empty()) {
    if (driver_get_version(&version_) != CUDA_SUCCESS) version_ = 0;
    if (version_ < kAbiVersion) {
      why = fmt::format(
          "the NVIDIA driver supports CUDA {}.{}, salusd needs {}.{} or newer (update the "
          "driver)",
          version_ / 1000, version_ % 1000 / 10, kAbiVersion / 1000, kAbiVersion % 1000 / 10);
      return false;
    }
  }
  need("cuGetErrorName", get_error_name);
  need("cuGetErrorString", get_error_string);
  need("cuInit", init);
  need("cuDeviceGet", device_get);
  need("cuDeviceGetCount", device_get_count);
  need("cuDeviceGetName", device_get_name);
  need("cuDeviceGetUuid", device_get_uuid);
  need("cuDeviceTotalMem", device_total_mem);
  need("cuDeviceGetAttribute", device_get_attribute);
  need("cuDevicePrimaryCtxRetain", primary_ctx_retain);
  need("cuDevicePrimaryCtxRelease", primary_ctx_release);
  need("cuDevicePrimaryCtxReset", primary_ctx_reset);
  need("cuCtxSetCurrent", ctx_set_current);
  need("cuCtxSynchronize", ctx_synchronize);
  need("cuMemGetInfo", mem_get_info);
  need("cuMemAlloc", mem_alloc);
  need("cuMemFree", mem_free);
  need("cuMemHostAlloc", mem_host_alloc);
  need("cuMemFreeHost", mem_free_host);
  need("cuMemHostRegister", mem_host_register);
  need("cuMemHostUnregister", mem_host_unregister);
  need("cuMemcpyHtoDAsync", memcpy_htod_async);
  need("cuMemcpyDtoHAsync", memcpy_dtoh_async);
  need("cuMemcpyDtoDAsync", memcpy_dtod_async);
  need("cuMemsetD8Async", memset_d8_async);
  need("cuMemsetD32Async", memset_d32_async);
  need("cuStreamCreate", stream_create);
  need("cuStreamDestroy", stream_destroy);
  need("cuStreamSynchronize", stream_synchronize);
  need("cuStreamWaitEvent", stream_wait_event);
  need("cuEventCreate", event_create);
  need("cuEventDestroy", event_destroy);
  need("cuEventRecord", event_record);
  need("cuEventQuery", event_query);
  need("cuEventSynchronize", event_synchronize);
  need("cuEventElapsedTime", event_elapsed_time);
  need("cuModuleLoadDataEx", module_load_data_ex);
  need("cuModuleUnload", module_unload);
  need("cuModuleGetFunction", module_get_function);
  need("cuLaunchKernel", launch_kernel);
  need("cuLaunchHostFunc", launch_host_func);
  need("cuFuncGetAttribute", func_get_attribute);
  if (!err.empty()) {
    why = err;
    return false;
  }
  resolve_optional(*this, resolve);

  if (const CUresult r = init(0); r != CUDA_SUCCESS) {
    why = fmt::format("cuInit failed: {}", error_name(r));
    return false;
  }
  return true;
}

std::string CudaDriver::error_name(CUresult r) const {
  const char* name = nullptr;
  if (get_error_name != nullptr && get_error_name(r, &name) == CUDA_SUCCESS && name != nullptr)
    return name;
  return fmt::format("CUresult {}", static_cast<int>(r));
}

std::string CudaDriver::describe(CUresult r) const {
  const char* text = nullptr;
  if (get_error_string != nullptr && get_error_string(r, &text) == CUDA_SUCCESS && text != nullptr)
    return fmt::format("{} ({})", error_name(r), text);
  return error_name(r);
}

bool is_kernel_fault(CUresult r) {
  switch (r) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_LAUNCH_FAILED:
      return true;
    default:
      return false;
  }
}

bool is_sticky(CUresult r) {
  if (is_kernel_fault(r)) return true;
  switch (r) {
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_CONTAINED:
    case CUDA_ERROR_TENSOR_MEMORY_LEAK:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
      return true;
    default:
      return false;
  }
}

int to_errno(CUresult r) {
  if (r == CUDA_SUCCESS) return 0;
  if (is_kernel_fault(r)) return EFAULT;
  switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return ENOMEM;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_NOT_FOUND:
    case CUDA_ERROR_INVALID_IMAGE:
    case CUDA_ERROR_INVALID_SOURCE:
    case CUDA_ERROR_INVALID_PTX:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND:
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
    case CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING:
    case CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
      return EINVAL;
    default:
      return EIO;
  }
}

}  // namespace salus::vgpu::cuda
