#include "vgpu/broker/spill_file.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/store/ring_io.hpp"

namespace salus::vgpu {

std::unique_ptr<SpillFile> SpillFile::open(const std::string& dir, std::string& why) {
  const int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    why = fmt::format("swap dir {}: {} ({}){}", dir, strerrorname_np(e), std::strerror(e),
                      e == EOPNOTSUPP || e == EISDIR ? "; the filesystem has no O_TMPFILE" : "");
    return nullptr;
  }
  return std::unique_ptr<SpillFile>(new SpillFile(UniqueFd(fd), dir));
}

SpillFile::SpillFile(UniqueFd fd, std::string dir)
    : fd_(std::move(fd)), dir_(std::move(dir)), thread_([this] { run(); }) {}

SpillFile::~SpillFile() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

off_t SpillFile::reserve(std::size_t n) {
  std::lock_guard lk(mu_);
  reserved_ += n;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    const off_t off = it->first;
    const std::size_t left = it->second - n;
    free_.erase(it);
    if (left) free_.emplace(off + static_cast<off_t>(n), left);
    return off;
  }
  const off_t off = end_;
  end_ += static_cast<off_t>(n);
  return off;
}

void SpillFile::release(off_t off, std::size_t n) {
  if (n == 0) return;
  {
    std::lock_guard lk(mu_);
    reserved_ -= std::min<std::uint64_t>(reserved_, n);
    auto [it, _] = free_.emplace(off, n);
    auto next = std::next(it);
    if (next != free_.end() && it->first + static_cast<off_t>(it->second) == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + static_cast<off_t>(prev->second) == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
    jobs_.push_back(Job{Job::punch, {Piece{nullptr, n, off}}, nullptr});
  }
  cv_.notify_one();
}

void SpillFile::submit(bool write, std::vector<Piece> pieces, Done done) {
  {
    std::lock_guard lk(mu_);
    jobs_.push_back(Job{write ? Job::write : Job::read, std::move(pieces), std::move(done)});
  }
  cv_.notify_one();
}

std::uint64_t SpillFile::bytes_reserved() const {
  std::lock_guard lk(mu_);
  return reserved_;
}

int SpillFile::execute(RingIo& ring, Job& job) {
  for (const Piece& p : job.pieces) {
    int rc = 0;
    if (job.kind == Job::punch) {
      // Frees the blocks; the file keeps its size so later offsets stay valid.
      if (::fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, p.offset,
                      static_cast<off_t>(p.size)) != 0)
        rc = -errno;
      if (rc == -EOPNOTSUPP) rc = 0;  // the space then comes back when salusd stops
    } else if (job.kind == Job::write) {
      rc = ring.write(fd_.get(), p.data, p.size, p.offset);
    } else {
      rc = ring.read(fd_.get(), p.data, p.size, p.offset);
    }
    if (rc < 0) return -rc;
  }
  return 0;
}

// The spill thread: jobs in order, each reported through its callback. Nothing
// thrown escapes the thread.
void SpillFile::run() {
  RingIo ring;
  for (;;) {
    Job job;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      if (stop_ && job.kind != Job::punch) {
        lk.unlock();
        if (job.done) job.done(ECANCELED);
        continue;
      }
    }
    int err = EIO;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      err = execute(ring, job);
    } catch (const std::exception& e) {
      spdlog::error("swap dir {}: spill job failed: {}", dir_, e.what());
    }
    if (job.kind != Job::punch && spdlog::should_log(spdlog::level::debug)) {
      // The file's own part of a swap, apart from the device copy (tools/spill-bench.py).
      std::size_t n = 0;
      for (const Piece& p : job.pieces) n += p.size;
      spdlog::debug(
          "spill: {} {} bytes in {:.3f} ms: {}", job.kind == Job::write ? "wrote" : "read", n,
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
          err ? strerrorname_np(err) : "ok");
    }
    if (err && job.kind == Job::punch)
      spdlog::warn("swap dir {}: freeing spilled blocks: {}", dir_, strerrorname_np(err));
    try {
      if (job.done) job.done(err);
    } catch (const std::exception& e) {
      spdlog::error("swap dir {}: spill completion failed: {}", dir_, e.what());
    }
  }
}

}  // namespace salus::vgpu
