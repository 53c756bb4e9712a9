#define FUSE_USE_VERSION 312
#include "fusefs/filesystem.hpp"

#include <fuse3/fuse_lowlevel.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "fusefs/command_parser.hpp"
#include "fusefs/inode.hpp"
#include "fusefs/readme.hpp"
#include "salus_config.hpp"

namespace salus::fusefs {

// The content of each snapshot inode (Kind::snapshot_file), from the lookup that
// made it until the kernel forgets it. One lookup, one inode, one content: the
// size the kernel caches and the bytes every reader of that inode gets agree.
struct Snapshots {
  struct Entry {
    Inode origin;  // the generated file this is a snapshot of
    std::shared_ptr<const std::string> content;
    std::uint64_t version = 0;  // status: the session's status version at lookup
  };

  Inode add(Entry e) {
    static std::atomic<std::uint64_t> instances{0};
    const std::uint64_t n = ++instances;
    const Inode in{Kind::snapshot_file, n >> 24, static_cast<std::uint32_t>(n & 0xffffff)};
    std::lock_guard lk(mu);
    entries.emplace(encode(in), std::move(e));
    return in;
  }
  std::optional<Entry> find(std::uint64_t ino) {
    std::lock_guard lk(mu);
    const auto it = entries.find(ino);
    if (it == entries.end()) return std::nullopt;
    return it->second;
  }
  void erase(std::uint64_t ino) {
    std::lock_guard lk(mu);
    entries.erase(ino);
  }

  std::mutex mu;
  std::unordered_map<std::uint64_t, Entry> entries;  // by snapshot inode number
};

namespace {

using vgpu::Broker;
using vgpu::Caller;
using vgpu::SessionId;

constexpr double kStaticTimeout = 60.0;  // the fixed part of the tree never changes
constexpr double kDynamicTimeout = 0.0;  // sessions and buffers come and go

struct OpenFile {
  Inode ino;
  std::mutex mu;
  std::string content;    // snapshot taken at open (or the wait result)
  std::string replies;    // ctl/clone: replies not yet read
  bool answered = false;  // wait: the result is in `content`
  bool clone = false;
  SessionId session = 0;
  std::uint64_t version = 0;  // status: the session's status version at open
  std::uint64_t dropped = 0;  // replies dropped unread (see add_reply)
};

// Replies a client never reads must not pile up without bound: past this many
// bytes the oldest are dropped, and the next read starts with "dropped N".
constexpr std::size_t kMaxUnreadReplies = 64 * 1024;

void add_reply(OpenFile& of, const std::string& text) {
  std::lock_guard lk(of.mu);
  of.replies += text;
  if (of.replies.size() <= kMaxUnreadReplies) return;
  std::size_t cut = 0;
  while (of.replies.size() - cut > kMaxUnreadReplies) {
    const std::size_t nl = of.replies.find('\n', cut);
    cut = nl == std::string::npos ? of.replies.size() : nl + 1;
    ++of.dropped;
  }
  of.replies.erase(0, cut);
}

struct DirHandle {
  struct Entry {
    std::string name;
    std::uint64_t ino;
    mode_t mode;
  };
  std::vector<Entry> entries;
};

Filesystem* fs_of(fuse_req_t req) {
  return static_cast<Filesystem*>(fuse_req_userdata(req));
}

// ---------------------------------------------------------------- held requests

// A request salusd holds while the broker works on it (a `wait` read, a write
// waiting for its files, its turn, admission or `sync`). When its caller is
// interrupted (FUSE_INTERRUPT: a signal; a SIGKILL sends one too) the broker is
// asked to cancel it, and answers it with EINTR if that is safe. The broker
// answers every request exactly once; this only makes sure that libfuse never
// calls the interrupt hook after the answer, when the request is gone.
struct Held {
  fuse_req_t req = nullptr;
  std::uint64_t key = 0;
  pid_t pid = 0;
  std::mutex mu;
  bool interrupted = false;
  // Interrupted by a signal that was not fatal, and not given up (a write some
  // of whose lines ran). The kernel sends no second FUSE_INTERRUPT when a
  // SIGKILL follows, so watch_dying_callers() looks for one.
  bool lingering = false;
  SessionId session = 0;
  std::uint64_t ticket = 0;
};

std::mutex g_held_mu;
std::unordered_map<std::uint64_t, std::shared_ptr<Held>> g_held;
std::uint64_t g_held_next = 1;
// The request whose interrupt hook this thread is running: libfuse holds that
// request's lock around the hook, so answering it must not take the lock again.
thread_local fuse_req_t t_interrupting = nullptr;

// Whether thread `tid` is being killed: SIGKILL pending (the kernel adds it to
// every thread of a process on a fatal signal), or already gone.
bool caller_dying(pid_t tid) {
  if (tid <= 0) return false;  // outside our pid namespace: cannot tell
  std::ifstream in(fmt::format("/proc/{}/status", tid));
  if (!in) return true;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("SigPnd:", 0) != 0 && line.rfind("ShdPnd:", 0) != 0) continue;
    const unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
    if (mask & (1ull << (SIGKILL - 1))) return true;
  }
  return false;
}

void on_interrupt(fuse_req_t req, void* data) {
  std::shared_ptr<Held> h;
  {
    std::lock_guard lk(g_held_mu);
    auto it = g_held.find(reinterpret_cast<std::uintptr_t>(data));
    if (it == g_held.end()) return;
    h = it->second;
  }
  bool ready = false;
  {
    std::lock_guard lk(h->mu);
    h->interrupted = true;
    ready = h->ticket != 0;
  }
  if (!ready) return;  // held_as() cancels it once it has the ticket
  t_interrupting = req;
  try {
    if (!fs_of(req)->broker().cancel_request(h->session, h->ticket, caller_dying(h->pid))) {
      std::lock_guard lk(h->mu);
      h->lingering = true;
    }
  } catch (const std::exception& e) {
    spdlog::error("interrupt: {}", e.what());
  }
  t_interrupting = nullptr;
}

// While serve() runs: a held request whose caller got a non-fatal signal and
// then SIGKILL gets no second FUSE_INTERRUPT (the kernel sends one per request,
// then waits uninterruptibly once the request was read), so its killed caller
// would stay in D state until salusd answered. Every 100 ms, each such
// request's caller is checked, and one being killed is given up.
void watch_dying_callers(Filesystem& fs, std::mutex& mu, std::condition_variable& cv,
                         const bool& stop) {
  std::unique_lock lk(mu);
  while (!cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return stop; })) {
    std::vector<std::shared_ptr<Held>> lingering;
    {
      std::lock_guard g(g_held_mu);
      for (const auto& [key, h] : g_held) {
        std::lock_guard hl(h->mu);
        if (h->lingering) lingering.push_back(h);
      }
    }
    for (const auto& h : lingering) {
      try {
        if (caller_dying(h->pid)) fs.broker().cancel_request(h->session, h->ticket, true);
      } catch (const std::exception& e) {
        spdlog::error("interrupt watch: {}", e.what());
      }
    }
  }
}

// Registers `req` as held, before the broker sees it. If its caller was
// interrupted already, the hook runs at once and is remembered.
std::shared_ptr<Held> hold(fuse_req_t req) {
  auto h = std::make_shared<Held>();
  h->req = req;
  h->pid = fuse_req_ctx(req)->pid;
  {
    std::lock_guard lk(g_held_mu);
    h->key = g_held_next++;
    g_held.emplace(h->key, h);
  }
  fuse_req_interrupt_func(req, on_interrupt, reinterpret_cast<void*>(h->key));
  return h;
}

// The broker's ticket for the held request (0: answered already). An
// interrupt that came before it is acted on now.
void held_as(Filesystem& fs, const std::shared_ptr<Held>& h, SessionId session,
             std::uint64_t ticket) {
  bool interrupted = false;
  {
    std::lock_guard lk(h->mu);
    h->session = session;
    h->ticket = ticket;
    interrupted = h->interrupted;
  }
  if (interrupted && ticket && !fs.broker().cancel_request(session, ticket, caller_dying(h->pid))) {
    std::lock_guard lk(h->mu);
    h->lingering = true;
  }
}

// Before the answer: no interrupt hook may run for the request after it.
void unhold(Held& h) {
  {
    std::lock_guard lk(g_held_mu);
    g_held.erase(h.key);
  }
  // Waits for a hook running on another thread (libfuse runs it under the
  // request's lock); on this thread, inside the hook, the lock is held already.
  if (t_interrupting != h.req) fuse_req_interrupt_func(h.req, nullptr, nullptr);
}

std::shared_ptr<OpenFile>& open_of(fuse_file_info* fi) {
  return *reinterpret_cast<std::shared_ptr<OpenFile>*>(fi->fh);
}

Caller caller_of(fuse_req_t req, const FilesystemOptions& opts) {
  const fuse_ctx* ctx = fuse_req_ctx(req);
  Caller c{ctx->uid, ctx->gid, ctx->pid, ctx->uid == 0};
  if (!c.admin && opts.admin_group) {
    if (ctx->gid == *opts.admin_group) {
      c.admin = true;
    } else {
      gid_t groups[64];
      const int n = fuse_req_getgroups(req, 64, groups);
      for (int i = 0; i < n && i < 64; ++i) c.admin = c.admin || groups[i] == *opts.admin_group;
    }
  }
  return c;
}

const char* top_name(TopFile f) {
  switch (f) {
    case TopFile::readme:
      return "README";
    case TopFile::version:
      return "version";
    case TopFile::clone:
      return "clone";
    case TopFile::policy:
      return "policy";
    case TopFile::ctl:
      return "ctl";
    case TopFile::stats:
      return "stats";
    case TopFile::metrics:
      return "metrics";
    case TopFile::count:
      break;
  }
  return "";
}
const char* gpu_file_name(GpuFile f) {
  switch (f) {
    case GpuFile::info:
      return "info";
    case GpuFile::memory:
      return "memory";
    case GpuFile::lanes:
      return "lanes";
    case GpuFile::queue:
      return "queue";
    case GpuFile::processes:
      return "processes";
    case GpuFile::count:
      break;
  }
  return "";
}
const char* session_file_name(SessionFile f) {
  switch (f) {
    case SessionFile::ctl:
      return "ctl";
    case SessionFile::status:
      return "status";
    case SessionFile::log:
      return "log";
    case SessionFile::wait:
      return "wait";
    case SessionFile::count:
      break;
  }
  return "";
}

const std::string& version_text() {
  static const std::string text =
      fmt::format("salusd {} api {}\n", SALUS_VERSION, SALUS_API_VERSION);
  return text;
}

// Whether lookups of `in` return snapshot inodes: the generated files whose
// content changes (policy too: admins also write it through the snapshot).
// readme and version never change and report their size.
bool snapshotted(Inode in) {
  switch (in.kind) {
    case Kind::top_file:
      return in.sub == static_cast<std::uint32_t>(TopFile::stats) ||
             in.sub == static_cast<std::uint32_t>(TopFile::metrics) ||
             in.sub == static_cast<std::uint32_t>(TopFile::policy);
    case Kind::gpu_file:
      return true;
    case Kind::session_file:
      return in.sub == static_cast<std::uint32_t>(SessionFile::status) ||
             in.sub == static_cast<std::uint32_t>(SessionFile::log);
    default:
      return false;
  }
}

// The content of a snapshotted file now: 0, or ENOENT if it is gone.
int render(Broker& b, Inode in, std::string& content, std::uint64_t& version) {
  if (in.kind == Kind::top_file) {
    switch (static_cast<TopFile>(in.sub)) {
      case TopFile::stats:
        content = b.render_stats();
        return 0;
      case TopFile::metrics:
        content = b.render_metrics();
        return 0;
      case TopFile::policy:
        content = b.render_policy();
        return 0;
      default:
        return ENOENT;
    }
  }
  if (in.kind == Kind::gpu_file) {
    if (in.id >= b.gpu_count()) return ENOENT;
    switch (static_cast<GpuFile>(in.sub)) {
      case GpuFile::info:
        content = b.render_gpu_info(in.id);
        return 0;
      case GpuFile::memory:
        content = b.render_gpu_memory(in.id);
        return 0;
      case GpuFile::lanes:
        content = b.render_gpu_lanes(in.id);
        return 0;
      case GpuFile::queue:
        content = b.render_gpu_queue(in.id);
        return 0;
      case GpuFile::processes:
        content = b.render_gpu_processes(in.id);
        return 0;
      default:
        return ENOENT;
    }
  }
  if (in.kind != Kind::session_file || !b.session_owner(in.id)) return ENOENT;
  if (static_cast<SessionFile>(in.sub) == SessionFile::status) {
    version = b.status_version(in.id);
    content = b.render_status(in.id);
  } else {
    content = b.render_log(in.id);
  }
  return 0;
}

// Attributes of an inode: 0, or ENOENT (ESTALE for a dropped snapshot) if what
// it names is gone.
int fill_attr(Filesystem& fs, Inode in, struct stat& st) {
  std::memset(&st, 0, sizeof st);
  st.st_ino = encode(in);
  st.st_nlink = 1;
  st.st_blksize = 4096;
  const auto& opts = fs.options();
  const gid_t admin_gid = opts.admin_group.value_or(0);
  Broker& b = fs.broker();
  switch (in.kind) {
    case Kind::root:
      st.st_mode = S_IFDIR | 0755;
      st.st_nlink = 2;
      return 0;
    case Kind::snapshot_file: {
      const auto snap = fs.snapshots().find(encode(in));
      if (!snap) return ESTALE;
      if (int rc = fill_attr(fs, snap->origin, st)) return rc;
      st.st_ino = encode(in);
      st.st_size = static_cast<off_t>(snap->content->size());
      st.st_blocks = static_cast<blkcnt_t>((snap->content->size() + 511) / 512);
      return 0;
    }
    case Kind::top_file:
      switch (static_cast<TopFile>(in.sub)) {
        case TopFile::readme:
          st.st_mode = S_IFREG | 0444;
          st.st_size = static_cast<off_t>(readme_text().size());
          return 0;
        case TopFile::version:
          st.st_mode = S_IFREG | 0444;
          st.st_size = static_cast<off_t>(version_text().size());
          return 0;
        case TopFile::stats:
        case TopFile::metrics:
          st.st_mode = S_IFREG | 0444;
          return 0;
        case TopFile::clone:
          st.st_mode = S_IFREG | 0666;
          return 0;
        case TopFile::policy:
          st.st_mode = S_IFREG | (opts.admin_group ? 0664 : 0644);
          st.st_gid = admin_gid;
          return 0;
        case TopFile::ctl:
          st.st_mode = S_IFREG | (opts.admin_group ? 0660 : 0600);
          st.st_gid = admin_gid;
          return 0;
        default:
          return ENOENT;
      }
    case Kind::clone_file:
      st.st_mode = S_IFREG | 0666;
      return 0;
    case Kind::gpus_dir:
      st.st_mode = S_IFDIR | 0555;
      st.st_nlink = 2;
      return 0;
    case Kind::gpu_dir:
      if (in.id >= b.gpu_count()) return ENOENT;
      st.st_mode = S_IFDIR | 0555;
      st.st_nlink = 2;
      return 0;
    case Kind::gpu_file:
      if (in.id >= b.gpu_count() || in.sub >= static_cast<std::uint32_t>(GpuFile::count))
        return ENOENT;
      st.st_mode = S_IFREG | 0444;
      return 0;
    case Kind::sessions_dir:
      st.st_mode = S_IFDIR | 01777;  // anyone may mkdir; sticky: only owners rmdir
      st.st_nlink = 2;
      return 0;
    case Kind::session_dir:
    case Kind::session_file:
    case Kind::mem_dir:
    case Kind::mem_file: {
      const auto owner = b.session_owner(in.id);
      if (!owner) return ENOENT;
      st.st_uid = owner->first;
      st.st_gid = owner->second;
      if (in.kind == Kind::session_dir || in.kind == Kind::mem_dir) {
        st.st_mode = S_IFDIR | 0700;
        st.st_nlink = 2;
      } else if (in.kind == Kind::session_file) {
        if (in.sub >= static_cast<std::uint32_t>(SessionFile::count)) return ENOENT;
        st.st_mode = S_IFREG | (static_cast<SessionFile>(in.sub) == SessionFile::ctl ? 0600 : 0400);
      } else {
        const auto buf = b.buffer_by_id(in.id, in.sub);
        if (!buf) return ENOENT;
        st.st_mode = S_IFREG | 0600;
        st.st_size = static_cast<off_t>(buf->size);
        st.st_blocks = static_cast<blkcnt_t>((buf->size + 511) / 512);
      }
      return 0;
    }
  }
  return ENOENT;
}

void reply_entry(fuse_req_t req, Filesystem& fs, Inode in) {
  fuse_entry_param e;
  std::memset(&e, 0, sizeof e);
  const int rc = fill_attr(fs, in, e.attr);
  if (rc) {
    if (in.kind == Kind::snapshot_file) fs.snapshots().erase(encode(in));
    fuse_reply_err(req, rc);
    return;
  }
  const bool fixed = in.kind == Kind::top_file || in.kind == Kind::gpus_dir ||
                     in.kind == Kind::gpu_dir || in.kind == Kind::gpu_file ||
                     in.kind == Kind::sessions_dir;
  e.ino = encode(in);
  e.attr_timeout = fixed ? kStaticTimeout : kDynamicTimeout;
  e.entry_timeout = fixed ? kStaticTimeout : kDynamicTimeout;
  // The kernel never saw the inode if the lookup was interrupted.
  if (fuse_reply_entry(req, &e) != 0 && in.kind == Kind::snapshot_file)
    fs.snapshots().erase(encode(in));
}

// ---------------------------------------------------------------- lookup

std::optional<Inode> child(Filesystem& fs, Inode parent, const std::string& name,
                           const Caller& caller, int& err) {
  Broker& b = fs.broker();
  err = ENOENT;
  switch (parent.kind) {
    case Kind::root:
      if (name == top_name(TopFile::clone)) {
        static std::atomic<std::uint64_t> instances{0};
        const std::uint64_t n = ++instances;
        return Inode{Kind::clone_file, n >> 24, static_cast<std::uint32_t>(n & 0xffffff)};
      }
      for (std::uint32_t f = 0; f < static_cast<std::uint32_t>(TopFile::count); ++f)
        if (name == top_name(static_cast<TopFile>(f))) return Inode{Kind::top_file, 0, f};
      if (name == "gpus") return Inode{Kind::gpus_dir, 0, 0};
      if (name == "sessions") return Inode{Kind::sessions_dir, 0, 0};
      return std::nullopt;
    case Kind::gpus_dir: {
      if (name.empty() || name.size() > 4 ||
          name.find_first_not_of("0123456789") != std::string::npos)
        return std::nullopt;
      const std::size_t gi = std::stoul(name);
      if (gi >= b.gpu_count() || (name.size() > 1 && name[0] == '0')) return std::nullopt;
      return Inode{Kind::gpu_dir, gi, 0};
    }
    case Kind::gpu_dir:
      for (std::uint32_t f = 0; f < static_cast<std::uint32_t>(GpuFile::count); ++f)
        if (name == gpu_file_name(static_cast<GpuFile>(f)))
          return Inode{Kind::gpu_file, parent.id, f};
      return std::nullopt;
    case Kind::sessions_dir: {
      const auto id = b.find_session(name);
      if (!id) return std::nullopt;
      return Inode{Kind::session_dir, *id, 0};
    }
    case Kind::session_dir: {
      if (int rc = b.check_access(parent.id, caller)) {
        err = rc;
        return std::nullopt;
      }
      for (std::uint32_t f = 0; f < static_cast<std::uint32_t>(SessionFile::count); ++f)
        if (name == session_file_name(static_cast<SessionFile>(f)))
          return Inode{Kind::session_file, parent.id, f};
      if (name == "mem") return Inode{Kind::mem_dir, parent.id, 0};
      return std::nullopt;
    }
    case Kind::mem_dir: {
      if (int rc = b.check_access(parent.id, caller)) {
        err = rc;
        return std::nullopt;
      }
      const auto buf = b.find_buffer(parent.id, name);
      if (!buf) return std::nullopt;
      return Inode{Kind::mem_file, parent.id, buf->id};
    }
    default:
      err = ENOTDIR;
      return std::nullopt;
  }
}

void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Filesystem& fs = *fs_of(req);
  int err = ENOENT;
  const auto in = child(fs, decode(parent), name, caller_of(req, fs.options()), err);
  if (!in) {
    fuse_reply_err(req, err);
    return;
  }
  if (!snapshotted(*in)) {
    reply_entry(req, fs, *in);
    return;
  }
  Snapshots::Entry snap{*in, nullptr, 0};
  std::string content;
  if (int rc = render(fs.broker(), *in, content, snap.version)) {
    fuse_reply_err(req, rc);
    return;
  }
  snap.content = std::make_shared<const std::string>(std::move(content));
  reply_entry(req, fs, fs.snapshots().add(std::move(snap)));
}

// A snapshot inode is returned by exactly one lookup: its first forget is its last.
void op_forget(fuse_req_t req, fuse_ino_t ino, std::uint64_t) {
  if (decode(ino).kind == Kind::snapshot_file) fs_of(req)->snapshots().erase(ino);
  fuse_reply_none(req);
}

void op_forget_multi(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i)
    if (decode(forgets[i].ino).kind == Kind::snapshot_file)
      fs_of(req)->snapshots().erase(forgets[i].ino);
  fuse_reply_none(req);
}

void op_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Filesystem& fs = *fs_of(req);
  struct stat st;
  const Inode in = decode(ino);
  if (int rc = fill_attr(fs, in, st)) {
    fuse_reply_err(req, rc);
    return;
  }
  const bool dynamic = in.kind >= Kind::session_dir;
  fuse_reply_attr(req, &st, dynamic ? kDynamicTimeout : kStaticTimeout);
}

void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info*) {
  Filesystem& fs = *fs_of(req);
  const Inode in = decode(ino);
  const Caller caller = caller_of(req, fs.options());
  if (to_set & (FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID)) {
    fuse_reply_err(req, EPERM);
    return;
  }
  if (in.kind == Kind::mem_file && (to_set & FUSE_SET_ATTR_SIZE)) {
    const auto size = static_cast<arena::Bytes>(attr->st_size);
    fs.broker().resize_buffer(in.id, caller, in.sub, size, [req, &fs, in](int err) {
      if (err) {
        fuse_reply_err(req, err);
        return;
      }
      struct stat st;
      if (int rc = fill_attr(fs, in, st)) {
        fuse_reply_err(req, rc);
        return;
      }
      fuse_reply_attr(req, &st, kDynamicTimeout);
    });
    return;
  }
  // Shell redirections truncate command files; there is nothing to truncate.
  struct stat st;
  if (int rc = fill_attr(fs, in, st)) {
    fuse_reply_err(req, rc);
    return;
  }
  fuse_reply_attr(req, &st, kDynamicTimeout);
}

// ---------------------------------------------------------------- directories

void op_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Filesystem& fs = *fs_of(req);
  const Inode in = decode(ino);
  const Caller caller = caller_of(req, fs.options());
  auto dh = std::make_unique<DirHandle>();
  auto add = [&](std::string name, Inode child_in, mode_t mode) {
    dh->entries.push_back({std::move(name), encode(child_in), mode});
  };
  add(".", in, S_IFDIR);
  add("..", Inode{}, S_IFDIR);
  Broker& b = fs.broker();
  switch (in.kind) {
    case Kind::root:
      for (std::uint32_t f = 0; f < static_cast<std::uint32_t>(TopFile::count); ++f)
        add(top_name(static_cast<TopFile>(f)), Inode{Kind::top_file, 0, f}, S_IFREG);
      add("gpus", Inode{Kind::gpus_dir, 0, 0}, S_IFDIR);
      add("sessions", Inode{Kind::sessions_dir, 0, 0}, S_IFDIR);
      break;
    case Kind::gpus_dir:
      for (std::size_t i = 0; i < b.gpu_count(); ++i)
        add(std::to_string(i), Inode{Kind::gpu_dir, i, 0}, S_IFDIR);
      break;
    case Kind::gpu_dir:
      for (std::uint32_t f = 0; f < static_cast<std::uint32_t>(GpuFile::count); ++f)
        add(gpu_file_name(static_cast<GpuFile>(f)), Inode{Kind::gpu_file, in.id, f}, S_IFREG);
      break;
    case Kind::sessions_dir:
      for (const auto& [name, id] : b.list_sessions())
        add(name, Inode{Kind::session_dir, id, 0}, S_IFDIR);
      break;
    case Kind::session_dir:
      if (int rc = b.check_access(in.id, caller)) {
        fuse_reply_err(req, rc);
        return;
      }
      for (std::uint32_t f = 0; f < static_cast<std::uint32_t>(SessionFile::count); ++f)
        add(session_file_name(static_cast<SessionFile>(f)), Inode{Kind::session_file, in.id, f},
            S_IFREG);
      add("mem", Inode{Kind::mem_dir, in.id, 0}, S_IFDIR);
      break;
    case Kind::mem_dir:
      if (int rc = b.check_access(in.id, caller)) {
        fuse_reply_err(req, rc);
        return;
      }
      for (const auto& buf : b.list_buffers(in.id))
        add(buf.name, Inode{Kind::mem_file, in.id, buf.id}, S_IFREG);
      break;
    default:
      fuse_reply_err(req, ENOTDIR);
      return;
  }
  fi->fh = reinterpret_cast<std::uint64_t>(dh.release());
  fuse_reply_open(req, fi);
}

void op_readdir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  auto* dh = reinterpret_cast<DirHandle*>(fi->fh);
  std::vector<char> buf(size);
  std::size_t used = 0;
  for (std::size_t i = static_cast<std::size_t>(off); i < dh->entries.size(); ++i) {
    const auto& e = dh->entries[i];
    struct stat st;
    std::memset(&st, 0, sizeof st);
    st.st_ino = e.ino;
    st.st_mode = e.mode;
    const std::size_t need = fuse_add_direntry(req, buf.data() + used, size - used, e.name.c_str(),
                                               &st, static_cast<off_t>(i + 1));
    if (need > size - used) break;
    used += need;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void op_releasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete reinterpret_cast<DirHandle*>(fi->fh);
  fuse_reply_err(req, 0);
}

void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t) {
  Filesystem& fs = *fs_of(req);
  if (decode(parent).kind != Kind::sessions_dir) {
    fuse_reply_err(req, EPERM);
    return;
  }
  const auto id = fs.broker().create_session(caller_of(req, fs.options()), name);
  if (id < 0) {
    fuse_reply_err(req, static_cast<int>(-id));
    return;
  }
  reply_entry(req, fs, Inode{Kind::session_dir, static_cast<std::uint64_t>(id), 0});
}

void op_rmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Filesystem& fs = *fs_of(req);
  if (decode(parent).kind != Kind::sessions_dir) {
    fuse_reply_err(req, EPERM);
    return;
  }
  Broker& b = fs.broker();
  const auto id = b.find_session(name);
  if (!id) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  if (int rc = b.check_access(*id, caller_of(req, fs.options()))) {
    fuse_reply_err(req, rc);
    return;
  }
  // A clone session belongs to its open file; it ends when that file closes.
  if (!b.session_is_named(*id)) {
    b.note(*id,
           "rmdir refused (EBUSY): a clone session ends when the last descriptor of its "
           "clone file is closed (or by `kill ID` on /salus/ctl)");
    fuse_reply_err(req, EBUSY);
    return;
  }
  b.end_session(*id);
  fuse_reply_err(req, 0);
}

void op_unlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Filesystem& fs = *fs_of(req);
  const Inode p = decode(parent);
  if (p.kind != Kind::mem_dir) {
    fuse_reply_err(req, EPERM);
    return;
  }
  fuse_reply_err(req, fs.broker().remove_buffer(p.id, caller_of(req, fs.options()), name));
}

// ---------------------------------------------------------------- files

void reply_open(fuse_req_t req, fuse_file_info* fi, std::shared_ptr<OpenFile> of) {
  fi->fh = reinterpret_cast<std::uint64_t>(new std::shared_ptr<OpenFile>(std::move(of)));
  fi->direct_io = 1;  // synthetic content: read() bypasses the page cache
  fi->keep_cache = 0;
  if (fuse_reply_open(req, fi) == -ENOENT) {
    // The opener is gone (interrupted); drop our handle.
    delete reinterpret_cast<std::shared_ptr<OpenFile>*>(fi->fh);
  }
}

// Opening clone creates a session tied to this open file; the first read
// returns its id.
void open_clone(fuse_req_t req, fuse_file_info* fi, Broker& b, const Caller& caller) {
  // Write-only (`echo need ... > clone`): the opener can never read the id, and
  // the session would end, with whatever the write started, at the close that
  // follows. Refused before a session exists, so nothing runs and vanishes.
  if ((fi->flags & O_ACCMODE) == O_WRONLY) {
    spdlog::info(
        "clone: refused a write-only open by uid {} pid {} (EINVAL): a clone session lives "
        "only while its file is open; open it read-write (exec 3<>clone) or use a named "
        "session (mkdir sessions/NAME, then write to its ctl)",
        caller.uid, caller.pid);
    fuse_reply_err(req, EINVAL);
    return;
  }
  const auto id = b.create_session(caller, "");
  if (id < 0) {
    fuse_reply_err(req, static_cast<int>(-id));
    return;
  }
  auto of = std::make_shared<OpenFile>();
  of->ino = Inode{Kind::top_file, 0, static_cast<std::uint32_t>(TopFile::clone)};
  of->clone = true;
  of->session = static_cast<SessionId>(id);
  of->replies = fmt::format("{}\n", id);
  fi->nonseekable = 1;
  reply_open(req, fi, std::move(of));
}

// Opening a snapshot inode reads the content its lookup rendered, with the
// checks of the file it is a snapshot of.
void open_snapshot(fuse_req_t req, fuse_file_info* fi, Filesystem& fs, Inode in,
                   const Caller& caller, bool writing) {
  const auto snap = fs.snapshots().find(encode(in));
  if (!snap) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  // Every generated file is read-only but policy, which admins write.
  const bool policy = snap->origin.kind == Kind::top_file &&
                      snap->origin.sub == static_cast<std::uint32_t>(TopFile::policy);
  if (writing && !(policy && caller.admin)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  auto of = std::make_shared<OpenFile>();
  of->ino = snap->origin;  // read, write and poll treat it as the file it shows
  if (snap->origin.kind == Kind::session_file) {
    if (int rc = fs.broker().check_access(snap->origin.id, caller)) {
      fuse_reply_err(req, rc);
      return;
    }
    of->session = snap->origin.id;
  }
  of->content = *snap->content;
  of->version = snap->version;
  reply_open(req, fi, std::move(of));
}

void op_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Filesystem& fs = *fs_of(req);
  Broker& b = fs.broker();
  const Inode in = decode(ino);
  const Caller caller = caller_of(req, fs.options());
  const bool writing = (fi->flags & O_ACCMODE) != O_RDONLY;
  auto of = std::make_shared<OpenFile>();
  of->ino = in;
  switch (in.kind) {
    case Kind::top_file:
      switch (static_cast<TopFile>(in.sub)) {
        case TopFile::readme:
          of->content = readme_text();
          break;
        case TopFile::version:
          of->content = version_text();
          break;
        case TopFile::stats:
          of->content = b.render_stats();
          break;
        case TopFile::metrics:
          of->content = b.render_metrics();
          break;
        case TopFile::policy:
          if (writing && !caller.admin) {
            fuse_reply_err(req, EACCES);
            return;
          }
          of->content = b.render_policy();
          break;
        case TopFile::ctl:
          if (!caller.admin) {
            fuse_reply_err(req, EACCES);
            return;
          }
          break;
        case TopFile::clone:
          open_clone(req, fi, b, caller);
          return;
        default:
          fuse_reply_err(req, ENOENT);
          return;
      }
      break;
    case Kind::clone_file:
      open_clone(req, fi, b, caller);
      return;
    case Kind::snapshot_file:
      open_snapshot(req, fi, fs, in, caller, writing);
      return;
    case Kind::gpu_file:
      if (writing) {
        fuse_reply_err(req, EACCES);
        return;
      }
      if (int rc = render(b, in, of->content, of->version)) {
        fuse_reply_err(req, rc);
        return;
      }
      break;
    case Kind::session_file:
    case Kind::mem_file: {
      if (int rc = b.check_access(in.id, caller)) {
        fuse_reply_err(req, rc);
        return;
      }
      of->session = in.id;
      if (in.kind == Kind::mem_file) {
        if (!b.buffer_by_id(in.id, in.sub)) {
          fuse_reply_err(req, ENOENT);
          return;
        }
        break;
      }
      const auto f = static_cast<SessionFile>(in.sub);
      if (writing && f != SessionFile::ctl) {
        fuse_reply_err(req, EACCES);
        return;
      }
      if (snapshotted(in)) render(b, in, of->content, of->version);  // status, log
      if (f == SessionFile::ctl || f == SessionFile::wait) fi->nonseekable = 1;
      break;
    }
    default:
      fuse_reply_err(req, EISDIR);
      return;
  }
  reply_open(req, fi, std::move(of));
}

void reply_slice(fuse_req_t req, const std::string& s, size_t size, off_t off) {
  if (off < 0 || static_cast<std::size_t>(off) >= s.size()) {
    fuse_reply_buf(req, nullptr, 0);
    return;
  }
  const std::size_t n = std::min(size, s.size() - static_cast<std::size_t>(off));
  fuse_reply_buf(req, s.data() + off, n);
}

void op_read(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Filesystem& fs = *fs_of(req);
  std::shared_ptr<OpenFile> of = open_of(fi);
  const Inode in = of->ino;
  const bool command_file =
      of->clone ||
      (in.kind == Kind::session_file && static_cast<SessionFile>(in.sub) == SessionFile::ctl) ||
      (in.kind == Kind::top_file && static_cast<TopFile>(in.sub) == TopFile::ctl);
  if (command_file) {
    std::lock_guard lk(of->mu);
    if (of->dropped) {
      of->replies.insert(0, fmt::format("dropped {}\n", of->dropped));
      of->dropped = 0;
    }
    const std::size_t n = std::min(size, of->replies.size());
    fuse_reply_buf(req, of->replies.data(), n);
    of->replies.erase(0, n);
    return;
  }
  if (in.kind == Kind::session_file && static_cast<SessionFile>(in.sub) == SessionFile::wait) {
    {
      std::lock_guard lk(of->mu);
      if (of->answered) {
        reply_slice(req, of->content, size, off);
        return;
      }
    }
    auto h = hold(req);
    const std::uint64_t ticket =
        fs.broker().wait(of->session, [h, of, size](int err, std::string text) {
          unhold(*h);
          if (err) {
            fuse_reply_err(h->req, err);
            return;
          }
          std::lock_guard lk(of->mu);
          of->answered = true;
          of->content = std::move(text);
          reply_slice(h->req, of->content, size, 0);
        });
    held_as(fs, h, of->session, ticket);
    return;
  }
  if (in.kind == Kind::mem_file) {
    if (off < 0) {
      fuse_reply_err(req, EINVAL);
      return;
    }
    // Held behind the session's earlier work, which may be a long spin: a
    // killed reader must not wait for it.
    auto h = hold(req);
    const std::uint64_t ticket =
        fs.broker().read_buffer(in.id, in.sub, static_cast<arena::Bytes>(off), size,
                                [h](int err, std::span<const char> data) {
                                  unhold(*h);
                                  if (err)
                                    fuse_reply_err(h->req, err);
                                  else
                                    fuse_reply_buf(h->req, data.data(), data.size());
                                });
    held_as(fs, h, in.id, ticket);
    return;
  }
  reply_slice(req, of->content, size, off);
}

void op_write(fuse_req_t req, fuse_ino_t, const char* buf, size_t size, off_t off,
              fuse_file_info* fi) {
  Filesystem& fs = *fs_of(req);
  Broker& b = fs.broker();
  std::shared_ptr<OpenFile> of = open_of(fi);
  const Inode in = of->ino;
  const Caller caller = caller_of(req, fs.options());
  const std::string_view text(buf, size);
  if (in.kind == Kind::top_file && static_cast<TopFile>(in.sub) == TopFile::policy) {
    if (!caller.admin) {
      fuse_reply_err(req, EACCES);
      return;
    }
    std::string why;
    const int rc = b.set_policy(std::string(text), why);
    if (rc) {
      // No session log to put it in: the daemon log, for the admin.
      spdlog::warn("policy: rejected '{}': {}", std::string(text.substr(0, text.find('\n'))), why);
      fuse_reply_err(req, rc);
    } else {
      spdlog::info("policy: now '{}'", std::string(text.substr(0, text.find('\n'))));
      fuse_reply_write(req, size);
    }
    return;
  }
  if (in.kind == Kind::top_file && static_cast<TopFile>(in.sub) == TopFile::ctl) {
    std::string reply, why, line;
    std::size_t start = 0;
    int rc = 0;
    while (start < text.size() && rc == 0) {
      std::size_t nl = text.find('\n', start);
      if (nl == std::string_view::npos) nl = text.size();
      line = std::string(text.substr(start, nl - start));
      rc = b.admin_command(line, reply, why);
      start = nl + 1;
    }
    // The reason goes back to the writer in the reply (there is no session log
    // here), and to the daemon log.
    if (rc) spdlog::warn("ctl: '{}' failed: {} ({})", line, why, strerrorname_np(rc));
    add_reply(*of, rc ? fmt::format("error {}: {}\n", strerrorname_np(rc), why) : reply);
    if (rc)
      fuse_reply_err(req, rc);
    else
      fuse_reply_write(req, size);
    return;
  }
  const bool session_ctl = of->clone || (in.kind == Kind::session_file &&
                                         static_cast<SessionFile>(in.sub) == SessionFile::ctl);
  if (session_ctl) {
    ParseResult parsed = parse_commands(text);
    std::optional<std::pair<std::uint32_t, std::pair<int, std::string>>> perr;
    if (parsed.error) perr = {parsed.error->line, {parsed.error->error, parsed.error->message}};
    auto h = hold(req);
    const std::uint64_t ticket =
        b.submit(of->session, caller, size, std::move(parsed.commands), std::move(perr),
                 [h, of, size](int err, std::string reply) {
                   unhold(*h);
                   // An interrupted write's caller never reads its reply.
                   if (err != EINTR)
                     add_reply(*of, err ? fmt::format("error {}\n", strerrorname_np(err))
                                        : std::move(reply));
                   if (err)
                     fuse_reply_err(h->req, err);
                   else
                     fuse_reply_write(h->req, size);
                 });
    held_as(fs, h, of->session, ticket);
    return;
  }
  if (in.kind == Kind::mem_file) {
    if (off < 0) {
      fuse_reply_err(req, EINVAL);
      return;
    }
    auto h = hold(req);
    const std::uint64_t ticket = b.write_buffer(in.id, in.sub, static_cast<arena::Bytes>(off), buf,
                                                size, [h](int err, arena::Bytes written) {
                                                  unhold(*h);
                                                  if (err)
                                                    fuse_reply_err(h->req, err);
                                                  else
                                                    fuse_reply_write(h->req, written);
                                                });
    held_as(fs, h, in.id, ticket);
    return;
  }
  fuse_reply_err(req, EACCES);
}

void op_create(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t, fuse_file_info* fi) {
  Filesystem& fs = *fs_of(req);
  const Inode p = decode(parent);
  if (p.kind != Kind::mem_dir) {
    fuse_reply_err(req, EPERM);
    return;
  }
  const int bid = fs.broker().create_buffer(p.id, caller_of(req, fs.options()), name);
  if (bid < 0) {
    fuse_reply_err(req, -bid);
    return;
  }
  const Inode in{Kind::mem_file, p.id, static_cast<std::uint32_t>(bid)};
  fuse_entry_param e;
  std::memset(&e, 0, sizeof e);
  if (int rc = fill_attr(fs, in, e.attr)) {
    fuse_reply_err(req, rc);
    return;
  }
  e.ino = encode(in);
  auto of = std::make_shared<OpenFile>();
  of->ino = in;
  of->session = p.id;
  fi->fh = reinterpret_cast<std::uint64_t>(new std::shared_ptr<OpenFile>(std::move(of)));
  fi->direct_io = 1;
  if (fuse_reply_create(req, &e, fi) == -ENOENT)
    delete reinterpret_cast<std::shared_ptr<OpenFile>*>(fi->fh);
}

// poll(2) on status: readable once the session's status has changed since this
// file was opened (re-open it to read the new snapshot). The poll handle waits
// in the broker, not in a daemon thread.
void op_poll(fuse_req_t req, fuse_ino_t, fuse_file_info* fi, fuse_pollhandle* ph) {
  Filesystem& fs = *fs_of(req);
  std::shared_ptr<OpenFile> of = open_of(fi);
  const bool status = of->ino.kind == Kind::session_file &&
                      static_cast<SessionFile>(of->ino.sub) == SessionFile::status;
  if (!status) {
    if (ph) fuse_pollhandle_destroy(ph);
    fuse_reply_poll(req, POLLIN | POLLOUT);
    return;
  }
  const bool changed = fs.broker().status_version(of->session) != of->version;
  if (ph) {
    if (changed) {
      fuse_pollhandle_destroy(ph);
    } else {
      // One watch per open file: the kernel hands a new poll handle to every
      // poll(2), and the newest replaces the one before.
      fs.broker().watch(of->session, of->version, reinterpret_cast<std::uintptr_t>(of.get()),
                        [ph](bool fire) {
                          if (fire) fuse_lowlevel_notify_poll(ph);
                          fuse_pollhandle_destroy(ph);
                        });
    }
  }
  fuse_reply_poll(req, changed ? POLLIN : 0);
}

void op_release(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  Filesystem& fs = *fs_of(req);
  auto* holder = reinterpret_cast<std::shared_ptr<OpenFile>*>(fi->fh);
  // The last close of a clone file ends its session and frees everything.
  if ((*holder)->clone) fs.broker().end_session((*holder)->session);
  const Inode in = (*holder)->ino;
  if (in.kind == Kind::session_file && static_cast<SessionFile>(in.sub) == SessionFile::status)
    fs.broker().unwatch((*holder)->session, reinterpret_cast<std::uintptr_t>(holder->get()));
  delete holder;
  fuse_reply_err(req, 0);
}

void op_statfs(fuse_req_t req, fuse_ino_t) {
  struct statvfs st;
  std::memset(&st, 0, sizeof st);
  st.f_bsize = 4096;
  st.f_namemax = 255;
  fuse_reply_statfs(req, &st);
}

void op_init(void*, fuse_conn_info* conn) {
  if (conn->capable & FUSE_CAP_ATOMIC_O_TRUNC) conn->want |= FUSE_CAP_ATOMIC_O_TRUNC;
  // mem/ requests are as large as they get: libfuse 3.14 caps max_write (and
  // with it max_pages) at 256 pages, the kernel's fs.fuse.max_pages_limit
  // defaults to the same, and max_read is left unlimited (0). Splice was tried
  // and saves no copy here (docs/benchmarks.md); bulk data uses upload/download.
  conn->max_write = 1024 * 1024;
  conn->max_background = 256;
}

const fuse_lowlevel_ops kOps = [] {
  fuse_lowlevel_ops ops;
  std::memset(&ops, 0, sizeof ops);
  ops.init = op_init;
  ops.lookup = op_lookup;
  ops.forget = op_forget;
  ops.forget_multi = op_forget_multi;
  ops.getattr = op_getattr;
  ops.setattr = op_setattr;
  ops.opendir = op_opendir;
  ops.readdir = op_readdir;
  ops.releasedir = op_releasedir;
  ops.mkdir = op_mkdir;
  ops.rmdir = op_rmdir;
  ops.unlink = op_unlink;
  ops.open = op_open;
  ops.read = op_read;
  ops.write = op_write;
  ops.create = op_create;
  ops.release = op_release;
  ops.poll = op_poll;
  ops.statfs = op_statfs;
  return ops;
}();

// The filesystem type of what is mounted at `path` (per /proc/self/mountinfo),
// e.g. "fuse.salus", or nullopt when nothing is.
std::optional<std::string> mounted_at(const std::string& path) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  std::optional<std::string> type;
  while (std::getline(in, line)) {
    // fields: id parent major:minor root mountpoint options [optional...] - fstype ...
    std::size_t pos = 0;
    for (int i = 0; i < 4 && pos != std::string::npos; ++i) pos = line.find(' ', pos + 1);
    if (pos == std::string::npos) continue;
    const std::size_t end = line.find(' ', pos + 1);
    if (line.substr(pos + 1, end - pos - 1) != path) continue;
    const std::size_t dash = line.find(" - ", end);
    // The last mount on the path is the one a lookup sees.
    type = dash == std::string::npos ? std::string()
                                     : line.substr(dash + 3, line.find(' ', dash + 3) - dash - 3);
  }
  return type;
}

// statfs(2) on `path`: 0 or its errno, ETIMEDOUT when no answer came within
// `limit`. A FUSE mount whose daemon died keeps answering stat from the
// kernel's attribute cache for up to the attribute timeout, but statfs always
// goes to the daemon, and on a dead connection fails at once with ENOTCONN.
// The call runs on its own thread: a live but hung filesystem must not hang
// salusd's start.
int statfs_errno(const std::string& path, std::chrono::milliseconds limit) {
  auto result = std::make_shared<std::promise<int>>();
  std::future<int> answer = result->get_future();
  std::thread([path, result] {
    struct statfs sf;
    result->set_value(::statfs(path.c_str(), &sf) == 0 ? 0 : errno);
  }).detach();
  if (answer.wait_for(limit) != std::future_status::ready) return ETIMEDOUT;
  return answer.get();
}

// ENOTCONN, with the way out in `why`: a FUSE mount whose daemon died is there.
int dead_mount(const std::string& path, std::string& why) {
  why = fmt::format("mountpoint {} is busy: a dead FUSE mount is there; run `fusermount3 -u {}`",
                    path, path);
  return ENOTCONN;
}

// `why` = "mountpoint <path>: strerror(err)"; returns `err`.
int failed(int err, const std::string& path, std::string& why) {
  why = fmt::format("mountpoint {}: {}", path, std::strerror(err));
  return err;
}

}  // namespace

Filesystem::Filesystem(vgpu::Broker& broker, FilesystemOptions options)
    : broker_(broker), options_(std::move(options)), snapshots_(std::make_unique<Snapshots>()) {}

Filesystem::~Filesystem() {
  unmount();
}

int Filesystem::mount(std::string& why) {
  if (::access("/dev/fuse", R_OK | W_OK) != 0) {
    const int e = errno;
    why = fmt::format(
        "cannot use /dev/fuse: {} (load the fuse module, or give the container "
        "--device /dev/fuse)",
        std::strerror(e));
    return e;
  }
  const std::string& mp = options_.mountpoint;
  char resolved[PATH_MAX];
  struct stat st;
  if (::stat(mp.c_str(), &st) != 0) {
    if (errno == ENOTCONN) return dead_mount(mp, why);
    if (errno != ENOENT) return failed(errno, mp, why);
    if (::mkdir(mp.c_str(), 0755) != 0) {
      // Only the last component is created: say so rather than a bare ENOENT.
      const int err = errno;
      why = fmt::format("mountpoint {}: cannot create it: {}{}", mp, std::strerror(err),
                        err == ENOENT ? " (salusd creates the mountpoint, not its parents)" : "");
      return err;
    }
  } else if (!S_ISDIR(st.st_mode)) {
    why = fmt::format("mountpoint {} is not a directory", mp);
    return ENOTDIR;
  }
  if (!::realpath(mp.c_str(), resolved)) return failed(errno, mp, why);
  if (const auto type = mounted_at(resolved)) {
    if (type->rfind("fuse", 0) == 0 && statfs_errno(resolved, std::chrono::seconds(2)) == ENOTCONN)
      return dead_mount(resolved, why);
    why = fmt::format(
        "mountpoint {} is busy: something is already mounted there (another "
        "salusd?)",
        resolved);
    return EBUSY;
  }
  std::vector<std::string> argv_s = {"salusd", "-o",
                                     "allow_other,default_permissions,fsname=salus,subtype=salus"};
  if (options_.debug) argv_s.push_back("-d");
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  session_ = fuse_session_new(&args, &kOps, sizeof kOps, this);
  if (!session_) {
    why = "could not create the FUSE session (see messages above)";
    return EIO;
  }
  if (fuse_session_mount(session_, resolved) != 0) {
    fuse_session_destroy(session_);
    session_ = nullptr;
    why = fmt::format("could not mount at {} (see messages above)", resolved);
    return EIO;
  }
  options_.mountpoint = resolved;
  mounted_ = true;
  return 0;
}

int Filesystem::serve() {
  if (!session_) return 1;
  if (fuse_set_signal_handlers(session_) != 0) return 1;
  fuse_loop_config* cfg = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(cfg, options_.max_threads);
  fuse_loop_cfg_set_idle_threads(cfg, 4);
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  bool watch_stop = false;
  std::thread watch([&] { watch_dying_callers(*this, watch_mu, watch_cv, watch_stop); });
  const int rc = fuse_session_loop_mt(session_, cfg);
  {
    std::lock_guard lk(watch_mu);
    watch_stop = true;
  }
  watch_cv.notify_all();
  watch.join();
  fuse_loop_cfg_destroy(cfg);
  fuse_remove_signal_handlers(session_);
  return rc < 0 ? 1 : 0;
}

void Filesystem::request_exit() {
  if (session_) fuse_session_exit(session_);
}

void Filesystem::unmount() {
  if (!session_) return;
  if (mounted_) fuse_session_unmount(session_);
  mounted_ = false;
  fuse_session_destroy(session_);
  session_ = nullptr;
}

}  // namespace salus::fusefs
