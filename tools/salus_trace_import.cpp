// salus-trace-import: converts a public GPU-cluster trace (Philly job log, Helios-style
// job CSV, Alibaba PAI task table, Alibaba openb pod list) to a salus-sim trace. The
// rules live in sched/trace_import; this is the file handling and the summary.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <new>
#include <string>

#include "sched/trace.hpp"
#include "sched/trace_import.hpp"

namespace {

namespace sc = salus::sched;

void print_summary(const sc::ImportSummary& s, std::string_view format) {
  std::cerr << fmt::format(
      "salus-trace-import: {}: {} records, {} jobs imported ({:.1f} GPU-hours); {} multi-GPU "
      "(run as k x duration), {} on a fraction of a GPU, {} failed or killed kept\n",
      format, s.records, s.imported, s.gpu_seconds / 3600.0, s.multi_gpu, s.fractional,
      s.failed_kept);
  if (s.users > 0)
    std::cerr << fmt::format("salus-trace-import: {} {}\n", s.users,
                             s.users == 1 ? "user" : "users");
  for (const auto& [why, n] : s.skipped)
    std::cerr << fmt::format("salus-trace-import: skipped {}: {}\n", n, why);
}

int run(int argc, char** argv) {
  sc::ImportOptions o;
  std::string format_name, in_path, out_path, pai_jobs_path;
  bool completed_only = false;
  CLI::App app{"Converts a GPU-cluster trace to a salus-sim trace", "salus-trace-import"};
  app.add_option("--format", format_name,
                 "philly (cluster_job_log JSON), jobs-csv (one job per row: Helios "
                 "cluster_log.csv, Philly-derived CSVs), pai (Alibaba v2020 pai_task_table), "
                 "openb (Alibaba v2023 openb_pod_list)")
      ->required()
      ->check(CLI::IsMember({"philly", "jobs-csv", "pai", "openb"}));
  app.add_option("input", in_path, "the trace file ('-': standard input)")->required();
  app.add_option("-o,--out", out_path, "output trace (default: standard output)");
  app.add_option("--pai-jobs", pai_jobs_path,
                 "pai only: the pai_job_table, whose start_time is the submit time");
  app.add_option("--iter-ms", o.iter_ms, "every job's iteration length, ms")
      ->capture_default_str()
      ->check(CLI::Range(1e-6, 1e9));
  app.add_option("--persistent-mb", o.persistent_mb, "every job's persistent GPU memory, MiB")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ephemeral-mb", o.ephemeral_mb, "every job's ephemeral GPU memory, MiB")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--util", o.util, "utilization of a whole-GPU job (fractions scale it)")
      ->capture_default_str()
      ->check(CLI::Range(1e-6, 1.0));
  app.add_option("--model", o.model, "the model column of every job")->capture_default_str();
  app.add_flag("--completed-only", completed_only, "skip failed and killed jobs");
  app.add_flag("--users", o.users,
               "keep each job's user as the trace's user column (salus-sim's FAIR by user)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  o.keep_failed = !completed_only;
  if (o.model.empty() || o.model.find_first_of(",\n#") != std::string::npos) {
    std::cerr << "salus-trace-import: --model must be non-empty, without ',' or '#'\n";
    return 2;
  }
  const sc::ImportFormat format = *sc::import_format_from_string(format_name);
  if (!pai_jobs_path.empty() && format != sc::ImportFormat::pai) {
    std::cerr << "salus-trace-import: --pai-jobs goes with --format pai\n";
    return 2;
  }
  std::ifstream file;
  if (in_path != "-") {
    file.open(in_path, std::ios::binary);
    if (!file) {
      std::cerr << fmt::format("salus-trace-import: cannot open {}\n", in_path);
      return 2;
    }
  }
  std::istream& in = in_path == "-" ? std::cin : file;
  std::ifstream jobs;
  if (!pai_jobs_path.empty()) {
    jobs.open(pai_jobs_path, std::ios::binary);
    if (!jobs) {
      std::cerr << fmt::format("salus-trace-import: cannot open {}\n", pai_jobs_path);
      return 2;
    }
  }
  sc::ImportResult res;
  try {
    res = sc::import_trace(in, format, o, pai_jobs_path.empty() ? nullptr : &jobs);
  } catch (const sc::TraceError& e) {
    std::cerr << fmt::format("salus-trace-import: {}: {}\n", in_path, e.what());
    return 2;
  }
  if (out_path.empty()) {
    sc::write_trace(std::cout, res.jobs);
    std::cout.flush();
    if (!std::cout) return 1;
  } else {
    std::ofstream out(out_path);
    sc::write_trace(out, res.jobs);
    out.close();
    if (!out) {
      std::cerr << fmt::format("salus-trace-import: cannot write {}\n", out_path);
      return 1;
    }
  }
  print_summary(res.summary, format_name);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::cerr << "salus-trace-import: out of memory\n";
  } catch (const std::exception& e) {
    std::cerr << fmt::format("salus-trace-import: internal error: {}\n", e.what());
  }
  return 3;
}
