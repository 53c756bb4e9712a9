#include "vgpu/sim/sim_ops.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "vgpu/sim/cpu_kernels.hpp"
#include "vgpu/sim/host_mapping.hpp"
#include "vgpu/sim/realtime_contention.hpp"
#include "vgpu/sim/sim_modules.hpp"

namespace salus::vgpu::sim {
namespace {

// The caller has bounds-checked already; re-checking is a few compares and turns a
// caller bug into EFAULT (as a GPU fault would) instead of host memory corruption.
bool matrix_in(const HostMapping& memory, DevOffset at, std::uint64_t rows, std::uint64_t cols) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  if (rows != 0 && cols > kMax / rows / sizeof(float)) return false;
  return memory.contains(at, rows * cols * sizeof(float));
}

struct Executor {
  HostMapping& memory;
  RealTimeContention& contention;
  KernelTiming* timing;

  std::byte* at(DevOffset offset) const { return memory.data() + offset; }

  int operator()(const FillOp& op) const {
    if (!memory.contains(op.dst, op.length)) return EFAULT;
    return cpu_fill(at(op.dst), op.length, op.pattern, op.width) ? 0 : EINVAL;
  }
  int operator()(const CopyOp& op) const {
    if (!memory.contains(op.dst, op.length) || !memory.contains(op.src, op.length)) return EFAULT;
    std::memmove(at(op.dst), at(op.src), op.length);
    return 0;
  }
  int operator()(const SpinOp& op) const {
    // Capped at about 11 days so that deadlines, stretched by contention and added
    // to steady_clock's epoch, stay far from overflowing 64-bit nanoseconds.
    constexpr std::uint64_t kMaxUsec = 1'000'000'000'000;
    const std::uint64_t usec = op.usec < kMaxUsec ? op.usec : kMaxUsec;
    // NaN would poison the model's utilization sum; the model clamps the rest.
    const double util = std::isnan(op.util) ? 1.0 : op.util;
    const auto span = contention.run_kernel(static_cast<std::int64_t>(usec) * 1000, util,
                                            timing ? timing->ready_at : RealTimeContention::kNow);
    if (timing) *timing = {timing->ready_at, span.start, span.finish, true};
    return 0;
  }
  int operator()(const GemmOp& op) const {
    if (!matrix_in(memory, op.a, op.m, op.k) || !matrix_in(memory, op.b, op.k, op.n) ||
        !matrix_in(memory, op.c, op.m, op.n))
      return EFAULT;
    cpu_gemm(op.m, op.n, op.k, at(op.a), at(op.b), at(op.c));
    return 0;
  }
  int operator()(const ToHostOp& op) const {
    if (!memory.contains(op.src, op.length)) return EFAULT;
    if (op.length != 0) std::memcpy(op.host, at(op.src), op.length);
    return 0;
  }
  int operator()(const FromHostOp& op) const {
    if (!memory.contains(op.dst, op.length)) return EFAULT;
    if (op.length != 0) std::memcpy(at(op.dst), op.host, op.length);
    return 0;
  }
  int operator()(const LaunchOp& op) const {
    return op.launch ? run_sim_launch(*op.launch) : EINVAL;
  }
  int operator()(const NotifyOp&) const { return 0; }
};

}  // namespace

int execute_op(const SimOp& op, HostMapping& memory, RealTimeContention& contention,
               KernelTiming* timing) {
  return std::visit(Executor{memory, contention, timing}, op);
}

}  // namespace salus::vgpu::sim
