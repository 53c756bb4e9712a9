// Opening files on behalf of a session's caller: inside the caller's root (its
// mount namespace, via /proc/PID/root) and with the caller's uid, gid and groups,
// so a root daemon never reads or writes a file the caller could not.
//
// Paths are resolved one component at a time, each step an openat2 that follows
// nothing (RESOLVE_NO_SYMLINKS). salusd follows a symlink itself, and only when
// the caller could trust it: it is owned by the caller, by root, or by the owner
// of the directory it is in (the kernel's protected_symlinks rule, applied in
// every directory, not only sticky world-writable ones). Others fail with EACCES.
// ".." never climbs above the caller's root, and nothing is ever opened before
// it is known to be a regular file, so no FIFO blocks and no device is touched.
// Nothing on a kernel filesystem (/proc, /sys, debugfs, cgroupfs...) is ever
// opened: each step's filesystem is checked (fstatfs) before it is used.
// Everything runs under ThreadCredentials: the caller's ids and groups, and only
// the capabilities the caller has itself.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vgpu/caller/caller_credentials.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

enum class FileIntent : std::uint8_t {
  read,            // open an existing regular file for reading
  write,           // open an existing regular file for writing, or find where to create it
  write_existing,  // open an existing regular file for writing; never create
  read_write,      // open an existing regular file for reading and writing; never create
};

// What open_caller_file found: an open regular file, or, for `write` to a file
// that does not exist yet, the directory to create it in and its name there.
struct CallerFile {
  UniqueFd fd;
  struct stat st {};  // of `fd`, taken right after the open
  UniqueFd dir;       // O_PATH; set only when the file does not exist yet
  std::string name;
  bool exists() const { return static_cast<bool>(fd); }
};

inline constexpr int kMaxSymlinks = 40;  // like the kernel's MAXSYMLINKS

// Resolves `path` (absolute, as the caller sees it) and opens it as the caller.
// Returns 0, or a positive errno with a one-line reason in `why`:
//   ENOENT, ENOTDIR, EACCES (permissions, or an untrusted symlink), ELOOP (too
//   many symlinks, or for writes a symlink as the last component: salusd never
//   writes through one), EISDIR a directory, EINVAL a FIFO, socket or device,
//   EPERM when the caller's credentials could not be taken on or were refused
//   (CallerCredentials::refused: a caller outside salusd's pid namespace),
//   EACCES also for anything on a kernel filesystem (kernel_filesystem).
// For `write` to a missing file, the caller's write and search permission on the
// directory is checked now; create_caller_file creates it later.
int open_caller_file(const CallerCredentials& who, const std::string& path, FileIntent intent,
                     CallerFile& out, std::string& why);

// Creates the file open_caller_file found missing, as the caller, with mode
// 0666 & ~umask (what a shell redirection would give), without following a
// symlink; if it appeared meanwhile, opens it if it is a regular file. `shown` is
// the path for messages. Returns 0 (f.fd is open) or a positive errno with `why`.
int create_caller_file(const CallerCredentials& who, CallerFile& f, const std::string& shown,
                       std::string& why);

// Reads a whole regular file as the caller, up to `limit` bytes (EFBIG beyond).
// Returns 0, or a positive errno with `why` (the errors of open_caller_file).
int read_file_as_caller(const CallerCredentials& who, const std::string& path, std::size_t limit,
                        std::vector<std::uint8_t>& out, std::string& why);

// The name of the kernel filesystem with statfs type `f_type` (procfs, sysfs,
// debugfs, tracefs, securityfs, cgroupfs...), or nullptr for any other.
const char* kernel_filesystem(long f_type);

// The symlink rule above, as a pure function: may a caller with `caller_uid`
// follow a link owned by `link_uid` that sits in a directory owned by `dir_uid`?
bool may_follow_symlink(uid_t caller_uid, uid_t link_uid, uid_t dir_uid);

}  // namespace salus::vgpu
