// The arena backed on demand (cuda with VMM, design.md "The arena backed on
// demand"): the device is told which ranges salusd holds before any work uses
// them, so that the rest of the card is free for attached programs, whose
// memory is their own. One compare per call while the layout stands still.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <unordered_set>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {

// A failure is said again at most this often, and tried again at most this
// often while the layout stands still (each try may be an IPC to the executor).
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

bool Broker::backing_ready(Gpu& g) {
  if (!g.device->info().backs_on_demand) return true;
  if (const std::uint64_t epoch = g.device->backing_epoch(); epoch != g.backing_epoch) {
    // The device lost what it was told (an executor restarted and could not back
    // it again): nothing is backed until it is told again, whatever the layout.
    spdlog::warn("gpu{}: the device lost the arena's backing; backing it again", g.index);
    g.backing_epoch = epoch;
    g.backed.clear();
    g.backed_version = g.backing_failed_version = ~std::uint64_t{0};
  }
  const std::uint64_t version = g.sched.arena().layout_version();
  if (version == g.backed_version) return true;
  if (version == g.backing_failed_version && now() - g.backing_tried < kBackingRetryNs)
    return false;
  std::vector<arena::ByteRange> held = held_ranges(g);
  if (held == g.backed) {  // e.g. a swap-in undone: back where it was
    g.backed_version = version;
    return true;
  }
  std::string why;
  if (g.device->set_backing(held, why) == 0) {
    // backing_why stays until new memory is backed: it says why work waited.
    if (!g.backing_why.empty())
      spdlog::info("gpu{}: the arena is backed again; work goes on", g.index);
    g.backing_why.clear();
    g.backed = std::move(held);
    g.backed_version = version;
    return true;
  }
  const TimeNs t = now();
  g.backing_tried = t;
  g.backing_failed_version = version;
  if (why != g.backing_why || t - g.backing_reported >= kBackingReportNs) {
    spdlog::warn("gpu{}: work that needs new memory waits: {}", g.index, why);
    g.backing_reported = t;
  }
  g.backing_why = why;
  return false;
}

}  // namespace salus::vgpu
