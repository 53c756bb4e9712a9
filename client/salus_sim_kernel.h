/* The C ABI of kernels for salusd's sim backend: a module is an ELF host shared
 * object whose kernels salusd calls on a stream thread, once per launch. See
 * docs/modules.md for the full contract. Usable from C and C++.
 *
 *   #include "salus_sim_kernel.h"
 *   SALUS_SIM_SIGNATURE(scale, "ptr,u32,f32");
 *   SALUS_SIM_KERNEL(scale) {
 *     float* x = SALUS_SIM_ARG(args, 0, float*);
 *     uint32_t n = SALUS_SIM_ARG(args, 1, uint32_t);
 *     float a = SALUS_SIM_ARG(args, 2, float);
 *     for (uint32_t i = 0; i < n; ++i) x[i] *= a;
 *   }
 */
#ifndef SALUS_SIM_KERNEL_H
#define SALUS_SIM_KERNEL_H

#include <stdint.h>

/* Bumped whenever salus_launch changes incompatibly; salusd fills in `abi`. */
#define SALUS_SIM_KERNEL_ABI 1

#ifdef __cplusplus
#define SALUS_SIM_EXTERN_C extern "C"
#else
#define SALUS_SIM_EXTERN_C
#endif

/* Exported whatever -fvisibility the module is built with. */
#define SALUS_SIM_EXPORT __attribute__((visibility("default")))

/* What a launch passes besides the arguments. A sim kernel runs once per launch,
 * on one host thread, and loops over the grid itself. */
typedef struct salus_launch {
  uint32_t abi;        /* SALUS_SIM_KERNEL_ABI */
  uint32_t grid[3];    /* x, y, z; each >= 1 */
  uint32_t block[3];   /* x, y, z; each >= 1 */
  uint32_t shared_mem; /* bytes at `shared` */
  void* shared;        /* zeroed, 16-byte-aligned scratch for this launch; NULL if 0 bytes */
} salus_launch;

/* args[i] points at the i-th argument's value: a buffer argument is a pointer
 * (the buffer's address in salusd's simulated device memory), a scalar is the
 * scalar itself. Each value is 16-byte aligned. */
typedef void (*salus_sim_kernel_fn)(const salus_launch* launch, void* const* args);

#define SALUS_SIM_KERNEL(name) \
  SALUS_SIM_EXTERN_C SALUS_SIM_EXPORT void name(const salus_launch* launch, void* const* args)

/* Reads argument `i` as `type` (float*, uint32_t, double, ...). */
#define SALUS_SIM_ARG(args, i, type) (*(type const*)((args)[i]))

/* Declares (then defines, which keeps C++ compilers from warning about an
 * initialized extern) the parameter list of kernel `name` so salusd can check a launch's
 * argument count and sizes before running it: comma-separated tokens from
 * ptr (8 bytes), i32, u32, f32 (4 bytes), i64, u64, f64 (8 bytes); "" means none. */
#define SALUS_SIM_SIGNATURE(name, sig)                                    \
  SALUS_SIM_EXTERN_C SALUS_SIM_EXPORT const char* salus_signature_##name; \
  const char* salus_signature_##name = sig

#endif /* SALUS_SIM_KERNEL_H */
