#include "sched/placement.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

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

namespace {

bool fits(const GpuView& g, std::uint64_t need, Placement policy) {
  if (!g.eligible || g.draining || need > g.capacity) return false;
  return policy != Placement::exclusive || g.placed == 0;
}

// Whether `a` ranks before `b` (b being the best so far, of a lower index).
bool better(const GpuView& a, const GpuView& b, Placement policy) {
  if (policy == Placement::lug) {
    if (a.load < b.load - 1e-12) return true;
    if (a.load > b.load + 1e-12) return false;
  }
  return a.available > b.available;
}

// The best eligible GPU by magm or lug, leaving out risky ones when `filter`.
std::optional<std::uint32_t> best_of(std::span<const GpuView> gpus, std::uint64_t need,
                                     const PlacementOptions& o, bool filter, std::uint32_t& risky) {
  std::optional<std::uint32_t> best;
  for (std::uint32_t i = 0; i < gpus.size(); ++i) {
    const GpuView& g = gpus[i];
    if (!fits(g, need, o.policy)) continue;
    if (filter && o.risk.risky(g)) {
      ++risky;
      continue;
    }
    if (!best || better(g, gpus[*best], o.policy)) best = i;
  }
  return best;
}

}  // namespace

PlacementChoice choose_gpu(std::span<const GpuView> gpus, std::uint64_t need,
                           const PlacementOptions& options, std::size_t rr_cursor) {
  PlacementChoice c;
  c.next_rr = rr_cursor;
  const std::size_t n = gpus.size();
  if (n == 0) return c;
  switch (options.policy) {
    case Placement::rr:
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t i = (rr_cursor % n + k) % n;
        if (fits(gpus[i], need, options.policy)) {
          c.gpu = static_cast<std::uint32_t>(i);
          c.next_rr = i + 1;
          break;
        }
      }
      return c;
    case Placement::exclusive:
      for (std::uint32_t i = 0; i < n && !c.gpu; ++i)
        if (fits(gpus[i], need, options.policy)) c.gpu = i;
      return c;
    case Placement::magm:
    case Placement::lug:
      break;
  }
  c.gpu = best_of(gpus, need, options, options.risk.enabled, c.risky);
  if (!c.gpu && c.risky > 0 && options.risk.place_when_all_risky) {
    std::uint32_t ignored = 0;
    c.gpu = best_of(gpus, need, options, false, ignored);
    c.risk_ignored = c.gpu.has_value();
  }
  return c;
}

std::optional<double> risk_score(std::span<const double> samples) {
  const std::size_t n = samples.size();
  if (n == 0) return std::nullopt;
  double sum = 0.0, ema = samples[0];
  const double alpha = 2.0 / (static_cast<double>(n) + 1.0);
  for (std::size_t i = 0; i < n; ++i) {
    sum += samples[i];
    if (i > 0) ema = alpha * samples[i] + (1 - alpha) * ema;
  }
  std::vector<double> s(samples.begin(), samples.end());
  std::sort(s.begin(), s.end());
  // pandas' default quantile: linear between the two nearest order statistics.
  auto quantile = [&](double q) {
    const double pos = q * static_cast<double>(n - 1);
    const std::size_t lo = static_cast<std::size_t>(std::floor(pos));
    const std::size_t hi = std::min(lo + 1, n - 1);
    return s[lo] + (s[hi] - s[lo]) * (pos - static_cast<double>(lo));
  };
  return 0.2 * (sum / static_cast<double>(n)) + 0.3 * quantile(0.5) + 0.3 * quantile(0.95) +
         0.2 * ema;
}

}  // namespace salus::sched
