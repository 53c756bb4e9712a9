// Oversubscription, the broker's side: swapping hosted sessions' persistent buffers
// between the GPU and host memory at iteration boundaries, as the residency planner
// (sched/residency.hpp) decides. The copies run on a per-GPU swap stream, like
// compaction's moves, and are started and finished by the GPU's worker, never on a
// FUSE thread. Device memory is freed only once its copy is safe on the host.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

bool Broker::swappable(const Session& s) const {
  if (s.dead || s.swapping) return false;
  // Attached programs own their memory in their own CUDA context: salusd can move it
  // only through the gate (issue 15, attach-swap). Until that path is wired here they
  // stay resident, counted in the resident set like any other session.
  if (s.gate) return false;
  return true;
}

int Broker::swap_out(Gpu& g, Session& s) {
  if (s.gate) return ENOTSUP;  // attach-swap: call the gate's swap-out request here
  return hosted_swap_out(g, s);
}

int Broker::swap_in(Gpu& g, Session& s) {
  if (s.gate) return ENOTSUP;  // attach-swap: call the gate's swap-in request here
  return hosted_swap_in(g, s);
}

void Broker::want_resident(Gpu& g, Session& s) {
  s.wants_resident = true;
  kick(g);
}

// Copies every buffer of an idle resident session to host memory. 0, EBUSY (not at a
// boundary yet: work, a transfer or a compaction of its own is in flight), or ENOMEM
// (past the host limit, or no host memory): the session then stays resident.
int Broker::hosted_swap_out(Gpu& g, Session& s) {
  if (s.in_flight > 0 || !s.dispatched.empty() || s.moving || s.transferring || s.swapping)
    return EBUSY;
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> bufs;
  if (!ar.begin_swap_out(s.id, bufs)) return EBUSY;
  Bytes total = 0;
  for (const arena::SwapBuffer& b : bufs) total += b.size;
  if (g.host_swapped + total > config_.swap_host_limit) {
    ar.cancel_swap_out(s.id);
    log(s, fmt::format("swap out: {} would pass the host limit ({} of {} in use); stays resident",
                       arena::format_size(total), arena::format_size(g.host_swapped),
                       arena::format_size(config_.swap_host_limit)));
    return ENOMEM;
  }
  Gpu::SwapJob job;
  job.session = s.id;
  job.out = true;
  job.started = now();
  job.bytes = total;
  if (!g.swap_stream) g.swap_stream = g.device->create_stream();
  for (const arena::SwapBuffer& b : bufs) {
    StagingPool::Block block = g.staging->acquire(b.size);
    if (!block) {
      ar.cancel_swap_out(s.id);  // nothing was queued yet that the blocks outlive
      log(s, fmt::format("swap out: no host memory for {}; stays resident",
                         arena::format_size(b.size)));
      return ENOMEM;
    }
    job.blocks.emplace_back(b.buffer, std::move(block));
  }
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    pin(s, bufs[i].buffer);  // a free meanwhile waits for the copy
    g.device->copy_to_staging(*g.swap_stream, job.blocks[i].second.data(), bufs[i].offset,
                              bufs[i].size);
  }
  g.host_swapped += total;
  s.swapping = true;
  g.sched.residency().swap_started(s.id);
  const std::uint64_t token = next_token_++;
  g.swap_jobs.emplace(token, std::move(job));
  g.device->notify(*g.swap_stream, token);
  return 0;
}

// Places a swapped session's buffers again and copies their bytes back. 0, or EAGAIN
// when the resident set has no room yet (compaction may have been planned).
int Broker::hosted_swap_in(Gpu& g, Session& s) {
  if (s.swapping) return EBUSY;
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> placed;
  const arena::ArenaError e = ar.swap_in(s.id, placed);
  if (e == arena::ArenaError::fragmented) kick(g);
  if (e != arena::ArenaError::ok) return EAGAIN;
  Gpu::SwapJob job;
  job.session = s.id;
  job.out = false;
  job.started = now();
  if (!g.swap_stream) g.swap_stream = g.device->create_stream();
  for (const arena::SwapBuffer& b : placed) {
    auto it = s.host_copies.find(b.buffer);
    if (it == s.host_copies.end()) {
      // Never copied out (it cannot happen: every buffer of a swapped session was);
      // reading as zero is what a fresh buffer does, never another session's bytes.
      g.device->discard(b.offset, b.size);
      continue;
    }
    pin(s, b.buffer);
    g.device->copy_from_staging(*g.swap_stream, b.offset, it->second.data(), b.size);
    job.bytes += b.size;
    job.blocks.emplace_back(b.buffer, std::move(it->second));
    s.host_copies.erase(it);
  }
  // Copies of buffers freed while it was out are dropped with their blocks.
  s.host_copies.clear();
  g.host_swapped -= std::min(g.host_swapped, s.host_bytes);
  s.host_bytes = 0;
  s.swapping = true;
  g.sched.residency().swap_started(s.id);
  const std::uint64_t token = next_token_++;
  g.swap_jobs.emplace(token, std::move(job));
  g.device->notify(*g.swap_stream, token);
  return 0;
}

void Broker::finish_swap(Gpu& g, const Completion& c, Deferred& later) {
  auto it = g.swap_jobs.find(c.token);
  if (it == g.swap_jobs.end()) return;
  Gpu::SwapJob job = std::move(it->second);
  g.swap_jobs.erase(it);
  arena::GpuArena& ar = g.sched.arena();
  const TimeNs t = now();
  const TimeNs took = std::max<TimeNs>(t - job.started, 1);
  Session* s = get(job.session);
  if (job.out) {
    const bool ok = c.status == 0;
    if (ok && s) {
      ar.finish_swap_out(s->id, t);  // the device copy is safe: its ranges go
      for (auto& [h, block] : job.blocks) s->host_copies.emplace(h, std::move(block));
      s->host_bytes = job.bytes;
    } else {
      ar.cancel_swap_out(job.session);  // still all there on the device
      g.host_swapped -= std::min(g.host_swapped, job.bytes);
      if (s)
        log(*s, fmt::format("swap out failed ({}); stays resident", strerrorname_np(c.status)));
    }
    g.sched.residency().swap_out_done(job.session, job.bytes, took, t, ok && s);
  } else {
    g.sched.residency().swap_in_done(job.session, job.bytes, took, t);
    if (s && c.status != 0)
      fail_session(*s, c.status ? c.status : EIO,
                   "swap in: copying its buffers back to the GPU failed", later);
  }
  if (s) {
    for (const auto& [h, block] : job.blocks) unpin(*s, h);
    s->swapping = false;
    if (!job.out) {
      s->wants_resident = false;
      if (!s->writes.empty() && !s->writes.front().syncing) resume_writes(*s, later);
      maybe_start_transfer(*s);
    }
    update_runnable(g, *s);
    maybe_finalize(*s, later);
  }
  handle_admissions(g, later);
}

// Once per dispatch pass: start the swap-outs of victims that reached a boundary,
// then ask the planner what to do for the sessions waiting to be resident.
void Broker::drive_residency(Gpu& g, Deferred& later) {
  (void)later;
  if (!g.sched.oversubscribed()) return;
  sched::ResidencyPlanner& rp = g.sched.residency();
  arena::GpuArena& ar = g.sched.arena();
  for (auto& [id, sp] : sessions_) {
    Session& s = *sp;
    if (s.gpu != static_cast<int>(g.index)) continue;
    if (rp.evicting(id) && !s.swapping) {
      const int err = swap_out(g, s);
      if (err != 0 && err != EBUSY) rp.swap_out_done(id, 0, 0, now(), false);
    }
    if (s.wants_resident && ar.residency(id) == arena::Residency::swapped && !s.dead)
      g.sched.want_resident(id);
  }
  const sched::ResidencyPlan plan = g.sched.plan_residency(
      [this](SessionId id) {
        const Session* s = get(id);
        return s && swappable(*s);
      },
      now());
  for (SessionId v : plan.swap_out) {
    Session* s = get(v);
    if (!s) continue;
    const int err = swap_out(g, *s);
    if (err != 0 && err != EBUSY) rp.swap_out_done(v, 0, 0, now(), false);
    update_runnable(g, *s);
  }
  if (plan.swap_in) {
    Session* s = get(*plan.swap_in);
    if (s) {
      const int err = swap_in(g, *s);
      if (err == 0 && !s->swapping) update_runnable(g, *s);
    }
  }
}

void Broker::render_residency(const Session& s, std::string& out) const {
  const Session* sp = &s;
  auto git = std::find_if(gpus_.begin(), gpus_.end(),
                          [&](const auto& g) { return static_cast<int>(g->index) == sp->gpu; });
  if (git == gpus_.end() || s.state == SessionState::idle) return;
  const Gpu& g = **git;
  const arena::Residency r = g.sched.arena().residency(s.id);
  const char* word = r == arena::Residency::resident
                         ? (s.swapping ? "swapping_in" : "resident")
                         : (r == arena::Residency::swapping_out ? "swapping_out" : "swapped");
  out += fmt::format("residency: {}\n", word);
  const sched::SessionResidency* sr = g.sched.residency().find(s.id);
  if (!sr) return;
  const arena::Bytes bytes = g.sched.arena().swap_in_bytes(s.id);
  out += fmt::format("swaps_out: {}\nswaps_in: {}\nswap_ms: {:.3f}\nresident_quantum_ms: {:.1f}\n",
                     sr->stats.swaps_out, sr->stats.swaps_in,
                     static_cast<double>(sr->stats.swap_ns) / 1e6,
                     static_cast<double>(g.sched.residency().cost().quantum_ns(bytes)) / 1e6);
}

}  // namespace salus::vgpu
