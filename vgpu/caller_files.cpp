#include "vgpu/caller_files.hpp"

#include <fcntl.h>
#include <grp.h>
#include <linux/openat2.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace salus::vgpu {

namespace {

// setfsuid/setfsgid and the raw setgroups syscall change only the calling
// thread's credentials (glibc's setgroups() would change every thread).
class ThreadCredentials {
 public:
  explicit ThreadCredentials(const CallerIdentity& who) {
    groups_ = supplementary_groups(who);
    saved_ngroups_ = ::getgroups(0, nullptr);
    saved_groups_.resize(saved_ngroups_ > 0 ? static_cast<std::size_t>(saved_ngroups_) : 0);
    if (saved_ngroups_ > 0) ::getgroups(saved_ngroups_, saved_groups_.data());
    ::syscall(SYS_setgroups, groups_.size(), groups_.data());
    ::setfsgid(who.gid);
    ::setfsuid(who.uid);
    ok_ = static_cast<uid_t>(::setfsuid(static_cast<uid_t>(-1))) == who.uid &&
          static_cast<gid_t>(::setfsgid(static_cast<gid_t>(-1))) == who.gid;
  }
  ~ThreadCredentials() {
    ::setfsuid(::geteuid());
    ::setfsgid(::getegid());
    ::syscall(SYS_setgroups, saved_groups_.size(), saved_groups_.data());
  }
  bool ok() const { return ok_; }

 private:
  static std::vector<gid_t> supplementary_groups(const CallerIdentity& who) {
    // The caller's groups as the kernel has them for that process.
    std::vector<gid_t> groups;
    if (who.pid > 0) {
      const std::string path = fmt::format("/proc/{}/status", who.pid);
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        char buf[4096];
        const ssize_t n = ::read(fd, buf, sizeof buf - 1);
        ::close(fd);
        if (n > 0) {
          buf[n] = '\0';
          if (const char* g = std::strstr(buf, "\nGroups:")) {
            g += 8;
            while (*g && *g != '\n') {
              char* end = nullptr;
              const unsigned long v = std::strtoul(g, &end, 10);
              if (end == g) break;
              groups.push_back(static_cast<gid_t>(v));
              g = end;
              while (*g == ' ' || *g == '\t') ++g;
            }
          }
        }
      }
    }
    return groups;
  }

  std::vector<gid_t> groups_;
  int saved_ngroups_ = 0;
  std::vector<gid_t> saved_groups_;
  bool ok_ = false;
};

}  // namespace

int open_as_caller(const CallerIdentity& who, const std::string& path, int flags, mode_t mode,
                   std::string& why) {
  if (path.empty() || path[0] != '/') {
    why = fmt::format("'{}' is not an absolute path", path);
    return -EINVAL;
  }
  const std::string root = who.pid > 0 ? fmt::format("/proc/{}/root", who.pid) : "/";
  const int root_fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0) {
    const int e = errno;
    why = fmt::format("cannot reach the caller's root {}: {}", root, std::strerror(e));
    return -e;
  }
  open_how how;
  std::memset(&how, 0, sizeof how);
  how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
  int fd;
  int err = 0;
  {
    ThreadCredentials creds(who);
    if (!creds.ok()) {
      ::close(root_fd);
      why = "could not take on the caller's credentials";
      return -EPERM;
    }
    fd = static_cast<int>(::syscall(SYS_openat2, root_fd, path.c_str() + 1, &how, sizeof how));
    if (fd < 0) err = errno;
  }
  ::close(root_fd);
  if (fd < 0) {
    why = fmt::format("{}: {}", path, std::strerror(err));
    return -err;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const bool dir = S_ISDIR(st.st_mode);
    ::close(fd);
    why = fmt::format("{}: not a regular file", path);
    return dir ? -EISDIR : -EINVAL;
  }
  // O_NONBLOCK only kept a FIFO from blocking the open; regular files ignore it.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

int read_file_as_caller(const CallerIdentity& who, const std::string& path, std::size_t limit,
                        std::vector<std::uint8_t>& out, std::string& why) {
  const int fd = open_as_caller(who, path, O_RDONLY, 0, why);
  if (fd < 0) return fd;
  struct stat st;
  ::fstat(fd, &st);
  if (static_cast<std::size_t>(st.st_size) > limit) {
    ::close(fd);
    why = fmt::format("{}: {} bytes is more than the {} allowed", path, st.st_size, limit);
    return -EFBIG;
  }
  out.resize(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      ::close(fd);
      why = fmt::format("{}: read failed: {}", path, std::strerror(e));
      return -e;
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return 0;
}

}  // namespace salus::vgpu
