// Multi-GPU placement for `need gpu=any` (after CARMA sections 2.3 and 2.4): one pure
// function that both salusd (Broker::exec_need) and salus-sim (Engine::choose_gpu) call,
// so that the daemon and its simulator place a job on the same GPU given the same state.
// It reads a per-GPU view the caller fills in and keeps no state of its own; the round-
// robin cursor goes in and comes out. It can therefore be asked at a job's arrival and
// again later (late binding) with whatever the GPUs look like then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "arena/admission_queue.hpp"

namespace salus::sched {

enum class Placement : std::uint8_t {
  magm,       // most available memory: free memory less what already waits there
  lug,        // least utilized GPU (the caller's load figure)
  rr,         // round robin over the GPUs that can take the job
  exclusive,  // the lowest-numbered GPU with no session at all
};

std::string_view to_string(Placement p);
std::optional<Placement> placement_from_string(std::string_view name);

// What placement needs to know about one GPU.
struct GpuView {
  std::uint64_t capacity = 0;  // the arena's capacity: a job larger than this never fits
  // The arena's free memory (capacity - reserved persistent - lane sizes) less the
  // declared persistent + ephemeral of the sessions already queued there. Signed: a GPU
  // with more queued than free is negative, and ranks below one that is merely full.
  std::int64_t available = 0;
  double load = 0.0;         // lug's figure; smaller is less utilized
  std::uint32_t placed = 0;  // sessions placed on the GPU (running or queued)
  bool draining = false;     // admits no new sessions
  // The caller's own condition (late binding: the GPU admits the job now, and under SRTF
  // and PRIORITY the job would run there at once); an ineligible GPU is never chosen.
  bool eligible = true;
  // Risk figures over the monitoring window, 0..1; absent when nobody measures them.
  std::optional<double> sm_activity;   // compute busy (NVML utilization.gpu; sim: summed util)
  std::optional<double> mem_activity;  // memory-bandwidth pressure (NVML utilization.memory)
};

// CARMA's interference filter (section 2.3): a GPU whose recent SM activity or memory
// traffic is at or above a threshold takes no new job under magm and lug. rr and exclusive
// ignore it, as in CARMA (rr runs without preconditions; an exclusive GPU is idle).
struct RiskFilter {
  bool enabled = false;
  double max_sm = 0.80;   // CARMA's THR_SMACT
  double max_mem = 0.40;  // CARMA's THR_DRAMA
  double window_s = 30;   // CARMA's monitoring window; the callers' samples cover this
  // When every GPU that fits is risky: place anyway (at arrival, where nothing else waits
  // for a GPU) or return none (late binding, where the job can wait for one to calm down).
  bool place_when_all_risky = true;
  bool risky(const GpuView& g) const {
    return enabled && ((g.sm_activity && *g.sm_activity >= max_sm) ||
                       (g.mem_activity && *g.mem_activity >= max_mem));
  }
};

struct PlacementOptions {
  Placement policy = Placement::magm;
  RiskFilter risk;
};

struct PlacementChoice {
  std::optional<std::uint32_t> gpu;  // none: no GPU can take the job now
  std::size_t next_rr = 0;           // the cursor to pass next time (moves only on a choice)
  std::uint32_t risky = 0;           // fitting GPUs the risk filter skipped
  bool risk_ignored = false;         // every fitting GPU was risky and one was taken anyway
};

// Picks the GPU for a job of `need` bytes (declared persistent + ephemeral). A GPU is
// eligible when it is not draining, its capacity is at least `need`, and (exclusive) no
// session is placed on it. Among the eligible:
//   magm: largest available; ties to the lowest index.
//   lug: smallest load (within 1e-12); ties by larger available, then lowest index.
//   rr: the first eligible at or after rr_cursor (mod the GPU count).
//   exclusive: the lowest-numbered eligible.
// Deterministic, no allocation.
PlacementChoice choose_gpu(std::span<const GpuView> gpus, std::uint64_t need,
                           const PlacementOptions& options, std::size_t rr_cursor);

// Late binding (issue 19 item 8): one pass over a host-wide queue of jobs that wait for a
// GPU, the same in salusd (Broker::bind_waiting) and salus-sim (Engine::place_host). In
// the queue's order (the policy's admission key, with the arena's bypass bound), each job
// goes to the GPU choose_gpu picks among those where it is admitted now. The caller gives:
//   bounds(): an arena::AdmissionBounds covering every GPU (what may fit anywhere);
//   refresh(views): fills `views` (one per GPU, sized by the caller) as of now;
//   admits(q, g): whether GPU g admits the queued request q now;
//   place(q, g, choice): binds q to GPU g (the request leaves the queue on return).
// The round-robin cursor advances on each placement. Returns the number placed.
template <typename Bounds, typename Refresh, typename Admits, typename Place>
std::size_t bind_late(arena::AdmissionQueue& queue, arena::QueueMode mode, std::uint32_t max_bypass,
                      Bounds&& bounds, std::span<GpuView> views, const PlacementOptions& options,
                      std::size_t& rr_cursor, Refresh&& refresh, Admits&& admits, Place&& place) {
  if (queue.empty()) return 0;
  return queue.admit(mode, max_bypass, bounds, [&](const arena::QueuedRequest& q) {
    refresh(views);
    bool any = false;
    for (std::uint32_t g = 0; g < views.size(); ++g) {
      views[g].eligible = admits(q, g);
      any = any || views[g].eligible;
    }
    if (!any) return false;
    const PlacementChoice c = choose_gpu(views, q.persistent + q.ephemeral, options, rr_cursor);
    if (!c.gpu) return false;
    rr_cursor = c.next_rr;
    place(q, *c.gpu, c);
    return true;
  });
}

// CARMA's risk score of one metric from its samples over the window (oldest first, one a
// sampling period): 0.2 mean + 0.3 median + 0.3 p95 + 0.2 EMA (alpha 2 / (n + 1)), the
// weights of CARMA's monitor (its median and p50 weights summed). Empty: nullopt.
// Allocates a scratch copy for the order statistics; it runs once per sample, not per job.
std::optional<double> risk_score(std::span<const double> samples);

}  // namespace salus::sched
