// Moves the bytes of `upload` and `download`: one thread per GPU drives device
// copies on streams of its own, and hands every read and write of a caller's
// file to CallerIo (per-uid threads; see caller_io.hpp), so that a file that
// never answers stalls only its own transfer. Each transfer goes in chunks
// through two staging blocks, so that the file side of one chunk overlaps the
// device side of the other. Neither a FUSE thread nor the broker lock ever
// waits for a transfer, and the engine thread never waits for a file.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vgpu/caller/caller_files.hpp"
#include "vgpu/caller/caller_io.hpp"
#include "vgpu/device.hpp"
#include "vgpu/transfer/staging_pool.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

struct TransferResult {
  int error = 0;  // 0, ECANCELED when cancelled, or what went wrong
  std::string why;
  Bytes bytes = 0;              // moved completely (both sides) before the end
  std::int64_t device_ns = 0;   // device time of its copies
  std::int64_t elapsed_ns = 0;  // from start to end
};

struct TransferJob {
  bool upload = true;     // into device memory; else out of it
  CallerFile file;        // open; for a download to a new file, where to create it
  CallerCredentials who;  // creates that file
  std::string shown;      // "shm:SEG" / "file:PATH" for messages
  Bytes file_offset = 0;
  DevOffset device_offset = 0;  // set by whoever submits, once the buffer is fixed
  Bytes length = 0;
  // A shared-memory segment: copied straight between its pages and the device
  // where the device can map them (no staging), kept mapped for the session's
  // next transfers.
  bool shm = false;
  std::uint64_t session = 0;  // whose mappings may be reused (see forget_session)
  // Called once, on the engine thread, with no engine lock held.
  std::function<void(TransferResult)> done;

  std::atomic<bool> cancel{false};
};

class TransferEngine {
 public:
  struct Options {
    Bytes chunk = Bytes{16} << 20;  // bytes per staging block
    // Transfers moving at once; more wait in order. A uid with nothing moving
    // may start one beyond it (up to kMaxActive), so that transfers stuck on
    // one user's files never hold up everyone else's.
    unsigned max_active = 4;
    // Where file reads and writes run; null: a CallerIo of the engine's own.
    CallerIo* io = nullptr;
    // Shared-memory segments stay mapped (on cuda, pinned) between transfers,
    // up to this many bytes per GPU; a segment beyond it is mapped for its
    // transfer alone.
    Bytes segment_cache = Bytes{4} << 30;
    Bytes direct_chunk = Bytes{64} << 20;  // bytes per direct copy
    // Files go straight into device memory the device lets this process
    // address (sim); false: through staging, as on cuda (kept selectable so
    // that path is tested on sim).
    bool device_view = true;
  };
  struct Stats {
    unsigned active = 0;
    unsigned waiting = 0;
    std::uint64_t started = 0;
    std::uint64_t completed = 0;
    std::uint64_t failed = 0;
    std::uint64_t cancelled = 0;
    std::uint64_t direct = 0;  // transfers copied straight from/to a segment's pages
    unsigned segments = 0;     // segments mapped now
    Bytes segment_bytes = 0;   // ... and their size
  };
  static constexpr unsigned kMaxActive = 16;

  // Starts the thread.
  TransferEngine(Device& device, StagingPool& staging, Options options, int gpu_index);
  ~TransferEngine();  // stop()
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  void submit(std::shared_ptr<TransferJob> job);
  // Stops a job soon: no new chunk starts, device copies in flight finish,
  // file reads and writes in flight are abandoned (they can no longer touch
  // its memory), its staging returns to the pool, and done() gets ECANCELED.
  void cancel(const std::shared_ptr<TransferJob>& job);
  // The session is gone: its segments are unmapped once no transfer uses them.
  void forget_session(std::uint64_t session);
  // Cancels everything, waits until it is all over, stops the thread. Idempotent.
  void stop();

  // Device completions for the engine's streams arrive here (from any thread).
  bool owns_stream(StreamId stream) const;
  void on_device_complete(StreamId stream, std::uint64_t token, int status, std::int64_t device_ns);

  Stats stats() const;
  const Options& options() const { return options_; }

 private:
  struct Active;
  struct FileIo;
  struct Create;
  struct Mailbox;
  // A caller's segment mapped into the device for direct copies.
  struct Segment {
    std::uint64_t session = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    // Changes on truncate, chmod and write faults: then mapped anew, since
    // pinned pages would no longer be the file's after a truncate.
    std::int64_t ctime_ns = 0;
    Bytes size = 0;
    bool writable = false;
    RegionId region = 0;
    UniqueFd fd;  // to see whether it was unlinked or changed
    unsigned users = 0;
    bool transient = false;  // over the cache limit: unmapped after its transfer
    std::uint64_t last_use = 0;
  };
  struct Slot {
    Active* owner = nullptr;
    StagingPool::Block block;
    enum class State : std::uint8_t { idle, file, device } state = State::idle;
    Bytes offset = 0;  // within the transfer
    Bytes length = 0;
    Bytes done = 0;              // file bytes of this chunk done so far
    std::shared_ptr<FileIo> io;  // its read or write with CallerIo, while state == file
  };
  struct Active {
    std::shared_ptr<TransferJob> job;
    unsigned stream_index = 0;
    std::array<Slot, 2> slots;
    Bytes next = 0;      // offset of the next chunk to start
    Bytes finished = 0;  // bytes that completed both sides
    int error = 0;
    std::string why;
    bool cancelled = false;
    std::int64_t device_ns = 0;
    std::int64_t started_ns = 0;
    Segment* segment = nullptr;      // direct: copies from/to its pages, no staging
    char* view = nullptr;            // device memory in reach: file I/O straight into it
    std::shared_ptr<UniqueFd> fd;    // the file, for its reads and writes in flight
    std::shared_ptr<Create> create;  // a download's missing file, being created
    Bytes eof = ~Bytes{0};           // the lowest file offset a read found the end at
  };
  struct DeviceDone {
    std::uint64_t token;
    int status;
    std::int64_t device_ns;
  };

  // What the other threads handed the engine since its last turn.
  struct Inbox {
    std::vector<DeviceDone> device_done;
    std::vector<std::uint64_t> forgotten;  // sessions whose segments may go
    std::vector<std::function<void()>> io_done;
    bool stopping = false;
  };

  void run();
  bool step();
  bool take_inbox(Inbox& in);
  void handle_inbox(Inbox& in);
  void retire_over();
  void check_segment_after(Active& a);
  TransferResult result_of(Active& a);
  void report_finished();
  bool note_idle();
  void wake();
  void start_waiting();
  void start(std::shared_ptr<TransferJob> job);
  void pump(Active& a);
  void file_io(Slot& s);
  void abandon(Slot& s);
  static int run_file_io(FileIo& io);
  void created(Create& c, int rc);
  void device_copy(Slot& s);
  void fail_at_eof_when_known(Active& a);
  void on_file_done(Slot& s, int res);
  void on_device_done(const DeviceDone& d);
  void fail(Active& a, int err, std::string why);
  bool over(const Active& a) const;
  Segment* acquire_segment(const TransferJob& job);
  void release_segment(Segment* seg);
  // Unmaps idle segments that are transient, changed, unlinked, or (everything)
  // all of them.
  void drop_segments(bool everything);
  Bytes cached_segment_bytes() const;
  void publish_segment_stats();

  Device& device_;
  StagingPool& staging_;
  const Options options_;
  const int gpu_;
  std::unique_ptr<CallerIo> own_io_;  // when options_.io is null
  CallerIo& io_;
  // Where CallerIo hands results back; shared with its jobs, which can outlive
  // the engine (a read that never returns).
  std::shared_ptr<Mailbox> mailbox_;

  // Shared with other threads.
  mutable std::mutex mu_;
  std::condition_variable quiet_;  // idle_ became true
  std::deque<std::shared_ptr<TransferJob>> incoming_;
  std::vector<DeviceDone> device_done_;
  std::vector<std::uint64_t> forgotten_;  // sessions that ended
  bool stopping_ = false;                 // stop(): cancel everything
  bool idle_ = false;                     // stopping and nothing left
  bool quit_ = false;                     // the destructor: leave the loop once idle
  Stats stats_;
  std::array<std::atomic<std::int64_t>, kMaxActive> streams_;  // StreamId or -1

  // The engine thread's own.
  std::deque<std::shared_ptr<TransferJob>> waiting_;
  std::list<Active> active_;
  std::array<bool, kMaxActive> stream_busy_{};
  std::unordered_map<std::uint64_t, Slot*> tokens_;
  std::uint64_t next_token_ = 1;
  std::vector<std::pair<std::shared_ptr<TransferJob>, TransferResult>> finished_;
  std::vector<std::pair<Slot*, int>> sync_done_;  // file I/O that failed before it was posted
  std::list<Segment> segments_;
  std::uint64_t use_clock_ = 0;

  std::thread thread_;
};

}  // namespace salus::vgpu
