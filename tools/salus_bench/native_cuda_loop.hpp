// The baseline salus-bench compares salusd with: the built-in spin or gemm kernel
// launched back to back on one stream by a plain Driver-API program, with the
// launch shapes salusd's cuda backend uses, and nothing else in the way.
#pragma once

#include <cstdint>
#include <string>

namespace salus::bench {

struct NativeSpec {
  std::string kind;  // "gemm" (size^3 fp32) or "spin" (usec)
  std::uint32_t size = 0;
  std::uint64_t usec = 0;
  // Cycles per microsecond for spin; 0 calibrates here the way salusd does.
  double spin_cycles_per_usec = 0;
};

struct NativeResult {
  long iterations = 0;
  double seconds = 0;  // first launch to the stream's completion
};

// `n` timed iterations after `warmup` untimed ones on GPU 0. False with a reason
// when there is no driver or GPU, or the built-in kernels are not in this build.
bool native_loop(const NativeSpec& spec, long n, long warmup, NativeResult& out, std::string& why);
// Iterations until `seconds` have passed (checked every few iterations).
bool native_timed_loop(const NativeSpec& spec, double seconds, NativeResult& out, std::string& why);

}  // namespace salus::bench
