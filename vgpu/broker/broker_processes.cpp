// Card memory held by processes that no gate accounts for (design.md,
// *Processes on the card*). NVML lists every compute process on a GPU with its
// memory. Besides the attached programs (each held to its budget by its gate)
// and salusd's own (itself, its executors, the MPS daemons it runs), such a
// process is either another process of an attached job (a descendant of the
// program or of the launcher it took the session over from: one process of a
// job is gated, the rest run ungated), or one that belongs to no session (run
// without salus-run, or by another tool). Neither is charged nor counted in
// admission. Both are shown (the session's `memory_ungated`, the GPU's
// `outside_sessions`) and said once in the logs, so that an operator sees who
// holds the card that salusd shares out.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "vgpu/attach/attach_gate.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"
#include "vgpu/mps/mps_control.hpp"

namespace salus::vgpu {

namespace {

// Kept bounded: a host that runs many programs outside Salus is told about the
// first ones of each round, not given a list that grows without end.
constexpr std::size_t kMostOutsideTold = 256;

}  // namespace

// Once a second until the gate service stops. An exception ends one round,
// never the thread (docs/style.md).
void Broker::census_loop() {
  std::unique_lock lk(census_mu_);
  while (!census_cv_.wait_for(lk, std::chrono::seconds(1), [this] { return census_stop_; })) {
    lk.unlock();
    try {
      census_tick();
    } catch (const std::exception& e) {
      spdlog::error("process census: {}", e.what());
    } catch (...) {
      spdlog::error("process census: a non-standard exception");
    }
    lk.lock();
  }
}

// NVML's snapshots and the processes' parents are read before the broker's
// lock (design.md, *Locks*); what they say is applied under it.
void Broker::census_tick() {
  std::vector<GpuTelemetrySnapshot> telemetry;
  for (std::size_t i = 0; i < gpus_.size(); ++i) telemetry.push_back(telemetry_->snapshot(i));
  const ProcessCensus census = census_of(telemetry);
  std::lock_guard lk(mu_);
  check_attached_contexts(telemetry);
  account_processes(census);
}

// Before the broker's lock: /proc is read here (a process's parents, up to
// kMostAncestors), never under it.
Broker::ProcessCensus Broker::census_of(const std::vector<GpuTelemetrySnapshot>& telemetry) const {
  ProcessCensus c;
  c.by_gpu.resize(telemetry.size());
  c.listed.resize(telemetry.size(), 0);
  std::vector<pid_t> own_roots{::getpid()};  // salusd and its executors
  for (const MpsControl* m : config_.mps)
    if (m != nullptr && m->pid() > 1)
      own_roots.push_back(m->pid());  // daemonised: no child of ours
  for (std::size_t gi = 0; gi < telemetry.size(); ++gi) {
    const GpuTelemetrySnapshot& t = telemetry[gi];
    if (!t.available || !t.readings.processes) continue;
    c.listed[gi] = 1;
    for (const GpuReadings::Process& p : *t.readings.processes) {
      if (!p.bytes || *p.bytes == 0 || p.pid <= 0) continue;
      ListedProcess lp;
      lp.pid = static_cast<pid_t>(p.pid);
      lp.bytes = *p.bytes;
      if (config_.attach_overrun_kill) lp.pidfd = UniqueFd(pidfd_open(lp.pid));
      lp.ancestors = ancestors_of(lp.pid);
      // Gone since it was opened: its pid may name another process now.
      if (lp.pidfd && process_exited(lp.pidfd.get())) continue;
      for (pid_t root : own_roots) lp.salusd_own = lp.salusd_own || lp.descends_from(root);
      c.by_gpu[gi].push_back(std::move(lp));
    }
  }
  return c;
}

// The attached session whose job `p` belongs to, or null: a descendant of its
// program, or of the launcher its program took the session over from while
// that runs (its pidfd says so; an exited launcher's pid may be reused).
Session* Broker::job_of(const ListedProcess& p) {
  for (SessionId id : attached_) {
    Session* s = get(id);
    if (!s || !s->gate || s->gate->exited) continue;
    if (p.descends_from(s->gate->pid)) return s;
    if (s->launcher_pidfd && p.descends_from(s->launcher_pid) &&
        !process_exited(s->launcher_pidfd.get()))
      return s;
  }
  return nullptr;
}

bool Broker::ListedProcess::descends_from(pid_t root) const {
  return root > 0 &&
         (pid == root || std::find(ancestors.begin(), ancestors.end(), root) != ancestors.end());
}

Session* Broker::attached_program(pid_t pid) {
  for (SessionId id : attached_)
    if (Session* s = get(id); s && s->gate && !s->gate->exited && s->gate->pid == pid) return s;
  return nullptr;
}

void Broker::account_processes(const ProcessCensus& census) {
  std::map<SessionId, std::vector<pid_t>> over;  // this census's, for kill_ungated
  for (std::size_t gi = 0; gi < census.by_gpu.size() && gi < gpus_.size(); ++gi)
    account_gpu(*gpus_[gi], census.by_gpu[gi], census.listed[gi] != 0, over);
  for (SessionId id : attached_)
    if (Session* s = get(id)) {
      auto it = over.find(id);
      s->ungated_over = it == over.end() ? std::vector<pid_t>{} : std::move(it->second);
    }
}

void Broker::account_gpu(Gpu& g, const std::vector<ListedProcess>& listed, bool known,
                         std::map<SessionId, std::vector<pid_t>>& over) {
  using Role = Gpu::Role;
  g.outside_known = known;
  g.census.clear();
  std::vector<pid_t> told;
  for (const ListedProcess& p : listed) {
    if (Session* s = attached_program(p.pid)) {  // its gate holds it to its budget
      g.census.push_back({p.pid, p.bytes, Role::program, s->id});
      continue;
    }
    if (Session* s = job_of(p)) {
      g.census.push_back({p.pid, p.bytes, Role::ungated, s->id});
      if (!kill_ungated(*s, p, g, over[s->id])) note_ungated(*s, p, g);
      continue;
    }
    if (p.salusd_own) {
      g.census.push_back({p.pid, p.bytes, Role::salusd, 0});
      continue;
    }
    g.census.push_back({p.pid, p.bytes, Role::outside, 0});
    note_outside(g, p, told);
  }
  g.outside_told = std::move(told);  // a process gone and back is told again
}

// Each process of no session once in salusd's log (while it stays listed), the
// first kMostOutsideTold of a census at most.
void Broker::note_outside(const Gpu& g, const ListedProcess& p, std::vector<pid_t>& told) {
  if (told.size() >= kMostOutsideTold) return;
  told.push_back(p.pid);
  if (std::find(g.outside_told.begin(), g.outside_told.end(), p.pid) != g.outside_told.end())
    return;
  spdlog::warn(
      "gpu {}: pid {} holds {} on the card and belongs to no Salus session (run "
      "without salus-run, or by another tool): admission does not count it",
      g.index, p.pid, arena::format_size(p.bytes));
}

std::string Broker::render_gpu_processes(std::size_t gi) const {
  std::lock_guard lk(mu_);
  if (gi >= gpus_.size()) return {};
  static constexpr const char* kRoles[] = {"program", "ungated", "salusd", "outside"};
  std::string o = "# pid bytes role session\n";
  for (const Gpu::CensusRow& r : gpus_[gi]->census)
    o += fmt::format("{} {} {} {}\n", r.pid, r.bytes, kRoles[static_cast<int>(r.role)],
                     r.session ? std::to_string(r.session) : std::string("-"));
  return o;
}

bool Broker::kill_ungated(Session& s, const ListedProcess& p, const Gpu& g,
                          std::vector<pid_t>& over) {
  if (!config_.attach_overrun_kill || p.bytes <= kDriverFigureSlack || !p.pidfd) return false;
  // Two censuses in a row, as for the program itself (check_context); after a
  // kill the count starts again, so a process that survives one is tried again
  // two censuses later, not every second.
  if (std::find(s.ungated_over.begin(), s.ungated_over.end(), p.pid) == s.ungated_over.end()) {
    over.push_back(p.pid);
    return false;
  }
  overrun_kill(s, p.pidfd.get(), p.pid,
               fmt::format("another process of this job holds {} on gpu {} ungated, which "
                           "admission does not count (one process of a job is gated)",
                           arena::format_size(p.bytes), g.index));
  return true;
}

void Broker::note_ungated(Session& s, const ListedProcess& p, const Gpu& g) {
  if (s.ungated_told) return;
  s.ungated_told = true;
  const std::string who =
      p.pid == s.launcher_pid
          ? std::string("the launcher this session was handed over from")
          : fmt::format("another process of this job (a descendant of pid {})",
                        p.descends_from(s.gate->pid) ? s.gate->pid : s.launcher_pid);
  const std::string text = fmt::format(
      "pid {}, {}, holds {} on gpu {} ungated: one process of a job is gated, so neither "
      "the budget nor admission counts it",
      p.pid, who, arena::format_size(p.bytes), g.index);
  log(s, text);
  spdlog::warn("session {}: {}", s.id, text);
}

}  // namespace salus::vgpu
