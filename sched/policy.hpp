// Scheduling policies: which runnable session of a lane runs its next iteration.
// Every policy is a ranking key; a lane runs its lowest-keyed runnable session, so
// a decision is one ordered-set lookup and a re-rank is O(log n).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace salus::sched {

using TimeNs = std::int64_t;

enum class PolicyKind : std::uint8_t { fifo, pack, srtf, fair, priority };

std::string_view to_string(PolicyKind kind);
std::optional<PolicyKind> policy_from_string(std::string_view name);

// What a policy may look at to rank a session.
struct RankInputs {
  std::uint64_t arrival = 0;           // admission-request order, unique
  std::int32_t priority = 0;           // larger runs first
  std::optional<std::uint64_t> iters;  // declared total iterations
  std::uint64_t done = 0;              // iterations finished
  // Integers, so that n iterations accounted at once (salus-sim's coalesced runs) leave
  // exactly the state n accounted one by one leave: sums of doubles depend on the order.
  std::int64_t measured_ns = 0;  // device time of the finished iterations, summed
  double mean_iter_ns = 0.0;     // measured_ns / done, kept in step with them
  std::int64_t vtime = 0;        // FAIR virtual time (ns of GPU time / weight)
};

struct RankKey {
  double primary = 0.0;
  std::uint64_t tiebreak = 0;  // arrival: FIFO among equals
  friend bool operator<(const RankKey& a, const RankKey& b) {
    if (a.primary != b.primary) return a.primary < b.primary;
    return a.tiebreak < b.tiebreak;
  }
  friend bool operator==(const RankKey&, const RankKey&) = default;
};

// Sessions without a declared iteration count rank after every session with one
// under SRTF; among themselves they run in arrival order.
inline constexpr double kUnknownRemaining = 1e300;

RankKey rank(PolicyKind kind, const RankInputs& in);

// Where a session waiting for admission stands in its GPU's queue (the arena admits
// smaller keys first, arrival order among equals), so that admission follows the policy:
// FIFO and PACK by arrival (0 for all), SRTF by least remaining work, PRIORITY by rank
// (highest first), FAIR by the service received so far (virtual time: 0 for a new job,
// so new jobs keep arrival order, and a re-queued one waits behind them by what it got).
// The arena's bypass bound keeps a request from starving behind later, smaller keys.
// One function for salusd and salus-sim alike.
double admission_key(PolicyKind kind, const RankInputs& in);

// SRTF's estimate: (declared iterations - done) x measured mean iteration time.
// Before the first measurement the mean is unknown; we rank by remaining count
// with a 1 ms guess so short declared jobs still go first. A session that has run
// more iterations than it declared has no estimate left: it ranks as one without
// iters=. Otherwise under-declaring (iters=1) would put a job at 0 remaining, first
// in its lane for as long as it ran.
double remaining_ns(const RankInputs& in);

// Whether the session has finished more iterations than its declared iters=.
bool overran(const RankInputs& in);

}  // namespace salus::sched
