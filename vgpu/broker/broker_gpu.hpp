// Broker-internal: one GPU's device, scheduler, lane streams and worker thread.
// Only broker*.cpp include this.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vgpu/attach/shared_lane.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/spill_file.hpp"

namespace salus::vgpu {

// The driver's figure (NVML) for a program rounds each allocation to its pages
// and grows the context as modules load: differences below this are not taken
// for memory held past what admission counts (broker_gate.cpp, broker_swap.cpp).
inline constexpr Bytes kDriverFigureSlack = Bytes{16} << 20;

// Gate ticks (25 ms) between two looks at whether a GPU idles while sessions
// wait for it (broker_idle_watch.cpp): a pass over the sessions, 4 times a second.
inline constexpr std::uint64_t kIdleWatchTicks = 10;

// `--attach-context-reserve auto` learns a GPU's reserve from the contexts it
// measures, up to this: a CUDA context with its libraries' modules takes well
// under it, so more is memory a program took around the shim (warned about, or
// killed with --attach-overrun kill), which must not cut every later job's
// packing. Learned figures are rounded up to the driver's 2 MiB pages.
inline constexpr Bytes kMostLearnedContext = Bytes{2} << 30;
inline constexpr Bytes kLearnedContextUnit = Bytes{2} << 20;

// Runs the replies and releases collected under the broker's lock, after it is
// dropped, and empties the list. Nothing they throw escapes into a FUSE callback.
void run_deferred(std::vector<std::function<void()>>& later);

// Hands device completions to the GPU's worker thread.
class Broker::Sink final : public CompletionSink {
 public:
  explicit Sink(Gpu& g) : g_(g) {}
  void on_complete(StreamId stream, std::uint64_t token, int status,
                   std::int64_t device_ns) override;

 private:
  Gpu& g_;
};

struct Broker::Gpu {
  Gpu(std::size_t i, std::unique_ptr<Device> dev, sched::PolicyKind policy,
      arena::ArenaOptions options)
      : index(i), device(std::move(dev)), sched(device->info().arena_size, policy, options) {}

  std::size_t index;
  std::unique_ptr<Device> device;
  sched::GpuScheduler sched;  // guarded by Broker::mu_
  std::unordered_map<LaneId, Lane> lanes;
  std::unordered_map<StreamId, LaneId> stream_lane;
  std::vector<LaneId> lane_ids;         // scratch for dispatch
  std::vector<std::uint8_t> arg_bytes;  // scratch for kernel launches
  std::vector<std::uint32_t> arg_sizes;
  std::optional<StreamId> move_stream;  // persistent compaction copies
  std::unordered_map<std::uint64_t, SessionId> move_tokens;
  // Oversubscription: swap copies run on their own stream, one job per token.
  struct SwapJob {
    SessionId session = 0;
    bool out = true;
    TimeNs started = 0;
    Bytes bytes = 0;
    std::vector<std::pair<arena::BufferHandle, StagingPool::Block>> blocks;
    // Through the spill file: stage 0 is the device copy, 1 the file write (out)
    // or read (in), 2 the copy back to the device (in).
    bool spill = false;
    int stage = 0;
    off_t spill_off = 0;
    std::vector<Bytes> sizes;                   // per block: its buffer's size
    std::vector<std::uint64_t> device_offsets;  // per block, for the copy back
  };
  std::optional<StreamId> swap_stream;
  Bytes host_swapped = 0;  // bytes of this GPU's sessions held in host memory
  std::deque<std::pair<TimeNs, std::int64_t>> busy_samples;  // (time, busy_ns)
  std::uint64_t generation = 0;  // the device's context generation last seen
  bool draining = false;
  std::uint32_t placed = 0;  // sessions placed on this GPU
  SharedLane shared_lane;    // attached sessions' shared ephemeral memory (broker_lanes.cpp)
  // Sessions whose front write waits for an `alloc` that found no hole
  // (fragmented): retried by the worker (Broker::retry_waiting_allocs).
  std::vector<SessionId> alloc_waiters;
  bool retrying_allocs = false;  // inside retry_waiting_allocs: no kick from exec_alloc
  // Idle while sessions wait for it (broker_idle_watch.cpp), sampled every
  // kIdleWatchTicks gate ticks: since when (0: not now), summed over all
  // episodes, when last sampled, whether this episode was reported, and how
  // many were.
  TimeNs idle_waiting_since = 0;
  std::int64_t idle_waiting_ns = 0;
  TimeNs idle_watched_at = 0;
  bool idle_warned = false;
  std::uint64_t idle_warnings = 0;
  // The arena backed on demand (broker_backing.cpp). Under the broker lock:
  // what the device holds backed for certain, the ranges held at `held_version`
  // of the layout, and why the last try to back new memory failed (empty once
  // one succeeds).
  std::vector<arena::ByteRange> backed;
  std::vector<arena::ByteRange> held;
  std::uint64_t held_version = ~std::uint64_t{0};
  // What attached programs were promised on the card, at `promised_key`
  // (resident room, admissions) of the arena (Broker::promised_to_programs).
  Bytes promised_bytes = 0;
  std::pair<Bytes, std::uint64_t> promised_key{~Bytes{0}, ~std::uint64_t{0}};
  std::string backing_why;
  TimeNs backing_reported = 0;
  TimeNs backing_tried = 0;
  std::vector<arena::ByteRange> backing_failed_target;  // of the last failed job
  std::uint64_t backing_epoch = 0;  // the device's Device::backing_epoch() when told
  TimeNs backing_excess_since = 0;  // backed past what is held since: given back after a delay
  // The job the backer thread runs off the broker lock: what it backs, what
  // stays backed while it runs, the device's epoch when it started; and what
  // waits for it to end (resizes; suspended writes are resumed anyway).
  bool backing_busy = false;
  std::vector<arena::ByteRange> backing_target;
  std::vector<arena::ByteRange> backing_safe;
  std::uint64_t backing_job_epoch = 0;
  std::vector<std::function<void(std::vector<std::function<void()>>&)>> backing_waiters;
  // The backer thread (devices that back on demand only) and its mailbox.
  std::mutex backer_mu;
  std::condition_variable backer_cv;
  std::optional<std::vector<arena::ByteRange>> backer_job;
  bool backer_stop = false;
  std::thread backer;
  // The most any attached program's driver figure passed its charge here (its
  // context, measured): what --attach-context-reserve should be at least.
  Bytes context_measured = 0;
  // With `--attach-context-reserve auto`: the largest context seen here at two
  // checks in a row, rounded up (Broker::learn_context); 0 until one passes the
  // configured reserve. New attached needs on this GPU count it.
  Bytes context_learned = 0;
  // The compute processes NVML listed here at the last census, sorted
  // (broker_processes.cpp): what gpus/N/processes shows, and what the GPU's
  // outside_* figures and its sessions' memory_ungated sum. outside_known: a
  // census counted this GPU (NVML lists its processes); else those read "-".
  // outside_told: the pids of no session already named in salusd's log.
  enum class Role : std::uint8_t { program, ungated, salusd, outside };
  struct CensusRow {
    pid_t pid;
    Bytes bytes;
    Role role;
    SessionId session;  // 0: none
  };
  bool outside_known = false;
  std::vector<CensusRow> census;
  std::vector<pid_t> outside_told;
  // Bytes and processes of the census in `role` (of session `id`, if not 0).
  std::pair<Bytes, std::uint32_t> census_sum(Role role, SessionId id = 0) const {
    std::pair<Bytes, std::uint32_t> sum{0, 0};
    for (const CensusRow& r : census)
      if (r.role == role && (id == 0 || r.session == id)) {
        sum.first += r.bytes;
        ++sum.second;
      }
    return sum;
  }
  Bytes ungated_bytes(SessionId id) const { return census_sum(Role::ungated, id).first; }
  std::pair<Bytes, std::uint32_t> outside() const { return census_sum(Role::outside); }
  // Compaction moves whose destinations wait for memory, by session.
  std::vector<std::pair<SessionId, std::vector<arena::PersistentMove>>> unbacked_moves;
  // The admission bounds when sessions waiting host-wide were last offered this
  // GPU: more room since then offers it again (Broker::offer_room_host_wide).
  arena::AdmissionBounds host_offered{0, 0};
  // Sessions whose buffers compaction still has to move (ascending): they get
  // no iteration while one is in flight, so that each reaches an idle moment.
  std::vector<SessionId> compaction_holds, compaction_holds_next;
  // On that list with work in flight: no new iteration until it is idle.
  bool held_for_compaction(SessionId id, std::uint64_t in_flight) const {
    return in_flight > 0 &&
           std::binary_search(compaction_holds.begin(), compaction_holds.end(), id);
  }

  // Completions from the device and wake-ups for the worker.
  std::mutex cq_mu;
  std::condition_variable cq_cv;
  std::vector<Completion> completions;
  bool wake = false;
  bool stop = false;

  std::unique_ptr<Sink> sink;
  std::thread worker;

  // The data plane. Declared last: destroyed first, while the device lives.
  std::unique_ptr<StagingPool> staging;
  std::unique_ptr<TransferEngine> transfers;
  // Swaps in progress hold staging blocks: destroyed before the pool they go back to.
  std::unordered_map<std::uint64_t, SwapJob> swap_jobs;
  // Its thread writes and reads swap jobs' blocks: stopped before they go.
  std::unique_ptr<SpillFile> spill;
};

}  // namespace salus::vgpu
