// libsalus-shim against the mock driver (mock_libcuda.cpp), with no GPU.
//
// The program runs with the shim preloaded (tests/vgpu/cuda/meson.build), reaches the
// driver as real programs do (dlopen + dlsym, cuGetProcAddress v1 and v2), and
// plays salusd itself: its session's ctl is a FIFO, from which FakeSalusd reads
// the shim's `attach gate=FD bell=FD` line, takes both descriptors out of this
// process with pidfd_getfd exactly as salusd does, checks the seals, maps the
// gate and serves it (heartbeat, grants). Suites that need a fresh process
// (CpuOnly, Lifecycle, Yield) are run by meson one process each.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "client/salus_gate.h"

namespace {

using namespace std::chrono_literals;

// ---- the fake salusd ----

class FakeSalusd {
 public:
  explicit FakeSalusd(const std::string& root) : root_(root) {
    ::mkdir((root + "/sessions").c_str(), 0700);
    ::mkdir((root + "/sessions/s1").c_str(), 0700);
    ctl_ = root + "/sessions/s1/ctl";
    ::mkfifo(ctl_.c_str(), 0600);
    ::setenv("SALUS_MOUNT", root.c_str(), 1);
    ::setenv("SALUS_SESSION", "s1", 1);
    set_uptime(1000);
    server_ = std::thread([this] { serve(); });
  }
  ~FakeSalusd() {
    stop_ = true;
    // Unblock a reader still waiting for a writer.
    const int fd = ::open(ctl_.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
    server_.join();
    ::unlink(ctl_.c_str());
    ::unlink((root_ + "/stats").c_str());
    ::rmdir((root_ + "/sessions/s1").c_str());
    ::rmdir((root_ + "/sessions").c_str());
  }

  salus_gate* gate() { return gate_.load(); }
  // The `stats` file's uptime_s, by which the shim tells a restart.
  void set_uptime(double s) {
    FILE* f = std::fopen((root_ + "/stats").c_str(), "w");
    std::fprintf(f, "version 0.1.0\nuptime_s %.3f\ngpus 1\n", s);  // as salusd writes it
    std::fclose(f);
  }
  const std::string& ctl() const { return ctl_; }
  int attaches() const { return attaches_.load(); }
  std::uint64_t bells() const { return bells_.load(); }
  std::atomic<bool> auto_grant{true};
  std::atomic<bool> heartbeat{true};
  std::uint64_t budget = UINT64_MAX;  // given at the next attach

  void grant(std::uint64_t k) {
    salus_gate* g = gate();
    __atomic_store_n(&g->granted, k, __ATOMIC_RELEASE);
    wake(g);
  }
  void set_state(std::uint32_t s) {
    salus_gate* g = gate();
    __atomic_store_n(&g->state, s, __ATOMIC_RELEASE);
    wake(g);
  }

 private:
  static void wake(salus_gate* g) {
    __atomic_fetch_add(&g->grant_word, 1, __ATOMIC_RELEASE);
    ::syscall(SYS_futex, &g->grant_word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }

  // Takes the gate as salusd does; fails the test on anything salusd refuses.
  void take(const std::string& line) {
    int gfd = -1, bfd = -1;
    ASSERT_EQ(std::sscanf(line.c_str(), "attach gate=%d bell=%d", &gfd, &bfd), 2) << line;
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
    ASSERT_GE(pidfd, 0) << std::strerror(errno);
    const int g = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, gfd, 0));
    const int b = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, bfd, 0));
    ::close(pidfd);
    ASSERT_GE(g, 0) << std::strerror(errno);
    ASSERT_GE(b, 0) << std::strerror(errno);
    EXPECT_EQ(::fcntl(g, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    struct stat st {};
    ASSERT_EQ(::fstat(g, &st), 0);
    ASSERT_EQ(st.st_size, static_cast<off_t>(sizeof(salus_gate)));
    void* p = ::mmap(nullptr, sizeof(salus_gate), PROT_READ | PROT_WRITE, MAP_SHARED, g, 0);
    ASSERT_NE(p, MAP_FAILED);
    ::close(g);
    auto* gate = static_cast<salus_gate*>(p);
    EXPECT_EQ(gate->magic, SALUS_GATE_MAGIC);
    EXPECT_EQ(gate->version, SALUS_GATE_VERSION);
    EXPECT_EQ(gate->size, sizeof(salus_gate));
    EXPECT_EQ(gate->pid, ::getpid());
    EXPECT_EQ(gate->state, SALUS_GATE_ATTACHING);
    EXPECT_EQ(gate->requested, 1u);
    gate->budget_bytes = budget;
    bell_ = b;
    gate_.store(gate);  // the old gate stays mapped: the test may still read it
    attaches_.fetch_add(1);
    set_state(SALUS_GATE_ATTACHED);
  }

  void serve() {
    while (!stop_) {
      const int fd = ::open(ctl_.c_str(), O_RDONLY);
      if (fd < 0) {  // a test moved the session away for a while
        std::this_thread::sleep_for(10ms);
        continue;
      }
      char buf[256];
      const ssize_t n = ::read(fd, buf, sizeof buf - 1);
      ::close(fd);
      if (n > 0 && !stop_) {
        buf[n] = '\0';
        take(buf);
        run_gate();
      }
    }
  }

  // Heartbeat, bell counting and (when auto_grant) granting what is requested,
  // until the test detaches the gate or stops.
  void run_gate() {
    salus_gate* g = gate();
    while (!stop_ && __atomic_load_n(&g->state, __ATOMIC_ACQUIRE) == SALUS_GATE_ATTACHED) {
      struct pollfd pfd {
        bell_, POLLIN, 0
      };
      if (::poll(&pfd, 1, 20) == 1) {
        std::uint64_t v = 0;
        if (::read(bell_, &v, sizeof v) == sizeof v) bells_.fetch_add(v);
      }
      if (heartbeat) __atomic_fetch_add(&g->heartbeat, 1, __ATOMIC_RELEASE);
      const std::uint64_t want = __atomic_load_n(&g->requested, __ATOMIC_ACQUIRE);
      if (auto_grant && __atomic_load_n(&g->granted, __ATOMIC_ACQUIRE) < want) {
        __atomic_store_n(&g->yield_requested, 0u,
                         __ATOMIC_RELEASE);  // as salusd: a grant ends the slice request
        grant(want);
      }
    }
    ::close(bell_);
  }

  std::string root_, ctl_;
  std::thread server_;
  std::atomic<bool> stop_{false};
  std::atomic<salus_gate*> gate_{nullptr};
  std::atomic<int> attaches_{0};
  std::atomic<std::uint64_t> bells_{0};
  int bell_ = -1;
};

FakeSalusd* salusd = nullptr;

// ---- the driver, as a program reaches it ----

struct Cuda {
  void* lib = nullptr;
  PFN_cuGetProcAddress_v12000 gpa = nullptr;
  template <typename F>
  F get(const char* name, int version = 12000, cuuint64_t flags = 0) {
    void* p = nullptr;
    if (gpa(name, &p, version, flags, nullptr) != CUDA_SUCCESS) return nullptr;
    return reinterpret_cast<F>(p);
  }
};
Cuda& cuda() {
  static Cuda c = [] {
    Cuda r;
    r.lib = ::dlopen("libcuda.so.1", RTLD_NOW);
    r.gpa = reinterpret_cast<PFN_cuGetProcAddress_v12000>(::dlsym(r.lib, "cuGetProcAddress_v2"));
    return r;
  }();
  return c;
}

const char* object_of(const void* p) {
  Dl_info info{};
  if (p == nullptr || ::dladdr(p, &info) == 0 || info.dli_fname == nullptr) return "?";
  return info.dli_fname;
}
bool in_shim(const void* p) {
  return std::strstr(object_of(p), "libsalus-shim") != nullptr;
}

const char kPtx[] =
    ".version 8.0\n.target sm_80\n.entry salus_spin ( .param .u64 cycles ) { ret; }\n";

// Driver set-up of every CUDA test: cuInit (the shim attaches here), the
// primary context current, and the spin kernel.
struct Gpu {
  CUfunction spin = nullptr;
  PFN_cuLaunchKernel_v4000 launch = nullptr;
};
Gpu& gpu() {
  static Gpu g = [] {
    Gpu r;
    Cuda& c = cuda();
    EXPECT_EQ(c.get<PFN_cuInit_v2000>("cuInit")(0), CUDA_SUCCESS);
    CUcontext ctx = nullptr;
    EXPECT_EQ(c.get<PFN_cuDevicePrimaryCtxRetain_v7000>("cuDevicePrimaryCtxRetain")(&ctx, 0),
              CUDA_SUCCESS);
    EXPECT_EQ(c.get<PFN_cuCtxSetCurrent_v4000>("cuCtxSetCurrent")(ctx), CUDA_SUCCESS);
    CUmodule mod = nullptr;
    EXPECT_EQ(
        c.get<PFN_cuModuleLoadDataEx_v2010>("cuModuleLoadDataEx")(&mod, kPtx, 0, nullptr, nullptr),
        CUDA_SUCCESS);
    EXPECT_EQ(
        c.get<PFN_cuModuleGetFunction_v2000>("cuModuleGetFunction")(&r.spin, mod, "salus_spin"),
        CUDA_SUCCESS);
    r.launch = c.get<PFN_cuLaunchKernel_v4000>("cuLaunchKernel");
    return r;
  }();
  return g;
}
void bind_context() {  // on a new thread
  CUcontext ctx = nullptr;
  cuda().get<PFN_cuDevicePrimaryCtxRetain_v7000>("cuDevicePrimaryCtxRetain")(&ctx, 0);
  cuda().get<PFN_cuCtxSetCurrent_v4000>("cuCtxSetCurrent")(ctx);
}
CUresult spin(std::chrono::microseconds d, CUstream s = nullptr) {
  unsigned long long cycles = static_cast<unsigned long long>(d.count()) * 1000;
  void* params[] = {&cycles};
  return gpu().launch(gpu().spin, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr);
}

std::uint64_t load(const std::uint64_t& v) {
  return __atomic_load_n(&v, __ATOMIC_ACQUIRE);
}
std::uint32_t load32(const std::uint32_t& v) {
  return __atomic_load_n(&v, __ATOMIC_ACQUIRE);
}
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// The shim's own API, as a program (or ctypes) finds it.
using StepFn = int (*)();
StepFn salus_step_fn() {
  return reinterpret_cast<StepFn>(::dlsym(RTLD_DEFAULT, "salus_step"));
}
int shim_step() {
  return salus_step_fn()();
}
int shim_attached() {
  return reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "salus_attached"))();
}
std::uint64_t shim_iterations() {
  return reinterpret_cast<std::uint64_t (*)()>(::dlsym(RTLD_DEFAULT, "salus_iterations"))();
}

constexpr std::uint64_t kMiB = 1 << 20;

// ---- reaching the driver ----

TEST(Interpose, DlsymOnLibcudaHandsOutTheHooks) {
  Cuda& c = cuda();
  ASSERT_NE(c.lib, nullptr) << ::dlerror();
  void* alloc = ::dlsym(c.lib, "cuMemAlloc_v2");
  EXPECT_TRUE(in_shim(alloc)) << object_of(alloc);
  EXPECT_EQ(alloc, ::dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));
  EXPECT_TRUE(in_shim(::dlsym(c.lib, "cuLaunchKernel")));
  EXPECT_TRUE(in_shim(::dlsym(c.lib, "cuGetProcAddress")));
  EXPECT_TRUE(in_shim(reinterpret_cast<void*>(c.gpa)));
  // An unknown name still fails as glibc says.
  EXPECT_EQ(::dlsym(c.lib, "cuNoSuchFunction"), nullptr);
  EXPECT_NE(::dlerror(), nullptr);
}

TEST(Interpose, DlsymExistsInBothGlibcVersionsAndKeepsTheCallersRtldNext) {
  for (const char* v : {"GLIBC_2.2.5", "GLIBC_2.34"}) {
    void* p = ::dlvsym(RTLD_DEFAULT, "dlsym", v);
    EXPECT_TRUE(in_shim(p)) << v << ": " << object_of(p);
  }
  // RTLD_NEXT is relative to the caller (this program), whose next object is
  // the shim: only a dlsym that reaches glibc with our return address finds it.
  EXPECT_TRUE(in_shim(::dlsym(RTLD_NEXT, "salus_iterations")));
  EXPECT_EQ(::dlsym(RTLD_NEXT, "malloc"), ::dlvsym(RTLD_NEXT, "malloc", "GLIBC_2.2.5"));
}

TEST(Interpose, GetProcAddressHonoursTheRequestedVersion) {
  Cuda& c = cuda();
  // cuGetProcAddress itself: 11030 is the 4-argument v1, 12000 the v2.
  void* v1 = nullptr;
  void* v2 = nullptr;
  ASSERT_EQ(c.gpa("cuGetProcAddress", &v1, 11030, 0, nullptr), CUDA_SUCCESS);
  ASSERT_EQ(c.gpa("cuGetProcAddress", &v2, 12000, 0, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(v1, ::dlsym(RTLD_DEFAULT, "cuGetProcAddress"));
  EXPECT_EQ(v2, ::dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  EXPECT_NE(v1, v2);
  // The v1 hook answers with hooks too.
  void* alloc = nullptr;
  ASSERT_EQ(reinterpret_cast<PFN_cuGetProcAddress_v11030>(v1)("cuMemAlloc", &alloc, 12000, 0),
            CUDA_SUCCESS);
  EXPECT_EQ(alloc, ::dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));

  // cuMemGetInfo at 3000 is the 32-bit v1: handed out untouched, never the
  // size_t hook (which would write past these unsigneds).
  using MemGetInfoV1 = CUresult (*)(unsigned*, unsigned*);
  auto info_v1 = c.get<MemGetInfoV1>("cuMemGetInfo", 3000);
  ASSERT_NE(info_v1, nullptr);
  EXPECT_FALSE(in_shim(reinterpret_cast<void*>(info_v1)));
  gpu();
  struct {
    unsigned free, total, guard;
  } v{0, 0, 0xfeedu};
  ASSERT_EQ(info_v1(&v.free, &v.total), CUDA_SUCCESS);
  EXPECT_EQ(v.guard, 0xfeedu);
  EXPECT_TRUE(in_shim(reinterpret_cast<void*>(c.get<void*>("cuMemGetInfo", 12000))));

  // Per-thread default stream: the _ptsz hook.
  EXPECT_EQ(reinterpret_cast<void*>(c.get<void*>("cuLaunchKernel", 12000,
                                                 CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)),
            ::dlsym(RTLD_DEFAULT, "cuLaunchKernel_ptsz"));
  // A version newer than the shim knows, answered with a function libcuda does
  // not export under the hook's name: passed through rather than guessed at.
  EXPECT_FALSE(in_shim(reinterpret_cast<void*>(c.get<void*>("cuMemAllocAsync", 13010))));
  EXPECT_TRUE(in_shim(reinterpret_cast<void*>(c.get<void*>("cuMemAllocAsync", 12000))));
  // Not found stays not found.
  void* none = reinterpret_cast<void*>(1);
  EXPECT_EQ(c.gpa("cuNoSuchFunction", &none, 12000, 0, nullptr), CUDA_ERROR_NOT_FOUND);
  EXPECT_EQ(none, nullptr);
}

// ---- memory ----

TEST(Memory, AttachesAtCuInitAndChargesEveryPath) {
  gpu();
  ASSERT_NE(salusd->gate(), nullptr);
  salus_gate* g = salusd->gate();
  EXPECT_EQ(g->budget_bytes, 64 * kMiB);
  Cuda& c = cuda();
  // Through dlsym, as a program linked by name would.
  auto alloc = reinterpret_cast<PFN_cuMemAlloc_v3020>(::dlsym(c.lib, "cuMemAlloc_v2"));
  auto free_ = reinterpret_cast<PFN_cuMemFree_v3020>(::dlsym(c.lib, "cuMemFree_v2"));
  const std::uint64_t base = load(g->charged_bytes);
  CUdeviceptr a = 0;
  ASSERT_EQ(alloc(&a, 4 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base + 4 * kMiB);
  // Pitch: pitch * height, the driver's padding included.
  CUdeviceptr b = 0;
  std::size_t pitch = 0;
  ASSERT_EQ(c.get<PFN_cuMemAllocPitch_v3020>("cuMemAllocPitch")(&b, &pitch, 1000, 100, 4),
            CUDA_SUCCESS);
  EXPECT_EQ(pitch, 1024u);
  EXPECT_EQ(load(g->charged_bytes), base + 4 * kMiB + 1024 * 100);
  // Stream-ordered, from the default and from a given pool.
  CUstream s = nullptr;
  ASSERT_EQ(c.get<PFN_cuStreamCreate_v2000>("cuStreamCreate")(&s, CU_STREAM_NON_BLOCKING),
            CUDA_SUCCESS);
  CUdeviceptr d = 0, e = 0;
  ASSERT_EQ(c.get<PFN_cuMemAllocAsync_v11020>("cuMemAllocAsync")(&d, kMiB, s), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemAllocFromPoolAsync_v11020>("cuMemAllocFromPoolAsync")(
                &e, 2 * kMiB, reinterpret_cast<CUmemoryPool>(1), s),
            CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base + 7 * kMiB + 1024 * 100);
  ASSERT_EQ(c.get<PFN_cuMemFreeAsync_v11020>("cuMemFreeAsync")(d, s), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemFreeAsync_v11020>("cuMemFreeAsync")(e, s), CUDA_SUCCESS);
  ASSERT_EQ(free_(a), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemFree_v3020>("cuMemFree")(b), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base);
  EXPECT_GE(load(g->peak_bytes), base + 7 * kMiB + 1024 * 100);
  c.get<PFN_cuStreamSynchronize_v2000>("cuStreamSynchronize")(s);
}

TEST(Memory, VmmHandlesAreChargedUntilReleasedAndUnmapped) {
  gpu();
  salus_gate* g = salusd->gate();
  Cuda& c = cuda();
  const std::uint64_t base = load(g->charged_bytes);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemGenericAllocationHandle h{};
  ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&h, 2 * kMiB, &prop, 0), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base + 2 * kMiB);
  CUdeviceptr va = 0;
  ASSERT_EQ(c.get<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve")(&va, 2 * kMiB, 0, 0, 0),
            CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemMap_v10020>("cuMemMap")(va, 2 * kMiB, 0, h, 0), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(h), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base + 2 * kMiB) << "still mapped: the driver keeps it";
  ASSERT_EQ(c.get<PFN_cuMemUnmap_v10020>("cuMemUnmap")(va, 2 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base);
}

// What shared lanes need of the driver (docs/design.md, *Movable memory of
// attached sessions*): a physical allocation exported as a POSIX fd is the same
// memory wherever it is imported and mapped, also in another process.
TEST(Memory, VmmHandlesExportAsFdsThatAnotherProcessMaps) {
  gpu();
  Cuda& c = cuda();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h{}, h2{};
  ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&h, 2 * kMiB, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr va = 0, va2 = 0;
  auto reserve = c.get<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
  ASSERT_EQ(reserve(&va, 2 * kMiB, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(reserve(&va2, 2 * kMiB, 0, 0, 0), CUDA_SUCCESS);
  auto map = c.get<PFN_cuMemMap_v10020>("cuMemMap");
  auto access = c.get<PFN_cuMemSetAccess_v10020>("cuMemSetAccess");
  CUmemAccessDesc rw{};
  rw.location = prop.location;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(map(va, 2 * kMiB, 0, h, 0), CUDA_SUCCESS);
  ASSERT_EQ(access(va, 2 * kMiB, &rw, 1), CUDA_SUCCESS);
  const std::uint32_t word = 0x5a1a5a1au;
  ASSERT_EQ(c.get<PFN_cuMemsetD32Async_v3020>("cuMemsetD32Async")(va, word, 2 * kMiB / 4, nullptr),
            CUDA_SUCCESS);
  c.get<PFN_cuCtxSynchronize_v2000>("cuCtxSynchronize")();
  int fd = -1;
  ASSERT_EQ(c.get<PFN_cuMemExportToShareableHandle_v10020>("cuMemExportToShareableHandle")(
                &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_SUCCESS);
  ASSERT_GE(fd, 0);
  // Imported here and mapped at a second address: the same bytes.
  ASSERT_EQ(c.get<PFN_cuMemImportFromShareableHandle_v10020>("cuMemImportFromShareableHandle")(
                &h2, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_SUCCESS);
  ASSERT_EQ(map(va2, 2 * kMiB, 0, h2, 0), CUDA_SUCCESS);
  ASSERT_EQ(access(va2, 2 * kMiB, &rw, 1), CUDA_SUCCESS);
  std::uint32_t got = 0;
  auto dtoh = c.get<PFN_cuMemcpyDtoH_v3020>("cuMemcpyDtoH");
  ASSERT_EQ(dtoh(&got, va2 + kMiB, 4), CUDA_SUCCESS);
  EXPECT_EQ(got, word);
  // Another process with only the fd sees them and writes back.
  const pid_t child = ::fork();
  if (child == 0) {
    void* p = ::mmap(nullptr, 2 * kMiB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED || static_cast<std::uint32_t*>(p)[7] != word) ::_exit(1);
    static_cast<std::uint32_t*>(p)[7] = 0xc0ffee;
    ::_exit(0);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(child, &st, 0), child);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ASSERT_EQ(dtoh(&got, va + 7 * 4, 4), CUDA_SUCCESS);
  EXPECT_EQ(got, 0xc0ffeeu);
  // A handle made without the POSIX fd type cannot be exported.
  CUmemAllocationProp plain = prop;
  plain.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  CUmemGenericAllocationHandle h3{};
  ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&h3, 2 * kMiB, &plain, 0), CUDA_SUCCESS);
  int fd3 = -1;
  EXPECT_EQ(c.get<PFN_cuMemExportToShareableHandle_v10020>("cuMemExportToShareableHandle")(
                &fd3, h3, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_ERROR_INVALID_VALUE);
  auto unmap = c.get<PFN_cuMemUnmap_v10020>("cuMemUnmap");
  auto release = c.get<PFN_cuMemRelease_v10020>("cuMemRelease");
  auto addr_free = c.get<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
  EXPECT_EQ(unmap(va, 2 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(unmap(va2, 2 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(release(h), CUDA_SUCCESS);
  EXPECT_EQ(release(h2), CUDA_SUCCESS);
  EXPECT_EQ(release(h3), CUDA_SUCCESS);
  EXPECT_EQ(addr_free(va, 2 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(addr_free(va2, 2 * kMiB), CUDA_SUCCESS);
  ::close(fd);
}

TEST(Memory, PastTheBudgetIsOutOfMemoryWithANote) {
  gpu();
  salus_gate* g = salusd->gate();
  Cuda& c = cuda();
  auto alloc = c.get<PFN_cuMemAlloc_v3020>("cuMemAlloc");
  const std::uint64_t base = load(g->charged_bytes);
  CUdeviceptr a = 0, b = 0;
  ASSERT_EQ(alloc(&a, 40 * kMiB), CUDA_SUCCESS);
  const std::uint64_t refusals = load(g->oom_refusals);
  const std::uint32_t seq = __atomic_load_n(&g->note_seq, __ATOMIC_ACQUIRE);
  const std::uint64_t bells = salusd->bells();
  EXPECT_EQ(alloc(&b, 30 * kMiB), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(load(g->oom_refusals), refusals + 1);
  EXPECT_EQ(__atomic_load_n(&g->note_seq, __ATOMIC_ACQUIRE), seq + 1);
  const std::string want = "out of memory: budget " + std::to_string(64 * kMiB) + ", charged " +
                           std::to_string(base + 40 * kMiB) + ", request " +
                           std::to_string(30 * kMiB);
  EXPECT_EQ(std::string(g->note).rfind(want, 0), 0u) << g->note;
  EXPECT_TRUE(eventually([&] { return salusd->bells() > bells; }));
  // cuMemGetInfo: the budget is the card.
  std::size_t free = 0, total = 0;
  ASSERT_EQ(c.get<PFN_cuMemGetInfo_v3020>("cuMemGetInfo")(&free, &total), CUDA_SUCCESS);
  EXPECT_EQ(total, 64 * kMiB);
  EXPECT_EQ(free, 64 * kMiB - base - 40 * kMiB);
  // Pitch and VMM are held to it too; managed memory is refused outright.
  std::size_t pitch = 0;
  EXPECT_EQ(c.get<PFN_cuMemAllocPitch_v3020>("cuMemAllocPitch")(&b, &pitch, 1 << 20, 30, 4),
            CUDA_ERROR_OUT_OF_MEMORY);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h{};
  EXPECT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&h, 30 * kMiB, &prop, 0),
            CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(c.get<PFN_cuMemAllocManaged_v6000>("cuMemAllocManaged")(&b, kMiB, 1),
            CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(g->note).find("cuMemAllocManaged"), std::string::npos) << g->note;
  EXPECT_EQ(load(g->charged_bytes), base + 40 * kMiB);
  ASSERT_EQ(c.get<PFN_cuMemFree_v3020>("cuMemFree")(a), CUDA_SUCCESS);
  ASSERT_EQ(alloc(&b, 30 * kMiB), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemFree_v3020>("cuMemFree")(b), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base);
}

// The driver out of memory for an allocation the budget allows: the card is
// still freeing what admission promised (salusd giving back its arena, an
// exited program torn down), so the shim tries again for a moment (1 s by
// default) and says so, instead of failing the program at once.
// The mock's card has no memory while this file exists (cuMemAlloc and
// cuMemCreate); gone, with the variables, however the test ends.
struct NoMemoryFile {
  char path[32] = "/tmp/salus-no-alloc-XXXXXX";
  NoMemoryFile() {
    const int fd = ::mkstemp(path);
    if (fd >= 0) ::close(fd);
    ::setenv("SALUS_MOCK_NO_ALLOC_FILE", path, 1);
    ::setenv("SALUS_MOCK_NO_MEMORY_FILE", path, 1);
  }
  ~NoMemoryFile() {
    ::unlink(path);
    ::unsetenv("SALUS_MOCK_NO_ALLOC_FILE");
    ::unsetenv("SALUS_MOCK_NO_MEMORY_FILE");
  }
  bool make() { return ::close(::open(path, O_CREAT | O_WRONLY, 0600)) == 0; }
  // The card frees its memory `after` from now.
  std::thread free_after(std::chrono::milliseconds after) {
    return std::thread([this, after] {
      std::this_thread::sleep_for(after);
      ::unlink(path);
    });
  }
};

TEST(Memory, ADriverOutOfMemoryWithinTheBudgetIsTriedAgainForAMoment) {
  gpu();
  salus_gate* g = salusd->gate();
  ASSERT_NE(load(g->budget_bytes), UINT64_MAX);
  Cuda& c = cuda();
  auto alloc = c.get<PFN_cuMemAlloc_v3020>("cuMemAlloc");
  auto free_ = c.get<PFN_cuMemFree_v3020>("cuMemFree");
  const std::uint64_t base = load(g->charged_bytes);
  const std::uint64_t refusals = load(g->oom_refusals);
  NoMemoryFile card;
  std::thread freer = card.free_after(150ms);
  auto t0 = std::chrono::steady_clock::now();
  CUdeviceptr a = 0;
  const CUresult ra = alloc(&a, kMiB);
  freer.join();
  ASSERT_EQ(ra, CUDA_SUCCESS);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 150ms);
  EXPECT_NE(std::strstr(g->note,
                        "cuMemAlloc of 1048576 bytes: the driver had no memory for it "
                        "within the budget; it had after"),
            nullptr)
      << g->note;
  EXPECT_EQ(load(g->charged_bytes), base + kMiB);
  // cuMemCreate the same.
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h{};
  ASSERT_TRUE(card.make());
  freer = card.free_after(100ms);
  const CUresult rh = c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&h, 2 * kMiB, &prop, 0);
  freer.join();
  if (rh == CUDA_SUCCESS) {
    EXPECT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(h), CUDA_SUCCESS);
  }
  EXPECT_EQ(rh, CUDA_SUCCESS);
  EXPECT_NE(std::strstr(g->note, "cuMemCreate of 2097152 bytes"), nullptr) << g->note;
  // Memory that never comes: out of memory after the window, nothing charged,
  // and not a refusal of the budget's.
  ASSERT_TRUE(card.make());
  t0 = std::chrono::steady_clock::now();
  CUdeviceptr b = 0;
  EXPECT_EQ(alloc(&b, kMiB), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 1000ms);
  EXPECT_NE(std::strstr(g->note, "out of memory from the driver although the budget allows it"),
            nullptr)
      << g->note;
  EXPECT_EQ(load(g->charged_bytes), base + kMiB);
  EXPECT_EQ(load(g->oom_refusals), refusals);
  ASSERT_EQ(free_(a), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base);
}

TEST(Memory, ThreadsAllocatingAndLaunchingAgree) {
  gpu();
  salus_gate* g = salusd->gate();
  const std::uint64_t base = load(g->charged_bytes), launches = load(g->launches);
  constexpr int kThreads = 4, kRounds = 300;
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&] {
      bind_context();
      auto alloc = cuda().get<PFN_cuMemAlloc_v3020>("cuMemAlloc");
      auto free_ = cuda().get<PFN_cuMemFree_v3020>("cuMemFree");
      for (int i = 0; i < kRounds; ++i) {
        CUdeviceptr p = 0;
        if (alloc(&p, 4096 * (i % 7 + 1)) != CUDA_SUCCESS) ++failures;
        if (spin(0us) != CUDA_SUCCESS) ++failures;
        if (free_(p) != CUDA_SUCCESS) ++failures;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(load(g->charged_bytes), base);
  EXPECT_EQ(load(g->launches), launches + kThreads * kRounds);
}

// ---- the gate ----

TEST(Gate, StepWaitsForTheGrantAndReportsGpuTime) {
  gpu();
  salus_gate* g = salusd->gate();
  StepFn step = salus_step_fn();
  ASSERT_NE(step, nullptr);
  salusd->auto_grant = false;
  ASSERT_TRUE(eventually([&] { return load(g->granted) >= load(g->requested); }));
  const std::uint64_t k = load(g->requested);  // the iteration running now
  const std::uint64_t waits = load(g->gate_waits), bells = salusd->bells();
  const std::uint64_t iters = shim_iterations();
  // Boundary k ends iteration k and needs the grant of k + 1.
  ASSERT_EQ(spin(20ms), CUDA_SUCCESS);
  std::atomic<int> rc{1};
  std::thread t([&] {
    bind_context();
    rc = step();
  });
  ASSERT_TRUE(eventually([&] { return load(g->requested) == k + 1; }));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(rc, 1) << "salus_step returned without a grant";
  EXPECT_GT(salusd->bells(), bells);
  salusd->grant(k + 1);
  t.join();
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(load(g->gate_waits), waits + 1);
  EXPECT_GE(load(g->gate_wait_ns), 100'000'000u);
  EXPECT_TRUE(eventually([&] { return load(g->completed) == k; }));
  // Granted ahead: the next boundary does not wait. Its iteration's GPU time
  // comes from the two boundary events around a 20 ms kernel.
  salusd->grant(k + 2);
  const std::uint64_t gpu_ns = load(g->gpu_ns_total);
  ASSERT_EQ(spin(20ms), CUDA_SUCCESS);
  ASSERT_EQ(step(), 0);
  EXPECT_EQ(load(g->gate_waits), waits + 1);
  EXPECT_TRUE(eventually([&] { return load(g->completed) == k + 1; }));
  EXPECT_GE(load(g->gpu_ns_total) - gpu_ns, 15'000'000u);
  EXPECT_LT(load(g->gpu_ns_total) - gpu_ns, 2'000'000'000u);
  EXPECT_EQ(shim_iterations(), iters + 2);
  EXPECT_EQ(g->marking, SALUS_MARK_EXPLICIT);
  EXPECT_EQ(shim_attached(), 1);
  salusd->auto_grant = true;
}

// The gate's round trip as the program sees it: boundary, doorbell, the fake
// salusd's poll wakes and grants, futex wake, salus_step returns. Printed for
// docs/benchmarks.md; the bound only catches a broken wake-up (a lost wake
// would cost the 100 ms futex timeout).
void round_trip(const char* what) {
  salus_gate* g = salusd->gate();
  ASSERT_NE(g, nullptr);
  ASSERT_TRUE(salusd->auto_grant);
  constexpr int kSteps = 2000;
  std::vector<double> us;
  for (int i = 0; i < kSteps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(shim_step(), 0);
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  const double p50 = us[kSteps / 2], p99 = us[kSteps * 99 / 100];
  std::printf("gate round trip (%s): p50 %.1f us, p99 %.1f us over %d boundaries\n", what, p50, p99,
              kSteps);
  EXPECT_LT(p50, 20'000.0);
}

TEST(Gate, RoundTrip) {
  gpu();
  round_trip("with CUDA: an event per boundary");
}

// ---- suites that run in a process of their own ----

TEST(CpuOnly, AMissingSessionLeavesTheProgramUngatedAndIsTriedAgain) {
  ::setenv("SALUS_SESSION", "no-such-session", 1);
  EXPECT_EQ(shim_step(), -ENOTCONN);
  EXPECT_EQ(shim_step(), -ENOTCONN);
  EXPECT_EQ(shim_iterations(), 2u);
  EXPECT_EQ(shim_attached(), 0);
  EXPECT_EQ(salusd->attaches(), 0);
  // SALUS_SESSION as `salusctl run` sets it: the session's path.
  ::setenv("SALUS_SESSION", (std::string(::getenv("SALUS_MOUNT")) + "/sessions/s1").c_str(), 1);
  std::this_thread::sleep_for(1100ms);  // attach is tried again at most once a second
}

TEST(CpuOnly, StepAttachesAndTimesIterationsByWallClock) {
  // No cuInit in this process: a salus_step attaches.
  EXPECT_EQ(shim_attached(), 0);
  const std::uint64_t iters = shim_iterations();
  ASSERT_EQ(shim_step(), 0);
  ASSERT_EQ(salusd->attaches(), 1);
  salus_gate* g = salusd->gate();
  EXPECT_EQ(shim_attached(), 1);
  std::this_thread::sleep_for(30ms);
  ASSERT_EQ(shim_step(), 0);
  EXPECT_TRUE(eventually([&] { return load(g->completed) == 1; }));
  EXPECT_GE(load(g->gpu_ns_total), 30'000'000u);
  EXPECT_EQ(load(g->requested), 2u);
  EXPECT_EQ(shim_iterations(), iters + 2);
  EXPECT_EQ(::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), nullptr)
      << "a CPU-only program had libcuda loaded";
  round_trip("CPU only");
}

TEST(Lifecycle, DetachedRunsUngatedThenReattaches) {
  gpu();
  salus_gate* g = salusd->gate();
  ASSERT_EQ(shim_step(), 0);
  CUdeviceptr p = 0;
  ASSERT_EQ(cuda().get<PFN_cuMemAlloc_v3020>("cuMemAlloc")(&p, 3 * kMiB), CUDA_SUCCESS);
  const std::uint64_t launches = load(g->launches);
  salusd->set_state(SALUS_GATE_DETACHED);
  EXPECT_EQ(shim_step(), -ENOTCONN);
  EXPECT_EQ(shim_attached(), 0);
  ASSERT_EQ(spin(0us), CUDA_SUCCESS);  // ungated, still counted (privately)
  EXPECT_EQ(shim_step(), -ENOTCONN) << "re-attach is tried at most once a second";
  EXPECT_EQ(salusd->attaches(), 1);
  std::this_thread::sleep_for(1100ms);
  ASSERT_EQ(shim_step(), 0);
  EXPECT_EQ(salusd->attaches(), 2);
  salus_gate* g2 = salusd->gate();
  ASSERT_NE(g2, g);
  EXPECT_EQ(shim_attached(), 1);
  EXPECT_EQ(load(g2->charged_bytes), load(g->charged_bytes));
  EXPECT_GE(load(g2->charged_bytes), 3 * kMiB);
  EXPECT_EQ(load(g2->launches), launches + 1);
  EXPECT_EQ(load(g2->requested), 1u);
  EXPECT_EQ(g2->marking, SALUS_MARK_EXPLICIT);
  ASSERT_EQ(cuda().get<PFN_cuMemFree_v3020>("cuMemFree")(p), CUDA_SUCCESS);
  EXPECT_EQ(load(g2->charged_bytes), load(g->charged_bytes) - 3 * kMiB);
}

TEST(Lifecycle, AStoppedHeartbeatLetsTheProgramRunOn) {
  gpu();
  ASSERT_EQ(shim_attached(), 1);
  salusd->auto_grant = false;
  salusd->heartbeat = false;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(shim_step(), -ENOTCONN);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, std::chrono::milliseconds(SALUS_GATE_DEAD_MS));
  EXPECT_LT(waited, std::chrono::milliseconds(SALUS_GATE_DEAD_MS + 1500));
  EXPECT_EQ(shim_attached(), 0);
  ASSERT_EQ(spin(0us), CUDA_SUCCESS);
  salusd->heartbeat = true;
  salusd->auto_grant = true;
}

// Run after AStoppedHeartbeatLetsTheProgramRunOn (the program is ungated).
// A vanished session is made again only by a salusd that started after the
// program attached (its `stats` says uptime_s); the fake mount is not FUSE, so
// here "made again" stops short of the mkdir and shows as a retry.
TEST(Lifecycle, AVanishedSessionIsTriedAgainAfterARestart) {
  gpu();
  ASSERT_EQ(shim_attached(), 0);
  salusd->set_state(SALUS_GATE_DETACHED);  // the fake salusd goes back to reading ctl
  const std::string ctl = salusd->ctl(), away = ctl + ".away";
  ASSERT_EQ(::rename(ctl.c_str(), away.c_str()), 0);
  salusd->set_uptime(0.5);  // "restarted" after the program attached
  std::this_thread::sleep_for(1100ms);
  EXPECT_EQ(shim_step(), -ENOTCONN);
  ASSERT_EQ(::rename(away.c_str(), ctl.c_str()), 0);
  std::this_thread::sleep_for(1100ms);
  EXPECT_EQ(shim_step(), 0);
  EXPECT_EQ(salusd->attaches(), 3);
}

TEST(Lifecycle, ASessionEndedBySalusdIsNotMadeAgain) {
  gpu();
  ASSERT_EQ(shim_attached(), 1);
  salusd->set_state(SALUS_GATE_DETACHED);
  EXPECT_EQ(shim_step(), -ENOTCONN);
  const std::string ctl = salusd->ctl(), away = ctl + ".away";
  ASSERT_EQ(::rename(ctl.c_str(), away.c_str()), 0);  // removed by the same salusd
  salusd->set_uptime(1000);
  std::this_thread::sleep_for(1100ms);
  EXPECT_EQ(shim_step(), -ENOTCONN);
  ASSERT_EQ(::rename(away.c_str(), ctl.c_str()), 0);
  std::this_thread::sleep_for(1100ms);
  EXPECT_EQ(shim_step(), -ENOTCONN) << "an ended session must not be attached again";
  EXPECT_EQ(salusd->attaches(), 3);
}

TEST(Yield, AnUnmarkedProgramComesToASliceBoundaryAtItsNextLaunch) {
  gpu();
  salus_gate* g = salusd->gate();
  ASSERT_EQ(g->marking, SALUS_MARK_NONE);
  ASSERT_EQ(spin(0us), CUDA_SUCCESS);
  EXPECT_EQ(shim_iterations(), 0u);
  __atomic_store_n(&g->yield_requested, 1u, __ATOMIC_RELEASE);
  ASSERT_EQ(spin(0us), CUDA_SUCCESS);  // the fake salusd grants and clears the request
  EXPECT_EQ(shim_iterations(), 1u);
  EXPECT_EQ(g->marking, SALUS_MARK_SLICE);
  EXPECT_EQ(load(g->requested), 2u);
  EXPECT_TRUE(eventually([&] { return load(g->completed) == 1; }));
  // Once the program marks iterations itself, yield requests are ignored.
  ASSERT_EQ(shim_step(), 0);
  EXPECT_EQ(g->marking, SALUS_MARK_EXPLICIT);
  __atomic_store_n(&g->yield_requested, 1u, __ATOMIC_RELEASE);
  ASSERT_EQ(spin(0us), CUDA_SUCCESS);
  EXPECT_EQ(shim_iterations(), 2u);
  __atomic_store_n(&g->yield_requested, 0u, __ATOMIC_RELEASE);
}

// ---- movable memory (SALUS_SWAP=1; a process of its own) ----

// The program's side of a swap: a thread waits at its boundary (the fake
// salusd holds the grant back) while the test asks for a swap as salusd would.
struct Boundary {
  std::atomic<int> rc{1};
  std::thread t;
  std::uint64_t next = 0;
  void start() {
    salus_gate* g = salusd->gate();
    next = load(g->requested) + 1;  // boundary `requested - 1 + 1`: the one after this iteration
    t = std::thread([this] {
      bind_context();
      rc = shim_step();
    });
    ASSERT_TRUE(eventually([&] { return load(g->requested) == next; }));
  }
  void finish() {
    salusd->grant(next);
    t.join();
    EXPECT_EQ(rc, 0);
  }
};

// Asks for a swap (as salusd does: request, then a new seq, then a wake) and
// waits for the program's report. Returns swap_result.
int ask_swap(std::uint32_t req) {
  salus_gate* g = salusd->gate();
  const std::uint32_t seq = load32(g->swap_seq) + 1;
  __atomic_store_n(&g->swap_request, req, __ATOMIC_RELEASE);
  __atomic_store_n(&g->swap_seq, seq, __ATOMIC_RELEASE);
  __atomic_fetch_add(&g->grant_word, 1, __ATOMIC_RELEASE);
  ::syscall(SYS_futex, &g->grant_word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  EXPECT_TRUE(eventually([&] { return load32(g->swap_done_seq) == seq; }));
  return __atomic_load_n(&g->swap_result, __ATOMIC_ACQUIRE);
}

std::vector<std::uint32_t> pattern(std::size_t bytes, std::uint32_t seed) {
  std::vector<std::uint32_t> v(bytes / 4);
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = seed * 2654435761u + static_cast<std::uint32_t>(i);
  return v;
}
void put(CUdeviceptr p, const std::vector<std::uint32_t>& v) {
  ASSERT_EQ(cuda().get<PFN_cuMemcpyHtoD_v3020>("cuMemcpyHtoD")(p, v.data(), v.size() * 4),
            CUDA_SUCCESS);
}
std::vector<std::uint32_t> get(CUdeviceptr p, std::size_t bytes) {
  std::vector<std::uint32_t> v(bytes / 4);
  EXPECT_EQ(cuda().get<PFN_cuMemcpyDtoH_v3020>("cuMemcpyDtoH")(v.data(), p, bytes), CUDA_SUCCESS);
  return v;
}
// The mock's own free figure, not the session's view: the 32-bit cuMemGetInfo
// of CUDA 2.0 passes through the shim unhooked (and 512 MiB fits).
std::size_t driver_free() {
  void* p = nullptr;
  EXPECT_EQ(cuda().gpa("cuMemGetInfo", &p, 2000, 0, nullptr), CUDA_SUCCESS);
  EXPECT_FALSE(in_shim(p));
  unsigned free = 0, total = 0;
  reinterpret_cast<CUresult (*)(unsigned*, unsigned*)>(p)(&free, &total);
  return free;
}

struct Movable {
  CUdeviceptr a = 0, b = 0;
  std::size_t a_bytes = 5 * kMiB, b_bytes = 0;
  std::vector<std::uint32_t> pa, pb;
  void make() {
    auto alloc = cuda().get<PFN_cuMemAlloc_v3020>("cuMemAlloc");
    ASSERT_EQ(alloc(&a, a_bytes), CUDA_SUCCESS);
    std::size_t pitch = 0;
    ASSERT_EQ(cuda().get<PFN_cuMemAllocPitch_v3020>("cuMemAllocPitch")(&b, &pitch, 1000, 300, 4),
              CUDA_SUCCESS);
    EXPECT_EQ(pitch, 1024u);
    b_bytes = pitch * 300;
    pa = pattern(a_bytes, 1);
    pb = pattern(b_bytes, 2);
    put(a, pa);
    put(b, pb);
  }
  void check() {
    EXPECT_TRUE(get(a, a_bytes) == pa) << "contents of a changed";
    EXPECT_TRUE(get(b, b_bytes) == pb) << "contents of b changed";
  }
  void drop() {
    auto free_ = cuda().get<PFN_cuMemFree_v3020>("cuMemFree");
    EXPECT_EQ(free_(a), CUDA_SUCCESS);
    EXPECT_EQ(free_(b), CUDA_SUCCESS);
  }
};

TEST(Swap, OutAndInKeepsContentsAddressesAndCharge) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  const std::uint64_t base = load(g->charged_bytes);
  Movable m;
  m.make();
  // Rounded up to the VMM granularity (2 MiB here) and charged so.
  EXPECT_EQ(load(g->charged_bytes), base + 6 * kMiB + 2 * kMiB);
  EXPECT_EQ(load(g->unswappable_bytes), base);
  const std::size_t free_before = driver_free();
  const CUdeviceptr a = m.a, b = m.b;
  Boundary k;
  k.start();
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_SWAPPED);
  EXPECT_EQ(load(g->swapped_bytes), 8 * kMiB);
  EXPECT_EQ(load(g->resident_bytes), base);
  EXPECT_EQ(load(g->charged_bytes), base + 8 * kMiB) << "the charge stays with the session";
  EXPECT_EQ(load(g->swaps_out), 1u);
  EXPECT_EQ(driver_free(), free_before + 8 * kMiB) << "the device memory was given back";
  EXPECT_EQ(k.rc, 1) << "the program must still wait for its grant";
  k.finish();  // the grant brings the memory back before the program runs
  EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_RESIDENT);
  EXPECT_EQ(load(g->swaps_in), 1u);
  EXPECT_EQ(load(g->swapped_bytes), 0u);
  EXPECT_EQ(driver_free(), free_before);
  EXPECT_EQ(m.a, a);
  EXPECT_EQ(m.b, b);
  m.check();
  EXPECT_GT(load(g->swap_ns), 0u);
  m.drop();
  EXPECT_EQ(load(g->charged_bytes), base);
  salusd->auto_grant = true;
}

TEST(Swap, ManyRoundsWithAPrefetchKeepEveryByte) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Movable m;
  m.make();
  const std::uint64_t outs = load(g->swaps_out), ins = load(g->swaps_in);
  for (int round = 0; round < 20; ++round) {
    Boundary k;
    k.start();
    ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
    ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0) << "a second request while swapped is a no-op";
    if (round % 2 == 0) {  // salusd prefetches ahead of the grant
      ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_IN), 0);
      EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_RESIDENT);
    }
    k.finish();
    m.check();
    // The program changes its data between swaps.
    m.pa = pattern(m.a_bytes, 100 + round);
    put(m.a, m.pa);
  }
  EXPECT_EQ(load(g->swaps_out), outs + 20);
  EXPECT_EQ(load(g->swaps_in), ins + 20);
  m.drop();
  salusd->auto_grant = true;
}

TEST(Swap, ARunningProgramIsNotSwappedOut) {
  gpu();
  salus_gate* g = salusd->gate();
  Movable m;
  m.make();
  // The fake salusd granted ahead: the program holds a grant when it next waits.
  salusd->auto_grant = false;
  const std::uint64_t want = load(g->requested) + 1;
  salusd->grant(want);
  const std::uint32_t seq = load32(g->swap_seq) + 1;
  __atomic_store_n(&g->swap_request, SALUS_SWAP_REQ_OUT, __ATOMIC_RELEASE);
  __atomic_store_n(&g->swap_seq, seq, __ATOMIC_RELEASE);
  ASSERT_EQ(shim_step(), 0);  // sees the request while granted: refuses it
  ASSERT_TRUE(eventually([&] { return load32(g->swap_done_seq) == seq; }));
  EXPECT_EQ(__atomic_load_n(&g->swap_result, __ATOMIC_ACQUIRE), -EBUSY);
  EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_RESIDENT);
  m.check();
  m.drop();
  salusd->auto_grant = true;
}

TEST(Swap, NoHostMemoryLeavesTheDataOnTheDeviceWithAClearError) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Movable m;
  m.a_bytes = 9 * kMiB;  // a size no earlier swap left a pinned buffer for
  m.make();
  const std::size_t free_before = driver_free();
  const std::uint32_t notes = load32(g->note_seq);
  ::setenv("SALUS_MOCK_HOST_LIMIT", "7340032", 1);  // 7 MiB: the 10 MiB copy cannot be pinned
  ::unsetenv("SALUS_SWAP_DIR");
  Boundary k;
  k.start();
  EXPECT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), -ENOMEM);
  ::unsetenv("SALUS_MOCK_HOST_LIMIT");
  EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_RESIDENT);
  EXPECT_EQ(load(g->swapped_bytes), 0u);
  EXPECT_EQ(driver_free(), free_before) << "nothing was released";
  EXPECT_GT(load32(g->note_seq), notes);
  EXPECT_NE(std::strstr(g->note, "swap out failed"), nullptr) << g->note;
  EXPECT_NE(std::strstr(g->note, "everything stays on the GPU"), nullptr) << g->note;
  k.finish();
  m.check();
  m.drop();
  salusd->auto_grant = true;
}

TEST(Swap, PastTheHostLimitASpillFileHoldsItAndAFullOneFailsCleanly) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Movable m;
  m.make();
  char dir[] = "/tmp/salus-swap-spill-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  ::setenv("SALUS_SWAP_DIR", dir, 1);
  ::setenv("SALUS_SWAP_HOST_LIMIT", "0", 1);  // everything to the spill file
  {
    Boundary k;
    k.start();
    ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
    EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_SWAPPED);
    k.finish();
    m.check();
  }
  // A spill file that cannot grow (RLIMIT_FSIZE stands in for a full disk:
  // the write fails the same way and must lose nothing).
  struct rlimit old {};
  ::getrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 3 * kMiB;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::size_t free_before = driver_free();
  {
    Boundary k;
    k.start();
    EXPECT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), -EFBIG);
    EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_RESIDENT);
    EXPECT_EQ(driver_free(), free_before);
    EXPECT_NE(std::strstr(g->note, "spill file"), nullptr) << g->note;
    k.finish();
    m.check();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::unsetenv("SALUS_SWAP_HOST_LIMIT");
  ::unsetenv("SALUS_SWAP_DIR");
  EXPECT_EQ(::rmdir(dir), 0) << "the spill file is unlinked from the start";
  m.drop();
  salusd->auto_grant = true;
}

TEST(Swap, FreeingSwappedMemoryAndAllocatingWhileSwappedWork) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  const std::uint64_t base = load(g->charged_bytes);
  Movable m;
  m.make();
  Boundary k;
  k.start();
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  // Another thread of the program frees one swapped allocation and makes a new one.
  auto free_ = cuda().get<PFN_cuMemFree_v3020>("cuMemFree");
  ASSERT_EQ(free_(m.b), CUDA_SUCCESS);
  EXPECT_EQ(load(g->swapped_bytes), 6 * kMiB);
  CUdeviceptr c = 0;
  ASSERT_EQ(cuda().get<PFN_cuMemAlloc_v3020>("cuMemAlloc")(&c, kMiB), CUDA_SUCCESS);
  auto pc = pattern(2 * kMiB, 7);
  put(c, pc);
  k.finish();
  EXPECT_TRUE(get(m.a, m.a_bytes) == m.pa);
  EXPECT_TRUE(get(c, 2 * kMiB) == pc);
  ASSERT_EQ(free_(m.a), CUDA_SUCCESS);
  ASSERT_EQ(free_(c), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base);
  salusd->auto_grant = true;
}

TEST(Swap, StreamOrderedAllocationsMoveTooAndAreFreedInStreamOrder) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Cuda& c = cuda();
  CUstream s = nullptr;
  ASSERT_EQ(c.get<PFN_cuStreamCreate_v2000>("cuStreamCreate")(&s, CU_STREAM_NON_BLOCKING),
            CUDA_SUCCESS);
  auto alloc_async = c.get<PFN_cuMemAllocAsync_v11020>("cuMemAllocAsync");
  auto free_async = c.get<PFN_cuMemFreeAsync_v11020>("cuMemFreeAsync");
  const std::uint64_t base = load(g->charged_bytes), fixed = load(g->unswappable_bytes);
  CUdeviceptr x = 0;
  ASSERT_EQ(alloc_async(&x, 3 * kMiB, s), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base + 4 * kMiB);
  EXPECT_EQ(load(g->unswappable_bytes), fixed) << "movable";
  auto px = pattern(4 * kMiB, 9);
  put(x, px);
  {
    Boundary k;
    k.start();
    ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
    EXPECT_EQ(load(g->swapped_bytes), 4 * kMiB);
    k.finish();
  }
  EXPECT_TRUE(get(x, 4 * kMiB) == px);
  // Freed in stream order: still mapped while the stream's kernel runs.
  const std::size_t before = driver_free();
  ASSERT_EQ(spin(300ms, s), CUDA_SUCCESS);
  ASSERT_EQ(free_async(x, s), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base) << "refunded when the free is enqueued";
  CUdeviceptr y = 0;
  ASSERT_EQ(alloc_async(&y, kMiB, s), CUDA_SUCCESS);  // reaps nothing yet: the kernel runs
  EXPECT_EQ(driver_free(), before - 2 * kMiB);
  ASSERT_EQ(c.get<PFN_cuStreamSynchronize_v2000>("cuStreamSynchronize")(s), CUDA_SUCCESS);
  CUdeviceptr z = 0;
  ASSERT_EQ(alloc_async(&z, kMiB, s), CUDA_SUCCESS);  // now x is released
  EXPECT_EQ(driver_free(), before + 4 * kMiB - 4 * kMiB);
  ASSERT_EQ(free_async(y, s), CUDA_SUCCESS);
  ASSERT_EQ(free_async(z, s), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuStreamSynchronize_v2000>("cuStreamSynchronize")(s), CUDA_SUCCESS);
  EXPECT_EQ(load(g->charged_bytes), base);
  salusd->auto_grant = true;
}

// ---- the program's own physical allocations (cuMemCreate), movable too ----

// The program's own VMM memory as PyTorch's expandable segments make it: one
// reservation, 2 MiB handles created with the POSIX-fd handle type, each
// mapped whole, then access set over the whole range in one call.
struct Segment {
  std::size_t n = 2;  // handles
  CUdeviceptr va = 0;
  std::vector<CUmemGenericAllocationHandle> h;
  std::vector<std::uint32_t> data;
  static constexpr std::size_t kPiece = 2 * kMiB;
  std::size_t bytes() const { return n * kPiece; }
  static CUmemAllocationProp prop() {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return p;
  }
  static CUmemAccessDesc rw() {
    CUmemAccessDesc d{};
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = 0;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return d;
  }
  void make() {
    Cuda& c = cuda();
    ASSERT_EQ(c.get<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve")(&va, bytes(), 0, 0, 0),
              CUDA_SUCCESS);
    const CUmemAllocationProp p = prop();
    h.assign(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&h[i], kPiece, &p, 0), CUDA_SUCCESS);
      ASSERT_EQ(c.get<PFN_cuMemMap_v10020>("cuMemMap")(va + i * kPiece, kPiece, 0, h[i], 0),
                CUDA_SUCCESS);
    }
    const CUmemAccessDesc d = rw();
    ASSERT_EQ(c.get<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(va, bytes(), &d, 1), CUDA_SUCCESS);
    data = pattern(bytes(), 31);
    put(va, data);
  }
  void check() { EXPECT_TRUE(get(va, bytes()) == data) << "contents of the segment changed"; }
  void drop() {
    Cuda& c = cuda();
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(c.get<PFN_cuMemUnmap_v10020>("cuMemUnmap")(va + i * kPiece, kPiece), CUDA_SUCCESS);
      EXPECT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(h[i]), CUDA_SUCCESS);
    }
    EXPECT_EQ(c.get<PFN_cuMemAddressFree_v10020>("cuMemAddressFree")(va, bytes()), CUDA_SUCCESS);
  }
};

// Lets the shim release what earlier tests freed in stream order (it does at
// its next allocation), so that the driver's free figure moves only with what
// a test does.
void settle() {
  CUdeviceptr x = 0;
  ASSERT_EQ(cuda().get<PFN_cuMemAlloc_v3020>("cuMemAlloc")(&x, kMiB), CUDA_SUCCESS);
  ASSERT_EQ(cuda().get<PFN_cuMemFree_v3020>("cuMemFree")(x), CUDA_SUCCESS);
}

TEST(Swap, TheProgramsOwnHandlesMoveAndKeepTheirAddresses) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Cuda& c = cuda();
  const std::uint64_t base = load(g->charged_bytes), fixed = load(g->unswappable_bytes);
  Segment seg;
  seg.make();
  EXPECT_EQ(load(g->charged_bytes), base + 4 * kMiB);
  EXPECT_EQ(load(g->unswappable_bytes), fixed) << "mapped whole and writable: movable";
  for (CUmemGenericAllocationHandle h : seg.h)
    EXPECT_EQ(h >> 48, 0x5a15u) << "a handle of the shim's";
  // The handle is the program's wherever it asks: by address, and its properties.
  CUmemGenericAllocationHandle again = 0;
  ASSERT_EQ(c.get<PFN_cuMemRetainAllocationHandle_v11000>("cuMemRetainAllocationHandle")(
                &again, reinterpret_cast<void*>(seg.va + 2 * kMiB + 100)),
            CUDA_SUCCESS);
  EXPECT_EQ(again, seg.h[1]);
  ASSERT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(again), CUDA_SUCCESS);
  CUmemAllocationProp prop{};
  ASSERT_EQ(c.get<PFN_cuMemGetAllocationPropertiesFromHandle_v10020>(
                "cuMemGetAllocationPropertiesFromHandle")(&prop, seg.h[0]),
            CUDA_SUCCESS);
  EXPECT_EQ(prop.requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  EXPECT_EQ(prop.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
  // Not movable: a handle never mapped (nowhere to copy it from), and one
  // mapped but never made accessible.
  const CUmemAllocationProp p = Segment::prop();
  CUmemGenericAllocationHandle unmapped = 0, closed = 0;
  CUdeviceptr closed_va = 0;
  ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&unmapped, 2 * kMiB, &p, 0), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&closed, 2 * kMiB, &p, 0), CUDA_SUCCESS);
  ASSERT_EQ(
      c.get<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve")(&closed_va, 2 * kMiB, 0, 0, 0),
      CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemMap_v10020>("cuMemMap")(closed_va, 2 * kMiB, 0, closed, 0),
            CUDA_SUCCESS);
  EXPECT_EQ(load(g->unswappable_bytes), fixed + 4 * kMiB);
  settle();
  const std::size_t free_before = driver_free();
  Boundary k;
  k.start();
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  EXPECT_EQ(load(g->swapped_bytes), 4 * kMiB);
  EXPECT_EQ(driver_free(), free_before + 4 * kMiB) << "the segment's memory was given back";
  EXPECT_EQ(load(g->charged_bytes), base + 8 * kMiB);
  k.finish();
  EXPECT_EQ(load(g->swapped_bytes), 0u);
  EXPECT_EQ(driver_free(), free_before);
  seg.check();
  EXPECT_EQ(c.get<PFN_cuMemUnmap_v10020>("cuMemUnmap")(closed_va, 2 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(c.get<PFN_cuMemAddressFree_v10020>("cuMemAddressFree")(closed_va, 2 * kMiB),
            CUDA_SUCCESS);
  EXPECT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(closed), CUDA_SUCCESS);
  EXPECT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(unmapped), CUDA_SUCCESS);
  seg.drop();
  EXPECT_EQ(load(g->charged_bytes), base);
  EXPECT_EQ(load(g->unswappable_bytes), fixed);
  EXPECT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(seg.h[0]), CUDA_ERROR_INVALID_VALUE)
      << "a released handle is unknown, as to the driver";
  salusd->auto_grant = true;
}

TEST(Swap, AHandleSharedWithTheWorldStaysOnTheCard) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Cuda& c = cuda();
  const std::uint64_t fixed = load(g->unswappable_bytes);
  Segment seg;
  seg.n = 4;
  seg.make();
  EXPECT_EQ(load(g->unswappable_bytes), fixed);
  // Exported as an fd, a dma-buf of its range, bound to a multicast object:
  // each reaches the driver with the driver's handle, and stays put from now on.
  int fd = -1, dmabuf = -1;
  ASSERT_EQ(c.get<PFN_cuMemExportToShareableHandle_v10020>("cuMemExportToShareableHandle")(
                &fd, seg.h[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemGetHandleForAddressRange_v11070>("cuMemGetHandleForAddressRange")(
                &dmabuf, seg.va + 2 * kMiB, 2 * kMiB, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
            CUDA_SUCCESS);
  auto bind = c.get<PFN_cuMulticastBindMem_v12010>("cuMulticastBindMem", 12010);
  ASSERT_NE(bind, nullptr);
  ASSERT_EQ(bind(0, 0, seg.h[2], 0, 2 * kMiB, 0), CUDA_SUCCESS);
  EXPECT_EQ(load(g->unswappable_bytes), fixed + 6 * kMiB);
  settle();
  const std::size_t free_before = driver_free();
  Boundary k;
  k.start();
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  EXPECT_EQ(load(g->swapped_bytes), 2 * kMiB) << "only the handle nobody else holds";
  EXPECT_EQ(driver_free(), free_before + 2 * kMiB);
  // What another process maps through the fd is still the program's memory.
  void* shared = ::mmap(nullptr, 2 * kMiB, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(shared, MAP_FAILED);
  EXPECT_EQ(std::memcmp(shared, seg.data.data(), 2 * kMiB), 0);
  ::munmap(shared, 2 * kMiB);
  k.finish();
  seg.check();
  ::close(fd);
  ::close(dmabuf);
  seg.drop();
  EXPECT_EQ(load(g->unswappable_bytes), fixed);
  salusd->auto_grant = true;
}

TEST(Swap, TheProgramsHandlesWorkWhileItIsSwappedOut) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Cuda& c = cuda();
  const std::uint64_t base = load(g->charged_bytes);
  Segment seg;
  seg.make();
  Boundary k;
  k.start();
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  ASSERT_EQ(load(g->swapped_bytes), 4 * kMiB);
  // Another thread of the program, while its memory is off the GPU: access is
  // set again (recorded), the second handle is unmapped and released, a new
  // one is made and mapped in its place, and one is retained by address.
  const CUmemAccessDesc rw = Segment::rw();
  EXPECT_EQ(c.get<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(seg.va, seg.bytes(), &rw, 1),
            CUDA_SUCCESS);
  EXPECT_EQ(c.get<PFN_cuMemUnmap_v10020>("cuMemUnmap")(seg.va + 2 * kMiB, 2 * kMiB), CUDA_SUCCESS);
  EXPECT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(seg.h[1]), CUDA_SUCCESS);
  EXPECT_EQ(load(g->swapped_bytes), 2 * kMiB);
  EXPECT_EQ(load(g->charged_bytes), base + 2 * kMiB);
  const CUmemAllocationProp p = Segment::prop();
  ASSERT_EQ(c.get<PFN_cuMemCreate_v10020>("cuMemCreate")(&seg.h[1], 2 * kMiB, &p, 0), CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemMap_v10020>("cuMemMap")(seg.va + 2 * kMiB, 2 * kMiB, 0, seg.h[1], 0),
            CUDA_SUCCESS);
  ASSERT_EQ(c.get<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(seg.va + 2 * kMiB, 2 * kMiB, &rw, 1),
            CUDA_SUCCESS);
  const auto fresh = pattern(2 * kMiB, 77);
  put(seg.va + 2 * kMiB, fresh);
  std::copy(fresh.begin(), fresh.end(), seg.data.begin() + 2 * kMiB / 4);
  CUmemGenericAllocationHandle again = 0;
  ASSERT_EQ(c.get<PFN_cuMemRetainAllocationHandle_v11000>("cuMemRetainAllocationHandle")(
                &again, reinterpret_cast<void*>(seg.va)),
            CUDA_SUCCESS);
  EXPECT_EQ(again, seg.h[0]);
  // Its access, as the program set it, though the driver sees nothing mapped.
  auto get_access = c.get<PFN_cuMemGetAccess_v10020>("cuMemGetAccess");
  unsigned long long flags = 0;
  ASSERT_EQ(get_access(&flags, &rw.location, seg.va + 4096), CUDA_SUCCESS);
  EXPECT_EQ(flags, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  CUmemLocation other = rw.location;
  other.id = 1;
  ASSERT_EQ(get_access(&flags, &other, seg.va + 4096), CUDA_SUCCESS);
  EXPECT_EQ(flags, CU_MEM_ACCESS_FLAGS_PROT_NONE);
  int fd = -1;
  EXPECT_EQ(c.get<PFN_cuMemExportToShareableHandle_v10020>("cuMemExportToShareableHandle")(
                &fd, seg.h[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_ERROR_NOT_PERMITTED)
      << "off the GPU: cannot be shared now";
  EXPECT_NE(std::strstr(g->note, "swapped out"), nullptr) << g->note;
  ASSERT_EQ(c.get<PFN_cuMemRelease_v10020>("cuMemRelease")(again), CUDA_SUCCESS);
  k.finish();
  EXPECT_EQ(load(g->swapped_bytes), 0u);
  seg.check();
  // Swapped out and in again with the new handle: both halves come back.
  {
    Boundary k2;
    k2.start();
    ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
    EXPECT_EQ(load(g->swapped_bytes), 4 * kMiB);
    k2.finish();
  }
  seg.check();
  seg.drop();
  EXPECT_EQ(load(g->charged_bytes), base);
  salusd->auto_grant = true;
}

// The GPU has no room for a swap-in: the mock's cuMemCreate fails after the
// third piece (the shim's own two allocations come first, then the program's
// handles), so what was mapped again is undone and the copies stay; the grant
// brings everything back once there is room.
TEST(Swap, NoRoomToComeBackUndoesWhatWasMappedAndKeepsTheCopies) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Movable m;
  m.make();
  Segment seg;
  seg.make();
  settle();
  const std::size_t free_before = driver_free();
  Boundary k;
  k.start();
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  ASSERT_EQ(load(g->swapped_bytes), 12 * kMiB);
  char path[] = "/tmp/salus-no-memory-XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "3\n", 2), 2);  // three pieces come back, the fourth cannot
  ::close(fd);
  ::setenv("SALUS_MOCK_NO_MEMORY_FILE", path, 1);
  EXPECT_EQ(ask_swap(SALUS_SWAP_REQ_IN), -ENOMEM);
  EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_SWAPPED);
  EXPECT_EQ(load(g->swapped_bytes), 12 * kMiB);
  EXPECT_EQ(driver_free(), free_before + 12 * kMiB) << "what came back was undone";
  EXPECT_NE(std::strstr(g->note, "the GPU has no room for it yet"), nullptr) << g->note;
  ::unlink(path);
  ::unsetenv("SALUS_MOCK_NO_MEMORY_FILE");
  k.finish();  // room again: the grant brings it all back
  EXPECT_EQ(load(g->swapped_bytes), 0u);
  EXPECT_EQ(driver_free(), free_before);
  m.check();
  seg.check();
  seg.drop();
  m.drop();
  salusd->auto_grant = true;
}

// salusd stopping (or ending the session) while the program is swapped out:
// the program runs on ungated, with its memory back first. Last of the suite:
// it leaves the program detached.
TEST(Swap, LetGoWhileSwappedOutTheMemoryComesBackFirst) {
  gpu();
  salus_gate* g = salusd->gate();
  salusd->auto_grant = false;
  Movable m;
  m.make();
  const std::size_t free_before = driver_free();
  std::atomic<int> rc{1};
  const std::uint64_t next = load(g->requested) + 1;
  std::thread t([&] {
    bind_context();
    rc = shim_step();
  });
  ASSERT_TRUE(eventually([&] { return load(g->requested) == next; }));
  ASSERT_EQ(ask_swap(SALUS_SWAP_REQ_OUT), 0);
  EXPECT_EQ(driver_free(), free_before + 8 * kMiB);
  salusd->set_state(SALUS_GATE_DETACHED);
  t.join();
  EXPECT_EQ(rc, -ENOTCONN);
  EXPECT_EQ(load32(g->swap_state), SALUS_SWAP_RESIDENT);
  EXPECT_EQ(driver_free(), free_before);
  m.check();
  m.drop();
  salusd->auto_grant = true;
}

// ---- the shared lane as room (SALUS_SHARED_LANE=segments; a process of its own) ----
// The fake salusd lends the room by hand: lane_bytes and lane_grant in the gate,
// as Broker::grant_lane_room sets them.

struct RoomVmm {
  PFN_cuMemCreate_v10020 create = cuda().get<PFN_cuMemCreate_v10020>("cuMemCreate");
  PFN_cuMemRelease_v10020 release = cuda().get<PFN_cuMemRelease_v10020>("cuMemRelease");
  PFN_cuMemMap_v10020 map = cuda().get<PFN_cuMemMap_v10020>("cuMemMap");
  PFN_cuMemUnmap_v10020 unmap = cuda().get<PFN_cuMemUnmap_v10020>("cuMemUnmap");
  PFN_cuMemAddressReserve_v10020 reserve =
      cuda().get<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
  PFN_cuMemAddressFree_v10020 addr_free =
      cuda().get<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
  PFN_cuMemRetainAllocationHandle_v11000 retain =
      cuda().get<PFN_cuMemRetainAllocationHandle_v11000>("cuMemRetainAllocationHandle");

  // A segment as expandable segments make one.
  CUmemGenericAllocationHandle make(std::uint64_t n, CUresult* r = nullptr) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h = 0;
    const CUresult got = create(&h, n, &prop, 0);
    if (r != nullptr)
      *r = got;
    else
      EXPECT_EQ(got, CUDA_SUCCESS);
    return h;
  }
  CUdeviceptr map_at_new(CUmemGenericAllocationHandle h, std::uint64_t n) {
    CUdeviceptr va = 0;
    EXPECT_EQ(reserve(&va, n, 0, 0, 0), CUDA_SUCCESS);
    EXPECT_EQ(map(va, n, 0, h, 0), CUDA_SUCCESS);
    CUmemAccessDesc rw{};
    rw.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    EXPECT_EQ(cuda().get<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(va, n, &rw, 1), CUDA_SUCCESS);
    return va;
  }
  void unmap_and_free(CUdeviceptr va, std::uint64_t n) {
    EXPECT_EQ(unmap(va, n), CUDA_SUCCESS);
    EXPECT_EQ(addr_free(va, n), CUDA_SUCCESS);
  }
};

void lend_room(std::uint64_t bytes, std::uint32_t grant) {
  salus_gate* g = salusd->gate();
  __atomic_store_n(&g->lane_bytes, bytes, __ATOMIC_RELEASE);
  __atomic_store_n(&g->lane_grant, grant, __ATOMIC_SEQ_CST);
}

// Each test's start: the room lent (16M, grant 1), the charge counted from here.
struct Room {
  Room() {
    gpu();  // cuInit: the shim attaches, and the fake salusd has a gate
    g = salusd->gate();
    lend_room(16 * kMiB, 1);
    base = load(g->charged_bytes);
  }
  std::uint64_t charged() const { return load(g->charged_bytes) - base; }
  salus_gate* g = nullptr;
  RoomVmm v;
  std::uint64_t base = 0;
};

TEST(LaneRoom, ACreateWhileHeldIsUnchargedAndAReleasedHandleServesTheNext) {
  Room t;
  RoomVmm& v = t.v;
  const CUmemGenericAllocationHandle h = v.make(4 * kMiB);
  EXPECT_EQ(t.charged(), 0u) << "the room's, not the budget's";
  EXPECT_EQ(load32(t.g->lane_held), 1u) << "the room is held: salusd must ask for it back";
  const CUdeviceptr va = v.map_at_new(h, 4 * kMiB);
  // A second reference (by address) and both released: still mapped, so the
  // memory is in use and no spare yet.
  CUmemGenericAllocationHandle again = 0;
  ASSERT_EQ(v.retain(&again, reinterpret_cast<void*>(va)), CUDA_SUCCESS);
  EXPECT_EQ(again, h);
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
  const CUmemGenericAllocationHandle other = v.make(4 * kMiB);
  EXPECT_NE(other, h) << "h is still mapped: not a spare";
  // Unmapped, it is a spare and serves the next segment of its size.
  v.unmap_and_free(va, 4 * kMiB);
  EXPECT_EQ(v.make(4 * kMiB), h);
  EXPECT_EQ(t.charged(), 0u);
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
  EXPECT_EQ(v.release(other), CUDA_SUCCESS);  // two 4M spares now
}

TEST(LaneRoom, SparesOfAnotherSizeGiveWayWhenTheRoomIsShort) {
  Room t;
  RoomVmm& v = t.v;
  // 8M of 4M spares and 12M more do not fit 16M: the spares go, the segment
  // is made in the room.
  const CUmemGenericAllocationHandle h = v.make(12 * kMiB);
  EXPECT_EQ(t.charged(), 0u);
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
}

TEST(LaneRoom, PastTheRoomOrWithoutTheLaneItIsCharged) {
  Room t;
  RoomVmm& v = t.v;
  const CUmemGenericAllocationHandle big = v.make(32 * kMiB);  // past the room: the budget
  EXPECT_EQ(t.charged(), 32 * kMiB);
  EXPECT_EQ(v.release(big), CUDA_SUCCESS);
  EXPECT_EQ(t.charged(), 0u);
  lend_room(16 * kMiB, 0);  // not held
  const CUmemGenericAllocationHandle h = v.make(2 * kMiB);
  EXPECT_EQ(t.charged(), 2 * kMiB);
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
  EXPECT_EQ(t.charged(), 0u);
}

TEST(LaneRoom, ASegmentLiveAtABoundaryIsChargedWhereItIsMapped) {
  Room t;
  RoomVmm& v = t.v;
  const CUmemGenericAllocationHandle h = v.make(4 * kMiB);
  const CUdeviceptr va = v.map_at_new(h, 4 * kMiB);
  const std::vector<char> bytes(4 * kMiB, 0x5a);
  auto htod = cuda().get<PFN_cuMemcpyHtoD_v3020>("cuMemcpyHtoD");
  auto dtoh = cuda().get<PFN_cuMemcpyDtoH_v3020>("cuMemcpyDtoH");
  ASSERT_EQ(htod(va, bytes.data(), bytes.size()), CUDA_SUCCESS);
  EXPECT_EQ(t.charged(), 0u);
  ASSERT_EQ(shim_step(), 0);
  EXPECT_EQ(t.charged(), 4 * kMiB) << "what outlives the iteration is persistent";
  std::vector<char> back(bytes.size());
  ASSERT_EQ(dtoh(back.data(), va, back.size()), CUDA_SUCCESS);
  EXPECT_EQ(back, bytes) << "nothing moved";
  // Released while mapped, then unmapped: refunded as the program's own memory.
  EXPECT_EQ(v.release(h), CUDA_SUCCESS);
  EXPECT_EQ(t.charged(), 4 * kMiB);
  v.unmap_and_free(va, 4 * kMiB);
  EXPECT_EQ(t.charged(), 0u);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  char root[] = "/tmp/salus-shim-test-XXXXXX";
  if (::mkdtemp(root) == nullptr) return 1;
  int rc;
  {
    FakeSalusd s(root);
    s.budget = 64 * kMiB;
    salusd = &s;
    rc = RUN_ALL_TESTS();
    salusd = nullptr;
  }
  ::rmdir(root);
  return rc;
}
