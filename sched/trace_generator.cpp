#include "sched/trace_generator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numbers>
#include <random>
#include <stdexcept>

namespace salus::sched {

namespace {

// See docs/simulation.md, "Workload table", for the reasoning behind every column.
// Stated in the paper (TensorFlow, P100): googlenet_25 persistent 110.9 MB, resnet152_75
// persistent 822.2 MB and peak 13.8 GB, vae average 22 MB and peak 35 MB. Utilization
// anchors: packing 300 resnet50_50 jobs gained 1.07x (util ~ 0.93) and superres_128 2.38x
// (util ~ 0.42) in Figure 12.
constexpr std::array<Workload, 45> kWorkloads{{
    {"alexnet", "25", 260, 1300, 30, 0.45},
    {"alexnet", "50", 290, 1900, 45, 0.60},
    {"alexnet", "100", 350, 3100, 75, 0.75},
    {"googlenet", "25", 110.9, 1800, 55, 0.55},
    {"googlenet", "50", 140, 3300, 95, 0.70},
    {"googlenet", "100", 200, 6300, 175, 0.85},
    {"inception3", "25", 200, 3800, 190, 0.85},
    {"inception3", "50", 270, 7300, 360, 0.95},
    {"inception3", "100", 400, 13600, 700, 1.00},
    {"inception4", "25", 300, 4500, 370, 0.90},
    {"inception4", "50", 400, 8700, 720, 1.00},
    {"inception4", "75", 500, 12900, 1070, 1.00},
    {"overfeat", "25", 620, 1700, 45, 0.60},
    {"overfeat", "50", 660, 2600, 75, 0.75},
    {"overfeat", "100", 740, 4400, 135, 0.90},
    {"resnet50", "25", 230, 3000, 135, 0.85},
    {"resnet50", "50", 290, 5700, 250, 0.93},
    {"resnet50", "75", 350, 8400, 365, 0.97},
    {"resnet101", "25", 380, 4600, 230, 0.90},
    {"resnet101", "50", 450, 8800, 430, 0.97},
    {"resnet101", "75", 520, 12900, 630, 1.00},
    {"resnet152", "25", 620, 5000, 320, 0.92},
    {"resnet152", "50", 720, 9400, 610, 0.98},
    {"resnet152", "75", 822.2, 13800, 900, 1.00},
    {"vgg11", "25", 560, 2400, 120, 0.85},
    {"vgg11", "50", 600, 4100, 215, 0.93},
    {"vgg11", "100", 680, 7500, 410, 0.98},
    {"vgg16", "25", 580, 3300, 190, 0.90},
    {"vgg16", "50", 620, 5900, 350, 0.97},
    {"vgg16", "100", 700, 11200, 680, 1.00},
    {"vgg19", "25", 600, 3600, 225, 0.92},
    {"vgg19", "50", 640, 6500, 420, 0.98},
    {"vgg19", "100", 720, 12300, 820, 1.00},
    {"vae", "64", 15, 25, 4, 0.10},
    {"vae", "128", 17, 30, 5, 0.15},
    {"vae", "256", 20, 35, 7, 0.20},
    {"superres", "32", 30, 600, 30, 0.20},
    {"superres", "64", 32, 1100, 55, 0.30},
    {"superres", "128", 35, 2100, 100, 0.42},
    {"speech", "25", 250, 3000, 250, 0.80},
    {"speech", "50", 300, 5600, 470, 0.90},
    {"speech", "75", 350, 8200, 690, 0.95},
    {"seq2seq", "small", 40, 500, 20, 0.30},
    {"seq2seq", "medium", 120, 1500, 60, 0.60},
    {"seq2seq", "large", 300, 3500, 150, 0.85},
}};

// Uniform in [0, 1) from the top 53 bits: the same on every platform, unlike the
// standard distributions, whose algorithms are left to the library.
double uniform(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

double exponential(std::mt19937_64& rng, double mean) {
  return -std::log1p(-uniform(rng)) * mean;
}

double standard_normal(std::mt19937_64& rng) {
  // Box-Muller; 1 - u keeps the log argument in (0, 1].
  const double u1 = 1.0 - uniform(rng), u2 = uniform(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace

std::string Workload::name() const {
  return fmt::format("{}_{}", model, batch);
}

std::span<const Workload> salus_workloads() {
  return kWorkloads;
}

const Workload* find_workload(std::string_view name) {
  for (const Workload& w : kWorkloads)
    if (w.name() == name) return &w;
  return nullptr;
}

namespace {
// GeneratorConfig::users: each job's user, drawn from its own seeded stream.
void assign_users(const GeneratorConfig& c, std::vector<TraceJob>& jobs) {
  if (c.users == 0) return;
  std::vector<double> cumulative(c.users);
  double sum = 0.0;
  for (std::size_t k = 0; k < c.users; ++k) {
    sum += 1.0 / std::pow(static_cast<double>(k + 1), c.user_skew);
    cumulative[k] = sum;
  }
  std::mt19937_64 rng(c.seed ^ 0x75736572'73000000ULL);  // "users"
  for (TraceJob& j : jobs) {
    const double u = uniform(rng) * sum;
    const auto k = static_cast<std::size_t>(
        std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin());
    j.user = fmt::format("user{}", std::min(k, c.users - 1) + 1);
  }
}
}  // namespace

std::vector<TraceJob> generate_trace(const GeneratorConfig& c) {
  std::vector<const Workload*> pool;
  if (c.workloads.empty()) {
    for (const Workload& w : kWorkloads) pool.push_back(&w);
  } else {
    for (const std::string& name : c.workloads) {
      const std::size_t before = pool.size();
      if (const Workload* w = find_workload(name)) {
        pool.push_back(w);
      } else {
        for (const Workload& x : kWorkloads)
          if (x.model == name) pool.push_back(&x);
      }
      if (pool.size() == before)
        throw std::invalid_argument(fmt::format("unknown workload '{}'", name));
    }
  }
  if (!(c.duration_mean_s > 0) || !(c.duration_sigma >= 0) || !(c.max_duration_s > 0))
    throw std::invalid_argument("durations must be positive");
  if (!(c.mean_interarrival_s >= 0)) throw std::invalid_argument("interarrival must be >= 0");
  if (c.util && !(*c.util > 0 && *c.util <= 1))
    throw std::invalid_argument("util must be in (0, 1]");
  if (c.iters && *c.iters == 0) throw std::invalid_argument("iters must be at least 1");
  if (!(c.user_skew >= 0 && c.user_skew <= 10))
    throw std::invalid_argument("user skew must be between 0 and 10");
  if (c.users > 100000) throw std::invalid_argument("at most 100000 users");
  for (double a : c.arrivals)
    if (!(a >= 0) || !std::isfinite(a)) throw std::invalid_argument("arrivals must be >= 0");

  const std::size_t n = c.arrivals.empty() ? c.jobs : c.arrivals.size();
  // A lognormal's mean is exp(mu + sigma^2 / 2): solve for its median exp(mu).
  const double median = c.duration_mean_s / std::exp(c.duration_sigma * c.duration_sigma / 2);
  std::mt19937_64 rng(c.seed);
  std::vector<TraceJob> out;
  out.reserve(n);
  const int width = static_cast<int>(fmt::format("{}", n).size());
  double clock = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    // Every job draws the same numbers whatever the options, so that changing one
    // option (say, the arrival rate) leaves the rest of the trace as it was.
    const double gap = exponential(rng, 1.0);
    const Workload& w =
        *pool[std::min(pool.size() - 1, static_cast<std::size_t>(uniform(rng) * pool.size()))];
    const double z = standard_normal(rng);

    TraceJob j;
    j.name = fmt::format("{}{:0{}}", c.prefix, i, width);
    if (!c.arrivals.empty()) {
      j.arrival_s = c.arrivals[i];
    } else {
      // The first job arrives at 0; gaps are exponential (Poisson arrivals).
      if (i > 0) clock += gap * c.mean_interarrival_s;
      // Millisecond resolution keeps the CSV short; it cannot reorder arrivals.
      j.arrival_s = std::round(clock * 1000.0) / 1000.0;
    }
    j.model = w.name();
    j.persistent_mb = w.persistent_mb;
    j.ephemeral_mb = std::max(0.0, w.peak_mb - w.persistent_mb);
    j.iter_ms = w.iter_ms;
    j.util = c.util.value_or(w.util);
    if (c.iters) {
      j.iters = *c.iters;
    } else {
      const double duration = std::min(c.max_duration_s, median * std::exp(c.duration_sigma * z));
      j.iters = std::max<std::uint64_t>(
          1, static_cast<std::uint64_t>(std::llround(duration * 1000.0 / w.iter_ms)));
    }
    out.push_back(std::move(j));
  }
  assign_users(c, out);
  return out;
}

}  // namespace salus::sched
