#include "vgpu/caller_credentials.hpp"

#include <fcntl.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace salus::vgpu {

namespace {

// The value after "\nKEY:" in a /proc/PID/status text, or nullptr.
const char* status_field(const char* text, const char* key) {
  const char* p = std::strstr(text, key);
  if (!p) return nullptr;
  p += std::strlen(key);
  while (*p == ' ' || *p == '\t') ++p;
  return p;
}

}  // namespace

CallerCredentials CallerCredentials::capture(const CallerIdentity& who) {
  CallerCredentials c;
  c.uid = who.uid;
  c.gid = who.gid;
  c.pid = who.pid;
  const std::string path =
      who.pid > 0 ? fmt::format("/proc/{}/status", who.pid) : std::string("/proc/self/status");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return c;
  char buf[8192];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof buf - 1);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n <= 0) return c;
  buf[n] = '\0';
  if (const char* u = status_field(buf, "\nUmask:"))
    c.umask = static_cast<mode_t>(std::strtoul(u, nullptr, 8)) & 0777;
  // Only a caller's own groups count: the process was found by pid, so it may be
  // salusd itself (pid 0) but then it is root's anyway.
  if (const char* g = status_field(buf, "\nGroups:")) {
    while (*g && *g != '\n') {
      char* end = nullptr;
      const unsigned long v = std::strtoul(g, &end, 10);
      if (end == g) break;
      c.groups.push_back(static_cast<gid_t>(v));
      g = end;
      while (*g == ' ' || *g == '\t') ++g;
    }
  }
  return c;
}

std::string CallerCredentials::root_path() const {
  return pid > 0 ? fmt::format("/proc/{}/root", pid) : std::string("/");
}

ThreadCredentials::ThreadCredentials(const CallerCredentials& who) {
  const int n = ::getgroups(0, nullptr);
  saved_groups_.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  if (n > 0 && ::getgroups(n, saved_groups_.data()) != n) saved_groups_.clear();
  // An unprivileged salusd (tests, development) can act only as itself, with
  // its own groups, and cannot call setgroups: that is not a failure.
  const bool groups_ok =
      ::syscall(SYS_setgroups, who.groups.size(), who.groups.data()) == 0 || ::geteuid() != 0;
  ::setfsgid(who.gid);
  ::setfsuid(who.uid);
  // setfsuid returns the previous value, so asking with -1 reads the current one.
  ok_ = groups_ok && static_cast<uid_t>(::setfsuid(static_cast<uid_t>(-1))) == who.uid &&
        static_cast<gid_t>(::setfsgid(static_cast<gid_t>(-1))) == who.gid;
}

ThreadCredentials::~ThreadCredentials() {
  ::setfsuid(::geteuid());
  ::setfsgid(::getegid());
  ::syscall(SYS_setgroups, saved_groups_.size(), saved_groups_.data());
}

}  // namespace salus::vgpu
