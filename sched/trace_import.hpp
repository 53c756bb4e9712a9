// Importers from public GPU-cluster trace formats to salus-sim's trace CSV: a Philly
// cluster_job_log (JSON), job-per-row CSVs derived from it or shaped like Helios'
// cluster_log.csv, Alibaba PAI's pai_task_table (cluster-trace-gpu-v2020) and Alibaba's
// openb_pod_list (cluster-trace-gpu-v2023). Pure conversion, text in and jobs out, so that
// the rules (docs/simulation.md, "Importing cluster traces") are tested without files.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sched/trace.hpp"

namespace salus::sched {

enum class ImportFormat : std::uint8_t {
  philly,    // Philly cluster_job_log: a JSON array of jobs with attempts
  jobs_csv,  // one job per row, columns found by name (Helios, Philly-derived CSVs)
  pai,       // Alibaba cluster-trace-gpu-v2020 pai_task_table (+ pai_job_table)
  openb,     // Alibaba cluster-trace-gpu-v2023 openb_pod_list
};
std::string_view to_string(ImportFormat f);
std::optional<ImportFormat> import_format_from_string(std::string_view name);

// What the traces do not record, and the choices the rules leave open.
struct ImportOptions {
  // None of these traces has iterations: every job gets iterations of this length, and
  // iters = its GPU time / iter_ms (at least 1).
  double iter_ms = 1000.0;
  // None records a job's GPU memory (PAI's plan_mem and openb's memory_mib are host
  // memory): every job gets these.
  double persistent_mb = 500.0;
  double ephemeral_mb = 4500.0;
  // Utilization of a job that holds whole GPUs; a fractional GPU gets its fraction.
  double util = 1.0;
  // Failed and killed jobs used the GPU time they are recorded with, so they are load:
  // kept by default. Off: only jobs that ended well are imported.
  bool keep_failed = true;
  std::string model = "imported";
  // Keeps who submitted each job (Philly's "user", a jobs CSV's user column, the PAI job
  // table's user; openb records none) as the trace's user column, for salus-sim's FAIR
  // by user. Off by default: with two users or more salus-sim simulates FAIR iteration
  // by iteration, which is slower on long traces.
  bool users = false;
};

struct ImportSummary {
  std::size_t records = 0;      // jobs, rows or pods read
  std::size_t imported = 0;     // jobs written
  std::size_t multi_gpu = 0;    // imported jobs with k > 1 GPUs, run as k x their duration
  std::size_t fractional = 0;   // imported jobs on a fraction of a GPU (util below 1)
  std::size_t failed_kept = 0;  // imported jobs that failed or were killed
  std::size_t users = 0;        // distinct users among the imported jobs (ImportOptions::users)
  std::map<std::string, std::size_t> skipped;  // reason -> jobs
  double gpu_seconds = 0.0;                    // total GPU time imported
};

struct ImportResult {
  std::vector<TraceJob> jobs;  // by arrival (ties in input order), the first at 0 s
  ImportSummary summary;
};

// Converts a whole trace. `pai_jobs` (pai format only, optional) is the pai_job_table,
// whose start_time is the submission; without it a job arrives at its first task's start.
// Throws TraceError naming the line (and column, for CSV) of malformed input: a wrong
// column count, a number or time that does not parse, a header without a needed column,
// broken JSON. A trace with nothing to import is an error too, with the skip reasons.
ImportResult import_trace(std::istream& in, ImportFormat format, const ImportOptions& options,
                          std::istream* pai_jobs = nullptr);
ImportResult import_trace_text(std::string_view text, ImportFormat format,
                               const ImportOptions& options,
                               std::optional<std::string_view> pai_jobs = std::nullopt);

// "2017-10-03 02:53:09" (UTC, 'T' allowed between date and time) or plain seconds, as
// seconds; nullopt for an empty field, "None", "null" or "NaN", which the traces use for
// times that never happened. Throws std::invalid_argument on anything else.
std::optional<double> parse_trace_time(std::string_view text);

}  // namespace salus::sched
