// The hosted swap's spill file (issue 15): past --swap-host-limit, a swapped-out
// session's bytes go to an unnamed file (O_TMPFILE) in --swap-dir instead of
// host memory. Every read, write and hole punch runs on this file's own thread
// through io_uring (RingIo), so neither a FUSE thread nor a GPU worker ever waits
// on the disk; each job reports back through a callback on that thread. The file
// has no name, so a crash leaves nothing on disk.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

class RingIo;

class SpillFile {
 public:
  struct Piece {
    char* data;
    std::size_t size;
    off_t offset;
  };
  // Called on the spill thread with 0 or an errno (ENOSPC: the disk is full;
  // ECANCELED: the file closed first).
  using Done = std::function<void(int err)>;

  // The file in `dir`, or nullptr with `why` (no such directory, no O_TMPFILE).
  static std::unique_ptr<SpillFile> open(const std::string& dir, std::string& why);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  // Room for `n` bytes: the first freed extent that holds them, else the end.
  off_t reserve(std::size_t n);
  // Gives an extent back; its disk space is freed (a hole punched, in order with
  // the jobs already queued) so a spill that passed leaves no blocks behind.
  void release(off_t off, std::size_t n);
  // Queues the writes (or reads) of every piece, then `done`.
  void submit(bool write, std::vector<Piece> pieces, Done done);
  std::uint64_t bytes_reserved() const;
  const std::string& dir() const { return dir_; }

 private:
  SpillFile(UniqueFd fd, std::string dir);
  struct Job {
    enum Kind { write, read, punch } kind;
    std::vector<Piece> pieces;
    Done done;
  };
  void run();
  int execute(RingIo& ring, Job& job);

  UniqueFd fd_;
  std::string dir_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::map<off_t, std::size_t> free_;  // freed extents by offset, merged
  off_t end_ = 0;
  std::uint64_t reserved_ = 0;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace salus::vgpu
