#include "vgpu/transfer/transfer_engine.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace salus::vgpu {

// One read or write of a slot's chunk, run by CallerIo. It touches the slot's
// memory only under `mu` and only while not `abandoned`: a cancelled transfer
// abandons its requests and reuses their memory at once, whether or not the
// syscall ever returns.
struct TransferEngine::FileIo {
  std::mutex mu;
  bool abandoned = false;  // set by the engine thread only
  char* mem = nullptr;     // upload: where the bytes go; download: where they come from
  Bytes length = 0;
  off_t offset = 0;
  bool upload = true;
  std::shared_ptr<UniqueFd> fd;
  Slot* slot = nullptr;  // the engine's; valid while not abandoned
};

// A download's missing file, created as the caller by CallerIo.
struct TransferEngine::Create {
  bool abandoned = false;  // engine thread only
  CallerFile file;
  CallerCredentials who;
  std::string shown;
  std::string why;
  Active* active = nullptr;  // valid while not abandoned
};

// Results from CallerIo jobs, run on the engine thread (never if it is gone).
struct TransferEngine::Mailbox {
  std::mutex mu;
  std::vector<std::function<void()>> done;
  UniqueFd wake{::eventfd(0, EFD_CLOEXEC)};
  void post(std::function<void()> fn) {
    {
      std::lock_guard lk(mu);
      done.push_back(std::move(fn));
    }
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto n = ::write(wake.get(), &one, sizeof one);
  }
};

namespace {

// A file's ctime as one number, to compare a segment's now with when it was mapped.
std::int64_t ctime_ns(const struct stat& st) {
  return std::int64_t{st.st_ctim.tv_sec} * 1'000'000'000 + st.st_ctim.tv_nsec;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The bytes go through a buffer of the request's own, a piece at a time, so
// that a syscall that returns after its transfer was abandoned writes only
// there (and reads nothing that is no longer the transfer's).
constexpr Bytes kPiece = Bytes{1} << 20;

}  // namespace

TransferEngine::TransferEngine(Device& device, StagingPool& staging, Options options, int gpu_index)
    : device_(device),
      staging_(staging),
      options_(options),
      gpu_(gpu_index),
      own_io_(options.io ? nullptr : std::make_unique<CallerIo>(CallerIo::Options{})),
      io_(options.io ? *options.io : *own_io_),
      mailbox_(std::make_shared<Mailbox>()) {
  for (auto& s : streams_) s.store(-1);
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
}

void TransferEngine::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto n = ::write(mailbox_->wake.get(), &one, sizeof one);
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

void TransferEngine::run() {
  for (;;) {
    try {
      if (!step()) break;
    } catch (const std::exception& e) {
      // Nothing may take salusd down; the transfers at fault are the ones to go.
      spdlog::error("gpu {}: transfer engine: {}", gpu_, e.what());
      for (Active& a : active_)
        fail(a, EIO, fmt::format("{}: internal error: {}", a.job->shown, e.what()));
    }
  }
  drop_segments(true);  // every transfer is over: nothing copies from them
  for (auto& s : streams_) {
    const std::int64_t id = s.exchange(-1);
    if (id >= 0) device_.destroy_stream(static_cast<StreamId>(id));
  }
}

// Starts waiting jobs in order while there is room: max_active in all, and
// beyond that one for a uid with nothing moving (see Options::max_active).
void TransferEngine::start_waiting() {
  const unsigned cap = std::min(options_.max_active, kMaxActive);
  for (auto it = waiting_.begin(); it != waiting_.end() && active_.size() < kMaxActive;) {
    const uid_t uid = (*it)->who.uid;
    const auto mine = static_cast<unsigned>(std::count_if(
        active_.begin(), active_.end(), [&](const Active& a) { return a.job->who.uid == uid; }));
    const bool room = active_.size() < cap ? mine < cap : mine == 0;
    if (!room) {
      ++it;
      continue;
    }
    auto job = std::move(*it);
    it = waiting_.erase(it);
    start(std::move(job));
  }
}

// One turn of the engine loop; false once it is time to stop.
bool TransferEngine::step() {
  Inbox in;
  if (!take_inbox(in)) return false;
  handle_inbox(in);
  start_waiting();
  for (Active& a : active_) pump(a);
  retire_over();
  const bool freed = !finished_.empty();  // a waiting job may start now
  report_finished();
  if (note_idle()) return true;  // the destructor waits: ends at the next step
  if (!sync_done_.empty() || (freed && !waiting_.empty())) return true;
  std::uint64_t v;
  [[maybe_unused]] const auto n = ::read(mailbox_->wake.get(), &v, sizeof v);
  return true;
}

// Takes what the other threads handed over; false once the destructor asked
// the loop to end and nothing is left.
bool TransferEngine::take_inbox(Inbox& in) {
  {
    std::lock_guard lk(mu_);
    for (auto& j : incoming_) waiting_.push_back(std::move(j));
    incoming_.clear();
    in.device_done.swap(device_done_);
    in.forgotten.swap(forgotten_);
    in.stopping = stopping_;
    if (quit_ && active_.empty() && waiting_.empty()) return false;
  }
  std::lock_guard lk(mailbox_->mu);
  in.io_done.swap(mailbox_->done);
  return true;
}

void TransferEngine::handle_inbox(Inbox& in) {
  if (!in.forgotten.empty()) {
    for (Segment& seg : segments_)
      if (std::find(in.forgotten.begin(), in.forgotten.end(), seg.session) != in.forgotten.end())
        seg.transient = true;
    drop_segments(false);
  }
  for (const DeviceDone& d : in.device_done) on_device_done(d);
  for (auto& fn : in.io_done) fn();
  // on_file_done may fail to post the next request, which lands in sync_done_.
  for (auto& [slot, res] : std::exchange(sync_done_, {})) on_file_done(*slot, res);
  if (in.stopping) {
    for (Active& a : active_) a.job->cancel.store(true);
    for (auto& j : waiting_) j->cancel.store(true);
  }
}

// Moves every transfer that is over from active_ to finished_.
void TransferEngine::retire_over() {
  for (auto it = active_.begin(); it != active_.end();) {
    if (!over(*it)) {
      ++it;
      continue;
    }
    Active& a = *it;
    if (a.segment) {
      check_segment_after(a);
      if (a.error) a.segment->transient = true;  // a guard may have replaced its pages
      release_segment(a.segment);
      a.segment = nullptr;
    }
    TransferResult r = result_of(a);
    stream_busy_[a.stream_index] = false;
    a.job->file = CallerFile{};  // closes it (requests abandoned in flight hold a dup)
    finished_.emplace_back(std::move(a.job), std::move(r));
    it = active_.erase(it);  // its staging blocks go back to the pool
  }
}

// A finished transfer through a segment: fails it if the segment shrank
// meanwhile, and keeps the segment's mappings after a download's own writes.
void TransferEngine::check_segment_after(Active& a) {
  // The pages were the file's when the copies began; if the file shrank
  // meanwhile, some of them were zeros (see HostRegions) or went nowhere.
  // (Segments are on tmpfs, so fstat never waits.)
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
}

TransferResult TransferEngine::result_of(Active& a) {
  TransferResult r;
  r.bytes = a.finished;
  r.device_ns = a.device_ns;
  r.elapsed_ns = now_ns() - a.started_ns;
  if (a.error) {
    r.error = a.error;
    r.why = std::move(a.why);
  } else if (a.finished < a.job->length) {
    r.error = ECANCELED;
    r.why =
        fmt::format("{}: cancelled after {} of {} bytes", a.job->shown, a.finished, a.job->length);
  }
  return r;
}

// Publishes the counts, then calls the finished transfers' callbacks.
void TransferEngine::report_finished() {
  {
    // Before the callbacks: whoever they wake sees the transfer gone.
    std::lock_guard lk(mu_);
    stats_.active = static_cast<unsigned>(active_.size());
    stats_.waiting = static_cast<unsigned>(waiting_.size() + incoming_.size());
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

// Records whether the engine is idle while stopping (stop() waits for that);
// true when the destructor is waiting to end the loop.
bool TransferEngine::note_idle() {
  std::lock_guard lk(mu_);
  idle_ = stopping_ && active_.empty() && waiting_.empty() && incoming_.empty();
  if (idle_) quiet_.notify_all();
  return quit_ && idle_;
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
  if (a.job->file.exists() || a.job->cancel.load()) {
    a.fd = std::make_shared<UniqueFd>(::fcntl(a.job->file.fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!*a.fd && a.job->file.exists())
      fail(a, EMFILE,
           fmt::format("{}: no file descriptor left: {}", a.job->shown, std::strerror(errno)));
    return;
  }
  // A download's file is created when it starts, as the caller, by CallerIo.
  auto c = std::make_shared<Create>();
  c->file = std::move(a.job->file);
  c->who = a.job->who;
  c->shown = a.job->shown;
  c->active = &a;
  a.create = c;
  const int rc = io_.post(c->who.uid, [this, c, mb = mailbox_](CallerIo::Gate&) {
    int res = 0;
    if (const int err = CallerIo::isolated(
            [&] { res = create_caller_file(c->who, c->file, c->shown, c->why); }))
      res = err;
    mb->post([this, c, res] { created(*c, res); });
  });
  if (rc) created(*c, rc);
}

void TransferEngine::created(Create& c, int rc) {
  if (c.abandoned) return;  // cancelled meanwhile; the file goes with `c`
  Active& a = *c.active;
  auto keep = std::move(a.create);  // `c` lives until this returns
  if (rc) {
    if (c.why.empty()) c.why = fmt::format("{}: {}", c.shown, std::strerror(rc));
    return fail(a, rc, std::move(c.why));
  }
  a.job->file = std::move(c.file);
  a.fd = std::make_shared<UniqueFd>(::fcntl(a.job->file.fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!*a.fd)
    fail(a, EMFILE,
         fmt::format("{}: no file descriptor left: {}", a.job->shown, std::strerror(errno)));
}

bool TransferEngine::over(const Active& a) const {
  if (a.create) return false;
  for (const Slot& s : a.slots)
    if (s.state != Slot::State::idle) return false;
  return a.error || a.cancelled || a.finished == a.job->length;
}

void TransferEngine::fail(Active& a, int err, std::string why) {
  if (a.error) return;  // the first error is the one reported
  a.error = err;
  a.why = std::move(why);
}

// The slot's read or write may never return: it is left to finish (or not)
// on its own, with no access to the slot's memory from now on.
void TransferEngine::abandon(Slot& s) {
  if (s.io) {
    std::lock_guard lk(s.io->mu);
    s.io->abandoned = true;
  }
  s.io.reset();
  s.state = Slot::State::idle;
}

void TransferEngine::pump(Active& a) {
  if (a.job->cancel.load() && !a.cancelled) {
    a.cancelled = true;
    // A stuck file must not hold the session (or salusd's shutdown) up.
    for (Slot& s : a.slots)
      if (s.state == Slot::State::file) abandon(s);
    if (a.create) {
      a.create->abandoned = true;
      a.create.reset();
    }
  }
  if (a.error || a.cancelled || a.create) return;
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
    a.next += s.length;
    if (a.job->upload)
      file_io(s);
    else
      device_copy(s);
  }
}

int TransferEngine::run_file_io(FileIo& io) {
  {
    std::lock_guard lk(io.mu);
    if (io.abandoned) return -ECANCELED;
  }
  std::unique_ptr<char[]> bounce(new (std::nothrow) char[std::min(io.length, kPiece)]);
  if (!bounce) return -ENOMEM;
  const int fd = io.fd->get();
  Bytes done = 0;
  while (done < io.length) {
    const auto n = static_cast<std::size_t>(std::min(kPiece, io.length - done));
    const auto at = static_cast<off_t>(io.offset + static_cast<off_t>(done));
    ssize_t r;
    if (io.upload) {
      r = ::pread(fd, bounce.get(), n, at);
      if (r > 0) {
        std::lock_guard lk(io.mu);
        if (io.abandoned) return -ECANCELED;
        std::memcpy(io.mem + done, bounce.get(), static_cast<std::size_t>(r));
      }
    } else {
      {
        std::lock_guard lk(io.mu);
        if (io.abandoned) return -ECANCELED;
        std::memcpy(bounce.get(), io.mem + done, n);
      }
      r = ::pwrite(fd, bounce.get(), n, at);
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return done ? static_cast<int>(done) : -errno;
    done += static_cast<Bytes>(r);
    if (static_cast<std::size_t>(r) < n) break;  // end of file, or a short write
  }
  return static_cast<int>(done);
}

void TransferEngine::file_io(Slot& s) {
  const Active& a = *s.owner;
  const TransferJob& job = *a.job;
  auto io = std::make_shared<FileIo>();
  io->mem = (a.view ? a.view + s.offset : s.block.data()) + s.done;
  io->length = s.length - s.done;
  io->offset = static_cast<off_t>(job.file_offset + s.offset + s.done);
  io->upload = job.upload;
  io->fd = a.fd;
  io->slot = &s;
  s.io = io;
  s.state = Slot::State::file;
  const int rc = io_.post(job.who.uid, [this, io, mb = mailbox_](CallerIo::Gate&) {
    int res = 0;
    if (const int err = CallerIo::isolated([&] { res = run_file_io(*io); })) res = -err;
    mb->post([this, io, res] {
      if (!io->abandoned) on_file_done(*io->slot, res);
    });
  });
  if (rc) sync_done_.emplace_back(&s, -rc);  // on_file_done takes a count or -errno
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

// A read found the file's end before the transfer's (it shrank after the command
// was accepted). No fstat says where it ends now (that could wait on the file's
// filesystem, here on the engine thread), so the transfer fails once no chunk
// before that end is still being read: one of them may find the end earlier.
void TransferEngine::fail_at_eof_when_known(Active& a) {
  for (const Slot& o : a.slots)
    if (o.state == Slot::State::file && o.offset < a.eof) return;
  const TransferJob& job = *a.job;
  fail(a, EIO,
       fmt::format("{}: ended at byte {}, short of the {} bytes asked; it shrank after the "
                   "command was accepted",
                   job.shown, a.eof, job.file_offset + job.length));
}

void TransferEngine::on_file_done(Slot& s, int res) {
  Active& a = *s.owner;
  const TransferJob& job = *a.job;
  const Bytes at = job.file_offset + s.offset + s.done;
  const bool stop = a.error || a.cancelled;
  s.io.reset();
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
    // No fstat to say where it ends now (that could wait on the file's
    // filesystem, here on the engine thread): an earlier chunk still being
    // read finds the end, or this one is where it is.
    a.eof = std::min(a.eof, at);
    if (!job.upload)
      return fail(a, EIO, fmt::format("{}: writing at byte {} made no progress", job.shown, at));
    return fail_at_eof_when_known(a);
  }
  s.done += static_cast<Bytes>(res);
  if (stop) {
    s.state = Slot::State::idle;
    return;
  }
  if (s.done < s.length) return file_io(s);  // a short read or write: the rest
  // A read that found the end earlier waits for the chunks before it; this was one.
  if (a.eof != ~Bytes{0}) {
    s.state = Slot::State::idle;
    return fail_at_eof_when_known(a);
  }
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
