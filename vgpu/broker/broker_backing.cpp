// The arena backed on demand (cuda with VMM, design.md "The arena backed on
// demand"): the device is told which ranges salusd holds before any work uses
// them, so that the rest of the card is free for attached programs, whose
// memory is their own. Telling it maps or unmaps one 2 MiB chunk at a time,
// which for gigabytes takes the driver a long while: each GPU's backer thread
// does it off the broker lock, one job at a time, so that no other session,
// FUSE call or GPU waits on it; only work that needs the new memory does. One
// compare per call while the layout stands still.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <unordered_set>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {

// A failure is said again at most this often, and tried again at most this
// often for the same memory (each try may be an IPC to the executor).
constexpr std::int64_t kBackingReportNs = 10'000'000'000;
constexpr std::int64_t kBackingRetryNs = 50'000'000;

}  // namespace

std::vector<arena::ByteRange> Broker::held_ranges(const Gpu& g) const {
  // The lanes of attached sessions hold nothing of the arena: the shared lane's
  // memory is its own allocation (broker_lanes.cpp) and the programs' is theirs.
  std::unordered_set<LaneId> attached_lanes;
  for (const SessionId id : attached_) {
    const Session* s = get(id);
    if (s != nullptr && s->gate && s->gpu == static_cast<int>(g.index) && s->lane)
      attached_lanes.insert(*s->lane);
  }
  std::vector<arena::ByteRange> held;
  for (const arena::PhysicalRegion& r : g.sched.arena().physical_regions()) {
    if (r.kind == arena::PhysicalRegion::Kind::lane &&
        attached_lanes.count(static_cast<LaneId>(r.id)) != 0)
      continue;
    held.push_back({r.offset, r.size});
  }
  return arena::merge_ranges(std::move(held));
}

Broker::Backing Broker::backing_state(Gpu& g) {
  if (!g.device->info().backs_on_demand) return Backing::ready;
  if (const std::uint64_t epoch = g.device->backing_epoch(); epoch != g.backing_epoch) {
    // The device lost what it was told (an executor restarted and could not back
    // it again): nothing is backed until it is told again, whatever the layout.
    spdlog::warn("gpu{}: the device lost the arena's backing; backing it again", g.index);
    g.backing_epoch = epoch;
    g.backed.clear();
    g.backing_safe.clear();
    g.backing_failed_target.clear();
  }
  if (const std::uint64_t version = g.sched.arena().layout_version(); version != g.held_version) {
    g.held = held_ranges(g);
    g.held_version = version;
  }
  if (g.backing_busy)
    return arena::covers(g.backing_safe, g.held) ? Backing::ready : Backing::pending;
  if (arena::covers(g.backed, g.held)) {
    maybe_give_back(g);
    return Backing::ready;
  }
  if (now() - g.backing_tried < kBackingRetryNs && arena::covers(g.backing_failed_target, g.held))
    return Backing::failed;
  // Never unmaps what it keeps mapped: whatever is backed now stays usable
  // while the job runs.
  std::vector<arena::ByteRange> target = g.held;
  target.insert(target.end(), g.backed.begin(), g.backed.end());
  start_backing(g, arena::merge_ranges(std::move(target)));
  return arena::covers(g.backing_safe, g.held) ? Backing::ready : Backing::pending;
}

Broker::Backing Broker::backing_of(Gpu& g, std::vector<arena::ByteRange> touched) {
  const Backing b = backing_state(g);
  if (b == Backing::ready) return b;
  // Rare (a job runs, or the last one failed): what is backed for certain may
  // still hold everything this use touches.
  const std::vector<arena::ByteRange>& sure = g.backing_busy ? g.backing_safe : g.backed;
  return arena::covers(sure, arena::merge_ranges(std::move(touched))) ? Backing::ready : b;
}

bool Broker::work_backed(Gpu& g, LaneId lane_id, const WorkItem& item) {
  if (backing_state(g) == Backing::ready) return true;  // the dispatch path: one compare
  const arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::ByteRange> touched{{ar.lane_offset(lane_id), ar.lane_size(lane_id)}};
  for (const arena::BufferHandle h : item.bound)
    if (h != 0 && ar.buffer_on_gpu(h)) touched.push_back({ar.buffer_offset(h), ar.buffer_size(h)});
  return backing_of(g, std::move(touched)) == Backing::ready;
}

bool Broker::moves_backed(Gpu& g, const std::vector<arena::PersistentMove>& moves) {
  std::vector<arena::ByteRange> touched;
  for (const arena::PersistentMove& m : moves) {
    touched.push_back({m.from, m.size});
    touched.push_back({m.to, m.size});
  }
  return backing_of(g, std::move(touched)) == Backing::ready;
}

// What the GPU's attached programs were promised on the card, which they take
// from their own contexts: their resident shares (P and context) and their
// lanes (the shared lane's memory). Counted again only when an admission or the
// resident set changed (the key), so the dispatch path pays one compare.
Bytes Broker::promised_to_programs(Gpu& g) {
  const arena::GpuArena& ar = g.sched.arena();
  const std::pair<Bytes, std::uint64_t> key{ar.resident_room(), ar.stats().admissions};
  if (key == g.promised_key) return g.promised_bytes;
  Bytes promised = 0;
  std::unordered_set<arena::SessionId> programs;
  for (const auto& [id, sp] : sessions_) {
    if (sp->gpu != static_cast<int>(g.index) || !sp->lane || !will_attach(*sp)) continue;
    promised += ar.on_card_bytes(id);
    programs.insert(id);
  }
  for (const arena::LaneView& v : ar.lanes())
    if (!v.sessions.empty() && programs.count(v.sessions.front()) != 0) promised += v.size;
  g.promised_key = key;
  g.promised_bytes = promised;
  return promised;
}

// Memory no longer held goes back to the card after config_.give_back_delay_ns:
// a write or a swap-in that waited for a job retries right after it and finds
// its memory still there, instead of each giving back what the other needs.
// But not when attached programs were promised that room: one admitted into
// memory a hosted session just freed allocates it from its own context (at
// once, for a C program), and the driver would refuse it while salusd still
// holds it. What salusd keeps backed and what the programs were promised must
// fit the card together, or the excess goes back now.
void Broker::maybe_give_back(Gpu& g) {
  if (g.backed == g.held) {
    g.backing_excess_since = 0;
    return;
  }
  if (g.device->backed_bytes() + promised_to_programs(g) > g.sched.arena().capacity()) {
    start_backing(g, g.held);
    return;
  }
  const TimeNs t = now();
  if (g.backing_excess_since == 0)
    g.backing_excess_since = t;  // the worker comes back within 100 ms
  if (t - g.backing_excess_since >= config_.give_back_delay_ns) start_backing(g, g.held);
}

void Broker::start_backing(Gpu& g, std::vector<arena::ByteRange> target) {
  g.backing_busy = true;
  g.backing_safe = arena::intersect_ranges(g.backed, target);
  g.backing_target = target;
  g.backing_job_epoch = g.backing_epoch;
  g.backing_excess_since = 0;
  {
    std::lock_guard lk(g.backer_mu);
    g.backer_job = std::move(target);
  }
  g.backer_cv.notify_one();
}

void Broker::backer_loop(Gpu& g) {
  for (;;) {
    std::vector<arena::ByteRange> job;
    {
      std::unique_lock lk(g.backer_mu);
      g.backer_cv.wait(lk, [&] { return g.backer_job || g.backer_stop; });
      if (g.backer_stop) return;
      job = std::move(*g.backer_job);
      g.backer_job.reset();
    }
    std::string why;
    int status = 0;
    try {
      status = g.device->set_backing(job, why);
    } catch (const std::exception& e) {
      status = EIO;
      why = e.what();
    }
    Deferred later;
    try {
      std::lock_guard lk(mu_);
      finish_backing(g, status, why, later);
    } catch (const std::exception& e) {
      spdlog::error("gpu {} backer: {}", g.index, e.what());
    }
    run_deferred(later);
    {
      std::lock_guard lk(g.cq_mu);
      g.wake = true;
    }
    g.cq_cv.notify_one();
  }
}

void Broker::finish_backing(Gpu& g, int status, const std::string& why, Deferred& later) {
  g.backing_busy = false;
  if (g.device->backing_epoch() != g.backing_job_epoch) {
    g.backed.clear();  // lost meanwhile: backing_state tells the device again
  } else if (status == 0) {
    // backing_why stays until new memory is backed: it says why work waited.
    if (!g.backing_why.empty())
      spdlog::info("gpu{}: the arena is backed again; work goes on", g.index);
    g.backing_why.clear();
    g.backed = std::move(g.backing_target);
  } else {
    // What was backed and still wanted stays; of the rest nothing is certain.
    g.backed = std::move(g.backing_safe);
    g.backing_failed_target = std::move(g.backing_target);
    const TimeNs t = now();
    g.backing_tried = t;
    if (why != g.backing_why || t - g.backing_reported >= kBackingReportNs) {
      spdlog::warn("gpu{}: work that needs new memory waits: {}", g.index, why);
      g.backing_reported = t;
    }
    g.backing_why = why;
  }
  g.backing_target.clear();
  g.backing_safe.clear();
  // Writes whose allocation waited for the job retry now (and find out).
  for (auto& [sid, sp] : sessions_)
    if (sp->gpu == static_cast<int>(g.index) && !sp->writes.empty()) resume_writes(*sp, later);
  auto waiters = std::move(g.backing_waiters);
  g.backing_waiters.clear();
  for (auto& w : waiters) w(later);
}

void Broker::stop_backer(Gpu& g) {
  {
    std::lock_guard lk(g.backer_mu);
    g.backer_stop = true;
  }
  g.backer_cv.notify_one();
  if (g.backer.joinable()) g.backer.join();
}

}  // namespace salus::vgpu
