// Oversubscription, the broker's side: swapping hosted sessions' persistent buffers
// between the GPU and host memory (or the spill file) at iteration boundaries, as the
// residency planner (sched/residency.hpp) decides, and asking attached programs to
// move theirs through the gate. The copies run on a per-GPU swap stream, like
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
  // Attached programs own their memory in their own CUDA context: salusd moves it
  // only through the gate, and only while the program can answer and has not said
  // its memory is not movable.
  if (s.gate) return !s.gate->exited && !s.gate->unswappable && !s.gate->swap_pending;
  return true;
}

int Broker::swap_out(Gpu& g, Session& s) {
  if (s.gate) return attached_swap_out(g, s);
  return hosted_swap_out(g, s);
}

int Broker::swap_in(Gpu& g, Session& s) {
  if (s.gate) return attached_swap_in(g, s);
  return hosted_swap_in(g, s);
}

// An attached victim: the arena keeps its ranges (swapping_out) until the program
// answers; attached_swap_done frees them only on success. EBUSY while an iteration
// or another request is in flight (asked again at the next pass).
int Broker::attached_swap_out(Gpu& g, Session& s) {
  AttachedGate& gt = *s.gate;
  if (gt.unswappable) return ENOTSUP;
  if (gt.exited) return ENOTCONN;
  if (gt.swap_pending || s.swapping) return EBUSY;
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> bufs;
  if (!ar.begin_swap_out(s.id, bufs)) return EBUSY;
  const int err = request_attached_swap(s, true);
  if (err == EALREADY) {  // already out (an admin swap): only the bookkeeping is left
    learn_unswappable(g, s);
    ar.finish_swap_out(s.id, now());
    g.sched.residency().swap_started(s.id, now());
    g.sched.residency().swap_out_done(s.id, 0, 1, now(), true);
    return 0;
  }
  if (err != 0) {
    ar.cancel_swap_out(s.id);
    return err;
  }
  gt.swap_for_residency = true;
  s.swapping = true;
  g.sched.residency().swap_started(s.id, now());
  return 0;
}

// What an attached program leaves on the GPU when it is swapped out: its context
// (the reserve) and what its shim reported it cannot move (pool allocations,
// its own cuMemCreate handles, promoted lane granules). The program writes that
// figure; the arena caps it at the session's P, so a lie costs only its own room.
// What the driver showed left on the card at an earlier swap-out counts too.
void Broker::learn_unswappable(Gpu& g, Session& s) {
  const std::uint64_t reported = gate_load(s.gate->g().unswappable_bytes);
  const Bytes cap = arena::Bytes{1} << 60;  // no overflow below, whatever was written
  const Bytes said = context_of(s) + std::min<std::uint64_t>(reported, cap);
  g.sched.arena().set_unswappable(s.id, std::max<Bytes>(said, s.gate->leftover_floor));
}

// The shim's report of what it cannot move is the program's word (a hostile or
// buggy one may keep memory on the card while others are let into its room). Once
// it has been out for a whole check (NVML's sample may predate the swap-out), the
// driver's figure is held against its counted part plus the context it showed
// beyond the reserve while on the card; past that at two checks in a row, the
// arena counts what the driver shows, as far as P and the card's room go, so that
// nothing more is let in, and later swap-outs count it too.
void Broker::check_swapped_program(Gpu& g, Session& s, std::optional<Bytes> used) {
  AttachedGate& gt = *s.gate;
  gt.context_over = 0;
  if (++gt.swapped_checks < 2 || !used) return;
  arena::GpuArena& ar = g.sched.arena();
  const Bytes counted = ar.on_card_bytes(s.id);
  const Bytes reserve = context_of(s);
  const Bytes context_beyond = gt.context_seen > reserve ? gt.context_seen - reserve : 0;
  if (*used <= counted + context_beyond + kDriverFigureSlack) {
    gt.leftover_over = 0;
    return;
  }
  if (++gt.leftover_over < 2) return;
  if (kill_overrun(s, *used, counted)) return;
  const Bytes shown = *used - context_beyond;
  gt.leftover_floor = std::max<Bytes>(gt.leftover_floor, shown);
  const Bytes now_counted = ar.raise_unswappable(s.id, shown);
  if (now_counted == counted && gt.leftover_warned) return;  // nothing new to say
  gt.leftover_warned = true;
  std::string text = fmt::format(
      "warning: swapped out, pid {} still holds {} on gpu {} by the driver's count, past "
      "the {} counted for its context and the {} its shim reported it cannot move: "
      "admission now counts {} of it on the card",
      gt.pid, arena::format_size(*used), s.gpu, arena::format_size(reserve + context_beyond),
      arena::format_size(gate_load(gt.g().unswappable_bytes)), arena::format_size(now_counted));
  if (shown > now_counted)
    text += fmt::format(
        " ({} more is past its need or the card's room: programs on gpu {} "
        "may run out of memory until a session leaves)",
        arena::format_size(shown - now_counted), s.gpu);
  log(s, text);
  spdlog::warn("session {}: {}", s.id, text);
}

// Prefetch of an attached session before its grant: room is taken in the arena
// first (EAGAIN without it), then the program is asked to bring its memory back;
// it is not granted until the answer (s.swapping holds it back).
int Broker::attached_swap_in(Gpu& g, Session& s) {
  AttachedGate& gt = *s.gate;
  if (gt.exited) return ENOTCONN;
  if (gt.swap_pending || s.swapping) return EBUSY;
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> placed;
  const arena::ArenaError e = ar.swap_in(s.id, placed);
  if (e == arena::ArenaError::fragmented) kick(g);
  if (e != arena::ArenaError::ok) return EAGAIN;
  g.sched.residency().swap_started(s.id, now());
  const int err = request_attached_swap(s, false);
  if (err != 0) {
    // EALREADY: its memory is back already (a grant brought it); anything else:
    // the grant will bring it back (the shim never runs without its memory).
    g.sched.residency().swap_in_done(s.id, 0, 1, now());
    s.wants_resident = false;
    update_runnable(g, s);
    return 0;
  }
  gt.swap_for_residency = true;
  s.swapping = true;
  return 0;
}

// The residency side of an attached program's answer (from attached_swap_done).
void Broker::attached_residency_done(Gpu& g, Session& s) {
  AttachedGate& gt = *s.gate;
  salus_gate& G = gt.g();
  gt.swap_for_residency = false;
  s.swapping = false;
  arena::GpuArena& ar = g.sched.arena();
  const TimeNs t = now();
  const TimeNs took = std::max<TimeNs>(t - gt.swap_asked_at, 1);
  // The program's figures: never more than its budget, and the GPU's bandwidth
  // estimate moves at most 2x on them (sched::SwapSource).
  const Bytes budget = s.need.persistent + s.need.ephemeral;
  const Bytes moved = std::min<Bytes>(gate_load(G.swapped_bytes), budget);
  if (gt.swap_request == SALUS_SWAP_REQ_OUT) {
    const bool ok = gt.swap_error == 0;
    if (ok) {
      learn_unswappable(g, s);
      ar.finish_swap_out(s.id, t);  // the program's memory is off the GPU: room is free
    } else {
      ar.cancel_swap_out(s.id);
    }
    if (gt.swap_error == ENOTSUP && !gt.unswappable) {
      gt.unswappable = true;
      log(s, "not movable: counted resident from now on and never asked to swap again");
    }
    g.sched.residency().swap_out_done(s.id, moved, took, t, ok, sched::SwapSource::reported);
  } else {
    g.sched.residency().swap_in_done(s.id, std::min<Bytes>(gate_load(G.resident_bytes), budget),
                                     took, t, sched::SwapSource::reported);
    s.wants_resident = false;
  }
  update_runnable(g, s);
  // Never finalizes `s` here: its callers go on using it. A session ended during
  // the swap is finalized by end_session, after detach_gate has come here.
}

void Broker::want_resident(Gpu& g, Session& s) {
  s.wants_resident = true;
  kick(g);
}

// Copies every buffer of an idle resident session to host memory, or, past the host
// limit, through host memory to the spill file. 0, EBUSY (not at a boundary yet:
// work, a transfer or a compaction of its own is in flight), or ENOMEM (past the
// host limit with no spill file, or no host memory): the session then stays resident.
int Broker::hosted_swap_out(Gpu& g, Session& s) {
  if (s.in_flight > 0 || !s.dispatched.empty() || s.moving || s.transferring || s.swapping)
    return EBUSY;
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> bufs;
  if (!ar.begin_swap_out(s.id, bufs)) return EBUSY;
  Bytes total = 0;
  for (const arena::SwapBuffer& b : bufs) total += b.size;
  const bool spill = g.host_swapped + total > config_.swap_host_limit;
  if (spill && (!g.spill || now() < s.spill_retry_at)) {
    ar.cancel_swap_out(s.id);
    log(s, fmt::format("swap out: {} would pass the host limit ({} of {} in use) and {}; stays "
                       "resident",
                       arena::format_size(total), arena::format_size(g.host_swapped),
                       arena::format_size(config_.swap_host_limit),
                       g.spill ? "the spill file failed a moment ago" : "there is no spill file"));
    return ENOMEM;
  }
  Gpu::SwapJob job;
  job.session = s.id;
  job.out = true;
  job.started = now();
  job.bytes = total;
  job.spill = spill;
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
    job.sizes.push_back(b.size);
  }
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    pin(s, bufs[i].buffer);  // a free meanwhile waits for the copy
    g.device->copy_to_staging(*g.swap_stream, job.blocks[i].second.data(), bufs[i].offset,
                              bufs[i].size);
  }
  // A spilled swap's blocks are transient: the file holds the bytes, not the host.
  if (spill)
    job.spill_off = g.spill->reserve(total);
  else
    g.host_swapped += total;
  s.swapping = true;
  g.sched.residency().swap_started(s.id, now());
  const std::uint64_t token = next_token_++;
  g.swap_jobs.emplace(token, std::move(job));
  g.device->notify(*g.swap_stream, token);
  return 0;
}

// Places a swapped session's buffers again and copies their bytes back. 0, or EAGAIN
// when the resident set has no room yet (compaction may have been planned).
int Broker::hosted_swap_in(Gpu& g, Session& s) {
  if (s.swapping) return EBUSY;
  if (s.spill_bytes) return spill_swap_in(g, s);
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> placed;
  const arena::ArenaError e = ar.swap_in(s.id, placed);
  if (e == arena::ArenaError::fragmented) kick(g);
  if (e != arena::ArenaError::ok) return EAGAIN;
  if (!backing_ready(g)) return undo_swap_in(g, s);
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
  g.sched.residency().swap_started(s.id, now());
  const std::uint64_t token = next_token_++;
  g.swap_jobs.emplace(token, std::move(job));
  g.device->notify(*g.swap_stream, token);
  return 0;
}

// The placed session had no card memory behind its ranges (backing_ready): it
// goes back to swapped at once, its copies untouched, and the planner tries
// again on a later pass.
int Broker::undo_swap_in(Gpu& g, Session& s) {
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> ranges;
  if (ar.begin_swap_out(s.id, ranges)) {
    ar.finish_swap_out(s.id, now());
  } else {
    // Cannot happen right after a placement (nothing of it runs or moves yet).
    spdlog::error("gpu{}: session {} placed for a swap-in that cannot be backed nor undone",
                  g.index, s.id);
  }
  return EAGAIN;
}

// Swap-in of a spilled session: staging blocks first (EAGAIN without them, nothing
// changed), then its buffers are placed and the spill thread reads the file into
// the blocks; the copy to the device starts when that read completes (finish_swap).
int Broker::spill_swap_in(Gpu& g, Session& s) {
  std::unordered_map<arena::BufferHandle, StagingPool::Block> blocks;
  for (const auto& [h, ext] : s.spilled) {
    StagingPool::Block b = g.staging->acquire(ext.second);
    if (!b) return EAGAIN;
    blocks.emplace(h, std::move(b));
  }
  arena::GpuArena& ar = g.sched.arena();
  std::vector<arena::SwapBuffer> placed;
  const arena::ArenaError e = ar.swap_in(s.id, placed);
  if (e == arena::ArenaError::fragmented) kick(g);
  if (e != arena::ArenaError::ok) return EAGAIN;
  if (!backing_ready(g)) return undo_swap_in(g, s);
  Gpu::SwapJob job;
  job.session = s.id;
  job.out = false;
  job.started = now();
  job.spill = true;
  job.stage = 1;
  if (!g.swap_stream) g.swap_stream = g.device->create_stream();
  for (const arena::SwapBuffer& b : placed) {
    auto it = blocks.find(b.buffer);
    if (it == blocks.end()) {
      g.device->discard(b.offset, b.size);  // as in hosted_swap_in: never another's bytes
      continue;
    }
    pin(s, b.buffer);
    job.bytes += b.size;
    job.device_offsets.push_back(b.offset);
    job.sizes.push_back(b.size);
    job.blocks.emplace_back(b.buffer, std::move(it->second));
  }
  s.swapping = true;
  g.sched.residency().swap_started(s.id, now());
  const std::uint64_t token = next_token_++;
  g.swap_jobs.emplace(token, std::move(job));
  spill_io(g, token, false);
  return 0;
}

// Hands the blocks of the swap job under `token` to the spill thread: written to
// (or read from) the file at the session's extent. The answer is a completion on
// the swap stream under the same token, so finish_swap takes it on the worker.
void Broker::spill_io(Gpu& g, std::uint64_t token, bool write) {
  Gpu::SwapJob& job = g.swap_jobs.at(token);
  Session* s = get(job.session);
  std::vector<SpillFile::Piece> pieces;
  off_t off = job.spill_off;
  for (std::size_t i = 0; i < job.blocks.size(); ++i) {
    const auto& [h, block] = job.blocks[i];
    const Bytes size = job.sizes[i];
    if (write) {
      if (s) s->spilled[h] = {off, size};
    } else if (s) {
      off = s->spilled.at(h).first;
    }
    pieces.push_back(SpillFile::Piece{block.data(), static_cast<std::size_t>(size), off});
    off += static_cast<off_t>(size);
  }
  Gpu* gp = &g;
  const StreamId stream = *g.swap_stream;
  g.spill->submit(write, std::move(pieces), [gp, stream, token](int err) {
    {
      std::lock_guard lk(gp->cq_mu);
      gp->completions.push_back(Completion{stream, token, err, 0});
    }
    gp->cq_cv.notify_one();
  });
}

// The end of a swap-out (its device copy, and for a spill its file write): on
// success the device ranges go; on failure everything stays on the device.
void Broker::end_swap_out(Gpu& g, Session* s, std::uint64_t token, int status, TimeNs took) {
  Gpu::SwapJob& job = g.swap_jobs.at(token);
  arena::GpuArena& ar = g.sched.arena();
  const TimeNs t = now();
  const bool ok = status == 0 && s;
  if (ok) {
    ar.finish_swap_out(s->id, t);  // the copy is safe: the ranges go
    if (job.spill) {
      s->spill_off = job.spill_off;
      s->spill_bytes = job.bytes;
    } else {
      for (auto& [h, block] : job.blocks) s->host_copies.emplace(h, std::move(block));
      s->host_bytes = job.bytes;
    }
    s->swap_error = 0;
  } else {
    ar.cancel_swap_out(job.session);  // still all there on the device
    if (job.spill) {
      g.spill->release(job.spill_off, job.bytes);
    } else {
      g.host_swapped -= std::min(g.host_swapped, job.bytes);
    }
    if (s) {
      s->spilled.clear();
      s->swap_error = status ? status : EIO;
      if (job.spill) s->spill_retry_at = t + 1'000'000'000;  // no retry storm on a full disk
      log(*s, fmt::format("swap out failed: {} ({}){}; stays resident",
                          strerrorname_np(s->swap_error), std::strerror(s->swap_error),
                          job.spill ? fmt::format(" writing the spill file in {}", g.spill->dir())
                                    : std::string()));
    }
  }
  g.sched.residency().swap_out_done(job.session, job.bytes, took, t, ok);
}

void Broker::finish_swap(Gpu& g, const Completion& c, Deferred& later) {
  auto it = g.swap_jobs.find(c.token);
  if (it == g.swap_jobs.end()) return;
  Gpu::SwapJob& j = it->second;
  Session* s = get(j.session);
  // A spill continues: the device copy out is followed by the file write; the file
  // read in by the copy back to the device (under a fresh token).
  if (j.spill && c.status == 0 && s && ((j.out && j.stage == 0) || (!j.out && j.stage == 1))) {
    const bool out = j.out;
    ++j.stage;
    if (out) {
      spill_io(g, c.token, true);
      return;
    }
    for (std::size_t i = 0; i < j.blocks.size(); ++i)
      g.device->copy_from_staging(*g.swap_stream, j.device_offsets[i], j.blocks[i].second.data(),
                                  j.sizes[i]);
    g.spill->release(s->spill_off, s->spill_bytes);  // the bytes are in the blocks now
    s->spilled.clear();
    s->spill_bytes = 0;
    const std::uint64_t token = next_token_++;
    g.swap_jobs.emplace(token, std::move(j));
    g.swap_jobs.erase(c.token);
    g.device->notify(*g.swap_stream, token);
    return;
  }
  const TimeNs took = std::max<TimeNs>(now() - j.started, 1);
  if (j.out) end_swap_out(g, s, c.token, c.status, took);
  Gpu::SwapJob job = std::move(j);
  g.swap_jobs.erase(it);
  if (!job.out) {
    g.sched.residency().swap_in_done(job.session, job.bytes, took, now());
    if (s && c.status != 0)
      fail_session(*s, c.status ? c.status : EIO,
                   job.stage == 1 ? "swap in: reading its spilled bytes back failed"
                                  : "swap in: copying its buffers back to the GPU failed",
                   later);
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
    say_if_swap_stuck(g, s);
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

// A session chosen to swap out (or asked back) that has not moved in the planner's
// stuck_after: the planner now goes on around it (ResidencyPlanner::plan). Said once
// per step in its log and salusd's, since a program that does not come to its
// boundary is often an idle notebook or a hung job.
void Broker::say_if_swap_stuck(Gpu& g, Session& s) {
  const sched::ResidencyPlanner& rp = g.sched.residency();
  const sched::SessionResidency* r = rp.find(s.id);
  if (!r || !(r->evicting || r->swapping) || s.swap_stuck_said == r->step_since) return;
  if (now() - r->step_since < rp.stuck_after()) return;
  s.swap_stuck_said = r->step_since;
  const std::string text = fmt::format(
      "{} {:.0f} s ago and still waiting for its iteration boundary; swapping other "
      "sessions meanwhile",
      r->evicting ? "chosen to swap out" : "asked to swap back in",
      static_cast<double>(now() - r->step_since) / 1e9);
  log(s, text);
  spdlog::warn("gpu {}: session {}: {}", g.index, s.id, text);
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
  out += fmt::format("residency: {}\nmemory_spilled: {}\nswap_error: {}\n", word, s.spill_bytes,
                     s.swap_error ? strerrorname_np(s.swap_error) : "-");
  const sched::SessionResidency* sr = g.sched.residency().find(s.id);
  if (!sr) return;
  const arena::Bytes bytes = g.sched.arena().swap_in_bytes(s.id);
  out += fmt::format("swaps_out: {}\nswaps_in: {}\nswap_ms: {:.3f}\nresident_quantum_ms: {:.1f}\n",
                     sr->stats.swaps_out, sr->stats.swaps_in,
                     static_cast<double>(sr->stats.swap_ns) / 1e6,
                     static_cast<double>(g.sched.residency().cost().quantum_ns(bytes)) / 1e6);
}

}  // namespace salus::vgpu
