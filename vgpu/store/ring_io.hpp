// The one io_uring helper of salusd: whole-range reads, writes and fsyncs on a
// file through a ring owned by this object (RAII), used by the session store's
// save/restore (session_store.cpp) and the hosted swap's spill file
// (vgpu/broker/spill_file.hpp). Blocking: call it only on a thread of its own,
// never on a FUSE thread or a GPU worker.
#pragma once

#include <liburing.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>

namespace salus::vgpu {

// Whole-range writes and reads through one io_uring, falling back to pwrite/pread
// where io_uring is not available. Not thread-safe: one ring per thread.
class RingIo {
 public:
  // Each submitted write or read moves at most `chunk` bytes.
  explicit RingIo(std::size_t chunk = std::size_t{8} << 20) : chunk_(chunk) {
    ok_ = io_uring_queue_init(8, &ring_, 0) == 0;
  }
  ~RingIo() {
    if (ok_) io_uring_queue_exit(&ring_);
  }
  RingIo(const RingIo&) = delete;
  RingIo& operator=(const RingIo&) = delete;

  // Writes or reads all of [data, data+n) at `off`; 0 or -errno.
  int write(int fd, const char* data, std::size_t n, off_t off) {
    return io(fd, const_cast<char*>(data), n, off, true);
  }
  int read(int fd, char* data, std::size_t n, off_t off) { return io(fd, data, n, off, false); }
  int fsync(int fd) {
    if (!ok_) return ::fsync(fd) == 0 ? 0 : -errno;
    io_uring_sqe* e = io_uring_get_sqe(&ring_);
    io_uring_prep_fsync(e, fd, 0);
    return complete();
  }

 private:
  int io(int fd, char* data, std::size_t n, off_t off, bool out) {
    while (n > 0) {
      ssize_t got;
      const unsigned len = static_cast<unsigned>(std::min<std::size_t>(n, chunk_));
      if (ok_) {
        io_uring_sqe* e = io_uring_get_sqe(&ring_);
        if (out)
          io_uring_prep_write(e, fd, data, len, static_cast<__u64>(off));
        else
          io_uring_prep_read(e, fd, data, len, static_cast<__u64>(off));
        got = complete();
      } else {
        got = out ? ::pwrite(fd, data, len, off) : ::pread(fd, data, len, off);
        if (got < 0) got = -errno;
      }
      if (got == -EINTR || got == -EAGAIN) continue;
      if (got < 0) return static_cast<int>(got);
      if (got == 0) return out ? -EIO : -ENODATA;  // a short file
      data += got;
      off += got;
      n -= static_cast<std::size_t>(got);
    }
    return 0;
  }
  int complete() {
    io_uring_submit(&ring_);
    io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) return rc;
    rc = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    return rc;
  }

  io_uring ring_{};
  std::size_t chunk_;
  bool ok_ = false;
};

}  // namespace salus::vgpu
