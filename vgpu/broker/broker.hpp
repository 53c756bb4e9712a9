// The broker: every GPU (device + scheduler + worker thread) and every session.
// fusefs calls it with typed commands and callbacks; it never blocks a caller on
// GPU work — results come back through the callbacks (deferred replies).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "sched/gpu_scheduler.hpp"
#include "sched/owner_placements.hpp"
#include "sched/placement.hpp"
#include "vgpu/broker/session.hpp"
#include "vgpu/caller/caller_io.hpp"
#include "vgpu/device.hpp"
#include "vgpu/gpu_telemetry.hpp"
#include "vgpu/transfer/transfer_engine.hpp"

namespace salus::vgpu {

class MpsControl;
struct SharedLane;

struct Caller {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  bool admin = false;  // root or a member of the admin group
};

struct Quotas {
  std::uint32_t sessions_per_uid = 1024;
  std::uint32_t buffers_per_uid = 4096;
  std::uint64_t queued_iterations_per_uid = 10'000'000;
  std::uint32_t bytes_per_write = 64 * 1024;
  // upload/download commands queued or running; each holds an open file.
  std::uint32_t transfers_per_uid = 256;
};

using sched::Placement;

struct BrokerConfig {
  sched::PolicyKind policy = sched::PolicyKind::fair;
  Placement placement = Placement::magm;
  sched::RiskFilter risk;  // CARMA's filter for magm and lug, fed by NVML (telemetry)
  arena::ArenaOptions arena;
  Quotas quotas;
  // Iterations kept queued on a lane's stream ahead of the running one, so the
  // next kernel starts without waiting for the worker (the switch gap).
  std::uint32_t pipeline_depth = 2;
  std::size_t log_lines = 64;  // per session
  // Data plane: staging block size of upload/download, transfers moving at once
  // per GPU, and the staging memory kept for reuse per GPU.
  Bytes transfer_chunk = Bytes{16} << 20;
  unsigned transfers_active = 4;
  Bytes staging_cache = Bytes{64} << 20;
  // Shared-memory segments kept mapped between a session's transfers, per GPU.
  Bytes segment_cache = Bytes{4} << 30;
  // Oversubscription: host memory swapped-out sessions may hold in all (per GPU).
  // A swap-out that would pass it is refused and the session stays resident.
  Bytes swap_host_limit = Bytes{64} << 30;
  // Past the host limit, swap-outs spill to an unnamed file in this directory
  // (spill_file.hpp); empty: no spill file, such a swap-out is refused.
  std::string swap_dir;
  // Attached sessions that mark no iterations are asked to yield (a slice
  // boundary) after holding their lane this long while another session waits.
  std::int64_t quantum_ns = 50'000'000;
  // Card memory an attached program takes beyond what its budget charges: its own
  // CUDA context, module code and driver buffers, which NVML counts for the process
  // but no allocation hook sees. Counted in admission with each attached session's
  // need (as unswappable: it stays on the card while the program's memory is
  // swapped out). salusd: 512 MiB on the cuda backend, 0 on sim.
  Bytes attach_context_reserve = 0;
  // `--attach-context-reserve auto`: a GPU's reserve for new attached sessions
  // grows to the largest context measured there (Broker::learn_context), never
  // below attach_context_reserve. Off: the reserve is the configured one.
  bool attach_context_learn = false;
  // A program whose driver figure (NVML) stays past what admission counts for it
  // (its charge and context reserve on the card; swapped out, what it said stays)
  // is SIGKILLed rather than only warned about or counted: for hosts where
  // programs that take memory around the shim must not run (salusd
  // --attach-overrun kill).
  bool attach_overrun_kill = false;
  // The largest priority a caller who is not an admin may give a session
  // (salusd --user-priority-max); lowering one, or keeping it, is always allowed.
  std::int32_t user_priority_max = 0;
  // FAIR's shares: per uid, each uid's split among its sessions in a lane (the
  // default: a user cannot take more of a lane by opening more sessions), or per
  // session (salusd --fair-share).
  sched::FairShare fair_share = sched::FairShare::owner;
  // An attached iteration that holds its lane longer than this while other
  // sessions of the lane wait loses the lane (Broker::release_long_hold); 0: never.
  std::int64_t attach_hold_limit_ns = 30'000'000'000;
  // A GPU idle this long while sessions wait for it (to be admitted, swapped
  // in or dispatched) is reported once per episode, in salusd's log and each
  // waiting session's (Broker::watch_idle); 0: never reported, still counted.
  std::int64_t idle_warn_ns = 60'000'000'000;
  // Arena memory no longer held stays backed this long before it goes back to
  // the card (broker_backing.cpp), unless room promised to attached programs
  // needs it sooner. Tests lengthen it.
  std::int64_t give_back_delay_ns = 200'000'000;
  // Threads that open, read and write what callers name (see caller_io.hpp).
  CallerIo::Options caller_io;
  // Per GPU, the MPS control daemon salusd runs for it (--mps), or null; owned
  // by salusd's main and outliving the broker. Shown in gpus/N/info.
  std::vector<const MpsControl*> mps;
};

struct BrokerStats {
  std::uint64_t sessions_created = 0;
  std::uint64_t sessions_ended = 0;
  std::uint64_t commands = 0;
  std::uint64_t command_errors = 0;
  std::uint64_t iterations = 0;
  std::uint64_t ops = 0;
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_from_host = 0;
  std::uint64_t quota_rejections = 0;
};

class Broker {
 public:
  // `telemetry` (optional) supplies the NVML lines of gpus/N/info and the
  // matching metrics; without it they say why there are none.
  Broker(std::vector<std::unique_ptr<Device>> devices, BrokerConfig config,
         std::unique_ptr<GpuTelemetry> telemetry = nullptr);
  ~Broker();
  Broker(const Broker&) = delete;
  Broker& operator=(const Broker&) = delete;

  // Before the save of named sessions at a stop: swapped sessions are brought in
  // without waiting for the resident ones' quanta (residency.hpp), so the save's
  // reads are not held back by anti-thrash timers past the grace period.
  void prepare_to_stop();
  // Stops admitting, lets running iterations finish (up to `bound`), ends every
  // session and stops the workers. Idempotent.
  void shutdown(std::chrono::milliseconds bound);
  bool shutting_down() const { return stopping_.load(); }

  // ---- sessions ----
  // name empty: a clone session named by its id. Returns the id, or -errno.
  std::int64_t create_session(const Caller& caller, const std::string& name);
  // Ends the session: queued work is dropped, in-flight work drains, then every
  // byte, lane and queue slot it held is released.
  void end_session(SessionId id);
  // Looks up a session by directory name; nullopt if gone.
  std::optional<SessionId> find_session(const std::string& dir_name) const;
  // Whether `caller` may touch session `id`: its owner or an admin.
  int check_access(SessionId id, const Caller& caller) const;
  std::vector<std::pair<std::string, SessionId>> list_sessions() const;
  std::optional<std::pair<uid_t, gid_t>> session_owner(SessionId id) const;
  bool session_is_named(SessionId id) const;

  // ---- commands ----
  // Runs `commands` in order. `parse_error` (line, errno, message) is the first
  // line that failed to parse: earlier lines run, then the write fails with it.
  // `done` gets 0 or an errno and the reply text; it may run later (deferred).
  // Files the commands name are opened on a CallerIo thread, never on the
  // calling one. Returns a ticket for cancel_request, or 0 if already answered.
  std::uint64_t submit(
      SessionId id, const Caller& caller, std::size_t write_bytes,
      std::vector<CommandLine> commands,
      std::optional<std::pair<std::uint32_t, std::pair<int, std::string>>> parse_error,
      WriteReply done);
  // poll(2) support for status: a counter that moves whenever the status may
  // have changed, and a one-shot callback for when it moves past `seen`:
  // changed(true) then, or at once if it has. One watch per `key` (an open
  // file): a new one replaces the old, which gets changed(false), so a client
  // polling in a loop holds one watch, not one per poll.
  std::uint64_t status_version(SessionId id) const;
  void watch(SessionId id, std::uint64_t seen, std::uint64_t key,
             std::function<void(bool fire)> changed);
  // Drops `key`'s watch, if any (changed(false)): its file was closed.
  void unwatch(SessionId id, std::uint64_t key);
  // Completes when all work submitted so far has finished: "done <n>" or an errno.
  // Returns a ticket for cancel_request (0 if answered already).
  std::uint64_t wait(SessionId id, std::function<void(int err, std::string text)> done);
  // The caller of a held request was interrupted (FUSE_INTERRUPT): answers it
  // with EINTR and forgets it, if that is safe. A `wait`, a mem/ read or write,
  // or a write none of whose lines ran yet (waiting for its files, its turn or
  // admission), always goes; a write some of whose lines ran goes only if `caller_dying` (they
  // cannot be undone, and a caller that retries would run them twice).
  // Returns whether the request was answered.
  bool cancel_request(SessionId id, std::uint64_t ticket, bool caller_dying);

  // ---- buffers as files ----
  struct BufferView {
    std::uint32_t id;
    std::string name;
    Bytes size;
  };
  std::vector<BufferView> list_buffers(SessionId id) const;
  std::optional<BufferView> find_buffer(SessionId id, const std::string& name) const;
  std::optional<BufferView> buffer_by_id(SessionId id, std::uint32_t buffer_id) const;
  // mem/NAME: create (size 0), resize (allocate/reallocate keeping contents), remove.
  // create_buffer returns the buffer id or -errno; resize_buffer and
  // remove_buffer give 0 or a positive errno (docs/style.md, rules 1 and 2).
  int create_buffer(SessionId id, const Caller& caller, const std::string& name);
  void resize_buffer(SessionId id, const Caller& caller, std::uint32_t buffer_id, Bytes size,
                     std::function<void(int err)> done);
  int remove_buffer(SessionId id, const Caller& caller, const std::string& name);
  // Ordered after the session's earlier work; the callback gets the bytes read.
  // Both go through the GPU's staging blocks. Each returns a ticket for
  // cancel_request (0 if answered already): a held read or write is answered
  // with EINTR when its caller is interrupted; its copy still runs in order
  // (re-reading or re-writing the same bytes is harmless), with no one to tell.
  std::uint64_t read_buffer(SessionId id, std::uint32_t buffer_id, Bytes offset, Bytes length,
                            HostCopyDone done);
  std::uint64_t write_buffer(SessionId id, std::uint32_t buffer_id, Bytes offset, const char* data,
                             Bytes length, std::function<void(int err, Bytes written)> done);

  // ---- restart (session_store.cpp saves and restores named sessions with these) ----
  struct NamedSessionState {
    SessionId id = 0;
    std::string name;
    uid_t uid = 0;
    gid_t gid = 0;
    bool need_declared = false;  // `need` was accepted (queued, admitted or placed)
    NeedCmd need;                // as declared; need.gpu is where it was placed
    std::int32_t priority = 0;
    std::vector<BufferView> buffers;
  };
  // Every live named session, as of now (a snapshot under the lock).
  std::vector<NamedSessionState> named_sessions() const;
  // Adds a line to a session's log (e.g. "restored after a restart").
  void note(SessionId id, std::string text);

  // ---- admin ----
  int kill_session(SessionId id);
  // Both return 0 or a positive errno (EINVAL, and ENOENT/ENODEV for a ctl
  // line naming no session/GPU) with the reason in `why` (docs/style.md, rule 1).
  int set_policy(const std::string& text, std::string& why);  // "NAME [key=value...]"
  // One /salus/ctl line; what it did is appended to `reply`.
  int admin_command(const std::string& line, std::string& reply, std::string& why);
  // `swap out|in SESSION` of /salus/ctl (broker_gate.cpp): asks an attached
  // session's program to move its memory off the GPU or back; the outcome is in
  // the session's status and log. A manual trigger beside the residency logic.
  int admin_swap(const std::string& session, bool out, std::string& reply, std::string& why);

  // ---- views (file contents; snapshots) ----
  std::size_t gpu_count() const { return gpus_.size(); }
  std::string render_status(SessionId id) const;
  std::string render_log(SessionId id) const;
  std::string render_gpu_info(std::size_t gpu) const;
  std::string render_gpu_summary(std::size_t gpu) const;  // one line for logs
  std::string render_gpu_memory(std::size_t gpu) const;
  std::string render_gpu_lanes(std::size_t gpu) const;
  std::string render_gpu_queue(std::size_t gpu) const;
  // The compute processes NVML lists on the GPU, as the last census sorted them
  // (broker_processes.cpp): pid, bytes, role, session.
  std::string render_gpu_processes(std::size_t gpu) const;
  std::string render_policy() const;
  std::string render_stats() const;
  std::string render_metrics() const;

  const BrokerConfig& config() const { return config_; }

 private:
  struct Lane {
    StreamId stream = 0;
    std::uint32_t in_flight = 0;
    // Ephemeral memory never carries one session's data to another: a lane is
    // cleared where it is (re)placed, and the bytes the previous session used are
    // cleared, in stream order, when a different session runs next.
    std::optional<std::pair<Bytes, Bytes>> cleared;  // (offset, size) last cleared
    std::optional<SessionId> last_session;
    Bytes last_used = 0;
    struct InFlight {
      std::uint64_t token;
      SessionId session;
      TimeNs started;
    };
    std::deque<InFlight> tokens;
  };
  struct Completion {
    StreamId stream;
    std::uint64_t token;
    int status;
    std::int64_t device_ns;
  };
  struct Gpu;  // device + scheduler + worker
  class Sink;
  using Deferred = std::vector<std::function<void()>>;

  TimeNs now() const;
  Session* get(SessionId id);
  const Session* get(SessionId id) const;
  void log(Session& s, std::string text);
  Gpu* gpu_of(const Session& s);

  // Command execution (under mu_). Returns false when the write must wait.
  bool run_write(Session& s, PendingWrite& w, Deferred& later);
  int exec(Session& s, const CommandLine& line, PendingWrite& w, bool& suspend, Deferred& later);
  int check_priority(Session& s, const Command& cmd, bool admin, std::uint32_t line);
  int exec_need(Session& s, const NeedCmd& cmd, std::uint32_t line, Deferred& later);
  int place_any(Session& s, Bytes persistent, Bytes ephemeral, std::uint32_t line);
  // Late binding (issue 19 item 8): on a host of several GPUs a first `need gpu=any` waits
  // in host_queue_ and is bound to a GPU by bind_waiting (sched::bind_late, the code
  // salus-sim runs) once one admits it.
  int queue_any(Session& s, const NeedCmd& cmd, Bytes persistent, Bytes ephemeral,
                std::uint32_t line, Deferred& later);
  void bind_waiting(Deferred& later);
  void rekey_host_queue();  // after a policy change: the host-wide queue follows it
  // FAIR by owner: each uid's sessions placed on a GPU or waiting host-wide, which
  // order the host-wide queue; nothing counted under other policies.
  sched::OwnerPlacements owner_placements() const;
  double host_key(const Session& s, std::uint64_t arrival,
                  const sched::OwnerPlacements& owners) const;
  bool bind_to(Session& s, std::uint32_t gpu);
  void fill_views();
  // "N of M" for a session in the host-wide queue, else empty.
  std::string host_queue_position(SessionId id) const;
  // 0 or a positive errno; sets `suspend` when the line must wait (compaction,
  // memory still pinned by submitted work) and run again.
  int exec_alloc(Session& s, const AllocCmd& cmd, std::uint32_t line, bool& suspend);
  int exec_free(Session& s, const FreeCmd& cmd, std::uint32_t line);
  int record_op(Session& s, const Command& cmd, std::uint32_t line);
  int exec_module(Session& s, const ModuleCmd& cmd, PendingWrite& w, std::uint32_t line);
  int record_launch(Session& s, Iteration& it, const LaunchCmd& cmd, Op& op, std::uint32_t line);
  int submit_iteration(Session& s, std::shared_ptr<const Iteration> iter, std::uint64_t repeat,
                       std::uint32_t line);
  int resolve(Session& s, Iteration& it, const BufRef& ref, Bytes length, Operand& out,
              std::uint32_t line, const char* what);
  void enqueue(Session& s, WorkItem item);
  int usable_buffer(SessionId id, std::uint32_t bid, Session*& s, const Buffer*& b);
  // Returns the item's ticket for cancel_request.
  std::uint64_t enqueue_host_copy(Session& s, Op::Kind kind, arena::BufferHandle handle,
                                  Bytes offset, StagingPool::Block host, Bytes length,
                                  HostCopyDone done);
  // The GPU index of a usable buffer's session, for taking a staging block
  // before the copy is queued (-errno when unusable).
  int buffer_gpu(SessionId id, std::uint32_t bid);

  // What a write names, opened as the caller (on a CallerIo thread).
  struct OpenedFiles {
    std::vector<PendingWrite::ModuleFile> module_files;
    std::unordered_map<std::size_t, TransferEndpoint> endpoints;
    CallerCredentials creds;
  };
  static OpenedFiles open_caller_files(const Caller& caller,
                                       const std::vector<CommandLine>& commands);
  static OpenedFiles could_not_open(const std::vector<CommandLine>& commands, int err);
  // Hands them to the write waiting for them and resumes it (if still there).
  void files_opened(SessionId id, std::uint64_t write_id, OpenedFiles files);

  // Data plane (broker_transfers.cpp).
  int exec_transfer(Session& s, const TransferCmd& cmd, PendingWrite& w, std::uint32_t line);
  // Hands the session's next transfer to its GPU's engine once everything
  // before it has completed.
  void maybe_start_transfer(Session& s);
  void transfer_finished(SessionId id, std::uint64_t seq, TransferResult result);
  void cancel_transfer(Session& s);
  void resume_writes(Session& s, Deferred& later);
  void fail_session(Session& s, int err, std::string text, Deferred& later);
  void drop_queued(Session& s, int err, Deferred& later);
  void check_waiters(Session& s, Deferred& later);
  void retire(Session& s, arena::BufferHandle handle, Bytes size);
  void pin(Session& s, arena::BufferHandle handle);
  void unpin(Session& s, arena::BufferHandle handle);
  void maybe_finalize(Session& s, Deferred& later);
  // kick_worker false: the caller dispatches itself right after (the gate service).
  void handle_admissions(Gpu& g, Deferred& later, bool kick_worker = true);
  void sync_lanes(Gpu& g, Deferred& later);

  // Worker side.
  void worker_loop(Gpu& g);
  void dispatch(Gpu& g, Deferred& later);
  bool dispatch_one(Gpu& g, LaneId lane_id, Lane& lane, Deferred& later);
  void prepare_lane(Gpu& g, LaneId lane_id, Lane& lane, SessionId sid, Bytes ephemeral);
  void emit_ops(Gpu& g, StreamId stream, Bytes base, WorkItem& item);
  void complete(Gpu& g, const Completion& c, Deferred& later);
  void compact(Gpu& g);
  // What compaction does with the session's buffers, for its status: "moving"
  // (copies out, not dispatched), "held" (in the way, with work in flight: no
  // new iteration until they move) or "-".
  const char* compaction_role(const Session& s) const;
  // Offers room this GPU gained since the last offer to sessions waiting host-wide.
  void offer_room_host_wide(Gpu& g, Deferred& later);
  // Brings g.compaction_holds up to date and the runnable state of who joined or left it.
  void hold_for_compaction(Gpu& g);
  void start_moves(Gpu& g, SessionId id, const std::vector<arena::PersistentMove>& moves);
  // The arena backed on demand (broker_backing.cpp): whether every range held in
  // g's arena has memory behind it. New memory is backed by g's backer thread,
  // off the broker lock (mapping gigabytes takes the driver long: no other user
  // may wait on it): `pending` until that job ends, when the GPU's worker is
  // woken, its sessions' suspended writes resume and `backing_waiters` run.
  // `failed` (logged, retried after a pause) while the card has no room. Memory
  // no longer held goes back to the card once it has stayed free a moment.
  enum class Backing { ready, pending, failed };
  Backing backing_state(Gpu& g);
  bool backing_ready(Gpu& g) { return backing_state(g) == Backing::ready; }
  // Whether an instance of `item` may go out on the lane now: all held memory
  // is backed, or a job backs other memory and everything this work touches
  // (its lane, its bound buffers) is backed for certain meanwhile.
  bool work_backed(Gpu& g, LaneId lane_id, const WorkItem& item);
  // The same for compaction copies: everything they read and write is backed.
  bool moves_backed(Gpu& g, const std::vector<arena::PersistentMove>& moves);
  // backing_state for one use of memory: ready when the ranges it touches are
  // backed for certain, even while a job backs other memory or after one
  // failed; otherwise the GPU's state (pending, failed).
  Backing backing_of(Gpu& g, std::vector<arena::ByteRange> touched);
  std::vector<arena::ByteRange> held_ranges(const Gpu& g) const;
  void start_backing(Gpu& g, std::vector<arena::ByteRange> target);
  void resize_locked(SessionId id, const Caller& caller, std::uint32_t buffer_id, Bytes size,
                     std::function<void(int err)> done, Deferred& later);
  void maybe_give_back(Gpu& g);
  Bytes promised_to_programs(Gpu& g);
  void backer_loop(Gpu& g);
  void finish_backing(Gpu& g, int status, const std::string& why, Deferred& later);
  void stop_backer(Gpu& g);
  void finish_compaction(Gpu& g, const Completion& c, Deferred& later);
  void finish_instance(Gpu& g, Session& s, WorkItem& item, int status, std::int64_t device_ns,
                       Deferred& later);
  void kick(Gpu& g);
  // Writes whose `alloc` found no hole (fragmented) try again (on the worker).
  void retry_waiting_allocs(Gpu& g, Deferred& later);
  // Utilization from the device's busy time, sampled by the worker every 100 ms:
  // the busy fraction over the last `window` ns.
  void sample_busy(Gpu& g);
  // After a device fault the backend recreates its context and every byte on
  // that GPU is lost: every session placed there fails with "gpu context lost".
  void check_generation(Gpu& g, Deferred& later);
  // Fails a session whose GPU lost its context: as the likely culprit (its
  // kernel was running: EFAULT) or as collateral.
  void tell_loss(Gpu& g, Session& s, bool culprit, Deferred& later);
  // The session-facing text for a completion that failed with `status`.
  std::string device_failure(Gpu& g, int status);
  double busy_fraction(const Gpu& g, TimeNs window) const;
  // The telemetry of GPU `gpu`, or why there is none. Takes the telemetry's own
  // lock, never mu_: call it before locking mu_.
  GpuTelemetrySnapshot telemetry_of(std::size_t gpu) const;
  void update_runnable(Gpu& g, Session& s);
  void render_gate_status(const Session& s, const GpuTelemetrySnapshot* t, std::string& out) const;
  std::string gpu_memory_of(pid_t pid, const Gpu& g, const GpuTelemetrySnapshot* t) const;
  // NVML's device memory for process `pid` in snapshot `t`, when it gives one.
  static std::optional<Bytes> process_gpu_bytes(pid_t pid, const GpuTelemetrySnapshot* t);
  // What the driver counts for each attached program beyond its charge, against
  // the context reserve (once a second, from the gate service).
  void check_attached_contexts(const std::vector<GpuTelemetrySnapshot>& telemetry);
  // Card memory of processes no gate accounts for (broker_processes.cpp): a
  // process NVML lists on a GPU, with its parents read from /proc before the lock.
  struct ListedProcess {
    pid_t pid = 0;
    Bytes bytes = 0;
    std::vector<pid_t> ancestors;  // parent first, at most kMostAncestors
    bool salusd_own = false;       // salusd, its executors, its MPS daemons
    // Under --attach-overrun kill: the process, opened before its parents were
    // read and alive after, so a kill reaches the process they describe.
    UniqueFd pidfd;
    bool descends_from(pid_t root) const;  // or is it
  };
  struct ProcessCensus {
    std::vector<std::vector<ListedProcess>> by_gpu;
    std::vector<char> listed;  // by GPU: NVML gave its process list
  };
  ProcessCensus census_of(const std::vector<GpuTelemetrySnapshot>& telemetry) const;
  void census_loop();
  void census_tick();
  // Under the lock: each GPU's `outside_*` and each attached session's
  // ungated processes from the census, said once in the logs.
  void account_processes(const ProcessCensus& census);
  void account_gpu(Gpu& g, const std::vector<ListedProcess>& listed, bool known,
                   std::map<SessionId, std::vector<pid_t>>& over);
  void note_outside(const Gpu& g, const ListedProcess& p, std::vector<pid_t>& told);
  Session* job_of(const ListedProcess& p);
  Session* attached_program(pid_t pid);
  void note_ungated(Session& s, const ListedProcess& p, const Gpu& g);
  // Under --attach-overrun kill: SIGKILLs a process of s's job that holds card
  // memory past the slack ungated at two censuses in a row (`over` collects
  // this census's such pids). True if it did.
  bool kill_ungated(Session& s, const ListedProcess& p, const Gpu& g, std::vector<pid_t>& over);
  void check_context(Gpu& g, Session& s, std::optional<Bytes> used);
  // A swapped-out program whose driver figure stays past what it said it leaves
  // on the card: the arena counts what the driver shows (broker_swap.cpp).
  void check_swapped_program(Gpu& g, Session& s, std::optional<Bytes> used);
  // Under --attach-overrun kill (broker_gate.cpp): SIGKILLs the program when `used` is past
  // `counted` and the slack, and says why; true if it did.
  bool kill_overrun(Session& s, Bytes used, Bytes counted);
  // SIGKILLs the process behind `pidfd` (pid `pid`, for the text) and says
  // `killed pid N (--attach-overrun kill): WHY` in s's log and salusd's.
  void overrun_kill(Session& s, int pidfd, pid_t pid, const std::string& why);
  std::string context_reserve_note(const Session& s) const;
  static bool will_attach(const Session& s);
  static std::string ephemeral_hint(const Session& s);

  // Oversubscription (broker_swap.cpp). Swaps happen between a session's
  // iterations, on the GPU's swap stream; the residency planner decides whom.
  void drive_residency(Gpu& g, Deferred& later);
  void say_if_swap_stuck(Gpu& g, Session& s);
  void finish_swap(Gpu& g, const Completion& c, Deferred& later);
  // One interface per session kind: hosted sessions swap their buffers here;
  // attached ones ask their program through the gate (request_attached_swap), and
  // attached_residency_done completes the residency bookkeeping with its answer.
  bool swappable(const Session& s) const;
  int swap_out(Gpu& g, Session& s);
  int swap_in(Gpu& g, Session& s);
  int hosted_swap_out(Gpu& g, Session& s);
  int hosted_swap_in(Gpu& g, Session& s);
  int undo_swap_in(Gpu& g, Session& s);
  int attached_swap_out(Gpu& g, Session& s);
  int attached_swap_in(Gpu& g, Session& s);
  void attached_residency_done(Gpu& g, Session& s);
  // The spill file's part (broker_swap.cpp): swap-in of a spilled session, the
  // file write or read of the swap job under `token` (its answer comes back as a
  // completion on the swap stream), and the end of a swap-out.
  int spill_swap_in(Gpu& g, Session& s);
  void spill_io(Gpu& g, std::uint64_t token, bool write);
  void end_swap_out(Gpu& g, Session* s, std::uint64_t token, int status, TimeNs took);
  // Marks the session as waiting for its memory (a write's alloc, a transfer).
  void want_resident(Gpu& g, Session& s);
  void render_residency(const Session& s, std::string& out) const;

  // Attached sessions (broker_gate.cpp).
  int exec_attach(Session& s, const AttachCmd& cmd, PendingWrite& w, std::uint32_t line,
                  Deferred& later);
  // The hand-over of client/salus_gate.h: when `incoming` uses the GPU (has
  // allocated device memory), descends from the attached process and that one
  // does not, lets the attached one go (SALUS_GATE_HANDED_OVER) and returns
  // true; else changes nothing.
  bool hand_over_gate(Session& s, const AttachedGate& incoming, std::uint32_t line,
                      Deferred& later);
  // At its attached program's exit: why s stays, without a program, for the
  // job's next process (declared kind=attached: its creator, salus-run or the
  // Slurm plugin, ends it; or the launcher it was handed over from still
  // runs), or empty when it ends. Never while s is swapped out.
  std::string outlives_its_program(Gpu& g, const Session& s);
  // The need the arena of GPU `gpu` admits for session `s` declaring `persistent`
  // and `ephemeral`: an attached session's whole need is its own (persistent),
  // in the GPU's shared attached lane, with the context reserve beside it.
  arena::Need arena_need(const Session& s, Bytes persistent, Bytes ephemeral, int gpu) const;
  // The context reserve counted for `s` on GPU `gpu` (-1: not chosen yet): that
  // GPU's (context_reserve_on), cut to what the need leaves of its capacity.
  Bytes context_for(const Session& s, Bytes persistent, Bytes ephemeral, int gpu) const;
  // What admission counted for the session's context with its need as placed
  // (Session::context_counted): a reserve learned later counts for new needs only.
  static Bytes context_of(const Session& s) { return will_attach(s) ? s.context_counted : 0; }
  // The reserve new attached needs count on GPU `gpu` (-1: any): the configured
  // one, or with `auto` the context learned there when that is larger.
  Bytes context_reserve_on(int gpu) const;
  // `auto`: a context of `bytes`, seen at two checks in a row, raises the GPU's
  // learned reserve (rounded up, at most kMostLearnedContext); salusd's log says so.
  void learn_context(Gpu& g, Bytes bytes);
  void set_budget(Session& s);
  // Warns (session log) when the attached budgets of s's GPU exceed the card's
  // memory outside salusd's arena on the cuda backend.
  void note_memory_outside_arena(const Gpu& g, Session& s, std::uint32_t line);
  // A dispatch of an attached session: a grant through its gate.
  bool grant_one(Gpu& g, LaneId lane_id, Lane& lane, Session& s, Deferred& later);
  // Shared lane of attached sessions (broker_lanes.cpp). Under the lock.
  // Whether s may be granted as far as the shared lane goes: true at once when
  // s did not opt in or holds it; else asks the holder to yield it, clears it
  // (off the lock, through `later`) or hands it over, and says false until s
  // holds it.
  bool lane_ready(Gpu& g, Session& s, Deferred& later);
  bool grant_lane_room(Gpu& g, Session& s, Bytes room);  // lane_room=1: the lane as room
  // The lane is s's from here: its gate says `bytes` and the lane's generation.
  void hand_lane_to(SharedLane& L, Session& s, Bytes bytes);
  // broker_idle_watch.cpp: a GPU idle while sessions wait for it.
  void watch_idle(Gpu& g, TimeNs t);
  bool gpu_working(const Gpu& g) const;
  std::vector<std::pair<Session*, std::string>> idle_waiters(const Gpu& g);
  void add_host_waiters(const Gpu& g, std::vector<std::pair<Session*, std::string>>& out);
  void warn_idle(const Gpu& g, TimeNs idle_ns,
                 const std::vector<std::pair<Session*, std::string>>& waiting);
  // Whether nobody else holds the lane for s (asking the holder to yield).
  bool lane_free_for(Gpu& g, Session& s);
  // Whether a session other than `other_than` asked for the lane and still
  // waits for a grant.
  bool lane_asked_for(const SharedLane& L, SessionId other_than) const;
  bool lane_claimed_against(const Gpu& g, const Session& s) const;
  void ask_to_yield(SharedLane& L, Session& holder);
  // The holder's yield report (gate lane_held = 0) frees the lane.
  void lane_serve(Gpu& g, Session& s);
  // s lets go of its gate: the lane is free if its process exited, else its
  // memory is abandoned (it may still be mapped there).
  void lane_detach(Session& s);
  // A holder that does not report within kLaneReleaseLimitNs loses the memory.
  void lane_tick(Gpu& g, TimeNs t);
  // Run from `later` without the lock: make (and clear) new lane memory, or
  // zero the lane memory; then take the lock and dispatch.
  void make_lane(Gpu& g, Bytes bytes, SessionId next);
  void clear_lane(Gpu& g, int fd, Bytes bytes, SessionId next);
  void lane_off(Session& s, const std::string& why);
  bool shares_lane(const Session& s) const { return s.gate && s.gate->lane_sock; }
  void render_lane_status(const Session& s, const Gpu& g, std::string& out) const;
  // Whether the lane holds an iteration of a session other than `id` that a
  // switch must drain first (either side attached: separate processes).
  bool must_drain(const Lane& lane, const Session& next) const;
  // Reads the program's side of the gate: completions, requests, the note.
  void serve_gate(Gpu& g, Session& s, Deferred& later);
  static std::uint64_t device_time_ceiling(const AttachedGate& gt, TimeNs t);
  // One granted iteration of an attached session ends: `device_ns` as the program
  // reported it (the session's GPU time), `charge_ns` what the policy is charged.
  void finish_grant(Gpu& g, Session& s, std::int64_t device_ns, std::int64_t charge_ns, bool counts,
                    Deferred& later);
  std::int64_t lane_held_since_charged(const Gpu& g, Session& s, TimeNs t) const;
  void release_long_hold(Gpu& g, Session& s, TimeNs t, Deferred& later);
  void tick_attached(SessionId id, TimeNs t, Deferred& later);
  // Lets go of the gate: `state` (DETACHED, or HANDED_OVER), woken, its grants no
  // longer in flight.
  void detach_gate(Session& s, Deferred& later, std::uint32_t state = SALUS_GATE_DETACHED);
  // Swap of an attached session (issue 15). Under the lock; never waits.
  // Asks s's program to move its movable memory off the GPU at its boundary
  // (out: only with no iteration in flight) or back (in: a prefetch ahead of
  // the grant; a grant while swapped brings it back anyway). 0: asked, and
  // attached_swap_done runs when the program answers (through its doorbell, on
  // the gate service); else an errno (ENOTCONN, EBUSY, EALREADY).
  int request_attached_swap(Session& s, bool out);
  void attached_swap_done(Gpu& g, Session& s);
  void learn_unswappable(Gpu& g, Session& s);
  void gate_loop();
  void gate_tick();
  void gate_event(std::uint64_t data);
  void start_gate_service();
  void stop_gate_service();

  BrokerConfig config_;
  std::string mps_lines(std::size_t gpu) const;
  mutable std::mutex mu_;
  // Declared before gpus_: their transfer engines post file I/O to it.
  std::unique_ptr<CallerIo> caller_io_;
  std::vector<std::unique_ptr<Gpu>> gpus_;
  std::unordered_map<SessionId, std::unique_ptr<Session>> sessions_;
  std::unordered_map<std::string, SessionId> by_name_;
  struct UidUsage {
    std::uint32_t sessions = 0;
    std::uint32_t buffers = 0;
    std::uint64_t queued = 0;
    std::uint32_t transfers = 0;
  };
  std::unordered_map<uid_t, UidUsage> usage_;
  SessionId next_id_ = 1;
  std::uint64_t next_token_ = 1;
  std::uint64_t next_ticket_ = 1;  // held writes and waits, for cancel_request
  std::size_t rr_next_ = 0;
  std::vector<sched::GpuView> views_;  // scratch for place_any and bind_waiting
  arena::AdmissionQueue host_queue_;   // gpu=any sessions bound to no GPU yet
  std::uint64_t host_arrivals_ = 0;    // their arrival order
  bool binding_ = false;               // bind_waiting is running: no nested pass
  // A session was placed, ended or queued host-wide since the host queue's keys
  // were set: FAIR by user re-keys it before the next binding pass.
  bool host_keys_stale_ = true;
  BrokerStats stats_;
  std::atomic<bool> stopping_{false};
  bool stopped_ = false;
  std::chrono::steady_clock::time_point epoch_;
  std::unique_ptr<GpuTelemetry> telemetry_;  // may be null

  // The gate service: one thread, epoll over every attached session's bell and
  // pidfd, a timer for heartbeats and slices, and an eventfd to stop it.
  UniqueFd gate_epoll_;
  UniqueFd gate_timer_;
  UniqueFd gate_stop_;
  std::thread gate_thread_;
  std::uint64_t gate_ticks_ = 0;
  // The census of GPU processes and the check of attached programs' driver
  // figures (NVML, once a second): a thread of its own, so that its /proc reads
  // never delay a grant on the gate thread. Only with telemetry.
  std::thread census_thread_;
  std::mutex census_mu_;
  std::condition_variable census_cv_;
  bool census_stop_ = false;                // under census_mu_
  std::unordered_set<SessionId> attached_;  // sessions whose gate is served
};

}  // namespace salus::vgpu
