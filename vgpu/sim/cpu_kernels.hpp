// The built-in ops as the sim backend runs them: plain CPU code over host memory.
// They compute real results so that sessions on the sim backend can be checked
// byte for byte against the CUDA backend.
#pragma once

#include <cstddef>
#include <cstdint>

namespace salus::vgpu::sim {

// Repeats the `width`-byte element `pattern` (1, 2 or 4; little-endian, as the GPU
// stores it) over `length` bytes. A length that is not a multiple of the width
// ends with the element's leading bytes. Returns false for any other width.
bool cpu_fill(std::byte* dst, std::size_t length, std::uint32_t pattern, unsigned width);

// C[m x n] = A[m x k] * B[k x n], fp32, row-major, densely packed. The pointers need
// no particular alignment, and C may overlap A or B (the result is then as if the
// inputs had been read before C was written).
void cpu_gemm(std::uint32_t m, std::uint32_t n, std::uint32_t k, const std::byte* a,
              const std::byte* b, std::byte* c);

}  // namespace salus::vgpu::sim
