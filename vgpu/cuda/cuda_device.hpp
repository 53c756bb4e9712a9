// One NVIDIA GPU behind the Device interface, through the CUDA Driver API: the
// primary context, an arena (address space backed on demand where salusd holds
// memory, see vmm_arena.hpp, or one cuMemAlloc up front without VMM), one
// non-blocking stream per lane, completions found through events by a
// backend-owned thread, and the handling of the faults a user kernel can cause
// (in salusd the context is reset and rebuilt, and the streams, modules and
// handles the broker holds stay valid; in an executor process the device goes
// out of service and the process exits, see CudaOptions::recover_in_process).
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "vgpu/cuda/cuda_backend.hpp"
#include "vgpu/cuda/cuda_driver.hpp"
#include "vgpu/cuda/cuda_plans.hpp"
#include "vgpu/cuda/vmm_arena.hpp"
#include "vgpu/device.hpp"

namespace salus::vgpu::cuda {

// Threading: any thread may call the Device methods (the broker uses one worker
// per GPU); ops on one stream must come from one thread at a time or in an order
// the callers agree on, as for any stream. Completions arrive on the device's own
// completion thread. Errors inside an op (bad launch configuration, a kernel
// fault) surface as the status of the stream's next notify, as on sim; only an
// unknown stream id throws (std::invalid_argument).
class CudaDevice final : public Device {
 public:
  // Retains the primary context, reserves the arena, loads the built-in kernels
  // and calibrates spin. Throws std::runtime_error with a one-line reason.
  CudaDevice(const CudaDriver& driver, int index, CUdevice device, const CudaOptions& options);
  // Finishes every stream's queued ops (delivering their completions), then
  // frees everything and releases the primary context.
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  const DeviceInfo& info() const override { return info_; }
  void set_sink(CompletionSink* sink) override;

  // Ids are the smallest free ones, as on sim.
  StreamId create_stream() override;
  // Must not be called from a completion callback (std::logic_error): it waits
  // for the completion thread to deliver the stream's last notifies.
  void destroy_stream(StreamId stream) override;

  // Widths 1, 2 and 4 at any alignment, via cuMemsetD8/D32Async (no kernel).
  void fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
            unsigned width) override;
  // cuMemcpyDtoDAsync; overlapping ranges are split (plan_copy) so the result is
  // memmove's.
  void copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) override;
  // salus_spin for `usec` at the calibrated clock; `util` scales the grid
  // (spin_blocks). Completes with ENOSYS in a build without built-in kernels.
  void spin(StreamId stream, std::uint64_t usec, double util) override;
  // salus_gemm. A C that overlaps A or B is computed into the stream's scratch
  // buffer first (up to kScratchBytes of output; larger fails with EINVAL).
  void gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k, DevOffset a,
            DevOffset b, DevOffset c) override;
  // Through pinned staging up to CudaOptions::staging_limit (never blocks; the
  // device-to-host data is copied out when the notify completes), directly from
  // the caller's memory above it (blocks until the stream reaches the copy).
  void copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) override;
  void copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) override;
  // Staging blocks are page-aligned host memory that salusd owns, registered
  // with the driver (cuMemHostRegister), so copies to and from them are plain
  // async DMA. Unlike cuMemHostAlloc'ed memory, a block outlives a fault
  // recovery: its registration is renewed on its next use, and until then (or if
  // registering fails) the copies take the pageable path of copy_*_host.
  void* alloc_staging(Bytes size) override;
  void free_staging(void* block, Bytes size) override;
  void copy_from_staging(StreamId stream, DevOffset dst, const void* host, Bytes length) override;
  void copy_to_staging(StreamId stream, void* host, DevOffset src, Bytes length) override;
  // Regions are registered too (read-only ones with CU_MEMHOSTREGISTER_READ_ONLY),
  // renewed after a recovery like staging; a region the driver will not
  // register is still copied, through the pageable path.
  int map_region(int fd, Bytes size, bool writable, RegionId& out, std::string& why) override;
  void unmap_region(RegionId region) override;
  void copy_from_region(StreamId stream, DevOffset dst, RegionId region, Bytes offset,
                        Bytes length) override;
  void copy_to_region(StreamId stream, RegionId region, Bytes offset, DevOffset src,
                      Bytes length) override;
  // Records the interval's end event (and a host-function wake-up); device_ns is
  // cuEventElapsedTime from the event recorded before the interval's first op.
  void notify(StreamId stream, std::uint64_t token) override;

  // An async memset on an internal stream; every stream waits for it before its
  // next op, so the caller's thread never waits for the memset itself.
  void discard(DevOffset offset, Bytes length) override;
  int set_backing(const std::vector<arena::ByteRange>& held, std::string& why) override;
  Bytes backed_bytes() const override;
  // Shared lane of attached sessions: cuMemCreate with a POSIX-fd handle type
  // in this device's context; cleared with cuMemsetD8 on the maintenance
  // stream through a temporary mapping, then synchronized.
  int make_lane_memory(Bytes size, UniqueFd& out, std::string& why) override;
  int clear_lane_memory(int fd, Bytes size, std::string& why) override;
  void drop_lane_memory(int fd) override;

  // Union of the completed notify intervals, placed in time by when their
  // completion was seen (BusyUnion); lags by at most one interval per stream.
  std::int64_t busy_ns() const override;

  // Modules: cubin, fatbin or PTX (NUL-terminated here if needed). The image is
  // kept so the module can be reloaded after a fault recovery.
  int load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                  std::string& why) override;
  // Deferred until every stream has passed the point of the call, so launches
  // already queued still find their code.
  void unload_module(ModuleHandle module) override;
  // param_sizes via cuFuncGetParamInfo (drivers >= 12.4), else left empty.
  int get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                   std::vector<std::uint32_t>& param_sizes, std::string& why) override;
  // The CUdeviceptr of an arena offset. Changes when a fault recovery reallocates
  // the arena: resolve at dispatch time, as the broker does.
  std::uint64_t device_address(DevOffset offset) const override;
  void launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
              const std::uint8_t* args, const std::uint32_t* arg_sizes,
              std::size_t arg_count) override;

  // Bumped by every fault recovery: the arena was reallocated (all device memory
  // reads as zero again) and everything queued before the fault was lost.
  std::uint64_t generation() const override { return generation_.load(); }
  // restarts = generation(); last_fault and last_restart name the CUresult.
  DeviceHealth health() const override;

  // False once a recovery failed: every op then completes with ENODEV.
  bool healthy() const { return !dead_.load(); }
  // Whether spin and gemm can run; if not, `why` says why (no nvcc at build
  // time, or the embedded kernels do not load on this GPU/driver).
  bool builtins_available(std::string& why) const;
  // Measured at start-up (clock64 cycles per microsecond of a timed spin).
  double spin_cycles_per_usec() const { return cycles_per_usec_; }

  // Output bytes a gemm may stage in scratch, and the scratch buffer size.
  static constexpr Bytes kScratchBytes = Bytes{16} << 20;

 private:
  struct PinnedBlock {
    void* ptr = nullptr;
    Bytes size = 0;  // the size class it was allocated with
  };
  struct CopyOut {  // a staged device-to-host copy, finished on completion
    void* host;
    const void* pinned;
    Bytes length;
  };
  // What an interval (the ops since the previous notify) holds until it completes.
  struct Interval {
    CUevent start = nullptr;  // recorded before the interval's first op
    CUevent end = nullptr;    // recorded by notify
    std::uint64_t token = 0;
    std::uint32_t ops = 0;
    int status = 0;  // first error of the interval
    bool user_launch = false;
    std::vector<PinnedBlock> blocks;
    std::vector<CopyOut> copy_out;
  };
  struct Stream {
    explicit Stream(StreamId i) : id(i) {}
    const StreamId id;
    // Orders enqueues onto the stream; guards everything below except `pending`.
    std::mutex mu;
    CUstream handle = nullptr;  // null while dead
    // Carries the completion wake-ups: a host function enqueued on `handle`
    // itself would hold the lane's next kernels until the driver's callback
    // thread ran it (~100 us on an H100), so it waits on the interval's end
    // event here instead. Null: completions are found by polling alone.
    CUstream wake = nullptr;
    bool closing = false;
    Interval open;
    std::uint64_t discards_seen = 0;
    CUdeviceptr scratch = 0;       // kScratchBytes, allocated on first need
    std::deque<Interval> pending;  // notified, not yet delivered; guarded by pending_mu_
  };
  struct Function {
    std::string name;
    CUfunction handle = nullptr;  // null if a reload after recovery lost it
    bool sizes_known = false;
    std::vector<std::uint32_t> param_sizes;
  };
  struct Module {
    std::vector<std::uint8_t> image;
    CUmodule handle = nullptr;
    std::vector<Function> functions;
  };
  struct RetiredModule {  // unloaded once every fence has completed
    CUmodule handle;
    std::vector<CUevent> fences;
  };
  struct Delivery {
    std::shared_ptr<Stream> stream;
    std::uint64_t token;
    int status;
    std::int64_t device_ns;
  };
  // The completion thread's wake-up. Separate and heap-allocated because the
  // driver's host-function thread holds a pointer to it.
  struct Waker {
    std::mutex mu;
    std::condition_variable cv;
    bool woken = false;  // guarded by mu
    bool stop = false;   // guarded by mu
  };
  // Holds the context lock (shared) and the stream's lock for one API op.
  class OpScope;

  // Context lifetime.
  void open_context(bool first, std::string& why);  // throws on failure when `first`
  void load_builtins();
  void calibrate_spin(int clock_khz);
  void release_context_resources();  // healthy teardown
  void set_current() const;
  CUstream create_wake_stream();  // caller holds ctx_mu_ with the context current

  // Op helpers (caller holds ctx_mu_ shared and the stream's mu).
  bool begin_op(Stream& s);
  bool check(Stream& s, CUresult r, const char* what);
  void fail(Stream& s, int err, const std::string& why);
  bool ensure_scratch(Stream& s);
  bool builtins_ok(Stream& s, CUfunction fn);
  CUdeviceptr at(DevOffset offset) const { return arena_base_.load() + offset; }
  // The arena's memory at start-up or after a rebuild (caller holds ctx_mu_).
  CUresult reserve_arena(bool first);
  CUresult clear_arena();
  // Maps the run's chunks (no lock held: one mapper at a time) and queues their
  // clearing on maint_ (taking maint_mu_ for that).
  CUresult back_run(const arena::ChunkRun& run);
  bool all_backed(DevOffset offset, Bytes length) const;

  CUresult acquire_event(CUevent& e);  // from the pool, or a new timing event
  void release_event(CUevent e);
  // Whether [host, host+length) lies in a staging block registered with the
  // current context (re-registering it after a recovery).
  bool staging_pinned(const void* host, Bytes length);
  // The same for a host region; false when its copies must take the pageable path.
  bool region_pinned(RegionId region);
  // One DMA between device memory and pinned host pages, or the pageable path when the
  // pages could not be pinned; behind the staging and region copies alike.
  void copy_in(StreamId stream, DevOffset dst, const void* host, Bytes length, bool pinned);
  void copy_out(StreamId stream, void* host, DevOffset src, Bytes length, bool pinned);
  // cuMemHostRegister with the context current; whether it took.
  bool register_host(void* p, Bytes size, bool writable);
  PinnedBlock acquire_pinned(Bytes size);
  void release_pinned(PinnedBlock b);
  void release_interval(Interval& iv);  // events and blocks back to the pools

  std::shared_ptr<Stream> find_stream(StreamId id) const;
  std::vector<std::shared_ptr<Stream>> all_streams() const;

  // Completion thread.
  void poke();
  void note_fault(CUresult r);
  void poll_loop();
  void collect(std::vector<Delivery>& out);
  void deliver(std::vector<Delivery>& out);
  void retire_modules();
  void recover();
  // rebuild: recover (CudaOptions::recover_in_process decides how); false while
  // the destructor runs.
  void flush_after_fault(bool rebuild);
  void fail_pending(bool kernel, std::vector<Delivery>& out);
  void forget_context();
  void rebuild_context(CUresult cause, const std::string& cause_text);
  std::string dead_reason() const;
  static void CUDA_CB on_host_wake(void* waker);

  const CudaDriver& drv_;
  const CudaOptions opts_;
  const CUdevice device_;
  DeviceInfo info_;
  std::atomic<CompletionSink*> sink_{nullptr};
  std::uint32_t threads_per_sm_ = 2048;
  double cycles_per_usec_ = 0;
  int clock_khz_ = 0;

  // Shared by every API call that touches CUDA objects; exclusive while a fault
  // recovery tears the context down and rebuilds it.
  mutable std::shared_mutex ctx_mu_;
  CUcontext ctx_ = nullptr;
  std::atomic<CUdeviceptr> arena_base_{0};
  CUmodule builtin_module_ = nullptr;
  CUfunction spin_fn_ = nullptr;
  CUfunction gemm_fn_ = nullptr;
  std::string builtins_why_;  // empty: built-ins available
  CUstream maint_ = nullptr;  // discards and start-up work

  mutable std::mutex maint_mu_;  // discards and clearing; guards the three below
  CUevent discard_event_ = nullptr;
  std::uint64_t discard_seq_ = 0;
  // What the arena had backed when the context was lost, for the rebuilt one.
  std::vector<bool> backed_before_loss_;
  // Backing on demand (null: the arena is one cuMemAlloc). Its chunks change in
  // one caller at a time (set_backing, the rebuild); it locks what readers share.
  std::unique_ptr<VmmArena> vmm_;

  std::atomic<int> fault_{CUDA_SUCCESS};  // a sticky CUresult awaiting recovery
  std::atomic<bool> dead_{false};
  std::atomic<std::uint64_t> generation_{0};
  mutable std::mutex text_mu_;  // guards the three strings below
  std::string last_fault_;      // describe() of the last sticky error
  std::string last_restart_;    // the same, for the last successful rebuild
  std::string dead_why_;        // why the device is out of service (dead_)

  struct StagingBlock {
    Bytes size = 0;
    bool registered = false;
    std::uint64_t generation = 0;  // of the context it was registered with
  };
  std::mutex staging_mu_;                           // never held while taking ctx_mu_
  std::map<std::uintptr_t, StagingBlock> staging_;  // by address

  mutable std::mutex table_mu_;
  std::vector<std::shared_ptr<Stream>> streams_;  // index = StreamId; null = free

  std::mutex pending_mu_;
  std::condition_variable pending_cv_;  // some stream's pending queue shrank
  std::atomic<std::size_t> pending_total_{0};

  std::mutex pool_mu_;
  std::vector<CUevent> free_events_;
  std::map<Bytes, std::vector<void*>> free_blocks_;  // by size class
  Bytes cached_bytes_ = 0;

  std::mutex modules_mu_;
  std::map<ModuleHandle, Module> modules_;
  ModuleHandle next_module_ = 1;
  std::vector<RetiredModule> retired_;
  std::atomic<std::size_t> retired_count_{0};

  mutable std::mutex busy_mu_;
  BusyUnion busy_;
  const std::chrono::steady_clock::time_point epoch_ = std::chrono::steady_clock::now();

  // Shared-lane memory made here (make_lane_memory), by the fd handed out.
  std::mutex lane_mu_;
  std::map<int, std::pair<CUmemGenericAllocationHandle, Bytes>> lane_handles_;

  std::unique_ptr<Waker> waker_ = std::make_unique<Waker>();
  std::thread poller_;  // last: starts once everything above exists
};

}  // namespace salus::vgpu::cuda
