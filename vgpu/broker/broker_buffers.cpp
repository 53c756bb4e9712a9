// Buffers as files (mem/NAME): listing, create, resize, remove, and reads and
// writes ordered after the session's earlier work.
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

std::vector<Broker::BufferView> Broker::list_buffers(SessionId id) const {
  std::lock_guard lk(mu_);
  std::vector<BufferView> out;
  const Session* s = get(id);
  if (!s || s->dead) return out;
  out.reserve(s->names.size());
  for (const auto& [name, bid] : s->names) out.push_back({bid, name, s->buffers.at(bid).size});
  return out;
}

std::optional<Broker::BufferView> Broker::find_buffer(SessionId id, const std::string& name) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  if (!s || s->dead) return std::nullopt;
  auto it = s->names.find(name);
  if (it == s->names.end()) return std::nullopt;
  return BufferView{it->second, name, s->buffers.at(it->second).size};
}

std::optional<Broker::BufferView> Broker::buffer_by_id(SessionId id, std::uint32_t bid) const {
  std::lock_guard lk(mu_);
  const Session* s = get(id);
  if (!s || s->dead) return std::nullopt;
  auto it = s->buffers.find(bid);
  if (it == s->buffers.end()) return std::nullopt;
  return BufferView{bid, it->second.name, it->second.size};
}

int Broker::create_buffer(SessionId id, const Caller& caller, const std::string& name) {
  std::lock_guard lk(mu_);
  Session* s = get(id);
  if (!s || s->dead) return -ENOENT;
  if (caller.uid != s->uid && !caller.admin) return -EACCES;
  if (!is_valid_name(name)) {
    log(*s, fmt::format("mem/{}: invalid buffer name (use 1-64 of [A-Za-z0-9_.-])", name));
    return -EINVAL;
  }
  if (s->state == SessionState::failed) {
    log(*s, fmt::format("mem/{}: the session failed earlier ({}); write `reset` to continue", name,
                        s->error_text));
    return -EIO;
  }
  if (s->state != SessionState::admitted) {
    if (s->state == SessionState::queued) {
      log(*s, fmt::format("mem/{}: the session is still queued for admission", name));
      return -EAGAIN;
    }
    log(*s, fmt::format("mem/{}: {}", name, kNoGpuYet));
    return -ENXIO;
  }
  if (s->names.count(name)) return -EEXIST;
  UidUsage& u = usage_[s->uid];
  if (u.buffers >= config_.quotas.buffers_per_uid) {
    ++stats_.quota_rejections;
    log(*s, fmt::format("mem/{}: uid {} holds {} buffers, the quota", name, s->uid, u.buffers));
    return -EDQUOT;
  }
  Buffer b;
  b.id = s->next_buffer_id++;
  b.name = name;
  s->names[name] = b.id;
  s->buffers[b.id] = std::move(b);
  ++u.buffers;
  return static_cast<int>(s->names[name]);
}

int Broker::remove_buffer(SessionId id, const Caller& caller, const std::string& name) {
  Deferred later;
  int err = 0;
  {
    std::lock_guard lk(mu_);
    Session* s = get(id);
    if (!s || s->dead) return ENOENT;
    if (caller.uid != s->uid && !caller.admin) return EACCES;
    err = exec_free(*s, FreeCmd{name}, 0);
  }
  run_deferred(later);
  return err;
}

void Broker::resize_buffer(SessionId id, const Caller& caller, std::uint32_t bid, Bytes size,
                           std::function<void(int err)> done) {
  Deferred later;
  {
    std::lock_guard lk(mu_);
    resize_locked(id, caller, bid, size, std::move(done), later);
  }
  run_deferred(later);
}

// Under the broker lock; `done` is called after it (through `later`), or when
// the kept prefix has been copied.
void Broker::resize_locked(SessionId id, const Caller& caller, std::uint32_t bid, Bytes size,
                           std::function<void(int err)> done, Deferred& later) {
  int err = 0;
  {
    Session* s = get(id);
    auto bit = s && !s->dead ? s->buffers.find(bid) : decltype(s->buffers)::iterator{};
    if (!s || s->dead || bit == s->buffers.end()) {
      err = ENOENT;
    } else if (caller.uid != s->uid && !caller.admin) {
      err = EACCES;
    } else if (bit->second.size == size) {
      err = 0;
    } else if (s->state != SessionState::admitted) {
      log(*s, fmt::format("mem/{}: cannot resize: the session is {}", bit->second.name,
                          to_string(s->state)));
      err = s->error ? EIO : s->state == SessionState::queued ? EAGAIN : ENXIO;
    } else {
      Buffer& b = bit->second;
      Gpu& g = *gpu_of(*s);
      arena::BufferHandle fresh = 0;
      if (size > 0) {
        const auto r = g.sched.arena().alloc_persistent(s->id, size);
        if (r.error == arena::ArenaError::swapped_out) {
          log(*s, fmt::format("mem/{}: resize: the session is swapped out; retry shortly", b.name));
          want_resident(g, *s);
          err = EAGAIN;
        } else if (r.error != arena::ArenaError::ok) {
          log(*s, fmt::format("mem/{}: resize to {} failed: {}", b.name, size,
                              r.error == arena::ArenaError::fragmented
                                  ? "persistent memory is fragmented; retry shortly"
                                  : "persistent memory exhausted under the safety condition"));
          err = r.error == arena::ArenaError::fragmented ? EAGAIN : ENOMEM;
        } else if (const Backing state = backing_of(g, {{r.offset, arena::align_up(size)}});
                   state == Backing::pending) {
          // Mapped off the lock: tried again when that is done.
          g.sched.arena().free_persistent(r.handle);
          g.backing_waiters.push_back([this, id, caller, bid, size, done](Deferred& l) {
            resize_locked(id, caller, bid, size, done, l);
          });
          return;
        } else if (state == Backing::failed) {
          g.sched.arena().free_persistent(r.handle);
          log(*s, fmt::format("mem/{}: resize to {} failed: gpu {} has no card memory to back "
                              "it: {}",
                              b.name, size, s->gpu, g.backing_why));
          err = ENOMEM;
        } else {
          fresh = r.handle;
          g.device->discard(r.offset, arena::align_up(size));
        }
      }
      if (!err) {
        const Bytes keep = std::min(size, b.size);
        const arena::BufferHandle old = b.handle;
        const Bytes old_size = b.size;
        b.handle = fresh;
        b.size = size;
        // Fresh memory is zero (freed memory is discarded); only the kept prefix moves.
        auto it = std::make_shared<Iteration>();
        it->counts = false;
        if (keep > 0 && old) {
          Op op;
          op.kind = Op::Kind::copy;
          op.a = Operand{false, 1, 0};
          op.b = Operand{false, 0, 0};
          op.length = keep;
          it->ops.push_back(op);
        }
        WorkItem item;
        item.bound = {old, fresh};
        pin(*s, old);
        pin(*s, fresh);
        item.iter = std::move(it);
        item.on_done = [done](int e, std::span<const char>) { done(e); };
        retire(*s, old, old_size);
        enqueue(*s, std::move(item));
        return;  // replied when the copy is done
      }
    }
  }
  later.push_back([done = std::move(done), err] { done(err); });
}

// mem/ reads and writes: one host copy through a staging block, queued like any
// other work of the session, so it is ordered after everything submitted before it.
std::uint64_t Broker::enqueue_host_copy(Session& s, Op::Kind kind, arena::BufferHandle handle,
                                        Bytes offset, StagingPool::Block host, Bytes length,
                                        HostCopyDone done) {
  auto it = std::make_shared<Iteration>();
  it->counts = false;
  Op op;
  op.kind = kind;
  op.a = Operand{false, 0, offset};
  op.length = length;
  it->ops.push_back(op);
  WorkItem item;
  item.bound = {handle};
  pin(s, handle);
  item.iter = std::move(it);
  item.host = std::move(host);
  item.host_length = length;
  item.on_done = std::move(done);
  item.ticket = next_ticket_++;
  const std::uint64_t ticket = item.ticket;
  enqueue(s, std::move(item));
  return ticket;
}

// The session and buffer a mem/ read or write addresses: ENOENT when either is
// gone, EIO while the session is failed.
int Broker::usable_buffer(SessionId id, std::uint32_t bid, Session*& s, const Buffer*& b) {
  s = get(id);
  if (!s || s->dead) return ENOENT;
  auto it = s->buffers.find(bid);
  if (it == s->buffers.end()) return ENOENT;
  if (s->error) return EIO;
  b = &it->second;
  return 0;
}

int Broker::buffer_gpu(SessionId id, std::uint32_t bid) {
  std::lock_guard lk(mu_);
  Session* s = nullptr;
  const Buffer* b = nullptr;
  if (const int err = usable_buffer(id, bid, s, b)) return -err;
  return s->gpu < 0 ? -ENXIO : s->gpu;
}

// Both take their staging block before the lock (it may have to be allocated,
// on cuda pinned) and check the buffer again under it: it may have changed.
std::uint64_t Broker::read_buffer(SessionId id, std::uint32_t bid, Bytes offset, Bytes length,
                                  HostCopyDone done) {
  int err = 0;
  const int gi = buffer_gpu(id, bid);
  if (gi < 0) return done(-gi, {}), 0;
  if (length == 0) return done(0, {}), 0;
  StagingPool::Block block = gpus_[static_cast<std::size_t>(gi)]->staging->acquire(length);
  if (!block) return done(ENOMEM, {}), 0;
  {
    std::lock_guard lk(mu_);
    Session* s = nullptr;
    const Buffer* found = nullptr;
    err = usable_buffer(id, bid, s, found);
    if (!err) {
      const Buffer& b = *found;
      if (offset >= b.size || !b.handle) {
        length = 0;
      } else {
        length = std::min(length, b.size - offset);
        stats_.bytes_to_host += length;
        return enqueue_host_copy(*s, Op::Kind::to_host, b.handle, offset, std::move(block), length,
                                 std::move(done));
      }
    }
  }
  done(err, {});
  return 0;
}

std::uint64_t Broker::write_buffer(SessionId id, std::uint32_t bid, Bytes offset, const char* data,
                                   Bytes length, std::function<void(int err, Bytes written)> done) {
  int err = 0;
  const int gi = buffer_gpu(id, bid);
  if (gi < 0) return done(-gi, 0), 0;
  StagingPool::Block block;
  if (length > 0) {
    block = gpus_[static_cast<std::size_t>(gi)]->staging->acquire(length);
    if (!block) return done(ENOMEM, 0), 0;
    std::memcpy(block.data(), data, length);
  }
  {
    std::lock_guard lk(mu_);
    Session* s = nullptr;
    const Buffer* found = nullptr;
    err = usable_buffer(id, bid, s, found);
    if (!err) {
      const Buffer& b = *found;
      if (offset > b.size || length > b.size - offset) {
        log(*s, fmt::format("mem/{}: write of {} bytes at {} runs past the buffer's {} bytes; "
                            "grow it first with truncate -s",
                            b.name, length, offset, b.size));
        err = EFBIG;
      } else if (length == 0) {
        err = 0;
      } else {
        stats_.bytes_from_host += length;
        return enqueue_host_copy(
            *s, Op::Kind::from_host, b.handle, offset, std::move(block), length,
            [done, length](int e, std::span<const char>) { done(e, e ? 0 : length); });
      }
    }
  }
  done(err, 0);
  return 0;
}

}  // namespace salus::vgpu
