// Job traces for salus-sim: one training job per CSV line, parsed with line-numbered
// errors, and written back in the same format (the trace generator's output).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace salus::sched {

// job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util[,priority[,user]]
// MB here are MiB (2^20 bytes), like the K/M/G suffixes everywhere else in Salus.
struct TraceJob {
  std::string name;
  double arrival_s = 0.0;
  std::string model;
  double persistent_mb = 0.0;
  double ephemeral_mb = 0.0;
  double iter_ms = 0.0;     // one iteration's duration when the job runs alone
  std::uint64_t iters = 0;  // declared, and what the job runs
  double util = 1.0;        // fraction of the GPU one iteration occupies, in (0, 1]
  std::int32_t priority = 0;
  std::size_t line = 0;  // 1-based line in the source, 0 when built in code
  // The arrival in nanoseconds, parsed exactly from the decimal text (-1: not parsed,
  // use arrival_s). A double holds seconds like 8842326.112 only to a few nanoseconds,
  // which would make a simulation depend on where the trace's clock starts.
  std::int64_t arrival_ns = -1;
  // Who submitted the job: FAIR by owner (salus-sim --fair-share user) shares a lane
  // per user. Empty: the job counts as the one anonymous user's.
  std::string user = {};
};

inline constexpr std::string_view kTraceHeader =
    "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority";
// The header of a trace whose jobs name their users (write_trace writes it when one does).
inline constexpr std::string_view kTraceHeaderWithUser =
    "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority,user";

class TraceError : public std::runtime_error {
 public:
  TraceError(std::size_t line, const std::string& what) : std::runtime_error(what), line_(line) {}
  std::size_t line() const { return line_; }

 private:
  std::size_t line_;
};

// Parses a whole trace. A UTF-8 byte-order mark before the first line is skipped. Blank lines and
// lines starting with '#' are skipped; the first other line may be a header (its first field is
// "job"). Throws TraceError naming the line and the field on any malformed or out-of-range value, a
// duplicate job name, or an empty trace. Jobs come back in file order.
std::vector<TraceJob> parse_trace(std::istream& in);
std::vector<TraceJob> parse_trace_text(std::string_view text);

// One data line (no header handling): for tests and for callers that read line by line.
TraceJob parse_trace_line(std::string_view line, std::size_t line_no);

// Writes the header and one line per job; numbers are printed so that parsing the output
// gives back the same values. The user column is written when a job has a user.
void write_trace(std::ostream& out, const std::vector<TraceJob>& jobs);

}  // namespace salus::sched
