#include "arena/admission_queue.hpp"

namespace salus::arena {

void AdmissionQueue::count(const QueuedRequest& q) {
  persistent_.insert(q.persistent);
  total_.insert(q.persistent + q.ephemeral);
}

void AdmissionQueue::uncount(const QueuedRequest& q) {
  persistent_.erase(persistent_.find(q.persistent));
  total_.erase(total_.find(q.persistent + q.ephemeral));
}

bool AdmissionQueue::push(SessionId session, std::uint64_t arrival, TimeNs now, Bytes persistent,
                          Bytes ephemeral) {
  if (contains(session) || entries_.count(arrival)) return false;
  const QueuedRequest& q =
      entries_.emplace(arrival, QueuedRequest{session, arrival, now, 0, persistent, ephemeral})
          .first->second;
  position_.emplace(session, arrival);
  count(q);
  return true;
}

bool AdmissionQueue::remove(SessionId session) {
  auto it = position_.find(session);
  if (it == position_.end()) return false;
  auto e = entries_.find(it->second);
  uncount(e->second);
  entries_.erase(e);
  position_.erase(it);
  return true;
}

bool AdmissionQueue::set_need(SessionId session, Bytes persistent, Bytes ephemeral) {
  auto it = position_.find(session);
  if (it == position_.end()) return false;
  QueuedRequest& q = entries_.at(it->second);
  uncount(q);
  q.persistent = persistent;
  q.ephemeral = ephemeral;
  count(q);
  return true;
}

const QueuedRequest* AdmissionQueue::find(SessionId session) const {
  auto it = position_.find(session);
  return it == position_.end() ? nullptr : &entries_.at(it->second);
}

}  // namespace salus::arena
