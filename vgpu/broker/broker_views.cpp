// The broker's state rendered as the text of the /salus files: snapshots taken
// under the broker lock, formatted as "key: value" lines or one row per object.
#include <cstring>

#include <fmt/format.h>

#include "salus_config.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"
#include "vgpu/mps/mps_control.hpp"

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

// The session's scheduling key under the current policy, for `rank` in status.
std::string rank_text(const sched::GpuScheduler& gs, const sched::SessionSched& ss) {
  switch (gs.policy()) {
    case sched::PolicyKind::fair: {
      std::string rank = fmt::format("vtime={}ns", ss.in.vtime);
      // Charged for each of its uid's sessions competing in the lane.
      if (const std::int64_t f = gs.fair_factor(ss); f > 1) rank += fmt::format(" x{}", f);
      // Across lanes: what its uid received on this GPU, and whether it waits for
      // a uid that received less (GpuScheduler::pick).
      if (sched::by_owner(gs.fair_share())) {
        rank += fmt::format(" user_gpu_ms={:.1f}",
                            static_cast<double>(gs.owner_service_ns(ss.owner)) / 1e6);
        if (gs.held_for_owner(ss)) rank += " held(user ahead across lanes)";
      }
      return rank;
    }
    case sched::PolicyKind::srtf: {
      const double r = sched::remaining_ns(ss.in);
      return sched::overran(ss.in)           ? "remaining=unknown(past iters=; ranks last)"
             : r >= sched::kUnknownRemaining ? "remaining=unknown(no iters=; ranks last)"
                                             : fmt::format("remaining={:.1f}ms", r / 1e6);
    }
    case sched::PolicyKind::priority:
      return fmt::format("priority={}", ss.in.priority);
    default:
      return fmt::format("arrival={}", ss.in.arrival);
  }
}

}  // namespace

std::string Broker::render_status(SessionId id) const {
  // The driver's own figures (NVML), taken before the lock (telemetry_of).
  std::vector<GpuTelemetrySnapshot> telemetry;
  if (telemetry_)
    for (std::size_t i = 0; i < gpus_.size(); ++i) telemetry.push_back(telemetry_of(i));
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
  // gpu=any on several GPUs: bound to none until one admits it (late binding).
  const std::string host_pos = host_queue_position(s->id);
  kv("host_queue", host_pos.empty() ? std::string("-") : host_pos);
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
    if (const auto* ss = g.sched.find(s->id)) rank = rank_text(g.sched, *ss);
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
  kv("compaction", compaction_role(*s));
  kv("recording", s->recording ? "yes" : "no");
  kv("recording_begun", s->recording ? fmt::format("line {} of write {}", s->recording->begun_line,
                                                   s->recording->begun_write)
                                     : std::string("-"));
  kv("error",
     s->error ? fmt::format("{} {}", strerrorname_np(s->error), s->error_text) : std::string("-"));
  // Declared kind=attached, before its program attaches or between two of them,
  // it is attached already (placed and admitted as such); `pid` says whether a
  // program holds it now.
  kv("kind", will_attach(*s) ? "attached" : "hosted");
  kv("pid", s->gate ? std::to_string(s->gate->pid) : std::string("-"));
  // An attached program reports its own residency (render_gate_status).
  if (!s->gate) render_residency(*s, o);
  if (s->gate)
    render_gate_status(
        *s, static_cast<std::size_t>(s->gpu) < telemetry.size() ? &telemetry[s->gpu] : nullptr, o);
  return o;
}

namespace {

// The card memory of session `id`'s ungated processes on every GPU, at the last
// census (broker_processes.cpp).
template <class Gpus>
Bytes ungated_bytes_of(const Gpus& gpus, SessionId id) {
  Bytes sum = 0;
  for (const auto& g : gpus) sum += g->ungated_bytes(id);
  return sum;
}

// NVML's entry for process `pid` in a GPU's process list, or null.
const GpuReadings::Process* find_process(pid_t pid, const GpuTelemetrySnapshot* t) {
  if (!t || !t->available || !t->readings.processes) return nullptr;
  for (const auto& p : *t->readings.processes)
    if (p.pid == pid) return &p;
  return nullptr;
}

}  // namespace

std::optional<Bytes> Broker::process_gpu_bytes(pid_t pid, const GpuTelemetrySnapshot* t) {
  const GpuReadings::Process* p = find_process(pid, t);
  return p && p->bytes ? std::optional<Bytes>(*p->bytes) : std::nullopt;
}

// The driver's figure for process `pid` on GPU `g` (NVML), or why there is none.
std::string Broker::gpu_memory_of(pid_t pid, const Gpu& g, const GpuTelemetrySnapshot* t) const {
  if (!t || !t->available) {
    if (g.device->info().backend == "sim") return "unavailable (sim backend: no driver figure)";
    return fmt::format("unavailable ({})", t ? t->why_not : std::string("no NVML telemetry"));
  }
  if (!t->readings.processes) return "unavailable (NVML gives no process list for this GPU)";
  if (const GpuReadings::Process* p = find_process(pid, t))
    return p->bytes ? std::to_string(*p->bytes)
                    : std::string("unavailable (the driver does not give the process's memory)");
  // NVML lists host pids; salusd in another pid namespace sees other numbers.
  return fmt::format("0 (NVML lists no compute process {} on the GPU)", pid);
}

// The attached session's gate, as the program last reported it (salus(5)).
void Broker::render_gate_status(const Session& s, const GpuTelemetrySnapshot* t,
                                std::string& o) const {
  auto kv = [&](std::string_view k, const auto& v) { o += fmt::format("{}: {}\n", k, v); };
  const AttachedGate& gt = *s.gate;
  salus_gate& G = gt.g();
  const std::uint32_t mark = gate_load(G.marking);
  kv("gate", gt.exited ? "detached" : "attached");
  kv("marking", mark == SALUS_MARK_EXPLICIT ? "explicit"
                : mark == SALUS_MARK_SLICE  ? "slice"
                                            : "none");
  kv("iterations_requested", gate_load(G.requested));
  kv("iterations_granted", gt.granted);
  kv("iterations_completed", gate_load(G.completed));
  const std::uint64_t budget = gate_load(G.budget_bytes);
  kv("memory_budget", budget == UINT64_MAX ? std::string("unlimited") : std::to_string(budget));
  kv("memory_charged", gate_load(G.charged_bytes));
  kv("memory_peak", gate_load(G.peak_bytes));
  const Gpu& g = *gpus_[static_cast<std::size_t>(s.gpu)];
  kv("memory_gpu", gpu_memory_of(gt.pid, g, t));
  kv("memory_context_reserve", context_of(s));
  // The driver's figure beyond the charge: the CUDA context, module code, and
  // memory taken around the shim.
  const std::optional<Bytes> on_gpu = process_gpu_bytes(gt.pid, t);
  const std::uint64_t charged = gate_load(G.charged_bytes);
  kv("memory_context",
     on_gpu ? std::to_string(*on_gpu > charged ? *on_gpu - charged : 0) : std::string("-"));
  // The job's other processes on the card (broker_processes.cpp): no NVML, no figure.
  kv("memory_ungated", gpus_[static_cast<std::size_t>(s.gpu)]->outside_known
                           ? std::to_string(ungated_bytes_of(gpus_, s.id))
                           : std::string("-"));
  kv("launches", gate_load(G.launches));
  kv("gate_waits", gate_load(G.gate_waits));
  kv("gate_wait_ms", fmt::format("{:.3f}", ms(static_cast<std::int64_t>(std::min<std::uint64_t>(
                                               gate_load(G.gate_wait_ns), INT64_MAX)))));
  kv("lane_held_ms", fmt::format("{:.3f}", ms(s.lane_held_ns)));
  kv("hold_limit_releases", gt.hold_releases);
  kv("oom_refusals", gate_load(G.oom_refusals));
  kv("yield_requests", gt.yields);
  kv("quantum_ms", fmt::format("{:.3f}", ms(config_.quantum_ns)));
  // Movable memory (issue 15): where the program's memory is now.
  kv("residency", swap_state_name(gate_load(G.swap_state)));
  kv("memory_resident", gate_load(G.resident_bytes));
  kv("memory_swapped", gate_load(G.swapped_bytes));
  kv("memory_unswappable", gate_load(G.unswappable_bytes));
  // The session's share of the card's resident set as admission counts it: all
  // of it on the card; swapped, its context and what stays (the shim's report,
  // or the driver's figure where that was larger).
  kv("memory_counted_on_card", g.sched.arena().on_card_bytes(s.id));
  kv("swaps_out", gate_load(G.swaps_out));
  kv("swaps_in", gate_load(G.swaps_in));
  kv("swap_ms", fmt::format("{:.3f}", static_cast<double>(gate_load(G.swap_ns)) / 1e6));
  kv("swappable", gt.unswappable ? "no" : "yes");  // no: answered ENOTSUP, never asked again
  kv("swap_error", gt.swap_pending ? std::string("pending")
                   : gt.swap_error ? std::string(strerrorname_np(gt.swap_error))
                                   : std::string("-"));
  render_lane_status(s, g, o);
}

void Broker::render_lane_status(const Session& s, const Gpu& g, std::string& o) const {
  // Shared lane (issue 15): off (not opted in), held (its program may map the
  // lane memory now) or free; the rest are the GPU lane's figures.
  const SharedLane& L = g.shared_lane;
  const bool on = shares_lane(s);
  o += fmt::format("shared_lane: {}\n", !on                ? "off"
                                        : s.gate->lane_off ? "failed"
                                        : L.holder == s.id ? "held"
                                                           : "free");
  if (!on) return;
  // room: its own cuMemCreate is charged to the lane (SALUS_SHARED_LANE=segments).
  o += fmt::format("lane_use: {}\n", s.gate->lane_room ? "room" : "memory");
  o += fmt::format(
      "lane_memory: {}\nlane_handovers: {}\nlane_clears: {}\nlane_clear_ms: {:.3f}\n"
      "lane_yield_wait_ms: {:.3f}\nlane_abandoned: {}\n",
      L.bytes, L.handovers, L.clears, static_cast<double>(L.clear_ns) / 1e6,
      static_cast<double>(L.release_wait_ns) / 1e6, L.abandoned);
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

// `mps: on|off|down` and the pipe directory attached programs must use
// (CUDA_MPS_PIPE_DIRECTORY; salus-run sets it). down: salusd started the
// daemon but it is gone, so new programs would fail to start on this GPU.
std::string Broker::mps_lines(std::size_t gi) const {
  const MpsControl* m = gi < config_.mps.size() ? config_.mps[gi] : nullptr;
  if (!m) return "mps: off\nmps_pipe_directory: -\n";
  return fmt::format("mps: {}\nmps_pipe_directory: {}\n", m->alive() ? "on" : "down",
                     m->pipe_directory());
}

namespace {
// How long the GPU has been idle while sessions wait for it, this episode (0: not now).
template <class G>
double idle_episode_ms(const G& g) {
  return g.idle_waiting_since == 0
             ? 0.0
             : static_cast<double>(g.idle_watched_at - g.idle_waiting_since) / 1e6;
}
}  // namespace

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
             "busy_10s: {:.3f}\nbusy_60s: {:.3f}\nidle_waiting_ms: {:.1f}\n"
             "idle_waiting_total_s: {:.3f}\nidle_waiting_reports: {}\nisolation: {}\n"
             "executor_pid: {}\nstate: {}\nrestarts: {}\nlast_restart: {}\nlast_fault: {}\n",
             gi, d.name, d.uuid, d.backend, d.arena_size, d.total_memory, d.sm_count,
             d.driver_version,
             d.spin_cycles_per_usec > 0 ? fmt::format("{:.1f}", d.spin_cycles_per_usec) : "-",
             gpus_[gi]->draining ? "yes" : "no", busy_fraction(*gpus_[gi], 1'000'000'000),
             busy_fraction(*gpus_[gi], 10'000'000'000), busy_fraction(*gpus_[gi], 60'000'000'000),
             idle_episode_ms(*gpus_[gi]), static_cast<double>(gpus_[gi]->idle_waiting_ns) / 1e9,
             gpus_[gi]->idle_warnings, h.isolation,
             h.executor_pid > 0 ? std::to_string(h.executor_pid) : std::string("-"),
             h.usable ? std::string("ok") : "out-of-service: " + h.unusable_why, h.restarts,
             or_dash(h.last_restart), or_dash(h.last_fault)) +
         mps_lines(gi) + nvml;
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
  // Processes of no session (broker_processes.cpp): "-" where no census counted.
  const auto [outside_bytes, outside_count] = gpus_[gi]->outside();
  const auto known = [&](auto v) {
    return gpus_[gi]->outside_known ? std::to_string(v) : std::string("-");
  };
  return fmt::format(
      "capacity: {}\npersistent_used: {}\npersistent_reserved: {}\nephemeral: {}\nlanes: {}\n"
      "free: {}\nlargest_hole: {}\nfragmentation: {:.3f}\nqueued: {}\n"
      "persistent_bytes_moved: {}\nlane_moves: {}\n"
      "oversubscribe: {}\nadmit_capacity: {}\nresident: {}\nresident_reserved: {}\n"
      "swapped: {}\nhost_swapped: {}\n"
      "spilled: {}\nbacking: {}\nbacked: {}\nbacking_wait: {}\ncontext_reserve: {}\n"
      "context_measured: {}\noutside_sessions: {}\noutside_processes: {}\n",
      m.capacity, m.persistent_used, m.persistent_reserved, m.lane_total, m.lanes, m.free,
      m.largest_hole, m.fragmentation, m.queued, st.persistent_bytes_moved, st.lane_moves,
      gpus_[gi]->sched.arena().options().oversubscribe, m.admit_capacity,
      m.persistent_used - m.swapped, m.resident_reserved, m.swapped, gpus_[gi]->host_swapped,
      gpus_[gi]->spill ? gpus_[gi]->spill->bytes_reserved() : 0,
      gpus_[gi]->device->info().backs_on_demand ? "on-demand" : "up-front",
      gpus_[gi]->device->backed_bytes(),
      gpus_[gi]->backing_why.empty() ? std::string("-") : gpus_[gi]->backing_why,
      context_reserve_on(static_cast<int>(gi)), gpus_[gi]->context_measured, known(outside_bytes),
      known(outside_count));
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
  o += fmt::format("quantum_ms: {}\n", config_.quantum_ns / 1'000'000);
  o += fmt::format("fair_share: {}\n", sched::to_string(config_.fair_share));
  o += fmt::format("oversubscribe: {}\n", opts.oversubscribe);
  if (!gpus_.empty() && opts.oversubscribe > 1.0) {
    // The residency quantum: a session swapped in stays at least this long, so that
    // its swap (out and back in, at the measured bandwidth) is at most 10% of it.
    const sched::SwapCostModel& c = gpus_[0]->sched.residency().cost();
    o += fmt::format("swap_bandwidth_gbps: {:.2f}{}\n", c.bytes_per_s / 1e9,
                     c.measured ? "" : " (prior, not measured yet)");
    o += fmt::format("resident_quantum_ms_per_gib: {:.1f}\n",
                     static_cast<double>(c.quantum_ns(Bytes{1} << 30)) / 1e6);
    o += fmt::format("swap_share_max: {:.2f}\n", c.max_swap_share);
  }
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
  std::size_t watchers = 0;
  for (const auto& [id, s] : sessions_) watchers += s->watchers.size();
  kv("poll_watchers", watchers);
  const CallerIo::Stats io = caller_io_->stats();
  kv("caller_io_threads", io.threads);
  kv("caller_io_busy", io.busy);
  kv("caller_io_queued", io.queued);
  kv("decisions", decisions);
  kv("decisions_per_s", fmt::format("{:.1f}", up > 0 ? static_cast<double>(decisions) / up : 0.0));
  kv("switches", switches);
  kv("preemptions", preemptions);
  kv("lane_moves", lane_moves);
  kv("persistent_moves", moves);
  kv("persistent_bytes_moved", bytes_moved);
  return o;
}

namespace {

// Prometheus text, one family at a time: its HELP and TYPE lines, then its
// samples. A new metric is one call to the method of its shape.
class MetricsText {
 public:
  using Labelled = std::vector<std::pair<const char*, std::string>>;

  void family(std::string_view name, std::string_view type, std::string_view help) {
    o_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  // One sample per GPU; value(gpu) gives it, formatted.
  template <class Gpus, class Value>
  void per_gpu(const Gpus& gpus, std::string_view name, std::string_view type,
               std::string_view help, Value value) {
    family(name, type, help);
    for (const auto& g : gpus)
      o_ += fmt::format("{}{{gpu=\"{}\"}} {}\n", name, g->index, value(*g));
  }
  // One sample per GPU where value(gpu) gives one (an optional string); the
  // family only when some GPU does: an absent sample, not a made-up 0.
  template <class Gpus, class Value>
  void per_gpu_known(const Gpus& gpus, std::string_view name, std::string_view type,
                     std::string_view help, Value value) {
    bool any = false;
    for (const auto& g : gpus) any = any || value(*g).has_value();
    if (!any) return;
    family(name, type, help);
    for (const auto& g : gpus)
      if (const std::optional<std::string> v = value(*g))
        o_ += fmt::format("{}{{gpu=\"{}\"}} {}\n", name, g->index, *v);
  }
  // Several samples per GPU told apart by the label `key`: values(gpu) lists
  // (label value, formatted sample) pairs.
  template <class Gpus, class Values>
  void per_gpu_by(const Gpus& gpus, std::string_view name, std::string_view type,
                  std::string_view help, std::string_view key, Values values) {
    family(name, type, help);
    for (const auto& g : gpus)
      for (const auto& [label, v] : Labelled(values(*g)))
        o_ += fmt::format("{}{{gpu=\"{}\",{}=\"{}\"}} {}\n", name, g->index, key, label, v);
  }
  // One sample per session; value(session) gives it, formatted.
  template <class Sessions, class Value>
  void per_session(const Sessions& sessions, std::string_view name, std::string_view type,
                   std::string_view help, Value value) {
    family(name, type, help);
    for (const auto& [id, s] : sessions)
      o_ +=
          fmt::format("{}{{session=\"{}\",uid=\"{}\"}} {}\n", name, s->dir_name, s->uid, value(*s));
  }
  template <class T>
  void single(std::string_view name, std::string_view type, std::string_view help, const T& v) {
    family(name, type, help);
    o_ += fmt::format("{} {}\n", name, v);
  }
  // NVML families appear only when some GPU gives the reading, and then only
  // with the GPUs that give it: an absent sample, not a made-up 0.
  void nvml(const std::vector<GpuTelemetrySnapshot>& telemetry, std::string_view name,
            std::string_view type, std::string_view help, std::optional<double> GpuReadings::*field,
            const char* format) {
    bool any = false;
    for (const auto& t : telemetry) any = any || (t.readings.*field).has_value();
    if (!any) return;
    family(name, type, help);
    for (std::size_t i = 0; i < telemetry.size(); ++i)
      if (const auto& v = telemetry[i].readings.*field)
        o_ += fmt::format("{}{{gpu=\"{}\"}} {}\n", name, i, fmt::format(fmt::runtime(format), *v));
  }
  // Attached sessions only, labelled with their program's pid: value(gate)
  // reads what the program reports. Absent when no session is attached.
  template <class Sessions, class Value>
  void per_gate(const Sessions& sessions, std::string_view name, std::string_view type,
                std::string_view help, Value value) {
    per_gate_known(sessions, name, type, help, [&](const Session& s) {
      return std::optional<std::string>(fmt::format("{}", value(s.gate->g())));
    });
  }
  // Attached sessions whose value(session) is known (an optional): a session
  // without one has no sample, and the family is absent when none has one.
  template <class Sessions, class Value>
  void per_gate_known(const Sessions& sessions, std::string_view name, std::string_view type,
                      std::string_view help, Value value) {
    std::string samples;
    for (const auto& [id, s] : sessions)
      if (s->gate)
        if (const auto v = value(*s))
          samples += fmt::format("{}{{session=\"{}\",uid=\"{}\",pid=\"{}\"}} {}\n", name,
                                 s->dir_name, s->uid, s->gate->pid, *v);
    if (samples.empty()) return;
    family(name, type, help);
    o_ += samples;
  }
  std::string take() { return std::move(o_); }

 private:
  std::string o_;
};

// The families of attached sessions: what their programs report through the
// gate (render_metrics, one helper per family group).
template <class Sessions>
void gate_families(MetricsText& m, const Sessions& sessions_) {
  m.per_gate(sessions_, "salus_session_memory_charged_bytes", "gauge",
             "Attached session: device memory its program holds now.",
             [](salus_gate& G) { return gate_load(G.charged_bytes); });
  m.per_gate(sessions_, "salus_session_memory_peak_bytes", "gauge",
             "Attached session: the most device memory its program held.",
             [](salus_gate& G) { return gate_load(G.peak_bytes); });
  m.per_gate(sessions_, "salus_session_memory_budget_bytes", "gauge",
             "Attached session: device memory its program may hold (-1: unlimited).",
             [](salus_gate& G) {
               const std::uint64_t b = gate_load(G.budget_bytes);
               return b == UINT64_MAX ? std::string("-1") : std::to_string(b);
             });
  m.per_gate(sessions_, "salus_session_memory_swapped_bytes", "gauge",
             "Attached session: its device memory now on the host (swapped out).",
             [](salus_gate& G) { return gate_load(G.swapped_bytes); });
  m.per_gate(sessions_, "salus_session_swaps_out_total", "counter",
             "Attached session: swap-outs its program carried out.",
             [](salus_gate& G) { return gate_load(G.swaps_out); });
  m.per_gate(sessions_, "salus_session_swaps_in_total", "counter",
             "Attached session: swap-ins its program carried out.",
             [](salus_gate& G) { return gate_load(G.swaps_in); });
  m.per_gate(sessions_, "salus_session_swap_seconds_total", "counter",
             "Attached session: time its program spent moving memory out and in.",
             [](salus_gate& G) {
               return fmt::format("{:.6f}", static_cast<double>(gate_load(G.swap_ns)) / 1e9);
             });
  m.per_gate(sessions_, "salus_session_gate_waits_total", "counter",
             "Attached session: iteration boundaries that waited for a grant.",
             [](salus_gate& G) { return gate_load(G.gate_waits); });
  m.per_gate(sessions_, "salus_session_gate_wait_seconds_total", "counter",
             "Attached session: time its boundaries waited for grants.", [](salus_gate& G) {
               return fmt::format("{:.9f}", static_cast<double>(gate_load(G.gate_wait_ns)) / 1e9);
             });
  m.per_gate_known(sessions_, "salus_session_lane_held_seconds_total", "counter",
                   "Attached session: time its iterations held the GPU's attached lane, "
                   "as salusd measured it.",
                   [](const Session& s) {
                     return std::optional<std::string>(
                         fmt::format("{:.9f}", static_cast<double>(s.lane_held_ns) / 1e9));
                   });
  m.per_gate_known(sessions_, "salus_session_hold_limit_releases_total", "counter",
                   "Attached session: iterations that held the lane past salusd's "
                   "--attach-hold-limit while others waited.",
                   [](const Session& s) {
                     return std::optional<std::string>(std::to_string(s.gate->hold_releases));
                   });
  m.per_gate(sessions_, "salus_session_launches_total", "counter",
             "Attached session: kernel launches its program made.",
             [](salus_gate& G) { return gate_load(G.launches); });
  m.per_gate(sessions_, "salus_session_oom_refusals_total", "counter",
             "Attached session: allocations refused for its budget.",
             [](salus_gate& G) { return gate_load(G.oom_refusals); });
}

// The memory families: the arena by class, oversubscription's swaps and the
// shared lane of attached sessions.
template <class Gpus>
void memory_families(MetricsText& m, const Gpus& gpus) {
  using Labelled = MetricsText::Labelled;
  auto str = [](auto v) { return fmt::format("{}", v); };
  auto seconds = [](TimeNs ns) { return fmt::format("{:.9f}", static_cast<double>(ns) / 1e9); };
  m.per_gpu_by(gpus, "salus_gpu_memory_bytes", "gauge", "GPU arena bytes by class.", "class",
               [&](const auto& g) {
                 const auto mem = g.sched.arena().memory();
                 return Labelled{{"capacity", str(mem.capacity)},
                                 {"persistent", str(mem.persistent_used)},
                                 {"reserved", str(mem.persistent_reserved)},
                                 {"ephemeral", str(mem.lane_total)},
                                 {"free", str(mem.free)},
                                 {"resident", str(mem.persistent_used - mem.swapped)},
                                 {"swapped", str(mem.swapped)}};
               });
  m.per_gpu_by(gpus, "salus_swaps_total", "counter",
               "Oversubscription: swaps of sessions' persistent memory, by direction.", "direction",
               [&](const auto& g) {
                 const auto& t = g.sched.residency().totals();
                 return Labelled{{"out", str(t.swaps_out)}, {"in", str(t.swaps_in)}};
               });
  m.per_gpu(gpus, "salus_swap_seconds_total", "counter",
            "Oversubscription: time spent swapping, both directions.",
            [&](const auto& g) { return seconds(g.sched.residency().totals().swap_ns); });
  m.per_gpu(gpus, "salus_gpu_idle_waiting_seconds_total", "counter",
            "Time the GPU ran nothing while sessions waited for it (admission, swap-in or "
            "dispatch), sampled every 250 ms.",
            [&](const auto& g) { return seconds(g.idle_waiting_ns); });
  m.per_gpu(gpus, "salus_gpu_idle_waiting_reports_total", "counter",
            "Episodes of the GPU idle while sessions waited that lasted past --idle-warn.",
            [&](const auto& g) { return str(g.idle_warnings); });
  m.per_gpu(gpus, "salus_shared_lane_bytes", "gauge",
            "Shared lane of attached sessions: size of its memory now (0: none).",
            [&](const auto& g) { return str(g.shared_lane.bytes); });
  m.per_gpu_by(gpus, "salus_shared_lane_events_total", "counter",
               "Shared lane of attached sessions: hand-overs, clears, memories abandoned.", "event",
               [&](const auto& g) {
                 const SharedLane& L = g.shared_lane;
                 return Labelled{{"handover", str(L.handovers)},
                                 {"clear", str(L.clears)},
                                 {"abandoned", str(L.abandoned)}};
               });
  m.per_gpu_by(
      gpus, "salus_shared_lane_seconds_total", "counter",
      "Shared lane of attached sessions: time clearing it, and waiting for yields.", "phase",
      [&](const auto& g) {
        const SharedLane& L = g.shared_lane;
        return Labelled{{"clear", seconds(L.clear_ns)}, {"yield_wait", seconds(L.release_wait_ns)}};
      });
}

// Attached programs' card memory as the driver counts it (NVML): their contexts
// against the reserve, each program's figure, its job's ungated processes, and
// the processes of no session (broker_processes.cpp).
template <typename Gpus, typename Sessions, typename ReserveOf>
void attached_memory_families(MetricsText& m, const Gpus& gpus, const Sessions& sessions,
                              const std::vector<GpuTelemetrySnapshot>& telemetry,
                              ReserveOf reserve_of) {
  using Labelled = MetricsText::Labelled;
  auto str = [](auto v) { return fmt::format("{}", v); };
  // The session's GPU's snapshot, when NVML answered for it.
  auto nvml_of = [&](const auto& s) -> const GpuTelemetrySnapshot* {
    const auto gi = static_cast<std::size_t>(s.gpu);
    return s.gpu >= 0 && gi < telemetry.size() && telemetry[gi].available ? &telemetry[gi]
                                                                          : nullptr;
  };
  m.per_gpu_by(
      gpus, "salus_gpu_attach_context_bytes", "gauge",
      "Attached programs' CUDA contexts: the reserve admission counts for each, and the "
      "largest measured (the driver's figure less the charge).",
      "kind", [&](const auto& g) {
        return Labelled{{"reserve", str(reserve_of(g))}, {"measured", str(g.context_measured)}};
      });
  m.per_gpu_known(gpus, "salus_gpu_memory_outside_sessions_bytes", "gauge",
                  "Card memory the driver (NVML) shows for processes that belong to no session.",
                  [&](const auto& g) -> std::optional<std::string> {
                    if (!g.outside_known) return std::nullopt;
                    return str(g.outside().first);
                  });
  m.per_gate_known(sessions, "salus_session_memory_gpu_bytes", "gauge",
                   "Attached session: the driver's figure (NVML) for its program's device memory, "
                   "context included.",
                   [&](const auto& s) -> std::optional<std::string> {
                     const GpuReadings::Process* p = find_process(s.gate->pid, nvml_of(s));
                     return p && p->bytes ? std::optional<std::string>(std::to_string(*p->bytes))
                                          : std::nullopt;
                   });
  m.per_gate_known(sessions, "salus_session_memory_ungated_bytes", "gauge",
                   "Attached session: the driver's figure (NVML) for the job's other processes, "
                   "which run ungated (one process of a job is gated).",
                   [&](const auto& s) -> std::optional<std::string> {
                     if (s.gpu < 0 || !gpus[static_cast<std::size_t>(s.gpu)]->outside_known)
                       return std::nullopt;
                     return std::to_string(ungated_bytes_of(gpus, s.id));
                   });
}

}  // namespace

std::string Broker::render_metrics() const {
  std::vector<GpuTelemetrySnapshot> telemetry;
  for (std::size_t i = 0; i < gpus_.size(); ++i) telemetry.push_back(telemetry_of(i));
  std::lock_guard lk(mu_);
  MetricsText m;
  using Labelled = MetricsText::Labelled;
  auto str = [](auto v) { return fmt::format("{}", v); };
  auto seconds = [](TimeNs ns) { return fmt::format("{:.9f}", static_cast<double>(ns) / 1e9); };

  memory_families(m, gpus_);
  attached_memory_families(m, gpus_, sessions_, telemetry, [this](const Gpu& g) {
    return context_reserve_on(static_cast<int>(g.index));
  });
  m.per_gpu(gpus_, "salus_gpu_lanes", "gauge", "Lanes open on the GPU.",
            [&](const Gpu& g) { return str(g.sched.arena().memory().lanes); });
  m.per_gpu(gpus_, "salus_gpu_busy_seconds_total", "counter",
            "Device time with at least one op running.",
            [&](const Gpu& g) { return seconds(g.device->busy_ns()); });
  m.per_gpu(gpus_, "salus_gpu_restarts_total", "counter",
            "Times the GPU lost its context and was given a fresh one (executor restarts).",
            [&](const Gpu& g) { return str(g.device->health().restarts); });
  m.per_gpu_by(gpus_, "salus_gpu_busy_ratio", "gauge",
               "Fraction of the last window during which the GPU ran at least one op.", "window",
               [&](const Gpu& g) {
                 auto ratio = [&](TimeNs ns) {
                   return fmt::format("{:.4f}", busy_fraction(g, ns));
                 };
                 return Labelled{{"1s", ratio(1'000'000'000)},
                                 {"10s", ratio(10'000'000'000)},
                                 {"60s", ratio(60'000'000'000)}};
               });
  m.nvml(telemetry, "salus_gpu_sm_utilization_ratio", "gauge",
         "NVML: fraction of the driver's last sample period during which a kernel ran.",
         &GpuReadings::sm_util, "{:.2f}");
  m.nvml(telemetry, "salus_gpu_memory_controller_utilization_ratio", "gauge",
         "NVML: fraction of the driver's last sample period during which device memory "
         "was read or written.",
         &GpuReadings::mem_util, "{:.2f}");
  m.nvml(telemetry, "salus_gpu_power_watts", "gauge", "NVML: board power draw.",
         &GpuReadings::power_w, "{:.3f}");
  m.nvml(telemetry, "salus_gpu_energy_joules_total", "counter",
         "NVML: energy consumed since the driver was loaded.", &GpuReadings::energy_j, "{:.3f}");
  m.nvml(telemetry, "salus_gpu_temperature_celsius", "gauge", "NVML: GPU die temperature.",
         &GpuReadings::temperature_c, "{:.0f}");
  m.per_gpu(gpus_, "salus_switches_total", "counter", "Lane switches between sessions.",
            [&](const Gpu& g) { return str(g.sched.stats().switches); });
  m.per_session(sessions_, "salus_session_iterations_total", "counter",
                "Iterations finished by the session.",
                [&](const Session& s) { return str(s.iterations_done); });
  m.per_session(sessions_, "salus_session_gpu_seconds_total", "counter",
                "Device time used by the session.",
                [&](const Session& s) { return seconds(s.gpu_ns); });
  m.per_session(sessions_, "salus_session_queue_seconds", "gauge",
                "Time the session waited for admission.", [&](const Session& s) {
                  TimeNs waited = s.queue_wait_ns;
                  if (s.state == SessionState::queued) waited += now() - s.queued_at;
                  return seconds(waited);
                });
  gate_families(m, sessions_);
  m.single("salus_sessions", "gauge", "Live sessions.", sessions_.size());
  m.single("salus_iterations_total", "counter", "Iterations finished on all GPUs.",
           stats_.iterations);
  m.single("salus_command_errors_total", "counter", "Commands that failed.", stats_.command_errors);
  m.per_gpu_by(gpus_, "salus_transfers_total", "counter",
               "upload/download transfers that ended, by result.", "result", [&](const Gpu& g) {
                 const auto t = g.transfers->stats();
                 return Labelled{{"completed", str(t.completed)},
                                 {"failed", str(t.failed)},
                                 {"cancelled", str(t.cancelled)}};
               });
  m.per_gpu(gpus_, "salus_shm_segment_bytes", "gauge",
            "Shared-memory segments mapped (on cuda, pinned) for direct transfers.",
            [&](const Gpu& g) { return str(g.transfers->stats().segment_bytes); });
  m.per_gpu_by(gpus_, "salus_staging_bytes", "gauge", "Host staging memory of the data plane.",
               "state", [&](const Gpu& g) {
                 const auto p = g.staging->stats();
                 return Labelled{{"in_use", str(p.in_use)}, {"cached", str(p.cached)}};
               });
  return m.take();
}

}  // namespace salus::vgpu
