// The shared lane of attached sessions (issue 15): one physical allocation per
// GPU, made by salusd's device with a POSIX-fd handle, that the attached
// sessions which opted in (attach ... lane=FD) map in turn for their ephemeral
// memory. This module holds the lane's state and the socket message that hands
// its fd to a program; the broker (vgpu/broker/broker_lanes.cpp) decides who
// holds it. The rules it keeps:
//  - one holder at a time; the next session gets it only after the holder's
//    yield report (gate `lane_held` = 0: synchronized and unmapped) or after
//    its process exited;
//  - bytes pass to another uid only cleared (the device zeroes the memory);
//  - a holder that lets go of the gate alive (detached, not exited) may still
//    have it mapped: that memory is abandoned (salusd drops its reference, the
//    program's mapping keeps it alive) and the next holder gets fresh memory.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "arena/size_units.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

using arena::Bytes;

struct SharedLane {
  UniqueFd memory;               // the exported handle (a POSIX fd); empty: none yet
  Bytes bytes = 0;               // its size
  std::uint32_t generation = 0;  // bumped for every new memory
  std::uint64_t holder = 0;      // session that may have it mapped; 0: nobody
  bool release_asked = false;    // the holder's lane_grant was set to 0
  std::uint64_t asker = 0;       // who asked for it: served before other arena lanes' sessions
  std::int64_t asked_at = 0;     // when the asker last tried (its claim lapses unless renewed)
  std::int64_t release_asked_at = 0;
  std::optional<uid_t> dirty_uid;  // whose bytes may be in it; none: cleared
  bool busy = false;               // the device makes or clears it (off the broker lock)

  // Figures for status and benchmarks.
  std::uint64_t handovers = 0;  // grants of the lane to a session other than the last
  std::uint64_t clears = 0;
  std::int64_t clear_ns = 0;         // device time of clears, summed (wall, salusd side)
  std::int64_t release_wait_ns = 0;  // from asking a holder to its yield report, summed
  std::uint64_t abandoned = 0;       // memories dropped because a holder detached alive
};

// A lane memory's size for `ephemeral` bytes: rounded up to the VMM granularity
// (2 MiB, what cuMemCreate takes on every current GPU).
Bytes lane_bytes_for(Bytes ephemeral);

// Sends the lane memory's fd with one struct salus_lane_msg over the program's
// socket (SCM_RIGHTS), without blocking. 0, or an errno with `why`.
int send_lane_memory(int sock, int memory_fd, Bytes bytes, std::uint32_t generation,
                     std::string& why);

// Whether the process behind `pidfd` has exited (a poll of the pidfd, no wait).
bool process_exited(int pidfd);

}  // namespace salus::vgpu
