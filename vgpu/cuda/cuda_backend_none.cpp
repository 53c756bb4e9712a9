// open_cuda_devices() for a build without the CUDA backend (no cuda.h >= 12.0 at
// build time, or -Dcuda=disabled): always empty, with the reason, so salusd can
// call it unconditionally and fall back to sim.
#include "vgpu/cuda/cuda_backend.hpp"

namespace salus::vgpu {

std::vector<std::unique_ptr<Device>> open_cuda_devices(const CudaOptions& options,
                                                       std::string& why) {
  (void)options;
  why = "this salusd was built without the CUDA backend (no cuda.h at build time)";
  return {};
}

int cuda_device_count(std::string& why) {
  why = "this salusd was built without the CUDA backend (no cuda.h at build time)";
  return -1;
}

std::unique_ptr<Device> open_cuda_device(const CudaOptions& options, int ordinal, int index,
                                         std::string& why) {
  (void)options;
  (void)ordinal;
  (void)index;
  why = "this salusd was built without the CUDA backend (no cuda.h at build time)";
  return nullptr;
}

bool cuda_builtins_built(std::string& why) {
  why = "this salusd was built without the CUDA backend";
  return false;
}

}  // namespace salus::vgpu
