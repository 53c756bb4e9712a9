#include "vgpu/sim/sim_device.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace salus::vgpu {

using sim::CopyOp;
using sim::FillOp;
using sim::FromHostOp;
using sim::GemmOp;
using sim::LaunchOp;
using sim::NotifyOp;
using sim::SimModule;
using sim::SimOp;
using sim::SimStream;
using sim::SpinOp;
using sim::StreamEnv;
using sim::StreamRunner;
using sim::ToHostOp;

namespace {

DeviceInfo make_info(int index, Bytes memory_bytes, std::string name) {
  DeviceInfo info;
  info.index = index;
  info.name = std::move(name);
  // Shaped like a CUDA UUID so tools that parse one cope, but "5a1a5" (salus) and
  // the zero groups make it plainly fake; stable across runs for the same index.
  info.uuid = fmt::format("GPU-5a1a5000-0000-0000-0000-{:012x}",
                          static_cast<std::uint64_t>(static_cast<std::uint32_t>(index)));
  info.backend = "sim";
  info.total_memory = memory_bytes;
  info.arena_size = memory_bytes;
  info.sm_count = SimDevice::kSmCount;
  info.driver_version = "sim";
  return info;
}

}  // namespace

SimDevice::SimDevice(int index, Bytes memory_bytes, std::string name)
    : info_(make_info(index, memory_bytes, std::move(name))),
      memory_(memory_bytes),
      runner_(std::make_unique<sim::StreamRunner>(
          StreamEnv{info_.index, memory_, contention_, busy_, sink_})) {}

SimDevice::~SimDevice() {
  std::vector<Slot> slots;
  {
    std::unique_lock lock(streams_mu_);
    slots.swap(slots_);
  }
  // Every stream finishes its queued ops, then the threads stop; memory_
  // outlives them all.
  for (Slot& slot : slots)
    if (slot.stream) runner_->drain(*slot.stream);
  runner_.reset();
}

void SimDevice::set_sink(CompletionSink* sink) {
  sink_.store(sink, std::memory_order_release);
}

StreamId SimDevice::create_stream() {
  std::unique_lock lock(streams_mu_);
  std::size_t id = 0;
  while (id < slots_.size() && (slots_[id].stream || slots_[id].retiring)) ++id;
  if (id == slots_.size()) slots_.emplace_back();
  slots_[id].stream = std::make_unique<SimStream>(static_cast<StreamId>(id));
  return static_cast<StreamId>(id);
}

void SimDevice::destroy_stream(StreamId stream) {
  std::unique_ptr<SimStream> victim;
  {
    std::unique_lock lock(streams_mu_);
    if (stream >= slots_.size() || !slots_[stream].stream)
      throw std::invalid_argument(fmt::format("sim gpu{}: no stream {}", info_.index, stream));
    if (runner_->on_own_thread())
      throw std::logic_error(fmt::format(
          "sim gpu{}: stream {} destroyed from a completion callback", info_.index, stream));
    victim = std::move(slots_[stream].stream);
    slots_[stream].retiring = true;
  }
  // Drain outside the lock: it can take as long as the queued kernels, and other
  // streams must keep accepting ops meanwhile.
  runner_->drain(*victim);
  victim.reset();
  std::unique_lock lock(streams_mu_);
  if (stream < slots_.size()) slots_[stream].retiring = false;
}

void SimDevice::enqueue(StreamId stream, const SimOp& op) {
  // Shared: ops for different streams enqueue in parallel; destroy_stream (unique)
  // cannot free a stream while an op is being pushed onto it.
  std::shared_lock lock(streams_mu_);
  if (stream >= slots_.size() || !slots_[stream].stream)
    throw std::invalid_argument(fmt::format("sim gpu{}: no stream {}", info_.index, stream));
  runner_->enqueue(*slots_[stream].stream, op);
}

void SimDevice::fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
                     unsigned width) {
  enqueue(stream, FillOp{dst, length, pattern, width});
}

void SimDevice::copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) {
  enqueue(stream, CopyOp{dst, src, length});
}

void SimDevice::spin(StreamId stream, std::uint64_t usec, double util) {
  enqueue(stream, SpinOp{usec, util});
}

void SimDevice::gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k,
                     DevOffset a, DevOffset b, DevOffset c) {
  enqueue(stream, GemmOp{m, n, k, a, b, c});
}

void SimDevice::copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) {
  enqueue(stream, ToHostOp{host, src, length});
}

void SimDevice::copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) {
  enqueue(stream, FromHostOp{dst, host, length});
}

void SimDevice::notify(StreamId stream, std::uint64_t token) {
  enqueue(stream, NotifyOp{token});
}

int SimDevice::make_lane_memory(Bytes size, UniqueFd& out, std::string& why) {
  UniqueFd fd(::memfd_create("salus-lane", MFD_CLOEXEC));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    const int e = errno;
    why = fmt::format("lane memory of {} bytes: {}", size, std::strerror(e));
    return e;
  }
  out = std::move(fd);
  return 0;
}

int SimDevice::clear_lane_memory(int fd, Bytes size, std::string& why) {
  // Punching the whole file out leaves zeroes (and gives the pages back).
  if (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size)) == 0)
    return 0;
  const int e = errno;
  why = fmt::format("clearing the lane memory: fallocate: {}", std::strerror(e));
  return e;
}

void SimDevice::discard(DevOffset offset, Bytes length) {
  if (const int err = memory_.discard(offset, length); err != 0)
    spdlog::warn("sim gpu{}: discard of {} bytes at {} failed: {}", info_.index, length, offset,
                 std::generic_category().message(err));
}

// ---- modules

namespace {

constexpr std::uint32_t kMaxFunctionsPerModule = 1u << 20;

ModuleHandle module_of(FunctionHandle f) {
  return static_cast<ModuleHandle>(f >> 32);
}
std::uint32_t index_of(FunctionHandle f) {
  return static_cast<std::uint32_t>(f);
}

}  // namespace

int SimDevice::load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                           std::string& why) {
  std::shared_ptr<SimModule> object;
  // dlopen runs outside the table lock: it can take a while for a big object.
  if (const int err = SimModule::load(image, object, why); err != 0) return err;
  std::lock_guard lock(modules_mu_);
  if (next_module_ == 0) {  // 2^32 loads: refuse rather than reuse a live handle
    why = "module handles exhausted";
    return ENOSPC;
  }
  out = next_module_++;
  modules_[out].object = std::move(object);
  return 0;
}

void SimDevice::unload_module(ModuleHandle module) {
  std::shared_ptr<SimModule> object;
  {
    std::lock_guard lock(modules_mu_);
    auto it = modules_.find(module);
    if (it == modules_.end()) return;
    object = std::move(it->second.object);
    modules_.erase(it);
  }
  // dlclose (when no queued launch holds the object any more) outside the lock.
  object.reset();
}

int SimDevice::get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                            std::vector<std::uint32_t>& param_sizes, std::string& why) {
  param_sizes.clear();
  std::lock_guard lock(modules_mu_);
  auto it = modules_.find(module);
  if (it == modules_.end()) {
    why = fmt::format("no module {}", module);
    return ENOENT;
  }
  Module& m = it->second;
  for (std::size_t i = 0; i < m.functions.size(); ++i) {
    if (m.functions[i].name != name) continue;
    out = FunctionHandle{module} << 32 | i;
    param_sizes = m.functions[i].param_sizes;
    return 0;
  }
  if (m.functions.size() >= kMaxFunctionsPerModule) {
    why = "too many functions looked up in this module";
    return ENOSPC;
  }
  Function f;
  f.name = name;
  if (const int err = m.object->find(name, f.fn, f.param_sizes, f.has_signature, why); err != 0)
    return err;
  out = FunctionHandle{module} << 32 | m.functions.size();
  param_sizes = f.param_sizes;
  m.functions.push_back(std::move(f));
  return 0;
}

char* SimDevice::host_view(DevOffset offset, Bytes length) {
  if (offset > memory_.size() || length > memory_.size() - offset) return nullptr;
  return reinterpret_cast<char*>(memory_.data()) + offset;
}

std::uint64_t SimDevice::device_address(DevOffset offset) const {
  return reinterpret_cast<std::uintptr_t>(memory_.data()) + offset;
}

void SimDevice::launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
                       const std::uint8_t* args, const std::uint32_t* arg_sizes,
                       std::size_t arg_count) {
  std::shared_ptr<const SimModule> object;
  ::salus_sim_kernel_fn fn = nullptr;
  bool checked = false;
  std::vector<std::uint32_t> sizes;
  {
    std::lock_guard lock(modules_mu_);
    auto it = modules_.find(module_of(function));
    if (it != modules_.end() && index_of(function) < it->second.functions.size()) {
      const Function& f = it->second.functions[index_of(function)];
      object = it->second.object;
      fn = f.fn;
      checked = f.has_signature;
      sizes = f.param_sizes;
    }
  }
  std::string why;
  std::shared_ptr<const sim::SimLaunch> op;
  if (fn == nullptr) {
    auto bad = std::make_shared<sim::SimLaunch>();
    bad->status = EINVAL;
    why = fmt::format("no function with handle {:#x} (module unloaded?)", function);
    op = std::move(bad);
  } else {
    op = sim::make_sim_launch(std::move(object), fn, dims, args, arg_sizes, arg_count, checked,
                              sizes, why);
  }
  if (op->status != 0)
    spdlog::warn("sim gpu{} stream {}: launch refused: {}", info_.index, stream, why);
  enqueue(stream, LaunchOp{std::move(op)});
}

}  // namespace salus::vgpu
