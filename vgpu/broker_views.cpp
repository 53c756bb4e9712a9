// The broker's state rendered as the text of the /salus files: snapshots taken
// under the broker lock, formatted as "key: value" lines or one row per object.
#include <cstring>

#include <fmt/format.h>

#include "salus_config.hpp"
#include "vgpu/broker.hpp"
#include "vgpu/broker_gpu.hpp"

namespace salus::vgpu {

namespace {
double ms(std::int64_t ns) {
  return static_cast<double>(ns) / 1e6;
}

// A reading formatted, or "-" when the GPU cannot give it.
std::string reading(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : std::string("-");
}

// The NVML part of gpus/N/info: always the same keys, so scripts can rely on
// them; "nvml" says whether the values can be had and, if not, why.
std::string telemetry_lines(const GpuTelemetrySnapshot& t) {
  std::string state = "yes";
  if (!t.available)
    state = fmt::format("no ({})", t.why_not);
  else if (!t.error.empty())
    state = fmt::format("yes (last sample: {})", t.error);
  const GpuReadings& r = t.readings;
  return fmt::format(
      "nvml: {}\nsm_util: {}\nmem_util: {}\npower_w: {}\nenergy_j: {}\ntemperature_c: {}\n", state,
      reading(r.sm_util, "{:.2f}"), reading(r.mem_util, "{:.2f}"), reading(r.power_w, "{:.3f}"),
      reading(r.energy_j, "{:.3f}"), reading(r.temperature_c, "{:.0f}"));
}

}  // namespace

std::string Broker::render_status(SessionId id) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  if (!s) return "state: ended\n";
  std::string o;
  auto kv = [&](std::string_view k, const auto& v) { o += fmt::format("{}: {}\n", k, v); };
  kv("id", s->id);
  kv("name", s->need.name.value_or(s->dir_name));
  kv("uid", s->uid);
  kv("state", to_string(s->state));
  kv("gpu", s->gpu < 0 ? std::string("-") : std::to_string(s->gpu));
  std::string lane = "-", lane_offset = "-", lane_size = "-";
  Bytes persistent_used = 0;
  std::string rank = "-";
  if (s->gpu >= 0) {
    const Gpu& g = *gpus_[static_cast<std::size_t>(s->gpu)];
    if (auto p = g.sched.arena().placement(s->id)) {
      persistent_used = p->persistent_used;
      if (p->lane) {
        lane = std::to_string(*p->lane);
        lane_size = std::to_string(p->lane_size);
        lane_offset = p->lane_offset ? std::to_string(*p->lane_offset) : "moving";
      }
    }
    if (const auto* ss = g.sched.find(s->id)) {
      switch (g.sched.policy()) {
        case sched::PolicyKind::fair:
          rank = fmt::format("vtime={}ns", ss->in.vtime);
          break;
        case sched::PolicyKind::srtf: {
          const double r = sched::remaining_ns(ss->in);
          rank = r >= sched::kUnknownRemaining ? "remaining=unknown(no iters=; ranks last)"
                                               : fmt::format("remaining={:.1f}ms", r / 1e6);
          break;
        }
        case sched::PolicyKind::priority:
          rank = fmt::format("priority={}", ss->in.priority);
          break;
        default:
          rank = fmt::format("arrival={}", ss->in.arrival);
          break;
      }
    }
  }
  kv("lane", lane);
  kv("lane_offset", lane_offset);
  kv("lane_size", lane_size);
  kv("priority", s->priority);
  kv("persistent", s->need.persistent);
  kv("persistent_used", persistent_used);
  kv("ephemeral", s->need.ephemeral);
  kv("iters", s->need.iters ? std::to_string(*s->need.iters) : std::string("-"));
  kv("iterations_done", s->iterations_done);
  kv("iterations_queued", s->queued_instances);
  kv("in_flight", s->in_flight);
  kv("buffers", s->names.size());
  std::size_t transfers = 0;
  for (const auto* q : {&s->queue, &s->dispatched})
    for (const WorkItem& item : *q) transfers += item.transfer ? 1 : 0;
  kv("transfers", transfers);
  const double mean =
      s->iterations_done ? ms(s->iteration_gpu_ns) / static_cast<double>(s->iterations_done) : 0.0;
  kv("mean_iteration_ms", fmt::format("{:.3f}", mean));
  kv("gpu_time_ms", fmt::format("{:.3f}", ms(s->gpu_ns)));
  TimeNs waited = s->queue_wait_ns;
  if (s->state == SessionState::queued) waited += now() - s->queued_at;
  kv("queue_wait_ms", fmt::format("{:.3f}", ms(waited)));
  kv("rank", rank);
  kv("recording", s->recording ? "yes" : "no");
  kv("error",
     s->error ? fmt::format("{} {}", strerrorname_np(s->error), s->error_text) : std::string("-"));
  return o;
}

std::string Broker::render_log(SessionId id) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  if (!s) return {};
  std::string o;
  for (const LogLine& l : s->log)
    o += fmt::format("[{:.6f}] {}\n", static_cast<double>(l.at) / 1e9, l.text);
  return o;
}

GpuTelemetrySnapshot Broker::telemetry_of(std::size_t gpu) const {
  if (telemetry_) return telemetry_->snapshot(gpu);
  GpuTelemetrySnapshot none;
  const std::string& backend = gpus_[gpu]->device->info().backend;
  none.why_not = backend == "cuda" ? "not sampled" : fmt::format("{} backend", backend);
  return none;
}

std::string Broker::render_gpu_info(std::size_t gi) const {
  // gpus_ never changes size after construction; the snapshot is taken before
  // mu_ so the two locks are never held together.
  if (gi >= gpus_.size()) return {};
  const std::string nvml = telemetry_lines(telemetry_of(gi));
  std::lock_guard lk(mu_);
  const DeviceInfo& d = gpus_[gi]->device->info();
  const DeviceHealth h = gpus_[gi]->device->health();
  auto or_dash = [](const std::string& v) { return v.empty() ? std::string("-") : v; };
  return fmt::format(
             "index: {}\nname: {}\nuuid: {}\nbackend: {}\ncapacity: {}\nmemory_total: {}\n"
             "sms: {}\ndriver: {}\nspin_cycles_per_us: {}\ndraining: {}\nbusy_1s: {:.3f}\n"
             "busy_10s: {:.3f}\nbusy_60s: {:.3f}\nisolation: {}\nexecutor_pid: {}\nstate: {}\n"
             "restarts: {}\nlast_restart: {}\nlast_fault: {}\n",
             gi, d.name, d.uuid, d.backend, d.arena_size, d.total_memory, d.sm_count,
             d.driver_version,
             d.spin_cycles_per_usec > 0 ? fmt::format("{:.1f}", d.spin_cycles_per_usec) : "-",
             gpus_[gi]->draining ? "yes" : "no", busy_fraction(*gpus_[gi], 1'000'000'000),
             busy_fraction(*gpus_[gi], 10'000'000'000), busy_fraction(*gpus_[gi], 60'000'000'000),
             h.isolation, h.executor_pid > 0 ? std::to_string(h.executor_pid) : std::string("-"),
             h.usable ? std::string("ok") : "out-of-service: " + h.unusable_why, h.restarts,
             or_dash(h.last_restart), or_dash(h.last_fault)) +
         nvml;
}

std::string Broker::render_gpu_summary(std::size_t gi) const {
  if (gi >= gpus_.size()) return {};
  const DeviceInfo& d = gpus_[gi]->device->info();
  return fmt::format("{} ({}, {}, {} managed of {}, {} SMs, driver {})", d.name, d.backend, d.uuid,
                     arena::format_size(d.arena_size), arena::format_size(d.total_memory),
                     d.sm_count, d.driver_version);
}

std::string Broker::render_gpu_memory(std::size_t gi) const {
  std::lock_guard lk(mu_);
  if (gi >= gpus_.size()) return {};
  const auto m = gpus_[gi]->sched.arena().memory();
  const auto& st = gpus_[gi]->sched.arena().stats();
  return fmt::format(
      "capacity: {}\npersistent_used: {}\npersistent_reserved: {}\nephemeral: {}\nlanes: {}\n"
      "free: {}\nlargest_hole: {}\nfragmentation: {:.3f}\nqueued: {}\n"
      "persistent_bytes_moved: {}\nlane_moves: {}\n",
      m.capacity, m.persistent_used, m.persistent_reserved, m.lane_total, m.lanes, m.free,
      m.largest_hole, m.fragmentation, m.queued, st.persistent_bytes_moved, st.lane_moves);
}

std::string Broker::render_gpu_lanes(std::size_t gi) const {
  std::lock_guard lk(mu_);
  if (gi >= gpus_.size()) return {};
  std::string o = "# id offset size used sessions running\n";
  for (const auto& l : gpus_[gi]->sched.arena().lanes()) {
    std::string members;
    for (SessionId sid : l.sessions) {
      if (!members.empty()) members += ',';
      members += std::to_string(sid);
    }
    o += fmt::format("{} {} {} {} {} {}\n", l.id, l.offset ? std::to_string(*l.offset) : "-",
                     l.size, l.used, members.empty() ? "-" : members,
                     l.running ? std::to_string(*l.running) : "-");
  }
  return o;
}

std::string Broker::render_gpu_queue(std::size_t gi) const {
  std::lock_guard lk(mu_);
  if (gi >= gpus_.size()) return {};
  std::string o = "# position session persistent ephemeral waited_ms bypassed\n";
  std::size_t pos = 0;
  const TimeNs t = now();
  for (const auto& q : gpus_[gi]->sched.arena().queue()) {
    o += fmt::format("{} {} {} {} {:.1f} {}\n", ++pos, q.session, q.need.persistent,
                     q.need.ephemeral, ms(t - q.waiting_since), q.bypassed);
  }
  return o;
}

std::string Broker::render_policy() const {
  std::lock_guard lk(mu_);
  const sched::PolicyKind p = gpus_.empty() ? config_.policy : gpus_[0]->sched.policy();
  const auto& opts = gpus_.empty() ? config_.arena : gpus_[0]->sched.arena().options();
  std::string o = fmt::format("policy: {}\n", sched::to_string(p));
  o += fmt::format("placement: {}\n", sched::to_string(config_.placement));
  o += fmt::format("queue: {}\n", opts.queue_mode == arena::QueueMode::strict_fifo
                                      ? "strict"
                                      : fmt::format("bypass max_bypass={}", opts.max_bypass));
  o += fmt::format("pipeline_depth: {}\n", config_.pipeline_depth);
  o += "# policies: fifo (arrival order), pack (arrival order, as many lanes as fit),\n"
       "#   srtf (least (iters - done) x mean iteration time first; sessions without iters=\n"
       "#   rank last), fair (equal GPU time per lane by virtual time), priority (larger\n"
       "#   priority first, FIFO within a level). Switch: echo NAME > policy\n";
  return o;
}

std::string Broker::render_stats() const {
  std::lock_guard lk(mu_);
  std::uint64_t decisions = 0, switches = 0, preemptions = 0, lane_moves = 0, moves = 0;
  arena::Bytes bytes_moved = 0;
  std::size_t lanes = 0, queued = 0;
  for (const auto& g : gpus_) {
    const auto& as = g->sched.arena().stats();
    lane_moves += as.lane_moves;
    moves += as.persistent_moves;
    bytes_moved += as.persistent_bytes_moved;
    decisions += g->sched.stats().decisions;
    switches += g->sched.stats().switches;
    preemptions += g->sched.stats().preemptions;
    lanes += g->lanes.size();
    queued += g->sched.arena().memory().queued;
  }
  const double up = static_cast<double>(now()) / 1e9;
  std::string o;
  auto kv = [&](std::string_view k, const auto& v) { o += fmt::format("{} {}\n", k, v); };
  kv("version", SALUS_VERSION);
  kv("uptime_s", fmt::format("{:.3f}", up));
  kv("gpus", gpus_.size());
  kv("sessions", sessions_.size());
  kv("sessions_created", stats_.sessions_created);
  kv("sessions_ended", stats_.sessions_ended);
  kv("lanes", lanes);
  kv("queued_sessions", queued);
  kv("commands", stats_.commands);
  kv("command_errors", stats_.command_errors);
  kv("quota_rejections", stats_.quota_rejections);
  kv("iterations", stats_.iterations);
  kv("ops", stats_.ops);
  kv("bytes_to_host", stats_.bytes_to_host);
  kv("bytes_from_host", stats_.bytes_from_host);
  TransferEngine::Stats ts;
  StagingPool::Stats ss;
  for (const auto& g : gpus_) {
    const auto t = g->transfers->stats();
    ts.active += t.active;
    ts.waiting += t.waiting;
    ts.started += t.started;
    ts.completed += t.completed;
    ts.failed += t.failed;
    ts.cancelled += t.cancelled;
    ts.direct += t.direct;
    ts.segments += t.segments;
    ts.segment_bytes += t.segment_bytes;
    const auto p = g->staging->stats();
    ss.in_use += p.in_use;
    ss.cached += p.cached;
  }
  kv("transfers_active", ts.active);
  kv("transfers_waiting", ts.waiting);
  kv("transfers_completed", ts.completed);
  kv("transfers_failed", ts.failed);
  kv("transfers_cancelled", ts.cancelled);
  kv("transfers_direct", ts.direct);
  kv("shm_segments_mapped", ts.segments);
  kv("shm_segment_bytes", ts.segment_bytes);
  kv("staging_bytes_in_use", ss.in_use);
  kv("staging_bytes_cached", ss.cached);
  kv("decisions", decisions);
  kv("decisions_per_s", fmt::format("{:.1f}", up > 0 ? static_cast<double>(decisions) / up : 0.0));
  kv("switches", switches);
  kv("preemptions", preemptions);
  kv("lane_moves", lane_moves);
  kv("persistent_moves", moves);
  kv("persistent_bytes_moved", bytes_moved);
  return o;
}

std::string Broker::render_metrics() const {
  std::vector<GpuTelemetrySnapshot> telemetry;
  for (std::size_t i = 0; i < gpus_.size(); ++i) telemetry.push_back(telemetry_of(i));
  std::lock_guard lk(mu_);
  std::string o;
  auto family = [&](std::string_view name, std::string_view type, std::string_view help) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  // NVML families appear only when some GPU gives the reading, and then only
  // with the GPUs that give it: an absent sample, not a made-up 0.
  auto nvml_family = [&](std::string_view name, std::string_view type, std::string_view help,
                         std::optional<double> GpuReadings::*field, const char* format) {
    bool any = false;
    for (const auto& t : telemetry) any = any || (t.readings.*field).has_value();
    if (!any) return;
    family(name, type, help);
    for (std::size_t i = 0; i < telemetry.size(); ++i)
      if (const auto& v = telemetry[i].readings.*field)
        o += fmt::format("{}{{gpu=\"{}\"}} {}\n", name, i, fmt::format(fmt::runtime(format), *v));
  };
  family("salus_gpu_memory_bytes", "gauge", "GPU arena bytes by class.");
  for (const auto& g : gpus_) {
    const auto m = g->sched.arena().memory();
    o += fmt::format("salus_gpu_memory_bytes{{gpu=\"{}\",class=\"capacity\"}} {}\n", g->index,
                     m.capacity);
    o += fmt::format("salus_gpu_memory_bytes{{gpu=\"{}\",class=\"persistent\"}} {}\n", g->index,
                     m.persistent_used);
    o += fmt::format("salus_gpu_memory_bytes{{gpu=\"{}\",class=\"reserved\"}} {}\n", g->index,
                     m.persistent_reserved);
    o += fmt::format("salus_gpu_memory_bytes{{gpu=\"{}\",class=\"ephemeral\"}} {}\n", g->index,
                     m.lane_total);
    o += fmt::format("salus_gpu_memory_bytes{{gpu=\"{}\",class=\"free\"}} {}\n", g->index, m.free);
  }
  family("salus_lane_count", "gauge", "Lanes open on the GPU.");
  for (const auto& g : gpus_)
    o += fmt::format("salus_lane_count{{gpu=\"{}\"}} {}\n", g->index,
                     g->sched.arena().memory().lanes);
  family("salus_gpu_busy_seconds_total", "counter", "Device time with at least one op running.");
  for (const auto& g : gpus_)
    o += fmt::format("salus_gpu_busy_seconds_total{{gpu=\"{}\"}} {:.9f}\n", g->index,
                     static_cast<double>(g->device->busy_ns()) / 1e9);
  family("salus_gpu_restarts_total", "counter",
         "Times the GPU lost its context and was given a fresh one (executor restarts).");
  for (const auto& g : gpus_)
    o += fmt::format("salus_gpu_restarts_total{{gpu=\"{}\"}} {}\n", g->index,
                     g->device->health().restarts);
  family("salus_gpu_busy_ratio", "gauge",
         "Fraction of the last window during which the GPU ran at least one op.");
  for (const auto& g : gpus_)
    for (const auto& [label, ns] : {std::pair<const char*, TimeNs>{"1s", 1'000'000'000},
                                    {"10s", 10'000'000'000},
                                    {"60s", 60'000'000'000}})
      o += fmt::format("salus_gpu_busy_ratio{{gpu=\"{}\",window=\"{}\"}} {:.4f}\n", g->index, label,
                       busy_fraction(*g, ns));
  nvml_family("salus_gpu_sm_utilization_ratio", "gauge",
              "NVML: fraction of the driver's last sample period during which a kernel ran.",
              &GpuReadings::sm_util, "{:.2f}");
  nvml_family("salus_gpu_memory_controller_utilization_ratio", "gauge",
              "NVML: fraction of the driver's last sample period during which device memory "
              "was read or written.",
              &GpuReadings::mem_util, "{:.2f}");
  nvml_family("salus_gpu_power_watts", "gauge", "NVML: board power draw.", &GpuReadings::power_w,
              "{:.3f}");
  nvml_family("salus_gpu_energy_joules_total", "counter",
              "NVML: energy consumed since the driver was loaded.", &GpuReadings::energy_j,
              "{:.3f}");
  nvml_family("salus_gpu_temperature_celsius", "gauge", "NVML: GPU die temperature.",
              &GpuReadings::temperature_c, "{:.0f}");
  family("salus_switches_total", "counter", "Lane switches between sessions.");
  for (const auto& g : gpus_)
    o +=
        fmt::format("salus_switches_total{{gpu=\"{}\"}} {}\n", g->index, g->sched.stats().switches);
  family("salus_session_iterations_total", "counter", "Iterations finished by the session.");
  for (const auto& [id, s] : sessions_)
    o += fmt::format("salus_session_iterations_total{{session=\"{}\",uid=\"{}\"}} {}\n",
                     s->dir_name, s->uid, s->iterations_done);
  family("salus_session_gpu_seconds_total", "counter", "Device time used by the session.");
  for (const auto& [id, s] : sessions_)
    o += fmt::format("salus_session_gpu_seconds_total{{session=\"{}\",uid=\"{}\"}} {:.9f}\n",
                     s->dir_name, s->uid, static_cast<double>(s->gpu_ns) / 1e9);
  family("salus_session_queue_seconds", "gauge", "Time the session waited for admission.");
  for (const auto& [id, s] : sessions_) {
    TimeNs waited = s->queue_wait_ns;
    if (s->state == SessionState::queued) waited += now() - s->queued_at;
    o += fmt::format("salus_session_queue_seconds{{session=\"{}\",uid=\"{}\"}} {:.9f}\n",
                     s->dir_name, s->uid, static_cast<double>(waited) / 1e9);
  }
  family("salus_sessions", "gauge", "Live sessions.");
  o += fmt::format("salus_sessions {}\n", sessions_.size());
  family("salus_iterations_total", "counter", "Iterations finished on all GPUs.");
  o += fmt::format("salus_iterations_total {}\n", stats_.iterations);
  family("salus_command_errors_total", "counter", "Commands that failed.");
  o += fmt::format("salus_command_errors_total {}\n", stats_.command_errors);
  family("salus_transfers_total", "counter", "upload/download transfers that ended, by result.");
  for (const auto& g : gpus_) {
    const auto t = g->transfers->stats();
    for (const auto& [result, n] : {std::pair<const char*, std::uint64_t>{"completed", t.completed},
                                    {"failed", t.failed},
                                    {"cancelled", t.cancelled}})
      o += fmt::format("salus_transfers_total{{gpu=\"{}\",result=\"{}\"}} {}\n", g->index, result,
                       n);
  }
  family("salus_shm_segment_bytes", "gauge",
         "Shared-memory segments mapped (on cuda, pinned) for direct transfers.");
  for (const auto& g : gpus_)
    o += fmt::format("salus_shm_segment_bytes{{gpu=\"{}\"}} {}\n", g->index,
                     g->transfers->stats().segment_bytes);
  family("salus_staging_bytes", "gauge", "Host staging memory of the data plane.");
  for (const auto& g : gpus_) {
    const auto p = g->staging->stats();
    o += fmt::format("salus_staging_bytes{{gpu=\"{}\",state=\"in_use\"}} {}\n", g->index, p.in_use);
    o += fmt::format("salus_staging_bytes{{gpu=\"{}\",state=\"cached\"}} {}\n", g->index, p.cached);
  }
  return o;
}

}  // namespace salus::vgpu
