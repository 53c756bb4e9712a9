#include "vgpu/broker/broker.hpp"

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/broker/broker_gpu.hpp"
#include "vgpu/caller/caller_files.hpp"

namespace salus::vgpu {

namespace {

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

constexpr std::uint32_t kInlineBudget = 512;  // empty iterations per worker pass
constexpr std::chrono::milliseconds kBusySamplePeriod{100};
constexpr std::size_t kMaxModuleBytes = 256u << 20;

// Which commands Broker::exec lets through in which session state.
template <class... Cmds>
bool is_one_of(const Command& c) {
  return (std::holds_alternative<Cmds>(c) || ...);
}
// Those that do not touch the GPU, so they run while the session is queued or idle.
bool runs_without_gpu(const Command& c) {
  return is_one_of<NeedCmd, PriorityCmd, ResetCmd, SyncCmd, BeginCmd, AttachCmd>(c);
}
// Those a failed session still takes (reset clears the failure).
bool runs_after_failure(const Command& c) {
  return is_one_of<NeedCmd, ResetCmd, PriorityCmd>(c);
}
// Those an attached session takes: its work runs in the program.
bool runs_when_attached(const Command& c) {
  return is_one_of<NeedCmd, PriorityCmd, ResetCmd, SyncCmd, AttachCmd>(c);
}

// `reset`: the session takes commands again, admitted if it still holds a lane.
void clear_failure(Session& s) {
  s.error = 0;
  s.error_text.clear();
  if (s.state == SessionState::failed)
    s.state = s.lane ? SessionState::admitted : SessionState::idle;
}

}  // namespace

void run_deferred(std::vector<std::function<void()>>& later) {
  for (auto& fn : later) {
    try {
      fn();
    } catch (const std::exception& e) {
      spdlog::error("deferred reply threw: {}", e.what());
    } catch (...) {
      spdlog::error("deferred reply threw a non-standard exception");
    }
  }
  later.clear();
}

const char* to_string(SessionState s) {
  switch (s) {
    case SessionState::idle:
      return "idle";
    case SessionState::queued:
      return "queued";
    case SessionState::admitted:
      return "admitted";
    case SessionState::failed:
      return "failed";
    case SessionState::ended:
      return "ended";
  }
  return "unknown";
}

void Broker::Sink::on_complete(StreamId stream, std::uint64_t token, int status,
                               std::int64_t device_ns) {
  if (g_.transfers && g_.transfers->owns_stream(stream)) {
    g_.transfers->on_device_complete(stream, token, status, device_ns);
    return;
  }
  {
    std::lock_guard lk(g_.cq_mu);
    g_.completions.push_back(Completion{stream, token, status, device_ns});
  }
  g_.cq_cv.notify_one();
}

Broker::Broker(std::vector<std::unique_ptr<Device>> devices, BrokerConfig config,
               std::unique_ptr<GpuTelemetry> telemetry)
    : config_(std::move(config)),
      epoch_(std::chrono::steady_clock::now()),
      telemetry_(std::move(telemetry)) {
  if (config_.pipeline_depth == 0) config_.pipeline_depth = 1;
  caller_io_ = std::make_unique<CallerIo>(config_.caller_io);
  for (std::size_t i = 0; i < devices.size(); ++i) {
    auto g = std::make_unique<Gpu>(i, std::move(devices[i]), config_.policy, config_.arena);
    g->sched.set_fair_share(config_.fair_share);
    // A victim that does not come to its boundary holds up the residency planner as
    // long as an attached iteration may hold up a lane (30 s when that is never).
    if (config_.attach_hold_limit_ns > 0)
      g->sched.residency().set_stuck_after(config_.attach_hold_limit_ns);
    g->sink = std::make_unique<Sink>(*g);
    g->device->set_sink(g->sink.get());
    g->staging = std::make_unique<StagingPool>(*g->device, config_.staging_cache);
    TransferEngine::Options to;
    to.chunk = std::max<Bytes>(config_.transfer_chunk, StagingPool::kMinBlock);
    to.max_active = std::clamp(config_.transfers_active, 1u, TransferEngine::kMaxActive);
    to.segment_cache = config_.segment_cache;
    to.io = caller_io_.get();
    g->transfers =
        std::make_unique<TransferEngine>(*g->device, *g->staging, to, static_cast<int>(i));
    if (!config_.swap_dir.empty()) {
      std::string why;
      g->spill = SpillFile::open(config_.swap_dir, why);
      if (!g->spill)
        spdlog::warn("gpu {}: no spill file ({}): past the swap host limit, swap-outs are refused",
                     i, why);
    }
    gpus_.push_back(std::move(g));
  }
  for (auto& g : gpus_) {
    Gpu* gp = g.get();
    gp->worker = std::thread([this, gp] { worker_loop(*gp); });
    if (gp->device->info().backs_on_demand)
      gp->backer = std::thread([this, gp] { backer_loop(*gp); });
  }
  start_gate_service();
}

Broker::~Broker() {
  shutdown(std::chrono::milliseconds(0));
}

TimeNs Broker::now() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              epoch_)
      .count();
}

Session* Broker::get(SessionId id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.get();
}
const Session* Broker::get(SessionId id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.get();
}

Broker::Gpu* Broker::gpu_of(const Session& s) {
  if (s.gpu < 0 || static_cast<std::size_t>(s.gpu) >= gpus_.size()) return nullptr;
  return gpus_[static_cast<std::size_t>(s.gpu)].get();
}

void Broker::log(Session& s, std::string text) {
  ++s.log_lines_total;
  s.log.push_back(LogLine{now(), std::move(text)});
  while (s.log.size() > config_.log_lines) s.log.pop_front();
}

// ---------------------------------------------------------------- sessions

std::int64_t Broker::create_session(const Caller& caller, const std::string& name) {
  std::lock_guard lk(mu_);
  if (stopping_) return -ESHUTDOWN;
  if (!name.empty()) {
    if (!is_valid_name(name)) return -EINVAL;
    bool digits = true;
    for (char c : name) digits = digits && c >= '0' && c <= '9';
    if (digits) return -EINVAL;  // numeric names belong to clone sessions
    if (by_name_.count(name)) return -EEXIST;
  }
  UidUsage& u = usage_[caller.uid];
  if (u.sessions >= config_.quotas.sessions_per_uid) {
    ++stats_.quota_rejections;
    spdlog::warn("uid {}: session quota ({}) reached", caller.uid, config_.quotas.sessions_per_uid);
    return -EDQUOT;
  }
  ++u.sessions;
  auto s = std::make_unique<Session>();
  s->id = next_id_++;
  s->dir_name = name.empty() ? std::to_string(s->id) : name;
  s->named = !name.empty();
  s->uid = caller.uid;
  s->gid = caller.gid;
  s->created_at = now();
  const SessionId id = s->id;
  log(*s, fmt::format("session {} created by uid {} pid {}", s->dir_name, caller.uid, caller.pid));
  by_name_[s->dir_name] = id;
  sessions_[id] = std::move(s);
  ++stats_.sessions_created;
  return static_cast<std::int64_t>(id);
}

void Broker::end_session(SessionId id) {
  Deferred later;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || s->dead) return;
    s->dead = true;
    s->state = SessionState::ended;
    by_name_.erase(s->dir_name);
    drop_queued(*s, ECANCELED, later);
    cancel_transfer(*s);  // a transfer being moved stops after its chunks in flight
    for (PendingWrite& w : s->writes) {
      auto done = std::move(w.done);
      later.push_back([done] { done(ECANCELED, {}); });
    }
    s->writes.clear();
    for (Waiter& w : s->waiters) {
      auto done = std::move(w.done);
      later.push_back([done] { done(ECANCELED, {}); });
    }
    s->waiters.clear();
    for (auto& [key, w] : s->watchers) later.push_back([w = std::move(w)] { w(true); });
    s->watchers.clear();
    detach_gate(*s, later);
    maybe_finalize(*s, later);
  }
  run_deferred(later);
}

std::optional<SessionId> Broker::find_session(const std::string& dir_name) const {
  std::lock_guard lk(mu_);
  auto it = by_name_.find(dir_name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

int Broker::check_access(SessionId id, const Caller& caller) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  if (!s || s->dead) return ENOENT;
  if (caller.admin || caller.uid == s->uid) return 0;
  return EACCES;
}

std::vector<std::pair<std::string, SessionId>> Broker::list_sessions() const {
  std::lock_guard lk(mu_);
  std::vector<std::pair<std::string, SessionId>> out;
  out.reserve(by_name_.size());
  for (const auto& [name, id] : by_name_) out.emplace_back(name, id);
  return out;
}

std::optional<std::pair<uid_t, gid_t>> Broker::session_owner(SessionId id) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  if (!s || s->dead) return std::nullopt;
  return std::make_pair(s->uid, s->gid);
}

bool Broker::session_is_named(SessionId id) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  return s && s->named;
}

int Broker::kill_session(SessionId id) {
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || s->dead) return ENOENT;
    log(*s, "killed by admin");
  }
  end_session(id);
  return 0;
}

// Frees everything once nothing of the session is on a device any more.
void Broker::maybe_finalize(Session& s, Deferred& later) {
  if (!s.dead || s.in_flight > 0 || s.moving || s.transferring || s.swapping) return;
  Gpu* g = gpu_of(s);
  UidUsage& u = usage_[s.uid];
  // A swapped-out buffer holds no GPU range: its bytes are only in host_copies.
  auto on_gpu = [&](arena::BufferHandle h) { return h && g && g->sched.arena().buffer_on_gpu(h); };
  for (auto& [bid, b] : s.buffers) {
    if (u.buffers > 0) --u.buffers;
    if (on_gpu(b.handle)) g->device->discard(g->sched.arena().buffer_offset(b.handle), b.size);
  }
  for (auto& [handle, pin] : s.pins)
    if (pin.retired && on_gpu(handle))
      g->device->discard(g->sched.arena().buffer_offset(handle), pin.size);
  if (g) g->host_swapped -= std::min(g->host_swapped, s.host_bytes);
  if (g && g->spill && s.spill_bytes) g->spill->release(s.spill_off, s.spill_bytes);
  s.spill_bytes = 0;
  if (g) {
    for (auto& [name, m] : s.modules) g->device->unload_module(m.handle);
    g->transfers->forget_session(s.id);
  }
  if (u.sessions > 0) --u.sessions;
  if (g && g->placed > 0) --g->placed;
  u.queued -= std::min(u.queued, s.queued_instances);
  const SessionId id = s.id;
  ++stats_.sessions_ended;
  attached_.erase(id);
  const bool host_waiting = host_queue_.remove(id);
  host_keys_stale_ = host_keys_stale_ || host_waiting || g != nullptr;
  sessions_.erase(id);                    // `s` is gone from here on
  if (host_waiting) bind_waiting(later);  // it may have held back others (bypass bound)
  if (g) {
    g->sched.leave(id, now());  // frees its persistent buffers, lane and queue slot
    sync_lanes(*g, later);
    handle_admissions(*g, later);
    kick(*g);
  }
}

// ---------------------------------------------------------------- commands

namespace {

bool names_caller_files(const std::vector<CommandLine>& commands) {
  for (const CommandLine& c : commands)
    if (std::holds_alternative<TransferCmd>(c.command) ||
        std::holds_alternative<ModuleCmd>(c.command))
      return true;
  return false;
}

}  // namespace

// Opens the write's endpoints and reads its module files, as the caller. Runs
// on a CallerIo thread: it may block for as long as the caller's filesystem
// does, and costs only that caller's slots.
Broker::OpenedFiles Broker::open_caller_files(const Caller& caller,
                                              const std::vector<CommandLine>& commands) {
  OpenedFiles out;
  out.creds = CallerCredentials::capture({caller.uid, caller.gid, caller.pid});
  for (std::size_t i = 0; i < commands.size(); ++i) {
    const Command& cmd = commands[i].command;
    if (const auto* t = std::get_if<TransferCmd>(&cmd)) {
      out.endpoints.emplace(i, open_transfer_endpoint(out.creds, *t));
      continue;
    }
    const auto* m = std::get_if<ModuleCmd>(&cmd);
    if (!m) continue;
    PendingWrite::ModuleFile f;
    f.path = m->path;
    f.error = read_file_as_caller(out.creds, m->path, kMaxModuleBytes, f.image, f.why);
    out.module_files.push_back(std::move(f));
  }
  return out;
}

// Every file of the write fails with `err`: no task could be made to open them.
Broker::OpenedFiles Broker::could_not_open(const std::vector<CommandLine>& commands, int err) {
  OpenedFiles out;
  const std::string why =
      fmt::format("salusd could not start a task to open it: {}", std::strerror(err));
  for (std::size_t i = 0; i < commands.size(); ++i) {
    const Command& cmd = commands[i].command;
    if (std::holds_alternative<TransferCmd>(cmd)) {
      TransferEndpoint ep;
      ep.error = EAGAIN;
      ep.why = why;
      out.endpoints.emplace(i, std::move(ep));
    } else if (const auto* m = std::get_if<ModuleCmd>(&cmd)) {
      PendingWrite::ModuleFile f;
      f.path = m->path;
      f.error = EAGAIN;
      f.why = why;
      out.module_files.push_back(std::move(f));
    }
  }
  return out;
}

std::uint64_t Broker::submit(
    SessionId id, const Caller& caller, std::size_t write_bytes, std::vector<CommandLine> commands,
    std::optional<std::pair<std::uint32_t, std::pair<int, std::string>>> parse_error,
    WriteReply done) {
  Deferred later;
  std::uint64_t ticket = 0;
  // Files the write names are opened off this (FUSE) thread, as the caller; the
  // write waits in the session's queue meanwhile, holding no thread.
  const bool opening =
      write_bytes <= config_.quotas.bytes_per_write && names_caller_files(commands);
  // attach takes the program's fds with pidfd_getfd and reads procfs only:
  // nothing the writer can stall, so it is done here, before the broker lock.
  std::unordered_map<std::size_t, PendingWrite::AttachTaken> attach_gates;
  if (write_bytes <= config_.quotas.bytes_per_write) {
    for (std::size_t i = 0; i < commands.size(); ++i) {
      const auto* at = std::get_if<AttachCmd>(&commands[i].command);
      if (!at) continue;
      PendingWrite::AttachTaken taken;
      taken.gate = std::make_unique<AttachedGate>();
      taken.error =
          take_gate(caller.pid, at->gate_fd, at->bell_fd, at->lane_fd, *taken.gate, taken.why);
      if (taken.error)
        taken.gate.reset();
      else
        taken.gate->lane_room = at->lane_room;
      attach_gates.emplace(i, std::move(taken));
    }
  }
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || s->dead) {
      later.push_back([done] { done(ENOENT, {}); });
    } else if (caller.uid != s->uid && !caller.admin) {
      later.push_back([done] { done(EACCES, {}); });
    } else if (write_bytes > config_.quotas.bytes_per_write) {
      ++stats_.quota_rejections;
      ++stats_.command_errors;
      log(*s, fmt::format("write of {} bytes exceeds the per-write quota of {} bytes; "
                          "split commands over several writes",
                          write_bytes, config_.quotas.bytes_per_write));
      later.push_back([done] { done(EMSGSIZE, {}); });
    } else {
      PendingWrite w;
      w.id = ticket = next_ticket_++;
      w.opening = opening;
      w.attach_gates = std::move(attach_gates);
      w.number = ++s->writes_received;
      w.caller_admin = caller.admin;
      w.parse_error = std::move(parse_error);
      w.done = std::move(done);
      if (opening) {
        const int rc = caller_io_->post(caller.uid, [this, id, wid = w.id, caller,
                                                     cmds = commands](CallerIo::Gate& gate) {
          OpenedFiles files;
          if (const int err = CallerIo::isolated([&] { files = open_caller_files(caller, cmds); }))
            files = could_not_open(cmds, err);
          gate.enter([&] { files_opened(id, wid, std::move(files)); });
        });
        if (rc) {
          log(*s, rc == EAGAIN ? fmt::format("uid {} has too many writes waiting for their "
                                             "files to open; try again later",
                                             caller.uid)
                               : std::string("salusd is shutting down; no new work is accepted"));
          if (rc == EAGAIN) ++stats_.quota_rejections;
          ++stats_.command_errors;
          later.push_back([done = std::move(w.done), rc] { done(rc, {}); });
          ticket = 0;
        }
      }
      if (ticket) {
        w.commands = std::move(commands);
        s->writes.push_back(std::move(w));
        // Writes run strictly in order: only the oldest suspended one may proceed.
        if (s->writes.size() == 1) resume_writes(*s, later);
      }
    }
  }
  run_deferred(later);
  return ticket;
}

void Broker::files_opened(SessionId id, std::uint64_t write_id, OpenedFiles files) {
  Deferred later;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || s->dead) return;  // the write was answered when the session ended
    for (PendingWrite& w : s->writes) {
      if (w.id != write_id) continue;
      w.opening = false;
      w.module_files = std::move(files.module_files);
      w.transfer_endpoints = std::move(files.endpoints);
      w.creds = std::move(files.creds);
      if (&w == &s->writes.front()) resume_writes(*s, later);
      break;
    }
    // Not found: the write was interrupted; its files close with `files`.
  }
  run_deferred(later);
}

bool Broker::cancel_request(SessionId id, std::uint64_t ticket, bool caller_dying) {
  Deferred later;
  bool cancelled = false;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || !ticket) return false;
    for (auto it = s->waiters.begin(); it != s->waiters.end(); ++it) {
      if (it->id != ticket) continue;
      auto done = std::move(it->done);
      s->waiters.erase(it);
      later.push_back([done] { done(EINTR, {}); });
      cancelled = true;
      break;
    }
    // A mem/ read or write, queued or on the device behind earlier work: it is
    // answered now and its copy runs anyway (the same bytes again, if retried).
    for (auto* items : {&s->queue, &s->dispatched}) {
      for (auto it = items->begin(); !cancelled && it != items->end(); ++it) {
        if (it->ticket != ticket || !it->on_done) continue;
        auto done = std::move(it->on_done);
        it->on_done = nullptr;
        later.push_back([done] { done(EINTR, {}); });
        cancelled = true;
      }
    }
    for (auto it = s->writes.begin(); !cancelled && it != s->writes.end(); ++it) {
      if (it->id != ticket) continue;
      // A write some of whose lines ran cannot be undone: answering EINTR would
      // make a caller that retries run those lines twice. It is dropped only
      // when its caller is dying and will never see the answer.
      const bool started = it->next > 0 || it->syncing;
      if (started && !caller_dying) break;
      if (started && it->began_recording && s->recording) s->recording.reset();
      log(*s, fmt::format("a write was interrupted{}; {}",
                          caller_dying ? " (its caller is being killed)" : "",
                          started ? "its remaining lines are dropped" : "none of it ran"));
      auto done = std::move(it->done);
      const bool front = it == s->writes.begin();
      s->writes.erase(it);
      later.push_back([done] { done(EINTR, {}); });
      cancelled = true;
      if (front && !s->writes.empty()) resume_writes(*s, later);
      break;
    }
  }
  run_deferred(later);
  return cancelled;
}

void Broker::resume_writes(Session& s, Deferred& later) {
  // A command of the running write (e.g. `need`) can trigger admissions that
  // would resume this same session; the outer loop continues it instead.
  if (s.writing) return;
  s.writing = true;
  while (!s.writes.empty()) {
    PendingWrite& w = s.writes.front();
    if (!run_write(s, w, later)) break;  // still suspended
    s.writes.pop_front();
  }
  s.writing = false;
}

// Runs the write's remaining lines; false if it must wait (admission or sync).
bool Broker::run_write(Session& s, PendingWrite& w, Deferred& later) {
  if (w.opening) return false;  // files_opened resumes it
  auto finish = [&](int err) {
    if (err && s.recording && w.began_recording) {
      // Half an iteration from a failed write would poison the next `begin`.
      s.recording.reset();
      // Said on the error's own line, so "the last log line" stays the reason.
      if (!s.log.empty()) s.log.back().text += "; the iteration begun by this write is discarded";
    } else if (err && s.recording && !s.log.empty()) {
      // An earlier write's `begin` (the `end` meant for it may be the line
      // that failed): everything the session writes next is recorded, not run.
      s.log.back().text += fmt::format(
          "; a recording is still open (begin on line {} of write {}): the lines that follow "
          "are recorded into it, not run, until `end`",
          s.recording->begun_line, s.recording->begun_write);
    }
    auto done = std::move(w.done);
    std::string reply = std::move(w.reply);
    if (err) ++stats_.command_errors;
    later.push_back(
        [done, err, reply = std::move(reply)]() mutable { done(err, std::move(reply)); });
  };
  if (w.syncing) {
    if (s.error) {
      finish(s.error);
      return true;
    }
    const bool drained = s.queue.empty() && s.dispatched.empty() && s.in_flight == 0;
    if (!drained && s.completed_seq < w.sync_target) return false;
    w.syncing = false;
  }
  while (w.next < w.commands.size()) {
    const CommandLine& line = w.commands[w.next];
    bool suspend = false;
    ++stats_.commands;
    const int err = exec(s, line, w, suspend, later);
    if (suspend) {
      --stats_.commands;  // it runs again when resumed
      return false;
    }
    if (err) {
      finish(err);
      return true;
    }
    ++w.next;
  }
  if (w.parse_error) {
    const auto& [line, e] = *w.parse_error;
    log(s, e.second);
    finish(e.first);
    return true;
  }
  if (w.reply.empty()) w.reply = "ok\n";
  finish(0);
  return true;
}

int Broker::exec(Session& s, const CommandLine& line, PendingWrite& w, bool& suspend,
                 Deferred& later) {
  const std::uint32_t ln = line.line;
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: {}", ln, msg));
    return err;
  };
  if (stopping_) return fail(ESHUTDOWN, "salusd is shutting down; no new work is accepted");
  const Command& cmd = line.command;
  // Commands that need the GPU wait (without holding a thread) while queued; attaching
  // does too while the session waits host-wide for a GPU (late binding).
  const bool needs_gpu = !runs_without_gpu(cmd) && !s.recording;
  const bool attach_waits = s.gpu < 0 && std::holds_alternative<AttachCmd>(cmd);
  if ((needs_gpu || attach_waits) && s.state == SessionState::queued) {
    suspend = true;
    return 0;
  }
  if (needs_gpu && s.state == SessionState::idle) return fail(ENXIO, kNoGpuYet);
  if (s.error && !runs_after_failure(cmd))
    return fail(EIO, fmt::format("session failed earlier ({}: {}); write `reset` to continue",
                                 strerrorname_np(s.error), s.error_text));
  if (s.gate && !runs_when_attached(cmd))
    return fail(EINVAL, fmt::format("this session is attached (pid {}): its work runs in the "
                                    "program; only need, priority, reset and sync apply",
                                    s.gate->pid));
  if (const int err = check_priority(s, cmd, w.caller_admin, ln)) return err;

  return std::visit(
      Overloaded{
          [&](const NeedCmd& c) { return exec_need(s, c, ln, later); },
          [&](const AllocCmd& c) { return exec_alloc(s, c, ln, suspend); },
          [&](const FreeCmd& c) { return exec_free(s, c, ln); },
          [&](const BeginCmd&) {
            if (s.recording)
              return fail(EINVAL, "begin inside begin: end the open iteration first");
            s.recording.emplace();
            s.recording->iter = std::make_shared<Iteration>();
            s.recording->begun_write = w.number;
            s.recording->begun_line = ln;
            w.began_recording = true;
            return 0;
          },
          [&](const EndCmd& c) {
            if (!s.recording) return fail(EINVAL, "end without begin");
            std::shared_ptr<Iteration> it = std::move(s.recording->iter);
            s.recording.reset();
            it->counts = true;
            s.last_iteration = it;
            if (s.state == SessionState::queued) {
              // The iteration is recorded; submitting it waits for admission.
              w.commands[w.next].command = RunCmd{c.repeat};
              suspend = true;
              return 0;
            }
            return submit_iteration(s, it, c.repeat, ln);
          },
          [&](const RunCmd& c) {
            if (!s.last_iteration)
              return fail(EINVAL, "run: no iteration recorded yet (use begin ... end first)");
            return submit_iteration(s, s.last_iteration, c.count, ln);
          },
          [&](const SyncCmd&) {
            if (s.state == SessionState::queued) {
              suspend = true;
              return 0;
            }
            const bool drained = s.queue.empty() && s.dispatched.empty() && s.in_flight == 0;
            if (drained) return 0;
            ++w.next;  // sync itself is done once the wait ends
            w.syncing = true;
            w.sync_target = s.submitted_seq;
            suspend = true;
            ++stats_.commands;
            return 0;
          },
          [&](const PriorityCmd& c) {
            s.priority = c.priority;
            s.need.priority = c.priority;
            if (host_queue_.contains(s.id)) rekey_host_queue();
            if (Gpu* g = gpu_of(s)) {
              g->sched.set_priority(s.id, c.priority);
              // A waiting session moves in the queue (issue 19 item 7) and may be admitted.
              handle_admissions(*g, later);
            }
            return 0;
          },
          [&](const ResetCmd&) {
            if (s.error) log(s, fmt::format("line {}: error cleared by reset", ln));
            clear_failure(s);
            return 0;
          },
          [&](const ModuleCmd& c) { return exec_module(s, c, w, ln); },
          [&](const LaunchCmd&) { return record_op(s, cmd, ln); },
          [&](const TransferCmd& c) { return exec_transfer(s, c, w, ln); },
          [&](const AttachCmd& c) { return exec_attach(s, c, w, ln, later); },
          [&](const auto&) { return record_op(s, cmd, ln); },
      },
      cmd);
}

// A user may lower a session's priority, or keep it, but not raise it past
// --user-priority-max: under the priority policy a larger value runs first, so an
// unbounded one would let any user starve every other. Admins set any value.
int Broker::check_priority(Session& s, const Command& cmd, bool admin, std::uint32_t ln) {
  std::optional<std::int32_t> asked;
  if (const auto* need = std::get_if<NeedCmd>(&cmd)) asked = need->priority;
  if (const auto* prio = std::get_if<PriorityCmd>(&cmd)) asked = prio->priority;
  const std::int32_t most = std::max(config_.user_priority_max, s.priority);
  if (!asked || admin || *asked <= most) return 0;
  log(s, fmt::format("line {}: priority {}: a user may set at most {} (salusd "
                     "--user-priority-max {}, or the session's priority now); an admin may "
                     "set any",
                     ln, *asked, most, config_.user_priority_max));
  return EACCES;
}

int Broker::exec_need(Session& s, const NeedCmd& c, std::uint32_t ln, Deferred& later) {
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: need: {}", ln, msg));
    return err;
  };
  if (s.recording) return fail(EINVAL, "not allowed inside begin/end");
  const Bytes p = arena::align_up(c.persistent), e = arena::align_up(c.ephemeral);
  if (p > ~Bytes{0} - e) return fail(ERANGE, "persistent + ephemeral overflows");
  // kind= is kept for later needs that do not say it (--measure's second need).
  if (c.attached) s.need.attached = c.attached;

  // Choose the GPU: an explicit index, the one already placed on, or by placement.
  int gpu = s.gpu;
  if (gpu < 0) {
    if (c.gpu && *c.gpu != kAnyGpu) {
      if (*c.gpu < 0 || static_cast<std::size_t>(*c.gpu) >= gpus_.size())
        return fail(ENODEV, fmt::format("gpu={} does not exist (this host has {} GPU{})", *c.gpu,
                                        gpus_.size(), gpus_.size() == 1 ? "" : "s"));
      gpu = *c.gpu;
      // Waiting host-wide and now naming a GPU: it leaves the host-wide queue for that one.
      if (host_queue_.remove(s.id)) s.state = SessionState::idle;
      host_keys_stale_ = true;
    } else if (gpus_.size() > 1 || config_.placement == Placement::exclusive) {
      // Exclusive waits for an idle GPU, even on a host of one.
      return queue_any(s, c, p, e, ln, later);
    } else {
      gpu = place_any(s, p, e, ln);
      if (gpu < 0) return -gpu;
    }
  } else if (c.gpu && *c.gpu != kAnyGpu && *c.gpu != s.gpu) {
    return fail(
        EBUSY, fmt::format("session is placed on gpu {}; it cannot move to gpu {}", s.gpu, *c.gpu));
  }
  Gpu& g = *gpus_[static_cast<std::size_t>(gpu)];
  if (g.draining && s.gpu < 0)
    return fail(EBUSY, fmt::format("gpu {} is draining and admits no new sessions", gpu));
  const Bytes cap = g.sched.arena().capacity();
  if (p + e > cap)
    return fail(ENOMEM, fmt::format("persistent={} + ephemeral={} exceeds gpu {} capacity {}",
                                    arena::format_size(p), arena::format_size(e), gpu,
                                    arena::format_size(cap)));
  if (c.name && !c.name->empty()) s.need.name = c.name;
  const arena::Need need = arena_need(s, p, e, gpu);
  if (const Bytes context = need.unswappable; will_attach(s) && context < context_reserve_on(gpu))
    log(s, fmt::format("line {}: need: the context reserve is cut to {} on gpu {}: the need "
                       "leaves no more of its {} (the program's CUDA context may not fit)",
                       ln, arena::format_size(context), gpu, arena::format_size(cap)));
  arena::ArenaError err;
  const bool first = s.gpu < 0;
  if (first) {
    err = g.sched.arrive(s.id, need, c.priority.value_or(s.priority), c.iters, now(), s.uid);
  } else {
    err = g.sched.change_need(s.id, need, c.iters, now());
  }
  if (err != arena::ArenaError::ok)
    return fail(err == arena::ArenaError::too_large ? ENOMEM : EINVAL,
                fmt::format("rejected by gpu {}: {}", gpu, arena::to_string(err)));
  if (first) {
    ++g.placed;
    s.gpu_generation = g.device->generation();
    host_keys_stale_ = true;  // one more of its uid's sessions placed
  }
  s.gpu = gpu;
  s.need.persistent = p;
  s.need.ephemeral = e;
  s.context_counted = need.unswappable;
  set_budget(s);
  if (c.iters) s.need.iters = c.iters;
  if (c.priority) {
    s.priority = *c.priority;
    s.need.priority = c.priority;
    g.sched.set_priority(s.id, *c.priority);
  }
  s.error = 0;
  s.error_text.clear();
  s.lane.reset();
  s.state = SessionState::queued;
  s.queued_at = now();
  update_runnable(g, s);
  handle_admissions(g, later);
  if (s.state != SessionState::admitted) {
    std::size_t pos = 0;
    for (const auto& q : g.sched.arena().queue()) {
      ++pos;
      if (q.session == s.id) break;
    }
    log(s,
        fmt::format("line {}: queued on gpu {} at position {}: waiting for memory", ln, gpu, pos));
  }
  return 0;
}

// Each GPU's state now, for the shared placement rule (sched/placement.hpp). MAGM's
// figure is the arena's free memory less what already waits in its queue, the same as
// salus-sim's (docs/design.md).
void Broker::fill_views() {
  views_.resize(gpus_.size());
  const bool risk = config_.risk.enabled && telemetry_ &&
                    (config_.placement == Placement::magm || config_.placement == Placement::lug);
  for (std::size_t i = 0; i < gpus_.size(); ++i) {
    const Gpu& g = *gpus_[i];
    sched::GpuView& v = views_[i];
    const auto m = g.sched.arena().memory();
    std::int64_t waiting = 0;
    if (m.queued > 0)
      for (const auto& q : g.sched.arena().queue())
        waiting += static_cast<std::int64_t>(q.need.persistent + q.need.ephemeral);
    v.capacity = m.capacity;
    v.available = static_cast<std::int64_t>(m.free) - waiting;
    v.load = static_cast<double>(g.device->busy_ns()) /
             static_cast<double>(std::max<TimeNs>(now(), 1));  // busy since salusd started
    v.placed = g.placed;
    v.draining = g.draining;
    v.eligible = true;
    v.sm_activity.reset();
    v.mem_activity.reset();
    if (risk) {
      const GpuRisk r = telemetry_->risk(i);
      v.sm_activity = r.sm;
      v.mem_activity = r.mem;
    }
  }
}

// `need gpu=any` on a one-GPU host: placed at once. Returns the GPU, or -errno after
// logging why.
int Broker::place_any(Session& s, Bytes p, Bytes e, std::uint32_t ln) {
  fill_views();
  // A GPU with room for the context reserve too, else one with room for the need
  // (where the reserve is cut: context_for).
  const sched::PlacementOptions opts{config_.placement, config_.risk};
  const Bytes context = will_attach(s) ? context_reserve_on(-1) : 0;
  sched::PlacementChoice c = sched::choose_gpu(views_, p + e + context, opts, rr_next_);
  if (!c.gpu && context > 0) c = sched::choose_gpu(views_, p + e, opts, rr_next_);
  if (!c.gpu) {
    log(s, fmt::format("line {}: need: persistent={} + ephemeral={} fits no GPU{}", ln,
                       arena::format_size(p), arena::format_size(e),
                       config_.placement == Placement::exclusive
                           ? " with no other session (placement exclusive)"
                           : ""));
    return -ENOMEM;
  }
  rr_next_ = c.next_rr;
  if (c.risk_ignored)
    log(s, fmt::format("line {}: need: every GPU that fits is busy past the risk thresholds; "
                       "placed on gpu {} anyway",
                       ln, *c.gpu));
  return static_cast<int>(*c.gpu);
}

// A first `need gpu=any` (or a later one while it still waits) on a host of several GPUs:
// the session waits host-wide, ranked by the policy's admission key, and bind_waiting
// places it. It must fit some GPU that admits new sessions, or it would wait forever.
int Broker::queue_any(Session& s, const NeedCmd& c, Bytes p, Bytes e, std::uint32_t ln,
                      Deferred& later) {
  Bytes largest = 0;
  for (const auto& g : gpus_)
    if (!g->draining) largest = std::max(largest, g->sched.arena().capacity());
  if (p + e > largest) {
    log(s,
        fmt::format("line {}: need: persistent={} + ephemeral={} fits no GPU that admits "
                    "new sessions (the largest holds {})",
                    ln, arena::format_size(p), arena::format_size(e), arena::format_size(largest)));
    return ENOMEM;
  }
  if (c.name && !c.name->empty()) s.need.name = c.name;
  s.need.persistent = p;
  s.need.ephemeral = e;
  if (c.iters) s.need.iters = c.iters;
  if (c.priority) {
    s.priority = *c.priority;
    s.need.priority = c.priority;
  }
  if (const auto q = host_queue_.find(s.id)) {
    host_queue_.set_need(s.id, p, e);
    host_queue_.set_key(s.id, host_key(s, q->arrival, owner_placements()));
  } else {
    const std::uint64_t arrival = host_arrivals_++;
    host_queue_.push(s.id, arrival, now(), p, e, host_key(s, arrival, owner_placements()));
    host_keys_stale_ = true;  // a new uid may make the queue per user
    s.queued_at = now();
  }
  s.error = 0;
  s.error_text.clear();
  s.state = SessionState::queued;
  bind_waiting(later);
  if (s.gpu < 0)
    log(s, fmt::format("line {}: queued host-wide at position {}: no GPU admits it now", ln,
                       host_queue_position(s.id)));
  return 0;
}

// One late-binding pass (sched::bind_late, salus-sim's too). Each session bound here is
// admitted by its GPU at once (the pass binds it only where the arena would admit it);
// the broker's side of that admission runs after the pass, which must not see the host
// queue change under it.
void Broker::bind_waiting(Deferred& later) {
  if (binding_ || host_queue_.empty()) return;
  // Per-user admission order follows what is placed now (keys hold still in a pass);
  // re-keyed only after a placement, an end or a new waiter, not at every boundary.
  if (host_keys_stale_ && config_.policy == sched::PolicyKind::fair &&
      sched::by_owner(config_.fair_share))
    rekey_host_queue();
  binding_ = true;
  views_.resize(gpus_.size());  // before the span over it is taken
  std::vector<std::uint32_t> touched;
  auto bounds = [this] {
    arena::AdmissionBounds b{0, 0, std::numeric_limits<double>::infinity()};
    for (const auto& g : gpus_) {
      if (g->draining) continue;
      const arena::AdmissionBounds a = g->sched.arena().admission_bounds();
      b.room = std::max(b.room, a.room);
      b.total = std::max(b.total, a.total);
    }
    return b;
  };
  auto admits = [this](const arena::QueuedRequest& q, std::uint32_t gi) {
    const Gpu& g = *gpus_[gi];
    const Session* s = get(q.session);
    return s && !g.draining &&
           g.sched.arena().would_admit(
               arena_need(*s, q.persistent, q.ephemeral, static_cast<int>(gi)));
  };
  auto place = [&](const arena::QueuedRequest& q, std::uint32_t gi, const sched::PlacementChoice&) {
    if (Session* s = get(q.session); s && bind_to(*s, gi)) touched.push_back(gi);
  };
  // Exclusive: idle GPUs go to the waiting sessions in arrival order (as in salus-sim).
  const arena::QueueMode mode = config_.placement == Placement::exclusive
                                    ? arena::QueueMode::strict_fifo
                                    : config_.arena.queue_mode;
  sched::bind_late(
      host_queue_, mode, config_.arena.max_bypass, bounds, std::span<sched::GpuView>(views_),
      sched::PlacementOptions{config_.placement, config_.risk}, rr_next_,
      [this](std::span<sched::GpuView>) { fill_views(); }, admits, place);
  for (std::uint32_t gi : touched) handle_admissions(*gpus_[gi], later);
  binding_ = false;
}

// Binds a session waiting host-wide to GPU `gi`, as exec_need binds a first `need`.
bool Broker::bind_to(Session& s, std::uint32_t gi) {
  Gpu& g = *gpus_[gi];
  const arena::Need need = arena_need(s, s.need.persistent, s.need.ephemeral, static_cast<int>(gi));
  const arena::ArenaError err = g.sched.arrive(s.id, need, s.priority, s.need.iters, now(), s.uid);
  if (err == arena::ArenaError::ok) s.context_counted = need.unswappable;
  if (err != arena::ArenaError::ok) {
    s.error = EIO;
    s.error_text = fmt::format("rejected by gpu {}: {}", gi, arena::to_string(err));
    s.state = SessionState::failed;
    log(s, fmt::format("need: {}", s.error_text));
    return false;
  }
  ++g.placed;
  s.gpu_generation = g.device->generation();
  s.gpu = static_cast<int>(gi);
  host_keys_stale_ = true;  // one more of its uid's sessions placed
  set_budget(s);
  s.lane.reset();
  log(s, fmt::format("placed on gpu {} after {:.1f} ms in the host-wide queue", gi,
                     static_cast<double>(now() - s.queued_at) / 1e6));
  update_runnable(g, s);
  return true;
}

void Broker::rekey_host_queue() {
  std::vector<std::pair<SessionId, std::uint64_t>> waiting;
  host_queue_.for_each(
      [&](const arena::QueuedRequest& q) { waiting.emplace_back(q.session, q.arrival); });
  const sched::OwnerPlacements owners = owner_placements();
  host_keys_stale_ = false;
  for (const auto& [id, arrival] : waiting)
    if (const Session* s = get(id)) host_queue_.set_key(id, host_key(*s, arrival, owners));
}

sched::OwnerPlacements Broker::owner_placements() const {
  sched::OwnerPlacements owners;
  if (config_.policy != sched::PolicyKind::fair || !sched::by_owner(config_.fair_share))
    return owners;
  for (const auto& [id, s] : sessions_) {
    if (s->dead) continue;
    if (s->gpu >= 0) {
      owners.placed(s->uid, +1);
    } else if (host_queue_.contains(id)) {
      owners.waiting(s->uid, +1);
    }
  }
  return owners;
}

// The host-wide queue's order (sched::host_queue_key, salus-sim's too); under FAIR
// by owner it follows what each uid has placed, as each GPU's queue follows what
// each uid has admitted (GpuScheduler::queue_key).
double Broker::host_key(const Session& s, std::uint64_t arrival,
                        const sched::OwnerPlacements& owners) const {
  sched::RankInputs in;
  in.arrival = arrival;
  in.priority = s.priority;
  in.iters = s.need.iters;
  return sched::host_queue_key(config_.policy, config_.placement == Placement::exclusive, &owners,
                               s.uid, in);
}

std::string Broker::host_queue_position(SessionId id) const {
  if (!host_queue_.contains(id)) return {};
  std::size_t pos = 0, at = 0;
  host_queue_.for_each([&](const arena::QueuedRequest& q) {
    ++pos;
    if (q.session == id) at = pos;
  });
  return fmt::format("{} of {}", at, host_queue_.size());
}

// What to do about an iteration's ephemeral memory that its lane cannot hold. A
// session declared kind=attached (e.g. by the Slurm plugin where the shim is
// installed) has a lane without ephemeral memory: a program's is its own.
std::string Broker::ephemeral_hint(const Session& s) {
  if (will_attach(s) && !s.gate)
    return "the session's need says kind=attached, whose ephemeral memory is the program's own "
           "(its lane holds none); for iterations written to ctl, declare `need ... kind=hosted`";
  return "raise it with `need ... ephemeral=`";
}

int Broker::exec_alloc(Session& s, const AllocCmd& c, std::uint32_t ln, bool& suspend) {
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: alloc {}: {}", ln, c.name, msg));
    return err;
  };
  if (c.size == 0) return fail(EINVAL, "size must be positive");
  if (s.recording) {
    Recording& r = *s.recording;
    if (r.ephemeral.count(c.name) || s.names.count(c.name))
      return fail(EEXIST, "a buffer with this name already exists");
    const Bytes off = r.iter->ephemeral_bytes;
    const Bytes size = arena::align_up(c.size);
    Bytes lane_size = s.need.ephemeral;
    if (const Gpu* g = gpu_of(s); g && s.lane) lane_size = g->sched.arena().lane_size(*s.lane);
    if (off + size > lane_size) {
      s.recording.reset();
      return fail(ENOMEM, fmt::format("the iteration needs {} bytes of ephemeral memory but its "
                                      "lane holds {} (declared ephemeral={}); the iteration is "
                                      "discarded — {}",
                                      off + size, lane_size, s.need.ephemeral, ephemeral_hint(s)));
    }
    r.ephemeral[c.name] = {off, size};
    r.iter->ephemeral_bytes = off + size;
    return 0;
  }
  if (s.names.count(c.name)) return fail(EEXIST, "a buffer with this name already exists");
  UidUsage& u = usage_[s.uid];
  if (u.buffers >= config_.quotas.buffers_per_uid) {
    ++stats_.quota_rejections;
    return fail(EDQUOT, fmt::format("uid {} holds {} buffers, the quota", s.uid, u.buffers));
  }
  Gpu& g = *gpu_of(s);
  const auto r = g.sched.arena().alloc_persistent(s.id, c.size);
  if (r.error == arena::ArenaError::swapped_out) {
    // Oversubscribed and swapped out: the write waits until its memory is back.
    want_resident(g, s);
    suspend = true;
    return 0;
  }
  if (r.error == arena::ArenaError::fragmented) {
    // Compaction is planned; the write waits (holding no thread) and retries
    // when it completes, or when the GPU's worker next runs (memory freed by
    // a session that left, a swap-out or a lane that shrank may be the room
    // it needs, and a plan that moves nothing completes nothing).
    if (std::find(g.alloc_waiters.begin(), g.alloc_waiters.end(), s.id) == g.alloc_waiters.end())
      g.alloc_waiters.push_back(s.id);
    // The dispatch pass starts the compaction. A retry runs on the worker just
    // before one, and a kick from there would wake it again at once: a spin.
    if (!g.retrying_allocs) kick(g);
    suspend = true;
    return 0;
  }
  if (r.error == arena::ArenaError::no_memory) {
    // Memory this session freed may still be in use by its submitted work; it
    // comes back when that work completes, so wait for it rather than fail.
    for (const auto& [handle, pin] : s.pins) {
      if (pin.retired) {
        suspend = true;
        return 0;
      }
    }
  }
  if (r.error != arena::ArenaError::ok) {
    const auto pl = g.sched.arena().placement(s.id);
    return fail(ENOMEM, fmt::format("persistent memory exhausted: the session uses {} (declared "
                                    "persistent={}), gpu {} has {} free under the safety condition",
                                    arena::format_size(pl ? pl->persistent_used : 0),
                                    arena::format_size(s.need.persistent), s.gpu,
                                    arena::format_size(g.sched.arena().memory().free)));
  }
  if (const Backing b = backing_of(g, {{r.offset, arena::align_up(c.size)}}); b != Backing::ready) {
    g.sched.arena().free_persistent(r.handle);
    if (b == Backing::pending) {
      // Its memory is being mapped off the lock: the write waits (holding no
      // thread) and retries when that is done (finish_backing).
      suspend = true;
      return 0;
    }
    return fail(ENOMEM,
                fmt::format("gpu {} has no card memory to back it: {}", s.gpu, g.backing_why));
  }
  Buffer b;
  b.id = s.next_buffer_id++;
  b.name = c.name;
  b.size = c.size;
  b.handle = r.handle;
  // Freshly allocated memory reads as zero, whatever lived there before (an old
  // lane, a compacted buffer): nothing is in flight on a free range.
  g.device->discard(r.offset, arena::align_up(c.size));
  s.names[c.name] = b.id;
  s.buffers[b.id] = std::move(b);
  ++u.buffers;
  return 0;
}

void Broker::retire(Session& s, arena::BufferHandle handle, Bytes size) {
  if (!handle) return;
  auto p = s.pins.find(handle);
  if (p != s.pins.end() && p->second.count > 0) {
    p->second.retired = true;
    p->second.size = size;
    return;
  }
  if (p != s.pins.end()) s.pins.erase(p);
  if (Gpu* g = gpu_of(s)) {
    if (g->sched.arena().buffer_on_gpu(handle))
      g->device->discard(g->sched.arena().buffer_offset(handle), size);
    g->sched.arena().free_persistent(handle);
  }
}

void Broker::pin(Session& s, arena::BufferHandle handle) {
  if (handle) ++s.pins[handle].count;
}

void Broker::unpin(Session& s, arena::BufferHandle handle) {
  auto p = s.pins.find(handle);
  if (p == s.pins.end()) return;
  if (--p->second.count > 0) return;
  const bool retired = p->second.retired;
  const Bytes size = p->second.size;
  s.pins.erase(p);
  if (retired) retire(s, handle, size);
}

int Broker::exec_free(Session& s, const FreeCmd& c, std::uint32_t ln) {
  if (s.recording) {
    if (s.recording->ephemeral.erase(c.name)) return 0;
    log(s, fmt::format("line {}: free {}: {}", ln, c.name,
                       s.names.count(c.name) ? "persistent buffers cannot be freed inside begin/end"
                                             : "no such ephemeral buffer in this iteration"));
    return s.names.count(c.name) ? EINVAL : ENOENT;
  }
  auto it = s.names.find(c.name);
  if (it == s.names.end()) {
    log(s, fmt::format("line {}: free {}: no such buffer", ln, c.name));
    return ENOENT;
  }
  const Buffer b = s.buffers.at(it->second);
  s.names.erase(it);
  s.buffers.erase(b.id);
  UidUsage& u = usage_[s.uid];
  if (u.buffers > 0) --u.buffers;
  // Work already submitted keeps the memory until it is done with it.
  retire(s, b.handle, b.size);
  return 0;
}

int Broker::resolve(Session& s, Iteration& it, const BufRef& ref, Bytes length, Operand& out,
                    std::uint32_t ln, const char* what) {
  if (s.recording) {
    auto e = s.recording->ephemeral.find(ref.name);
    if (e != s.recording->ephemeral.end()) {
      const auto [off, size] = e->second;
      if (ref.offset > size || length > size - ref.offset) {
        log(s,
            fmt::format("line {}: {}: range +{} len {} is outside ephemeral buffer {} ({} bytes)",
                        ln, what, ref.offset, length, ref.name, size));
        return ERANGE;
      }
      out = Operand{true, 0, off + ref.offset};
      return 0;
    }
  }
  auto n = s.names.find(ref.name);
  if (n == s.names.end()) {
    log(s, fmt::format("line {}: {}: unknown buffer '{}'", ln, what, ref.name));
    return ENOENT;
  }
  const Buffer& b = s.buffers.at(n->second);
  if (ref.offset > b.size || length > b.size - ref.offset) {
    log(s, fmt::format("line {}: {}: range +{} len {} is outside buffer {} ({} bytes)", ln, what,
                       ref.offset, length, ref.name, b.size));
    return ERANGE;
  }
  std::uint32_t slot = 0;
  while (slot < it.names.size() && it.names[slot] != ref.name) ++slot;
  if (slot == it.names.size()) {
    it.names.push_back(ref.name);
    it.min_sizes.push_back(0);
  }
  it.min_sizes[slot] = std::max(it.min_sizes[slot], ref.offset + length);
  out = Operand{false, slot, ref.offset};
  return 0;
}

int Broker::record_op(Session& s, const Command& cmd, std::uint32_t ln) {
  std::shared_ptr<Iteration> single;
  Iteration* it;
  if (s.recording) {
    it = s.recording->iter.get();
  } else {
    single = std::make_shared<Iteration>();
    single->counts = false;
    it = single.get();
  }
  Op op;
  int err = 0;
  if (const auto* f = std::get_if<FillCmd>(&cmd)) {
    op.kind = Op::Kind::fill;
    op.width = f->dtype == DType::u8 ? 1 : 4;
    op.pattern = f->bits;
    Bytes len = 0;
    if (f->length) {
      len = *f->length;
    } else {
      // Default: to the end of the buffer.
      Bytes size = 0;
      if (s.recording && s.recording->ephemeral.count(f->dst.name))
        size = s.recording->ephemeral.at(f->dst.name).second;
      else if (auto n = s.names.find(f->dst.name); n != s.names.end())
        size = s.buffers.at(n->second).size;
      len = size > f->dst.offset ? size - f->dst.offset : 0;
    }
    if (len % op.width != 0) {
      log(s, fmt::format("line {}: fill: length {} is not a multiple of the {}-byte element", ln,
                         len, op.width));
      return EINVAL;
    }
    op.length = len;
    err = resolve(s, *it, f->dst, len, op.a, ln, "fill");
  } else if (const auto* c = std::get_if<CopyCmd>(&cmd)) {
    op.kind = Op::Kind::copy;
    op.length = c->length;
    err = resolve(s, *it, c->dst, c->length, op.a, ln, "copy destination");
    if (!err) err = resolve(s, *it, c->src, c->length, op.b, ln, "copy source");
  } else if (const auto* sp = std::get_if<SpinCmd>(&cmd)) {
    op.kind = Op::Kind::spin;
    op.usec = sp->usec;
    op.util = sp->util;
  } else if (const auto* gm = std::get_if<GemmCmd>(&cmd)) {
    op.kind = Op::Kind::gemm;
    op.m = gm->m;
    op.n = gm->n;
    op.k = gm->k;
    const Bytes fm = gm->m, fn = gm->n, fk = gm->k;
    err = resolve(s, *it, BufRef{gm->a, 0}, fm * fk * 4, op.a, ln, "gemm A");
    if (!err) err = resolve(s, *it, BufRef{gm->b, 0}, fk * fn * 4, op.b, ln, "gemm B");
    if (!err) err = resolve(s, *it, BufRef{gm->c, 0}, fm * fn * 4, op.c, ln, "gemm C");
  } else if (const auto* l = std::get_if<LaunchCmd>(&cmd)) {
    err = record_launch(s, *it, *l, op, ln);
  } else {
    log(s, fmt::format("line {}: command not supported here", ln));
    return EINVAL;
  }
  if (err) return err;
  it->ops.push_back(std::move(op));
  if (single) return submit_iteration(s, std::move(single), 1, ln);
  return 0;
}

int Broker::submit_iteration(Session& s, std::shared_ptr<const Iteration> iter,
                             std::uint64_t repeat, std::uint32_t ln) {
  if (repeat == 0) return 0;
  if (s.state == SessionState::queued) {
    log(s, fmt::format("line {}: the session is still queued for admission", ln));
    return EAGAIN;
  }
  if (s.state != SessionState::admitted || !s.lane) {
    log(s, fmt::format("line {}: {}", ln, kNoGpuYet));
    return ENXIO;
  }
  Gpu& g = *gpu_of(s);
  const Bytes lane_size = g.sched.arena().lane_size(*s.lane);
  if (iter->ephemeral_bytes > lane_size) {
    log(s, fmt::format("line {}: the iteration needs {} bytes of ephemeral memory but its lane "
                       "holds {}; {}",
                       ln, iter->ephemeral_bytes, lane_size, ephemeral_hint(s)));
    return ENOMEM;
  }
  UidUsage& u = usage_[s.uid];
  // A count no queue could ever take is a range error, not a full quota: it
  // fails the same on an idle daemon, and waiting does not help.
  if (repeat > config_.quotas.queued_iterations_per_uid) {
    log(s, fmt::format("line {}: {} iterations in one submission; at most {} (the "
                       "queued-iterations quota) can be queued at once",
                       ln, repeat, config_.quotas.queued_iterations_per_uid));
    return ERANGE;
  }
  if (u.queued > config_.quotas.queued_iterations_per_uid - repeat) {
    ++stats_.quota_rejections;
    log(s, fmt::format("line {}: uid {} would have {} iterations queued; the quota is {}", ln,
                       s.uid, u.queued + repeat, config_.quotas.queued_iterations_per_uid));
    return EDQUOT;
  }
  WorkItem item;
  item.bound.reserve(iter->names.size());
  for (std::size_t i = 0; i < iter->names.size(); ++i) {
    auto n = s.names.find(iter->names[i]);
    if (n == s.names.end()) {
      log(s, fmt::format("line {}: buffer '{}' used by the iteration no longer exists", ln,
                         iter->names[i]));
      return ENOENT;
    }
    const Buffer& b = s.buffers.at(n->second);
    if (b.size < iter->min_sizes[i]) {
      log(s, fmt::format("line {}: buffer '{}' is {} bytes; the iteration touches {}", ln, b.name,
                         b.size, iter->min_sizes[i]));
      return ERANGE;
    }
    item.bound.push_back(b.handle);
  }
  for (arena::BufferHandle h : item.bound) pin(s, h);
  item.iter = std::move(iter);
  item.remaining = repeat;
  item.counted = true;
  u.queued += repeat;
  s.queued_instances += repeat;
  enqueue(s, std::move(item));
  return 0;
}

void Broker::enqueue(Session& s, WorkItem item) {
  item.seq = ++s.submitted_seq;
  s.queue.push_back(std::move(item));
  if (Gpu* g = gpu_of(s)) {
    update_runnable(*g, s);
    kick(*g);
  }
}

std::uint64_t Broker::status_version(SessionId id) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  return s ? s->version : 0;
}

void Broker::watch(SessionId id, std::uint64_t seen, std::uint64_t key,
                   std::function<void(bool fire)> changed) {
  std::function<void(bool)> replaced;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (s && !s->dead && s->version == seen) {
      for (auto& [k, w] : s->watchers) {
        if (k != key) continue;
        replaced = std::exchange(w, std::move(changed));
        break;
      }
      if (!replaced) s->watchers.emplace_back(key, std::move(changed));
    }
  }
  if (replaced) {
    replaced(false);
    return;
  }
  if (changed) changed(true);  // already changed (or gone)
}

void Broker::unwatch(SessionId id, std::uint64_t key) {
  std::function<void(bool)> dropped;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s) return;
    for (auto it = s->watchers.begin(); it != s->watchers.end(); ++it) {
      if (it->first != key) continue;
      dropped = std::move(it->second);
      s->watchers.erase(it);
      break;
    }
  }
  if (dropped) dropped(false);
}

std::uint64_t Broker::wait(SessionId id, std::function<void(int err, std::string text)> done) {
  Deferred later;
  std::uint64_t ticket = 0;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || s->dead) {
      later.push_back([done] { done(ENOENT, {}); });
    } else {
      ticket = next_ticket_++;
      s->waiters.push_back(Waiter{s->submitted_seq, std::move(done), ticket});
      check_waiters(*s, later);
    }
  }
  run_deferred(later);
  return ticket;
}

void Broker::check_waiters(Session& s, Deferred& later) {
  ++s.version;
  for (auto& [key, w] : s.watchers) later.push_back([w = std::move(w)] { w(true); });
  s.watchers.clear();
  const bool drained = s.queue.empty() && s.dispatched.empty() && s.in_flight == 0;
  if (s.waiters.empty()) {
    // fallthrough to writes
  } else {
    std::vector<Waiter> keep;
    for (Waiter& w : s.waiters) {
      if (s.error) {
        auto done = std::move(w.done);
        const int err = s.error;
        later.push_back([done, err] { done(err, {}); });
      } else if (drained || s.completed_seq >= w.target_seq) {
        auto done = std::move(w.done);
        std::string text = fmt::format("done {}\n", s.iterations_done);
        later.push_back([done, text] { done(0, text); });
      } else {
        keep.push_back(std::move(w));
      }
    }
    s.waiters = std::move(keep);
  }
  if (!s.writes.empty() && s.writes.front().syncing) resume_writes(s, later);
}

void Broker::fail_session(Session& s, int err, std::string text, Deferred& later) {
  if (!s.error) {
    s.error = err;
    s.error_text = text;
  }
  if (s.state == SessionState::admitted) s.state = SessionState::failed;
  log(s, fmt::format("failed: {} ({}); queued work dropped", text, strerrorname_np(err)));
  drop_queued(s, err, later);
  check_waiters(s, later);
}

void Broker::drop_queued(Session& s, int err, Deferred& later) {
  UidUsage& u = usage_[s.uid];
  std::deque<WorkItem> keep;
  for (WorkItem& item : s.queue) {
    if (item.counted) {
      u.queued -= std::min(u.queued, item.remaining);
      s.queued_instances -= std::min(s.queued_instances, item.remaining);
    }
    if (item.transfer && u.transfers > 0) --u.transfers;  // closes its file as it goes
    item.remaining = 0;
    if (item.outstanding > 0) {
      s.dispatched.push_back(std::move(item));
      continue;
    }
    for (arena::BufferHandle h : item.bound) unpin(s, h);
    if (item.on_done) {
      auto fn = std::move(item.on_done);
      later.push_back([fn, err]() mutable { fn(err, {}); });
    }
  }
  s.queue.clear();
  if (Gpu* g = gpu_of(s)) update_runnable(*g, s);
}

int Broker::exec_module(Session& s, const ModuleCmd& c, PendingWrite& w, std::uint32_t ln) {
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: module {}: {}", ln, c.name, msg));
    return err;
  };
  if (s.recording) return fail(EINVAL, "not allowed inside begin/end");
  if (s.modules.count(c.name)) return fail(EEXIST, "a module with this name is already loaded");
  const PendingWrite::ModuleFile* file = nullptr;
  for (const auto& f : w.module_files)
    if (f.path == c.path) file = &f;
  if (!file) return fail(EIO, "internal: module file was not read");
  if (file->error) return fail(file->error, file->why);
  Gpu& g = *gpu_of(s);
  // A sim module is host code that would run inside this root daemon.
  if (g.device->info().backend == "sim" && !w.caller_admin)
    return fail(EPERM,
                "sim-backend modules are host code run inside salusd; only root or the "
                "admin group may load them");
  LoadedModule m;
  std::string why;
  if (int rc = g.device->load_module(file->image, m.handle, why)) return fail(rc, why);
  s.modules.emplace(c.name, std::move(m));
  return 0;
}

int Broker::record_launch(Session& s, Iteration& it, const LaunchCmd& c, Op& op, std::uint32_t ln) {
  const std::string what = fmt::format("launch {}.{}", c.module, c.function);
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: {}: {}", ln, what, msg));
    return err;
  };
  auto mit = s.modules.find(c.module);
  if (mit == s.modules.end())
    return fail(ENOENT,
                fmt::format("no module '{}' (load it with `module {} PATH`)", c.module, c.module));
  LoadedModule& mod = mit->second;
  auto fit = mod.functions.find(c.function);
  if (fit == mod.functions.end()) {
    LoadedModule::Function f;
    std::string why;
    Gpu& g = *gpu_of(s);
    if (int rc = g.device->get_function(mod.handle, c.function, f.handle, f.param_sizes, why))
      return fail(rc, why);
    fit = mod.functions.emplace(c.function, std::move(f)).first;
  }
  const auto& params = fit->second.param_sizes;
  if (!params.empty() && params.size() != c.args.size())
    return fail(EINVAL, fmt::format("the kernel takes {} parameter{}, the command gives {}",
                                    params.size(), params.size() == 1 ? "" : "s", c.args.size()));
  op.kind = Op::Kind::launch;
  op.function = fit->second.handle;
  for (int d = 0; d < 3; ++d) {
    op.dims.grid[d] = c.grid[d];
    op.dims.block[d] = c.block[d];
  }
  op.dims.shared_mem = c.shared_mem;
  op.args.reserve(c.args.size());
  for (std::size_t i = 0; i < c.args.size(); ++i) {
    const LaunchArg& a = c.args[i];
    KernelArg k;
    switch (a.kind) {
      case LaunchArg::Kind::buffer:
        k.size = 8;
        break;
      case LaunchArg::Kind::i32:
      case LaunchArg::Kind::u32:
      case LaunchArg::Kind::f32:
        k.size = 4;
        break;
      default:
        k.size = 8;
        break;
    }
    if (!params.empty() && params[i] != k.size)
      return fail(EINVAL, fmt::format("parameter {} is {} bytes but argument {} gives {}", i,
                                      params[i], i + 1, k.size));
    if (a.kind == LaunchArg::Kind::buffer) {
      k.buffer = true;
      if (int err = resolve(s, it, a.buffer, 0, k.operand, ln, "launch")) return err;
    } else {
      k.bits = a.bits;
    }
    op.args.push_back(k);
  }
  return 0;
}

// ---------------------------------------------------------------- admission

void Broker::handle_admissions(Gpu& g, Deferred& later, bool kick_worker) {
  sync_lanes(g, later);
  for (const arena::Admitted& a : g.sched.take_admissions()) {
    Session* s = get(a.session);
    if (!s) continue;
    s->lane = a.lane;
    if (s->state == SessionState::queued) {
      s->state = s->error ? SessionState::failed : SessionState::admitted;
      s->admitted_at = now();
      s->queue_wait_ns += s->admitted_at - s->queued_at;
    }
    log(*s, fmt::format("admitted on gpu {} lane {} after {:.1f} ms in the queue", g.index, a.lane,
                        static_cast<double>(s->admitted_at - s->queued_at) / 1e6));
    update_runnable(g, *s);
    resume_writes(*s, later);
    check_waiters(*s, later);
    maybe_start_transfer(*s);
  }
  sync_lanes(g, later);
  if (kick_worker) kick(g);
  bind_waiting(later);  // what left this GPU may make room for a session waiting host-wide
}

// Keeps one stream per arena lane: new lanes get a stream now, streams of deleted
// lanes are destroyed after the broker unlocks (destroy waits for the stream).
void Broker::sync_lanes(Gpu& g, Deferred& later) {
  const auto views = g.sched.arena().lanes();
  for (const auto& v : views) {
    if (!g.lanes.count(v.id)) {
      Lane lane;
      lane.stream = g.device->create_stream();
      g.stream_lane[lane.stream] = v.id;
      g.lanes.emplace(v.id, std::move(lane));
    }
  }
  for (auto it = g.lanes.begin(); it != g.lanes.end();) {
    bool present = false;
    for (const auto& v : views) present = present || v.id == it->first;
    if (present || it->second.in_flight > 0) {
      ++it;
      continue;
    }
    const StreamId stream = it->second.stream;
    g.stream_lane.erase(stream);
    Device* dev = g.device.get();
    later.push_back([dev, stream] { dev->destroy_stream(stream); });
    it = g.lanes.erase(it);
  }
}

void Broker::update_runnable(Gpu& g, Session& s) {
  // A transfer is not lane work: while one waits at the head or is being moved,
  // nothing of the session is dispatched.
  if (s.gate) {
    // An attached session wants an iteration when it requested more than granted.
    // Not while a swap-out it was asked for is unanswered (broker_gate.cpp).
    const bool wants = !s.gate->exited && gate_load(s.gate->g().requested) > s.gate->granted &&
                       !(s.gate->swap_pending && s.gate->swap_request == SALUS_SWAP_REQ_OUT) &&
                       !s.swapping;  // a prefetch (swap-in) is granted when it is answered
    g.sched.set_runnable(s.id, wants && !s.dead && s.lane && s.state == SessionState::admitted &&
                                   !(s.in_flight > 0 && s.in_flight_lane != s.lane));
    return;
  }
  // A session whose buffers compaction waits for gets no pipelined iteration:
  // it would never be idle, and the allocation or lane waiting for the room
  // would wait for as long as it keeps queueing work.
  const bool runnable = !s.queue.empty() && !s.dead && s.lane && !s.moving && !s.transferring &&
                        !s.queue.front().transfer && (s.state == SessionState::admitted) &&
                        !(s.in_flight > 0 && s.in_flight_lane != s.lane) &&
                        !g.held_for_compaction(s.id, s.in_flight);
  g.sched.set_runnable(s.id, runnable);
}

// ---------------------------------------------------------------- worker

void Broker::kick(Gpu& g) {
  {
    std::lock_guard lk(g.cq_mu);
    g.wake = true;
  }
  g.cq_cv.notify_one();
}

void Broker::retry_waiting_allocs(Gpu& g, Deferred& later) {
  if (g.alloc_waiters.empty()) return;
  std::vector<SessionId> ids;
  ids.swap(g.alloc_waiters);  // a retry that still finds no hole puts its session back
  g.retrying_allocs = true;
  struct Reset {  // also if a retry throws (the worker logs it and goes on)
    bool& on;
    ~Reset() { on = false; }
  } reset{g.retrying_allocs};
  for (SessionId id : ids)
    if (Session* s = get(id); s && !s->writes.empty() && !s->writes.front().syncing)
      resume_writes(*s, later);
}

void Broker::worker_loop(Gpu& g) {
  std::vector<Completion> batch;
  Deferred later;
  for (;;) {
    {
      std::unique_lock lk(g.cq_mu);
      // Wakes at least every sampling period to record the busy-time sample.
      g.cq_cv.wait_for(lk, kBusySamplePeriod,
                       [&] { return g.wake || !g.completions.empty() || g.stop; });
      if (g.stop && g.completions.empty()) return;
      batch.swap(g.completions);
      g.wake = false;
    }
    try {
      std::lock_guard lk(mu_);
      for (const Completion& c : batch) complete(g, c, later);
      check_generation(g, later);
      retry_waiting_allocs(g, later);
      dispatch(g, later);
      sample_busy(g);
    } catch (const std::exception& e) {
      spdlog::error("gpu {} worker: {}", g.index, e.what());
    }
    batch.clear();
    run_deferred(later);
  }
}

namespace {

std::string context_lost_text(const DeviceHealth& h) {
  return fmt::format(
      "gpu context lost ({}); the GPU was given a fresh context and its memory "
      "is gone",
      h.last_restart.empty() ? std::string("a kernel faulted") : h.last_restart);
}

}  // namespace

// A device that loses its context bumps its generation before it delivers the
// errored completions. A session with work in flight is told by its own
// completion (EFAULT marks the likely culprit, whose kernel was running);
// check_generation tells the others.
void Broker::tell_loss(Gpu& g, Session& s, bool culprit, Deferred& later) {
  const std::uint64_t gen = g.device->generation();
  s.gpu_generation = gen;
  s.told_loss = gen;
  const DeviceHealth h = g.device->health();
  if (culprit) {
    fail_session(s, EFAULT,
                 fmt::format("kernel fault: {}; the GPU's context was lost, the memory of every "
                             "session on it is gone",
                             h.last_fault.empty() ? std::string("a kernel of this session faulted")
                                                  : h.last_fault),
                 later);
  } else {
    fail_session(s, EIO, context_lost_text(h), later);
  }
}

std::string Broker::device_failure(Gpu& g, int status) {
  // A fault that cost no context (sim: an op outside device memory).
  if (status == EFAULT)
    return "kernel fault: an op of this session touched an address it does not own or trapped "
           "on the GPU";
  if (status == ENODEV) {
    const DeviceHealth h = g.device->health();
    if (!h.usable) return "the GPU is out of service: " + h.unusable_why;
  }
  return fmt::format("the device reported {}", std::strerror(status));
}

void Broker::check_generation(Gpu& g, Deferred& later) {
  const std::uint64_t gen = g.device->generation();
  if (gen == g.generation) return;
  g.generation = gen;
  const DeviceHealth h = g.device->health();
  spdlog::error(
      "gpu {}: the device lost its context ({}); every session on it loses its GPU "
      "memory",
      g.index, h.last_restart.empty() ? std::string("a fault") : h.last_restart);
  for (auto& [id, sp] : sessions_) {
    Session& s = *sp;
    if (s.gpu != static_cast<int>(g.index) || s.dead || s.gpu_generation == gen) continue;
    if (s.gate) continue;           // its memory lives in the program's own context
    if (s.in_flight > 0) continue;  // its own completion will tell it, and whether it is to blame
    tell_loss(g, s, false, later);
  }
}

void Broker::sample_busy(Gpu& g) {
  const TimeNs t = now();
  if (!g.busy_samples.empty() &&
      t - g.busy_samples.back().first <
          std::chrono::duration_cast<std::chrono::nanoseconds>(kBusySamplePeriod).count())
    return;
  g.busy_samples.emplace_back(t, g.device->busy_ns());
  // Keep a little over the longest window (60 s).
  while (g.busy_samples.size() > 2 && t - g.busy_samples[1].first > 61'000'000'000) {
    g.busy_samples.pop_front();
  }
}

double Broker::busy_fraction(const Gpu& g, TimeNs window) const {
  const TimeNs t = now();
  const std::int64_t busy = g.device->busy_ns();
  // The newest sample at least `window` old, else the oldest one there is.
  std::pair<TimeNs, std::int64_t> from{0, 0};
  for (const auto& sample : g.busy_samples) {
    if (sample.first > t - window) break;
    from = sample;
  }
  if (from.first == 0 && !g.busy_samples.empty() && g.busy_samples.front().first > t - window)
    from = {0, 0};  // younger than the window: since start
  const double span = static_cast<double>(t - from.first);
  if (span <= 0) return 0.0;
  return std::clamp(static_cast<double>(busy - from.second) / span, 0.0, 1.0);
}

void Broker::dispatch(Gpu& g, Deferred& later) {
  // The whole pass reaches a forwarding device as one burst (one send for
  // process isolation instead of one per iteration).
  struct Batch {
    Device& d;
    explicit Batch(Device& dev) : d(dev) { d.begin_batch(); }
    ~Batch() { d.end_batch(); }
  } batch(*g.device);
  // Memory freed since the last pass goes back to the card (and new ranges get theirs).
  backing_ready(g);
  // Admissions the arena made on its own (a buffer freed when the work that
  // used it ended): handled here, not only when some lane goes idle, which a
  // session that keeps its lane busy would put off for as long as it likes.
  if (g.sched.arena().has_admissions()) handle_admissions(g, later, false);
  offer_room_host_wide(g, later);
  compact(g);
  std::uint32_t budget = kInlineBudget;
  bool progress = true;
  while (progress && budget > 0) {
    progress = false;
    // Completions inside dispatch_one can delete lanes, so iterate over ids.
    g.lane_ids.clear();
    for (const auto& [lane_id, lane] : g.lanes) g.lane_ids.push_back(lane_id);
    for (LaneId lane_id : g.lane_ids) {
      auto it = g.lanes.find(lane_id);
      if (it == g.lanes.end()) continue;
      if (dispatch_one(g, lane_id, it->second, later)) {
        progress = true;
        --budget;
      }
      if (budget == 0) break;
    }
  }
  // After the picks, which noted the swapped sessions the lanes want next.
  drive_residency(g, later);
  if (budget == 0) {
    std::lock_guard lk(g.cq_mu);
    g.wake = true;  // more to do: come back after letting others take the lock
  }
}

// Room freed outside the events that bind waiting sessions (a buffer freed when
// the work that used it ends) would otherwise reach a session waiting host-wide
// only when some lane goes idle, which a busy session can put off at will.
void Broker::offer_room_host_wide(Gpu& g, Deferred& later) {
  if (host_queue_.empty()) return;
  const arena::AdmissionBounds b = g.sched.arena().admission_bounds();
  if (b.room <= g.host_offered.room && b.total <= g.host_offered.total) {
    g.host_offered = b;
    return;
  }
  bind_waiting(later);
  g.host_offered = g.sched.arena().admission_bounds();  // what binding left
}

// Clears what the lane must not pass on before `sid`'s instance (design.md,
// "Isolation of memory between sessions") and marks the lane busy at an idle start.
void Broker::prepare_lane(Gpu& g, LaneId lane_id, Lane& lane, SessionId sid, Bytes ephemeral) {
  arena::GpuArena& ar = g.sched.arena();
  Device& dev = *g.device;
  const Bytes base = ar.lane_offset(lane_id);
  const Bytes lane_size = ar.lane_size(lane_id);
  if (!lane.cleared || lane.cleared->first != base || lane.cleared->second != lane_size) {
    // New, grown or moved: nothing of this lane is in flight (lanes move only
    // when idle) and the region is now exclusively its own.
    if (lane.in_flight == 0) {
      dev.discard(base, lane_size);
      lane.cleared = {base, lane_size};
      lane.last_used = 0;
    }
  } else if (lane.last_session && *lane.last_session != sid && lane.last_used > 0) {
    dev.fill(lane.stream, base, lane.last_used, 0, 1);
    lane.last_used = 0;
  }
  if (lane.last_session != sid) lane.last_used = 0;
  lane.last_session = sid;
  lane.last_used = std::max(lane.last_used, ephemeral);
  if (lane.in_flight == 0) ar.begin_iteration(lane_id, sid, ephemeral);
}

// Puts one instance's ops on the stream; addresses are resolved now, from the bound
// handles' current offsets and the lane's (see "How work refers to memory").
void Broker::emit_ops(Gpu& g, StreamId st, Bytes base, WorkItem& item) {
  arena::GpuArena& ar = g.sched.arena();
  Device& dev = *g.device;
  auto addr = [&](const Operand& o) -> DevOffset {
    if (o.ephemeral) return base + o.offset;
    const arena::BufferHandle h = item.bound[o.slot];
    return h ? ar.buffer_offset(h) + o.offset : 0;
  };
  for (const Op& op : item.iter->ops) {
    switch (op.kind) {
      case Op::Kind::fill:
        dev.fill(st, addr(op.a), op.length, op.pattern, op.width);
        break;
      case Op::Kind::copy:
        dev.copy(st, addr(op.a), addr(op.b), op.length);
        break;
      case Op::Kind::spin:
        dev.spin(st, op.usec, op.util);
        break;
      case Op::Kind::gemm:
        dev.gemm(st, op.m, op.n, op.k, addr(op.a), addr(op.b), addr(op.c));
        break;
      case Op::Kind::to_host:
        dev.copy_to_staging(st, item.host.data(), addr(op.a), op.length);
        break;
      case Op::Kind::from_host:
        dev.copy_from_staging(st, addr(op.a), item.host.data(), op.length);
        break;
      case Op::Kind::launch: {
        g.arg_bytes.clear();
        g.arg_sizes.clear();
        for (const KernelArg& a : op.args) {
          const std::uint64_t v = a.buffer ? dev.device_address(addr(a.operand)) : a.bits;
          const auto* p = reinterpret_cast<const std::uint8_t*>(&v);  // little-endian
          g.arg_bytes.insert(g.arg_bytes.end(), p, p + a.size);
          g.arg_sizes.push_back(a.size);
        }
        dev.launch(st, op.function, op.dims, g.arg_bytes.data(), g.arg_sizes.data(),
                   g.arg_sizes.size());
        break;
      }
    }
  }
}

bool Broker::dispatch_one(Gpu& g, LaneId lane_id, Lane& lane, Deferred& later) {
  arena::GpuArena& ar = g.sched.arena();
  if (lane.in_flight >= config_.pipeline_depth || !ar.lane_ready(lane_id)) return false;
  if (!g.sched.lane_may_dispatch(lane_id)) return false;
  const auto sid = g.sched.pick(lane_id);
  if (!sid) return false;
  Session* s = get(*sid);
  if (s && s->gate) return grant_one(g, lane_id, lane, *s, later);
  if (!s || s->queue.empty()) {
    g.sched.set_runnable(*sid, false);
    return false;
  }
  if (must_drain(lane, *s)) return false;
  WorkItem& item = s->queue.front();
  if (item.transfer || s->transferring) {
    g.sched.set_runnable(*sid, false);
    return false;
  }
  const Iteration& it = *item.iter;
  if (it.ephemeral_bytes > ar.lane_size(lane_id)) {
    fail_session(
        *s, ENOMEM,
        fmt::format("the iteration needs {} bytes of ephemeral memory but lane {} holds {}",
                    it.ephemeral_bytes, lane_id, ar.lane_size(lane_id)),
        later);
    return true;
  }
  // A lane placed or moved since the last pass needs memory behind it first.
  if (!it.ops.empty() && !work_backed(g, lane_id, item)) return false;
  --item.remaining;
  ++item.outstanding;
  if (it.ops.empty() && s->in_flight == 0) {
    // Nothing for the device: complete in order right here.
    WorkItem* ip = &item;
    if (item.remaining == 0) {
      s->dispatched.push_back(std::move(item));
      s->queue.pop_front();
      ip = &s->dispatched.back();
    }
    g.sched.iteration_dispatched(*sid);
    finish_instance(g, *s, *ip, 0, 0, later);
    if (Session* again = get(*sid)) update_runnable(g, *again);
    return true;
  }
  prepare_lane(g, lane_id, lane, *sid, it.ephemeral_bytes);
  emit_ops(g, lane.stream, ar.lane_offset(lane_id), item);
  g.sched.residency().ran(*sid, now());
  g.sched.iteration_dispatched(*sid);
  const std::uint64_t token = next_token_++;
  lane.tokens.push_back(Lane::InFlight{token, *sid, now()});
  ++lane.in_flight;
  ++s->in_flight;
  s->in_flight_lane = lane_id;
  if (item.remaining == 0) {
    s->dispatched.push_back(std::move(item));
    s->queue.pop_front();
  }
  g.device->notify(lane.stream, token);
  update_runnable(g, *s);
  return true;
}

// Persistent compaction: sessions with nothing in flight hand over their planned
// buffer moves, which run as device-to-device copies on the GPU's move stream.
// The session is not dispatched until its copies are done.
void Broker::compact(Gpu& g) {
  arena::GpuArena& ar = g.sched.arena();
  // Moves planned earlier whose memory was not backed yet.
  if (!g.unbacked_moves.empty()) {
    auto waiting = std::move(g.unbacked_moves);
    g.unbacked_moves.clear();
    for (auto& [id, moves] : waiting) {
      if (moves_backed(g, moves))
        start_moves(g, id, moves);
      else
        g.unbacked_moves.emplace_back(id, std::move(moves));
    }
  }
  if (ar.compaction_pending()) {
    for (auto& [id, sp] : sessions_) {
      Session& s = *sp;
      if (s.gpu != static_cast<int>(g.index) || s.moving || s.in_flight > 0 || s.transferring ||
          s.swapping)
        continue;
      auto moves = ar.session_idle(s.id);
      if (moves.empty()) continue;
      s.moving = true;  // until the copies are done, whenever they start
      update_runnable(g, s);
      if (moves_backed(g, moves))
        start_moves(g, s.id, moves);
      else
        g.unbacked_moves.emplace_back(s.id, std::move(moves));
      if (!ar.compaction_pending()) break;
    }
  }
  hold_for_compaction(g);
}

void Broker::hold_for_compaction(Gpu& g) {
  arena::GpuArena& ar = g.sched.arena();
  if (g.compaction_holds.empty() && !ar.compaction_pending()) return;  // the usual pass
  ar.compaction_owners(g.compaction_holds_next);
  if (g.compaction_holds_next == g.compaction_holds) return;
  std::swap(g.compaction_holds, g.compaction_holds_next);
  // Everyone on the old list or the new: who joined is held now, who left may run.
  for (const std::vector<SessionId>* list : {&g.compaction_holds, &g.compaction_holds_next})
    for (SessionId id : *list)
      if (Session* s = get(id); s && s->gpu == static_cast<int>(g.index)) update_runnable(g, *s);
}

const char* Broker::compaction_role(const Session& s) const {
  if (s.moving) return "moving";
  if (s.gpu < 0 || s.gate) return "-";
  const Gpu& g = *gpus_[static_cast<std::size_t>(s.gpu)];
  return g.held_for_compaction(s.id, s.in_flight) ? "held" : "-";
}

void Broker::start_moves(Gpu& g, SessionId id, const std::vector<arena::PersistentMove>& moves) {
  if (!g.move_stream) g.move_stream = g.device->create_stream();
  for (const arena::PersistentMove& m : moves) g.device->copy(*g.move_stream, m.to, m.from, m.size);
  const std::uint64_t token = next_token_++;
  g.move_tokens.emplace(token, id);
  g.device->notify(*g.move_stream, token);
}

void Broker::finish_compaction(Gpu& g, const Completion& c, Deferred& later) {
  auto it = g.move_tokens.find(c.token);
  if (it == g.move_tokens.end()) return;
  const SessionId id = it->second;
  g.move_tokens.erase(it);
  g.sched.arena().finish_moves(id, now());
  if (Session* s = get(id)) {
    s->moving = false;
    if (c.status) fail_session(*s, c.status, "moving its persistent buffers failed", later);
    maybe_start_transfer(*s);
    update_runnable(g, *s);
    maybe_finalize(*s, later);
  }
  handle_admissions(g, later);
  // Writes waiting for a fragmented allocation retry now.
  for (auto& [sid, sp] : sessions_)
    if (sp->gpu == static_cast<int>(g.index) && !sp->writes.empty()) resume_writes(*sp, later);
}

void Broker::complete(Gpu& g, const Completion& c, Deferred& later) {
  if (g.move_stream && c.stream == *g.move_stream) {
    finish_compaction(g, c, later);
    return;
  }
  if (g.swap_stream && c.stream == *g.swap_stream) {
    finish_swap(g, c, later);
    return;
  }
  auto ls = g.stream_lane.find(c.stream);
  if (ls == g.stream_lane.end()) return;
  const LaneId lane_id = ls->second;
  Lane& lane = g.lanes.at(lane_id);
  if (lane.tokens.empty() || lane.tokens.front().token != c.token) {
    spdlog::error("gpu {} lane {}: completion token {} out of order", g.index, lane_id, c.token);
    return;
  }
  const Lane::InFlight f = lane.tokens.front();
  lane.tokens.pop_front();
  --lane.in_flight;
  if (lane.in_flight == 0) {
    g.sched.arena().end_iteration(lane_id, now());
    handle_admissions(g, later);
  } else if (lane.tokens.front().session != f.session) {
    // Another session's iteration runs now: f's session may be idle.
    g.sched.arena().lane_running(lane_id, lane.tokens.front().session);
  }
  Session* s = get(f.session);
  if (!s) return;
  --s->in_flight;
  WorkItem& item = !s->dispatched.empty() ? s->dispatched.front() : s->queue.front();
  finish_instance(g, *s, item, c.status, c.device_ns, later);
}

void Broker::finish_instance(Gpu& g, Session& s, WorkItem& item, int status, std::int64_t device_ns,
                             Deferred& later) {
  --item.outstanding;
  const Iteration& it = *item.iter;
  s.gpu_ns += device_ns;
  s.ops_done += it.ops.size();
  stats_.ops += it.ops.size();
  if (it.counts) {
    ++s.iterations_done;
    s.iteration_gpu_ns += device_ns;
    ++stats_.iterations;
  }
  g.sched.iteration_done(s.id, device_ns, it.counts);
  if (item.counted) {
    UidUsage& u = usage_[s.uid];
    if (u.queued > 0) --u.queued;
    if (s.queued_instances > 0) --s.queued_instances;
  }
  const SessionId id = s.id;
  if (!s.dead) {
    const std::uint64_t gen = g.device->generation();
    if (gen != s.gpu_generation) {
      // The context this session's work and memory lived in is gone, whatever
      // this item's own status (it may even have run on the fresh context).
      tell_loss(g, s, status == EFAULT, later);
    } else if (status != 0 && !(s.error != 0 && gen != 0 && s.told_loss == gen)) {
      fail_session(s, status, device_failure(g, status), later);
    }
  }
  if (item.remaining == 0 && item.outstanding == 0) {
    for (arena::BufferHandle h : item.bound) unpin(s, h);
    if (item.on_done) {
      auto fn = std::move(item.on_done);
      // The staging block goes back to its pool once the reply has been sent.
      auto host = std::make_shared<StagingPool::Block>(std::move(item.host));
      const Bytes n = host->data() ? item.host_length : 0;
      later.push_back([fn, status, host, n]() mutable {
        fn(status, std::span<const char>(host->data(), status ? 0 : n));
      });
    }
    s.completed_seq = std::max(s.completed_seq, item.seq);
    // The finished item is the oldest: pop it from whichever deque holds it.
    if (!s.dispatched.empty() && &s.dispatched.front() == &item)
      s.dispatched.pop_front();
    else if (!s.queue.empty() && &s.queue.front() == &item)
      s.queue.pop_front();
  }
  if (Session* again = get(id)) {
    // A write may be waiting for memory this item just released.
    if (!again->writes.empty() && !again->writes.front().syncing) resume_writes(*again, later);
    check_waiters(*again, later);
    maybe_start_transfer(*again);
    update_runnable(g, *again);
    maybe_finalize(*again, later);
  }
}

// ---------------------------------------------------------------- shutdown

void Broker::prepare_to_stop() {
  std::lock_guard lk(mu_);
  for (auto& g : gpus_) {
    g->sched.residency().set_quanta(false);
    kick(*g);
  }
}

void Broker::shutdown(std::chrono::milliseconds bound) {
  stopping_ = true;
  {
    std::lock_guard lk(mu_);
    if (stopped_) return;
  }
  // Let running iterations finish, up to the bound: nothing new is dispatched
  // because every queued item is dropped first.
  std::vector<SessionId> ids;
  {
    std::lock_guard lk(mu_);
    for (auto& [id, s] : sessions_) ids.push_back(id);
  }
  for (SessionId id : ids) end_session(id);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  for (;;) {
    {
      std::lock_guard lk(mu_);
      if (sessions_.empty()) break;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      spdlog::warn("shutdown: iterations still running after {} ms; stopping anyway",
                   bound.count());
      // Destroying the streams below waits for their work: cut it short.
      for (auto& g : gpus_) g->device->abort_work();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Transfers were cancelled with their sessions; wait for their chunks in
  // flight (their completions take the broker lock, so not under it).
  for (auto& g : gpus_) g->transfers->stop();
  stop_gate_service();
  for (auto& g : gpus_) stop_backer(*g);  // a job under way ends first
  for (auto& g : gpus_) {
    {
      std::lock_guard lk(g->cq_mu);
      g->stop = true;
    }
    g->cq_cv.notify_one();
    if (g->worker.joinable()) g->worker.join();
  }
  std::unique_lock lk(mu_);
  for (auto& g : gpus_) {
    for (auto& [id, lane] : g->lanes) g->device->destroy_stream(lane.stream);
    if (g->move_stream) g->device->destroy_stream(*g->move_stream);
    g->move_stream.reset();
    g->lanes.clear();
  }
  stopped_ = true;
  lk.unlock();
  // Jobs stuck in a caller's filesystem are abandoned, never waited for.
  caller_io_->close();
}

}  // namespace salus::vgpu
