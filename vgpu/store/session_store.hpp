// Named sessions across a restart: on a clean stop salusd writes every named
// session (owner, need, priority, persistent buffers and their bytes) to a state
// directory, and at start it restores them under the same names and owners.
//
// Layout of the state directory (salusd's own, 0700; files 0600):
//   sessions/NAME/session.state   what the session was (format_session_state)
//   sessions/NAME/buf-N           the bytes of its N-th buffer
//   sessions.new/                 a save in progress (or the previous snapshot
//                                 just swapped out); removed at start
//   set-aside/NAME.TIME.N/        a saved session that was corrupt or could not
//                                 be restored, kept for the administrator
// A save writes sessions.new/ with io_uring, fsyncs every file and directory,
// then swaps it with sessions/ in one renameat2(RENAME_EXCHANGE): a crash at any
// point leaves either the old or the new snapshot whole under sessions/.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/broker/command.hpp"

namespace salus::vgpu {

class Broker;

// One saved session, as session.state records it.
struct SavedSession {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  bool need_declared = false;
  Bytes persistent = 0;
  Bytes ephemeral = 0;
  std::optional<std::uint64_t> iters;
  std::optional<int> gpu;
  std::optional<std::string> label;  // need name=, the display name
  std::int32_t priority = 0;
  struct Buffer {
    std::string name;
    Bytes size = 0;
    std::uint64_t hash = 0;  // state_hash of its bytes: a torn or damaged file is caught
  };
  std::vector<Buffer> buffers;
};

// The text of session.state, and its strict parser (nullopt with `why` for
// anything malformed, including a truncated file: the last line is "end").
std::string format_session_state(const SavedSession& s);
std::optional<SavedSession> parse_session_state(std::string_view text, std::string& why);

// The hash of a buffer file, continued chunk by chunk from `h` (start with
// kHashStart; save and restore cut the same 8 MiB chunks). Each chunk is hashed
// FNV-1a style over 8-byte words in four interleaved lanes, so that it runs at
// memory speed (bytewise FNV-1a took 3.8 s per GiB); it detects torn and damaged
// files, not tampering: the state directory is salusd's alone.
inline constexpr std::uint64_t kHashStart = 14695981039346656037ULL;
std::uint64_t state_hash(std::uint64_t h, const void* data, std::size_t n);

struct StoreReport {
  std::size_t sessions = 0;  // saved, or restored
  std::size_t skipped = 0;   // not saved (work did not finish) or set aside
  Bytes bytes = 0;
  int error = 0;  // an errno when nothing could be saved or restored at all
  std::string why;
};

// Saves every named session of `broker` to `dir`. Reading a buffer waits for
// the session's earlier work; a session whose reads do not finish within
// `bound` is left out (logged). The environment variable
// SALUS_TEST_SAVE_PAUSE_MS (tests only) pauses that long before the commit, so
// a test can kill salusd in the middle of a save.
StoreReport save_sessions(Broker& broker, const std::string& dir, std::chrono::milliseconds bound);

// Restores what the last complete save left in `dir`: each session is created
// with its name and owner, its need declared again (and admitted), its buffers
// allocated and filled. A corrupt or unrestorable session is moved to
// set-aside/ with a log line; salusd goes on. `bound` limits each admission.
StoreReport restore_sessions(Broker& broker, const std::string& dir,
                             std::chrono::milliseconds bound);

}  // namespace salus::vgpu
