// upload and download: validated under the broker lock when their line runs,
// queued with the session's other work, and moved by the GPU's transfer engine
// once everything before them has completed.
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {

const std::shared_ptr<const Iteration>& no_ops() {
  static const std::shared_ptr<const Iteration> it = [] {
    auto i = std::make_shared<Iteration>();
    i->counts = false;
    return i;
  }();
  return it;
}

std::string ref(const BufRef& r) {
  return r.offset ? fmt::format("{}+{}", r.name, r.offset) : r.name;
}

}  // namespace

int Broker::exec_transfer(Session& s, const TransferCmd& c, PendingWrite& w, std::uint32_t ln) {
  const bool up = c.direction == TransferCmd::Direction::upload;
  const char* verb = up ? "upload" : "download";
  auto fail = [&](int err, std::string msg) {
    log(s, fmt::format("line {}: {} {}: {}", ln, verb, c.buffer.name, msg));
    return err;
  };
  if (s.recording)
    return fail(EINVAL, "not allowed inside begin/end: transfers run between iterations, in order");
  const auto n = s.names.find(c.buffer.name);
  if (n == s.names.end()) return fail(ENOENT, fmt::format("unknown buffer '{}'", c.buffer.name));
  const Buffer& b = s.buffers.at(n->second);
  if (c.buffer.offset > b.size || c.length > b.size - c.buffer.offset)
    return fail(ERANGE, fmt::format("range +{} len {} is outside buffer {} ({} bytes)",
                                    c.buffer.offset, c.length, b.name, b.size));
  auto ep = w.transfer_endpoints.find(w.next);
  if (ep == w.transfer_endpoints.end()) return fail(EIO, "internal: the endpoint was not opened");
  if (ep->second.error) return fail(ep->second.error, ep->second.why);
  UidUsage& u = usage_[s.uid];
  if (u.transfers >= config_.quotas.transfers_per_uid) {
    ++stats_.quota_rejections;
    return fail(EDQUOT, fmt::format("uid {} has {} transfers queued or running, the quota", s.uid,
                                    u.transfers));
  }
  auto job = std::make_shared<TransferJob>();
  job->upload = up;
  job->file = std::move(ep->second.file);
  job->who = w.creds;
  job->shown = ep->second.shown;
  job->file_offset = c.source_offset;
  job->device_offset = c.buffer.offset;  // the buffer's own offset is added at the start
  job->length = c.length;
  job->shm = c.endpoint == TransferCmd::Endpoint::shm;
  job->session = s.id;
  w.transfer_endpoints.erase(ep);

  WorkItem item;
  item.iter = no_ops();
  item.bound = {b.handle};
  pin(s, b.handle);
  item.transfer = std::move(job);
  item.what =
      fmt::format("line {}: {} {} {}{} {}", ln, verb, ref(c.buffer), item.transfer->shown,
                  c.source_offset ? fmt::format("+{}", c.source_offset) : std::string(), c.length);
  ++u.transfers;
  enqueue(s, std::move(item));
  maybe_start_transfer(s);
  return 0;
}

void Broker::maybe_start_transfer(Session& s) {
  if (s.dead || s.transferring || stopping_ || s.queue.empty() || !s.queue.front().transfer) return;
  // Everything before it must have completed: strict order with the session's
  // other work, and the buffer cannot move while the engine copies into it.
  if (s.in_flight > 0 || !s.dispatched.empty() || s.moving || s.state != SessionState::admitted)
    return;
  Gpu* g = gpu_of(s);
  if (!g || s.swapping || g->sched.residency().evicting(s.id)) return;
  if (g->sched.arena().residency(s.id) != arena::Residency::resident) {
    want_resident(*g, s);  // oversubscribed: the buffer comes back first
    return;
  }
  WorkItem& item = s.queue.front();
  std::shared_ptr<TransferJob> job = item.transfer;
  job->device_offset += g->sched.arena().buffer_offset(item.bound.at(0));
  job->done = [this, id = s.id, seq = item.seq](TransferResult r) {
    transfer_finished(id, seq, std::move(r));
  };
  item.remaining = 0;
  item.outstanding = 1;
  s.transferring = true;
  s.dispatched.push_back(std::move(item));
  s.queue.pop_front();
  update_runnable(*g, s);
  g->transfers->submit(std::move(job));
}

void Broker::cancel_transfer(Session& s) {
  if (!s.transferring) return;
  Gpu* g = gpu_of(s);
  for (WorkItem& item : s.dispatched)
    if (item.transfer && g) g->transfers->cancel(item.transfer);
}

void Broker::transfer_finished(SessionId id, std::uint64_t seq, TransferResult r) {
  Deferred later;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s) return;
    s->transferring = false;
    std::string what = "transfer";
    bool up = true;
    for (auto it = s->dispatched.begin(); it != s->dispatched.end(); ++it) {
      if (it->seq != seq || !it->transfer) continue;
      what = std::move(it->what);
      up = it->transfer->upload;
      for (arena::BufferHandle h : it->bound) unpin(*s, h);
      s->completed_seq = std::max(s->completed_seq, it->seq);
      s->dispatched.erase(it);
      break;
    }
    UidUsage& u = usage_[s->uid];
    if (u.transfers > 0) --u.transfers;
    s->gpu_ns += r.device_ns;
    (up ? stats_.bytes_from_host : stats_.bytes_to_host) += r.bytes;
    if (r.error == 0) {
      const double secs = static_cast<double>(std::max<std::int64_t>(r.elapsed_ns, 1)) / 1e9;
      log(*s,
          fmt::format("{}: done, {} in {:.1f} ms ({:.2f} GB/s)", what, arena::format_size(r.bytes),
                      secs * 1e3, static_cast<double>(r.bytes) / secs / 1e9));
    } else if (!s->dead) {
      fail_session(*s, r.error, fmt::format("{}: {}", what, r.why), later);
    }
    Gpu* g = gpu_of(*s);
    if (!s->writes.empty() && !s->writes.front().syncing) resume_writes(*s, later);
    check_waiters(*s, later);
    maybe_start_transfer(*s);
    if (g) {
      update_runnable(*g, *s);
      kick(*g);
    }
    maybe_finalize(*s, later);  // `s` may be gone after this
  }
  run_deferred(later);
}

}  // namespace salus::vgpu
