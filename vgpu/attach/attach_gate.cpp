#include "vgpu/attach/attach_gate.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace salus::vgpu {

namespace {

#ifndef F_GET_SEALS
constexpr int F_GET_SEALS = 1034;
constexpr int F_SEAL_SHRINK = 0x0002;
constexpr int F_SEAL_GROW = 0x0004;
constexpr int F_SEAL_WRITE = 0x0008;
#endif

int pidfd_getfd(int pidfd, int fd) {
  return static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
}

// What /proc/self/fd/N links to: "anon_inode:[eventfd]", "/memfd:NAME (deleted)", ...
std::string fd_target(int fd) {
  char path[64];
  char buf[256];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(path, buf, sizeof buf - 1);
  return n < 0 ? std::string() : std::string(buf, static_cast<std::size_t>(n));
}

// Takes fd `n` of the process behind `pidfd`; the fd names the program's number.
int take_fd(int pidfd, int n, const char* what, UniqueFd& out, std::string& why) {
  const int fd = pidfd_getfd(pidfd, n);
  if (fd >= 0) {
    out.reset(fd);
    return 0;
  }
  const int e = errno;
  if (e == EBADF) {
    why = fmt::format("{}={}: the writing process has no such file descriptor", what, n);
  } else if (e == EPERM) {
    why = fmt::format(
        "{}={}: salusd may not take file descriptors from the writing process "
        "(pidfd_getfd: {}; ptrace access is denied)",
        what, n, std::strerror(e));
  } else {
    why = fmt::format("{}={}: pidfd_getfd: {}", what, n, std::strerror(e));
  }
  return e == ENOSYS ? EOPNOTSUPP : e;
}

int check_gate_file(const UniqueFd& fd, int n, std::string& why) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    why = fmt::format("gate={}: fstat: {}", n, std::strerror(errno));
    return EBADF;
  }
  if (!S_ISREG(st.st_mode)) {
    why = fmt::format("gate={} is not a memfd (it links to '{}')", n, fd_target(fd.get()));
    return EINVAL;
  }
  if (st.st_size != static_cast<off_t>(sizeof(salus_gate))) {
    why = fmt::format("gate={} is {} bytes; a gate is exactly sizeof(struct salus_gate) = {}", n,
                      st.st_size, sizeof(salus_gate));
    return EINVAL;
  }
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    why = fmt::format("gate={} cannot be sealed (not a memfd made with MFD_ALLOW_SEALING)", n);
    return EINVAL;
  }
  constexpr int kNeeded = F_SEAL_SHRINK | F_SEAL_GROW;
  if ((seals & kNeeded) != kNeeded) {
    why = fmt::format(
        "gate={} lacks F_SEAL_SHRINK|F_SEAL_GROW (seals {:#x}): the program could "
        "resize it under salusd's mapping",
        n, seals);
    return EINVAL;
  }
  if (seals & F_SEAL_WRITE) {
    why = fmt::format("gate={} is sealed against writes (F_SEAL_WRITE); salusd writes to it", n);
    return EINVAL;
  }
  return 0;
}

// The lane socket must carry whole messages with their fds: a Unix
// SOCK_SEQPACKET socket (a socket pair the program made).
int check_lane_socket(const UniqueFd& fd, int n, std::string& why) {
  int type = 0, domain = 0;
  socklen_t len = sizeof type;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_TYPE, &type, &len) != 0) {
    why = fmt::format("lane={} is not a socket (it links to '{}')", n, fd_target(fd.get()));
    return EINVAL;
  }
  len = sizeof domain;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 || domain != AF_UNIX ||
      type != SOCK_SEQPACKET) {
    why = fmt::format(
        "lane={} is not a Unix SOCK_SEQPACKET socket (domain {}, type {}): make it with "
        "socketpair(AF_UNIX, SOCK_SEQPACKET, 0, fds)",
        n, domain, type);
    return EINVAL;
  }
  return 0;
}

int check_header(const salus_gate& g, std::string& why) {
  const std::uint64_t magic = gate_load(const_cast<salus_gate&>(g).magic);
  const std::uint32_t version = gate_load(const_cast<salus_gate&>(g).version);
  const std::uint32_t size = gate_load(const_cast<salus_gate&>(g).size);
  if (magic != SALUS_GATE_MAGIC) {
    why = fmt::format("gate header: magic {:#x}, expected {:#x} (SALUS_GATE_MAGIC)", magic,
                      SALUS_GATE_MAGIC);
    return EINVAL;
  }
  if (version < SALUS_GATE_VERSION_OLDEST || version > SALUS_GATE_VERSION) {
    why = fmt::format("gate header: version {}, this salusd speaks versions {} to {}", version,
                      SALUS_GATE_VERSION_OLDEST, SALUS_GATE_VERSION);
    return EINVAL;
  }
  if (size != sizeof(salus_gate)) {
    why = fmt::format("gate header: size {}, expected sizeof(struct salus_gate) = {}", size,
                      sizeof(salus_gate));
    return EINVAL;
  }
  return 0;
}

}  // namespace

GateMapping::GateMapping(GateMapping&& o) noexcept
    : g_(std::exchange(o.g_, nullptr)), len_(std::exchange(o.len_, 0)) {}

GateMapping& GateMapping::operator=(GateMapping&& o) noexcept {
  if (this != &o) {
    reset();
    g_ = std::exchange(o.g_, nullptr);
    len_ = std::exchange(o.len_, 0);
  }
  return *this;
}

void GateMapping::reset() {
  if (g_) ::munmap(g_, len_);
  g_ = nullptr;
  len_ = 0;
}

void AttachedGate::wake() const {
  std::atomic_ref<std::uint32_t>(g().grant_word).fetch_add(1, std::memory_order_acq_rel);
  ::syscall(SYS_futex, &g().grant_word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

const char* swap_state_name(std::uint32_t state) {
  switch (state) {
    case SALUS_SWAP_RESIDENT:
      return "resident";
    case SALUS_SWAP_OUT_BUSY:
      return "swapping-out";
    case SALUS_SWAP_SWAPPED:
      return "swapped";
    case SALUS_SWAP_IN_BUSY:
      return "swapping-in";
    default:
      return "unknown";
  }
}

namespace {

// The number after `key` (e.g. "\nTgid:") in /proc/PID/status, or -ESRCH.
pid_t status_number(pid_t pid, std::string_view key) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/status", static_cast<int>(pid));
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd) return -ESRCH;
  char buf[4096];
  const ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
  if (n <= 0) return -ESRCH;
  const std::string_view text(buf, static_cast<std::size_t>(n));
  const auto at = text.find(key);
  if (at == std::string_view::npos) return -ESRCH;
  long number = 0;
  for (std::size_t i = at + key.size(); i < text.size() && text[i] != '\n'; ++i) {
    if (text[i] >= '0' && text[i] <= '9') number = number * 10 + (text[i] - '0');
    if (number > INT_MAX) return -ESRCH;
  }
  return static_cast<pid_t>(number);
}

}  // namespace

pid_t thread_group_of(pid_t tid) {
  if (tid <= 0) return -EPERM;
  const pid_t tgid = status_number(tid, "\nTgid:");
  return tgid > 0 ? tgid : -ESRCH;
}

std::vector<pid_t> ancestors_of(pid_t pid) {
  std::vector<pid_t> out;
  for (pid_t p = pid; out.size() < kMostAncestors;) {
    p = status_number(p, "\nPPid:");
    if (p <= 1) break;  // init, a reaper's adoption, or gone
    out.push_back(p);
  }
  return out;
}

int take_gate(pid_t tid, int gate_fd, int bell_fd, int lane_fd, AttachedGate& out,
              std::string& why) {
  if (tid <= 0) {
    why =
        "the writing process is not visible to salusd (pid 0: another pid namespace?); "
        "attach must be written by the program itself";
    return EPERM;
  }
  const pid_t tgid = thread_group_of(tid);
  if (tgid < 0) {
    why = fmt::format("the writing thread {} is gone", tid);
    return ESRCH;
  }
  UniqueFd pidfd(pidfd_open(tgid));
  if (!pidfd) {
    const int e = errno;
    why = fmt::format("pidfd_open({}): {}", tgid, std::strerror(e));
    return e == ENOSYS ? EOPNOTSUPP : (e == ESRCH ? ESRCH : EPERM);
  }
  // The pidfd names process tgid; make sure it is still the writer's (pid reuse).
  if (thread_group_of(tid) != tgid) {
    why = fmt::format("the writing thread {} exited while attaching", tid);
    return ESRCH;
  }
  UniqueFd memfd, bell;
  if (int e = take_fd(pidfd.get(), gate_fd, "gate", memfd, why)) return e;
  if (int e = take_fd(pidfd.get(), bell_fd, "bell", bell, why)) return e;
  if (const std::string t = fd_target(bell.get()); t != "anon_inode:[eventfd]") {
    why = fmt::format("bell={} is not an eventfd (it links to '{}')", bell_fd, t);
    return EINVAL;
  }
  if (int e = check_gate_file(memfd, gate_fd, why)) return e;
  UniqueFd lane;
  if (lane_fd >= 0) {
    if (int e = take_fd(pidfd.get(), lane_fd, "lane", lane, why)) return e;
    if (int e = check_lane_socket(lane, lane_fd, why)) return e;
  }
  void* p = ::mmap(nullptr, sizeof(salus_gate), PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    why = fmt::format("gate={}: mmap: {}", gate_fd, std::strerror(e));
    return e == EACCES || e == EPERM ? EINVAL : e;
  }
  GateMapping map(static_cast<salus_gate*>(p), sizeof(salus_gate));
  if (int e = check_header(*map.get(), why)) return e;
  out.pid = tgid;
  // Only a program that uses the GPU may take a session over from an ancestor
  // (client/salus_gate.h, hand-over): read its ancestry now, before the broker
  // locks.
  if (gate_load(map.get()->uses_gpu) == 1) out.ancestors = ancestors_of(tgid);
  out.pidfd = std::move(pidfd);
  out.memfd = std::move(memfd);
  out.bell = std::move(bell);
  out.map = std::move(map);
  out.lane_sock = std::move(lane);
  return 0;
}

int pidfd_open(pid_t pid) {
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

}  // namespace salus::vgpu
