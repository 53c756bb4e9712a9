// Kernels for the cuda device tests, loaded as a user module (fatbin and PTX).
// extern "C" keeps their names unmangled, as docs/modules.md recommends.
#include <cstdint>

// Copies every scalar type into `out` at fixed offsets: i32@0 u32@4 i64@8 u64@16
// f32@24 f64@32.
extern "C" __global__ void all_types(unsigned char* out, int a, unsigned b, long long c,
                                     unsigned long long d, float e, double f) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  *reinterpret_cast<int*>(out + 0) = a;
  *reinterpret_cast<unsigned*>(out + 4) = b;
  *reinterpret_cast<long long*>(out + 8) = c;
  *reinterpret_cast<unsigned long long*>(out + 16) = d;
  *reinterpret_cast<float*>(out + 24) = e;
  *reinterpret_cast<double*>(out + 32) = f;
}

// y[i] = a * x[i] + y[i]
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned n) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

// Waits (at most `max_cycles`) for another stream's kernel to raise *flag, and
// records whether it saw it: 1 proves the two streams ran at the same time.
extern "C" __global__ void wait_flag(volatile unsigned* flag, unsigned* seen,
                                     unsigned long long max_cycles) {
  const long long start = clock64();
  unsigned v = 0;
  while ((v = *flag) == 0 && static_cast<unsigned long long>(clock64() - start) < max_cycles) {
  }
  *seen = v != 0 ? 1u : 0u;
}

extern "C" __global__ void set_flag(volatile unsigned* flag) {
  *flag = 1;
  __threadfence();
}

// Stores through a pointer the host made up: with an unmapped address this is
// the CUDA_ERROR_ILLEGAL_ADDRESS the fault-recovery test needs.
extern "C" __global__ void bad_store(unsigned* p) {
  *reinterpret_cast<volatile unsigned*>(p) = 0xdead;
}
