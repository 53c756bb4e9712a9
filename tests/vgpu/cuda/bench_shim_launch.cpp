// The cost libsalus-shim adds to a kernel launch, against the mock driver.
//
//   bench_shim_launch SHIM.so [--launches N] [--rounds R] [--max-ns X]
//
// Runs the same launch loop in child processes of itself, alternately without
// and with SHIM.so preloaded, R rounds each, and reports the best ns per launch
// of each and their difference (the hook's cost). Each launch has a zero grid,
// which the mock driver rejects right after taking its lock, so the driver's
// own share is small and constant while the hook runs its whole path (count,
// yield check, real-pointer load, call). Exits 1 if the difference exceeds
// --max-ns (default 300, the 0.3 us target). On a GPU host, run it with
// the real libcuda.so.1 on the library path instead of the mock: a real driver
// rejects the zero grid as cheaply.
//
//   bench_shim_launch --child N   (internal) one loop; prints ns per launch
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// Valid PTX for a real driver's JIT too (the mock finds the kernel by name).
const char kPtx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry salus_spin(.param .u64 c)\n{\n\tret;\n}\n";

int child(long n) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) return 2;
  auto gpa = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  auto get = [&](const char* name) {
    void* p = nullptr;
    gpa(name, &p, 12000, 0, nullptr);
    return p;
  };
  reinterpret_cast<PFN_cuInit_v2000>(get("cuInit"))(0);
  CUcontext ctx = nullptr;
  reinterpret_cast<PFN_cuDevicePrimaryCtxRetain_v7000>(get("cuDevicePrimaryCtxRetain"))(&ctx, 0);
  reinterpret_cast<PFN_cuCtxSetCurrent_v4000>(get("cuCtxSetCurrent"))(ctx);
  CUmodule mod = nullptr;
  CUfunction f = nullptr;
  reinterpret_cast<PFN_cuModuleLoadDataEx_v2010>(get("cuModuleLoadDataEx"))(&mod, kPtx, 0, nullptr,
                                                                            nullptr);
  reinterpret_cast<PFN_cuModuleGetFunction_v2000>(get("cuModuleGetFunction"))(&f, mod,
                                                                              "salus_spin");
  CUstream s = nullptr;
  reinterpret_cast<PFN_cuStreamCreate_v2000>(get("cuStreamCreate"))(&s, CU_STREAM_NON_BLOCKING);
  auto launch = reinterpret_cast<PFN_cuLaunchKernel_v4000>(get("cuLaunchKernel"));
  unsigned long long cycles = 0;
  void* params[] = {&cycles};
  long rejected = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i)
    rejected += launch(f, 0, 1, 1, 1, 1, 1, 0, s, params, nullptr) == CUDA_ERROR_INVALID_VALUE;
  const auto t1 = std::chrono::steady_clock::now();
  if (rejected != n) return 3;
  std::printf("%.3f\n", std::chrono::duration<double, std::nano>(t1 - t0).count() / n);
  return 0;
}

// One child run; ns per launch, or a negative number on failure.
double run(const char* self, const char* preload, long n) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    if (preload != nullptr)
      setenv("LD_PRELOAD", preload, 1);
    else
      unsetenv("LD_PRELOAD");
    const std::string count = std::to_string(n);
    execl(self, self, "--child", count.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  char buf[64] = {};
  const ssize_t got = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (got <= 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return std::atof(buf);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--child") == 0) return child(std::atol(argv[2]));
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s SHIM.so [--launches N] [--rounds R] [--max-ns X]\n", argv[0]);
    return 2;
  }
  long n = 2'000'000;
  int rounds = 5;
  double max_ns = 300;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--launches") == 0) n = std::atol(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--max-ns") == 0) max_ns = std::atof(argv[i + 1]);
  }
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return 2;
  self[len] = '\0';
  std::vector<double> base, shim;
  for (int r = 0; r < rounds; ++r) {
    base.push_back(run(self, nullptr, n));
    shim.push_back(run(self, argv[1], n));
    if (base.back() < 0 || shim.back() < 0) {
      std::fprintf(stderr, "bench_shim_launch: a child run failed\n");
      return 2;
    }
  }
  const double b = *std::min_element(base.begin(), base.end());
  const double s = *std::min_element(shim.begin(), shim.end());
  std::printf("launches per run: %ld, rounds: %d (best of each)\n", n, rounds);
  std::printf("without shim: %.1f ns/launch\n", b);
  std::printf("with shim:    %.1f ns/launch (%.3fx)\n", s, s / b);
  std::printf("hook cost:    %.1f ns/launch (limit %.0f)\n", s - b, max_ns);
  return s - b <= max_ns ? 0 : 1;
}
