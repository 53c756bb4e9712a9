// The built-in ops that need a kernel on the cuda backend: spin (a calibrated
// busy loop for synthetic load) and gemm (fp32, row-major). Compiled by nvcc at
// build time into a fatbin that salusd embeds and loads with cuModuleLoadData.
// fill and copy need no kernel: cuMemsetD8/D32Async and cuMemcpyDtoDAsync cover
// them (cuda_plans.hpp), so they work even in a build without nvcc.
//
// Launch shapes are part of the contract with cuda_device.cpp and cuda_plans.hpp:
// salus_spin takes kSpinBlockThreads (256) threads per block, salus_gemm 256
// threads per block on a (ceil(N/64), ceil(M/64)) grid.

// Every thread of every block spins until its SM's cycle counter has advanced by
// `cycles`. All threads spin, not one per block, because an SM frees a block's
// thread slots only when the whole block has finished: the spin really occupies
// what it was launched on. __launch_bounds__ keeps register use low enough that
// full occupancy (2048 threads per SM on sm_80/sm_90) is possible.
extern "C" __global__ void __launch_bounds__(256) salus_spin(unsigned long long cycles) {
  const long long start = clock64();
  while (static_cast<unsigned long long>(clock64() - start) < cycles) {
  }
}

// C[M x N] = A[M x K] * B[K x N], fp32, row-major, densely packed.
// Each 256-thread block computes a 64 x 64 tile of C; thread (tx, ty) of the
// 16 x 16 layout owns rows ty + 16i and columns tx + 16j (i, j < 4), a strided
// assignment that keeps shared-memory reads conflict-free and global stores
// coalesced. K advances in slices of 16 staged through shared memory. Every
// global access is bounds-checked (out-of-range loads read 0), so any M, N, K is
// correct, including ones that are not multiples of the tile and K = 0 (C = 0).
namespace {
constexpr int kTile = 64;
constexpr int kSlice = 16;
constexpr int kThreads = 256;
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
    salus_gemm(unsigned m, unsigned n, unsigned k, const float* __restrict__ a,
               const float* __restrict__ b, float* c) {
  // As is stored transposed (As[kk][row]) so the inner loop reads it like Bs.
  __shared__ float as[kSlice][kTile];
  __shared__ float bs[kSlice][kTile];

  const int tid = threadIdx.x;
  const int tx = tid % 16;
  const int ty = tid / 16;
  const unsigned long long row0 = static_cast<unsigned long long>(blockIdx.y) * kTile;
  const unsigned long long col0 = static_cast<unsigned long long>(blockIdx.x) * kTile;

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

  for (unsigned long long k0 = 0; k0 < k; k0 += kSlice) {
    // A tile: 64 rows x 16 columns of K; consecutive threads read along K.
#pragma unroll
    for (int i = 0; i < kTile * kSlice / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int r = e / kSlice;
      const int kk = e % kSlice;
      const unsigned long long gr = row0 + r;
      const unsigned long long gk = k0 + kk;
      as[kk][r] = (gr < m && gk < k) ? a[gr * k + gk] : 0.0f;
    }
    // B tile: 16 rows of K x 64 columns; consecutive threads read along N.
#pragma unroll
    for (int i = 0; i < kTile * kSlice / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int kk = e / kTile;
      const int col = e % kTile;
      const unsigned long long gk = k0 + kk;
      const unsigned long long gc = col0 + col;
      bs[kk][col] = (gk < k && gc < n) ? b[gk * n + gc] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSlice; ++kk) {
      float av[4];
      float bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();  // before the next slice overwrites the tiles
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned long long gr = row0 + ty + 16 * i;
    if (gr >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned long long gc = col0 + tx + 16 * j;
      if (gc < n) c[gr * n + gc] = acc[i][j];
    }
  }
}
