// salus.hpp: a header-only C++17 client for salusd.
//
// salusd's whole API is the /salus filesystem; this header wraps the files of one
// session (ctl, status, log, wait, mem/NAME) in a small RAII class so that C++ jobs
// need not format commands by hand. It has no dependencies beyond POSIX and the
// standard library; every call is a plain open/read/write on the mount.
//
//   salus::Session s;                                  // opens /salus/clone
//   s.need(salus::MiB(64), salus::MiB(256));
//   s.alloc("w", salus::MiB(4));
//   s.iterate([&] {                                    // begin ... end x100
//     s.alloc("tmp", salus::MiB(8));
//     s.fill("tmp", 1.0);
//     s.gemm(256, 256, 256, "w", "w", "tmp");
//   }, 100);
//   s.wait();                                          // "done 100" -> 100
//
// Bulk data: upload_file/download_file (checkpoints; salusd reads and writes the
// file as you) and, with salus_shm.hpp (Boost.Interprocess), shared memory:
//
//   salus::SharedSegment seg(salus::MiB(64));           // /dev/shm/salus-..., 0600
//   std::memcpy(seg.data(), batch, n);
//   s.upload_shm("x", seg.name(), n);                   // or salus::upload(s, "x", batch, n)
//   s.download_file("w", "/ckpt/w.bin", salus::MiB(4));
//
// Failures throw std::system_error whose code() is the errno that salusd returned
// (std::generic_category, so `e.code() == std::errc::invalid_argument` works) and
// whose what() includes the last line of the session's log, where salusd explains.
//
// The mount point is $SALUS_MOUNT, else /salus. Session::attach() joins an existing
// session directory, by default $SALUS_SESSION (set by `salusctl run`).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace salus {

constexpr std::uint64_t KiB(std::uint64_t n) {
  return n << 10;
}
constexpr std::uint64_t MiB(std::uint64_t n) {
  return n << 20;
}
constexpr std::uint64_t GiB(std::uint64_t n) {
  return n << 30;
}

// $SALUS_MOUNT, else /salus.
inline std::string default_mount() {
  const char* m = std::getenv("SALUS_MOUNT");
  return m && *m ? std::string(m) : std::string("/salus");
}

enum class Dtype { f32, i32, u8 };

// Optional fields of `need`.
struct NeedOptions {
  std::optional<std::uint64_t> iters;  // declared iterations (SRTF ranks by them)
  std::optional<std::int32_t> priority;
  std::optional<int> gpu;  // an index; unset: any GPU (placement policy decides)
};

namespace detail {

inline std::string strip_timestamp(const std::string& line) {
  if (!line.empty() && line[0] == '[') {
    const auto close = line.find("] ");
    if (close != std::string::npos) return line.substr(close + 2);
  }
  return line;
}

// Reads a file to EOF; returns 0 or an errno.
inline int read_all(const std::string& path, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  out.clear();
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return err;
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return 0;
}

inline std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

}  // namespace detail

class Session {
 public:
  // A new session through <mount>/clone; it ends (and frees everything it holds)
  // when this object is destroyed or close() is called.
  explicit Session(const std::string& mount = default_mount()) : mount_(mount) {
    const std::string clone = mount_ + "/clone";
    fd_ = ::open(clone.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0) {
      const int err = errno;
      fail(err, clone + ": cannot open a session (is salusd mounted there?)");
    }
    char buf[64];
    ssize_t n;
    do {
      n = ::read(fd_, buf, sizeof buf - 1);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
      const int err = n < 0 ? errno : EPROTO;
      ::close(fd_);
      fd_ = -1;
      fail(err, clone + ": reading the session id");
    }
    id_.assign(buf, static_cast<std::size_t>(n));
    while (!id_.empty() && (id_.back() == '\n' || id_.back() == ' ')) id_.pop_back();
    dir_ = mount_ + "/sessions/" + id_;
  }

  // A named session: mkdir sessions/NAME; it is removed (rmdir) on destruction.
  static Session named(const std::string& name, const std::string& mount = default_mount()) {
    const std::string dir = mount + "/sessions/" + name;
    if (::mkdir(dir.c_str(), 0700) != 0) {
      const int err = errno;
      fail(err, dir + ": mkdir");
    }
    return Session(Tag{}, mount, name, dir, true);
  }

  // Joins an existing session directory (default $SALUS_SESSION); not removed.
  static Session attach(std::string dir = {}) {
    if (dir.empty()) {
      const char* env = std::getenv("SALUS_SESSION");
      if (!env || !*env) fail(ENOENT, "attach: $SALUS_SESSION is not set");
      dir = env;
    }
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    const auto slash = dir.rfind('/');
    const std::string name = slash == std::string::npos ? dir : dir.substr(slash + 1);
    std::string mount = default_mount();
    const auto sessions = dir.rfind("/sessions/");
    if (sessions != std::string::npos) mount = dir.substr(0, sessions);
    struct stat st;
    if (::stat((dir + "/ctl").c_str(), &st) != 0) {
      const int err = errno;
      fail(err, dir + ": attach");
    }
    return Session(Tag{}, mount, name, dir, false);
  }

  Session(Session&& o) noexcept
      : mount_(std::move(o.mount_)),
        id_(std::move(o.id_)),
        dir_(std::move(o.dir_)),
        fd_(std::exchange(o.fd_, -1)),
        remove_dir_(std::exchange(o.remove_dir_, false)) {}
  Session& operator=(Session&& o) noexcept {
    if (this != &o) {
      close_noexcept();
      mount_ = std::move(o.mount_);
      id_ = std::move(o.id_);
      dir_ = std::move(o.dir_);
      fd_ = std::exchange(o.fd_, -1);
      remove_dir_ = std::exchange(o.remove_dir_, false);
    }
    return *this;
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { close_noexcept(); }

  // Ends the session (clone: closes the fd; named: rmdir). Throws on rmdir errors.
  void close() {
    const int err = close_impl();
    if (err) throw_errno(err, dir_ + ": rmdir", false);
  }

  const std::string& id() const { return id_; }    // the directory name under sessions/
  const std::string& dir() const { return dir_; }  // <mount>/sessions/<id>
  const std::string& mount() const { return mount_; }
  std::string path(std::string_view file) const { return dir_ + "/" + std::string(file); }

  // ---- commands: each call is one write() of one or more lines ----

  // Sends raw command text (newline-terminated as needed). Throws on failure.
  // While an Iteration is open the text is kept and sent with it.
  void command(std::string_view text) {
    std::string line(text);
    if (line.empty() || line.back() != '\n') line += '\n';
    if (batch_) {
      *batch_ += line;
      return;
    }
    send(line);
  }

  void need(std::uint64_t persistent, std::uint64_t ephemeral, const NeedOptions& o = {}) {
    std::string line =
        "need persistent=" + std::to_string(persistent) + " ephemeral=" + std::to_string(ephemeral);
    if (o.iters) line += " iters=" + std::to_string(*o.iters);
    if (o.priority) line += " priority=" + std::to_string(*o.priority);
    if (o.gpu) line += " gpu=" + std::to_string(*o.gpu);
    command(line);
  }
  // Outside an iteration: persistent; inside begin/end: ephemeral, freed at end.
  void alloc(const std::string& name, std::uint64_t bytes) {
    command("alloc " + name + " " + std::to_string(bytes));
  }
  void free(const std::string& name) { command("free " + name); }
  void fill(const std::string& buf, double value, Dtype dtype = Dtype::f32,
            std::optional<std::uint64_t> offset = std::nullopt,
            std::optional<std::uint64_t> length = std::nullopt) {
    std::string line = "fill " + buf + " " +
                       (dtype == Dtype::f32 ? detail::fmt_double(value)
                                            : std::to_string(static_cast<long long>(value)));
    line += dtype == Dtype::f32 ? " dtype=f32" : dtype == Dtype::i32 ? " dtype=i32" : " dtype=u8";
    if (offset) line += " off=" + std::to_string(*offset);
    if (length) line += " len=" + std::to_string(*length);
    command(line);
  }
  void copy(const std::string& dst, const std::string& src, std::uint64_t bytes,
            std::uint64_t dst_offset = 0, std::uint64_t src_offset = 0) {
    command("copy " + ref(dst, dst_offset) + " " + ref(src, src_offset) + " " +
            std::to_string(bytes));
  }
  // C[m x n] = A[m x k] * B[k x n], f32.
  void gemm(std::uint32_t m, std::uint32_t n, std::uint32_t k, const std::string& a,
            const std::string& b, const std::string& c) {
    command("gemm " + std::to_string(m) + " " + std::to_string(n) + " " + std::to_string(k) + " " +
            a + " " + b + " " + c);
  }
  void spin(std::uint64_t usec, std::optional<double> util = std::nullopt) {
    std::string line = "spin " + std::to_string(usec);
    if (util) line += " util=" + detail::fmt_double(*util);
    command(line);
  }
  void priority(std::int32_t p) { command("priority " + std::to_string(p)); }
  // Submits the last recorded iteration n more times.
  void run(std::uint64_t n) { command("run " + std::to_string(n)); }
  // Returns when all earlier work has finished.
  void sync() { command("sync"); }

  // ---- iterations ----

  // Records the commands issued while it is open as one iteration. end() (or the
  // destructor) sends them in one write, "begin ... end xN"; if an exception unwinds
  // past it, nothing is sent. If a line fails, nothing is submitted and end() throws
  // naming the line (from the log); salusd then still holds the lines before it as
  // an open recording (it has no command to abort one): command("end") submits
  // them anyway, or end the session.
  class Iteration {
   public:
    Iteration(Iteration&& o) noexcept
        : s_(std::exchange(o.s_, nullptr)),
          repeat_(o.repeat_),
          unwinding_(o.unwinding_),
          text_(std::move(o.text_)) {
      if (s_) s_->batch_ = &text_;
    }
    Iteration(const Iteration&) = delete;
    Iteration& operator=(const Iteration&) = delete;
    Iteration& operator=(Iteration&&) = delete;
    // Submits the recorded iteration `repeat` times (default: as constructed).
    void end(std::optional<std::uint64_t> repeat = std::nullopt) {
      if (!s_) return;
      Session* s = std::exchange(s_, nullptr);
      s->batch_ = nullptr;
      s->send("begin\n" + text_ + "end x" + std::to_string(repeat.value_or(repeat_)) + "\n");
    }
    // Discards what was recorded; nothing is sent.
    void cancel() noexcept {
      if (s_) std::exchange(s_, nullptr)->batch_ = nullptr;
    }
    // Ends it unless end() or cancel() was called or an exception is unwinding.
    // Errors are swallowed here: call end() to see them.
    ~Iteration() {
      if (!s_) return;
      if (std::uncaught_exceptions() > unwinding_) {
        cancel();
        return;
      }
      try {
        end();
      } catch (...) {
      }
    }

   private:
    friend class Session;
    Iteration(Session& s, std::uint64_t repeat)
        : s_(&s), repeat_(repeat), unwinding_(std::uncaught_exceptions()) {
      if (s.batch_) throw std::logic_error("salus: iteration inside an iteration");
      s.batch_ = &text_;
    }
    Session* s_;
    std::uint64_t repeat_;
    int unwinding_;
    std::string text_;
  };

  [[nodiscard]] Iteration iteration(std::uint64_t repeat = 1) { return Iteration(*this, repeat); }

  // Records the commands body() issues as one iteration, then submits it `repeat`
  // times (one write; see Iteration). If body() throws, nothing is sent.
  template <class Body>
  void iterate(Body&& body, std::uint64_t repeat = 1) {
    Iteration it(*this, repeat);
    body();
    it.end();
  }

  // ---- results ----

  // Blocks until all submitted work is done; returns the iterations done so far.
  std::uint64_t wait() {
    std::string text;
    if (const int err = detail::read_all(path("wait"), text)) throw_errno(err, "wait", true);
    // "done <n>"
    const auto sp = text.find(' ');
    return sp == std::string::npos ? 0 : std::strtoull(text.c_str() + sp + 1, nullptr, 10);
  }

  // status as a map: state, gpu, lane, iterations_done, mean_iteration_ms, ...
  std::map<std::string, std::string> status() const {
    std::string text;
    if (const int err = detail::read_all(path("status"), text)) throw_errno(err, "status", false);
    std::map<std::string, std::string> out;
    std::size_t pos = 0;
    while (pos < text.size()) {
      auto nl = text.find('\n', pos);
      if (nl == std::string::npos) nl = text.size();
      const std::string line = text.substr(pos, nl - pos);
      pos = nl + 1;
      const auto colon = line.find(": ");
      if (colon != std::string::npos) out[line.substr(0, colon)] = line.substr(colon + 2);
    }
    return out;
  }

  // The session's log lines without timestamps, oldest first; the last `n` if n > 0.
  std::vector<std::string> log(std::size_t n = 0) const {
    std::string text;
    if (const int err = detail::read_all(path("log"), text)) throw_errno(err, "log", false);
    std::vector<std::string> lines;
    std::size_t pos = 0;
    while (pos < text.size()) {
      auto nl = text.find('\n', pos);
      if (nl == std::string::npos) nl = text.size();
      lines.push_back(detail::strip_timestamp(text.substr(pos, nl - pos)));
      pos = nl + 1;
    }
    if (n > 0 && lines.size() > n) lines.erase(lines.begin(), lines.end() - static_cast<long>(n));
    return lines;
  }
  std::string last_log_line() const noexcept {
    try {
      auto l = log(1);
      return l.empty() ? std::string() : l.back();
    } catch (...) {
      return {};
    }
  }

  // ---- buffer contents through mem/NAME (ordered after earlier work) ----

  void write_buffer(const std::string& name, const void* data, std::size_t bytes,
                    std::uint64_t offset = 0) {
    const std::string p = path("mem/" + name);
    const int fd = ::open(p.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      throw_errno(err, p, true);
    }
    const char* src = static_cast<const char*>(data);
    std::size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pwrite(fd, src + done, bytes - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : EIO;
        ::close(fd);
        throw_errno(err, p + ": write", true);
      }
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
  }
  template <class T>
  void write_buffer(const std::string& name, const std::vector<T>& v, std::uint64_t offset = 0) {
    write_buffer(name, v.data(), v.size() * sizeof(T), offset);
  }

  // Reads `bytes` bytes; throws ERANGE if the buffer ends first.
  void read_buffer(const std::string& name, void* data, std::size_t bytes,
                   std::uint64_t offset = 0) const {
    const std::string p = path("mem/" + name);
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      throw_errno(err, p, true);
    }
    char* dst = static_cast<char*>(data);
    std::size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd, dst + done, bytes - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : ERANGE;
        ::close(fd);
        // A short read is detected here; only salusd's own errors have a log line.
        throw_errno(err, p + (n == 0 ? ": read past the end of the buffer" : ": read"), n < 0);
      }
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
  }
  template <class T>
  std::vector<T> read_buffer(const std::string& name, std::size_t count,
                             std::uint64_t offset = 0) const {
    std::vector<T> v(count);
    read_buffer(name, v.data(), count * sizeof(T), offset);
    return v;
  }

  // ---- bulk transfers: salusd moves the bytes itself, ordered with the work ----
  // With `sync` the call returns once the transfer is done (a `sync` follows it
  // in the same write); without, once it is queued: then leave the file or
  // segment alone until wait(). Errors found while it runs fail the session.

  // upload BUF[+OFF] file:PATH[+FOFF] LEN: salusd reads the file as this uid,
  // with io_uring. Loading a checkpoint back is this. `path` must be absolute.
  void upload_file(const std::string& buf, const std::string& path, std::uint64_t bytes,
                   std::uint64_t offset = 0, std::uint64_t file_offset = 0, bool sync = true) {
    transfer("upload", buf, offset, "file:" + ref(path, file_offset), bytes, sync);
  }
  // download BUF[+OFF] file:PATH[+FOFF] LEN: salusd writes the file as this
  // uid, creating it (0666 & ~umask) if needed; it never truncates one.
  void download_file(const std::string& buf, const std::string& path, std::uint64_t bytes,
                     std::uint64_t offset = 0, std::uint64_t file_offset = 0, bool sync = true) {
    transfer("download", buf, offset, "file:" + ref(path, file_offset), bytes, sync);
  }
  // The same through a POSIX shared-memory segment /dev/shm/SEGMENT owned by
  // this uid (salus_shm.hpp makes them with Boost.Interprocess).
  void upload_shm(const std::string& buf, const std::string& segment, std::uint64_t bytes,
                  std::uint64_t offset = 0, std::uint64_t segment_offset = 0, bool sync = true) {
    transfer("upload", buf, offset, "shm:" + ref(segment, segment_offset), bytes, sync);
  }
  void download_shm(const std::string& buf, const std::string& segment, std::uint64_t bytes,
                    std::uint64_t offset = 0, std::uint64_t segment_offset = 0, bool sync = true) {
    transfer("download", buf, offset, "shm:" + ref(segment, segment_offset), bytes, sync);
  }

 private:
  struct Tag {};
  Session(Tag, std::string mount, std::string id, std::string dir, bool remove_dir)
      : mount_(std::move(mount)),
        id_(std::move(id)),
        dir_(std::move(dir)),
        remove_dir_(remove_dir) {
    const std::string ctl = dir_ + "/ctl";
    fd_ = ::open(ctl.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0) {
      const int err = errno;
      if (remove_dir_) ::rmdir(dir_.c_str());
      throw_errno(err, ctl, false);
    }
  }

  // One write() of command text.
  void send(const std::string& line) {
    if (fd_ < 0) throw_errno(EBADF, "session is closed", false);
    ssize_t n;
    do {
      n = ::write(fd_, line.data(), line.size());
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      const int err = errno;
      std::string shown = line.substr(0, line.size() - 1);
      for (std::size_t nl; (nl = shown.find('\n')) != std::string::npos;)
        shown.replace(nl, 1, "; ");
      if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
      throw_errno(err, "'" + shown + "'", true);
    }
  }

  static std::string ref(const std::string& buf, std::uint64_t offset) {
    return offset ? buf + "+" + std::to_string(offset) : buf;
  }
  void transfer(const char* verb, const std::string& buf, std::uint64_t offset,
                const std::string& endpoint, std::uint64_t bytes, bool sync) {
    command(std::string(verb) + " " + ref(buf, offset) + " " + endpoint + " " +
            std::to_string(bytes) + (sync ? "\nsync" : ""));
  }

  // Throws std::system_error(err) naming the session, the operation and, if
  // `with_log`, the session log's last line (salusd's explanation).
  [[noreturn]] void throw_errno(int err, const std::string& what, bool with_log) const {
    std::string msg = "salus";
    if (!id_.empty()) msg += " session " + id_;
    msg += ": " + what;
    if (with_log && !dir_.empty()) {
      const std::string last = last_log_line();
      if (!last.empty()) msg += " [log: " + last + "]";
    }
    throw std::system_error(err, std::generic_category(), msg);
  }
  [[noreturn]] static void fail(int err, const std::string& what) {
    throw std::system_error(err, std::generic_category(), "salus: " + what);
  }

  int close_impl() {
    int err = 0;
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
    if (remove_dir_) {
      remove_dir_ = false;
      if (::rmdir(dir_.c_str()) != 0 && errno != ENOENT) err = errno;
    }
    return err;
  }
  void close_noexcept() noexcept { close_impl(); }

  std::string mount_;
  std::string id_;
  std::string dir_;
  int fd_ = -1;
  bool remove_dir_ = false;
  std::string* batch_ = nullptr;  // the open Iteration's text, if any
};

}  // namespace salus
