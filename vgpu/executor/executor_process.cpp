#include "vgpu/executor/executor_process.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "vgpu/unique_fd.hpp"

namespace salus::vgpu::executor {
namespace {

// Both directions get room for bursts of requests and completions; the kernel
// caps it at net.core.{w,r}mem_max, which is fine.
constexpr int kSocketBuffer = 4 << 20;

}  // namespace

int create_staging(std::uint64_t bytes, std::string& why) {
  UniqueFd fd(::memfd_create("salus-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) {
    why = fmt::format("memfd_create: {}", std::strerror(errno));
    return -1;
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    why = fmt::format("sizing the staging area to {} bytes: {}", bytes, std::strerror(errno));
    return -1;
  }
  // Neither side may shrink it under the other's mapping (SIGBUS).
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    why = fmt::format("sealing the staging area: {}", std::strerror(errno));
    return -1;
  }
  return fd.release();
}

int spawn_executor(const std::string& exe, const std::vector<std::string>& args, int staging_fd,
                   ExecutorProcess& out, std::string& why) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    const int err = errno;
    why = fmt::format("socketpair: {}", std::strerror(err));
    return err;
  }
  UniqueFd ours(sv[0]), theirs(sv[1]);
  for (int fd : sv) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &kSocketBuffer, sizeof kSocketBuffer);
  }
  // Everything the child needs is built before fork: between fork and exec only
  // async-signal-safe calls are allowed (another thread may hold malloc's lock).
  std::vector<std::string> storage;
  storage.reserve(args.size() + 1);
  // argv[0] names the real binary, for ps; the exec itself goes through `exe`
  // (/proc/self/exe still finds salusd if its file was replaced meanwhile).
  std::string argv0 = exe;
  char link[4096];
  if (const ssize_t n = ::readlink(exe.c_str(), link, sizeof link); n > 0 && n < 4096)
    argv0.assign(link, static_cast<std::size_t>(n));
  storage.push_back(argv0);
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const char* path = exe.c_str();
  const pid_t parent = ::getpid();
  const int child_sock = sv[1];

  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    why = fmt::format("fork: {}", std::strerror(err));
    return err;
  }
  if (pid == 0) {
    // Dies with the spawning thread; and if that is already gone, do not start.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    // Out of the way of 3 and 4 first, then into place; dup2 clears O_CLOEXEC.
    const int s = ::fcntl(child_sock, F_DUPFD_CLOEXEC, 10);
    const int m = ::fcntl(staging_fd, F_DUPFD_CLOEXEC, 10);
    if (s < 0 || m < 0 || ::dup2(s, 3) != 3 || ::dup2(m, 4) != 4) ::_exit(127);
    ::close_range(5, ~0U, 0);
    sigset_t none;
    ::sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(path, argv.data());
    ::_exit(127);
  }
  theirs.reset();
  out.pid = pid;
  out.socket = ours.release();
  return 0;
}

int reap_executor(pid_t pid, std::chrono::milliseconds grace) {
  if (pid <= 0) return -1;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill(pid, SIGKILL);
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return status;
}

std::string describe_wait_status(int status) {
  if (status < 0) return "vanished (could not be waited for)";
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    const char* text = ::sigdescr_np(sig);
    return fmt::format("killed by SIG{} ({})", name ? name : std::to_string(sig).c_str(),
                       text ? text : "unknown signal");
  }
  return fmt::format("ended with wait status {:#x}", status);
}

bool is_crash(int status) {
  if (status < 0 || !WIFSIGNALED(status)) return false;
  switch (WTERMSIG(status)) {
    case SIGSEGV:
    case SIGBUS:
    case SIGILL:
    case SIGFPE:
    case SIGABRT:
    case SIGTRAP:
      return true;
    default:
      return false;
  }
}

}  // namespace salus::vgpu::executor
