// The program's side of the gate (client/salus_gate.h): attaching to the
// session, iteration boundaries, completing iterations on the GPU, and running
// on ungated when salusd is gone.
//
// Nothing here is on the launch path: boundaries are per iteration, and may
// take locks, make syscalls and wait.
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "client/shim/shim.hpp"

#define SALUS_EXPORT __attribute__((visibility("default")))

namespace salus::shim {
namespace {

// The gate while not attached: private, no limit until a session sets one.
// Constant-initialised: hooks may run before the shim's constructors.
constexpr salus_gate private_gate() {
  salus_gate g{};
  g.magic = SALUS_GATE_MAGIC;
  g.version = SALUS_GATE_VERSION;
  g.size = sizeof(salus_gate);
  g.state = SALUS_GATE_DETACHED;
  g.budget_bytes = UINT64_MAX;
  return g;
}
constinit salus_gate g_local = private_gate();

std::atomic<bool> g_cuda_up{false};   // cuInit succeeded through the shim
std::atomic<bool> g_uses_gpu{false};  // device memory was allocated (the gate's uses_gpu)
std::atomic<int> g_bell{-1};          // the current gate's doorbell
constexpr std::size_t kMaxEvents = 64;
constexpr auto kReattachEvery = std::chrono::seconds(1);
using Clock = std::chrono::steady_clock;

std::uint64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

void ring(int bell) {
  if (bell < 0) return;
  const std::uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(bell, &one, sizeof one);
}

// A condition variable straight on pthreads: std::condition_variable::wait is
// a GLIBCXX_3.4.30 symbol, which would keep the shim out of images whose
// libstdc++ predates GCC 12.
struct Cond {
  pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
  void wait(std::unique_lock<std::mutex>& lk) {
    ::pthread_cond_wait(&cv, lk.mutex()->native_handle());
  }
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred pred) {
    while (!pred()) wait(lk);
  }
  void notify_all() { ::pthread_cond_broadcast(&cv); }
};

// An iteration whose end the completion thread waits for, in order.
struct Pending {
  salus_gate* gate;    // null: not attached at that boundary (only timing continuity)
  std::uint64_t iter;  // the gate's iteration number
  int bell;
  CUevent event;  // null: no CUDA context; wall_ns is the iteration's time
  CUcontext ctx;
  std::uint64_t wall_ns;
};

struct Client {
  std::mutex mu;  // boundaries and attaching
  std::atomic<std::uint64_t> boundaries{0};
  std::uint64_t gate_iter = 0;  // boundaries passed on the current gate
  std::uint64_t iter_start = now_ns();
  std::uint32_t marking = SALUS_MARK_NONE;
  CUcontext last_ctx = nullptr;  // of the last boundary that had one
  bool attempted = false;        // a first attach was tried
  bool forbidden = false;        // never attach (forked child, or salusd said no for good)
  // Refused (EBUSY) before this process allocated device memory: another
  // process of the job holds the session. Its first allocation tries once
  // more, as a process that uses the GPU may take the session over from a
  // launcher (salus_gate.h, hand-over). Written under `mu`; read without it by
  // the first allocation, which takes `mu` only when it has an attach to make
  // (never behind a boundary's wait).
  std::atomic<bool> retry_at_first_use{false};
  int memfd = -1;
  bool ever_attached = false;
  Clock::time_point attached_at{};  // of the last successful attach
  Clock::time_point last_attempt{};
  int reported_errno = 0;
  // A clone session made again after a salusd restart (remake_session): its
  // directory, and the clone descriptor held for the program's life, so that
  // the session ends with the program as the one salus-run made would have.
  std::string remade_dir;
  int clone_fd = -1;

  std::mutex qmu;  // the completion queue and the event pool
  Cond qcv;
  std::deque<Pending> queue;
  std::vector<CUevent> free_events;
  std::size_t events_made = 0;
  bool thread_started = false;
};
// Never destroyed (the completion thread may outlive static destructors);
// replaced in a forked child.
std::atomic<Client*> g_client{nullptr};
Client& client() {
  Client* c = g_client.load(std::memory_order_acquire);
  if (c != nullptr) return *c;
  auto* fresh = new Client;
  if (g_client.compare_exchange_strong(c, fresh)) return *fresh;
  delete fresh;
  return *c;
}

thread_local bool t_in_boundary = false;

// ---- completion of iterations ----

void complete(const Pending& p, std::uint64_t ns) {
  if (p.gate == nullptr) return;
  __atomic_fetch_add(&p.gate->gpu_ns_total, ns, __ATOMIC_RELAXED);
  __atomic_store_n(&p.gate->completed, p.iter, __ATOMIC_RELEASE);
  ring(p.bell);
}

[[noreturn]] void completion_loop(Client* c) {
  CUevent prev = nullptr;
  CUcontext current = nullptr;
  for (;;) {
    Pending p;
    {
      std::unique_lock lk(c->qmu);
      c->qcv.wait(lk, [&] { return !c->queue.empty(); });
      p = c->queue.front();
      c->queue.pop_front();
    }
    std::uint64_t ns = p.wall_ns;
    if (p.event == nullptr && prev != nullptr) {
      // A boundary without an event (no context then): the next event's
      // predecessor is unknown, and must not span this iteration twice.
      std::lock_guard lk(c->qmu);
      c->free_events.push_back(prev);
      prev = nullptr;
      c->qcv.notify_all();
    }
    if (p.event != nullptr) {
      const Driver& d = driver();  // loaded only once a boundary had CUDA
      if (p.ctx != current && d.ctx_set_current(p.ctx) == CUDA_SUCCESS) current = p.ctx;
      ns = 0;
      float ms = 0;
      if (d.event_synchronize(p.event) == CUDA_SUCCESS && prev != nullptr &&
          d.event_elapsed(&ms, prev, p.event) == CUDA_SUCCESS && ms > 0)
        ns = static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6);
      std::lock_guard lk(c->qmu);
      if (prev != nullptr) c->free_events.push_back(prev);
      prev = p.event;
      c->qcv.notify_all();
    }
    complete(p, ns);
  }
}

// An event for a boundary: from the pool, or new while fewer than kMaxEvents
// exist, else wait until the GPU catches up (only a program far ahead of its
// GPU waits here). Needs the caller's context current.
CUevent take_event(Client& c) {
  const Driver& d = driver();
  std::unique_lock lk(c.qmu);
  for (;;) {
    if (!c.free_events.empty()) {
      CUevent e = c.free_events.back();
      c.free_events.pop_back();
      return e;
    }
    if (c.events_made < kMaxEvents) {
      ++c.events_made;
      lk.unlock();
      CUevent e = nullptr;
      if (d.event_create(&e, CU_EVENT_BLOCKING_SYNC) != CUDA_SUCCESS) e = nullptr;
      return e;
    }
    c.qcv.wait(lk);
  }
}

// Ends the running iteration: an event on `stream` (the legacy default stream
// for salus_step) when the program has a CUDA context on this thread, else its
// wall time. Caller holds c.mu.
void end_iteration(Client& c, salus_gate* g, std::uint64_t iter, CUstream stream) {
  Pending p{g, iter, g_bell.load(), nullptr, nullptr, now_ns() - c.iter_start};
  const Driver* d = g_cuda_up.load() ? &driver() : nullptr;  // CPU-only: never load libcuda
  if (d != nullptr && d->ok && d->ctx_get_current(&p.ctx) == CUDA_SUCCESS) {
    // A thread without a context (a Python thread calling salus.step()) records
    // in the context of the last boundary, and is given its own state back.
    const bool borrowed =
        p.ctx == nullptr && c.last_ctx != nullptr && d->ctx_set_current(c.last_ctx) == CUDA_SUCCESS;
    if (borrowed) p.ctx = c.last_ctx;
    // Never record into a CUDA graph being captured (an optimizer hook fires
    // inside torch.cuda.graph capture too): with a capture under way the event
    // record would fail and invalidate it. Such a boundary is timed by the clock.
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    if (p.ctx != nullptr && (d->stream_is_capturing(stream, &capture) != CUDA_SUCCESS ||
                             capture != CU_STREAM_CAPTURE_STATUS_NONE))
      p.ctx = nullptr;
    if (p.ctx != nullptr) {
      c.last_ctx = p.ctx;
      p.event = take_event(c);
      if (p.event != nullptr && d->event_record(p.event, stream) != CUDA_SUCCESS) {
        std::lock_guard lk(c.qmu);
        c.free_events.push_back(p.event);
        p.event = nullptr;
      }
    }
    if (borrowed) d->ctx_set_current(nullptr);
  }
  if (p.event == nullptr && g == nullptr) return;  // nothing to time or report
  std::unique_lock lk(c.qmu);
  if (p.event == nullptr && c.events_made == 0) {
    // A program without CUDA (so far): its iteration ends here, in order by
    // construction. Completing it inline saves a thread wake-up per boundary.
    lk.unlock();
    complete(p, p.wall_ns);
    return;
  }
  c.queue.push_back(p);
  if (!c.thread_started) {
    c.thread_started = true;
    std::thread(completion_loop, &c).detach();
  }
  c.qcv.notify_all();
}

// ---- attaching ----

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

// $SALUS_SESSION as `salusctl run` sets it (a path), or a name under
// $SALUS_MOUNT/sessions.
std::string session_dir() {
  const std::string s = env("SALUS_SESSION"), m = env("SALUS_MOUNT");
  if (s.empty() || m.empty()) return {};
  if (s.find('/') != std::string::npos) return s;
  return m + "/sessions/" + s;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The rest of the line that starts with `key` in salusd's file `path` (its
// first 8 KiB), or empty when there is none or the file cannot be read.
std::string line_value(const std::string& path, std::string_view key) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  char buf[8192];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  if (n <= 0) return {};
  const std::string_view text(buf, static_cast<std::size_t>(n));
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t eol = std::min(text.find('\n', at), text.size());
    const std::string_view line = text.substr(at, eol - at);
    if (line.substr(0, key.size()) == key) return std::string(line.substr(key.size()));
    at = eol + 1;
  }
  return {};
}

// How long the salusd now serving $SALUS_MOUNT has run (`uptime_s` of its
// `stats`, salus(5)), or -1 if none answers.
double salusd_uptime_s() {
  const std::string v = line_value(env("SALUS_MOUNT") + "/stats", "uptime_s ");
  char* end = nullptr;
  const double s = std::strtod(v.c_str(), &end);
  return v.empty() || end == v.c_str() ? -1 : s;
}

bool all_digits(std::string_view name) {
  return !name.empty() && name.find_first_not_of("0123456789") == std::string_view::npos;
}

// A descriptor of a fresh clone session with `need $SALUS_NEED` written, or -1.
// Its directory goes to `c.remade_dir`; the descriptor stays in `c.clone_fd`.
int remake_clone_session(Client& c, const std::string& mount) {
  const int fd = ::open((mount + "/clone").c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  char id[32];
  const ssize_t n = ::read(fd, id, sizeof id - 1);
  const std::string need = env("SALUS_NEED");
  const std::string line = "need " + need + "\n";
  if (n <= 0 || (!need.empty() &&
                 ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))) {
    const int err = n <= 0 || errno == 0 ? EIO : errno;
    ::close(fd);  // the half-made session ends here
    errno = err;
    return -1;
  }
  std::string_view name(id, static_cast<std::size_t>(n));
  while (!name.empty() && name.back() == '\n') name.remove_suffix(1);
  if (c.clone_fd >= 0) ::close(c.clone_fd);  // the dead salusd's session
  c.clone_fd = fd;
  c.remade_dir = mount + "/sessions/" + std::string(name);
  std::fprintf(stderr, "salus-shim: salusd restarted; the session is made again as %s\n",
               c.remade_dir.c_str());
  return ::dup(fd);  // written to and closed like a ctl
}

// After salusd restarted, the session is gone: make it again with `need` from
// $SALUS_NEED, and return a descriptor to attach through (or -1). A named
// session is made again under its name; a clone session (an all-digit name,
// as salus-run and `salusctl run` make) cannot be, so the shim opens a clone
// session of its own. Only on a mounted salus (FUSE), so that nothing is
// created in the empty mount point of a stopped salusd.
int remake_session(Client& c, const std::string& dir) {
  struct statfs fs {};
  const std::string m = env("SALUS_MOUNT");
  constexpr long kFuseSuperMagic = 0x65735546;
  if (::statfs(m.c_str(), &fs) != 0 || fs.f_type != kFuseSuperMagic) {
    errno = ENOENT;  // no salusd mounted there: the session is still gone
    return -1;
  }
  const std::string_view name = std::string_view(dir).substr(dir.rfind('/') + 1);
  if (all_digits(name)) return remake_clone_session(c, m);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return -1;
  std::fprintf(stderr, "salus-shim: salusd restarted; the session is made again as %s\n",
               dir.c_str());
  const std::string need = env("SALUS_NEED");
  if (!need.empty()) {
    const int fd = ::open((dir + "/ctl").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    const std::string line = "need " + need + "\n";
    [[maybe_unused]] ssize_t n = ::write(fd, line.data(), line.size());
    ::close(fd);
  }
  return ::open((dir + "/ctl").c_str(), O_WRONLY | O_CLOEXEC);
}

// A sealed memfd holding a filled-in gate, mapped; null on failure.
salus_gate* make_gate(Client& c, const salus_gate* from) {
  const int fd = ::memfd_create("salus-gate", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return nullptr;
  void* p = MAP_FAILED;
  if (::ftruncate(fd, sizeof(salus_gate)) == 0)
    p = ::mmap(nullptr, sizeof(salus_gate), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED || ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    if (p != MAP_FAILED) ::munmap(p, sizeof(salus_gate));
    ::close(fd);
    return nullptr;
  }
  auto* g = static_cast<salus_gate*>(p);  // zero-filled by ftruncate
  g->magic = SALUS_GATE_MAGIC;
  g->version = SALUS_GATE_VERSION;
  g->size = sizeof(salus_gate);
  g->pid = static_cast<std::int32_t>(::getpid());
  g->uses_gpu = g_uses_gpu.load() ? 1 : 0;
  g->state = SALUS_GATE_ATTACHING;
  g->budget_bytes = __atomic_load_n(&from->budget_bytes, __ATOMIC_ACQUIRE);
  g->requested = 1;  // the program waits for iteration 1 right after attaching
  g->charged_bytes = charged_now();
  g->peak_bytes = __atomic_load_n(&from->peak_bytes, __ATOMIC_RELAXED);
  g->launches = __atomic_load_n(&from->launches, __ATOMIC_RELAXED);
  g->oom_refusals = __atomic_load_n(&from->oom_refusals, __ATOMIC_RELAXED);
  g->gate_waits = __atomic_load_n(&from->gate_waits, __ATOMIC_RELAXED);
  g->gate_wait_ns = __atomic_load_n(&from->gate_wait_ns, __ATOMIC_RELAXED);
  g->marking = c.marking;
  c.memfd = fd;
  return g;
}

// The pid of the process attached to session `dir` (`pid` in its status), or
// empty when none or unreadable.
std::string holder_of(const std::string& dir) {
  const std::string pid = line_value(dir + "/status", "pid: ");
  return all_digits(pid) ? pid : std::string();
}

void report(Client& c, const std::string& dir, int err) {
  if (err == c.reported_errno) return;
  c.reported_errno = err;
  if (const std::string pid = err == EBUSY ? holder_of(dir) : std::string(); !pid.empty()) {
    std::fprintf(stderr,
                 "salus-shim: cannot attach to %s: pid %s holds the session (one process of a "
                 "job is gated); this process runs ungated\n",
                 dir.c_str(), pid.c_str());
    return;
  }
  std::fprintf(stderr, "salus-shim: cannot attach to %s: %s; running ungated%s\n", dir.c_str(),
               std::strerror(err), c.forbidden ? "" : " (trying again at iteration boundaries)");
}

// Salusd's answers that will not change by trying again.
bool final_refusal(int err) {
  return err == EINVAL || err == EBUSY || err == EEXIST || err == EPERM || err == EACCES ||
         err == EBADF || err == ENOTSUP;
}

bool wait_grant(Client& c, salus_gate* g, std::uint64_t want);
void go_local(Client& c, salus_gate* g);

// Whether salusd's `state` lets the program go (detached, or handed over).
bool let_go(std::uint32_t state) {
  return state == SALUS_GATE_DETACHED || state == SALUS_GATE_HANDED_OVER;
}

// Attaches to the session (caller holds c.mu) and waits for the grant of the
// gate's iteration 1. Returns whether the program is attached.
bool try_attach(Client& c, bool reattach) {
  c.attempted = true;
  c.last_attempt = Clock::now();
  const std::string dir = c.remade_dir.empty() ? session_dir() : c.remade_dir;
  if (c.forbidden || dir.empty()) return false;
  int ctl = ::open((dir + "/ctl").c_str(), O_WRONLY | O_CLOEXEC);
  if (ctl < 0 && errno == ENOENT && reattach && c.ever_attached) {
    // A session we were attached to is gone. If the salusd serving the mount
    // has run since before we attached, the session was ended on purpose
    // (rmdir, kill): stay ungated. If it started since (a restart), make the
    // session again. With no salusd answering, try again later. A session the
    // program never attached to is never made.
    const double up = salusd_uptime_s();
    if (up >= 0 && up >= seconds_since(c.attached_at)) {
      c.forbidden = true;
      report(c, dir, ENOENT);
      return false;
    }
    if (up >= 0) ctl = remake_session(c, dir);
  }
  if (ctl < 0) {
    report(c, dir, errno);
    return false;
  }
  salus_gate* old = gate();
  salus_gate* g = make_gate(c, old);
  const int bell = g == nullptr ? -1 : ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  int err = g == nullptr ? errno : bell < 0 ? errno : 0;
  if (err == 0) {
    char line[96];
    const int lane = lane_socket_for_attach();  // -1 unless SALUS_SHARED_LANE=1
    const int len =
        lane < 0 ? std::snprintf(line, sizeof line, "attach gate=%d bell=%d\n", c.memfd, bell)
                 : std::snprintf(line, sizeof line, "attach gate=%d bell=%d lane=%d%s\n", c.memfd,
                                 bell, lane, lane_room_mode() ? " lane_room=1" : "");
    if (::write(ctl, line, static_cast<std::size_t>(len)) != len) err = errno != 0 ? errno : EIO;
    lane_attach_done(err == 0);
  }
  ::close(ctl);
  if (err != 0) {
    if (g != nullptr) ::munmap(g, sizeof(salus_gate));
    if (bell >= 0) ::close(bell);
    if (c.memfd >= 0) ::close(c.memfd);
    c.memfd = -1;
    c.forbidden = final_refusal(err);
    // Busy before any GPU memory: a launcher's worker importing torch while its
    // parent holds the session, or a DataLoader worker. Quiet: the first
    // allocation tries again.
    c.retry_at_first_use = err == EBUSY && !g_uses_gpu.load();
    if (!c.retry_at_first_use) report(c, dir, err);
    return false;
  }
  // The old gate (private, or a dead session's page) stays mapped: hooks on
  // other threads may still be counting into it. Its doorbell stays open too,
  // so that a late ring never writes into a reused descriptor.
  g_bell.store(bell);
  g_gate.store(g, std::memory_order_release);
  c.ever_attached = true;
  c.attached_at = Clock::now();
  c.gate_iter = 0;
  c.reported_errno = 0;
  return wait_grant(c, g, 1);
}

// Back to the private gate (salusd gone or let go): run ungated, keep the
// budget salusd gave, count on. Caller holds c.mu.
void go_local(Client& c, salus_gate* g) {
  if (g == &g_local) return;
  for (auto f : {&salus_gate::budget_bytes, &salus_gate::peak_bytes, &salus_gate::launches,
                 &salus_gate::oom_refusals, &salus_gate::gate_waits, &salus_gate::gate_wait_ns})
    __atomic_store_n(&(g_local.*f), __atomic_load_n(&(g->*f), __ATOMIC_RELAXED), __ATOMIC_RELAXED);
  g_local.charged_bytes = charged_now();
  g_local.marking = c.marking;
  g_gate.store(&g_local, std::memory_order_release);
  g_bell.store(-1);
  lane_detach(g);  // salusd let go: the lane memory is no longer the program's
  if (c.memfd >= 0) ::close(c.memfd);
  c.memfd = -1;
  c.last_attempt = Clock::now();
  const std::uint32_t state = __atomic_load_n(&g->state, __ATOMIC_ACQUIRE);
  if (state == SALUS_GATE_HANDED_OVER) {
    c.forbidden = true;  // the job's process that uses the GPU holds the session now
    return;
  }
  std::fprintf(stderr, "salus-shim: salusd %s; running ungated\n",
               state == SALUS_GATE_DETACHED ? "let go of the session" : "stopped answering");
}

// Waits until `granted` >= want. Returns false (and goes local) when salusd
// detached or its heartbeat stood still for SALUS_GATE_DEAD_MS.
bool wait_grant(Client& c, salus_gate* g, std::uint64_t want) {
  const std::uint64_t t0 = now_ns();
  std::uint64_t beat = __atomic_load_n(&g->heartbeat, __ATOMIC_ACQUIRE);
  std::uint64_t beat_at = t0;
  bool rang = false;
  for (;;) {
    const std::uint32_t word = __atomic_load_n(&g->grant_word, __ATOMIC_ACQUIRE);
    if (let_go(__atomic_load_n(&g->state, __ATOMIC_ACQUIRE))) break;
    const bool granted = __atomic_load_n(&g->granted, __ATOMIC_ACQUIRE) >= want;
    // A swap request is carried out here, while the program waits (never on a
    // launch); a grant brings swapped memory back before the program runs.
    serve_swap(g, granted);
    serve_lane(g, granted);  // the yield report of a shared lane, or its mapping
    if (granted && !ensure_resident(g)) {
      // No room on the GPU yet (salusd granted too early): wait and try again.
      struct timespec ts {
        0, 100'000'000
      };
      ::syscall(SYS_futex, &g->grant_word, FUTEX_WAIT, word, &ts, nullptr, 0);
      continue;
    }
    if (granted) {
      if (rang) {
        __atomic_fetch_add(&g->gate_waits, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g->gate_wait_ns, now_ns() - t0, __ATOMIC_RELAXED);
      }
      return true;
    }
    if (!rang) {
      ring(g_bell.load());
      rang = true;
    }
    struct timespec ts {
      0, 100'000'000
    };
    ::syscall(SYS_futex, &g->grant_word, FUTEX_WAIT, word, &ts, nullptr, 0);
    const std::uint64_t b = __atomic_load_n(&g->heartbeat, __ATOMIC_ACQUIRE), t = now_ns();
    if (b != beat) {
      beat = b;
      beat_at = t;
    } else if (t - beat_at >= std::uint64_t{SALUS_GATE_DEAD_MS} * 1'000'000) {
      break;
    }
  }
  go_local(c, g);
  // Ungated from now on: the memory must be back before the program runs on.
  for (bool told = false; !ensure_resident(g); told = true) {
    if (!told) std::fprintf(stderr, "salus-shim: waiting for room to bring swapped memory back\n");
    ::usleep(100'000);
  }
  return false;
}

void set_marking(Client& c, std::uint32_t marking) {
  if (c.marking == SALUS_MARK_EXPLICIT) return;
  __atomic_store_n(&c.marking, marking, __ATOMIC_RELAXED);  // read by launch hooks
  __atomic_store_n(&gate()->marking, marking, __ATOMIC_RELAXED);
}

// An iteration boundary. Returns 0 if the program is attached afterwards,
// else -ENOTCONN (it runs ungated).
int boundary(std::uint32_t marking, CUstream stream) {
  Client& c = client();
  std::lock_guard lk(c.mu);
  set_marking(c, marking);
  c.boundaries.fetch_add(1, std::memory_order_relaxed);
  salus_gate* g = gate();
  const bool attached = g != &g_local;
  // Ask for the next iteration before this one can be reported complete (a
  // program without CUDA completes it inline): salusd must never see the
  // session between two iterations with nothing requested, or FIFO, SRTF and
  // PRIORITY hand the lane to another session at every boundary.
  if (attached) __atomic_store_n(&g->requested, c.gate_iter + 2, __ATOMIC_RELEASE);
  end_iteration(c, attached ? g : nullptr, attached ? ++c.gate_iter : 0, stream);
  if (const std::size_t live = lane_boundary(); live > 0) {
    char line[128];
    std::snprintf(line, sizeof line,
                  "shared lane: %zu lane allocation(s) still live at the boundary; they end "
                  "there (ephemeral)",
                  live);
    post_note(line);
  }
  bool ok = false;
  if (attached) {
    ok = wait_grant(c, g, c.gate_iter + 1);
  } else if (!c.attempted || Clock::now() - c.last_attempt >= kReattachEvery) {
    ok = try_attach(c, c.attempted);
  }
  c.iter_start = now_ns();
  return ok ? 0 : -ENOTCONN;
}

void on_fork_child() {
  // The child is not the session's program: it runs ungated and never attaches.
  salus_gate* g = gate();
  if (g != &g_local) {
    g_local.budget_bytes = __atomic_load_n(&g->budget_bytes, __ATOMIC_RELAXED);
    g_local.launches = __atomic_load_n(&g->launches, __ATOMIC_RELAXED);
  }
  g_gate.store(&g_local);
  g_bell.store(-1);
  lane_forget_in_child();
  // The parent's re-made session ends with the parent, not with this child.
  if (Client* parent = g_client.load(); parent != nullptr && parent->clone_fd >= 0)
    ::close(parent->clone_fd);
  auto* c = new Client;
  c->forbidden = true;
  c->attempted = true;
  g_client.store(c);
}

[[gnu::constructor]] void install_fork_handler() {
  ::pthread_atfork(nullptr, nullptr, on_fork_child);
}

}  // namespace

std::atomic<salus_gate*> g_gate{&g_local};

void after_cuinit() {
  if (g_cuda_up.exchange(true)) return;
  Client& c = client();
  std::lock_guard lk(c.mu);
  if (!c.attempted) try_attach(c, false);
}

void note_gpu_use() {
  if (g_uses_gpu.load(std::memory_order_relaxed) || g_uses_gpu.exchange(true)) return;
  // Attached before (at import torch, at cuInit): the gate says so from now on,
  // and the session stays this process's (no descendant takes it over). A gate
  // made from now on reads g_uses_gpu.
  if (salus_gate* g = gate(); g != &g_local) __atomic_store_n(&g->uses_gpu, 1u, __ATOMIC_RELEASE);
  Client& c = client();
  if (!c.retry_at_first_use.load()) return;
  std::lock_guard lk(c.mu);
  if (!c.retry_at_first_use.exchange(false)) return;
  c.forbidden = false;
  c.reported_errno = 0;
  try_attach(c, false);
}

void implicit_boundary(CUstream stream) {
  if (t_in_boundary || __atomic_load_n(&client().marking, __ATOMIC_RELAXED) == SALUS_MARK_EXPLICIT)
    return;
  const Driver& d = driver();
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  if (!d.ok || d.stream_is_capturing(stream, &st) != CUDA_SUCCESS ||
      st != CU_STREAM_CAPTURE_STATUS_NONE)
    return;  // never record into (or invalidate) a graph being captured
  t_in_boundary = true;
  boundary(SALUS_MARK_SLICE, stream);
  t_in_boundary = false;
}

void ring_bell() {
  ring(g_bell.load());
}

void post_note(const char* text) {
  static std::atomic_flag busy = ATOMIC_FLAG_INIT;
  while (busy.test_and_set(std::memory_order_acquire)) {
  }
  salus_gate* g = gate();
  std::snprintf(g->note, sizeof g->note, "%s", text);
  __atomic_fetch_add(&g->note_seq, 1, __ATOMIC_RELEASE);
  busy.clear(std::memory_order_release);
  ring(g_bell.load());
  if (g == &g_local) std::fprintf(stderr, "salus-shim: %s\n", text);
}

}  // namespace salus::shim

using namespace salus::shim;

extern "C" SALUS_EXPORT int salus_step(void) {
  return boundary(SALUS_MARK_EXPLICIT, nullptr);
}

extern "C" SALUS_EXPORT int salus_attached(void) {
  salus_gate* g = gate();
  return g != &g_local && __atomic_load_n(&g->state, __ATOMIC_ACQUIRE) == SALUS_GATE_ATTACHED;
}

extern "C" SALUS_EXPORT uint64_t salus_iterations(void) {
  return client().boundaries.load(std::memory_order_relaxed);
}
