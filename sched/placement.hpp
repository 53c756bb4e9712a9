// Multi-GPU placement for `need gpu=any` (after CARMA section 2.4, without its
// risk filter): the policies and their names, shared by salusd and salus-sim.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace salus::sched {

enum class Placement : std::uint8_t {
  magm,       // most available GPU memory, counting what already waits there
  lug,        // least utilized GPU (by measured busy time, or summed util in salus-sim)
  rr,         // round robin in arrival order
  exclusive,  // a GPU with no session at all
};

std::string_view to_string(Placement p);
std::optional<Placement> placement_from_string(std::string_view name);

}  // namespace salus::sched
