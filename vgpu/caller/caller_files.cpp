#include "vgpu/caller/caller_files.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <string_view>

#include <fmt/format.h>

namespace salus::vgpu {

namespace {

// One step of a walk: `name` is a single component, looked up in `dir` without
// following anything, as the thread's current (the caller's) credentials.
// Returns the fd, or -errno.
int open_step(int dir, const std::string& name, int flags, mode_t mode = 0) {
  open_how how;
  std::memset(&how, 0, sizeof how);
  how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC | O_NOFOLLOW);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH;
  const long fd = ::syscall(SYS_openat2, dir, name.c_str(), &how, sizeof how);
  return fd < 0 ? -errno : static_cast<int>(fd);
}

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISLNK(m)) return "a symlink";
  return "not a regular file";
}

// Only regular files are data: a directory is EISDIR, anything else EINVAL.
int not_regular(mode_t m, const std::string& shown, std::string& why) {
  why = fmt::format("{}: {}, not a regular file", shown, kind_of(m));
  return S_ISDIR(m) ? EISDIR : EINVAL;
}

std::deque<std::string> components(std::string_view path) {
  std::deque<std::string> out;
  std::size_t pos = 0;
  while (pos <= path.size()) {
    const std::size_t slash = std::min(path.find('/', pos), path.size());
    if (slash > pos) out.emplace_back(path.substr(pos, slash - pos));
    pos = slash + 1;
  }
  return out;
}

// Opens the regular file `name` in `dir` for real. It was seen as a regular file
// a moment ago, but may have been swapped since: O_NOFOLLOW refuses a symlink,
// O_NONBLOCK keeps a FIFO from blocking, and the type is checked again on the fd.
int open_regular(int dir, const std::string& name, FileIntent intent, const std::string& shown,
                 CallerFile& out, std::string& why) {
  const int access = intent == FileIntent::read         ? O_RDONLY
                     : intent == FileIntent::read_write ? O_RDWR
                                                        : O_WRONLY;
  const int flags = access | O_NOCTTY | O_NONBLOCK;
  const int fd = open_step(dir, name, flags);
  if (fd < 0) {
    why = fd == -ELOOP ? fmt::format("{}: became a symlink while being opened", shown)
                       : fmt::format("{}: {}", shown, std::strerror(-fd));
    return -fd;
  }
  UniqueFd file(fd);
  if (::fstat(fd, &out.st) != 0) {
    const int e = errno;
    why = fmt::format("{}: fstat: {}", shown, std::strerror(e));
    return e;
  }
  if (!S_ISREG(out.st.st_mode)) return not_regular(out.st.st_mode, shown, why);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  out.fd = std::move(file);
  return 0;
}

// EACCES when `fd` is on a kernel filesystem. The message names only the path
// the caller gave, never a component reached through a symlink.
int refuse_kernel_fs(int fd, const std::string& path, std::string& why) {
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0) {
    const int e = errno;
    why = fmt::format("{}: fstatfs: {}", path, std::strerror(e));
    return e;
  }
  const char* kind = kernel_filesystem(fs.f_type);
  if (!kind) return 0;
  why = fmt::format(
      "{}: refused: it leads into {}, a kernel filesystem; salusd never opens files in /proc, "
      "/sys or the like for a session",
      path, kind);
  return EACCES;
}

// The target of the symlink `probe` (named `name` in `dir`, whose stat is `st`),
// if the caller may follow it (may_follow_symlink); 0 or a positive errno with why.
int read_symlink(const CallerCredentials& who, int dir, int probe, const struct stat& st,
                 const std::string& path, const std::string& name, std::string& out,
                 std::string& why) {
  struct stat dst;
  if (::fstat(dir, &dst) != 0) {
    const int e = errno;
    why = fmt::format("{}: fstat: {}", path, std::strerror(e));
    return e;
  }
  if (!may_follow_symlink(who.uid, st.st_uid, dst.st_uid)) {
    why = fmt::format(
        "{}: refusing to follow symlink '{}' owned by uid {} in a directory of uid {} (only "
        "the caller's, root's or the directory owner's symlinks are followed)",
        path, name, st.st_uid, dst.st_uid);
    return EACCES;
  }
  char target[PATH_MAX];
  const ssize_t n = ::readlinkat(probe, "", target, sizeof target);
  if (n <= 0 || static_cast<std::size_t>(n) >= sizeof target) {
    const int e = n < 0 ? errno : ENOENT;
    why = fmt::format("{}: readlink '{}': {}", path, name, std::strerror(e));
    return e;
  }
  out.assign(target, static_cast<std::size_t>(n));
  return 0;
}

int walk(const CallerCredentials& who, int root, const std::string& path, FileIntent intent,
         CallerFile& out, std::string& why) {
  std::vector<UniqueFd> dirs;  // root first; each entry a child of the one before
  {
    const int fd = ::fcntl(root, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      const int e = errno;
      why = fmt::format("{}: {}", path, std::strerror(e));
      return e;
    }
    dirs.emplace_back(fd);
  }
  std::deque<std::string> todo = components(path);
  int links = 0;
  while (!todo.empty()) {
    const std::string name = std::move(todo.front());
    todo.pop_front();
    if (name == ".") continue;
    if (name == "..") {
      if (dirs.size() > 1) dirs.pop_back();  // never above the caller's root
      continue;
    }
    const bool last = todo.empty();
    const int dir = dirs.back().get();
    // O_PATH has no side effects: nothing is opened before its type is known.
    const int probe = open_step(dir, name, O_PATH);
    if (probe < 0) {
      if (probe == -ENOENT && last && intent == FileIntent::write) {
        // Created when the transfer runs; the caller must be able to do it now.
        if (::syscall(SYS_faccessat2, dir, "", W_OK | X_OK, AT_EMPTY_PATH | AT_EACCESS) != 0) {
          const int e = errno;
          why = fmt::format("{}: cannot create it: {}", path, std::strerror(e));
          return e;
        }
        out.dir = std::move(dirs.back());
        out.name = name;
        return 0;
      }
      why = fmt::format("{}: {}{}", path, std::strerror(-probe),
                        last ? std::string() : fmt::format(" (at '{}')", name));
      return -probe;
    }
    UniqueFd entry(probe);
    // What lies on /proc, /sys, debugfs... answers to capabilities and to the
    // opener's identity in ways a root daemon's open cannot pass on faithfully.
    if (const int rc = refuse_kernel_fs(probe, path, why)) return rc;
    struct stat st;
    if (::fstat(probe, &st) != 0) {
      const int e = errno;
      why = fmt::format("{}: fstat '{}': {}", path, name, std::strerror(e));
      return e;
    }
    if (S_ISLNK(st.st_mode)) {
      if (last && intent != FileIntent::read) {
        why = fmt::format("{}: is a symlink; salusd never writes through one", path);
        return ELOOP;
      }
      if (++links > kMaxSymlinks) {
        why = fmt::format("{}: too many levels of symbolic links", path);
        return ELOOP;
      }
      std::string t;
      if (const int rc = read_symlink(who, dir, probe, st, path, name, t, why)) return rc;
      if (t.front() == '/') dirs.resize(1);  // absolute: from the caller's root
      auto more = components(t);
      todo.insert(todo.begin(), more.begin(), more.end());
      continue;
    }
    if (!last) {
      if (!S_ISDIR(st.st_mode)) {
        why = fmt::format("{}: '{}' is not a directory", path, name);
        return ENOTDIR;
      }
      dirs.push_back(std::move(entry));
      continue;
    }
    if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode, path, why);
    return open_regular(dir, name, intent, path, out, why);
  }
  why = fmt::format("{}: a directory, not a regular file", path);
  return EISDIR;
}

}  // namespace

const char* kernel_filesystem(long f_type) {
  switch (static_cast<unsigned long>(f_type) & 0xffffffffUL) {
    case PROC_SUPER_MAGIC:
      return "procfs";
    case SYSFS_MAGIC:
      return "sysfs";
    case DEBUGFS_MAGIC:
      return "debugfs";
    case TRACEFS_MAGIC:
      return "tracefs";
    case SECURITYFS_MAGIC:
      return "securityfs";
    case CGROUP_SUPER_MAGIC:
      return "cgroupfs";
    case CGROUP2_SUPER_MAGIC:
      return "cgroup2fs";
    case BPF_FS_MAGIC:
      return "bpffs";
    case EFIVARFS_MAGIC:
      return "efivarfs";
    case PSTOREFS_MAGIC:
      return "pstore";
    case SELINUX_MAGIC:
      return "selinuxfs";
    case SMACK_MAGIC:
      return "smackfs";
    case BINFMTFS_MAGIC:
      return "binfmt_misc";
    case NSFS_MAGIC:
      return "nsfs";
    case 0x62656570UL:
      return "configfs";  // CONFIGFS_MAGIC, not in linux/magic.h
    case 0x65735543UL:
      return "fusectl";  // FUSECTL_SUPER_MAGIC
    default:
      return nullptr;
  }
}

bool may_follow_symlink(uid_t caller_uid, uid_t link_uid, uid_t dir_uid) {
  return link_uid == caller_uid || link_uid == 0 || link_uid == dir_uid;
}

int open_caller_file(const CallerCredentials& who, const std::string& path, FileIntent intent,
                     CallerFile& out, std::string& why) {
  out = CallerFile{};
  if (path.empty() || path[0] != '/') {
    why = fmt::format("'{}' is not an absolute path", path);
    return EINVAL;
  }
  if (who.refused) {
    why = fmt::format("{}: {}", path, who.refused_why);
    return who.refused;
  }
  const std::string root = who.root_path();
  UniqueFd root_fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root_fd) {
    const int e = errno;
    why = fmt::format("cannot reach the caller's root {}: {}", root, std::strerror(e));
    return e;
  }
  ThreadCredentials creds(who);
  if (!creds.ok()) {
    why = "could not take on the caller's credentials";
    return EPERM;
  }
  if (const int rc = refuse_kernel_fs(root_fd.get(), path, why)) return rc;
  const int rc = walk(who, root_fd.get(), path, intent, out, why);
  if (rc) out = CallerFile{};
  return rc;
}

int create_caller_file(const CallerCredentials& who, CallerFile& f, const std::string& shown,
                       std::string& why) {
  if (f.exists()) return 0;
  if (who.refused) {
    why = fmt::format("{}: {}", shown, who.refused_why);
    return who.refused;
  }
  if (!f.dir) {
    why = fmt::format("{}: nowhere to create it", shown);
    return EINVAL;
  }
  ThreadCredentials creds(who);
  if (!creds.ok()) {
    why = "could not take on the caller's credentials";
    return EPERM;
  }
  // 0600 first, so the file is never more open than meant, then the final mode.
  const int fd = open_step(f.dir.get(), f.name, O_WRONLY | O_CREAT | O_EXCL | O_NOCTTY, 0600);
  if (fd == -EEXIST) {
    // Someone made it meanwhile: use it if it is a regular file.
    const int probe = open_step(f.dir.get(), f.name, O_PATH);
    if (probe < 0) {
      why = fmt::format("{}: {}", shown, std::strerror(-probe));
      return -probe;
    }
    UniqueFd entry(probe);
    struct stat st;
    if (::fstat(probe, &st) != 0) {
      const int e = errno;
      why = fmt::format("{}: fstat: {}", shown, std::strerror(e));
      return e;
    }
    if (S_ISLNK(st.st_mode)) {
      why = fmt::format("{}: became a symlink; salusd never writes through one", shown);
      return ELOOP;
    }
    if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode, shown, why);
    return open_regular(f.dir.get(), f.name, FileIntent::write_existing, shown, f, why);
  }
  if (fd < 0) {
    why = fmt::format("{}: cannot create it: {}", shown, std::strerror(-fd));
    return -fd;
  }
  f.fd.reset(fd);
  ::fchmod(fd, 0666 & ~who.umask);
  ::fstat(fd, &f.st);
  f.dir.reset();
  return 0;
}

int read_file_as_caller(const CallerCredentials& who, const std::string& path, std::size_t limit,
                        std::vector<std::uint8_t>& out, std::string& why) {
  CallerFile f;
  if (const int rc = open_caller_file(who, path, FileIntent::read, f, why)) return rc;
  if (static_cast<std::size_t>(f.st.st_size) > limit) {
    why = fmt::format("{}: {} bytes is more than the {} allowed", path, f.st.st_size, limit);
    return EFBIG;
  }
  out.resize(static_cast<std::size_t>(f.st.st_size));
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(f.fd.get(), out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      why = fmt::format("{}: read failed: {}", path, std::strerror(e));
      return e;
    }
    done += static_cast<std::size_t>(n);
  }
  return 0;
}

}  // namespace salus::vgpu
