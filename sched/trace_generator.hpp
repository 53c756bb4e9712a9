// Seeded generator of salus-sim traces from the Salus workload mix (Table 3 models and
// batch sizes), with lognormal job durations and Poisson arrivals.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sched/trace.hpp"

namespace salus::sched {

// One workload of the mix, as measured for TensorFlow on a 16 GB P100 where the paper
// states a number, and estimated otherwise (docs/simulation.md lists every value and
// where it comes from).
struct Workload {
  std::string_view model;
  std::string_view batch;    // batch size, or small/medium/large for seq2seq
  double persistent_mb;      // model state that lives as long as the job
  double peak_mb;            // persistent + the largest iteration's ephemeral memory
  double iter_ms;            // one training iteration alone on the GPU
  double util;               // fraction of the GPU one iteration keeps busy
  std::string name() const;  // "resnet50_50"
};

std::span<const Workload> salus_workloads();
// Looks up "resnet50_50"; nullptr if unknown.
const Workload* find_workload(std::string_view name);

struct GeneratorConfig {
  std::size_t jobs = 100;
  std::uint64_t seed = 1;
  // Poisson arrivals with this mean gap; 0 puts every job at t = 0.
  double mean_interarrival_s = 20.0;
  // Explicit arrival times (seconds); when set, `jobs` is their count and the gaps above
  // are not drawn.
  std::vector<double> arrivals;
  // Lognormal job duration (alone on the GPU) with this mean and sigma of the underlying
  // normal, truncated at max_duration_s. iters = round(duration / iter_ms), at least 1.
  // Defaults: 3 minutes (Table 2: ~303 min of FIFO makespan for 100 jobs) and a heavy
  // tail (sigma 2: the median job is 24 s, one in a hundred runs over 40 minutes).
  double duration_mean_s = 180.0;
  double duration_sigma = 2.0;
  double max_duration_s = 6 * 3600.0;
  std::optional<std::uint64_t> iters;  // fixed iteration count instead of a duration
  // Workloads to draw from, uniformly: "resnet50_50", or a model name for all its batch
  // sizes. Empty: the whole mix.
  std::vector<std::string> workloads;
  std::optional<double> util;  // overrides every workload's utilization
  std::string prefix = "job";  // job names are prefix + sequence number
  // Who submits each job: user1 .. userN, drawn with probability proportional to
  // 1 / k^user_skew for user k (0: uniformly; 1: Zipf, user1 submitting the most).
  // From a stream of their own, so the rest of the trace is the same with or without
  // users. 0 users: no user column.
  std::size_t users = 0;
  double user_skew = 0.0;
};

// Deterministic for a given config on every platform: the generator draws from
// std::mt19937_64 and does its own transforms. Throws std::invalid_argument on a bad
// config (unknown workload, non-positive durations, util outside (0, 1]).
std::vector<TraceJob> generate_trace(const GeneratorConfig& config);

}  // namespace salus::sched
