#include "sched/placement.hpp"

namespace salus::sched {

std::string_view to_string(Placement p) {
  switch (p) {
    case Placement::magm:
      return "magm";
    case Placement::lug:
      return "lug";
    case Placement::rr:
      return "rr";
    case Placement::exclusive:
      return "exclusive";
  }
  return "unknown";
}

std::optional<Placement> placement_from_string(std::string_view name) {
  for (Placement p : {Placement::magm, Placement::lug, Placement::rr, Placement::exclusive})
    if (to_string(p) == name) return p;
  return std::nullopt;
}

}  // namespace salus::sched
