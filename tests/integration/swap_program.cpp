// A CUDA program for the swap tests: it reaches the driver as programs do
// (dlopen libcuda.so.1, cuGetProcAddress_v2), so that with libsalus-shim.so
// preloaded, SALUS_SWAP=1 and the mock driver it is an attached session whose
// memory the shim can move. It allocates MIB MiB, fills it with a pattern,
// prints "ready", waits for the file GO, then for each of ITERS iterations:
// salus_step() (its boundary: salusd may swap it out while it waits there),
// checks every byte at the same pointer, prints "verified K", and writes a
// new pattern. Exit 0: every check passed; 1: a mismatch; 2: set-up failed.
//
// usage: swap_program MIB ITERS GO_FILE
//
// With SWAP_PROGRAM_BASELINE=1 it first times a plain pinned cuMemcpyDtoH and
// cuMemcpyHtoD of the same MIB (best of 3; what the shim's swap does per
// allocation) and prints "baseline dtoh_s=S htod_s=S" before "ready": the
// baseline of tools/swap-eval.sh.
//
// With SWAP_PROGRAM_UNMOVABLE_MIB=N it also makes a physical allocation of its
// own (cuMemCreate) of N MiB that it keeps to the end but never maps: charged,
// but not movable by the shim (memory_unswappable).
//
// With SWAP_PROGRAM_SEGMENT_MIB=N it also builds N MiB of memory of its own as
// PyTorch's expandable segments do (one reservation, 2 MiB cuMemCreate handles
// of the POSIX-fd type mapped one after another, access set over the range),
// filled and checked at every iteration like the cuMemAlloc memory;
// SWAP_PROGRAM_SEGMENT_PIECE_MIB sets the handles' size (default 2; PyTorch's
// large pool uses 20).
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

typedef CUresult (*gpa_t)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
static gpa_t gpa;
template <typename F>
static void get(const char* name, F& out) {
  void* p = nullptr;
  if (gpa(name, &p, 12000, 0, nullptr) != CUDA_SUCCESS || p == nullptr) {
    fprintf(stderr, "swap_program: no %s\n", name);
    exit(2);
  }
  out = reinterpret_cast<F>(p);
}

static void fill(uint32_t* h, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) h[i] = seed * 2654435761u + static_cast<uint32_t>(i);
}

// N MiB as an expandable segment: reserved once, mapped in 2 MiB handles.
static CUdeviceptr segment(size_t bytes) {
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  get("cuMemAddressReserve", reserve);
  get("cuMemCreate", create);
  get("cuMemMap", map);
  get("cuMemSetAccess", access);
  const char* piece_mib = getenv("SWAP_PROGRAM_SEGMENT_PIECE_MIB");
  const size_t piece = static_cast<size_t>(piece_mib != nullptr ? atoi(piece_mib) : 2) << 20;
  if (piece == 0 || bytes % piece != 0) exit(2);
  CUdeviceptr va = 0;
  if (reserve(&va, bytes, 0, 0, 0)) exit(2);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  for (size_t at = 0; at < bytes; at += piece) {
    CUmemGenericAllocationHandle h;
    if (create(&h, piece, &prop, 0) || map(va + at, piece, 0, h, 0)) exit(2);
  }
  CUmemAccessDesc rw{};
  rw.location = prop.location;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (access(va, bytes, &rw, 1)) exit(2);
  return va;
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const size_t bytes = static_cast<size_t>(atoi(argv[1])) << 20;
  const int iters = atoi(argv[2]);
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) return 2;
  gpa = reinterpret_cast<gpa_t>(dlsym(lib, "cuGetProcAddress_v2"));
  auto step = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "salus_step"));
  if (gpa == nullptr || step == nullptr) return 2;
  CUresult (*init)(unsigned);
  CUresult (*retain)(CUcontext*, CUdevice);
  CUresult (*set)(CUcontext);
  CUresult (*alloc)(CUdeviceptr*, size_t);
  CUresult (*htod)(CUdeviceptr, const void*, size_t);
  CUresult (*dtoh)(void*, CUdeviceptr, size_t);
  get("cuInit", init);
  get("cuDevicePrimaryCtxRetain", retain);
  get("cuCtxSetCurrent", set);
  get("cuMemAlloc", alloc);
  get("cuMemcpyHtoD", htod);
  get("cuMemcpyDtoH", dtoh);
  CUcontext ctx;
  CUdeviceptr d;
  if (init(0) || retain(&ctx, 0) || set(ctx) || alloc(&d, bytes)) return 2;
  if (const char* u = getenv("SWAP_PROGRAM_UNMOVABLE_MIB"); u != nullptr) {
    CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                       unsigned long long);
    get("cuMemCreate", create);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle own;
    if (create(&own, static_cast<size_t>(atoi(u)) << 20, &prop, 0)) return 2;
  }
  const char* seg_mib = getenv("SWAP_PROGRAM_SEGMENT_MIB");
  const size_t seg_bytes = seg_mib != nullptr ? static_cast<size_t>(atoi(seg_mib)) << 20 : 0;
  const CUdeviceptr seg = seg_bytes > 0 ? segment(seg_bytes) : 0;
  // The cuMemAlloc memory, then the segment, checked as one.
  const size_t total = bytes + seg_bytes;
  auto* want = static_cast<uint32_t*>(malloc(total));
  auto* got = static_cast<uint32_t*>(malloc(total));
  auto put = [&] {
    return htod(d, want, bytes) || (seg && htod(seg, want + bytes / 4, seg_bytes));
  };
  auto take = [&] { return dtoh(got, d, bytes) || (seg && dtoh(got + bytes / 4, seg, seg_bytes)); };
  fill(want, total / 4, 1);
  if (put()) return 2;
  if (const char* b = getenv("SWAP_PROGRAM_BASELINE"); b != nullptr && b[0] == '1') {
    CUresult (*host_alloc)(void**, size_t, unsigned);
    CUresult (*free_host)(void*);
    get("cuMemHostAlloc", host_alloc);
    get("cuMemFreeHost", free_host);
    void* pinned = nullptr;
    if (host_alloc(&pinned, bytes, 0)) return 2;
    double best_out = 1e30, best_in = 1e30;
    for (int i = 0; i < 3; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      if (dtoh(pinned, d, bytes)) return 2;
      auto t1 = std::chrono::steady_clock::now();
      if (htod(d, pinned, bytes)) return 2;
      auto t2 = std::chrono::steady_clock::now();
      best_out = std::min(best_out, std::chrono::duration<double>(t1 - t0).count());
      best_in = std::min(best_in, std::chrono::duration<double>(t2 - t1).count());
    }
    free_host(pinned);
    printf("baseline dtoh_s=%.6f htod_s=%.6f\n", best_out, best_in);
  }
  printf("ready %#llx\n", static_cast<unsigned long long>(d));
  fflush(stdout);
  while (access(argv[3], F_OK) != 0) usleep(1000);
  for (int k = 1; k <= iters; ++k) {
    step();
    if (take()) return 2;
    for (size_t i = 0; i < total / 4; ++i)
      if (got[i] != want[i]) {
        printf("mismatch at iteration %d, word %zu: %#x, expected %#x\n", k, i, got[i], want[i]);
        return 1;
      }
    printf("verified %d\n", k);
    fflush(stdout);
    fill(want, total / 4, static_cast<uint32_t>(k) + 1);
    if (put()) return 2;
  }
  return 0;
}
