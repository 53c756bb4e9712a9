// A driver out-of-memory on an allocation the session's budget allows, tried
// again for a moment before the program sees it (SALUS_DRIVER_OOM_RETRY_MS,
// default 1000; 0: never).
//
// Admission promised the program this memory, but the card may not have it
// free yet: salusd gives memory its arena no longer holds back to the card off
// its lock, which takes a while for gigabytes, and the driver tears down a
// killed program's context a moment after the process is gone, while salusd
// admits the next session at once. A program told "out of memory" then would
// fail (or, under PyTorch, raise) for a condition that lasts milliseconds.
// Only the failure path runs this: a successful allocation costs one compare.
#include <inttypes.h>
#include <time.h>

#include <cstdio>
#include <cstdlib>

#include "client/shim/shim.hpp"

namespace salus::shim {

namespace {

constexpr std::int64_t kDefaultWindowNs = 1'000'000'000;
constexpr std::int64_t kLongestSleepNs = 64'000'000;

std::int64_t window_ns() {
  static const std::int64_t ns = [] {
    const char* v = std::getenv("SALUS_DRIVER_OOM_RETRY_MS");
    if (v == nullptr || *v == '\0') return kDefaultWindowNs;
    char* end = nullptr;
    const long long ms = std::strtoll(v, &end, 10);
    if (*end != '\0' || ms < 0) return kDefaultWindowNs;
    return static_cast<std::int64_t>(ms) * 1'000'000;
  }();
  return ns;
}

std::int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace

DriverOomRetry::DriverOomRetry(std::uint64_t bytes, const char* what)
    : bytes_(bytes), what_(what), start_ns_(monotonic_ns()) {}

bool DriverOomRetry::wait() {
  // Without a budget (no salusd yet) nothing was promised: the card is full.
  if (__atomic_load_n(&gate()->budget_bytes, __ATOMIC_ACQUIRE) == UINT64_MAX) return false;
  const std::int64_t left = window_ns() - (monotonic_ns() - start_ns_);
  if (left <= 0) return false;
  const std::int64_t ns = sleep_ns_ < left ? sleep_ns_ : left;
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  ::nanosleep(&ts, nullptr);
  sleep_ns_ = sleep_ns_ * 2 < kLongestSleepNs ? sleep_ns_ * 2 : kLongestSleepNs;
  ++tries_;
  return true;
}

void DriverOomRetry::finish(CUresult last) {
  if (tries_ == 0) return;
  const double ms = static_cast<double>(monotonic_ns() - start_ns_) / 1e6;
  char line[320];
  if (last == CUDA_SUCCESS) {
    std::snprintf(line, sizeof line,
                  "%s of %" PRIu64
                  " bytes: the driver had no memory for it within the budget; it had after "
                  "%.0f ms (the card was still freeing memory: salusd's arena or an exited "
                  "program's)",
                  what_, bytes_, ms);
  } else {
    salus_gate* g = gate();
    std::snprintf(line, sizeof line,
                  "%s of %" PRIu64
                  " bytes: out of memory from the driver although the budget allows it "
                  "(budget %" PRIu64 ", charged %" PRIu64
                  "), still after %.0f ms: something on the GPU holds more than admission "
                  "counts for it",
                  what_, bytes_, __atomic_load_n(&g->budget_bytes, __ATOMIC_ACQUIRE), charged_now(),
                  ms);
  }
  post_note(line);
}

}  // namespace salus::shim
