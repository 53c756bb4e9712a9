// Kernels for the sim-module tests, built as a host shared object the way a user
// would build one for the sim backend (client/salus_sim_kernel.h).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "client/salus_sim_kernel.h"

namespace {
int calls = 0;  // per loaded copy of the object: shows two loads do not share state
}

// y[i] = a * x[i] + y[i] for every i < n covered by the grid.
SALUS_SIM_SIGNATURE(saxpy, "ptr, ptr, f32, u32");
SALUS_SIM_KERNEL(saxpy) {
  float* y = SALUS_SIM_ARG(args, 0, float*);
  const float* x = SALUS_SIM_ARG(args, 1, const float*);
  const float a = SALUS_SIM_ARG(args, 2, float);
  const std::uint32_t n = SALUS_SIM_ARG(args, 3, std::uint32_t);
  const std::uint64_t threads = std::uint64_t{launch->grid[0]} * launch->block[0];
  for (std::uint64_t i = 0; i < threads && i < n; ++i) y[i] = a * x[i] + y[i];
}

// Copies every scalar type into `out` at fixed offsets: i32@0 u32@4 i64@8 u64@16
// f32@24 f64@32, and the ABI version @40.
SALUS_SIM_SIGNATURE(all_types, "ptr,i32,u32,i64,u64,f32,f64");
SALUS_SIM_KERNEL(all_types) {
  auto* out = SALUS_SIM_ARG(args, 0, unsigned char*);
  const std::int32_t a = SALUS_SIM_ARG(args, 1, std::int32_t);
  const std::uint32_t b = SALUS_SIM_ARG(args, 2, std::uint32_t);
  const std::int64_t c = SALUS_SIM_ARG(args, 3, std::int64_t);
  const std::uint64_t d = SALUS_SIM_ARG(args, 4, std::uint64_t);
  const float e = SALUS_SIM_ARG(args, 5, float);
  const double f = SALUS_SIM_ARG(args, 6, double);
  std::memcpy(out + 0, &a, 4);
  std::memcpy(out + 4, &b, 4);
  std::memcpy(out + 8, &c, 8);
  std::memcpy(out + 16, &d, 8);
  std::memcpy(out + 24, &e, 4);
  std::memcpy(out + 32, &f, 8);
  const std::uint32_t abi = launch->abi;
  std::memcpy(out + 40, &abi, 4);
}

// No signature table: salusd cannot check its arguments. Writes the launch shape
// (grid xyz, block xyz, smem) as seven u32 and whether smem arrived zeroed.
SALUS_SIM_KERNEL(shape) {
  auto* out = SALUS_SIM_ARG(args, 0, std::uint32_t*);
  for (int i = 0; i < 3; ++i) out[i] = launch->grid[i];
  for (int i = 0; i < 3; ++i) out[3 + i] = launch->block[i];
  out[6] = launch->shared_mem;
  std::uint32_t zero = 1;
  const auto* smem = static_cast<const unsigned char*>(launch->shared);
  for (std::uint32_t i = 0; i < launch->shared_mem; ++i)
    if (smem[i] != 0) zero = 0;
  out[7] = zero;
  out[8] = (launch->shared_mem == 0) == (launch->shared == nullptr);
  out[9] = reinterpret_cast<std::uintptr_t>(launch->shared) % 16 == 0;
}

// Counts its own calls in a static, so a second load of the same image is
// observably a separate copy.
SALUS_SIM_SIGNATURE(count, "ptr");
SALUS_SIM_KERNEL(count) {
  (void)launch;
  *SALUS_SIM_ARG(args, 0, std::int32_t*) = ++calls;
}

SALUS_SIM_SIGNATURE(throws, "");
SALUS_SIM_KERNEL(throws) {
  (void)launch;
  (void)args;
  throw std::runtime_error("kernel failure");
}

SALUS_SIM_SIGNATURE(bad_signature, "ptr,float");
SALUS_SIM_KERNEL(bad_signature) {
  (void)launch;
  (void)args;
}

// Kernels that take down the process they run in. On sim a kernel is host code,
// so a bad pointer is a segmentation fault of the GPU's process: with
// --gpu-isolation process that is the executor, which salusd replaces (the
// integration tests of fault recovery use these); in salusd itself it would be
// salusd, so nothing launches them there.
SALUS_SIM_SIGNATURE(crash_store, "u64");
SALUS_SIM_KERNEL(crash_store) {
  (void)launch;
  *reinterpret_cast<volatile std::uint32_t*>(SALUS_SIM_ARG(args, 0, std::uint64_t)) = 0xdead;
}

SALUS_SIM_SIGNATURE(crash_abort, "");
SALUS_SIM_KERNEL(crash_abort) {
  (void)launch;
  (void)args;
  std::abort();
}

// A data symbol: looking it up as a kernel must fail rather than jump into data.
extern "C" SALUS_SIM_EXPORT int not_a_function;
int not_a_function = 42;
