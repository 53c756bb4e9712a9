// A session as the broker sees it: who owns it, its buffers (by name), the
// iteration being recorded, the queue of submitted work, its log and counters.
// Plain data: the Broker mutates it under its lock.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "arena/gpu_arena.hpp"
#include "vgpu/attach/attach_gate.hpp"
#include "vgpu/broker/command.hpp"
#include "vgpu/device.hpp"
#include "vgpu/transfer/staging_pool.hpp"
#include "vgpu/transfer/transfer_endpoint.hpp"

namespace salus::vgpu {

using arena::LaneId;
using arena::SessionId;
using TimeNs = std::int64_t;

// What every command that needs a GPU says before the session's first `need`
// (with ENXIO): one wording, wherever the command came from.
inline constexpr const char* kNoGpuYet =
    "no GPU yet: declare needs first with `need persistent=SIZE ephemeral=SIZE`";

struct Buffer {
  std::uint32_t id = 0;  // per session, never reused: names mem/ inodes
  std::string name;
  Bytes size = 0;
  arena::BufferHandle handle = 0;  // 0 while size is 0
};

// Device memory that submitted work still uses. Work binds to arena handles, so a
// buffer can be freed or reallocated by name while older work keeps its memory;
// a retired handle is released when its last user completes.
struct Pin {
  std::uint32_t count = 0;
  bool retired = false;
  Bytes size = 0;
};

// An operand: a persistent buffer (a slot of the iteration's name table, bound at
// submission) or ephemeral memory at a lane-relative offset.
struct Operand {
  bool ephemeral = false;
  std::uint32_t slot = 0;
  Bytes offset = 0;
};

struct KernelArg {
  bool buffer = false;
  Operand operand;         // buffer: resolved to a device address at dispatch
  std::uint64_t bits = 0;  // scalar value, little-endian
  std::uint32_t size = 0;  // bytes the kernel receives
};

struct Op {
  enum class Kind : std::uint8_t { fill, copy, spin, gemm, to_host, from_host, launch };
  Kind kind = Kind::fill;
  Operand a, b, c;  // fill: a; copy: a=dst b=src; gemm: a b c; host copies: a
  Bytes length = 0;
  std::uint32_t pattern = 0;
  std::uint8_t width = 4;
  std::uint64_t usec = 0;
  double util = 1.0;
  std::uint32_t m = 0, n = 0, k = 0;
  // launch
  std::uint64_t function = 0;
  LaunchDims dims;
  std::vector<KernelArg> args;
};

struct LoadedModule {
  ModuleHandle handle = 0;
  struct Function {
    FunctionHandle handle = 0;
    std::vector<std::uint32_t> param_sizes;  // empty when the backend cannot tell
  };
  std::unordered_map<std::string, Function> functions;
};

// A recorded unit of work. Persistent buffers are referenced by name through
// `names`, so a recorded iteration keeps working after buffers are reallocated,
// moved or compacted: names are bound to buffers each time it is submitted.
struct Iteration {
  std::vector<Op> ops;
  std::vector<std::string> names;
  std::vector<Bytes> min_sizes;  // per name: bytes the ops touch, checked at binding
  Bytes ephemeral_bytes = 0;
  bool counts = true;  // a begin/end iteration (counted in iterations done)
};

struct PendingWrite;
struct TransferJob;

// Runs after the broker unlocks: the error, and for mem/ reads the bytes read
// (valid only during the call).
using HostCopyDone = std::function<void(int err, std::span<const char> data)>;

struct WorkItem {
  std::shared_ptr<const Iteration> iter;
  std::vector<arena::BufferHandle> bound;  // one per iter->names entry, pinned
  std::uint64_t remaining = 1;             // instances not yet dispatched
  std::uint64_t outstanding = 0;           // dispatched, not yet completed
  std::uint64_t seq = 0;
  bool counted = false;     // its instances count against the queued-iterations quota
  StagingPool::Block host;  // staging for mem/ reads and writes
  Bytes host_length = 0;
  HostCopyDone on_done;
  // A mem/ read or write held for its caller: the ticket of cancel_request,
  // which answers it with EINTR and leaves the item to run with no one to tell.
  std::uint64_t ticket = 0;
  // upload/download: moved by the GPU's transfer engine, not dispatched on a
  // lane. It starts once everything before it has completed, and nothing after
  // it starts before it is done.
  std::shared_ptr<TransferJob> transfer;
  std::string what;  // the transfer, for log lines
};

struct Recording {
  std::shared_ptr<Iteration> iter;
  // Where its `begin` was, for the status and for errors while it stays open.
  std::uint64_t begun_write = 0;  // the session's writes of commands, from 1
  std::uint32_t begun_line = 0;   // within that write, from 1
  std::unordered_map<std::string, std::pair<Bytes, Bytes>> ephemeral;  // name -> (offset, size)
};

enum class SessionState : std::uint8_t { idle, queued, admitted, failed, ended };
const char* to_string(SessionState s);

struct LogLine {
  TimeNs at;
  std::string text;
};

using WriteReply = std::function<void(int err, std::string reply)>;

struct PendingWrite {
  std::uint64_t id = 0;  // the ticket of Broker::cancel_request
  // Its files are being opened on a CallerIo thread: it waits, holding no thread.
  bool opening = false;
  std::vector<CommandLine> commands;
  // Module files, read with the caller's credentials off the broker lock.
  struct ModuleFile {
    std::string path;
    int error = 0;
    std::string why;
    std::vector<std::uint8_t> image;
  };
  std::vector<ModuleFile> module_files;
  // upload/download endpoints, opened as the caller off the broker lock,
  // by the command's index in `commands`.
  std::unordered_map<std::size_t, TransferEndpoint> transfer_endpoints;
  CallerCredentials creds;  // captured with them
  // attach: the gate taken out of the writer before the broker locks, by the
  // command's index in `commands` (or why it could not be taken).
  struct AttachTaken {
    int error = 0;
    std::string why;
    std::unique_ptr<AttachedGate> gate;
  };
  std::unordered_map<std::size_t, AttachTaken> attach_gates;
  bool caller_admin = false;
  std::size_t next = 0;
  std::optional<std::pair<std::uint32_t, std::pair<int, std::string>>> parse_error;
  std::string reply;              // accumulated reply text
  std::uint64_t sync_target = 0;  // while waiting on `sync`
  bool syncing = false;
  bool began_recording = false;  // a `begin` of this write opened the recording
  std::uint64_t number = 0;      // the session's writes of commands, from 1
  WriteReply done;
};

struct Waiter {
  std::uint64_t target_seq;
  std::function<void(int err, std::string text)> done;
  std::uint64_t id = 0;  // the ticket of Broker::cancel_request
};

struct Session {
  SessionId id = 0;
  std::string dir_name;  // the directory name under sessions/
  bool named = false;    // made by mkdir: lives until rmdir
  uid_t uid = 0;
  gid_t gid = 0;
  TimeNs created_at = 0;
  SessionState state = SessionState::idle;
  bool dead = false;  // closed/removed; finalized once nothing is in flight

  // Declared needs.
  NeedCmd need;
  std::int32_t priority = 0;
  int gpu = -1;
  std::optional<LaneId> lane;
  TimeNs queued_at = 0;
  TimeNs admitted_at = 0;
  TimeNs queue_wait_ns = 0;

  // Buffers.
  std::unordered_map<std::uint32_t, Buffer> buffers;  // by id
  std::map<std::string, std::uint32_t> names;         // name -> id
  std::unordered_map<arena::BufferHandle, Pin> pins;
  std::uint32_t next_buffer_id = 1;

  // Recording and work.
  std::optional<Recording> recording;
  std::uint64_t writes_received = 0;  // numbers PendingWrite::number
  std::shared_ptr<const Iteration> last_iteration;
  std::deque<WorkItem> queue;       // submitted, not fully dispatched
  std::deque<WorkItem> dispatched;  // fully dispatched, some instances in flight
  std::uint64_t in_flight = 0;      // instances on the device
  std::optional<LaneId> in_flight_lane;
  bool moving = false;        // its persistent buffers are being compacted
  bool transferring = false;  // an upload/download is with the transfer engine
  // Oversubscription (broker_swap.cpp): while swapped out, each persistent buffer's
  // bytes live in a staging block (pinned host memory on cuda), by arena handle.
  std::unordered_map<arena::BufferHandle, StagingPool::Block> host_copies;
  Bytes host_bytes = 0;  // what host_copies hold, counted in Gpu::host_swapped
  // Past the host limit the bytes go to the GPU's spill file instead: one extent
  // of it, each buffer at its (offset, size) there.
  std::unordered_map<arena::BufferHandle, std::pair<off_t, Bytes>> spilled;
  off_t spill_off = 0;
  Bytes spill_bytes = 0;        // the extent's size; 0 when nothing is spilled
  int swap_error = 0;           // errno of the last failed swap-out, 0 after a good one
  TimeNs spill_retry_at = 0;    // a failed spill is not tried again before this
  bool swapping = false;        // a swap of its memory is in progress (either way)
  bool wants_resident = false;  // a write or transfer waits for its memory to come back
  TimeNs swap_stuck_said = -1;  // the planner step it was chosen at, once the log said it is stuck
  std::uint64_t queued_instances = 0;  // counted against the uid's quota
  std::uint64_t submitted_seq = 0;
  std::uint64_t completed_seq = 0;
  std::deque<PendingWrite> writes;  // suspended writes, in order
  bool writing = false;             // resume_writes is running for this session
  std::vector<Waiter> waiters;
  // poll(2) on status: bumped whenever the status may have changed.
  std::uint64_t version = 0;
  // At most one per key (an open file): a new poll replaces its file's watch.
  // Called with true when the status changed, false when dropped unfired.
  std::vector<std::pair<std::uint64_t, std::function<void(bool fire)>>> watchers;

  // Failure latch: set by a failed item; cleared by `reset` or `need`.
  int error = 0;
  std::string error_text;
  // The device generation (Device::generation) the session's GPU state lives
  // in: set when it is placed on a GPU and when it is told that the context was
  // lost. told_loss: the generation whose loss it was told of, so the rest of
  // that loss's errored completions do not repeat it.
  std::uint64_t gpu_generation = 0;
  std::uint64_t told_loss = 0;

  // Counters.
  std::uint64_t iterations_done = 0;
  std::uint64_t ops_done = 0;
  std::int64_t gpu_ns = 0;            // all device time, transfers included
  std::int64_t iteration_gpu_ns = 0;  // device time of counted iterations
  // Attached: the time its grants held the GPU's attached lane, as salusd saw it
  // (from each grant, or the last completion, to the next completion).
  std::int64_t lane_held_ns = 0;

  std::map<std::string, LoadedModule> modules;

  // Attached sessions (attach): the program's gate. Its work runs in the
  // program's own CUDA context; salusd grants iterations through the gate.
  std::unique_ptr<AttachedGate> gate;
  // The launcher the program took the session over from (hand-over): while it
  // runs, the program's exit leaves the session for the launcher's next worker
  // (an elastic restart, a second stage) instead of ending it.
  UniqueFd launcher_pidfd;
  pid_t launcher_pid = 0;
  // The context reserve admission counted beside its need when that need was
  // placed (Broker::context_for): what its status shows and its driver figure is
  // held to, whatever the GPU's reserve learns later.
  Bytes context_counted = 0;
  // Whether the session log has named one of the job's other processes, which
  // run ungated (one process of a job is gated; broker_processes.cpp).
  bool ungated_told = false;
  // Under --attach-overrun kill: the job's ungated processes past the slack at
  // the last census (a second census in a row kills them).
  std::vector<pid_t> ungated_over;

  std::deque<LogLine> log;
  std::uint64_t log_lines_total = 0;
};

}  // namespace salus::vgpu
