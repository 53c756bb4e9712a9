// A Device in salusd whose work runs in an executor process: every call is
// forwarded over a socket, host copies go through a shared staging area, and
// when the executor dies (a kernel poisoned its context, or it was killed) a
// fresh one takes its place under the same stream, module and function handles.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vgpu/device.hpp"
#include "vgpu/executor/executor_main.hpp"
#include "vgpu/executor/executor_protocol.hpp"
#include "vgpu/executor/staging_ring.hpp"
#include "vgpu/mapping.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu::executor {

struct RemoteOptions {
  ExecutorOptions executor;            // the device the executor opens; its fd fields are set here
  std::string exe = "/proc/self/exe";  // salusd itself (tests: their own binary)
  int index = 0;                       // DeviceInfo::index as salusd numbers its GPUs
  Bytes staging_bytes = Bytes{256} << 20;
  // Host copies are cut into pieces of at most this much (and a quarter of the
  // staging area), so copy-in, transfer and copy-out of big copies overlap and no
  // single piece can need the whole area.
  Bytes max_piece = Bytes{8} << 20;
  std::chrono::milliseconds start_timeout{60000};  // spawn to hello (a CUDA start takes seconds)
  std::chrono::milliseconds call_timeout{60000};   // a synchronous request's reply (PTX JIT)
  std::chrono::milliseconds exit_grace{10000};     // shutdown: queued work drains first
  // An executor that dies sooner than this after it came up counts as a quick
  // failure: the next start waits (backoff doubling from backoff_initial up to
  // backoff_max), and after max_quick_failures of them in a row that no kernel
  // fault explains, the GPU is taken out of service.
  std::chrono::milliseconds quick_death{1000};
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{5000};
  int max_quick_failures = 5;
};

// Threading: like CudaDevice. Any thread may call; ops on one stream come from
// one thread at a time. Completions are delivered on the device's own I/O thread,
// which also restarts the executor. Unknown stream ids throw
// std::invalid_argument; everything else that goes wrong surfaces as the status
// of the stream's next notify.
class RemoteDevice final : public Device {
 public:
  // Starts the first executor and waits for its hello. Throws std::runtime_error
  // with a one-line reason if it does not come up (no such GPU, no memory, ...).
  explicit RemoteDevice(RemoteOptions options);
  // Asks the executor to finish its queued work and exit, then reaps it.
  ~RemoteDevice() override;
  RemoteDevice(const RemoteDevice&) = delete;
  RemoteDevice& operator=(const RemoteDevice&) = delete;

  const DeviceInfo& info() const override { return info_; }
  void set_sink(CompletionSink* sink) override;
  // Shutdown past its grace: the executor is killed, so its queued and running
  // work (a sim spin, a long kernel) ends now, failed with ECANCELED.
  void abort_work() override;

  StreamId create_stream() override;
  // Waits until the executor has drained the stream and its completions went
  // out. Must not be called from a completion callback (std::logic_error).
  void destroy_stream(StreamId stream) override;

  void fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
            unsigned width) override;
  void copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) override;
  void spin(StreamId stream, std::uint64_t usec, double util) override;
  void gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k, DevOffset a,
            DevOffset b, DevOffset c) override;
  // Through staging slots, in pieces. copy_from_host copies the caller's bytes
  // in now; copy_to_host copies out when the next notify completes, before the
  // sink hears of it. Waits (without holding up completions) while the staging
  // area is full.
  void copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) override;
  void copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) override;
  // Staging blocks are memfd pages mapped here and, as regions, in the
  // executor: copies to and from them go straight to the device there (DMA on
  // cuda), with no pass through the staging area. A block the executor could
  // not map (it was being restarted) falls back to copy_*_host.
  void* alloc_staging(Bytes size) override;
  void free_staging(void* block, Bytes size) override;
  void copy_from_staging(StreamId stream, DevOffset dst, const void* host, Bytes length) override;
  void copy_to_staging(StreamId stream, void* host, DevOffset src, Bytes length) override;
  // The fd is passed to the executor, which maps (and on cuda pins) it; a copy
  // of the fd is kept so that every new executor maps it again. EAGAIN while an
  // executor is being restarted, ENODEV once the GPU is out of service.
  int map_region(int fd, Bytes size, bool writable, RegionId& out, std::string& why) override;
  // Shared-lane memory, made and cleared by the executor; its fd taken out of
  // the executor with pidfd_getfd. Lost with the executor (a clear then fails
  // and the broker makes fresh memory).
  int make_lane_memory(Bytes size, UniqueFd& out, std::string& why) override;
  // Forwarded and waited for; kept, and sent again to a restarted executor.
  int set_backing(const std::vector<arena::ByteRange>& held, std::string& why) override;
  Bytes backed_bytes() const override;
  std::uint64_t backing_epoch() const override { return backing_epoch_.load(); }
  int clear_lane_memory(int fd, Bytes size, std::string& why) override;
  void drop_lane_memory(int fd) override;
  void unmap_region(RegionId region) override;
  void copy_from_region(StreamId stream, DevOffset dst, RegionId region, Bytes offset,
                        Bytes length) override;
  void copy_to_region(StreamId stream, RegionId region, Bytes offset, DevOffset src,
                      Bytes length) override;
  // Sends the requests built since the last send (inside begin_batch and
  // end_batch: at end_batch), the whole interval in one datagram.
  void notify(StreamId stream, std::uint64_t token) override;
  void begin_batch() override;
  void end_batch() override;
  void discard(DevOffset offset, Bytes length) override;

  // Reported by the executor with each completion and every 100 ms; carried
  // over restarts so it never goes backwards.
  std::int64_t busy_ns() const override;

  // The image is kept (in a sealed memfd) and reloaded into every new executor;
  // handles are salusd's own and stay valid across restarts. While an executor
  // is being restarted these fail with EAGAIN rather than block.
  int load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                  std::string& why) override;
  void unload_module(ModuleHandle module) override;
  int get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                   std::vector<std::uint32_t>& param_sizes, std::string& why) override;
  // The current executor's address. A launch whose arguments were resolved
  // against an executor that has since died fails with EIO instead of handing
  // the new one stale pointers.
  std::uint64_t device_address(DevOffset offset) const override;
  void launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
              const std::uint8_t* args, const std::uint32_t* arg_sizes,
              std::size_t arg_count) override;

  std::uint64_t generation() const override { return generation_.load(); }
  DeviceHealth health() const override;

  // The running executor's pid; -1 while none.
  pid_t executor_pid() const;

 private:
  enum class State { running, restarting, unusable, stopped };
  struct Slot {
    std::uint64_t offset;
    std::uint64_t length;
    void* copy_out;  // copy_to_host: where the bytes go at completion; else null
  };
  struct Interval {  // ops since the stream's last notify
    std::uint32_t ops = 0;
    int status = 0;
    bool user_launch = false;
    bool doomed = false;  // went to an executor that died: nothing more is sent
    std::vector<Slot> slots;
  };
  struct Pending {  // a notify not yet delivered
    std::uint64_t ticket;
    std::uint64_t token;
    int status;     // a local error (overrides the executor's), or the final status once done
    bool internal;  // a fence of our own, to free staging: not delivered
    bool done;      // completed (by the executor or locally); waits for those before it
    bool orphan;    // sent to an executor that has since been lost
    bool user_launch;
    bool by_executor;  // completed by the executor (not failed here): staged data is valid
    std::int64_t device_ns = 0;
    std::vector<Slot> slots;
  };
  struct Stream {
    bool closing = false;
    Interval open;
    std::deque<Pending> pending;
    std::uint32_t delivering = 0;  // popped, on their way to the sink
    int carry_status = 0;          // from internal fences, for the next notify
    std::int64_t carry_ns = 0;
  };
  struct Function {
    std::string name;
    std::vector<std::uint32_t> param_sizes;
  };
  struct Module {
    UniqueFd memfd;  // the image
    std::uint64_t size = 0;
    std::vector<Function> functions;  // FunctionHandle = module << 32 | index
  };
  struct Delivery {
    StreamId stream;
    std::uint64_t token;
    int status;
    std::int64_t device_ns;
    bool internal;
    bool copy_out;  // copy the device-to-host slots out before reporting
    std::vector<Slot> slots;
  };
  struct Reply {
    std::uint64_t request = 0;
    int status = 0;
    std::string why;
    std::vector<std::uint32_t> param_sizes;
  };
  struct Region {
    UniqueFd fd;  // our own copy, for the next executor
    Bytes size = 0;
    bool writable = false;
    bool lost = false;  // a new executor could not map it: its copies fail with EIO
  };
  struct StagingBlock {
    Mapping mapping;
    RegionId region = 0;  // 0: not mapped in the executor
  };
  struct Child {
    pid_t pid = -1;
    UniqueFd socket;
    std::uint64_t arena_base = 0;
  };

  // ---- executor lifetime (I/O thread, or the constructor)
  // Spawns an executor, waits for its hello and restores streams and modules.
  // On success it is the running one; on failure `why` says why and nothing is
  // left behind.
  bool start_child(std::string& why, bool first);
  // Checks the new executor's hello and, from the first one, takes the
  // device's description. False with `why` when the executor cannot serve.
  bool adopt_hello(const HelloMsg& hello, bool first, std::string& why);
  // Creates every stream of the table in the new executor. Needs mu_.
  void send_stream_creates(Child& c);
  bool restore(Child& c, std::string& why);
  bool restore_regions(Child& c, std::uint64_t& request, std::string& why);
  void restore_backing(Child& c, std::uint64_t& request);
  void region_copy(Msg type, StreamId stream, RegionId region, Bytes offset, DevOffset device,
                   Bytes length);
  // The region of the staging block holding [host, host+length), or 0.
  RegionId staging_region(const void* host, Bytes length, Bytes& offset);
  bool await_reply(int socket, std::uint64_t request, Reply& out, std::string& why);
  void io_loop();
  bool read_socket();  // false: the executor is gone
  void handle_record(Msg type, const char* body, std::size_t size, std::vector<Delivery>& out);
  void on_executor_gone();
  void schedule_restart(bool quick, bool blame_kernel, const std::string& what);
  void go_unusable(const std::string& why);
  void deliver(std::vector<Delivery>& out);
  void wake();

  // ---- with mu_ held
  // Leaves `running`: from now on the executor is lost. Dooms open intervals,
  // marks pending notifies as orphans, bumps the generation.
  void lose_child(const std::string& reason, const std::string& fault, bool kernel);
  void fail_orphans(bool crash_blames_kernels, std::vector<Delivery>& out);
  void collect_done(StreamId id, Stream& s, std::vector<Delivery>& out);
  Stream& op_stream(StreamId id);
  bool begin_op(Stream& s);
  void doom(Stream& s, int status);
  template <class T>
  bool put(Msg type, const T& fixed,
           std::initializer_list<std::pair<const void*, std::size_t>> tail = {});
  void flush();
  bool take_slot(std::unique_lock<std::mutex>& lk, Bytes length, std::uint64_t& offset);
  std::uint64_t piece_limit() const;
  int sync_call(std::unique_lock<std::mutex>& lk, std::uint64_t request, Reply& out,
                std::string& why);
  // 0 while an executor serves the GPU; else ENODEV (out of service) or EAGAIN (being
  // replaced), with the reason in `why`. Needs mu_.
  int unavailable(std::string& why) const;
  std::uint64_t make_ticket(StreamId id) {
    return std::uint64_t{id} << 40 | (next_ticket_++ & ((std::uint64_t{1} << 40) - 1));
  }

  RemoteOptions opts_;
  DeviceInfo info_;
  std::atomic<CompletionSink*> sink_{nullptr};
  UniqueFd staging_fd_;
  Mapping staging_;   // mapped in both processes
  UniqueFd wake_fd_;  // eventfd: wakes the I/O thread

  mutable std::mutex mu_;       // everything below
  std::condition_variable cv_;  // replies, state changes, staging freed, streams drained
  State state_ = State::restarting;
  Child child_;
  std::uint64_t arena_base_ = 0;  // the running (or last) executor's device_address(0)
  std::chrono::steady_clock::time_point child_up_;  // when the running executor came up
  RecordWriter tx_;
  StagingRing ring_;
  std::vector<std::unique_ptr<Stream>> streams_;  // index = StreamId; null = free
  std::map<ModuleHandle, Module> modules_;
  ModuleHandle next_module_ = 1;
  std::map<RegionId, Region> regions_by_id_;
  struct LaneMemory {
    int remote_fd = -1;            // the executor's number
    std::uint64_t generation = 0;  // of the executor that made it
  };
  std::map<int, LaneMemory> lanes_;  // by salusd's fd
  // The arena backed on demand: what the broker last asked for and what the
  // executor reported backed.
  std::mutex backing_mu_;  // guards backing_; taken alone
  std::vector<arena::ByteRange> backing_;
  std::atomic<Bytes> backed_bytes_{0};
  std::atomic<std::uint64_t> backing_epoch_{0};  // bumped when a new executor could not back it
  RegionId next_region_ = 1;
  std::uint64_t next_ticket_ = 1;
  std::uint64_t next_request_ = 1;
  // Replies to callers' requests, by request: set_backing's may come after
  // later requests' (the executor runs it on a thread of its own).
  std::unordered_map<std::uint64_t, Reply> replies_;
  std::uint64_t epoch_ = 0;            // bumped whenever an executor is lost: ends waits
  std::uint64_t base_generation_ = 0;  // the generation arena_base belongs to
  bool local_ready_ = false;           // a stream has done entries at its front
  int batch_depth_ = 0;                // begin_batch nesting: notifies wait for end_batch
  bool stop_ = false;
  // Restarts and health.
  std::atomic<std::uint64_t> generation_{0};
  bool fault_reported_ = false;  // the current loss was announced by a fault report
  bool fault_kernel_ = false;    // ... for a kernel's fault
  std::optional<std::chrono::steady_clock::time_point> kill_at_;  // a faulted executor's deadline
  std::string last_restart_;
  std::string last_fault_;
  std::string unusable_why_;
  int quick_failures_ = 0;  // in a row, not explained by a kernel fault
  int quick_streak_ = 0;    // in a row, any cause: sets the backoff
  std::chrono::steady_clock::time_point restart_at_;
  std::int64_t busy_base_ = 0;  // busy time of executors before the current one
  std::int64_t busy_last_ = 0;  // the current executor's last report

  std::mutex staging_mu_;  // never held while taking mu_ or sync_mu_
  std::map<std::uintptr_t, StagingBlock> staging_blocks_;  // by address

  std::mutex sync_mu_;          // one synchronous request at a time, set_backing aside
  std::mutex backing_call_mu_;  // one set_backing at a time
  std::thread io_;              // last: starts once everything above exists
};

// One RemoteDevice per GPU 0 .. count-1, each in its own executor started from
// `base` (gpu set per device), numbered in order of success. GPUs whose
// executor does not come up are logged and left out; if none does, returns
// nothing and `why` joins the reasons. Call from a thread that lives as long as
// the devices (an executor dies with the thread that spawned it).
std::vector<std::unique_ptr<Device>> open_remote_devices(const RemoteOptions& base, int count,
                                                         std::string& why);

}  // namespace salus::vgpu::executor
