#include "vgpu/store/session_store.hpp"
#include "vgpu/store/ring_io.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

namespace {

constexpr const char* kMagic = "salus-session-state 1";
constexpr const char* kCurrent = "sessions";
constexpr const char* kNew = "sessions.new";
constexpr const char* kSetAside = "set-aside";
constexpr const char* kStateFile = "session.state";
constexpr Bytes kChunk = Bytes{8} << 20;
// The least a save waits for one chunk: the data must move even when the grace
// period is 0 or used up; a session whose queued work ends later is left out.
constexpr std::chrono::seconds kChunkWait{5};
constexpr std::chrono::seconds kFirstChunkWait{1};

std::string errno_text(int e) {
  return std::strerror(e);
}

// ---------------------------------------------------------------- files

// Opens (creating it 0700 if missing) the state directory and checks that it is
// salusd's own and closed to everyone else: its files hold other users' data.
UniqueFd open_state_dir(const std::string& dir, std::string& why) {
  if (dir.empty() || dir[0] != '/') {
    why = fmt::format("state dir '{}' is not an absolute path", dir);
    return {};
  }
  // Parents as `mkdir -p` would make them; the state dir itself 0700.
  for (std::size_t pos = dir.find('/', 1); pos != std::string::npos; pos = dir.find('/', pos + 1))
    ::mkdir(dir.substr(0, pos).c_str(), 0755);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    why = fmt::format("cannot create state dir {}: {}", dir, errno_text(errno));
    return {};
  }
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st;
  if (!fd || ::fstat(fd.get(), &st) != 0) {
    why = fmt::format("cannot open state dir {}: {}", dir, errno_text(errno));
    return {};
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    why = fmt::format(
        "state dir {} is owned by uid {} with mode {:04o}; it must be salusd's own "
        "(uid {}) and 0700",
        dir, st.st_uid, st.st_mode & 07777, ::geteuid());
    return {};
  }
  return fd;
}

// Removes `name` in `dir` and everything under it (never following a symlink).
void remove_tree(int dir, const char* name) {
  UniqueFd fd(::openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd) {
    const int dup = ::dup(fd.get());
    if (DIR* d = dup >= 0 ? ::fdopendir(dup) : nullptr) {
      std::vector<std::string> names;
      while (const dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
          names.emplace_back(e->d_name);
      ::closedir(d);
      for (const auto& n : names)
        if (::unlinkat(fd.get(), n.c_str(), 0) != 0 && errno == EISDIR)
          remove_tree(fd.get(), n.c_str());
    } else if (dup >= 0) {
      ::close(dup);
    }
  }
  ::unlinkat(dir, name, AT_REMOVEDIR);
}

std::vector<std::string> list_dir(int dir, const char* name) {
  std::vector<std::string> out;
  const int fd = ::openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return out;
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    return out;
  }
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') out.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------- waiting on the broker

// A broker callback's result, waited for with a deadline. The callback may run
// after the waiter gave up, so everything it touches lives here, shared.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int err = 0;
  std::vector<char> data;

  void finish(int e, const char* p = nullptr, std::size_t n = 0) {
    std::lock_guard lk(mu);
    err = e;
    if (p) data.assign(p, p + n);
    done = true;
    cv.notify_all();
  }
  // The callback's errno, or ETIMEDOUT.
  int wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lk(mu);
    if (!cv.wait_until(lk, deadline, [&] { return done; })) return ETIMEDOUT;
    return err;
  }
};

}  // namespace

std::uint64_t state_hash(std::uint64_t h, const void* data, std::size_t n) {
  constexpr std::uint64_t kPrime = 1099511628211ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lane[4] = {kHashStart, kHashStart ^ 1, kHashStart ^ 2, kHashStart ^ 3};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = (lane[l] ^ w) * kPrime;
    }
  }
  std::uint64_t c = n;
  for (const std::uint64_t l : lane) c = (c ^ l) * kPrime;
  for (; i < n; ++i) c = (c ^ p[i]) * kPrime;
  return (h ^ c) * kPrime;
}

// ---------------------------------------------------------------- session.state

std::string format_session_state(const SavedSession& s) {
  std::string out = fmt::format("{}\nname {}\nowner {} {}\n", kMagic, s.name, s.uid, s.gid);
  if (s.need_declared) {
    out += fmt::format("need persistent={} ephemeral={}", s.persistent, s.ephemeral);
    if (s.iters) out += fmt::format(" iters={}", *s.iters);
    if (s.gpu) out += fmt::format(" gpu={}", *s.gpu);
    if (s.label) out += fmt::format(" name={}", *s.label);
    out += '\n';
  }
  out += fmt::format("priority {}\nbuffers {}\n", s.priority, s.buffers.size());
  for (const auto& b : s.buffers)
    out += fmt::format("buffer {} {} {:016x}\n", b.name, b.size, b.hash);
  out += "end\n";
  return out;
}

namespace {

bool parse_u64(const std::string& t, std::uint64_t& v, int base = 10) {
  if (t.empty() || t[0] == '-' || t[0] == '+') return false;
  char* end = nullptr;
  errno = 0;
  v = std::strtoull(t.c_str(), &end, base);
  return errno == 0 && end && *end == '\0';
}

bool parse_i64(const std::string& t, std::int64_t& v) {
  if (t.empty()) return false;
  char* end = nullptr;
  errno = 0;
  v = std::strtoll(t.c_str(), &end, 10);
  return errno == 0 && end && *end == '\0';
}

bool parse_need(std::istringstream& in, SavedSession& s) {
  std::string kv;
  std::uint64_t v = 0;
  bool p = false, e = false;
  while (in >> kv) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos) return false;
    const std::string key = kv.substr(0, eq);
    if (key == "name") {
      s.label = kv.substr(eq + 1);
      if (!is_valid_name(*s.label)) return false;
      continue;
    }
    if (!parse_u64(kv.substr(eq + 1), v)) return false;
    if (key == "persistent")
      s.persistent = v, p = true;
    else if (key == "ephemeral")
      s.ephemeral = v, e = true;
    else if (key == "iters")
      s.iters = v;
    else if (key == "gpu" && v < 1024)
      s.gpu = static_cast<int>(v);
    else
      return false;
  }
  s.need_declared = true;
  return p && e;
}

}  // namespace

std::optional<SavedSession> parse_session_state(std::string_view text, std::string& why) {
  std::istringstream lines{std::string(text)};
  std::string line;
  if (!std::getline(lines, line) || line != kMagic) {
    why = fmt::format("not a session state file (the first line is not '{}')", kMagic);
    return std::nullopt;
  }
  SavedSession s;
  std::uint64_t expected = 0, n = 0;
  bool name = false, owner = false, count = false, end = false;
  while (std::getline(lines, line)) {
    ++n;
    if (end) {
      why = "text after the 'end' line";
      return std::nullopt;
    }
    std::istringstream in(line);
    std::string key, a, b, c, extra;
    in >> key;
    bool ok = true;
    std::uint64_t u1 = 0, u2 = 0;
    std::int64_t i = 0;
    if (key == "name") {
      ok = static_cast<bool>(in >> s.name) && !(in >> extra) && is_valid_name(s.name);
      name = ok;
    } else if (key == "owner") {
      ok = (in >> a >> b) && !(in >> extra) && parse_u64(a, u1) && parse_u64(b, u2) &&
           u1 < 0xffffffffULL && u2 < 0xffffffffULL;
      s.uid = static_cast<uid_t>(u1), s.gid = static_cast<gid_t>(u2), owner = ok;
    } else if (key == "need") {
      ok = parse_need(in, s);
    } else if (key == "priority") {
      ok = (in >> a) && !(in >> extra) && parse_i64(a, i) && i >= INT32_MIN && i <= INT32_MAX;
      s.priority = static_cast<std::int32_t>(i);
    } else if (key == "buffers") {
      ok = (in >> a) && !(in >> extra) && parse_u64(a, expected) && expected <= 1 << 20;
      count = ok;
    } else if (key == "buffer") {
      SavedSession::Buffer buf;
      ok = count && (in >> buf.name >> a >> c) && !(in >> extra) && is_valid_name(buf.name) &&
           parse_u64(a, buf.size) && c.size() == 16 && parse_u64(c, buf.hash, 16);
      for (const auto& other : s.buffers) ok = ok && other.name != buf.name;
      if (ok) s.buffers.push_back(std::move(buf));
    } else if (key == "end") {
      end = true;
    } else {
      ok = false;
    }
    if (!ok) {
      why = fmt::format("line {}: malformed: '{}'", n + 1, line.substr(0, 80));
      return std::nullopt;
    }
  }
  if (!end || !name || !owner || !count || s.buffers.size() != expected) {
    why = !end ? "truncated (no 'end' line)"
               : fmt::format("incomplete (name, owner or {} buffer line(s) missing)", expected);
    return std::nullopt;
  }
  return s;
}

// ---------------------------------------------------------------- save

namespace {

// Copies buffer `b` of session `id` into `fd` in chunks: each read waits for
// the session's earlier work, each write goes through the ring. A read must
// finish by `until`; once one has, the session's earlier work is done and the
// next read gets kChunkWait of its own. 0 or an errno.
int save_buffer(Broker& broker, SessionId id, const Broker::BufferView& b, int fd, RingIo& ring,
                std::chrono::steady_clock::time_point& until, std::uint64_t& hash) {
  hash = kHashStart;
  for (Bytes off = 0; off < b.size; off += kChunk) {
    const Bytes len = std::min(kChunk, b.size - off);
    auto p = std::make_shared<Pending>();
    broker.read_buffer(id, b.id, off, len, [p](int err, std::span<const char> data) {
      p->finish(err, data.data(), data.size());
    });
    if (const int err = p->wait_until(until)) return err;
    until = std::chrono::steady_clock::now() + kChunkWait;
    std::lock_guard lk(p->mu);  // the callback is done with it
    if (p->data.size() != len) return EIO;
    hash = state_hash(hash, p->data.data(), len);
    if (const int rc = ring.write(fd, p->data.data(), len, static_cast<off_t>(off))) return -rc;
  }
  return -ring.fsync(fd);
}

int write_file(int dir, const char* name, const std::string& text, RingIo& ring) {
  UniqueFd fd(::openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) return errno;
  if (const int rc = ring.write(fd.get(), text.data(), text.size(), 0)) return -rc;
  return -ring.fsync(fd.get());
}

// Writes one session into `parent`/NAME/. Its first read may wait for the
// session's queued work until `work_deadline` (the grace period), or a second
// when that has passed. 0 or an errno, with `why`.
int save_one(Broker& broker, const Broker::NamedSessionState& n, int parent, RingIo& ring,
             std::chrono::steady_clock::time_point work_deadline, Bytes& bytes, std::string& why) {
  auto until = std::max(work_deadline, std::chrono::steady_clock::now() + kFirstChunkWait);
  if (::mkdirat(parent, n.name.c_str(), 0700) != 0) {
    const int e = errno;
    why = fmt::format("mkdir: {}", errno_text(e));
    return e;
  }
  UniqueFd dir(::openat(parent, n.name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir) return errno;
  SavedSession s;
  s.name = n.name;
  s.uid = n.uid;
  s.gid = n.gid;
  s.need_declared = n.need_declared;
  s.persistent = n.need.persistent;
  s.ephemeral = n.need.ephemeral;
  s.iters = n.need.iters;
  if (n.need.gpu && *n.need.gpu >= 0) s.gpu = n.need.gpu;
  s.label = n.need.name;
  s.priority = n.priority;
  for (std::size_t i = 0; i < n.buffers.size(); ++i) {
    const auto& b = n.buffers[i];
    const std::string file = fmt::format("buf-{}", i);
    UniqueFd fd(::openat(dir.get(), file.c_str(),
                         O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) return errno;
    std::uint64_t hash = 0;
    if (const int err = save_buffer(broker, n.id, b, fd.get(), ring, until, hash)) {
      why = fmt::format("buffer {}: {}", b.name,
                        err == ETIMEDOUT ? "its session's work did not finish in time"
                        : err == EIO ? "the session's failure latch is set (write `reset` before "
                                       "stopping salusd to keep it)"
                                     : errno_text(err));
      return err;
    }
    s.buffers.push_back({b.name, b.size, hash});
    bytes += b.size;
  }
  if (const int err = write_file(dir.get(), kStateFile, format_session_state(s), ring)) {
    why = fmt::format("{}: {}", kStateFile, errno_text(err));
    return err;
  }
  return ::fsync(dir.get()) == 0 ? 0 : errno;
}

void test_pause() {
  // Tests only: hold the save open before its commit, so that a test can kill
  // salusd in the middle of it.
  if (const char* ms = std::getenv("SALUS_TEST_SAVE_PAUSE_MS")) {
    spdlog::warn("state: SALUS_TEST_SAVE_PAUSE_MS: pausing {} ms before the commit", ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(ms)));
  }
}

}  // namespace

StoreReport save_sessions(Broker& broker, const std::string& dir, std::chrono::milliseconds bound) {
  StoreReport r;
  UniqueFd state = open_state_dir(dir, r.why);
  if (!state) {
    r.error = EACCES;
    spdlog::error("state: named sessions are not saved: {}", r.why);
    return r;
  }
  remove_tree(state.get(), kNew);  // a save that was cut off
  if (::mkdirat(state.get(), kNew, 0700) != 0) {
    r.error = errno;
    r.why = fmt::format("mkdir {}/{}: {}", dir, kNew, errno_text(errno));
    spdlog::error("state: named sessions are not saved: {}", r.why);
    return r;
  }
  UniqueFd fresh(::openat(state.get(), kNew, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  const auto sessions = broker.named_sessions();
  spdlog::info("state: saving {} named session(s) to {}", sessions.size(), dir);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  RingIo ring;
  for (const auto& n : sessions) {
    std::string why;
    Bytes bytes = 0;
    if (const int err = save_one(broker, n, fresh.get(), ring, deadline, bytes, why)) {
      ++r.skipped;
      remove_tree(fresh.get(), n.name.c_str());
      spdlog::error("state: session {} (uid {}) is not saved: {}", n.name, n.uid,
                    why.empty() ? errno_text(err) : why);
      continue;
    }
    ++r.sessions;
    r.bytes += bytes;
  }
  ::fsync(fresh.get());
  test_pause();
  // The commit: sessions.new becomes sessions in one step.
  if (::renameat2(state.get(), kNew, state.get(), kCurrent, RENAME_EXCHANGE) != 0 &&
      (errno != ENOENT || ::renameat(state.get(), kNew, state.get(), kCurrent) != 0)) {
    r.error = errno;
    r.why = fmt::format("cannot commit the save: {}", errno_text(errno));
    spdlog::error("state: {}; the previous state is kept", r.why);
    return r;
  }
  ::fsync(state.get());
  remove_tree(state.get(), kNew);  // the previous snapshot
  spdlog::info("state: saved {} named session(s), {} bytes{}", r.sessions, r.bytes,
               r.skipped ? fmt::format("; {} not saved", r.skipped) : std::string());
  return r;
}

// ---------------------------------------------------------------- restore

namespace {

// Moves sessions/NAME to set-aside/NAME.TIME, for the administrator to look at.
void set_aside(int state, const std::string& name, const std::string& why) {
  ::mkdirat(state, kSetAside, 0700);
  // The time, and a count for two in the same second (another start, another
  // session of that name): an entry there is never overwritten.
  static unsigned seq = 0;
  const std::string to = fmt::format("{}/{}.{}.{}", kSetAside, name, std::time(nullptr), seq++);
  const std::string from = fmt::format("{}/{}", kCurrent, name);
  if (::renameat(state, from.c_str(), state, to.c_str()) == 0)
    spdlog::error("state: session {} is not restored: {}; its saved files are kept in {}", name,
                  why, to);
  else
    spdlog::error("state: session {} is not restored: {}; could not set it aside: {}", name, why,
                  errno_text(errno));
}

int read_small_file(int dir, const char* name, std::string& out, RingIo& ring) {
  UniqueFd fd(::openat(dir, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st;
  if (!fd || ::fstat(fd.get(), &st) != 0) return errno;
  if (!S_ISREG(st.st_mode) || st.st_size > (1 << 20)) return EINVAL;
  out.resize(static_cast<std::size_t>(st.st_size));
  return -ring.read(fd.get(), out.data(), out.size(), 0);
}

// Runs commands in a restored session as its owner; 0 or an errno.
int run_as_owner(Broker& broker, SessionId id, const Caller& owner, std::vector<Command> cmds,
                 std::chrono::steady_clock::time_point deadline) {
  std::vector<CommandLine> lines;
  std::uint32_t ln = 0;
  for (auto& c : cmds) lines.push_back({++ln, std::move(c)});
  auto p = std::make_shared<Pending>();
  broker.submit(id, owner, 0, std::move(lines), std::nullopt,
                [p](int err, std::string) { p->finish(err); });
  return p->wait_until(deadline);
}

// Checks every buffer file against its size and hash before anything is made.
int verify_files(int dir, const SavedSession& s, RingIo& ring, std::string& why) {
  std::vector<char> chunk;
  for (std::size_t i = 0; i < s.buffers.size(); ++i) {
    const auto& b = s.buffers[i];
    const std::string file = fmt::format("buf-{}", i);
    UniqueFd fd(::openat(dir, file.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    struct stat st;
    if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
        static_cast<Bytes>(st.st_size) != b.size) {
      why = fmt::format("{} (buffer {}) is missing or not {} bytes", file, b.name, b.size);
      return EINVAL;
    }
    std::uint64_t h = kHashStart;
    for (Bytes off = 0; off < b.size; off += kChunk) {
      chunk.resize(std::min(kChunk, b.size - off));
      if (ring.read(fd.get(), chunk.data(), chunk.size(), static_cast<off_t>(off)) != 0) {
        why = fmt::format("{}: read failed", file);
        return EIO;
      }
      h = state_hash(h, chunk.data(), chunk.size());
    }
    if (h != b.hash) {
      why = fmt::format("{} (buffer {}) does not match its recorded hash", file, b.name);
      return EINVAL;
    }
  }
  return 0;
}

// Fills restored buffer `bid` from `fd`.
int fill_buffer(Broker& broker, SessionId id, std::uint32_t bid, int fd, Bytes size, RingIo& ring,
                std::chrono::steady_clock::time_point deadline) {
  std::vector<char> chunk;
  for (Bytes off = 0; off < size; off += kChunk) {
    chunk.resize(std::min(kChunk, size - off));
    if (ring.read(fd, chunk.data(), chunk.size(), static_cast<off_t>(off)) != 0) return EIO;
    auto p = std::make_shared<Pending>();
    // write_buffer copies the bytes into staging before it returns.
    broker.write_buffer(id, bid, off, chunk.data(), chunk.size(),
                        [p](int err, Bytes) { p->finish(err); });
    if (const int err = p->wait_until(deadline)) return err;
  }
  return 0;
}

// Waits (at start-up, before the mount) until session `id` is admitted.
bool admitted(const Broker& broker, SessionId id, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    if (broker.render_status(id).find("\nstate: admitted\n") != std::string::npos) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// Creates the session again and gives it its buffers. 0, or an errno with `why`
// (the session is ended again then).
int restore_one(Broker& broker, const SavedSession& s, int dir, RingIo& ring,
                std::chrono::milliseconds bound, std::string& why) {
  const Caller owner{s.uid, s.gid, 0, false};
  const std::int64_t made = broker.create_session(owner, s.name);
  if (made < 0) {
    why = fmt::format("cannot create it: {}", errno_text(static_cast<int>(-made)));
    return static_cast<int>(-made);
  }
  const auto id = static_cast<SessionId>(made);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  auto fail = [&](int err, std::string text) {
    why = std::move(text);
    broker.end_session(id);
    return err;
  };
  std::vector<Command> cmds;
  if (s.need_declared) {
    NeedCmd need;
    need.persistent = s.persistent;
    need.ephemeral = s.ephemeral;
    need.iters = s.iters;
    need.name = s.label;
    need.gpu = s.gpu && static_cast<std::size_t>(*s.gpu) < broker.gpu_count() ? *s.gpu : kAnyGpu;
    cmds.emplace_back(need);
  }
  cmds.emplace_back(PriorityCmd{s.priority});
  for (const auto& b : s.buffers)
    if (b.size > 0) cmds.emplace_back(AllocCmd{b.name, b.size});
  // A session that held no buffers may have been queued, not admitted: it is
  // queued again, and nothing waits for its admission.
  const bool wait_admission = !s.buffers.empty();
  const auto until =
      wait_admission ? deadline : std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  // salusd restores what it accepted before: as an admin, so that a priority an admin
  // raised past --user-priority-max comes back too.
  const Caller restorer{s.uid, s.gid, 0, true};
  const int ran = run_as_owner(broker, id, restorer, std::move(cmds), until);
  if (ran && !(ran == ETIMEDOUT && !wait_admission))
    return fail(ran, fmt::format("need, priority or alloc failed: {}{}", errno_text(ran),
                                 ran == ETIMEDOUT ? " (not admitted in time)" : ""));
  // `need` returns before admission; only `alloc` waits for it. Empty buffers
  // (mem/ files never resized) need the session admitted too.
  if (wait_admission && !admitted(broker, id, deadline))
    return fail(ETIMEDOUT, "not admitted in time");
  for (std::size_t i = 0; i < s.buffers.size(); ++i) {
    const auto& b = s.buffers[i];
    if (const int rc = b.size == 0 ? broker.create_buffer(id, owner, b.name) : 0; rc < 0)
      return fail(-rc, fmt::format("cannot create empty buffer {}: {}", b.name, errno_text(-rc)));
    const auto view = broker.find_buffer(id, b.name);
    if (!view || view->size != b.size)
      return fail(EIO, fmt::format("buffer {} was not allocated", b.name));
    const std::string file = fmt::format("buf-{}", i);
    UniqueFd fd(::openat(dir, file.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) return fail(errno, fmt::format("{}: {}", file, errno_text(errno)));
    if (const int err = fill_buffer(broker, id, view->id, fd.get(), b.size, ring, deadline))
      return fail(err, fmt::format("filling buffer {}: {}", b.name, errno_text(err)));
  }
  return 0;
}

}  // namespace

StoreReport restore_sessions(Broker& broker, const std::string& dir,
                             std::chrono::milliseconds bound) {
  StoreReport r;
  UniqueFd state = open_state_dir(dir, r.why);
  if (!state) {
    r.error = EACCES;
    spdlog::error("state: named sessions are not restored: {}", r.why);
    return r;
  }
  remove_tree(state.get(), kNew);  // a save that was cut off, or the snapshot before
  const auto names = list_dir(state.get(), kCurrent);
  UniqueFd current(
      ::openat(state.get(), kCurrent, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!names.empty())
    spdlog::info("state: restoring {} named session(s) from {}", names.size(), dir);
  RingIo ring;
  for (const auto& name : names) {
    UniqueFd sdir(
        ::openat(current.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    std::string text, why;
    std::optional<SavedSession> s;
    if (!sdir) {
      why = "not a directory";
    } else if (const int err = read_small_file(sdir.get(), kStateFile, text, ring)) {
      why = fmt::format("{}: {}", kStateFile, errno_text(err));
    } else if (!(s = parse_session_state(text, why))) {
      why = fmt::format("{} is corrupt: {}", kStateFile, why);
    } else if (s->name != name) {
      why = fmt::format("{} names session '{}'", kStateFile, s->name);
      s.reset();
    } else if (verify_files(sdir.get(), *s, ring, why) != 0) {
      s.reset();
    }
    if (!s || restore_one(broker, *s, sdir.get(), ring, bound, why) != 0) {
      ++r.skipped;
      sdir.reset();
      set_aside(state.get(), name, why);
      continue;
    }
    Bytes bytes = 0;
    for (const auto& b : s->buffers) bytes += b.size;
    if (const auto id = broker.find_session(name))
      broker.note(*id, fmt::format("restored after a restart: {} buffer(s), {} bytes, owner uid {}",
                                   s->buffers.size(), bytes, s->uid));
    ++r.sessions;
    r.bytes += bytes;
  }
  if (!names.empty())
    spdlog::info("state: restored {} named session(s), {} bytes, from {}{}", r.sessions, r.bytes,
                 dir, r.skipped ? fmt::format("; {} set aside", r.skipped) : std::string());
  return r;
}

}  // namespace salus::vgpu
