#include "vgpu/caller/caller_credentials.hpp"
#include "vgpu/unique_fd.hpp"

#include <fcntl.h>
#include <linux/capability.h>
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

// Whether process `pid` is in this process's user namespace.
bool same_user_namespace(pid_t pid) {
  struct stat mine, theirs;
  const std::string path = fmt::format("/proc/{}/ns/user", pid);
  return ::stat("/proc/self/ns/user", &mine) == 0 && ::stat(path.c_str(), &theirs) == 0 &&
         mine.st_dev == theirs.st_dev && mine.st_ino == theirs.st_ino;
}

// The calling thread's capability sets (capget with pid 0 reads this thread's).
bool thread_caps(__user_cap_data_struct (&data)[2]) {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  return ::syscall(SYS_capget, &hdr, data) == 0;
}

bool set_thread_caps(const __user_cap_data_struct (&data)[2]) {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  return ::syscall(SYS_capset, &hdr, data) == 0;
}

}  // namespace

CallerCredentials CallerCredentials::capture(const CallerIdentity& who) {
  CallerCredentials c;
  c.uid = who.uid;
  c.gid = who.gid;
  c.pid = who.pid;
  if (who.pid <= 0) {
    // /proc/self would be salusd itself: its groups, its capabilities, its root.
    c.refused = EPERM;
    c.refused_why =
        "the calling process is outside salusd's pid namespace (FUSE reports its pid as 0), so "
        "salusd cannot learn its groups, capabilities or root and does nothing as it (files, "
        "shm segments, modules); run it in salusd's pid namespace or a child of it";
    return c;
  }
  const std::string path = fmt::format("/proc/{}/status", who.pid);
  char buf[8192];
  ssize_t n;
  {
    const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return c;
    do {
      n = ::read(fd.get(), buf, sizeof buf - 1);
    } while (n < 0 && errno == EINTR);
  }
  if (n <= 0) return c;
  buf[n] = '\0';
  if (const char* u = status_field(buf, "\nUmask:"))
    c.umask = static_cast<mode_t>(std::strtoul(u, nullptr, 8)) & 0777;
  if (const char* e = status_field(buf, "\nCapEff:"); e && same_user_namespace(who.pid))
    c.caps = std::strtoull(e, nullptr, 16);
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
  if (who.refused) return;  // ok() stays false: nothing is done as this caller
  entered_ = true;
  // Read before setfsuid, which clears the filesystem capabilities it implies.
  __user_cap_data_struct caps[2];
  if (thread_caps(caps)) {
    saved_caps_[0] = caps[0].effective;
    saved_caps_[1] = caps[1].effective;
    caps_saved_ = true;
  }
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
  const bool ids_ok = static_cast<uid_t>(::setfsuid(static_cast<uid_t>(-1))) == who.uid &&
                      static_cast<gid_t>(::setfsgid(static_cast<gid_t>(-1))) == who.gid;
  // Last, because setgroups and setfsuid needed CAP_SETGID and CAP_SETUID: keep
  // only the effective capabilities the caller has itself. Without this, root's
  // CAP_SYS_ADMIN, CAP_SYS_PTRACE... would still apply to an open made as
  // nobody (sysfs config space, /proc/PID/cwd of another user's process).
  bool caps_ok = false;
  if (caps_saved_) {
    caps[0].effective = saved_caps_[0] & static_cast<std::uint32_t>(who.caps);
    caps[1].effective = saved_caps_[1] & static_cast<std::uint32_t>(who.caps >> 32);
    caps_ok = set_thread_caps(caps);
  }
  ok_ = groups_ok && ids_ok && caps_ok;
}

ThreadCredentials::~ThreadCredentials() {
  if (!entered_) return;
  // Capabilities first: restoring the groups needs CAP_SETGID back.
  __user_cap_data_struct caps[2];
  if (caps_saved_ && thread_caps(caps)) {
    caps[0].effective = saved_caps_[0];
    caps[1].effective = saved_caps_[1];
    set_thread_caps(caps);
  }
  ::setfsuid(::geteuid());
  ::setfsgid(::getegid());
  ::syscall(SYS_setgroups, saved_groups_.size(), saved_groups_.data());
}

}  // namespace salus::vgpu
