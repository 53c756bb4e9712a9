#include "vgpu/host_regions.hpp"

#include <signal.h>
#include <sys/mman.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

namespace salus::vgpu {

namespace {

// The guarded mappings, readable from a signal handler: no locks, no
// allocation. A slot is free while its base is 0.
constexpr std::size_t kMaxGuarded = 4096;
struct Guarded {
  std::atomic<std::uintptr_t> base{0};
  std::atomic<std::uintptr_t> size{0};
};
std::array<Guarded, kMaxGuarded> g_guarded;
std::atomic<std::uint64_t> g_faults{0};
struct sigaction g_previous {};
std::once_flag g_install_once;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (Guarded& g : g_guarded) {
    const std::uintptr_t base = g.base.load(std::memory_order_acquire);
    if (base == 0) continue;
    const std::uintptr_t size = g.size.load(std::memory_order_relaxed);
    if (addr < base || addr - base >= size) continue;
    // The file under this mapping shrank. Zero pages in its place let the
    // faulting copy finish; the transfer is failed by its owner afterwards.
    // (mmap is a plain system call here, safe in a handler.)
    ::mmap(reinterpret_cast<void*>(base), size, PROT_READ | PROT_WRITE,
           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    g_faults.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Not ours: whatever was there before decides.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) return g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != SIG_DFL &&
             g_previous.sa_handler != nullptr) {
    return g_previous.sa_handler(sig);
  }
  ::signal(SIGBUS, SIG_DFL);  // the fault repeats on return and ends the process
}

void install_handler() {
  std::call_once(g_install_once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous);
  });
}

bool guard(std::uintptr_t base, std::uintptr_t size) {
  for (Guarded& g : g_guarded) {
    std::uintptr_t expected = 0;
    // Claim with a sentinel so the handler never sees a base without its size.
    if (!g.base.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    g.size.store(size, std::memory_order_relaxed);
    g.base.store(base, std::memory_order_release);
    return true;
  }
  return false;
}

void unguard(std::uintptr_t base) {
  for (Guarded& g : g_guarded) {
    std::uintptr_t expected = base;
    if (g.base.compare_exchange_strong(expected, 0, std::memory_order_acq_rel)) return;
  }
}

}  // namespace

std::uint64_t host_region_faults() {
  return g_faults.load(std::memory_order_relaxed);
}

HostRegions::~HostRegions() {
  for (const auto& [id, r] : regions_) unmap(r);
}

int HostRegions::map(int fd, Bytes size, bool writable, RegionId& out, std::string& why) {
  if (size == 0) {
    why = "an empty region";
    return EINVAL;
  }
  install_handler();
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* p = ::mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    why = fmt::format("mapping {} bytes: {}", size, std::strerror(err));
    return err;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  if (!guard(base, size)) {
    ::munmap(p, size);
    why = fmt::format("more than {} host regions are mapped", kMaxGuarded);
    return ENOSPC;
  }
  std::lock_guard lk(mu_);
  while (next_ == 0 || regions_.count(next_)) ++next_;
  out = next_++;
  regions_[out] = Region{static_cast<char*>(p), size, writable, false, 0};
  return 0;
}

std::optional<HostRegions::Region> HostRegions::find(RegionId id) const {
  std::lock_guard lk(mu_);
  if (auto it = regions_.find(id); it != regions_.end()) return it->second;
  return std::nullopt;
}

char* HostRegions::at(RegionId id, Bytes offset, Bytes length, bool for_write) const {
  std::lock_guard lk(mu_);
  const auto it = regions_.find(id);
  if (it == regions_.end()) throw std::invalid_argument(fmt::format("no host region {}", id));
  const Region& r = it->second;
  if (offset > r.size || length > r.size - offset)
    throw std::invalid_argument(
        fmt::format("+{} len {} is past host region {} ({} bytes)", offset, length, id, r.size));
  if (for_write && !r.writable)
    throw std::invalid_argument(fmt::format("host region {} is read-only", id));
  return r.base + offset;
}

void HostRegions::set_pinned(RegionId id, bool pinned, std::uint64_t generation) {
  std::lock_guard lk(mu_);
  if (auto it = regions_.find(id); it != regions_.end()) {
    it->second.pinned = pinned;
    it->second.pin_generation = generation;
  }
}

std::optional<HostRegions::Region> HostRegions::remove(RegionId id) {
  std::lock_guard lk(mu_);
  const auto it = regions_.find(id);
  if (it == regions_.end()) return std::nullopt;
  Region r = it->second;
  regions_.erase(it);
  return r;
}

void HostRegions::unmap(const Region& r) {
  if (r.base == nullptr) return;
  unguard(reinterpret_cast<std::uintptr_t>(r.base));
  ::munmap(r.base, r.size);
}

}  // namespace salus::vgpu
