// Threads for everything that touches what a caller named: opening and reading
// the files of `module`, `upload` and `download`, and moving a transfer's file
// bytes. A path can lead to a filesystem that never answers (a dead NFS hard
// mount, a hostile FUSE mount), and a syscall stuck there cannot be cancelled:
// so no FUSE thread, broker worker or transfer engine ever makes one. They post
// a job here instead and hear back through a callback.
//
// Jobs run per uid in arrival order, at most `per_uid` of one uid at once: a
// uid whose jobs hang holds its own slots and nothing else, and other uids'
// jobs run on other threads. Threads are made on demand and leave when idle. A
// thread stuck in a syscall is never joined: close() waits only for callbacks
// into the owner (Gate::enter), so the owner can go while it is still stuck.
//
// A thread is not enough on its own: a syscall waiting for a FUSE server that
// has read the request cannot be killed, not even by SIGKILL, and a process
// exits only once all its threads have. So the syscalls themselves run in a
// task of their own (isolated(): a clone sharing memory and files but not the
// thread group), which the pool thread waits for killably. salusd can then
// always exit; a task still stuck is left behind and dies as soon as its
// syscall returns.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

namespace salus::vgpu {

class CallerIo {
 public:
  struct Options {
    unsigned per_uid = 4;                  // jobs of one uid running at once
    unsigned queued_per_uid = 4096;        // jobs of one uid waiting; more are refused
    unsigned max_threads = 256;            // all uids together
    std::chrono::milliseconds idle{5000};  // an idle thread leaves after this
  };
  struct Stats {
    unsigned threads = 0;  // alive, stuck ones included
    unsigned busy = 0;     // running a job
    unsigned queued = 0;   // waiting for a slot of their uid or a thread
    std::uint64_t jobs = 0;
  };
  // Lets a job call back into the pool's owner, unless the pool was closed.
  class Gate {
   public:
    // Runs `fn` and returns true, or returns false once the pool is closed.
    // close() waits for calls in progress; `fn` must not block on a caller.
    bool enter(const std::function<void()>& fn);

    struct State;  // the pool's shared state (caller_io.cpp)
    explicit Gate(State& s) : s_(s) {}

   private:
    State& s_;
  };
  using Job = std::function<void(Gate&)>;

  explicit CallerIo(Options options);
  ~CallerIo();  // close()
  CallerIo(const CallerIo&) = delete;
  CallerIo& operator=(const CallerIo&) = delete;

  // Runs `fn` in a task of its own that shares this process's memory and file
  // descriptors (clone with CLONE_VM | CLONE_FILES | CLONE_VFORK) and returns
  // when it is done: 0, or a positive errno if no task could be made. For the blocking
  // part of a job only: `fn` must not take locks that other threads hold for
  // long, and must not throw.
  static int isolated(const std::function<void()>& fn);

  // Queues `job` for `uid`. 0, EAGAIN when the uid has too many waiting, or
  // ESHUTDOWN once closed. The job runs with no lock held and may block.
  int post(uid_t uid, Job job);
  // Refuses new jobs, drops the waiting ones, and waits for Gate::enter calls
  // in progress; jobs stuck elsewhere are abandoned. Idempotent.
  void close();
  Stats stats() const;

 private:
  std::shared_ptr<Gate::State> st_;
};

}  // namespace salus::vgpu
