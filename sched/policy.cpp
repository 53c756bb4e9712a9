#include "sched/policy.hpp"

#include <array>

namespace salus::sched {

namespace {
constexpr std::array<std::pair<PolicyKind, std::string_view>, 5> kNames{{
    {PolicyKind::fifo, "fifo"},
    {PolicyKind::pack, "pack"},
    {PolicyKind::srtf, "srtf"},
    {PolicyKind::fair, "fair"},
    {PolicyKind::priority, "priority"},
}};
constexpr double kUnmeasuredIterNs = 1e6;
}  // namespace

std::string_view to_string(PolicyKind kind) {
  for (const auto& [k, name] : kNames)
    if (k == kind) return name;
  return "unknown";
}

std::optional<PolicyKind> policy_from_string(std::string_view name) {
  for (const auto& [k, n] : kNames) {
    if (n.size() != name.size()) continue;
    bool same = true;
    for (std::size_t i = 0; i < n.size(); ++i) {
      char c = name[i];
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      if (c != n[i]) same = false;
    }
    if (same) return k;
  }
  return std::nullopt;
}

double remaining_ns(const RankInputs& in) {
  if (!in.iters || overran(in)) return kUnknownRemaining;
  const std::uint64_t left = *in.iters - in.done;
  const double mean = in.mean_iter_ns > 0.0 ? in.mean_iter_ns : kUnmeasuredIterNs;
  return static_cast<double>(left) * mean;
}

bool overran(const RankInputs& in) {
  return in.iters && in.done > *in.iters;
}

RankKey rank(PolicyKind kind, const RankInputs& in) {
  switch (kind) {
    case PolicyKind::fifo:
    case PolicyKind::pack:
      return {0.0, in.arrival};
    case PolicyKind::srtf:
      return {remaining_ns(in), in.arrival};
    case PolicyKind::fair:
      return {static_cast<double>(in.vtime), in.arrival};
    case PolicyKind::priority:
      return {-static_cast<double>(in.priority), in.arrival};
  }
  return {0.0, in.arrival};
}

double admission_key(PolicyKind kind, const RankInputs& in) {
  switch (kind) {
    case PolicyKind::fifo:
    case PolicyKind::pack:
      return 0.0;
    case PolicyKind::srtf:
    case PolicyKind::fair:
    case PolicyKind::priority:
      return rank(kind, in).primary;
  }
  return 0.0;
}

}  // namespace salus::sched
