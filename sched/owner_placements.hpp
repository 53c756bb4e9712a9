// The order of a host-wide queue (sessions waiting for any GPU) under FAIR by owner
// (FairShare::owner): while sessions of two owners or more are placed or waiting, the
// owner with the fewest sessions placed on a GPU goes first, as each GPU's own queue
// admits the owner with the fewest admitted (GpuScheduler::queue_key). salusd's broker
// and salus-sim both count into it, so that the rule is written once.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>

#include "sched/policy.hpp"

namespace salus::sched {

class OwnerPlacements {
 public:
  // One of the owner's sessions was placed on a GPU (+1) or left it (-1).
  void placed(std::uint32_t owner, int delta) { add(owner, delta, 0); }
  // One of the owner's sessions began (+1) or stopped (-1) waiting host-wide.
  void waiting(std::uint32_t owner, int delta) { add(owner, 0, delta); }
  // The owner's key in the host-wide queue (lower goes first): its sessions placed.
  // nullopt while fewer than two owners have sessions placed or waiting: then the
  // policy's own admission key applies.
  std::optional<double> key(std::uint32_t owner) const;
  std::size_t owners() const { return counts_.size(); }

 private:
  struct Count {
    std::uint32_t placed = 0;
    std::uint32_t waiting = 0;
  };
  void add(std::uint32_t owner, int placed, int waiting);
  std::unordered_map<std::uint32_t, Count> counts_;
};

// A session's key in a host-wide queue, lower first: arrival order under exclusive
// placement (`in.arrival`); under FAIR by owner (`owners` set) with two owners or
// more counted, the owners' order; else the policy's admission key.
double host_queue_key(PolicyKind policy, bool exclusive, const OwnerPlacements* owners,
                      std::uint32_t owner, const RankInputs& in);

}  // namespace salus::sched
