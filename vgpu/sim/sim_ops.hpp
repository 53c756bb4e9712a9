// The ops a sim stream queues, as small copyable values (no heap per op), and how
// each one runs against the device's host memory and contention model.
#pragma once

#include <cstdint>
#include <memory>
#include <variant>

#include "vgpu/device.hpp"

namespace salus::vgpu::sim {

class HostMapping;
struct SimLaunch;

struct FillOp {
  DevOffset dst;
  Bytes length;
  std::uint32_t pattern;
  unsigned width;
};
struct CopyOp {
  DevOffset dst;
  DevOffset src;
  Bytes length;
};
struct SpinOp {
  std::uint64_t usec;
  double util;
};
struct GemmOp {
  std::uint32_t m, n, k;
  DevOffset a, b, c;
};
struct ToHostOp {
  void* host;
  DevOffset src;
  Bytes length;
};
struct FromHostOp {
  DevOffset dst;
  const void* host;
  Bytes length;
};
// A user kernel from a module (sim_modules.hpp). Shared, not copied, so the op
// stays small and the module stays loaded until the launch has run.
struct LaunchOp {
  std::shared_ptr<const SimLaunch> launch;
};
// Not executed: the stream reports completion when it reaches one.
struct NotifyOp {
  std::uint64_t token;
};

using SimOp =
    std::variant<FillOp, CopyOp, SpinOp, GemmOp, ToHostOp, FromHostOp, LaunchOp, NotifyOp>;

// A spin's alone time and utilization as the contention model takes them: the
// time capped at about 11 days, so that deadlines, stretched by contention and
// added to steady_clock's epoch, stay far from overflowing 64-bit nanoseconds;
// a NaN utilization (it would poison the model's sum) as 1.
std::int64_t spin_alone_ns(const SpinOp& op);
double spin_util(const SpinOp& op);

// Runs one host op (anything but a spin, which is a timed event of the
// contention model, and a notify) to completion on the calling thread. Returns
// 0, or the errno a real device would report: EFAULT for a range outside device
// memory, EINVAL for a bad fill width.
int execute_op(const SimOp& op, HostMapping& memory);

}  // namespace salus::vgpu::sim
