#include "vgpu/sim/cpu_kernels.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

namespace salus::vgpu::sim {

bool cpu_fill(std::byte* dst, std::size_t length, std::uint32_t pattern, unsigned width) {
  if (width != 1 && width != 2 && width != 4) return false;
  if (length == 0) return true;
  if (width == 1) {
    std::memset(dst, static_cast<int>(pattern & 0xffu), length);
    return true;
  }
  // Seed one element, then double the filled prefix with memcpy; capping the chunk
  // keeps the source hot in cache on multi-GiB fills.
  constexpr std::size_t kMaxChunk = std::size_t{1} << 20;
  unsigned char element[4];
  for (unsigned i = 0; i < 4; ++i) element[i] = static_cast<unsigned char>(pattern >> (8 * i));
  std::size_t filled = std::min<std::size_t>(width, length);
  std::memcpy(dst, element, filled);
  while (filled < length) {
    const std::size_t chunk = std::min({filled, length - filled, kMaxChunk});
    std::memcpy(dst + filled, dst, chunk);
    filled += chunk;
  }
  return true;
}

namespace {

// The kernel proper, on aligned, non-aliasing float arrays. The i-k-j order streams
// through rows of B and C, so the inner loop is unit-stride and vectorizes.
void gemm_ikj(std::uint32_t m, std::uint32_t n, std::uint32_t k, const float* __restrict a,
              const float* __restrict b, float* __restrict c) {
  for (std::size_t i = 0; i < m; ++i) {
    float* crow = c + i * n;
    std::fill(crow, crow + n, 0.0f);
    const float* arow = a + i * k;
    for (std::size_t kk = 0; kk < k; ++kk) {
      const float aik = arow[kk];
      const float* brow = b + kk * n;
      for (std::size_t j = 0; j < n; ++j) crow[j] += aik * brow[j];
    }
  }
}

bool aligned_for_float(const std::byte* p) {
  return reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0;
}

bool overlaps(const std::byte* p, std::size_t plen, const std::byte* q, std::size_t qlen) {
  const auto pa = reinterpret_cast<std::uintptr_t>(p);
  const auto qa = reinterpret_cast<std::uintptr_t>(q);
  return pa < qa + qlen && qa < pa + plen;
}

}  // namespace

void cpu_gemm(std::uint32_t m, std::uint32_t n, std::uint32_t k, const std::byte* a,
              const std::byte* b, std::byte* c) {
  if (m == 0 || n == 0) return;
  const std::size_t a_bytes = std::size_t{m} * k * sizeof(float);
  const std::size_t b_bytes = std::size_t{k} * n * sizeof(float);
  const std::size_t c_bytes = std::size_t{m} * n * sizeof(float);

  // Arena offsets are normally 256-aligned and buffers disjoint; the odd case goes
  // through packed copies rather than risking misaligned or aliased float access.
  const bool direct_in = aligned_for_float(a) && aligned_for_float(b);
  const bool direct_out = aligned_for_float(c) && !overlaps(c, c_bytes, a, a_bytes) &&
                          !overlaps(c, c_bytes, b, b_bytes);
  std::vector<float> a_copy, b_copy, c_tmp;
  const float* fa;
  const float* fb;
  if (direct_in) {
    fa = reinterpret_cast<const float*>(a);
    fb = reinterpret_cast<const float*>(b);
  } else {
    a_copy.resize(a_bytes / sizeof(float));
    b_copy.resize(b_bytes / sizeof(float));
    std::memcpy(a_copy.data(), a, a_bytes);
    std::memcpy(b_copy.data(), b, b_bytes);
    fa = a_copy.data();
    fb = b_copy.data();
  }
  if (direct_out) {
    gemm_ikj(m, n, k, fa, fb, reinterpret_cast<float*>(c));
  } else {
    c_tmp.resize(c_bytes / sizeof(float));
    gemm_ikj(m, n, k, fa, fb, c_tmp.data());
    std::memcpy(c, c_tmp.data(), c_bytes);
  }
}

}  // namespace salus::vgpu::sim
