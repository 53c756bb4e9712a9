#include "vgpu/transfer/transfer_engine.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace salus::vgpu {

namespace {

constexpr std::uint64_t kWakeTag = 1;    // the poll of the eventfd
constexpr std::uint64_t kCancelTag = 2;  // IORING_OP_ASYNC_CANCEL requests
constexpr unsigned kRingEntries = 64;

// A file's ctime as one number, to compare a segment's now with when it was mapped.
std::int64_t ctime_ns(const struct stat& st) {
  return std::int64_t{st.st_ctim.tv_sec} * 1'000'000'000 + st.st_ctim.tv_nsec;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Writes made for a caller must obey the caller's disk quota and leave the
// filesystem's root-reserved blocks alone, which CAP_SYS_RESOURCE would bypass.
// Capabilities are per thread, and io_uring's workers are clones of this one.
void drop_sys_resource() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &hdr, data) != 0) return;
  data[CAP_TO_INDEX(CAP_SYS_RESOURCE)].effective &= ~CAP_TO_MASK(CAP_SYS_RESOURCE);
  ::syscall(SYS_capset, &hdr, data);
}

}  // namespace

TransferEngine::TransferEngine(Device& device, StagingPool& staging, Options options, int gpu_index)
    : device_(device), staging_(staging), options_(options), gpu_(gpu_index) {
  for (auto& s : streams_) s.store(-1);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  thread_ = std::thread([this] { run(); });
}

TransferEngine::~TransferEngine() {
  stop();
  {
    std::lock_guard lk(mu_);
    quit_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void TransferEngine::wake() {
  const std::uint64_t one = 1;
  if (wake_fd_ < 0) return;
  [[maybe_unused]] const auto n = ::write(wake_fd_, &one, sizeof one);
}

void TransferEngine::submit(std::shared_ptr<TransferJob> job) {
  {
    std::lock_guard lk(mu_);
    incoming_.push_back(std::move(job));
  }
  wake();
}

void TransferEngine::cancel(const std::shared_ptr<TransferJob>& job) {
  if (!job) return;
  job->cancel.store(true);
  wake();
}

void TransferEngine::forget_session(std::uint64_t session) {
  {
    std::lock_guard lk(mu_);
    forgotten_.push_back(session);
  }
  wake();
}

void TransferEngine::stop() {
  std::unique_lock lk(mu_);
  stopping_ = true;
  lk.unlock();
  wake();
  lk.lock();
  quiet_.wait(lk, [&] { return idle_ || quit_; });
}

bool TransferEngine::owns_stream(StreamId stream) const {
  for (const auto& s : streams_)
    if (s.load() == static_cast<std::int64_t>(stream)) return true;
  return false;
}

void TransferEngine::on_device_complete(StreamId, std::uint64_t token, int status,
                                        std::int64_t device_ns) {
  {
    std::lock_guard lk(mu_);
    device_done_.push_back(DeviceDone{token, status, device_ns});
  }
  wake();
}

TransferEngine::Stats TransferEngine::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

// ---------------------------------------------------------------- engine thread

io_uring_sqe* TransferEngine::sqe() {
  io_uring_sqe* e = io_uring_get_sqe(&ring_);
  if (!e) {
    io_uring_submit(&ring_);
    e = io_uring_get_sqe(&ring_);
  }
  return e;  // never null: the ring has room for every slot, cancel and wake-up
}

void TransferEngine::arm_wakeup() {
  io_uring_sqe* e = sqe();
  // A poll, not a read: a read of an empty eventfd would be handed to an io-wq
  // worker, one more thread hop on every chunk's device completion.
  io_uring_prep_poll_add(e, wake_fd_, POLLIN);
  io_uring_sqe_set_data64(e, kWakeTag);
}

void TransferEngine::run() {
  drop_sys_resource();
  if (!options_.io_uring) {
    spdlog::debug("gpu {}: transfers use pread/pwrite", gpu_);
  } else if (const int rc = io_uring_queue_init(kRingEntries, &ring_, 0); rc < 0) {
    // Docker's default seccomp profile, for one, refuses io_uring.
    spdlog::warn("gpu {}: io_uring is unavailable ({}); transfers use pread/pwrite", gpu_,
                 std::strerror(-rc));
  } else {
    ring_ok_ = true;
    arm_wakeup();
  }
  std::vector<std::pair<Slot*, int>> file_done;
  for (;;) {
    try {
      if (!step(file_done)) break;
    } catch (const std::exception& e) {
      // Nothing may take salusd down; the transfers at fault are the ones to go.
      spdlog::error("gpu {}: transfer engine: {}", gpu_, e.what());
      file_done.clear();  // handled in part; never twice
      for (Active& a : active_)
        fail(a, EIO, fmt::format("{}: internal error: {}", a.job->shown, e.what()));
    }
  }
  drop_segments(true);  // every transfer is over: nothing copies from them
  for (auto& s : streams_) {
    const std::int64_t id = s.exchange(-1);
    if (id >= 0) device_.destroy_stream(static_cast<StreamId>(id));
  }
  if (ring_ok_) io_uring_queue_exit(&ring_);
}

// One turn of the engine loop; false once it is time to stop.
bool TransferEngine::step(std::vector<std::pair<Slot*, int>>& file_done) {
  std::vector<DeviceDone> device_done;
  std::vector<std::uint64_t> forgotten;
  bool stopping = false;
  {
    std::lock_guard lk(mu_);
    for (auto& j : incoming_) waiting_.push_back(std::move(j));
    incoming_.clear();
    device_done.swap(device_done_);
    forgotten.swap(forgotten_);
    stopping = stopping_;
    if (quit_ && active_.empty() && waiting_.empty()) return false;
  }
  if (!forgotten.empty()) {
    for (Segment& seg : segments_)
      if (std::find(forgotten.begin(), forgotten.end(), seg.session) != forgotten.end())
        seg.transient = true;
    drop_segments(false);
  }
  for (const DeviceDone& d : device_done) on_device_done(d);
  // on_file_done may issue the next pread/pwrite, which lands in sync_done_.
  for (auto& [slot, res] : std::exchange(sync_done_, {})) on_file_done(*slot, res);
  if (stopping) {
    for (Active& a : active_) a.job->cancel.store(true);
    for (auto& j : waiting_) j->cancel.store(true);
  }
  while (!waiting_.empty() && active_.size() < std::min(options_.max_active, kMaxActive)) {
    auto job = std::move(waiting_.front());
    waiting_.pop_front();
    start(std::move(job));
  }
  for (Active& a : active_) pump(a);
  for (auto it = active_.begin(); it != active_.end();) {
    if (!over(*it)) {
      ++it;
      continue;
    }
    Active& a = *it;
    if (a.segment) {
      // The pages were the file's when the copies began; if the file shrank
      // meanwhile, some of them were zeros (see HostRegions) or went nowhere.
      struct stat now {};
      const Bytes end = a.job->file_offset + a.job->length;
      if (!a.error && a.finished == a.job->length && ::fstat(a.job->file.fd.get(), &now) == 0 &&
          static_cast<Bytes>(now.st_size) < end)
        fail(a, EIO,
             fmt::format("{}: the segment shrank to {} bytes while it was being copied (the "
                         "transfer needs {}); nothing it moved can be trusted",
                         a.job->shown, now.st_size, end));
      if (!a.job->upload && ::fstat(a.segment->fd.get(), &now) == 0 &&
          static_cast<Bytes>(now.st_size) == a.segment->size) {
        // Our own writes through the mapping moved its ctime (tmpfs updates it
        // on write faults); the pages are the same, so its mappings stay.
        for (Segment& seg : segments_)
          if (seg.dev == a.segment->dev && seg.ino == a.segment->ino && seg.size == a.segment->size)
            seg.ctime_ns = ctime_ns(now);
      }
      if (a.error) a.segment->transient = true;  // a guard may have replaced its pages
      release_segment(a.segment);
      a.segment = nullptr;
    }
    TransferResult r;
    r.bytes = a.finished;
    r.device_ns = a.device_ns;
    r.elapsed_ns = now_ns() - a.started_ns;
    if (a.error) {
      r.error = a.error;
      r.why = std::move(a.why);
    } else if (a.finished < a.job->length) {
      r.error = ECANCELED;
      r.why = fmt::format("{}: cancelled after {} of {} bytes", a.job->shown, a.finished,
                          a.job->length);
    }
    stream_busy_[a.stream_index] = false;
    a.job->file = CallerFile{};  // closes it
    finished_.emplace_back(std::move(a.job), std::move(r));
    it = active_.erase(it);  // its staging blocks go back to the pool
  }
  const bool freed = !finished_.empty();  // a waiting job may start now
  {
    // Before the callbacks: whoever they wake sees the transfer gone.
    std::lock_guard lk(mu_);
    stats_.active = static_cast<unsigned>(active_.size());
    stats_.waiting = static_cast<unsigned>(waiting_.size() + incoming_.size());
  }
  if (!finished_.empty()) {
    {
      std::lock_guard lk(mu_);
      for (const auto& [job, r] : finished_) {
        if (r.error == 0)
          ++stats_.completed;
        else if (r.error == ECANCELED)
          ++stats_.cancelled;
        else
          ++stats_.failed;
      }
    }
    for (auto& [job, r] : finished_) {
      try {
        if (job->done) job->done(std::move(r));
      } catch (const std::exception& e) {
        spdlog::error("gpu {}: a transfer's completion threw: {}", gpu_, e.what());
      } catch (...) {
        spdlog::error("gpu {}: a transfer's completion threw", gpu_);
      }
    }
    finished_.clear();
  }
  {
    std::lock_guard lk(mu_);
    idle_ = stopping_ && active_.empty() && waiting_.empty() && incoming_.empty();
    if (idle_) quiet_.notify_all();
    if (quit_ && idle_) return true;  // ends at the next step
  }
  if (!sync_done_.empty() || (freed && !waiting_.empty())) return true;
  if (ring_ok_) {
    io_uring_submit_and_wait(&ring_, 1);
    io_uring_cqe* cqe;
    unsigned head;
    unsigned seen = 0;
    bool rearm = false;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const std::uint64_t tag = cqe->user_data;
      if (tag == kWakeTag)
        rearm = true;
      else if (tag != kCancelTag)
        file_done.emplace_back(reinterpret_cast<Slot*>(tag), cqe->res);
    }
    io_uring_cq_advance(&ring_, seen);
    if (rearm) {
      [[maybe_unused]] const auto n = ::read(wake_fd_, &wake_value_, sizeof wake_value_);
      arm_wakeup();
    }
    for (auto& [slot, res] : file_done) on_file_done(*slot, res);
    file_done.clear();
  } else {
    std::uint64_t v;
    [[maybe_unused]] const auto n = ::read(wake_fd_, &v, sizeof v);
  }
  return true;
}

void TransferEngine::start(std::shared_ptr<TransferJob> job) {
  Active& a = active_.emplace_back();
  a.job = std::move(job);
  a.started_ns = now_ns();
  for (Slot& s : a.slots) s.owner = &a;
  {
    std::lock_guard lk(mu_);
    ++stats_.started;
  }
  unsigned i = 0;
  while (i < kMaxActive && stream_busy_[i]) ++i;  // active_ is capped, so one is free
  a.stream_index = i;
  stream_busy_[i] = true;
  if (streams_[i].load() < 0) {
    try {
      streams_[i].store(static_cast<std::int64_t>(device_.create_stream()));
    } catch (const std::exception& e) {
      return fail(a, EIO,
                  fmt::format("{}: no device stream for the transfer: {}", a.job->shown, e.what()));
    }
  }
  if (a.job->shm && !a.job->cancel.load()) {
    a.segment = acquire_segment(*a.job);
    if (a.segment) {
      std::lock_guard lk(mu_);
      ++stats_.direct;
    }
  }
  if (!a.segment && options_.device_view)
    a.view = device_.host_view(a.job->device_offset, a.job->length);
  if (!a.job->upload && !a.job->file.exists() && !a.job->cancel.load()) {
    std::string why;
    if (const int rc = create_caller_file(a.job->who, a.job->file, a.job->shown, why))
      return fail(a, -rc, std::move(why));
  }
}

bool TransferEngine::over(const Active& a) const {
  for (const Slot& s : a.slots)
    if (s.state != Slot::State::idle) return false;
  return a.error || a.cancelled || a.finished == a.job->length;
}

void TransferEngine::fail(Active& a, int err, std::string why) {
  if (a.error) return;  // the first error is the one reported
  a.error = err;
  a.why = std::move(why);
}

void TransferEngine::pump(Active& a) {
  if (a.job->cancel.load() && !a.cancelled) {
    a.cancelled = true;
    // Reads of a stuck filesystem should not hold the session up.
    if (ring_ok_)
      for (Slot& s : a.slots)
        if (s.state == Slot::State::file && !s.cancel_sent) {
          io_uring_sqe* e = sqe();
          io_uring_prep_cancel64(e, reinterpret_cast<std::uint64_t>(&s), 0);
          io_uring_sqe_set_data64(e, kCancelTag);
          s.cancel_sent = true;
        }
  }
  if (a.error || a.cancelled) return;
  const Bytes length = a.job->length;
  if (a.segment || a.view) {
    // No staging: a segment's pages to or from the device, or a file to or from
    // device memory in reach. Two chunks in flight keep both sides busy, and
    // cancelling waits for those two at most.
    const Bytes chunk = a.segment ? options_.direct_chunk : options_.chunk;
    for (Slot& s : a.slots) {
      if (s.state != Slot::State::idle || a.next >= length) continue;
      s.offset = a.next;
      s.length = std::min(chunk, length - a.next);
      s.done = 0;
      s.cancel_sent = false;
      a.next += s.length;
      if (a.segment)
        device_copy(s);
      else
        file_io(s);
    }
    return;
  }
  for (Slot& s : a.slots) {
    if (s.state != Slot::State::idle || a.next >= length) continue;
    if (!s.block) {
      s.block = staging_.acquire(std::min(options_.chunk, length));
      if (!s.block)
        return fail(a, ENOMEM,
                    fmt::format("{}: no host memory for a {}-byte staging block", a.job->shown,
                                std::min(options_.chunk, length)));
    }
    s.offset = a.next;
    s.length = std::min({options_.chunk, length - a.next, s.block.capacity()});
    s.done = 0;
    s.cancel_sent = false;
    a.next += s.length;
    if (a.job->upload)
      file_io(s);
    else
      device_copy(s);
  }
}

void TransferEngine::file_io(Slot& s) {
  const TransferJob& job = *s.owner->job;
  const int fd = job.file.fd.get();
  const auto off = static_cast<off_t>(job.file_offset + s.offset + s.done);
  char* p = (s.owner->view ? s.owner->view + s.offset : s.block.data()) + s.done;
  const auto n = static_cast<std::size_t>(s.length - s.done);
  s.state = Slot::State::file;
  if (ring_ok_) {
    io_uring_sqe* e = sqe();
    if (job.upload)
      io_uring_prep_read(e, fd, p, static_cast<unsigned>(n), static_cast<__u64>(off));
    else
      io_uring_prep_write(e, fd, p, static_cast<unsigned>(n), static_cast<__u64>(off));
    io_uring_sqe_set_data64(e, reinterpret_cast<std::uint64_t>(&s));
    return;
  }
  const ssize_t r = job.upload ? ::pread(fd, p, n, off) : ::pwrite(fd, p, n, off);
  sync_done_.emplace_back(&s, r < 0 ? -errno : static_cast<int>(r));
}

void TransferEngine::device_copy(Slot& s) {
  Active& a = *s.owner;
  const auto stream = static_cast<StreamId>(streams_[a.stream_index].load());
  const DevOffset dev = a.job->device_offset + s.offset;
  const std::uint64_t token = next_token_++;
  s.state = Slot::State::device;
  tokens_[token] = &s;
  try {
    if (a.segment) {
      const Bytes at = a.job->file_offset + s.offset;
      if (a.job->upload)
        device_.copy_from_region(stream, dev, a.segment->region, at, s.length);
      else
        device_.copy_to_region(stream, a.segment->region, at, dev, s.length);
    } else if (a.job->upload) {
      device_.copy_from_staging(stream, dev, s.block.data(), s.length);
    } else {
      device_.copy_to_staging(stream, s.block.data(), dev, s.length);
    }
    device_.notify(stream, token);
  } catch (const std::exception& e) {
    tokens_.erase(token);
    s.state = Slot::State::idle;
    fail(a, EIO, fmt::format("{}: the device refused the copy: {}", a.job->shown, e.what()));
  }
}

void TransferEngine::on_file_done(Slot& s, int res) {
  Active& a = *s.owner;
  const TransferJob& job = *a.job;
  const Bytes at = job.file_offset + s.offset + s.done;
  const bool stop = a.error || a.cancelled;
  if ((res == -EINTR || res == -EAGAIN) && !stop) return file_io(s);
  if (res < 0) {
    s.state = Slot::State::idle;
    if (res == -ECANCELED && a.cancelled) return;
    return fail(a, -res,
                fmt::format("{}: {} at byte {} failed: {}", job.shown,
                            job.upload ? "reading" : "writing", at, std::strerror(-res)));
  }
  if (res == 0) {
    s.state = Slot::State::idle;
    if (stop) return;
    // With reads of later chunks in flight, this one may be past the new end:
    // report where the file ends now.
    struct stat now {};
    const Bytes ended = job.upload && ::fstat(job.file.fd.get(), &now) == 0
                            ? std::min(at, static_cast<Bytes>(now.st_size))
                            : at;
    return fail(a, EIO,
                job.upload ? fmt::format("{}: ended at byte {}, short of the {} bytes asked; it "
                                         "shrank after the command was accepted",
                                         job.shown, ended, job.file_offset + job.length)
                           : fmt::format("{}: writing at byte {} made no progress", job.shown, at));
  }
  s.done += static_cast<Bytes>(res);
  if (stop) {
    s.state = Slot::State::idle;
    return;
  }
  if (s.done < s.length) return file_io(s);  // a short read or write: the rest
  if (job.upload && !a.view) return device_copy(s);
  s.state = Slot::State::idle;
  a.finished += s.length;
}

void TransferEngine::on_device_done(const DeviceDone& d) {
  const auto it = tokens_.find(d.token);
  if (it == tokens_.end()) return;
  Slot& s = *it->second;
  tokens_.erase(it);
  Active& a = *s.owner;
  a.device_ns += d.device_ns;
  if (d.status != 0) {
    s.state = Slot::State::idle;
    return fail(
        a, d.status,
        fmt::format("{}: the device copy failed: {}", a.job->shown, std::strerror(d.status)));
  }
  if (a.job->upload || a.segment) {
    s.state = Slot::State::idle;
    a.finished += s.length;
    return;
  }
  if (a.error || a.cancelled) {
    s.state = Slot::State::idle;
    return;
  }
  s.done = 0;
  file_io(s);
}

// ---------------------------------------------------------------- segments

TransferEngine::Segment* TransferEngine::acquire_segment(const TransferJob& job) {
  const struct stat& st = job.file.st;
  const bool writable = !job.upload;
  const std::int64_t ctime = ctime_ns(st);
  const auto size = static_cast<Bytes>(st.st_size);
  drop_segments(false);
  for (Segment& seg : segments_) {
    if (seg.transient || seg.session != job.session || seg.dev != st.st_dev ||
        seg.ino != st.st_ino || seg.ctime_ns != ctime || seg.size != size ||
        (writable && !seg.writable))
      continue;
    ++seg.users;
    seg.last_use = ++use_clock_;
    return &seg;
  }
  const int fd = job.file.fd.get();
  // A shared writable mapping needs the file open for reading too.
  if (size == 0 || (writable && (::fcntl(fd, F_GETFL) & O_ACCMODE) != O_RDWR)) return nullptr;
  bool transient = size > options_.segment_cache;
  while (!transient && cached_segment_bytes() + size > options_.segment_cache) {
    auto lru = segments_.end();
    for (auto it = segments_.begin(); it != segments_.end(); ++it)
      if (it->users == 0 && (lru == segments_.end() || it->last_use < lru->last_use)) lru = it;
    if (lru == segments_.end()) {
      transient = true;  // everything cached is in use
      break;
    }
    device_.unmap_region(lru->region);
    segments_.erase(lru);
  }
  Segment seg;
  seg.session = job.session;
  seg.dev = st.st_dev;
  seg.ino = st.st_ino;
  seg.ctime_ns = ctime;
  seg.size = size;
  seg.writable = writable;
  seg.transient = transient;
  seg.fd = UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!seg.fd) return nullptr;
  std::string why;
  if (const int err = device_.map_region(fd, size, writable, seg.region, why); err != 0) {
    spdlog::debug("gpu {}: {} goes through staging: {}", gpu_, job.shown, why);
    return nullptr;
  }
  seg.users = 1;
  seg.last_use = ++use_clock_;
  segments_.push_back(std::move(seg));
  publish_segment_stats();
  return &segments_.back();
}

void TransferEngine::release_segment(Segment* seg) {
  if (seg->users > 0) --seg->users;
  drop_segments(false);
}

void TransferEngine::drop_segments(bool everything) {
  bool dropped = false;
  for (auto it = segments_.begin(); it != segments_.end();) {
    bool drop = false;
    if (it->users == 0) {
      struct stat now {};
      const std::int64_t ctime = ::fstat(it->fd.get(), &now) == 0 ? ctime_ns(now) : -1;
      // Unlinked or changed: holding its pages would keep memory the client
      // freed, and a new transfer would not find it anyway.
      drop = everything || it->transient || now.st_nlink == 0 || ctime != it->ctime_ns ||
             static_cast<Bytes>(now.st_size) != it->size;
    }
    if (!drop) {
      ++it;
      continue;
    }
    device_.unmap_region(it->region);
    it = segments_.erase(it);
    dropped = true;
  }
  if (dropped) publish_segment_stats();
}

Bytes TransferEngine::cached_segment_bytes() const {
  Bytes n = 0;
  for (const Segment& seg : segments_)
    if (!seg.transient) n += seg.size;
  return n;
}

void TransferEngine::publish_segment_stats() {
  Bytes bytes = 0;
  for (const Segment& seg : segments_) bytes += seg.size;
  std::lock_guard lk(mu_);
  stats_.segments = static_cast<unsigned>(segments_.size());
  stats_.segment_bytes = bytes;
}

}  // namespace salus::vgpu
