// A stand-in libcuda.so.1 for running the cuda backend's tests on machines with
// no GPU. It implements, on the host, exactly the Driver API subset salusd
// resolves through cuGetProcAddress: device memory is host memory, each stream is
// a thread, events carry host timestamps, and the kernels salusd and the tests use
// (salus_spin, salus_gemm, the test module's) have CPU implementations found by
// name in the loaded image. It is strict where a real GPU is undefined or unkind:
// overlapping cuMemcpy, use of a handle after a context reset, a launch from an
// unloaded module or a call without a current context abort the process loudly,
// and a store outside every allocation makes the context sticky-faulted with
// CUDA_ERROR_ILLEGAL_ADDRESS until cuDevicePrimaryCtxReset.
//
// Only for tests: selected with LD_LIBRARY_PATH by tests/vgpu/cuda/meson.build.
//
// For libsalus-shim's tests (tests/vgpu/cuda/test_shim.cpp) it also has what a
// program's own CUDA use reaches: the driver entry points at several versions
// (cuGetProcAddress v1 and v2, cuMemGetInfo v1 and v2), a few exported symbols
// for dlsym, stream-ordered allocation, VMM with real memory (memfd-backed
// handles, reservations, mappings, access, POSIX-fd export and import,
// retained handles and their properties, a dma-buf of a range, multicast binds
// that check their arguments only), the
// synchronous copies (device-to-device too), managed memory, the other
// launch calls, and the legacy NULL stream, which salusd must never use and
// which is therefore emulated only with SALUS_MOCK_LEGACY_STREAM=1 in the
// environment.
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void misuse(const char* format, ...) {
  std::va_list ap;
  va_start(ap, format);
  std::fprintf(stderr, "MOCK libcuda: misuse: ");
  std::vfprintf(stderr, format, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::abort();
}

constexpr std::size_t kTotalMemory = std::size_t{512} << 20;
constexpr int kClockKhz = 1'000'000;  // 1 GHz: 1000 cycles per microsecond

struct Dims {
  unsigned grid[3];
  unsigned block[3];
};
using Params = std::vector<std::vector<std::uint8_t>>;
struct Kernel {
  const char* name;
  std::vector<std::uint32_t> sizes;
  void (*run)(const Dims&, const Params&);
};

struct MockStream {
  std::uint64_t gen = 0;
  bool destroyed = false;
  bool exit = false;
  bool busy = false;
  std::deque<std::function<void()>> queue;
};
struct MockEvent {
  std::uint64_t gen;
  unsigned flags;
  bool destroyed = false;
  std::uint64_t recorded = 0;  // records issued
  std::uint64_t done = 0;      // records completed
  Clock::time_point at{};
};
struct MockModule {
  std::uint64_t gen = 0;
  bool unloaded = false;
  std::vector<const Kernel*> kernels;
};
struct MockFunction {
  MockModule* module;
  const Kernel* kernel;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;  // any progress: op done, event done, fault, reset
  CUresult sticky = CUDA_SUCCESS;
  std::uint64_t gen = 1;  // bumped by every context reset
  int refs = 0;
  std::map<std::uintptr_t, std::size_t> device;  // allocations, by address
  std::map<std::uintptr_t, std::size_t> pinned;
  std::map<std::uintptr_t, std::size_t> registered;  // the caller's memory, page-locked
  std::size_t used = 0;
  std::vector<MockStream*> streams;  // of the current generation
  MockStream* legacy = nullptr;      // the NULL stream, made on first use
  // VMM: reservations (address -> size, real PROT_NONE host mappings), mappings
  // (address -> MockHandle) and the mapped ranges with access set, which kernels
  // and copies may touch (address -> size).
  std::map<std::uintptr_t, std::size_t> reserved;
  std::map<std::uintptr_t, void*> mapped;
  std::map<std::uintptr_t, std::size_t> accessible;
  std::size_t pinned_bytes = 0;  // cuMemHostAlloc, for SALUS_MOCK_HOST_LIMIT
};
// Never destroyed: detached stream threads may still wait on it at exit.
State& g = *new State;
// Handles are never freed (a stale one must still be recognisable as stale); kept
// reachable here so leak checkers do not count them.
std::mutex& g_keep_mu = *new std::mutex;
std::vector<void*>& g_keep = *new std::vector<void*>;
template <typename T>
T* keep(T* p) {
  std::lock_guard lk(g_keep_mu);
  g_keep.push_back(p);
  return p;
}
char g_ctx_token;
thread_local CUcontext t_current = nullptr;

CUcontext the_ctx() {
  return reinterpret_cast<CUcontext>(&g_ctx_token);
}

// Common entry check for calls that need the context. Caller holds g.mu.
CUresult enter_locked() {
  if (t_current != the_ctx())
    misuse("a context call on a thread without the primary context current");
  if (g.refs == 0) misuse("a context call while the primary context is not retained");
  return g.sticky;
}
#define ENTER()              \
  std::unique_lock lk(g.mu); \
  if (CUresult e_ = enter_locked(); e_ != CUDA_SUCCESS) return e_

bool range_in(const std::map<std::uintptr_t, std::size_t>& m, std::uintptr_t p, std::size_t n) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return false;
  --it;
  return p >= it->first && p - it->first <= it->second && n <= it->second - (p - it->first);
}
// VMM mappings with access set that lie next to each other form one range, as
// on a GPU (a reservation's address space is contiguous whatever backs it).
bool accessible_range(std::uintptr_t p, std::size_t n) {
  auto it = g.accessible.upper_bound(p);
  if (it == g.accessible.begin()) return false;
  --it;
  if (p < it->first || p - it->first >= it->second) return n == 0 && p == it->first + it->second;
  for (std::uintptr_t end = p + n;;) {
    const std::uintptr_t upto = it->first + it->second;
    if (end <= upto) return true;
    if (++it == g.accessible.end() || it->first != upto) return false;
  }
}

// Caller holds g.mu.
void fault_locked(CUresult r) {
  if (g.sticky == CUDA_SUCCESS) g.sticky = r;
  for (MockStream* s : g.streams) s->queue.clear();
  g.cv.notify_all();
}

// For kernels: device memory they touch must be allocated, or the context faults.
bool device_ok(std::uint64_t p, std::size_t n) {
  std::lock_guard lk(g.mu);
  if (range_in(g.device, p, n) || accessible_range(p, n)) return true;
  fault_locked(CUDA_ERROR_ILLEGAL_ADDRESS);
  return false;
}

// Waits (interruptibly, like a kernel killed by a fault) up to `d`, or until pred.
template <typename Pred>
void kernel_wait(std::chrono::microseconds d, Pred pred) {
  std::unique_lock lk(g.mu);
  const std::uint64_t gen = g.gen;
  g.cv.wait_until(lk, Clock::now() + d,
                  [&] { return g.sticky != CUDA_SUCCESS || g.gen != gen || pred(); });
}

template <typename T>
T param(const Params& p, std::size_t i) {
  T v;
  std::memcpy(&v, p[i].data(), sizeof v);
  return v;
}

// ---- kernels, by name ----

void k_spin(const Dims&, const Params& p) {
  const auto cycles = param<unsigned long long>(p, 0);
  kernel_wait(std::chrono::microseconds(cycles / (kClockKhz / 1000)), [] { return false; });
}

void k_gemm(const Dims& d, const Params& p) {
  const auto m = param<unsigned>(p, 0), n = param<unsigned>(p, 1), k = param<unsigned>(p, 2);
  const auto a = param<std::uint64_t>(p, 3), b = param<std::uint64_t>(p, 4),
             c = param<std::uint64_t>(p, 5);
  if (std::uint64_t{d.grid[0]} * 64 < n || std::uint64_t{d.grid[1]} * 64 < m || d.block[0] != 256)
    misuse("salus_gemm launched with a grid that does not cover %ux%u", m, n);
  if (!device_ok(a, std::size_t{m} * k * 4) || !device_ok(b, std::size_t{k} * n * 4) ||
      !device_ok(c, std::size_t{m} * n * 4))
    return;
  auto* A = reinterpret_cast<const float*>(a);
  auto* B = reinterpret_cast<const float*>(b);
  auto* C = reinterpret_cast<float*>(c);
  // Writes C as it goes, like blocks of a real kernel do: aliasing shows.
  for (unsigned i = 0; i < m; ++i)
    for (unsigned j = 0; j < n; ++j) {
      double sum = 0;
      for (unsigned q = 0; q < k; ++q)
        sum += double{A[std::size_t{i} * k + q]} * B[std::size_t{q} * n + j];
      C[std::size_t{i} * n + j] = static_cast<float>(sum);
    }
}

void k_all_types(const Dims&, const Params& p) {
  const auto out = param<std::uint64_t>(p, 0);
  if (!device_ok(out, 40)) return;
  auto* o = reinterpret_cast<std::uint8_t*>(out);
  std::memcpy(o + 0, p[1].data(), 4);
  std::memcpy(o + 4, p[2].data(), 4);
  std::memcpy(o + 8, p[3].data(), 8);
  std::memcpy(o + 16, p[4].data(), 8);
  std::memcpy(o + 24, p[5].data(), 4);
  std::memcpy(o + 32, p[6].data(), 8);
}

void k_saxpy(const Dims& d, const Params& p) {
  const auto y = param<std::uint64_t>(p, 0), x = param<std::uint64_t>(p, 1);
  const auto a = param<float>(p, 2);
  const auto n = param<unsigned>(p, 3);
  const std::uint64_t threads = std::uint64_t{d.grid[0]} * d.block[0];
  const std::uint64_t count = std::min<std::uint64_t>(threads, n);
  if (count == 0) return;
  if (!device_ok(y, count * 4) || !device_ok(x, count * 4)) return;
  auto* Y = reinterpret_cast<float*>(y);
  auto* X = reinterpret_cast<const float*>(x);
  for (std::uint64_t i = 0; i < count; ++i) Y[i] = a * X[i] + Y[i];
}

void k_wait_flag(const Dims&, const Params& p) {
  const auto flag = param<std::uint64_t>(p, 0), seen = param<std::uint64_t>(p, 1);
  const auto cycles = param<unsigned long long>(p, 2);
  if (!device_ok(flag, 4) || !device_ok(seen, 4)) return;
  auto* f = reinterpret_cast<std::atomic<unsigned>*>(flag);
  kernel_wait(std::chrono::microseconds(cycles / (kClockKhz / 1000)),
              [&] { return f->load() != 0; });
  *reinterpret_cast<unsigned*>(seen) = f->load() != 0 ? 1 : 0;
}

void k_set_flag(const Dims&, const Params& p) {
  const auto flag = param<std::uint64_t>(p, 0);
  if (!device_ok(flag, 4)) return;
  {
    std::lock_guard lk(g.mu);  // so the waiter's predicate sees it promptly
    reinterpret_cast<std::atomic<unsigned>*>(flag)->store(1);
  }
  g.cv.notify_all();
}

void k_bad_store(const Dims&, const Params& p) {
  const auto ptr = param<std::uint64_t>(p, 0);
  if (device_ok(ptr, 4)) *reinterpret_cast<unsigned*>(ptr) = 0xdead;
}

const Kernel kKernels[] = {
    {"salus_spin", {8}, k_spin},
    {"salus_gemm", {4, 4, 4, 8, 8, 8}, k_gemm},
    {"all_types", {8, 4, 4, 8, 8, 4, 8}, k_all_types},
    {"saxpy", {8, 8, 4, 4}, k_saxpy},
    {"wait_flag", {8, 8, 8}, k_wait_flag},
    {"set_flag", {8}, k_set_flag},
    {"bad_store", {8}, k_bad_store},
};

// ---- streams ----

void stream_loop(MockStream* s) {
  for (;;) {
    std::function<void()> op;
    {
      std::unique_lock lk(g.mu);
      g.cv.wait(lk, [&] { return !s->queue.empty() || s->exit; });
      if (s->queue.empty()) return;  // exiting and drained
      if (g.sticky != CUDA_SUCCESS || s->gen != g.gen) {
        s->queue.clear();  // a faulted context runs nothing more
        g.cv.notify_all();
        continue;
      }
      op = std::move(s->queue.front());
      s->queue.pop_front();
      s->busy = true;
    }
    op();
    std::lock_guard lk(g.mu);
    s->busy = false;
    g.cv.notify_all();
  }
}

// Caller holds g.mu.
MockStream* legacy_stream_locked() {
  static const bool allowed = std::getenv("SALUS_MOCK_LEGACY_STREAM") != nullptr;
  if (!allowed) misuse("the NULL stream is not emulated (salusd must use its own streams)");
  if (g.legacy == nullptr) {
    g.legacy = keep(new MockStream);
    g.legacy->gen = g.gen;
    g.streams.push_back(g.legacy);
    std::thread(stream_loop, g.legacy).detach();
  }
  return g.legacy;
}
MockStream* stream_of(CUstream h) {
  if (h == nullptr || h == CU_STREAM_LEGACY) return legacy_stream_locked();
  auto* s = reinterpret_cast<MockStream*>(h);
  if (s->gen != g.gen) misuse("stream %p used after a context reset", static_cast<void*>(s));
  if (s->destroyed) misuse("stream %p used after cuStreamDestroy", static_cast<void*>(s));
  return s;
}
MockEvent* event_of(CUevent h) {
  auto* e = reinterpret_cast<MockEvent*>(h);
  if (e == nullptr) misuse("null event");
  if (e->gen != g.gen) misuse("event %p used after a context reset", static_cast<void*>(e));
  if (e->destroyed) misuse("event %p used after cuEventDestroy", static_cast<void*>(e));
  return e;
}

// Caller holds g.mu (as `lk`). Enqueues and returns.
void push(MockStream* s, std::function<void()> op) {
  s->queue.push_back(std::move(op));
  g.cv.notify_all();
}
// Enqueues and waits for the op to have run (pageable copies are synchronous).
CUresult push_and_wait(std::unique_lock<std::mutex>& lk, MockStream* s, std::function<void()> op) {
  auto done = std::make_shared<bool>(false);
  push(s, [op = std::move(op), done] {
    op();
    std::lock_guard l(g.mu);
    *done = true;
  });
  const std::uint64_t gen = g.gen;
  g.cv.wait(lk, [&] { return *done || g.sticky != CUDA_SUCCESS || g.gen != gen; });
  return *done ? CUDA_SUCCESS : g.sticky;
}

void unmap_all_locked();  // VMM, below

void destroy_everything_locked(std::unique_lock<std::mutex>& lk) {
  ++g.gen;
  for (MockStream* s : g.streams) {
    s->queue.clear();
    s->exit = true;
  }
  g.cv.notify_all();
  // Kernels in flight notice the generation change and return; wait for them
  // before freeing the memory they may be touching.
  g.cv.wait(lk, [] {
    return std::none_of(g.streams.begin(), g.streams.end(), [](MockStream* s) { return s->busy; });
  });
  g.streams.clear();  // threads were detached; objects leak on purpose (stale handles abort)
  g.legacy = nullptr;
  unmap_all_locked();
  for (auto& [p, n] : g.device) std::free(reinterpret_cast<void*>(p));
  for (auto& [p, n] : g.pinned) std::free(reinterpret_cast<void*>(p));
  g.device.clear();
  g.pinned.clear();
  g.pinned_bytes = 0;
  g.registered.clear();  // registrations die with the context; the memory is the caller's
  g.used = 0;
  g.sticky = CUDA_SUCCESS;
}

// ---- API ----

CUresult m_cuGetErrorName(CUresult r, const char** s) {
  switch (r) {
#define NAME(x) \
  case x:       \
    *s = #x;    \
    return CUDA_SUCCESS;
    NAME(CUDA_SUCCESS)
    NAME(CUDA_ERROR_INVALID_VALUE)
    NAME(CUDA_ERROR_OUT_OF_MEMORY)
    NAME(CUDA_ERROR_NO_DEVICE)
    NAME(CUDA_ERROR_INVALID_IMAGE)
    NAME(CUDA_ERROR_INVALID_HANDLE)
    NAME(CUDA_ERROR_NOT_FOUND)
    NAME(CUDA_ERROR_NOT_READY)
    NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
    NAME(CUDA_ERROR_INVALID_PTX)
    NAME(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
#undef NAME
    default:
      *s = nullptr;
      return CUDA_ERROR_INVALID_VALUE;
  }
}
CUresult m_cuGetErrorString(CUresult r, const char** s) {
  const char* name = nullptr;
  if (m_cuGetErrorName(r, &name) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
  *s = "mock driver error";
  return CUDA_SUCCESS;
}
CUresult m_cuInit(unsigned flags) {
  return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult m_cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult m_cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult m_cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult m_cuDeviceGetName(char* name, int len, CUdevice) {
  std::snprintf(name, static_cast<std::size_t>(len), "Salus mock GPU");
  return CUDA_SUCCESS;
}
CUresult m_cuDeviceGetUuid(CUuuid* u, CUdevice) {
  for (int i = 0; i < 16; ++i) u->bytes[i] = static_cast<char>(0xa0 + i);
  return CUDA_SUCCESS;
}
CUresult m_cuDeviceTotalMem(std::size_t* bytes, CUdevice) {
  *bytes = kTotalMemory;
  return CUDA_SUCCESS;
}
CUresult m_cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *v = 8;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR:
      *v = 2048;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
      *v = 1024;
      break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE:
      *v = kClockKhz;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *v = 9;
      break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      *v = 1;
      break;
    default:
      *v = 0;
  }
  return CUDA_SUCCESS;
}
CUresult m_cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  std::lock_guard lk(g.mu);
  ++g.refs;
  *c = the_ctx();
  return CUDA_SUCCESS;
}
CUresult m_cuDevicePrimaryCtxRelease(CUdevice) {
  std::unique_lock lk(g.mu);
  if (g.refs == 0) misuse("cuDevicePrimaryCtxRelease without a retain");
  if (--g.refs == 0) destroy_everything_locked(lk);
  return CUDA_SUCCESS;
}
CUresult m_cuDevicePrimaryCtxReset(CUdevice) {
  std::unique_lock lk(g.mu);
  destroy_everything_locked(lk);
  return CUDA_SUCCESS;
}
CUresult m_cuCtxSetCurrent(CUcontext c) {
  if (c != nullptr && c != the_ctx()) misuse("cuCtxSetCurrent with a foreign context");
  t_current = c;
  return CUDA_SUCCESS;
}
CUresult m_cuCtxSynchronize() {
  ENTER();
  const std::uint64_t gen = g.gen;
  g.cv.wait(lk, [&] {
    return g.sticky != CUDA_SUCCESS || g.gen != gen ||
           std::all_of(g.streams.begin(), g.streams.end(),
                       [](MockStream* s) { return s->queue.empty() && !s->busy; });
  });
  return g.sticky;
}
// A card with no memory to give while the file named by `env` exists (a test
// creates and removes it while the process runs); a number in it is how many
// calls still succeed first (each takes one). SALUS_MOCK_NO_MEMORY_FILE holds
// up cuMemCreate, SALUS_MOCK_NO_ALLOC_FILE cuMemAlloc.
bool no_memory_now(const char* env = "SALUS_MOCK_NO_MEMORY_FILE") {
  const char* path = std::getenv(env);
  if (path == nullptr) return false;
  FILE* f = std::fopen(path, "r+");
  if (f == nullptr) return false;
  long left = 0;
  const bool counted = std::fscanf(f, "%ld", &left) == 1 && left > 0;
  if (counted) {
    std::rewind(f);
    std::fprintf(f, "%ld\n", left - 1);
  }
  std::fclose(f);
  return !counted;
}
CUresult m_cuMemGetInfo(std::size_t* free, std::size_t* total) {
  ENTER();
  *free = kTotalMemory - g.used;
  *total = kTotalMemory;
  return CUDA_SUCCESS;
}
CUresult m_cuMemAlloc(CUdeviceptr* p, std::size_t n) {
  ENTER();
  if (n == 0) return CUDA_ERROR_INVALID_VALUE;
  if (n > kTotalMemory - g.used) return CUDA_ERROR_OUT_OF_MEMORY;
  if (no_memory_now("SALUS_MOCK_NO_ALLOC_FILE")) return CUDA_ERROR_OUT_OF_MEMORY;
  void* mem = std::malloc(n);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::memset(mem, 0xab, n);  // fresh device memory is not zero
  g.device[reinterpret_cast<std::uintptr_t>(mem)] = n;
  g.used += n;
  *p = reinterpret_cast<CUdeviceptr>(mem);
  return CUDA_SUCCESS;
}
CUresult m_cuMemFree(CUdeviceptr p) {
  ENTER();
  auto it = g.device.find(p);
  if (it == g.device.end()) misuse("cuMemFree of %#llx, not an allocation", p);
  // cuMemFree waits for the device: nothing queued may still use the memory.
  g.cv.wait(lk, [] {
    return g.sticky != CUDA_SUCCESS ||
           std::all_of(g.streams.begin(), g.streams.end(),
                       [](MockStream* s) { return s->queue.empty() && !s->busy; });
  });
  g.used -= it->second;
  std::free(reinterpret_cast<void*>(p));
  g.device.erase(it);
  return CUDA_SUCCESS;
}
CUresult m_cuMemHostAlloc(void** p, std::size_t n, unsigned) {
  ENTER();
  // SALUS_MOCK_HOST_LIMIT=BYTES: pinned host memory runs out there (the shim's
  // swap tests: a failing host allocation must leave the data on the device).
  if (const char* lim = std::getenv("SALUS_MOCK_HOST_LIMIT");
      lim != nullptr && g.pinned_bytes + n > std::strtoull(lim, nullptr, 10))
    return CUDA_ERROR_OUT_OF_MEMORY;
  void* mem = std::malloc(n);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::memset(mem, 0xcd, n);
  g.pinned[reinterpret_cast<std::uintptr_t>(mem)] = n;
  g.pinned_bytes += n;
  *p = mem;
  return CUDA_SUCCESS;
}
CUresult m_cuMemFreeHost(void* p) {
  ENTER();
  auto it = g.pinned.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == g.pinned.end()) misuse("cuMemFreeHost of %p, not a pinned allocation", p);
  std::free(p);
  g.pinned_bytes -= it->second;
  g.pinned.erase(it);
  return CUDA_SUCCESS;
}

void check_device_range(CUdeviceptr p, std::size_t n, const char* what) {
  if (n != 0 && !range_in(g.device, p, n) && !accessible_range(p, n))
    misuse("%s of %zu bytes at %#llx is outside every allocation", what, n, p);
}
bool is_pinned(const void* p, std::size_t n) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  return range_in(g.pinned, at, n) || range_in(g.registered, at, n);
}
CUresult m_cuMemHostRegister(void* p, std::size_t n, unsigned) {
  ENTER();
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  if (n == 0) return CUDA_ERROR_INVALID_VALUE;
  auto next = g.registered.lower_bound(at);
  const bool overlaps =
      (next != g.registered.end() && next->first < at + n) ||
      (next != g.registered.begin() && std::prev(next)->first + std::prev(next)->second > at);
  if (overlaps) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  g.registered[at] = n;
  return CUDA_SUCCESS;
}
CUresult m_cuMemHostUnregister(void* p) {
  ENTER();
  auto it = g.registered.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == g.registered.end()) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  g.registered.erase(it);
  return CUDA_SUCCESS;
}

CUresult m_cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, std::size_t n, CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  check_device_range(dst, n, "cuMemcpyHtoDAsync");
  auto op = [dst, src, n] { std::memcpy(reinterpret_cast<void*>(dst), src, n); };
  if (is_pinned(src, n)) {
    push(s, op);
    return CUDA_SUCCESS;
  }
  return push_and_wait(lk, s, op);  // pageable: returns once the data is taken
}
CUresult m_cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, std::size_t n, CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  check_device_range(src, n, "cuMemcpyDtoHAsync");
  auto op = [dst, src, n] { std::memcpy(dst, reinterpret_cast<const void*>(src), n); };
  if (is_pinned(dst, n)) {
    push(s, op);
    return CUDA_SUCCESS;
  }
  return push_and_wait(lk, s, op);  // pageable: returns once the data has arrived
}
CUresult m_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  check_device_range(dst, n, "cuMemcpyDtoDAsync (dst)");
  check_device_range(src, n, "cuMemcpyDtoDAsync (src)");
  if (n != 0 && (dst < src ? src - dst < n : dst - src < n) && dst != src)
    misuse("overlapping cuMemcpyDtoDAsync (dst %#llx, src %#llx, %zu bytes)", dst, src, n);
  push(s, [dst, src, n] {
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  });
  return CUDA_SUCCESS;
}
CUresult m_cuMemsetD8Async(CUdeviceptr dst, unsigned char v, std::size_t n, CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  check_device_range(dst, n, "cuMemsetD8Async");
  push(s, [dst, v, n] {
    // Big memsets take a while, as on a GPU: a stream that does not wait for a
    // discard's memset would see the old bytes.
    if (n > (std::size_t{2} << 20)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::memset(reinterpret_cast<void*>(dst), v, n);
  });
  return CUDA_SUCCESS;
}
CUresult m_cuMemsetD32Async(CUdeviceptr dst, unsigned v, std::size_t n, CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  if (dst % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
  check_device_range(dst, n * 4, "cuMemsetD32Async");
  push(s, [dst, v, n] {
    auto* p = reinterpret_cast<std::uint32_t*>(dst);
    std::fill(p, p + n, v);
  });
  return CUDA_SUCCESS;
}
CUresult m_cuStreamCreate(CUstream* h, unsigned flags) {
  ENTER();
  if (flags != CU_STREAM_NON_BLOCKING) misuse("streams must be created non-blocking");
  auto* s = keep(new MockStream);
  s->gen = g.gen;
  g.streams.push_back(s);
  std::thread(stream_loop, s).detach();
  *h = reinterpret_cast<CUstream>(s);
  return CUDA_SUCCESS;
}
CUresult m_cuStreamDestroy(CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  s->destroyed = true;
  s->exit = true;  // its thread finishes what is queued, then leaves
  g.cv.notify_all();
  return CUDA_SUCCESS;
}
CUresult m_cuStreamSynchronize(CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  const std::uint64_t gen = g.gen;
  g.cv.wait(lk, [&] {
    return g.sticky != CUDA_SUCCESS || g.gen != gen || (s->queue.empty() && !s->busy);
  });
  return g.sticky;
}
CUresult m_cuStreamWaitEvent(CUstream h, CUevent ev, unsigned) {
  ENTER();
  MockStream* s = stream_of(h);
  MockEvent* e = event_of(ev);
  const std::uint64_t target = e->recorded;  // the record current at the call
  push(s, [e, target] {
    std::unique_lock l(g.mu);
    const std::uint64_t gen = g.gen;
    g.cv.wait(l, [&] { return e->done >= target || g.sticky != CUDA_SUCCESS || g.gen != gen; });
  });
  return CUDA_SUCCESS;
}
CUresult m_cuEventCreate(CUevent* ev, unsigned flags) {
  ENTER();
  *ev = reinterpret_cast<CUevent>(keep(new MockEvent{g.gen, flags}));
  return CUDA_SUCCESS;
}
CUresult m_cuEventDestroy(CUevent ev) {
  ENTER();
  event_of(ev)->destroyed = true;  // leaked: a later use aborts
  return CUDA_SUCCESS;
}
CUresult m_cuEventRecord(CUevent ev, CUstream h) {
  ENTER();
  MockEvent* e = event_of(ev);
  MockStream* s = stream_of(h);
  const std::uint64_t target = ++e->recorded;
  push(s, [e, target] {
    std::lock_guard l(g.mu);
    e->done = std::max(e->done, target);
    e->at = Clock::now();
    g.cv.notify_all();
  });
  return CUDA_SUCCESS;
}
CUresult m_cuEventQuery(CUevent ev) {
  ENTER();
  MockEvent* e = event_of(ev);
  return e->done >= e->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult m_cuEventSynchronize(CUevent ev) {
  ENTER();
  MockEvent* e = event_of(ev);
  const std::uint64_t gen = g.gen;
  g.cv.wait(lk, [&] { return e->done >= e->recorded || g.sticky != CUDA_SUCCESS || g.gen != gen; });
  return g.sticky;
}
CUresult m_cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
  ENTER();
  MockEvent* e0 = event_of(a);
  MockEvent* e1 = event_of(b);
  if ((e0->flags & CU_EVENT_DISABLE_TIMING) || (e1->flags & CU_EVENT_DISABLE_TIMING))
    return CUDA_ERROR_INVALID_HANDLE;
  if (e0->recorded == 0 || e1->recorded == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (e0->done < e0->recorded || e1->done < e1->recorded) return CUDA_ERROR_NOT_READY;
  *ms = std::chrono::duration<float, std::milli>(e1->at - e0->at).count();
  return CUDA_SUCCESS;
}

// The image's length, as the driver works it out from the headers.
std::size_t image_size(const std::uint8_t* p) {
  if (std::memcmp(p,
                  "\x7f"
                  "ELF",
                  4) == 0) {
    std::uint64_t shoff;
    std::uint16_t shentsize, shnum;
    std::memcpy(&shoff, p + 0x28, 8);
    std::memcpy(&shentsize, p + 0x3a, 2);
    std::memcpy(&shnum, p + 0x3c, 2);
    return shoff + std::size_t{shentsize} * shnum;
  }
  std::uint32_t magic;
  std::memcpy(&magic, p, 4);
  if (magic == 0xBA55ED50u) {
    std::uint16_t header;
    std::uint64_t body;
    std::memcpy(&header, p + 6, 2);
    std::memcpy(&body, p + 8, 8);
    return header + body;
  }
  return std::strlen(reinterpret_cast<const char*>(p));  // PTX: a C string
}

CUresult m_cuModuleLoadDataEx(CUmodule* mod, const void* image, unsigned n, CUjit_option* opts,
                              void** vals) {
  ENTER();
  const auto* p = static_cast<const std::uint8_t*>(image);
  if (reinterpret_cast<std::uintptr_t>(p) % 8 != 0) misuse("module image not 8-byte aligned");
  auto log = [&](const char* text) {
    char* buf = nullptr;
    std::size_t size = 0;
    for (unsigned i = 0; i < n; ++i) {
      if (opts[i] == CU_JIT_ERROR_LOG_BUFFER) buf = static_cast<char*>(vals[i]);
      if (opts[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        size = reinterpret_cast<std::uintptr_t>(vals[i]);
    }
    if (buf != nullptr && size > 0) std::snprintf(buf, size, "%s", text);
  };
  const bool elf = std::memcmp(p,
                               "\x7f"
                               "ELF",
                               4) == 0;
  std::uint32_t magic;
  std::memcpy(&magic, p, 4);
  const bool fatbin = magic == 0xBA55ED50u;
  if (elf) {
    std::uint16_t machine;
    std::memcpy(&machine, p + 0x12, 2);
    if (machine != 190) return CUDA_ERROR_INVALID_IMAGE;  // EM_CUDA
  }
  const std::string_view text(reinterpret_cast<const char*>(p), image_size(p));
  if (!elf && !fatbin) {
    if (text.find(".version") == std::string_view::npos) return CUDA_ERROR_INVALID_IMAGE;
    if (text.find(".entry") == std::string_view::npos) {
      log("ptxas fatal   : syntax error (mock JIT)");
      return CUDA_ERROR_INVALID_PTX;
    }
  }
  auto* m = keep(new MockModule);
  m->gen = g.gen;
  for (const Kernel& k : kKernels)
    if (text.find(k.name) != std::string_view::npos) m->kernels.push_back(&k);
  if (m->kernels.empty()) return CUDA_ERROR_INVALID_IMAGE;
  *mod = reinterpret_cast<CUmodule>(m);
  return CUDA_SUCCESS;
}
MockModule* module_of(CUmodule h) {
  auto* m = reinterpret_cast<MockModule*>(h);
  if (m->gen != g.gen) misuse("module used after a context reset");
  if (m->unloaded) misuse("module used after cuModuleUnload");
  return m;
}
CUresult m_cuModuleUnload(CUmodule h) {
  ENTER();
  module_of(h)->unloaded = true;
  return CUDA_SUCCESS;
}
CUresult m_cuModuleGetFunction(CUfunction* f, CUmodule h, const char* name) {
  ENTER();
  MockModule* m = module_of(h);
  for (const Kernel* k : m->kernels)
    if (std::strcmp(k->name, name) == 0) {
      *f = reinterpret_cast<CUfunction>(keep(new MockFunction{m, k}));
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_NOT_FOUND;
}
CUresult m_cuFuncGetAttribute(int* v, CUfunction_attribute, CUfunction) {
  *v = 0;
  return CUDA_SUCCESS;
}
CUresult m_cuFuncGetParamInfo(CUfunction f, std::size_t i, std::size_t* offset, std::size_t* size) {
  const Kernel* k = reinterpret_cast<MockFunction*>(f)->kernel;
  if (i >= k->sizes.size()) return CUDA_ERROR_INVALID_VALUE;
  std::size_t off = 0;
  for (std::size_t j = 0; j < i; ++j) off += k->sizes[j];
  *offset = off;
  *size = k->sizes[i];
  return CUDA_SUCCESS;
}
CUresult m_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned smem, CUstream h, void** params,
                          void** extra) {
  ENTER();
  MockStream* s = stream_of(h);
  auto* fn = reinterpret_cast<MockFunction*>(f);
  module_of(reinterpret_cast<CUmodule>(fn->module));
  if (extra != nullptr) misuse("cuLaunchKernel extra is not used by salusd");
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 ||
      bz > 64 || std::uint64_t{bx} * by * bz > 1024 || gy > 65535 || gz > 65535 || smem > 49152)
    return CUDA_ERROR_INVALID_VALUE;
  // The driver copies the values at launch time; so does the mock.
  Params copy;
  for (std::size_t i = 0; i < fn->kernel->sizes.size(); ++i) {
    if (params[i] == nullptr) misuse("kernel parameter %zu is null", i);
    const auto* v = static_cast<const std::uint8_t*>(params[i]);
    copy.emplace_back(v, v + fn->kernel->sizes[i]);
  }
  const Dims dims{{gx, gy, gz}, {bx, by, bz}};
  push(s, [fn, dims, copy = std::move(copy)] {
    {
      std::lock_guard l(g.mu);
      if (fn->module->unloaded)
        misuse("%s ran after its module was unloaded (unload did not wait)", fn->kernel->name);
    }
    fn->kernel->run(dims, copy);
  });
  return CUDA_SUCCESS;
}
CUresult m_cuLaunchHostFunc(CUstream h, CUhostFn fn, void* user) {
  ENTER();
  push(stream_of(h), [fn, user] { fn(user); });
  return CUDA_SUCCESS;
}

// ---- what a program's own CUDA use reaches (libsalus-shim's tests) ----

CUresult m_cuCtxGetDevice(CUdevice* d) {
  if (t_current != the_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult m_cuCtxGetCurrent(CUcontext* c) {
  *c = t_current;
  return CUDA_SUCCESS;
}
CUresult m_cuMemGetInfo_v1(unsigned* free, unsigned* total) {
  ENTER();
  *free = static_cast<unsigned>(kTotalMemory - g.used);
  *total = static_cast<unsigned>(kTotalMemory);
  return CUDA_SUCCESS;
}
CUresult m_cuMemAllocPitch(CUdeviceptr* p, std::size_t* pitch, std::size_t width,
                           std::size_t height, unsigned elem) {
  if (elem != 4 && elem != 8 && elem != 16) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t row = (width + 511) / 512 * 512;  // rows padded to 512 bytes
  if (CUresult r = m_cuMemAlloc(p, row * height); r != CUDA_SUCCESS) return r;
  *pitch = row;
  return CUDA_SUCCESS;
}
// Stream-ordered allocation: the memory is taken at once, freed in stream order.
CUresult m_cuMemAllocAsync(CUdeviceptr* p, std::size_t n, CUstream h) {
  {
    ENTER();
    stream_of(h);
  }
  return m_cuMemAlloc(p, n);
}
CUresult m_cuMemAllocFromPoolAsync(CUdeviceptr* p, std::size_t n, CUmemoryPool pool, CUstream h) {
  if (pool == nullptr) misuse("cuMemAllocFromPoolAsync with a null pool");
  return m_cuMemAllocAsync(p, n, h);
}
CUresult m_cuMemFreeAsync(CUdeviceptr p, CUstream h) {
  ENTER();
  MockStream* s = stream_of(h);
  if (g.device.find(p) == g.device.end()) misuse("cuMemFreeAsync of %#llx, not an allocation", p);
  push(s, [p] {
    std::lock_guard l(g.mu);
    auto it = g.device.find(p);
    g.used -= it->second;
    std::free(reinterpret_cast<void*>(p));
    g.device.erase(it);
  });
  return CUDA_SUCCESS;
}
CUresult m_cuMemPoolTrimTo(CUmemoryPool pool, std::size_t) {
  return pool == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult m_cuMemAllocManaged(CUdeviceptr* p, std::size_t n, unsigned) {
  return m_cuMemAlloc(p, n);
}
// VMM, with real memory: a physical handle is a memfd (so it can be exported
// as a POSIX file descriptor and imported by another process, which then sees
// the same bytes), a reservation is a PROT_NONE host mapping, cuMemMap maps the
// memfd there with MAP_FIXED (no access until cuMemSetAccess, as on a GPU), and
// cuMemUnmap puts PROT_NONE back. Device pointers are therefore host addresses
// the kernels and copies use directly. A handle counts in `used` from
// cuMemCreate until it is released and unmapped everywhere; an imported handle
// counts nothing (the memory is its exporter's).
constexpr std::size_t kGranularity = std::size_t{2} << 20;
struct MockHandle {
  std::size_t size;
  int fd = -1;
  int refs = 1;  // cuMemCreate or import, cuMemRetainAllocationHandle; cuMemRelease drops one
  int maps = 0;
  bool released = false;
  bool imported = false;
  bool exportable = false;
  CUmemAllocationProp prop{};
};
// Every handle this driver made (never freed: a stale handle is still known).
std::vector<MockHandle*>& g_handles = *new std::vector<MockHandle*>;
MockHandle* new_handle(std::size_t size, int fd) {
  auto* m = keep(new MockHandle{size, fd});
  g_handles.push_back(m);
  return m;
}
// Strict: a value this driver never handed out (a handle of the shim's that
// reached the driver untranslated) aborts.
MockHandle* handle_of(CUmemGenericAllocationHandle h) {
  auto* m = reinterpret_cast<MockHandle*>(h);
  if (std::find(g_handles.begin(), g_handles.end(), m) == g_handles.end())
    misuse("VMM handle %#llx was never made by this driver", h);
  return m;
}
// Copies through device memory take SALUS_MOCK_COPY_US_PER_MIB microseconds per
// MiB (default 0): slow enough for a test to kill a program in the middle of one.
void copy_delay(std::size_t n) {
  static const unsigned long long us = [] {
    const char* v = std::getenv("SALUS_MOCK_COPY_US_PER_MIB");
    return v == nullptr ? 0ULL : std::strtoull(v, nullptr, 10);
  }();
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us * (n >> 20)));
}
CUresult m_cuMemGetAllocationGranularity(std::size_t* gran, const CUmemAllocationProp* prop,
                                         CUmemAllocationGranularity_flags) {
  if (gran == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *gran = kGranularity;
  return CUDA_SUCCESS;
}
// Each cuMemCreate takes SALUS_MOCK_CREATE_US microseconds (default 0), outside
// the mock's lock, as a driver mapping gigabytes takes long while other threads'
// calls go on.
void create_delay() {
  static const unsigned long long us = [] {
    const char* v = std::getenv("SALUS_MOCK_CREATE_US");
    return v == nullptr ? 0ULL : std::strtoull(v, nullptr, 10);
  }();
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}
CUresult m_cuMemCreate(CUmemGenericAllocationHandle* h, std::size_t n,
                       const CUmemAllocationProp* prop, unsigned long long flags) {
  create_delay();
  ENTER();
  if (prop == nullptr || flags != 0 || n == 0 || n % kGranularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id != 0)
    return CUDA_ERROR_INVALID_DEVICE;
  if (n > kTotalMemory - g.used) return CUDA_ERROR_OUT_OF_MEMORY;
  if (no_memory_now()) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = ::memfd_create("mock-vmm", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(n)) != 0) {
    if (fd >= 0) ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // Fresh device memory is not zero: a test that reads back zeros proves nothing.
  if (void* tmp = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      tmp != MAP_FAILED) {
    std::memset(tmp, 0xab, n);
    ::munmap(tmp, n);
  }
  g.used += n;
  auto* m = new_handle(n, fd);
  m->exportable = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
  m->prop = *prop;
  *h = reinterpret_cast<CUmemGenericAllocationHandle>(m);
  return CUDA_SUCCESS;
}
void drop_handle_locked(MockHandle* m) {
  if (!m->released || m->maps != 0 || m->fd < 0) return;
  if (!m->imported) g.used -= m->size;
  ::close(m->fd);
  m->fd = -1;
}
CUresult m_cuMemRelease(CUmemGenericAllocationHandle h) {
  ENTER();
  auto* m = handle_of(h);
  if (m->released) misuse("cuMemRelease twice");
  m->released = --m->refs == 0;
  drop_handle_locked(m);
  return CUDA_SUCCESS;
}
MockHandle* mapped_at_locked(CUdeviceptr p);
CUresult m_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* h, void* addr) {
  ENTER();
  MockHandle* m = mapped_at_locked(reinterpret_cast<CUdeviceptr>(addr));
  if (h == nullptr || m == nullptr) return CUDA_ERROR_INVALID_VALUE;
  ++m->refs;
  *h = reinterpret_cast<CUmemGenericAllocationHandle>(m);
  return CUDA_SUCCESS;
}
CUresult m_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                  CUmemGenericAllocationHandle h) {
  ENTER();
  auto* m = handle_of(h);
  if (prop == nullptr || m->released) return CUDA_ERROR_INVALID_VALUE;
  *prop = m->prop;
  return CUDA_SUCCESS;
}
CUresult m_cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                        CUmemAllocationHandleType type, unsigned long long flags) {
  ENTER();
  auto* m = handle_of(h);
  if (out == nullptr || flags != 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_INVALID_VALUE;
  if (m->released || !m->exportable) return CUDA_ERROR_INVALID_VALUE;
  const int fd = ::fcntl(m->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}
CUresult m_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle,
                                          CUmemAllocationHandleType type) {
  ENTER();
  if (h == nullptr || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_INVALID_VALUE;
  const int fd =
      ::fcntl(static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle)), F_DUPFD_CLOEXEC, 0);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || st.st_size <= 0 ||
      static_cast<std::size_t>(st.st_size) % kGranularity != 0) {
    if (fd >= 0) ::close(fd);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  auto* m = new_handle(static_cast<std::size_t>(st.st_size), fd);
  m->imported = true;
  m->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  m->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  m->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  m->exportable = true;
  *h = reinterpret_cast<CUmemGenericAllocationHandle>(m);
  return CUDA_SUCCESS;
}
CUresult m_cuMemAddressReserve(CUdeviceptr* p, std::size_t n, std::size_t align, CUdeviceptr,
                               unsigned long long flags) {
  ENTER();
  if (p == nullptr || n == 0 || n % kGranularity != 0 || flags != 0 ||
      (align != 0 && align % kGranularity != 0))
    return CUDA_ERROR_INVALID_VALUE;
  const std::size_t a = std::max(align, kGranularity);
  // Over-reserve, then trim to an aligned range.
  void* raw = ::mmap(nullptr, n + a, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t at = (base + a - 1) / a * a;
  if (at > base) ::munmap(raw, at - base);
  if (base + n + a > at + n) ::munmap(reinterpret_cast<void*>(at + n), base + n + a - (at + n));
  g.reserved[at] = n;
  *p = at;
  return CUDA_SUCCESS;
}
CUresult m_cuMemAddressFree(CUdeviceptr p, std::size_t n) {
  ENTER();
  auto it = g.reserved.find(p);
  if (it == g.reserved.end() || it->second != n)
    misuse("cuMemAddressFree of %#llx, not a reservation", p);
  auto m = g.mapped.lower_bound(p);
  if (m != g.mapped.end() && m->first < p + n) misuse("cuMemAddressFree of a range still mapped");
  ::munmap(reinterpret_cast<void*>(p), n);
  g.reserved.erase(it);
  return CUDA_SUCCESS;
}
CUresult m_cuMemMap(CUdeviceptr p, std::size_t n, std::size_t off, CUmemGenericAllocationHandle h,
                    unsigned long long flags) {
  ENTER();
  auto* m = handle_of(h);
  if (m->released || off != 0 || n != m->size || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!range_in(g.reserved, p, n)) return CUDA_ERROR_INVALID_VALUE;
  auto next = g.mapped.lower_bound(p);
  if ((next != g.mapped.end() && next->first < p + n) ||
      (next != g.mapped.begin() &&
       std::prev(next)->first +
               handle_of(reinterpret_cast<CUmemGenericAllocationHandle>(std::prev(next)->second))
                   ->size >
           p))
    misuse("cuMemMap over a mapping");
  if (::mmap(reinterpret_cast<void*>(p), n, PROT_NONE, MAP_SHARED | MAP_FIXED, m->fd, 0) ==
      MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  g.mapped.emplace(p, m);
  ++m->maps;
  return CUDA_SUCCESS;
}
CUresult m_cuMemSetAccess(CUdeviceptr p, std::size_t n, const CUmemAccessDesc* desc,
                          std::size_t count) {
  ENTER();
  if (desc == nullptr || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int prot = PROT_NONE;
  for (std::size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id != 0)
      return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      prot = PROT_READ | PROT_WRITE;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ)
      prot = PROT_READ;
  }
  // Every byte of the range must be mapped.
  for (std::uintptr_t at = p; at < p + n;) {
    auto it = g.mapped.find(at);
    if (it == g.mapped.end()) return CUDA_ERROR_INVALID_VALUE;
    at += static_cast<MockHandle*>(it->second)->size;
  }
  if (::mprotect(reinterpret_cast<void*>(p), n, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
  for (std::uintptr_t at = p; at < p + n;) {
    const std::size_t size = static_cast<MockHandle*>(g.mapped[at])->size;
    if (prot == PROT_NONE)
      g.accessible.erase(at);
    else
      g.accessible[at] = size;
    at += size;
  }
  return CUDA_SUCCESS;
}
// Drops the mapping at `it`, putting the reservation's PROT_NONE back. Caller holds g.mu.
std::map<std::uintptr_t, void*>::iterator unmap_locked(
    std::map<std::uintptr_t, void*>::iterator it) {
  auto* m = static_cast<MockHandle*>(it->second);
  ::mmap(reinterpret_cast<void*>(it->first), m->size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  g.accessible.erase(it->first);
  --m->maps;
  drop_handle_locked(m);
  return g.mapped.erase(it);
}
void unmap_all_locked() {
  for (auto it = g.mapped.begin(); it != g.mapped.end();) it = unmap_locked(it);
}
CUresult m_cuMemUnmap(CUdeviceptr p, std::size_t n) {
  ENTER();
  // Unmapping waits for work that may still use the memory, as cuMemFree does.
  g.cv.wait(lk, [] {
    return g.sticky != CUDA_SUCCESS ||
           std::all_of(g.streams.begin(), g.streams.end(),
                       [](MockStream* s) { return s->queue.empty() && !s->busy; });
  });
  for (auto it = g.mapped.lower_bound(p); it != g.mapped.end() && it->first < p + n;)
    it = unmap_locked(it);
  return CUDA_SUCCESS;
}
MockHandle* mapped_at_locked(CUdeviceptr p) {
  auto it = g.mapped.upper_bound(p);
  if (it == g.mapped.begin()) return nullptr;
  --it;
  auto* m = static_cast<MockHandle*>(it->second);
  return p < it->first + m->size ? m : nullptr;
}
// Read-write where access was set (the mock keeps no finer grain), else none.
CUresult m_cuMemGetAccess(unsigned long long* flags, const CUmemLocation* where, CUdeviceptr p) {
  ENTER();
  if (flags == nullptr || where == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto it = g.mapped.upper_bound(p);
  if (it == g.mapped.begin() || mapped_at_locked(p) == nullptr) return CUDA_ERROR_INVALID_VALUE;
  --it;
  *flags = g.accessible.count(it->first) != 0 && where->type == CU_MEM_LOCATION_TYPE_DEVICE &&
                   where->id == 0
               ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
               : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return CUDA_SUCCESS;
}
// A dma-buf of a mapped range stands in as the fd of the handle mapped there.
CUresult m_cuMemGetHandleForAddressRange(void* out, CUdeviceptr p, std::size_t n,
                                         CUmemRangeHandleType type, unsigned long long flags) {
  ENTER();
  MockHandle* m = mapped_at_locked(p);
  if (out == nullptr || n == 0 || flags != 0 || type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD ||
      m == nullptr)
    return CUDA_ERROR_INVALID_VALUE;
  const int fd = ::fcntl(m->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}
// Multicast objects are not emulated: binding only checks what it is given.
CUresult m_cuMulticastBindMem(CUmemGenericAllocationHandle, std::size_t,
                              CUmemGenericAllocationHandle h, std::size_t, std::size_t n,
                              unsigned long long) {
  ENTER();
  auto* m = handle_of(h);
  return m->released || n == 0 || n > m->size ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult m_cuMulticastBindAddr(CUmemGenericAllocationHandle, std::size_t, CUdeviceptr p,
                               std::size_t n, unsigned long long) {
  ENTER();
  return n == 0 || mapped_at_locked(p) == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
// Synchronous copies (the legacy stream's semantics: after earlier work, done on return).
template <typename Copy>
CUresult sync_copy(std::unique_lock<std::mutex>& lk, std::size_t n, Copy copy) {
  g.cv.wait(lk, [] {
    return g.sticky != CUDA_SUCCESS ||
           std::all_of(g.streams.begin(), g.streams.end(),
                       [](MockStream* s) { return s->queue.empty() && !s->busy; });
  });
  if (g.sticky != CUDA_SUCCESS) return g.sticky;
  lk.unlock();
  copy_delay(n);
  copy();
  return CUDA_SUCCESS;
}
CUresult m_cuMemcpyHtoD(CUdeviceptr dst, const void* src, std::size_t n) {
  ENTER();
  check_device_range(dst, n, "cuMemcpyHtoD");
  return sync_copy(lk, n, [&] { std::memcpy(reinterpret_cast<void*>(dst), src, n); });
}
// SALUS_MOCK_FAIL_DTOD=1 makes it fail (CUDA_ERROR_UNKNOWN): the shim's lane
// promotion must undo what it did.
CUresult m_cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, std::size_t n) {
  ENTER();
  static const bool fail = std::getenv("SALUS_MOCK_FAIL_DTOD") != nullptr;
  if (fail) return CUDA_ERROR_UNKNOWN;
  check_device_range(dst, n, "cuMemcpyDtoD (dst)");
  check_device_range(src, n, "cuMemcpyDtoD (src)");
  if (n != 0 && dst != src && (dst < src ? src - dst < n : dst - src < n))
    misuse("overlapping cuMemcpyDtoD (dst %#llx, src %#llx, %zu bytes)", dst, src, n);
  return sync_copy(lk, n, [&] {
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  });
}
CUresult m_cuMemcpyDtoH(void* dst, CUdeviceptr src, std::size_t n) {
  ENTER();
  check_device_range(src, n, "cuMemcpyDtoH");
  return sync_copy(lk, n, [&] { std::memcpy(dst, reinterpret_cast<const void*>(src), n); });
}
CUresult m_cuLaunchKernelEx(const CUlaunchConfig* c, CUfunction f, void** params, void** extra) {
  return m_cuLaunchKernel(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                          c->blockDimZ, c->sharedMemBytes, c->hStream, params, extra);
}
CUresult m_cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                     unsigned bx, unsigned by, unsigned bz, unsigned smem,
                                     CUstream h, void** params) {
  return m_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, h, params, nullptr);
}
// A graph is not emulated: any non-null handle launches as an empty unit of work.
CUresult m_cuGraphLaunch(CUgraphExec e, CUstream h) {
  ENTER();
  if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
  push(stream_of(h), [] {});
  return CUDA_SUCCESS;
}
CUresult m_cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus* st) {
  ENTER();
  stream_of(h);
  *st = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult m_cuGetProcAddress_v1(const char* symbol, void** pfn, int version, cuuint64_t flags);

struct Entry {
  const char* name;
  void* fn;
  int version;  // salusd's: the version it must ask for; others: the version it came in
  bool strict = true;
};
#define E(n, v) \
  { #n, reinterpret_cast < void*>(&m_##n), v }
#define V(n, f, v) \
  { #n, reinterpret_cast < void*>(&f), v, false }
const Entry kEntries[] = {
    E(cuGetErrorName, 12000),
    E(cuGetErrorString, 12000),
    E(cuInit, 12000),
    E(cuDriverGetVersion, 12000),
    E(cuDeviceGet, 12000),
    E(cuDeviceGetCount, 12000),
    E(cuDeviceGetName, 12000),
    E(cuDeviceGetUuid, 12000),
    E(cuDeviceTotalMem, 12000),
    E(cuDeviceGetAttribute, 12000),
    E(cuDevicePrimaryCtxRetain, 12000),
    E(cuDevicePrimaryCtxRelease, 12000),
    E(cuDevicePrimaryCtxReset, 12000),
    E(cuCtxSetCurrent, 12000),
    E(cuCtxSynchronize, 12000),
    E(cuMemGetInfo, 12000),
    E(cuMemAlloc, 12000),
    E(cuMemFree, 12000),
    E(cuMemHostAlloc, 12000),
    E(cuMemFreeHost, 12000),
    E(cuMemHostRegister, 12000),
    E(cuMemHostUnregister, 12000),
    E(cuMemcpyHtoDAsync, 12000),
    E(cuMemcpyDtoHAsync, 12000),
    E(cuMemcpyDtoDAsync, 12000),
    E(cuMemsetD8Async, 12000),
    E(cuMemsetD32Async, 12000),
    E(cuStreamCreate, 12000),
    E(cuStreamDestroy, 12000),
    E(cuStreamSynchronize, 12000),
    E(cuStreamWaitEvent, 12000),
    E(cuEventCreate, 12000),
    E(cuEventDestroy, 12000),
    E(cuEventRecord, 12000),
    E(cuEventQuery, 12000),
    E(cuEventSynchronize, 12000),
    E(cuEventElapsedTime, 12000),
    E(cuModuleLoadDataEx, 12000),
    E(cuModuleUnload, 12000),
    E(cuModuleGetFunction, 12000),
    E(cuLaunchKernel, 12000),
    E(cuLaunchHostFunc, 12000),
    E(cuFuncGetAttribute, 12000),
    E(cuFuncGetParamInfo, 12040),
    // libsalus-shim's tests: an entry answers every version from its own up to
    // the next entry of the same name, as the real driver does.
    V(cuGetProcAddress, m_cuGetProcAddress_v1, 11030),
    V(cuGetProcAddress, cuGetProcAddress_v2, 12000),
    V(cuMemGetInfo, m_cuMemGetInfo_v1, 2000),
    V(cuCtxGetCurrent, m_cuCtxGetCurrent, 4000),
    V(cuCtxGetDevice, m_cuCtxGetDevice, 2000),
    V(cuMemAllocPitch, m_cuMemAllocPitch, 3020),
    V(cuMemAllocAsync, m_cuMemAllocAsync, 11020),
    V(cuMemAllocFromPoolAsync, m_cuMemAllocFromPoolAsync, 11020),
    V(cuMemFreeAsync, m_cuMemFreeAsync, 11020),
    V(cuMemPoolTrimTo, m_cuMemPoolTrimTo, 11020),
    V(cuMemAllocManaged, m_cuMemAllocManaged, 6000),
    V(cuMemCreate, m_cuMemCreate, 10020),
    V(cuMemRelease, m_cuMemRelease, 10020),
    V(cuMemAddressReserve, m_cuMemAddressReserve, 10020),
    V(cuMemAddressFree, m_cuMemAddressFree, 10020),
    V(cuMemMap, m_cuMemMap, 10020),
    V(cuMemUnmap, m_cuMemUnmap, 10020),
    V(cuMemSetAccess, m_cuMemSetAccess, 10020),
    V(cuMemGetAllocationGranularity, m_cuMemGetAllocationGranularity, 10020),
    V(cuMemExportToShareableHandle, m_cuMemExportToShareableHandle, 10020),
    V(cuMemImportFromShareableHandle, m_cuMemImportFromShareableHandle, 10020),
    V(cuMemRetainAllocationHandle, m_cuMemRetainAllocationHandle, 11000),
    V(cuMemGetAccess, m_cuMemGetAccess, 10020),
    V(cuMemGetAllocationPropertiesFromHandle, m_cuMemGetAllocationPropertiesFromHandle, 10020),
    V(cuMemGetHandleForAddressRange, m_cuMemGetHandleForAddressRange, 11070),
    V(cuMulticastBindMem, m_cuMulticastBindMem, 12010),
    V(cuMulticastBindAddr, m_cuMulticastBindAddr, 12010),
    V(cuMemcpyHtoD, m_cuMemcpyHtoD, 3020),
    V(cuMemcpyDtoH, m_cuMemcpyDtoH, 3020),
    V(cuMemcpyDtoD, m_cuMemcpyDtoD, 3020),
    V(cuLaunchKernelEx, m_cuLaunchKernelEx, 11060),
    V(cuLaunchCooperativeKernel, m_cuLaunchCooperativeKernel, 9000),
    V(cuGraphLaunch, m_cuGraphLaunch, 10000),
    V(cuStreamIsCapturing, m_cuStreamIsCapturing, 10000),
};
#undef E
#undef V

// The newest entry of `symbol` at or below `version`, as the driver answers.
const Entry* lookup(const char* symbol, int version, bool* too_old) {
  const Entry* best = nullptr;
  *too_old = false;
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, symbol) != 0) continue;
    if (e.version > version) {
      *too_old = true;
      continue;
    }
    if (best == nullptr || e.version > best->version) best = &e;
  }
  if (best != nullptr) *too_old = false;
  return best;
}

}  // namespace

// salusd takes only cuGetProcAddress_v2 from dlsym; libsalus-shim's tests take
// the others below too.
extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* symbol, void** pfn, int version, cuuint64_t flags,
    CUdriverProcAddressQueryResult* status) {
  if ((flags & ~cuuint64_t{CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM}) != 0)
    misuse("cuGetProcAddress flags %llu", flags);
  bool too_old = false;
  if (const Entry* e = lookup(symbol, version, &too_old)) {
    if (e->strict && version != e->version)
      misuse("%s asked for at version %d, not %d", symbol, version, e->version);
    *pfn = e->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
  }
  *pfn = nullptr;
  if (status)
    *status =
        too_old ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}

namespace {
CUresult m_cuGetProcAddress_v1(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}
}  // namespace

// A few exported entry points, for a program that takes them with dlsym (or
// links them) instead of asking cuGetProcAddress.
#define MOCK_EXPORT extern "C" __attribute__((visibility("default")))
#undef cuGetProcAddress
MOCK_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int version,
                                      cuuint64_t flags) {
  return m_cuGetProcAddress_v1(symbol, pfn, version, flags);
}
MOCK_EXPORT CUresult cuInit(unsigned flags) {
  return m_cuInit(flags);
}
MOCK_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t n) {
  return m_cuMemAlloc(p, n);
}
MOCK_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  return m_cuMemFree(p);
}
MOCK_EXPORT CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
  return m_cuMemGetInfo(free, total);
}
MOCK_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, unsigned smem,
                                    CUstream h, void** params, void** extra) {
  return m_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, h, params, extra);
}
