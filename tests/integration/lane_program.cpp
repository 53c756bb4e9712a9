// A CUDA program for the shared-lane tests: with libsalus-shim.so preloaded,
// SALUS_SHARED_LANE=1 (or alloc) and the mock driver it is an attached session
// that takes its ephemeral memory from the lane. For each of ITERS iterations
// it allocates MIB MiB (salus_lane_alloc, or with --malloc cuMemAlloc, which
// SALUS_SHARED_LANE=alloc serves from the lane), prints what the first byte
// held ("first K 0xNN": what the previous holder left, or zero when cleared),
// writes its own pattern, waits 20 ms (the other program would scribble over
// it now if the lane were not its alone), checks every byte, prints "verified
// K", frees it and comes to its boundary (salus_step). With HOLD_FILE it stops
// in iteration 1 after writing, prints "holding" and waits until the file
// exists (a test kills it there).
//
// --keep KMIB: in iteration 1, before the ephemeral block, it also allocates
// KMIB MiB with cuMemAlloc ("kept at ADDR in lane" when that was not charged,
// else "... charged") and keeps it to the end: in every iteration it
// checks that block's every byte (the previous iteration's pattern, across the
// boundary and whoever held the lane meanwhile) and writes a new pattern; at
// each boundary it prints "free K B" (cuMemGetInfo's free, i.e. the budget
// left: what promotion charged). At the end it frees the block and prints
// "free end B". Exit 0: every check passed; 1: a mismatch; 2: set-up failed;
// 3: no lane memory.
//
// --async: the iteration's block comes from cuMemAllocAsync on a stream of its
// own and goes with cuMemFreeAsync there (stream-ordered, as PyTorch's
// cudaMallocAsync backend frees); --pitch: from cuMemAllocPitch (rows of 4 KiB)
// and cuMemFree. Both imply --malloc's SALUS_SHARED_LANE=alloc path.
// --create: the block is a device cuMemCreate handle (PyTorch's expandable
// segments), which the lane does not serve: the test sizes it past the budget,
// so it exits 3 once the session's log has the shim's note (printed as
// "log: LINE"; or after 5 s); exit 4 if the handle was made after all.
//
// --segments: the block is made as PyTorch's expandable segments make theirs
// (cuMemCreate of device memory with a POSIX-fd handle type, cuMemMap at a
// reservation, cuMemSetAccess; cuMemUnmap and cuMemRelease to free it), which
// SALUS_SHARED_LANE=segments serves from the lane's room; with --keep the kept
// block is made so too. --spy (with --segments): iteration 1 exports its
// block's handle (POSIX fd) before freeing it, and after every boundary maps
// that memory through the fd and prints "spy K 0xNN", its first byte: the
// pattern while the shim keeps the memory for the program, 0 once it went back
// to the driver (cleared first).
//
// usage: lane_program [--malloc|--async|--pitch|--create|--segments [--spy]] [--keep KMIB]
//                     SEED MIB ITERS [HOLD_FILE]
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static uint32_t word(uint32_t seed, int k, size_t i) {
  return (seed * 2654435761u) ^ (static_cast<uint32_t>(k) << 24) ^ static_cast<uint32_t>(i);
}

struct Cuda {
  CUresult (*htod)(CUdeviceptr, const void*, size_t);
  CUresult (*dtoh)(void*, CUdeviceptr, size_t);
  CUresult (*alloc)(CUdeviceptr*, size_t);
  CUresult (*free)(CUdeviceptr);
  CUresult (*info)(size_t*, size_t*);
  CUresult (*alloc_async)(CUdeviceptr*, size_t, CUstream);
  CUresult (*free_async)(CUdeviceptr, CUstream);
  CUresult (*alloc_pitch)(CUdeviceptr*, size_t*, size_t, size_t, unsigned);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*addr_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*export_fd)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                        unsigned long long);
  CUresult (*import_fd)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
};
static Cuda cu;

// One block made as an expandable segment is: its own handle, mapped at a
// reservation of its own.
struct Segment {
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr va = 0;
  size_t bytes = 0;
};

static CUresult map_rw(CUdeviceptr va, size_t n, CUmemGenericAllocationHandle h) {
  if (CUresult r = cu.map(va, n, 0, h, 0)) return r;
  CUmemAccessDesc rw{};
  rw.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  rw.location.id = 0;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return cu.set_access(va, n, &rw, 1);
}

static CUresult segment_alloc(Segment& s, size_t n) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  s.bytes = n;
  if (CUresult r = cu.create(&s.handle, n, &prop, 0)) return r;
  if (CUresult r = cu.reserve(&s.va, n, 0, 0, 0)) return r;
  return map_rw(s.va, n, s.handle);
}

static CUresult segment_free(Segment& s) {
  if (CUresult r = cu.unmap(s.va, s.bytes)) return r;
  if (CUresult r = cu.release(s.handle)) return r;
  return cu.addr_free(s.va, s.bytes);
}

// The first byte of the memory behind an exported fd, through a mapping of its own.
static int spy_first(int fd, size_t n) {
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  unsigned char first = 0xff;
  if (cu.import_fd(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ||
      cu.reserve(&va, n, 0, 0, 0) || map_rw(va, n, h) || cu.dtoh(&first, va, 1))
    exit(2);
  if (cu.unmap(va, n) || cu.release(h) || cu.addr_free(va, n)) exit(2);
  return first;
}

// Checks that d holds pattern (seed, k) over n bytes. 0, or 1 after a message.
static int check(CUdeviceptr d, size_t n, uint32_t seed, int k, const char* what, int iter) {
  auto* got = static_cast<uint32_t*>(malloc(n));
  if (got == nullptr || cu.dtoh(got, d, n)) exit(2);
  for (size_t i = 0; i < n / 4; ++i)
    if (got[i] != word(seed, k, i)) {
      printf("mismatch in %s at iteration %d, word %zu: %#x, expected %#x\n", what, iter, i, got[i],
             word(seed, k, i));
      free(got);
      return 1;
    }
  free(got);
  return 0;
}

static void fill(CUdeviceptr d, size_t n, uint32_t seed, int k) {
  auto* want = static_cast<uint32_t*>(malloc(n));
  if (want == nullptr) exit(2);
  for (size_t i = 0; i < n / 4; ++i) want[i] = word(seed, k, i);
  if (cu.htod(d, want, n)) exit(2);
  free(want);
}

// Waits up to 5 s for `text` to appear in the session's log ($SALUS_SESSION/log)
// and prints the line that has it ("log: LINE").
static void wait_for_log(const char* text) {
  const char* dir = getenv("SALUS_SESSION");
  if (dir == nullptr) return;
  char path[4096];
  snprintf(path, sizeof path, "%s/log", dir);
  for (int i = 0; i < 500; ++i) {
    FILE* f = fopen(path, "r");
    char buf[8192];
    const size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    if (const char* at = strstr(buf, text)) {
      const char* begin = at;
      while (begin > buf && begin[-1] != '\n') --begin;
      const char* end = strchr(at, '\n');
      printf("log: %.*s\n", static_cast<int>(end ? end - begin : strlen(begin)), begin);
      return;
    }
    usleep(10000);
  }
}

static size_t budget_left() {
  size_t free = 0, total = 0;
  if (cu.info(&free, &total)) exit(2);
  return free;
}

int main(int argc, char** argv) {
  bool use_malloc = false, use_async = false, use_pitch = false, use_create = false;
  bool use_segments = false, spy = false;
  size_t keep = 0;
  int a = 1;
  for (; a < argc && argv[a][0] == '-'; ++a) {
    if (strcmp(argv[a], "--malloc") == 0) {
      use_malloc = true;
    } else if (strcmp(argv[a], "--async") == 0) {
      use_malloc = use_async = true;
    } else if (strcmp(argv[a], "--pitch") == 0) {
      use_malloc = use_pitch = true;
    } else if (strcmp(argv[a], "--create") == 0) {
      use_create = true;
    } else if (strcmp(argv[a], "--segments") == 0) {
      use_segments = true;
    } else if (strcmp(argv[a], "--spy") == 0) {
      spy = true;
    } else if (strcmp(argv[a], "--keep") == 0 && a + 1 < argc) {
      keep = static_cast<size_t>(atoi(argv[++a])) << 20;

    } else {
      return 2;
    }
  }
  argc -= a - 1;
  argv += a - 1;
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
  get("cuInit", init);
  get("cuDevicePrimaryCtxRetain", retain);
  get("cuCtxSetCurrent", set);
  get("cuMemcpyHtoD", cu.htod);
  get("cuMemcpyDtoH", cu.dtoh);
  get("cuMemAlloc", cu.alloc);  // the shim's hooks, through its cuGetProcAddress
  get("cuMemFree", cu.free);
  get("cuMemGetInfo", cu.info);
  get("cuMemAllocAsync", cu.alloc_async);
  get("cuMemFreeAsync", cu.free_async);
  get("cuMemAllocPitch", cu.alloc_pitch);
  get("cuStreamCreate", cu.stream_create);
  get("cuMemCreate", cu.create);
  get("cuMemRelease", cu.release);
  get("cuMemAddressReserve", cu.reserve);
  get("cuMemAddressFree", cu.addr_free);
  get("cuMemMap", cu.map);
  get("cuMemUnmap", cu.unmap);
  get("cuMemSetAccess", cu.set_access);
  get("cuMemExportToShareableHandle", cu.export_fd);
  get("cuMemImportFromShareableHandle", cu.import_fd);
  CUcontext ctx;
  if (init(0) || retain(&ctx, 0) || set(ctx)) return 2;
  CUstream stream = nullptr;
  if (use_async && cu.stream_create(&stream, CU_STREAM_NON_BLOCKING)) return 2;
  const uint32_t kseed = seed + 100;
  CUdeviceptr kept = 0;
  Segment kept_segment;
  int spy_fd = -1;
  if (keep > 0) {
    const size_t before = budget_left();
    if (use_segments ? segment_alloc(kept_segment, keep) != CUDA_SUCCESS
                     : cu.alloc(&kept, keep) != 0)
      return 2;
    if (use_segments) kept = kept_segment.va;
    fill(kept, keep, kseed, 0);
    // Not charged: the shim served it from the lane.
    printf("kept at %#llx %s\n", static_cast<unsigned long long>(kept),
           budget_left() == before ? "in lane" : "charged");
  }
  for (int k = 1; k <= iters; ++k) {
    if (keep > 0) {
      if (check(kept, keep, kseed, k - 1, "the kept block", k)) return 1;
      fill(kept, keep, kseed, k);
    }
    unsigned long long d = 0;
    int r = 0;
    size_t pitch = 0;
    Segment segment;
    if (use_segments) {
      r = segment_alloc(segment, bytes) ? -12 : 0;
      d = segment.va;
      if (r == 0 && spy && k == 1 &&
          cu.export_fd(&spy_fd, segment.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
        return 2;
    } else if (use_create) {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      CUmemGenericAllocationHandle h = 0;
      const CUresult made = cu.create(&h, bytes, &prop, 0);
      if (made == CUDA_SUCCESS) return 4;
      printf("cuMemCreate: %d\n", static_cast<int>(made));
      // The session (and its log) ends with this process: the note salusd
      // logged for the shim goes to stdout for the test.
      wait_for_log("cuMemCreate");
      r = -12;
    } else if (use_async)
      r = cu.alloc_async(&d, bytes, stream) ? -12 : 0;
    else if (use_pitch)
      r = cu.alloc_pitch(&d, &pitch, 4096, bytes / 4096, 4) || pitch != 4096 ? -12 : 0;
    else
      r = use_malloc ? (cu.alloc(&d, bytes) ? -12 : 0) : lane_alloc(&d, bytes);
    if (r != 0) {
      printf("no lane memory: %d\n", r);
      return 3;
    }
    unsigned char first = 0;
    if (cu.dtoh(&first, d, 1)) return 2;
    printf("first %d %#x\n", k, first);
    fill(d, bytes, seed, k);
    if (argc == 5 && k == 1) {
      printf("holding\n");
      fflush(stdout);
      while (access(argv[4], F_OK) != 0) usleep(1000);
    }
    usleep(20000);
    if (check(d, bytes, seed, k, "the iteration's block", k)) return 1;
    printf("verified %d\n", k);
    fflush(stdout);
    if (use_segments ? segment_free(segment) != CUDA_SUCCESS
        : use_async  ? cu.free_async(d, stream) != CUDA_SUCCESS
        : use_malloc ? cu.free(d) != CUDA_SUCCESS
                     : lane_free(d) != 0)
      return 2;
    step();
    if (keep > 0) printf("free %d %zu\n", k, budget_left());
    if (spy_fd >= 0) printf("spy %d %#x\n", k, spy_first(spy_fd, bytes));
  }
  if (keep > 0) {
    if (check(kept, keep, kseed, iters, "the kept block", iters + 1)) return 1;
    if (use_segments ? segment_free(kept_segment) != CUDA_SUCCESS : cu.free(kept) != 0) return 2;
    printf("free end %zu\n", budget_left());
  }
  return 0;
}
