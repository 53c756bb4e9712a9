// Requests waiting for a lane, in the order the scheduling policy gives them (a key per
// request; arrival order among equal keys), and the admission pass over them with the
// bounded-bypass rule that keeps any request from starving behind later ones.
//
// Indexed so that a pass costs O(admitted + refused candidates) x O(log n), not a walk of
// the whole queue: one tree in key order with the smallest needs and arrivals of each
// subtree (a pass visits only requests that could fit the room left), and one in arrival
// order whose bypass counts are added lazily (an admission bumps every earlier arrival at
// once) with their maximum per subtree (where the starvation bound stops the pass).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "arena/gpu_arena.hpp"

namespace salus::arena {

struct QueuedRequest {
  SessionId session = 0;
  std::uint64_t arrival = 0;  // position: smaller is earlier
  double key = 0.0;           // the policy's order: smaller is admitted first
  TimeNs waiting_since = 0;
  std::uint32_t bypassed = 0;  // later arrivals admitted while it waited (saturates)
  // What admitting it adds to the safety condition: persistent bytes beyond those it
  // already holds, and its ephemeral need. Kept here so that a pass can skip requests
  // that cannot fit without looking anything up.
  Bytes persistent = 0;
  Bytes ephemeral = 0;
  bool passable = false;  // see set_passable
};

class AdmissionQueue {
 public:
  AdmissionQueue();
  ~AdmissionQueue();
  AdmissionQueue(AdmissionQueue&&) noexcept;
  AdmissionQueue& operator=(AdmissionQueue&&) noexcept;

  // Queues at position `arrival`, which may be earlier than requests already queued (a
  // re-queued session keeps its original place), ordered by `key` then arrival. False if
  // the session or the arrival is queued already.
  bool push(SessionId session, std::uint64_t arrival, TimeNs now, Bytes persistent, Bytes ephemeral,
            double key = 0.0);
  bool remove(SessionId session);
  // The need of a queued request changed; false if it is not queued.
  bool set_need(SessionId session, Bytes persistent, Bytes ephemeral);
  // The policy's key of a queued request changed (it keeps its bypass count).
  bool set_key(SessionId session, double key);
  // A passable request cannot be admitted whatever the others do (it waits on its own
  // work to drain): passes still offer it, but others admitted meanwhile do not count as
  // bypassing it, since they do not delay it, and it never stops a pass.
  bool set_passable(SessionId session, bool passable);
  // Lower bounds over the queue, for skipping passes that cannot admit anything:
  // the smallest `persistent`, and the smallest `persistent + ephemeral`.
  Bytes min_persistent() const;
  Bytes min_total() const;
  static constexpr Bytes kNone = std::numeric_limits<Bytes>::max();
  bool contains(SessionId session) const { return info_.count(session) != 0; }
  std::size_t size() const { return info_.size(); }
  bool empty() const { return info_.empty(); }
  std::optional<QueuedRequest> find(SessionId session) const;

  // Offers queued requests to `try_admit` (as const QueuedRequest&) in key order; those it
  // accepts leave the queue. Each admission counts one bypass on every waiting request
  // that arrived earlier (and is not passable). Once one of them has been bypassed
  // `max_bypass` times (0 in strict_fifo), no request that arrived after it is admitted
  // until it is: the queue is strict behind it. `bounds` gives what may still fit before
  // each offer; requests beyond it are refused without being offered, so try_admit must
  // refuse them too. Returns the number admitted.
  template <typename Bounds, typename TryAdmit>
  std::size_t admit(QueueMode mode, std::uint32_t max_bypass, Bounds&& bounds,
                    TryAdmit&& try_admit);
  // As above with no bounds: every request is offered.
  template <typename TryAdmit>
  std::size_t admit(QueueMode mode, std::uint32_t max_bypass, TryAdmit&& try_admit) {
    return admit(
        mode, max_bypass, [] { return AdmissionBounds{}; }, try_admit);
  }

  // Every queued request, in key order.
  template <typename F>
  void for_each(F&& f) const;

  // Empty when the index agrees with the requests it holds; otherwise the first problem.
  // O(n): run by GpuArena's invariant check.
  std::string check() const;

 private:
  struct Info {
    double key;
    std::uint64_t arrival;
    TimeNs waiting_since;
    Bytes persistent, ephemeral;
    bool passable;
  };
  struct Trees;  // the two indexes, in admission_queue.cpp
  // The first request in key order after `after` (or from the head) that fits `b` and
  // arrived no later than `latest`; nullopt if none.
  std::optional<SessionId> next_candidate(
      const std::optional<std::pair<double, std::uint64_t>>& after, AdmissionBounds b,
      std::uint64_t latest) const;
  // The earliest arrival whose request (not passable) has been bypassed `cap` times or
  // more: nothing that arrived later may be admitted before it.
  std::uint64_t barrier(std::uint32_t cap) const;
  std::uint64_t bypassed(std::uint64_t arrival) const;
  // Admits the request: removes it and counts a bypass on earlier arrivals.
  void take(SessionId session);
  QueuedRequest request(SessionId session, const Info& i) const;
  std::vector<SessionId> in_key_order() const;

  std::unordered_map<SessionId, Info> info_;
  std::unique_ptr<Trees> trees_;
};

template <typename Bounds, typename TryAdmit>
std::size_t AdmissionQueue::admit(QueueMode mode, std::uint32_t max_bypass, Bounds&& bounds,
                                  TryAdmit&& try_admit) {
  const std::uint32_t cap = mode == QueueMode::strict_fifo ? 0 : max_bypass;
  std::size_t admitted = 0;
  std::optional<std::pair<double, std::uint64_t>> after;  // the last refused candidate
  for (;;) {
    const std::optional<SessionId> c = next_candidate(after, bounds(), barrier(cap));
    if (!c) break;
    const Info& i = info_.at(*c);
    if (try_admit(static_cast<const QueuedRequest&>(request(*c, i)))) {
      take(*c);
      ++admitted;
    } else {
      after = std::pair{i.key, i.arrival};
    }
  }
  return admitted;
}

template <typename F>
void AdmissionQueue::for_each(F&& f) const {
  for (SessionId s : in_key_order()) f(static_cast<const QueuedRequest&>(request(s, info_.at(s))));
}

}  // namespace salus::arena
