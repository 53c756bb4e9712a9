// The outside end of an upload or download: a POSIX shared-memory segment
// (shm:SEG, the file /dev/shm/SEG in the caller's mount namespace) or a file
// (file:PATH). Opened as the caller when the command's write arrives, with every
// check that can be made then, so that a bad endpoint fails the write itself.
#pragma once

#include <string>

#include "vgpu/broker/command.hpp"
#include "vgpu/caller/caller_files.hpp"

namespace salus::vgpu {

inline constexpr const char* kShmDir = "/dev/shm";

struct TransferEndpoint {
  CallerFile file;    // open; for a download to a missing file, where to create it
  std::string shown;  // "shm:SEG" or "file:PATH", for messages
  int error = 0;      // 0, or the errno the command fails with
  std::string why;    // the reason, for the session log
};

// Checks, in order (errno in brackets):
//   shm: SEG is one path component of [A-Za-z0-9_.-], not starting with '.'
//        [EINVAL]; the segment exists [ENOENT]; it is a regular file [EINVAL];
//        it is owned by the caller's uid, whatever its mode [EACCES]; it holds
//        OFF+LEN bytes, both directions: a segment is never grown [ERANGE].
//   file: see open_caller_file (ENOENT, EACCES, ELOOP, EISDIR, EINVAL, ...);
//        an upload's file holds OFF+LEN bytes [ERANGE]; OFF+LEN fits in off_t
//        [ERANGE].
TransferEndpoint open_transfer_endpoint(const CallerCredentials& who, const TransferCmd& cmd);

}  // namespace salus::vgpu
