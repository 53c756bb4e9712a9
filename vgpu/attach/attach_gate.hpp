// The gate of an attached session as salusd holds it: the program's sealed
// memfd (mapped shared), its doorbell eventfd and a pidfd of the program, all
// taken out of the writing process with pidfd_getfd and checked before use.
// The layout is client/salus_gate.h, the contract with libsalus-shim.so.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/salus_gate.h"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu {

// A MAP_SHARED mapping of one struct salus_gate; unmapped on destruction.
class GateMapping {
 public:
  GateMapping() = default;
  GateMapping(salus_gate* g, std::size_t len) : g_(g), len_(len) {}
  GateMapping(GateMapping&& o) noexcept;
  GateMapping& operator=(GateMapping&& o) noexcept;
  GateMapping(const GateMapping&) = delete;
  GateMapping& operator=(const GateMapping&) = delete;
  ~GateMapping() { reset(); }
  salus_gate* get() const { return g_; }
  void reset();

 private:
  salus_gate* g_ = nullptr;
  std::size_t len_ = 0;
};

// Atomic access to the shared fields (the program writes its side concurrently).
template <class T>
T gate_load(T& field) {
  return std::atomic_ref<T>(field).load(std::memory_order_acquire);
}
template <class T>
void gate_store(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_release);
}

struct AttachedGate {
  pid_t pid = 0;  // the program's thread-group id, in salusd's pid namespace
  // Its parent, the parent's parent, ... (at most kMostAncestors), read at the
  // attach when its gate said `uses_gpu` = 1: who it may take the session over from.
  std::vector<pid_t> ancestors;
  UniqueFd pidfd;
  UniqueFd memfd;
  UniqueFd bell;
  GateMapping map;

  salus_gate& g() const { return *map.get(); }
  // salusd's side: bump grant_word and wake every waiter (FUTEX_WAKE on the
  // shared mapping, not FUTEX_PRIVATE: the waiter is another process).
  void wake() const;

  // salusd's bookkeeping of the gate (under the broker lock).
  std::uint64_t granted = 0;         // what salusd wrote to `granted`
  std::uint64_t completed_seen = 0;  // completions already accounted
  std::uint64_t gpu_ns_seen = 0;     // gpu_ns_total already accounted
  // When it attached, and gpu_ns_total then: what it reports from there is held
  // to twice the wall time since (Broker::serve_gate).
  std::int64_t attached_at = 0;
  std::uint64_t gpu_ns_at_attach = 0;
  std::uint32_t note_seq_seen = 0;
  std::int64_t granted_at = 0;  // broker time of the last grant (the fallback slice)
  // Broker time up to which the session's hold of its lane has been charged: the
  // last completion seen (Broker::lane_held_since_charged).
  std::int64_t hold_charged_to = 0;
  // Grants the hold limit took off the lane (Broker::release_long_hold) that
  // have not completed yet, the hold it measured for them, and how often.
  std::uint32_t released_in_flight = 0;
  std::uint64_t released_hold_ns = 0;
  std::uint64_t hold_releases = 0;
  std::uint64_t yields = 0;  // yield requests made
  bool exited = false;       // the pidfd reported the program's exit
  // The driver's figure for the program passed its charge by more than the
  // context reserve (said once, in the session log and salusd's), checked once a
  // second: the charge at the last check, and how many checks in a row found it
  // past (a free since NVML's sample makes one check look past: two must).
  bool context_warned = false;
  std::uint64_t charged_at_check = 0;
  std::uint32_t context_over = 0;
  // The most the driver's figure passed the charge while the program's memory
  // was on the card: its context as measured (at least the reserve is allowed).
  std::uint64_t context_seen = 0;
  // The driver's figure less the charge at the last check (0: not past it), so
  // that only a context seen at two checks in a row is learned.
  std::uint64_t context_last = 0;
  // Swapped out, the driver's figure is held against what the program said stays
  // on the card (Broker::check_swapped_program): checks in a row that found it
  // swapped, of those in a row past it, and the figure learned from the driver,
  // which later swap-outs count as unswappable too.
  std::uint32_t swapped_checks = 0;
  std::uint32_t leftover_over = 0;
  std::uint64_t leftover_floor = 0;
  bool leftover_warned = false;
  bool overrun_killed = false;  // SIGKILL sent (--attach-overrun kill); its exit ends it

  // Swap (issue 15): salusd's last request and what it saw of the answer.
  std::uint32_t swap_seq = 0;                        // the last swap_seq written
  std::uint32_t swap_request = SALUS_SWAP_REQ_NONE;  // what it asked
  bool swap_pending = false;                         // asked, not answered yet
  std::int64_t swap_asked_at = 0;                    // broker time of the request
  int swap_error = 0;  // errno of the last failed swap, 0 if it succeeded (or none yet)

  // Shared lane (lane=FD): salusd's end of the program's socket pair; empty
  // when the session did not opt in. See vgpu/attach/shared_lane.hpp.
  UniqueFd lane_sock;
  std::uint32_t lane_sent = 0;  // the lane memory generation whose fd was sent
  bool lane_off = false;        // the lane failed for this session: granted without it
  bool lane_room = false;       // takes the lane as room, not memory (attach lane_room=1)
  // The pending request came from the residency planner (Broker::swap_out/swap_in),
  // not from /salus/ctl: its answer completes the residency bookkeeping.
  bool swap_for_residency = false;
  // The program answered ENOTSUP (no SALUS_SWAP=1): never asked again.
  bool unswappable = false;
};

// What a gate's swap fields say, as salus(5) names it: resident, swapped,
// swapping-out, swapping-in.
const char* swap_state_name(std::uint32_t state);

// Takes `gate_fd` and `bell_fd` (and `lane_fd` unless -1) out of the thread
// group of thread `tid` and checks them: the gate a regular (memfd) file of
// exactly sizeof(salus_gate), sealed against shrinking and growing, with a
// valid header; the bell an eventfd; the lane a SOCK_SEQPACKET Unix socket.
// Maps the gate. Returns 0, or an errno with `why` saying what failed.
// Does no I/O the program can stall: procfs and pidfd calls only.
int take_gate(pid_t tid, int gate_fd, int bell_fd, int lane_fd, AttachedGate& out,
              std::string& why);

// The thread-group id of thread `tid` (from /proc/TID/status), or -errno.
pid_t thread_group_of(pid_t tid);

// How far up the process tree a hand-over looks: launchers start their
// workers within a few levels (torchrun: its child; a shell in between: two).
inline constexpr std::size_t kMostAncestors = 32;

// The parent of process `pid`, its parent, ... up to (not including) pid 1, at
// most kMostAncestors, from /proc/PID/status; empty when `pid` is gone.
std::vector<pid_t> ancestors_of(pid_t pid);

// pidfd_open(2): a descriptor for process `pid`, or -1 with errno.
int pidfd_open(pid_t pid);

}  // namespace salus::vgpu
