// One GPU's memory as Salus lays it out: a persistent heap growing down from the
// top, lanes of ephemeral memory growing up from the bottom, Algorithm-1 lane
// assignment, the admission queue, and defragmentation at iteration boundaries.
//
// Pure and deterministic: no threads, no clocks (times are passed in), no I/O.
// salusd's worker threads and salus-sim both drive it through the calls below.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "arena/size_units.hpp"

namespace salus::arena {

using SessionId = std::uint64_t;
using LaneId = std::uint32_t;
using BufferHandle = std::uint64_t;  // arena-wide, never reused
using TimeNs = std::int64_t;         // injected clock

// What a session declares with `need`: P and E in the safety condition.
struct Need {
  Bytes persistent = 0;
  Bytes ephemeral = 0;
  // Non-zero: admission joins the lane of an admitted session of the same group
  // (when it is large enough) instead of opening a lane. salusd puts every
  // attached session of a GPU in one group: processes time-slice on a GPU, so
  // only a shared lane lets the policy, not the driver, decide who runs.
  std::uint32_t group = 0;
  // Of `persistent`, bytes that stay on the GPU while the session is swapped out
  // (oversubscription): an attached program's CUDA context, which no swap moves.
  // They count in the resident set whatever the session's residency.
  Bytes unswappable = 0;
};

enum class QueueMode : std::uint8_t {
  // A later request may be admitted ahead of a blocked earlier one, but each
  // blocked request can be overtaken at most `max_bypass` times; after that the
  // queue is strict behind it until it is admitted.
  bounded_bypass,
  strict_fifo,
};

enum class LaneMode : std::uint8_t {
  salus,             // Salus Algorithm 1: new lane, best existing lane, grow smallest lane
  lane_per_session,  // every session gets its own lane, or waits (no lane sharing)
};

struct ArenaOptions {
  QueueMode queue_mode = QueueMode::bounded_bypass;
  // How many later arrivals may be admitted ahead of a waiting request before the queue
  // turns strict behind it (whatever order the policy's keys give).
  std::uint32_t max_bypass = 16;
  LaneMode lane_mode = LaneMode::salus;
  // Oversubscription: admission lets the declared needs add up to this many times the
  // capacity; only the sessions that are resident must fit the card (see "Residency").
  // 1 is plain Salus: every admitted session is resident.
  double oversubscribe = 1.0;
};

enum class ArenaError : std::uint8_t {
  ok,
  too_large,        // P + E can never fit this GPU, even empty
  unknown_session,  // no such session (never requested, or already left)
  not_admitted,     // the session has no lane yet
  duplicate,        // request() for a session already known
  no_memory,        // the safety condition would break
  fragmented,       // accounting fits but no hole is big enough yet; compaction is planned
  swapped_out,      // the session's memory is not on the GPU now (oversubscription)
};

const char* to_string(ArenaError);

// What may still be admitted: a request needs persistent <= room and
// persistent + ephemeral <= total (the largest lane it could join or grow included),
// and a queue key below key_below (a caller's own limit; the arena sets none);
// anything beyond a bound is refused without a closer look.
struct AdmissionBounds {
  Bytes room = ~Bytes{0};
  Bytes total = ~Bytes{0};
  double key_below = std::numeric_limits<double>::infinity();
};

struct Admitted {
  SessionId session;
  LaneId lane;
};

// A persistent buffer the caller must copy from `from` to `to` (device to device).
// The two ranges never overlap.
struct PersistentMove {
  BufferHandle buffer;
  SessionId owner;
  Bytes from;
  Bytes to;
  Bytes size;
};

struct AllocResult {
  ArenaError error = ArenaError::ok;
  BufferHandle handle = 0;
  Bytes offset = 0;
};

// A persistent buffer that a swap moves between the GPU and the host. Its handle
// stays the same across the swap; its offset may change.
struct SwapBuffer {
  BufferHandle buffer;
  Bytes offset;
  Bytes size;
};

// Where a session's persistent memory is (oversubscription).
enum class Residency : std::uint8_t {
  resident,      // on the GPU (every session at oversubscribe 1)
  swapping_out,  // on the GPU, being copied out: its ranges stay held until finish_swap_out
  swapped,       // not on the GPU: its buffers hold no range
};

struct MemorySummary {
  Bytes capacity = 0;
  Bytes admit_capacity = 0;       // capacity x oversubscribe: what admission may hand out
  Bytes resident_reserved = 0;    // persistent_reserved of the sessions on the GPU
  Bytes swapped = 0;              // bytes of buffers that are off the GPU (swapped out)
  Bytes persistent_used = 0;      // bytes held by live persistent buffers
  Bytes persistent_reserved = 0;  // sum over admitted sessions of max(declared P, used)
  Bytes lane_total = 0;           // sum of lane sizes (the ephemeral region)
  Bytes free = 0;                 // admit_capacity - persistent_reserved - lane_total
  Bytes largest_hole = 0;         // largest physically free contiguous range
  double fragmentation = 0.0;     // 1 - largest_hole / physically free bytes (0 when none free)
  std::uint32_t lanes = 0;
  std::uint32_t queued = 0;
};

struct LaneView {
  LaneId id;
  std::optional<Bytes> offset;  // nullopt while waiting for room to be placed
  Bytes size;
  Bytes used;                        // ephemeral bytes of the iteration in flight (0 if idle)
  bool busy;                         // an iteration is in flight
  bool move_pending;                 // will move at its next iteration boundary
  std::optional<SessionId> running;  // session whose iteration is in flight
  std::vector<SessionId> sessions;   // members, in admission order
};

struct QueueEntry {
  SessionId session;
  Need need;
  TimeNs waiting_since;
  std::uint32_t bypassed;  // how many later requests were admitted ahead of it
  double key = 0.0;        // the policy's admission key: the queue is in this order
};

struct Placement {
  bool admitted = false;
  std::optional<LaneId> lane;
  std::optional<Bytes> lane_offset;  // nullopt while the lane waits for room
  Bytes lane_size = 0;
  Need declared;
  Bytes persistent_used = 0;
};

// One physically held range of GPU memory (an addition for status views and tests).
struct PhysicalRegion {
  enum class Kind : std::uint8_t {
    lane,        // what a lane holds at its current offset
    persistent,  // a live persistent buffer
    reserved,    // a move destination held for a persistent buffer until finish_moves
  };
  Kind kind;
  Bytes offset;
  Bytes size;
  std::uint64_t id;  // lane id, or the buffer handle
};

struct ArenaStats {
  std::uint64_t admissions = 0;
  std::uint64_t lanes_opened = 0;
  std::uint64_t lanes_closed = 0;
  std::uint64_t lanes_grown = 0;
  std::uint64_t lane_moves = 0;
  std::uint64_t persistent_moves = 0;
  Bytes persistent_bytes_moved = 0;
};

class GpuArena {
 public:
  explicit GpuArena(Bytes capacity, ArenaOptions options = {});
  ~GpuArena();
  GpuArena(GpuArena&&) noexcept;
  GpuArena& operator=(GpuArena&&) noexcept;

  Bytes capacity() const;
  const ArenaOptions& options() const;
  void set_queue_mode(QueueMode mode);  // admin: strict FIFO or bounded bypass
  // Admin: a new oversubscription ratio (>= 1). Refused (false) when what is admitted
  // already passes the new bound, or, going back to 1, while a session is not resident.
  bool set_oversubscribe(double ratio);

  // ---- Admission ----
  // Queues the session's need (arrival order is the order of these calls) and
  // runs assignment. too_large if P + E > capacity; duplicate if already known.
  // `key` orders the queue (smaller first, arrival order among equals): the
  // scheduling policy's admission key (sched::admission_key); 0 keeps arrival order.
  ArenaError request(SessionId session, Need need, TimeNs now, double key = 0.0);
  // New need for a queued or admitted session. An admitted session keeps its
  // persistent buffers, leaves its lane, and is re-queued at its original
  // arrival position (re-admission). Runs assignment. If its lane is busy, the session
  // waits on its own drain until that lane's boundary: the lane keeps its size until
  // then (LaneTable::remove_member), so others are placed above it, and the queue passes over the
  // session without charging it bypasses while it is refused (others do not delay it then); it may
  // still be admitted to another lane at once if there is room. session_idle plans no
  // moves of its buffers until the drain.
  ArenaError change_need(SessionId session, Need need, TimeNs now, double key = 0.0);
  // The queue key of a waiting session changed (its priority, or the policy): it moves
  // in the queue, keeping its bypass count, and assignment runs. False if not queued.
  bool set_admission_key(SessionId session, double key, TimeNs now);
  // Whether a request() for `need` by a new session would be admitted at once: nothing
  // is queued here and Algorithm 1 has a lane for it now. Changes nothing. For late
  // binding: a host-wide queue places a job on a GPU only when one admits it.
  bool would_admit(const Need& need) const;
  // Necessary conditions for any admission now (see AdmissionBounds).
  AdmissionBounds admission_bounds() const;
  // The session is gone: its persistent buffers are freed, its lane reference is
  // dropped (an empty lane is deleted), its queue slot is removed. Runs assignment.
  void leave(SessionId session, TimeNs now);
  // Admissions made since the last call, in the order they happened.
  std::vector<Admitted> take_admissions();
  // Whether take_admissions has something: any change may admit (a free, a move).
  bool has_admissions() const;

  // ---- Lanes and iterations ----
  // True when the lane has a physical place and no move is pending, so an
  // iteration may start in it now.
  bool lane_ready(LaneId lane) const;
  Bytes lane_offset(LaneId lane) const;  // precondition: lane_ready
  Bytes lane_size(LaneId lane) const;
  // Marks the lane busy with `session`'s iteration using `ephemeral_used` bytes
  // (<= lane size). The lane does not move until end_iteration.
  void begin_iteration(LaneId lane, SessionId session, Bytes ephemeral_used);
  // The iteration boundary: the lane goes idle; pending lane moves that are now
  // possible happen, and assignment runs again if anything moved.
  void end_iteration(LaneId lane, TimeNs now);
  // The lane, still busy, now runs `session`'s iteration, queued behind the one
  // begin_iteration named: the earlier session is idle from here on (compaction
  // and swap-out may take it) while the lane stays where it is.
  void lane_running(LaneId lane, SessionId session);

  // ---- Persistent memory ----
  // Allocates `size` (rounded up to kAlignment) for an admitted session.
  // Usage beyond the declared P is allowed while the safety condition holds;
  // past that: no_memory. If the accounting fits but no hole is large enough,
  // `fragmented` is returned and compaction is planned (see session_idle).
  AllocResult alloc_persistent(SessionId session, Bytes size);
  void free_persistent(BufferHandle buffer);
  Bytes buffer_offset(BufferHandle buffer) const;
  Bytes buffer_size(BufferHandle buffer) const;  // as allocated (aligned); 0 if unknown
  // Whether the buffer holds a GPU range now (false while its session is swapped out).
  bool buffer_on_gpu(BufferHandle buffer) const;

  // ---- Persistent compaction ----
  // Called when `session` has no work in flight. Returns the moves of this
  // session's buffers that the caller must perform now (copy from -> to), or an
  // empty list. The destination ranges stay reserved and the buffers keep their
  // old offsets until finish_moves.
  std::vector<PersistentMove> session_idle(SessionId session);
  // The copies returned by session_idle are done: buffers take their new offsets,
  // the old ranges are freed, and assignment runs again.
  void finish_moves(SessionId session, TimeNs now);
  // Whether compaction has moves planned (so the caller knows to visit idle sessions).
  bool compaction_pending() const;
  // The sessions whose buffers compaction may still have to move, ascending, into
  // `out` (cleared first). Their moves are planned only at an idle moment, so a
  // caller that keeps one busy (the next iteration queued before the last ends)
  // should stop doing so until it is off this list.
  void compaction_owners(std::vector<SessionId>& out) const;

  // ---- Residency (oversubscription) ----
  // Only sessions that are resident (or swapping out) hold GPU ranges, and only they
  // count in the physical safety condition: resident P + L <= C. Every admitted
  // session counts in the admission bound: P + L <= C x oversubscribe. A session
  // admitted when its P did not fit the card starts swapped (it holds nothing yet).
  Residency residency(SessionId session) const;
  // Bytes the resident set may still grow by: C - resident P - L.
  Bytes resident_room() const;
  // What the session adds to the resident set when it is swapped in, and frees
  // when it is swapped out: its P_i less the part that never leaves the GPU.
  Bytes swap_in_bytes(SessionId session) const;
  // Bytes a lane that waits for physical room needs from the resident set (0: none).
  Bytes lane_room_wanted() const;
  // Starts a swap-out of an admitted, resident session that is not running and has no
  // compaction moves out; otherwise returns false. `out` gets the buffers to copy
  // to the host; they keep their ranges until finish_swap_out.
  bool begin_swap_out(SessionId session, std::vector<SwapBuffer>& out);
  // The copies are safe on the host: the ranges are freed and assignment runs again.
  void finish_swap_out(SessionId session, TimeNs now);
  // The copies failed: the session stays resident with its memory where it was.
  void cancel_swap_out(SessionId session);
  // What of the session stays on the GPU when it is swapped out (Need::unswappable),
  // as learned at a swap-out: an attached program reports what its shim cannot
  // move. Only while the session is on the GPU (resident or swapping out), where
  // the part makes no difference to the resident set; false otherwise. Capped at P.
  bool set_unswappable(SessionId session, Bytes bytes);
  // The driver shows more of a swapped session on the card than its part says (its
  // program keeps memory it did not report): the part grows towards `bytes`, capped
  // at P and at the physical room left, since what is already on the card cannot be
  // refused, only counted so that nothing more is let in. In any residency; never
  // lowers the part. Returns the part now.
  Bytes raise_unswappable(SessionId session, Bytes bytes);
  // The session's share of the resident set now: its P_i while its memory is on
  // the GPU, its unswappable part while swapped (0 for an unknown session).
  Bytes on_card_bytes(SessionId session) const;
  // Places a swapped session's buffers again under their old handles (`out`: where).
  // no_memory: the resident set has no room for its P yet; fragmented: the room is
  // there but not in one piece, compaction is planned. On ok it is resident at once;
  // the caller copies the contents in before it runs.
  ArenaError swap_in(SessionId session, std::vector<SwapBuffer>& out);

  // ---- Observation ----
  MemorySummary memory() const;
  std::vector<LaneView> lanes() const;
  std::vector<QueueEntry> queue() const;
  std::optional<Placement> placement(SessionId session) const;
  const ArenaStats& stats() const;

  // Empty when every invariant holds; otherwise a description of the first
  // violation. O(sessions + queue + lanes + buffers). Checked in debug builds after
  // every operation on a small arena, and on a sample of them on a large one.
  std::string check_invariants() const;
  // Every physically held range, in offset order. A busy lane keeps holding its extent
  // until its boundary (one that grew meanwhile waits to move), so this can differ from
  // lanes().
  std::vector<PhysicalRegion> physical_regions() const;
  // Changes whenever physical_regions() may have: one compare tells a caller that
  // mirrors the held ranges (salusd backing the arena on demand) to look again.
  std::uint64_t layout_version() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace salus::arena
