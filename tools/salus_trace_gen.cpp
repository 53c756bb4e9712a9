// salus-trace-gen: writes a seeded salus-sim trace drawn from the Salus workload mix
// (Table 3 models and batch sizes, lognormal durations, Poisson arrivals).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "sched/trace.hpp"
#include "sched/trace_generator.hpp"

namespace {

namespace sc = salus::sched;

// --shape: the defaults of a trace of a known shape; what the user set stays.
void apply_shape(const std::string& shape, const CLI::App& app, sc::GeneratorConfig& c) {
  auto unset = [&app](const char* name) { return app.count(name) == 0; };
  if (shape == "cluster" || shape == "year") {
    // year: the cluster's load per GPU (8 GPUs, a job every 400 s) on 100 GPUs for 365 days.
    const bool year = shape == "year";
    if (unset("--jobs")) c.jobs = year ? 985500 : 15264;
    if (unset("--interarrival")) c.mean_interarrival_s = year ? 32 : 400;
    if (unset("--duration-mean")) c.duration_mean_s = 3000;
    if (unset("--duration-sigma")) c.duration_sigma = 2;
    if (unset("--duration-max")) c.max_duration_s = 30 * 86400.0;
  } else if (shape == "burst") {
    if (unset("--jobs")) c.jobs = 100000;
    if (unset("--interarrival")) c.mean_interarrival_s = 0;
    if (unset("--duration-mean")) c.duration_mean_s = 60;
    if (unset("--duration-sigma")) c.duration_sigma = 1;
  }
}

// --arrivals: comma-separated times in seconds, appended to `out`; false (and a
// message on stderr) for one that is not a number.
bool parse_arrivals(const std::string& arrivals, std::vector<double>& out) {
  if (arrivals.empty()) return true;
  std::stringstream ss(arrivals);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      std::size_t used = 0;
      out.push_back(std::stod(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      std::fprintf(stderr, "salus-trace-gen: bad arrival time '%s'\n", item.c_str());
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  sc::GeneratorConfig c;
  std::string out_path, arrivals;
  std::uint64_t iters = 0;
  double util = 0;
  bool list = false;
  std::string shape;
  CLI::App app{"Writes a salus-sim trace drawn from the Salus workload mix", "salus-trace-gen"};
  app.add_option("--jobs", c.jobs, "number of jobs")
      ->capture_default_str()
      ->check(CLI::Range(1ul, 100'000'000ul));
  app.add_option("--seed", c.seed, "random seed")->capture_default_str();
  app.add_option("--interarrival", c.mean_interarrival_s,
                 "mean gap between Poisson arrivals, seconds (0: all jobs at t=0)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--arrivals", arrivals,
                 "explicit arrival times in seconds, comma-separated (sets --jobs)");
  app.add_option("--duration-mean", c.duration_mean_s,
                 "mean job duration alone, seconds (lognormal)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--duration-sigma", c.duration_sigma, "sigma of the lognormal duration")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--duration-max", c.max_duration_s, "longest job duration, seconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--iters", iters, "fixed iteration count for every job (instead of a duration)")
      ->check(CLI::PositiveNumber);
  app.add_option("--workloads", c.workloads,
                 "workloads to draw from, e.g. resnet50_50 or resnet50 (all its batch sizes); "
                 "default: all 45")
      ->delimiter(',');
  app.add_option("--util", util, "override every job's utilization")->check(CLI::Range(1e-6, 1.0));
  app.add_option("--prefix", c.prefix, "job name prefix")->capture_default_str();
  app.add_option("--users", c.users,
                 "give each job a user, user1 .. userN (a user column for salus-sim's FAIR by "
                 "user); default: none")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100000}));
  app.add_option("--user-skew", c.user_skew,
                 "user k submits with probability proportional to 1/k^SKEW (0: uniform, 1: Zipf)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("-o,--out", out_path, "output file (default: stdout)");
  app.add_flag("--list", list, "print the workload table and exit");
  app.add_option("--shape", shape,
                 "defaults for a trace of a known shape (explicit options win): 'cluster' is "
                 "15,264 jobs over ~70 days with Philly-like heavy-tailed durations (mean "
                 "50 min, up to 30 days), 'burst' is 100,000 short jobs all at t=0 "
                 "(docs/benchmarks.md runs both), 'year' is the cluster shape for a year of a "
                 "100-GPU cluster (985,500 jobs, a gap of 32 s: --gpus 100)")
      ->check(CLI::IsMember({"cluster", "burst", "year"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  if (list) {
    std::cout << "workload persistent_mb peak_mb iter_ms util\n";
    for (const sc::Workload& w : sc::salus_workloads())
      std::cout << fmt::format("{} {} {} {} {}\n", w.name(), w.persistent_mb, w.peak_mb, w.iter_ms,
                               w.util);
    return 0;
  }
  apply_shape(shape, app, c);
  if (iters > 0) c.iters = iters;
  if (util > 0) c.util = util;
  if (!parse_arrivals(arrivals, c.arrivals)) return 2;
  std::vector<sc::TraceJob> jobs;
  try {
    jobs = sc::generate_trace(c);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "salus-trace-gen: %s\n", e.what());
    return 2;
  }
  if (out_path.empty()) {
    sc::write_trace(std::cout, jobs);
    return std::cout.flush() ? 0 : 1;
  }
  std::ofstream out(out_path);
  sc::write_trace(out, jobs);
  if (!out.flush()) {
    std::fprintf(stderr, "salus-trace-gen: writing '%s' failed\n", out_path.c_str());
    return 1;
  }
  return 0;
}
