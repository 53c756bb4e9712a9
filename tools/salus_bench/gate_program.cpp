#include "tools/salus_bench/gate_program.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>

#include <fmt/format.h>

#include "tools/salus_bench/bench_common.hpp"

namespace salus::bench {
namespace {

template <class T>
std::atomic_ref<T> at(T& f) {
  return std::atomic_ref<T>(f);
}

}  // namespace

GateProgram::GateProgram() {
  memfd_ = ::memfd_create("salus-gate", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd_ < 0 || ::ftruncate(memfd_, sizeof(salus_gate)) != 0) die("memfd");
  void* p = ::mmap(nullptr, sizeof(salus_gate), PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
  if (p == MAP_FAILED) die("mmap gate");
  g_ = static_cast<salus_gate*>(p);
  g_->magic = SALUS_GATE_MAGIC;
  g_->version = SALUS_GATE_VERSION;
  g_->size = sizeof(salus_gate);
  g_->pid = ::getpid();
  if (::fcntl(memfd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) die("seals");
  bell_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (bell_ < 0) die("eventfd");
}

GateProgram::~GateProgram() {
  ::munmap(g_, sizeof(salus_gate));
  ::close(memfd_);
  ::close(bell_);
}

std::string GateProgram::attachment() const {
  return fmt::format("attach gate={} bell={}\n", memfd_, bell_);
}

void GateProgram::ring() const {
  const std::uint64_t one = 1;
  if (::write(bell_, &one, sizeof one) != sizeof one) die("eventfd write");
}

// As the shim waits: a futex on grant_word until `granted` reaches k.
void GateProgram::wait_granted(std::uint64_t k) {
  for (;;) {
    const std::uint32_t w = at(g_->grant_word).load();
    if (at(g_->granted).load() >= k) return;
    if (at(g_->state).load() == SALUS_GATE_DETACHED) die("salusd detached the gate");
    ::syscall(SYS_futex, &g_->grant_word, FUTEX_WAIT, w, nullptr, nullptr, 0);
  }
}

void GateProgram::start() {
  at(g_->marking).store(SALUS_MARK_EXPLICIT);
  at(g_->requested).store(std::uint64_t{1});
  ring();
  wait_granted(1);
}

std::vector<double> GateProgram::boundaries(std::uint64_t lag, std::size_t warmup,
                                            std::size_t count,
                                            std::chrono::steady_clock::time_point until) {
  std::vector<double> rt;
  for (std::size_t i = 0; rt.size() < count && Clock::now() < until; ++i) {
    const std::uint64_t k = ++k_;
    const auto t0 = Clock::now();
    at(g_->gpu_ns_total).fetch_add(1000);
    at(g_->completed).store(k - lag);
    at(g_->requested).store(k + 1);
    ring();
    wait_granted(k + 1);
    if (i >= warmup) rt.push_back(us_since(t0));
  }
  return rt;
}

}  // namespace salus::bench
