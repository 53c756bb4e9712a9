// The broker's side of saving and restoring named sessions across a restart:
// a snapshot of what session_store.cpp writes down. Kept apart from broker.cpp
// so that the store reads the broker only through this and the public API.
#include "vgpu/broker/broker.hpp"

namespace salus::vgpu {

std::vector<Broker::NamedSessionState> Broker::named_sessions() const {
  std::lock_guard lk(mu_);
  std::vector<NamedSessionState> out;
  for (const auto& [id, sp] : sessions_) {
    const Session& s = *sp;
    if (!s.named || s.dead) continue;
    NamedSessionState n;
    n.id = id;
    n.name = s.dir_name;
    n.uid = s.uid;
    n.gid = s.gid;
    n.need_declared =
        s.gpu >= 0 || s.state == SessionState::queued || s.state == SessionState::admitted;
    n.need = s.need;
    if (s.gpu >= 0) n.need.gpu = s.gpu;
    n.priority = s.priority;
    for (const auto& [name, bid] : s.names) {
      const auto it = s.buffers.find(bid);
      if (it != s.buffers.end()) n.buffers.push_back({bid, name, it->second.size});
    }
    out.push_back(std::move(n));
  }
  return out;
}

void Broker::note(SessionId id, std::string text) {
  std::lock_guard lk(mu_);
  if (Session* s = get(id)) log(*s, std::move(text));
}

}  // namespace salus::vgpu
