// The one interface through which salusd drives a GPU, whatever the backend:
// an arena of device memory addressed by offset, streams (one per lane), async
// ops on a stream, and completion notification.
#pragma once

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "arena/backing_plan.hpp"
#include "arena/size_units.hpp"
#include "vgpu/host_regions.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

using arena::Bytes;
using DevOffset = Bytes;  // offset within the device's arena
using StreamId = std::uint32_t;
using ModuleHandle = std::uint32_t;
using FunctionHandle = std::uint64_t;

struct LaunchDims {
  std::uint32_t grid[3] = {1, 1, 1};
  std::uint32_t block[3] = {1, 1, 1};
  std::uint32_t shared_mem = 0;
};

struct DeviceInfo {
  int index = 0;
  std::string name;        // "Salus simulated GPU" / "NVIDIA H100 80GB HBM3"
  std::string uuid;        // "GPU-…" on CUDA; a stable fake for sim
  std::string backend;     // "sim" or "cuda"
  Bytes total_memory = 0;  // physical memory of the device
  Bytes arena_size = 0;    // what salusd manages (<= total_memory)
  // The arena holds physical memory only where set_backing says (cuda with VMM):
  // the rest of the card is left to attached programs.
  bool backs_on_demand = false;
  std::uint32_t sm_count = 0;
  std::string driver_version;  // "sim" for the sim backend
  // GPU clock cycles a built-in spin counts per microsecond (cuda: measured at
  // start-up); 0 where spin is not cycle-based (sim).
  double spin_cycles_per_usec = 0;
};

// How a device is run and how it has fared, for gpus/N/info and for the
// broker's error texts. Everything here may change while salusd runs.
struct DeviceHealth {
  // "thread": the device lives inside salusd; "process": in an executor
  // process that salusd kills and respawns when the GPU context is lost.
  std::string isolation = "thread";
  long executor_pid = 0;       // process isolation: the running executor; 0 while none
  std::uint64_t restarts = 0;  // times the device was rebuilt after losing its context
  std::string last_restart;    // why the last rebuild happened; empty if none
  // The last kernel fault, e.g. "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory
  // access was encountered)"; what a session whose work completed with EFAULT
  // after a context loss is told. Empty if none.
  std::string last_fault;
  bool usable = true;        // false: every op completes with ENODEV
  std::string unusable_why;  // why not, when !usable
};

// Receives completions. Called on a backend-owned thread; must not block for long.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  // All ops enqueued on `stream` before the matching notify() have finished.
  // status is 0 or an errno (e.g. EFAULT after a device fault). device_ns is the
  // time the device spent on those ops since the previous notify on the stream.
  virtual void on_complete(StreamId stream, std::uint64_t token, int status,
                           std::int64_t device_ns) = 0;
};

// Every offset/length passed here has already been bounds-checked by the caller
// against the arena and the buffer; a backend may assert but need not re-check.
class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceInfo& info() const = 0;
  virtual void set_sink(CompletionSink* sink) = 0;  // before the first op

  virtual StreamId create_stream() = 0;
  // Waits for the stream's queued ops to finish, then destroys it.
  virtual void destroy_stream(StreamId stream) = 0;

  // Sets `length` bytes at `dst` to a repeating element of `width` (1 or 4) bytes.
  virtual void fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
                    unsigned width) = 0;
  virtual void copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) = 0;
  // A kernel that keeps `util` of the GPU busy for `usec` microseconds when alone.
  virtual void spin(StreamId stream, std::uint64_t usec, double util) = 0;
  // C[MxN] = A[MxK] * B[KxN], fp32, row-major.
  virtual void gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k, DevOffset a,
                    DevOffset b, DevOffset c) = 0;
  // Host memory must stay valid until the next notify() on the stream completes.
  virtual void copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) = 0;
  virtual void copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) = 0;
  // ---- staging: host memory the device copies to and from without help ----
  // The data plane (mem/ files, upload, download) moves bytes through blocks
  // from here. The default is page-aligned anonymous memory, which is all the sim
  // backend needs; cuda pins it so the copies below are plain DMA. nullptr when
  // out of memory. A block stays valid until free_staging, whatever the device
  // goes through meanwhile (a cuda fault recovery included).
  virtual void* alloc_staging(Bytes size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  virtual void free_staging(void* block, Bytes size) {
    if (block) ::munmap(block, size);
  }
  // copy_from_host/copy_to_host for host memory inside a staging block: the
  // backend may copy straight from/to it (no bounce through its own buffers).
  // The same lifetime rule holds: valid until the next notify() completes.
  virtual void copy_from_staging(StreamId stream, DevOffset dst, const void* host, Bytes length) {
    copy_from_host(stream, dst, host, length);
  }
  virtual void copy_to_staging(StreamId stream, void* host, DevOffset src, Bytes length) {
    copy_to_host(stream, host, src, length);
  }

  // Device memory this process can address directly (the sim backend's is host
  // memory), or nullptr. The data plane then reads and writes files straight
  // into it: nothing else touches a buffer while its transfer runs.
  virtual char* host_view(DevOffset offset, Bytes length) {
    (void)offset;
    (void)length;
    return nullptr;
  }

  // ---- host regions: another file's pages, copied to and from directly ----
  // A client's shared-memory segment (upload/download shm:) or a staging block
  // shared with an executor process. map_region maps `size` bytes of `fd` (the
  // caller keeps its fd; the mapping holds the pages) and, on cuda, registers
  // them with the driver so the copies below are plain DMA from the file's own
  // pages. Returns 0 or an errno with the reason in `why`. The defaults map the
  // pages into this process (HostRegions) and copy as copy_*_staging would.
  virtual int map_region(int fd, Bytes size, bool writable, RegionId& out, std::string& why) {
    return regions_.map(fd, size, writable, out, why);
  }
  // Only once every copy involving the region has completed (its notify).
  virtual void unmap_region(RegionId region) {
    if (auto r = regions_.remove(region)) HostRegions::unmap(*r);
  }
  // Offsets are within the region; an unknown region or a range past its end
  // throws std::invalid_argument. The region must stay mapped until the next
  // notify() on the stream completes.
  virtual void copy_from_region(StreamId stream, DevOffset dst, RegionId region, Bytes offset,
                                Bytes length) {
    copy_from_staging(stream, dst, regions_.at(region, offset, length, false), length);
  }
  virtual void copy_to_region(StreamId stream, RegionId region, Bytes offset, DevOffset src,
                              Bytes length) {
    copy_to_staging(stream, regions_.at(region, offset, length, true), src, length);
  }

  // ---- shared lane memory of attached sessions (issue 15) ----
  // Makes `size` bytes (a multiple of 2 MiB) of device memory that another
  // process can import and map (cuda: cuMemCreate with
  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, in salusd's context, so it
  // outlives any program) and returns its fd. 0, or an errno with `why`
  // (EOPNOTSUPP: this backend cannot export memory).
  virtual int make_lane_memory(Bytes size, UniqueFd& out, std::string& why) {
    (void)size;
    (void)out;
    why = "this backend cannot export device memory to another process";
    return EOPNOTSUPP;
  }
  // Zeroes all of the lane memory `fd` and returns once the zeroes are on the
  // device (cuMemsetD8 + synchronize). Thread-safe: the broker calls it without
  // its lock, beside the GPU's worker.
  virtual int clear_lane_memory(int fd, Bytes size, std::string& why) {
    (void)fd;
    (void)size;
    why = "this backend cannot clear exported memory";
    return EOPNOTSUPP;
  }
  // The broker is about to close `fd`: the device lets go of what it holds for
  // it (the memory lives on while a program still has it mapped).
  virtual void drop_lane_memory(int fd) { (void)fd; }

  // Asks for sink->on_complete(stream, token, ...) once every op enqueued so far
  // on the stream has finished.
  virtual void notify(StreamId stream, std::uint64_t token) = 0;
  // Bracket a burst of calls from one thread (the broker's dispatch pass). A
  // backend that forwards requests elsewhere (process isolation) may then hold
  // notifies back until end_batch and send the burst at once; others ignore it.
  // Pairs may nest. Nothing else changes: every call still means what it says.
  // Cuts running and queued work short, as soon as the backend can: salusd is
  // stopping and its grace is over, so nothing waits for results any more.
  // The default does nothing (work then ends when it ends).
  virtual void abort_work() {}

  virtual void begin_batch() {}
  virtual void end_batch() {}

  // An arena backed on demand (DeviceInfo::backs_on_demand): after 0, physical
  // memory lies under every byte of `held` (sorted, disjoint: arena::merge_ranges)
  // and newly backed bytes read as zero to every later op; memory under nothing
  // held is given back to the card. Only discards may still be in flight on a
  // range that is no longer held. ENOMEM with `why` when the card has no room
  // (memory taken outside salusd): what was backed stays, and the call may be
  // repeated. The default backs everything up front and does nothing.
  virtual int set_backing(const std::vector<arena::ByteRange>& held, std::string& why) {
    (void)held;
    (void)why;
    return 0;
  }
  // Bytes of the arena with physical memory behind them.
  virtual Bytes backed_bytes() const { return info().arena_size; }
  // Changes when the device has lost the backing it was last given (a restarted
  // executor could not back it again): the caller gives it again before any op
  // touches held memory. Thread-safe, cheap: read before every dispatch.
  virtual std::uint64_t backing_epoch() const { return 0; }

  // Nothing lives in [offset, offset+length) any more. Afterwards the range reads
  // as zero, so memory never carries data from one owner to the next.
  virtual void discard(DevOffset offset, Bytes length) = 0;

  // Fraction of wall time since the device started during which at least one op
  // was executing (for utilization metrics).
  virtual std::int64_t busy_ns() const = 0;

  // Counts the times the backend rebuilt the device after a fault (cuda in
  // salusd: a kernel hit an illegal address, the context was reset and
  // recreated; process isolation: the executor died and a fresh one took its
  // place). Each time, everything queued was completed with an error and all
  // device memory was lost (it reads as zero again): persistent buffers of every
  // session are gone. Stream, module and function handles stay valid. The bump
  // is visible before the errored completions arrive. Sim in salusd never
  // faults: always 0.
  virtual std::uint64_t generation() const { return 0; }
  // See DeviceHealth. The default is a device in salusd that never faults.
  virtual DeviceHealth health() const { return {}; }

  // ---- user modules and kernels ----
  // Loads a module image (cubin/PTX/fatbin on cuda; an ELF host shared object on
  // sim) that the broker read with the caller's credentials. Returns 0 and a
  // handle, or an errno with a one-line reason in `why`.
  // The defaults say the backend has no module support (ENOSYS).
  virtual int load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                          std::string& why) {
    (void)image;
    (void)out;
    why = "this backend cannot load modules";
    return ENOSYS;
  }
  virtual void unload_module(ModuleHandle module) { (void)module; }
  // Looks up a kernel. When the backend can tell, `param_sizes` receives the byte
  // size of each parameter in order (cuFuncGetParamInfo; sim: the exported
  // signature table), otherwise it is left empty.
  virtual int get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                           std::vector<std::uint32_t>& param_sizes, std::string& why) {
    (void)module;
    (void)name;
    (void)out;
    (void)param_sizes;
    why = "this backend cannot load modules";
    return ENOSYS;
  }
  // The address a kernel sees for an arena offset (CUdeviceptr on cuda, a host
  // pointer on sim); buffer arguments are resolved through it at dispatch time.
  virtual std::uint64_t device_address(DevOffset offset) const { return offset; }
  // Enqueues a launch. `args` holds each argument's bytes back to back, in order,
  // with `arg_sizes` giving their sizes; the backend copies what it needs before
  // returning.
  virtual void launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
                      const std::uint8_t* args, const std::uint32_t* arg_sizes,
                      std::size_t arg_count) {
    (void)stream;
    (void)function;
    (void)dims;
    (void)args;
    (void)arg_sizes;
    (void)arg_count;
  }

 protected:
  HostRegions regions_;
};

}  // namespace salus::vgpu
