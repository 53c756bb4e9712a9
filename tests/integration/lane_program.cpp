// A CUDA program for the shared-lane tests: with libsalus-shim.so preloaded,
// SALUS_SHARED_LANE=1 and the mock driver it is an attached session that
// takes its ephemeral memory from the lane (salus_lane_alloc). For each of
// ITERS iterations it allocates MIB MiB from the lane, prints what the first
// byte held ("first K 0xNN": what the previous holder left, or zero when
// cleared), writes its own pattern, waits 20 ms (the other program would
// scribble over it now if the lane were not its alone), checks every byte,
// prints "verified K" and comes to its boundary (salus_step). With HOLD_FILE
// it stops in iteration 1 after writing, prints "holding" and waits until the
// file exists (a test kills it there). Exit 0: every check passed; 1: a
// mismatch; 2: set-up failed; 3: no lane memory.
//
// usage: lane_program SEED MIB ITERS [HOLD_FILE]
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef CUresult (*gpa_t)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
static gpa_t gpa;
template <typename F>
static void get(const char* name, F& out) {
  void* p = nullptr;
  if (gpa(name, &p, 12000, 0, nullptr) != CUDA_SUCCESS || p == nullptr) {
    fprintf(stderr, "lane_program: no %s\n", name);
    exit(2);
  }
  out = reinterpret_cast<F>(p);
}

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) return 2;
  const uint32_t seed = static_cast<uint32_t>(atoi(argv[1]));
  const size_t bytes = static_cast<size_t>(atoi(argv[2])) << 20;
  const int iters = atoi(argv[3]);
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) return 2;
  gpa = reinterpret_cast<gpa_t>(dlsym(lib, "cuGetProcAddress_v2"));
  auto step = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "salus_step"));
  auto lane_alloc = reinterpret_cast<int (*)(unsigned long long*, size_t)>(
      dlsym(RTLD_DEFAULT, "salus_lane_alloc"));
  auto lane_free =
      reinterpret_cast<int (*)(unsigned long long)>(dlsym(RTLD_DEFAULT, "salus_lane_free"));
  if (gpa == nullptr || step == nullptr || lane_alloc == nullptr || lane_free == nullptr) return 2;
  CUresult (*init)(unsigned);
  CUresult (*retain)(CUcontext*, CUdevice);
  CUresult (*set)(CUcontext);
  CUresult (*htod)(CUdeviceptr, const void*, size_t);
  CUresult (*dtoh)(void*, CUdeviceptr, size_t);
  get("cuInit", init);
  get("cuDevicePrimaryCtxRetain", retain);
  get("cuCtxSetCurrent", set);
  get("cuMemcpyHtoD", htod);
  get("cuMemcpyDtoH", dtoh);
  CUcontext ctx;
  if (init(0) || retain(&ctx, 0) || set(ctx)) return 2;
  auto* want = static_cast<uint32_t*>(malloc(bytes));
  auto* got = static_cast<uint32_t*>(malloc(bytes));
  for (int k = 1; k <= iters; ++k) {
    unsigned long long d = 0;
    const int r = lane_alloc(&d, bytes);
    if (r != 0) {
      printf("no lane memory: %d\n", r);
      return 3;
    }
    unsigned char first = 0;
    if (dtoh(&first, d, 1)) return 2;
    printf("first %d %#x\n", k, first);
    for (size_t i = 0; i < bytes / 4; ++i)
      want[i] = (seed * 2654435761u) ^ (static_cast<uint32_t>(k) << 24) ^ static_cast<uint32_t>(i);
    if (htod(d, want, bytes)) return 2;
    if (argc == 5 && k == 1) {
      printf("holding\n");
      fflush(stdout);
      while (access(argv[4], F_OK) != 0) usleep(1000);
    }
    usleep(20000);
    if (dtoh(got, d, bytes)) return 2;
    for (size_t i = 0; i < bytes / 4; ++i)
      if (got[i] != want[i]) {
        printf("mismatch at iteration %d, word %zu: %#x, expected %#x\n", k, i, got[i], want[i]);
        return 1;
      }
    printf("verified %d\n", k);
    fflush(stdout);
    if (lane_free(d) != 0) return 2;
    step();
  }
  return 0;
}
