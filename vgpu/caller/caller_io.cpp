#include "vgpu/caller/caller_io.hpp"

#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

namespace salus::vgpu {

struct CallerIo::Gate::State {
  explicit State(Options o) : opt(o) {}
  struct PerUid {
    std::deque<Job> queued;
    unsigned running = 0;
  };
  const Options opt;
  std::mutex mu;
  std::condition_variable work;   // a job for an idle thread, or closing
  std::condition_variable quiet;  // `entered` fell to 0
  std::map<uid_t, PerUid> uids;
  uid_t last = 0;  // the uid served last: the next pick starts after it
  unsigned threads = 0, idle = 0, busy = 0, entered = 0;
  std::uint64_t jobs = 0;
  bool closed = false;

  unsigned eligible() const {
    unsigned n = 0;
    for (const auto& [uid, u] : uids)
      if (u.running < opt.per_uid)
        n += static_cast<unsigned>(std::min<std::size_t>(u.queued.size(), opt.per_uid - u.running));
    return n;
  }
  // The next job of a uid below its bound, round robin over uids.
  bool take(Job& job, uid_t& uid) {
    if (uids.empty()) return false;
    auto start = uids.upper_bound(last);
    for (std::size_t i = 0; i < uids.size(); ++i, ++start) {
      if (start == uids.end()) start = uids.begin();
      PerUid& u = start->second;
      if (u.queued.empty() || u.running >= opt.per_uid) continue;
      job = std::move(u.queued.front());
      u.queued.pop_front();
      ++u.running;
      uid = last = start->first;
      return true;
    }
    return false;
  }
};

namespace {

using State = CallerIo::Gate::State;

// Writes made for a caller obey the caller's disk quota and leave the
// root-reserved blocks alone, which CAP_SYS_RESOURCE would bypass; capabilities
// are per thread.
void drop_sys_resource() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &hdr, data) != 0) return;
  data[CAP_TO_INDEX(CAP_SYS_RESOURCE)].effective &= ~CAP_TO_MASK(CAP_SYS_RESOURCE);
  ::syscall(SYS_capset, &hdr, data);
}

void spawn_if_needed(const std::shared_ptr<State>& st);

void thread_loop(const std::shared_ptr<State>& st) {
  drop_sys_resource();
  std::unique_lock lk(st->mu);
  for (;;) {
    CallerIo::Job job;
    uid_t uid = 0;
    if (!st->closed && st->take(job, uid)) {
      ++st->busy;
      ++st->jobs;
      lk.unlock();
      spawn_if_needed(st);  // other uids' jobs may be waiting too
      try {
        CallerIo::Gate gate(*st);
        job(gate);
      } catch (const std::exception& e) {
        spdlog::error("caller I/O job threw: {}", e.what());
      } catch (...) {
        spdlog::error("caller I/O job threw a non-standard exception");
      }
      job = nullptr;  // its captures go without the lock held
      lk.lock();
      --st->busy;
      auto it = st->uids.find(uid);
      if (it != st->uids.end() && --it->second.running == 0 && it->second.queued.empty())
        st->uids.erase(it);
      continue;
    }
    if (st->closed) break;
    ++st->idle;
    const bool woke =
        st->work.wait_for(lk, st->opt.idle, [&] { return st->closed || st->eligible() > 0; });
    --st->idle;
    if (!woke) break;  // idle for long enough
  }
  --st->threads;
}

void spawn_if_needed(const std::shared_ptr<State>& st) {
  std::unique_lock lk(st->mu);
  if (st->closed) return;
  const unsigned want = st->eligible();
  if (want <= st->idle) {
    if (want > 0) st->work.notify_all();
    return;
  }
  if (st->idle > 0) st->work.notify_all();
  for (unsigned i = st->idle; i < want && st->threads < st->opt.max_threads; ++i) {
    ++st->threads;
    try {
      // Detached: a thread stuck in a caller's syscall must never be joined.
      std::thread([st] { thread_loop(st); }).detach();
    } catch (const std::exception& e) {
      --st->threads;  // the job stays queued; the next post or finish retries
      spdlog::warn("caller I/O: cannot start a thread: {}", e.what());
      return;
    }
  }
}

struct IsolatedArg {
  const std::function<void()>* fn;
  pid_t daemon;
};

int isolated_main(void* p) {
  const auto* a = static_cast<const IsolatedArg*>(p);
  // Left behind when salusd exits while this task is stuck: it must die the
  // moment its syscall returns, before it touches memory nobody owns any more.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != a->daemon) ::_exit(0);
  try {
    (*a->fn)();
  } catch (...) {
  }
  ::_exit(0);  // this task only: it is a thread group of its own
}

constexpr std::size_t kIsolatedStack = 1u << 20;

}  // namespace

int CallerIo::isolated(const std::function<void()>& fn) {
  void* stack = ::mmap(nullptr, kIsolatedStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) return errno;
  IsolatedArg arg{&fn, ::getpid()};
  // CLONE_VFORK: this thread sleeps (killably) until the task exits. No exit
  // signal: salusd's other children are reaped by pid, and so is this one.
  const pid_t pid = ::clone(isolated_main, static_cast<char*>(stack) + kIsolatedStack,
                            CLONE_VM | CLONE_FILES | CLONE_VFORK, &arg);
  if (pid < 0) {
    const int err = errno;
    ::munmap(stack, kIsolatedStack);
    return err;
  }
  while (::waitpid(pid, nullptr, __WALL) < 0 && errno == EINTR) {
  }
  ::munmap(stack, kIsolatedStack);
  return 0;
}

bool CallerIo::Gate::enter(const std::function<void()>& fn) {
  {
    std::lock_guard lk(s_.mu);
    if (s_.closed) return false;
    ++s_.entered;
  }
  struct Leave {
    State& s;
    ~Leave() {
      std::lock_guard lk(s.mu);
      if (--s.entered == 0) s.quiet.notify_all();
    }
  } leave{s_};
  fn();
  return true;
}

CallerIo::CallerIo(Options options) : st_(std::make_shared<Gate::State>(options)) {}

CallerIo::~CallerIo() {
  close();
}

int CallerIo::post(uid_t uid, Job job) {
  {
    std::lock_guard lk(st_->mu);
    if (st_->closed) return ESHUTDOWN;
    auto& u = st_->uids[uid];
    if (u.queued.size() >= st_->opt.queued_per_uid) return EAGAIN;
    u.queued.push_back(std::move(job));
  }
  spawn_if_needed(st_);
  return 0;
}

void CallerIo::close() {
  std::vector<Job> dropped;
  {
    std::unique_lock lk(st_->mu);
    st_->closed = true;
    for (auto& [uid, u] : st_->uids)
      for (auto& j : u.queued) dropped.push_back(std::move(j));
    for (auto& [uid, u] : st_->uids) u.queued.clear();
    st_->work.notify_all();
    st_->quiet.wait(lk, [&] { return st_->entered == 0; });
  }
  dropped.clear();
}

CallerIo::Stats CallerIo::stats() const {
  std::lock_guard lk(st_->mu);
  Stats s;
  s.threads = st_->threads;
  s.busy = st_->busy;
  for (const auto& [uid, u] : st_->uids) s.queued += static_cast<unsigned>(u.queued.size());
  s.jobs = st_->jobs;
  return s;
}

}  // namespace salus::vgpu
