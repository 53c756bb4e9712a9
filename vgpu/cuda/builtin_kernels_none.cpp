// Stands in for the embedded fatbin when nvcc was not found at build time: the
// cuda backend still runs fill, copy, transfers and user modules, and the ops
// that need a built-in kernel (spin, gemm) fail with kNoBuiltinsReason.
#include "vgpu/cuda/builtin_kernels.hpp"

namespace salus::vgpu::cuda {

const unsigned char builtin_fatbin[1] = {0};
const std::size_t builtin_fatbin_size = 0;
const char* const builtin_fatbin_description = "none (built without nvcc)";

}  // namespace salus::vgpu::cuda
