// The simulated GPU: device memory is host memory, built-in ops run on the CPU,
// and spin kernels take time under the shared contention model, so salusd and
// its scheduling policies behave meaningfully on machines without a GPU. Its
// streams share a fixed set of threads (sim_stream.hpp), whatever users open.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "vgpu/device.hpp"
#include "vgpu/sim/busy_meter.hpp"
#include "vgpu/sim/host_mapping.hpp"
#include "vgpu/sim/realtime_contention.hpp"
#include "vgpu/sim/sim_modules.hpp"
#include "vgpu/sim/sim_stream.hpp"

namespace salus::vgpu {

class SimDevice final : public Device {
 public:
  // Like a P100, the GPU of the Salus paper whose 2 x 16 GiB salusd mimics by default.
  static constexpr std::uint32_t kSmCount = 56;

  // Reserves `memory_bytes` of address space (no RSS until touched). Throws
  // std::system_error if the mapping fails, e.g. for 0 bytes or under strict
  // overcommit.
  SimDevice(int index, Bytes memory_bytes, std::string name = "Salus simulated GPU");
  // Finishes every stream's queued ops, then releases the memory.
  ~SimDevice() override;
  SimDevice(const SimDevice&) = delete;
  SimDevice& operator=(const SimDevice&) = delete;

  const DeviceInfo& info() const override { return info_; }
  void set_sink(CompletionSink* sink) override;

  // Ids are the smallest free ones, so they are reused after destroy_stream returns.
  StreamId create_stream() override;
  // Must not be called from a completion callback (it would wait for the
  // device's own threads): that throws std::logic_error.
  void destroy_stream(StreamId stream) override;

  // The op calls below throw std::invalid_argument for a stream id that does not
  // exist. Ranges outside device memory complete with EFAULT on the next notify.
  void fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
            unsigned width) override;
  void copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) override;
  void spin(StreamId stream, std::uint64_t usec, double util) override;
  // Spins running or queued end at once.
  void abort_work() override { contention_.abort(); }
  void gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k, DevOffset a,
            DevOffset b, DevOffset c) override;
  void copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) override;
  void copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) override;
  void notify(StreamId stream, std::uint64_t token) override;

  // Takes effect immediately, not in stream order: the caller has already made
  // sure no queued op still uses the range.
  void discard(DevOffset offset, Bytes length) override;
  // Lane memory is a memfd (host memory, as all of the sim's), which the mock
  // libcuda imports as a VMM handle; cleared by punching it out (zeroes).
  int make_lane_memory(Bytes size, UniqueFd& out, std::string& why) override;
  int clear_lane_memory(int fd, Bytes size, std::string& why) override;

  // Wall time during which at least one data or kernel op was executing on any
  // stream (notify markers do not count).
  std::int64_t busy_ns() const override { return busy_.busy_ns(); }

  // Modules are host shared objects (client/salus_sim_kernel.h, docs/modules.md).
  // Loading one runs its code inside this process: the sim backend trusts modules.
  int load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                  std::string& why) override;
  // Launches already queued keep the object loaded until they have run.
  void unload_module(ModuleHandle module) override;
  // `param_sizes` comes from the module's salus_signature_NAME table; empty if none.
  int get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                   std::vector<std::uint32_t>& param_sizes, std::string& why) override;
  // A host pointer into the simulated device memory.
  std::uint64_t device_address(DevOffset offset) const override;
  // The same, for the data plane; nullptr for a range past the end.
  char* host_view(DevOffset offset, Bytes length) override;
  // Runs the kernel once on a host thread of the device. An unknown function, zero
  // dimensions or arguments that contradict the signature complete with EINVAL.
  void launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
              const std::uint8_t* args, const std::uint32_t* arg_sizes,
              std::size_t arg_count) override;

 private:
  // A slot stays reserved while its stream drains, so a concurrent create_stream
  // cannot hand out an id whose old completions are still arriving.
  struct Slot {
    std::unique_ptr<sim::SimStream> stream;
    bool retiring = false;
  };

  void enqueue(StreamId stream, const sim::SimOp& op);

  DeviceInfo info_;
  sim::HostMapping memory_;
  sim::RealTimeContention contention_;
  sim::BusyMeter busy_;
  std::atomic<CompletionSink*> sink_{nullptr};

  mutable std::shared_mutex streams_mu_;
  std::vector<Slot> slots_;  // indexed by StreamId
  // After memory_, contention_ and busy_, which its threads use; reset first.
  std::unique_ptr<sim::StreamRunner> runner_;

  struct Function {
    std::string name;
    ::salus_sim_kernel_fn fn = nullptr;
    bool has_signature = false;
    std::vector<std::uint32_t> param_sizes;
  };
  struct Module {
    std::shared_ptr<sim::SimModule> object;
    std::vector<Function> functions;  // FunctionHandle = module << 32 | index
  };
  std::mutex modules_mu_;
  std::map<ModuleHandle, Module> modules_;  // guarded by modules_mu_
  ModuleHandle next_module_ = 1;            // guarded by modules_mu_; 0 is never valid
};

}  // namespace salus::vgpu
