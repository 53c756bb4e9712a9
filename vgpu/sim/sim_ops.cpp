#include "vgpu/sim/sim_ops.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "vgpu/sim/cpu_kernels.hpp"
#include "vgpu/sim/host_mapping.hpp"
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
  // Spins never get here (StreamRunner starts them on the contention model).
  int operator()(const SpinOp&) const { return EINVAL; }
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

std::int64_t spin_alone_ns(const SpinOp& op) {
  constexpr std::uint64_t kMaxUsec = 1'000'000'000'000;
  return static_cast<std::int64_t>(op.usec < kMaxUsec ? op.usec : kMaxUsec) * 1000;
}

double spin_util(const SpinOp& op) {
  return std::isnan(op.util) ? 1.0 : op.util;
}

int execute_op(const SimOp& op, HostMapping& memory) {
  return std::visit(Executor{memory}, op);
}

}  // namespace salus::vgpu::sim
