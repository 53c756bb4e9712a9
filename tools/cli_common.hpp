// cli_common: what salusctl and salus-run share, the plain file operations on the
// /salus tree (reads, one-write commands, key/value and table parsing), the
// error type both report as "TOOL: MESSAGE", and the signalfd both wait on.
// Kept out of fusefs on purpose: these are client-side helpers over files, and
// a tool linking them needs nothing but libc and fmt.
#pragma once

#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace salus::cli {

// ---------------------------------------------------------------- errors

// A failure to report as "salusctl: MESSAGE" with exit status 1.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const std::string& message) {
  throw Failure(message);
}

// ---------------------------------------------------------------- context

struct Ctx {
  std::string mount;
  bool explain = false;
  bool exact = false;  // print byte counts instead of K/M/G

  std::string path(std::string_view rel) const { return mount + "/" + std::string(rel); }
};

// Quotes a word for sh if it needs quoting.
std::string sh_quote(std::string_view s);
// A hint for errors that mean "there is no salusd at the mount point".
std::string mount_hint(const Ctx& ctx, int err);
[[noreturn]] void fail_file(const Ctx& ctx, const std::string& path, int err,
                            std::string_view extra = {});

// ---------------------------------------------------------------- file I/O

// Reads a whole file into `out`; 0 or an errno.
int try_read(const std::string& path, std::string& out);
std::string read_file(const Ctx& ctx, const std::string& path);
// One write() of `text`; 0 or an errno.
int try_write(const std::string& path, std::string_view text);
// The last line of a session's log, without its timestamp.
std::string last_log_line(const Ctx& ctx, const std::string& dir);

// ---------------------------------------------------------------- parsing

using KeyValues = std::map<std::string, std::string>;

// "key: value" lines (status, info, memory) or "key value" lines (stats).
KeyValues parse_kv(std::string_view text, std::string_view sep);
std::string get(const KeyValues& kv, const std::string& key, std::string fallback = "-");
std::vector<std::string> split_lines(std::string_view text);
std::vector<std::string> split_words(std::string_view line);
// Rows of a table file (gpus/N/lanes, gpus/N/queue): '#' lines are headers.
std::vector<std::vector<std::string>> parse_rows(std::string_view text);
std::optional<unsigned long long> to_u64(const std::string& s);

// A child's wait status as a shell reports it: the exit code, or 128 + signal.
int exit_status_of(int wstatus);

// ---------------------------------------------------------------- signals

// Signals that end `top` or that `run` handles, delivered through a signalfd.
class SignalFd {
 public:
  explicit SignalFd(std::initializer_list<int> signals) {
    sigemptyset(&set_);
    for (int s : signals) sigaddset(&set_, s);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
    fd_ = ::signalfd(-1, &set_, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd_ < 0) fail(fmt::format("signalfd: {}", std::strerror(errno)));
  }
  ~SignalFd() {
    ::close(fd_);
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SignalFd(const SignalFd&) = delete;
  SignalFd& operator=(const SignalFd&) = delete;
  int fd() const { return fd_; }
  const sigset_t& old_mask() const { return old_; }
  std::optional<signalfd_siginfo> take() {
    signalfd_siginfo si;
    if (::read(fd_, &si, sizeof si) != static_cast<ssize_t>(sizeof si)) return std::nullopt;
    return si;
  }

 private:
  sigset_t set_, old_;
  int fd_ = -1;
};

}  // namespace salus::cli
