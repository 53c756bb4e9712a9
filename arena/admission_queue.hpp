// Requests waiting for a lane, in arrival order, and the admission pass over them with
// the bounded-bypass rule that keeps a large request from starving behind small ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include "arena/gpu_arena.hpp"

namespace salus::arena {

struct QueuedRequest {
  SessionId session = 0;
  std::uint64_t arrival = 0;  // position: smaller is earlier
  TimeNs waiting_since = 0;
  std::uint32_t bypassed = 0;
  // What admitting it adds to the safety condition: persistent bytes beyond those it
  // already holds, and its ephemeral need. Kept here so that a pass over a long queue
  // can refuse most requests without looking anything up.
  Bytes persistent = 0;
  Bytes ephemeral = 0;
};

class AdmissionQueue {
 public:
  // Queues at position `arrival`, which may be earlier than requests already queued (a
  // re-queued session keeps its original place). False if the session is queued already.
  bool push(SessionId session, std::uint64_t arrival, TimeNs now, Bytes persistent,
            Bytes ephemeral);
  bool remove(SessionId session);
  // The need of a queued request changed; false if it is not queued.
  bool set_need(SessionId session, Bytes persistent, Bytes ephemeral);
  // Lower bounds over the queue, for skipping passes that cannot admit anything:
  // the smallest `persistent`, and the smallest `persistent + ephemeral`.
  Bytes min_persistent() const { return persistent_.empty() ? kNone : *persistent_.begin(); }
  Bytes min_total() const { return total_.empty() ? kNone : *total_.begin(); }
  static constexpr Bytes kNone = std::numeric_limits<Bytes>::max();
  bool contains(SessionId session) const { return position_.count(session) != 0; }
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const QueuedRequest* find(SessionId session) const;

  // Offers queued requests (as const QueuedRequest&) to `try_admit` in arrival order;
  // those it accepts leave the
  // queue. strict_fifo stops at the first refusal. bounded_bypass lets later requests
  // pass refused ones, counting one bypass on each refused request per later admission,
  // and stops as soon as a refused request has been passed max_bypass times. Returns the
  // number admitted.
  template <typename TryAdmit>
  std::size_t admit(QueueMode mode, std::uint32_t max_bypass, TryAdmit&& try_admit) {
    return admit(mode, max_bypass, try_admit, [](const QueuedRequest&) { return false; });
  }
  // As above, but a refused request for which `passable` is true (it cannot be admitted
  // whatever the others do, e.g. it waits on its own work to drain) is passed over in
  // either mode without counting a bypass on it: others admitted meanwhile do not delay
  // it, so they must not use up its starvation bound either.
  template <typename TryAdmit, typename Passable>
  std::size_t admit(QueueMode mode, std::uint32_t max_bypass, TryAdmit&& try_admit,
                    Passable&& passable);

  template <typename F>
  void for_each(F&& f) const {
    for (const auto& [arrival, q] : entries_) f(q);
  }

 private:
  void count(const QueuedRequest& q);
  void uncount(const QueuedRequest& q);

  std::map<std::uint64_t, QueuedRequest> entries_;
  std::unordered_map<SessionId, std::uint64_t> position_;
  std::multiset<Bytes> persistent_, total_;
  std::vector<QueuedRequest*> refused_;  // scratch for admit, kept to avoid allocating
};

template <typename TryAdmit, typename Passable>
std::size_t AdmissionQueue::admit(QueueMode mode, std::uint32_t max_bypass, TryAdmit&& try_admit,
                                  Passable&& passable) {
  const std::uint32_t cap = mode == QueueMode::strict_fifo ? 0 : max_bypass;
  std::size_t admitted = 0;
  refused_.clear();
  for (auto it = entries_.begin(); it != entries_.end();) {
    QueuedRequest& q = it->second;
    if (try_admit(static_cast<const QueuedRequest&>(q))) {
      ++admitted;
      bool capped = false;
      for (QueuedRequest* r : refused_) {
        if (r->bypassed < std::numeric_limits<std::uint32_t>::max()) ++r->bypassed;
        capped = capped || r->bypassed >= cap;
      }
      position_.erase(q.session);
      uncount(q);
      it = entries_.erase(it);
      if (capped) break;
    } else if (passable(static_cast<const QueuedRequest&>(q))) {
      ++it;
    } else {
      if (q.bypassed >= cap) break;  // nothing behind it may pass it again
      refused_.push_back(&q);
      ++it;
    }
  }
  refused_.clear();
  return admitted;
}

}  // namespace salus::arena
