// How a program's calls reach the shim's hooks instead of libcuda.
//
// Programs find driver functions in three ways, and each gets the hook:
//   - linked against libcuda: the shim, first in the search order (LD_PRELOAD or
//     /etc/ld.so.preload), exports the hooked cu* symbols itself;
//   - dlopen("libcuda.so.1") + dlsym (Triton, cudart < 11.3, ctypes): the shim
//     exports dlsym in both glibc symbol versions and swaps hooked names;
//   - cuGetProcAddress(_v2) (cudart >= 11.3, static cudart, cuBLAS, cuDNN,
//     PyTorch's driver_api.cpp): the shim asks the real driver, then swaps the
//     answer for the hook of exactly the version the driver picked for the
//     caller's cudaVersion, so an old caller never gets a newer signature.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "client/shim/shim.hpp"

// dlopen and dlvsym at their oldest versions (libdl's GLIBC_2.2.5, which glibc
// 2.34+ keeps in libc as compat symbols): the shim then loads into images with
// any glibc from 2.17 on, not only those built with 2.34 or later.
__asm__(".symver dlopen, dlopen@GLIBC_2.2.5");
__asm__(".symver dlvsym, dlvsym@GLIBC_2.2.5");

namespace salus::shim {

std::atomic<void*> g_real[kFnCount][kSlots];

namespace {
using DlsymFn = void* (*)(void*, const char*);
}  // namespace
}  // namespace salus::shim

// glibc's dlsym, found with dlvsym (never through our own dlsym). Read by the
// assembly trampoline below, so it has C linkage.
extern "C" {
__attribute__((visibility("hidden"))) void* salus_real_dlsym_ptr = nullptr;
}

namespace salus::shim {
namespace {

void init_real_dlsym() {
  // No lock and no allocation: dlsym may be called while the loader, malloc or
  // another thread of ours is half-way through. Racing threads store the same value.
  void* p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (p == nullptr) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  __atomic_store_n(&salus_real_dlsym_ptr, p, __ATOMIC_RELEASE);
}

}  // namespace

void* real_dlsym(void* handle, const char* name) {
  void* p = __atomic_load_n(&salus_real_dlsym_ptr, __ATOMIC_ACQUIRE);
  if (p == nullptr) {
    init_real_dlsym();
    p = __atomic_load_n(&salus_real_dlsym_ptr, __ATOMIC_ACQUIRE);
  }
  return p == nullptr ? nullptr : reinterpret_cast<DlsymFn>(p)(handle, name);
}

void* driver_handle() {
  static void* handle = [] {
    const char* path = std::getenv("SALUS_SHIM_LIBCUDA");
    return dlopen(path != nullptr && *path != '\0' ? path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  }();
  return handle;
}

void* resolve_real(Fn f, int slot) {
  const HookEntry* e = find_hook_by_fn(f);
  if (e == nullptr || e->symbol[slot] == nullptr) return nullptr;
  void* h = driver_handle();
  void* p = h == nullptr ? nullptr : real_dlsym(h, e->symbol[slot]);
  if (p != nullptr && p != e->hook[slot]) {
    void* expected = nullptr;
    g_real[f][slot].compare_exchange_strong(expected, p, std::memory_order_release);
  }
  return g_real[f][slot].load(std::memory_order_acquire);
}

void* driver_proc(const char* name) {
  static const auto gpa = [] {
    void* h = driver_handle();
    return reinterpret_cast<PFN_cuGetProcAddress_v12000>(
        h == nullptr ? nullptr : real_dlsym(h, "cuGetProcAddress_v2"));
  }();
  void* p = nullptr;
  if (gpa == nullptr || gpa(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr) != CUDA_SUCCESS)
    return nullptr;
  return p;
}

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* h = driver_handle();
    auto gpa = reinterpret_cast<PFN_cuGetProcAddress_v12000>(
        h == nullptr ? nullptr : real_dlsym(h, "cuGetProcAddress_v2"));
    if (gpa == nullptr) return r;
    bool ok = true;
    auto get = [&](const char* name, auto& out) {
      void* p = nullptr;
      if (gpa(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr) != CUDA_SUCCESS ||
          p == nullptr)
        ok = false;
      out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(p);
    };
    get("cuEventCreate", r.event_create);
    get("cuEventRecord", r.event_record);
    get("cuEventSynchronize", r.event_synchronize);
    get("cuEventElapsedTime", r.event_elapsed);
    get("cuCtxGetCurrent", r.ctx_get_current);
    get("cuCtxSetCurrent", r.ctx_set_current);
    get("cuStreamIsCapturing", r.stream_is_capturing);
    r.ok = ok;
    return r;
  }();
  return d;
}

namespace {

// The driver answered `*pfn` for (symbol, version, flags): hand out the hook of
// that exact signature instead. A version newer than the cuda.h we were built
// with may have brought a new signature we cannot know; then the answer is
// hooked only if it is the very function libcuda exports under our name.
void swap_answer(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  if (symbol == nullptr || pfn == nullptr || *pfn == nullptr) return;
  const HookEntry* e = find_hook(symbol, version);
  if (e == nullptr) return;
  const int slot =
      (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0 && e->hook[1] != nullptr ? 1 : 0;
  if (*pfn == e->hook[slot]) return;
  if (version > CUDA_VERSION) {
    void* h = driver_handle();
    if (h == nullptr || real_dlsym(h, e->symbol[slot]) != *pfn) return;
  }
  g_real[e->fn][slot].store(*pfn, std::memory_order_release);
  *pfn = e->hook[slot];
}

}  // namespace
}  // namespace salus::shim

using namespace salus::shim;

// ---- dlsym ----

// Returns the hook to hand out for `name`, or null to let glibc's dlsym answer.
extern "C" __attribute__((visibility("hidden"), used)) void* salus_dlsym_hook(void* handle,
                                                                              const char* name) {
  if (__atomic_load_n(&salus_real_dlsym_ptr, __ATOMIC_ACQUIRE) == nullptr) init_real_dlsym();
  if (name == nullptr || name[0] != 'c' || name[1] != 'u') return nullptr;
  int slot = 0;
  const HookEntry* e = find_hook_by_symbol(name, &slot);
  if (e == nullptr) return nullptr;
  // A hooked name: ask glibc ourselves (RTLD_NEXT then means "after the shim",
  // which is where libcuda is).
  void* r = real_dlsym(handle, name);
  if (r == nullptr || r == e->hook[slot]) return nullptr;
  g_real[e->fn][slot].store(r, std::memory_order_release);
  return e->hook[slot];
}

#if defined(__x86_64__)
// dlsym itself: every name we do not hook must reach glibc's dlsym with the
// caller's own return address on the stack, because dlsym(RTLD_NEXT, ...) and
// the caller's namespace are found from it. A C wrapper cannot promise a tail
// call, so the entry is a trampoline: ask salus_dlsym_hook, then either return
// its answer or jump (not call) to glibc's dlsym with the original arguments.
__asm__(R"(
  .text
  .globl salus_dlsym_entry
  .type salus_dlsym_entry, @function
salus_dlsym_entry:
  .cfi_startproc
  push %rdi
  .cfi_adjust_cfa_offset 8
  push %rsi
  .cfi_adjust_cfa_offset 8
  sub $8, %rsp
  .cfi_adjust_cfa_offset 8
  call salus_dlsym_hook
  add $8, %rsp
  .cfi_adjust_cfa_offset -8
  pop %rsi
  .cfi_adjust_cfa_offset -8
  pop %rdi
  .cfi_adjust_cfa_offset -8
  test %rax, %rax
  jnz 1f
  jmp *salus_real_dlsym_ptr(%rip)
1:
  ret
  .cfi_endproc
  .size salus_dlsym_entry, .-salus_dlsym_entry
  .symver salus_dlsym_entry, dlsym@GLIBC_2.2.5
  .globl salus_dlsym_entry_new
  .set salus_dlsym_entry_new, salus_dlsym_entry
  .symver salus_dlsym_entry_new, dlsym@@GLIBC_2.34
)");
#else
#error "libsalus-shim: the dlsym trampoline is written for x86-64 only"
#endif

// ---- cuGetProcAddress, both versions ----

#undef cuGetProcAddress
extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress(const char* symbol,
                                                                            void** pfn, int version,
                                                                            cuuint64_t flags) {
  auto f = real<PFN_cuGetProcAddress_v11030>(kGetProcAddress);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = f(symbol, pfn, version, flags);
  if (r == CUDA_SUCCESS) swap_answer(symbol, pfn, version, flags);
  return r;
}

extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* symbol, void** pfn, int version, cuuint64_t flags,
    CUdriverProcAddressQueryResult* status) {
  auto f = real<PFN_cuGetProcAddress_v12000>(kGetProcAddress_v2);
  if (f == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = f(symbol, pfn, version, flags, status);
  if (r == CUDA_SUCCESS) swap_answer(symbol, pfn, version, flags);
  return r;
}

// ---- cuInit ----

extern "C" __attribute__((visibility("default"))) CUresult cuInit(unsigned flags) {
  auto f = real<PFN_cuInit_v2000>(kInit);
  if (f == nullptr) return CUDA_ERROR_NO_DEVICE;
  const CUresult r = f(flags);
  if (r == CUDA_SUCCESS) after_cuinit();
  return r;
}
