// Opening files on behalf of a session's caller: inside the caller's root (its
// mount namespace, via /proc/PID/root) and with the caller's uid, gid and groups,
// so a root daemon never reads or writes a file the caller could not.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace salus::vgpu {

struct CallerIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;  // resolves the caller's root; 0 means this process's root
};

// Opens `path` (absolute, as the caller sees it) with `flags` (O_RDONLY, O_WRONLY
// | O_CREAT, ...). Returns an fd, or -errno with a one-line reason in `why`.
// Resolution stays inside the caller's root (RESOLVE_IN_ROOT), never follows
// /proc magic links, and the open is checked against the caller's credentials.
// Only regular files are accepted (directories, FIFOs, devices: EINVAL/EISDIR).
int open_as_caller(const CallerIdentity& who, const std::string& path, int flags, mode_t mode,
                   std::string& why);

// Reads a whole regular file as the caller, up to `limit` bytes (EFBIG beyond).
int read_file_as_caller(const CallerIdentity& who, const std::string& path, std::size_t limit,
                        std::vector<std::uint8_t>& out, std::string& why);

}  // namespace salus::vgpu
