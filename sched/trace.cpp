#include "sched/trace.hpp"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <cmath>
#include <istream>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <unordered_set>

namespace salus::sched {

namespace {

constexpr std::array<std::string_view, 10> kColumns{
    "job",     "arrival_s", "model", "persistent_mb", "ephemeral_mb",
    "iter_ms", "iters",     "util",  "priority",      "user"};
constexpr std::size_t kLeastColumns = 8;  // priority and user are optional

std::string_view trim(std::string_view s) {
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!s.empty() && blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && blank(s.back())) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> out;
  for (;;) {
    const std::size_t comma = line.find(',');
    out.push_back(trim(line.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    line.remove_prefix(comma + 1);
  }
  return out;
}

bool equal_ci(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    char c = a[i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != b[i]) return false;
  }
  return true;
}

[[noreturn]] void fail(std::size_t line, const std::string& what) {
  throw TraceError(line, fmt::format("line {}: {}", line, what));
}

double number(std::string_view text, std::size_t line, std::string_view column) {
  double v = 0.0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || !std::isfinite(v))
    fail(line, fmt::format("{} '{}' is not a finite number", column, text));
  return v;
}

template <typename Int>
Int integer(std::string_view text, std::size_t line, std::string_view column) {
  Int v = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end)
    fail(line, fmt::format("{} '{}' is not a whole number in range", column, text));
  return v;
}

// Seconds written as plain decimals ("8842326.112") to exact nanoseconds, rounding half
// up past the ninth decimal; nullopt for other spellings (exponents), which the caller
// converts through the double.
std::optional<std::int64_t> exact_ns(std::string_view text) {
  std::int64_t whole = 0, frac = 0;
  std::size_t i = 0, digits = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++digits) {
    if (whole > 2'000'000'000) return std::nullopt;
    whole = whole * 10 + (text[i] - '0');
  }
  int scale = 0;
  bool round_up = false;
  if (i < text.size() && text[i] == '.') {
    for (++i; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++digits) {
      if (scale < 9) {
        frac = frac * 10 + (text[i] - '0');
        ++scale;
      } else if (scale == 9) {
        round_up = text[i] >= '5';
        ++scale;
      }
    }
  }
  if (i != text.size() || digits == 0) return std::nullopt;
  for (; scale < 9; ++scale) frac *= 10;
  return whole * 1'000'000'000 + frac + (round_up ? 1 : 0);
}

bool is_comment_or_blank(std::string_view line) {
  line = trim(line);
  return line.empty() || line.front() == '#';
}

// The header is recognised by its first field so that a trace whose first job happens
// to be called "job" still fails loudly (its columns would not match the names).
void check_header(const std::vector<std::string_view>& fields, std::size_t line) {
  if (fields.size() < kLeastColumns || fields.size() > kColumns.size())
    fail(line, fmt::format("header has {} columns, expected 8 to 10: {}", fields.size(),
                           kTraceHeaderWithUser));
  for (std::size_t i = 0; i < fields.size(); ++i)
    if (!equal_ci(fields[i], kColumns[i]))
      fail(line, fmt::format("header column {} is '{}', expected '{}' (header: {})", i + 1,
                             fields[i], kColumns[i], kTraceHeaderWithUser));
}

}  // namespace

TraceJob parse_trace_line(std::string_view line, std::size_t line_no) {
  const std::vector<std::string_view> f = split(line);
  if (f.size() < kLeastColumns || f.size() > kColumns.size())
    fail(line_no, fmt::format("{} fields, expected 8 to 10 ({})", f.size(), kTraceHeaderWithUser));
  TraceJob j;
  j.line = line_no;
  if (f[0].empty()) fail(line_no, "job name is empty");
  j.name = std::string(f[0]);
  j.arrival_s = number(f[1], line_no, "arrival_s");
  if (j.arrival_s < 0) fail(line_no, fmt::format("arrival_s {} is negative", f[1]));
  if (j.arrival_s <= 1e9) j.arrival_ns = exact_ns(f[1]).value_or(std::llround(j.arrival_s * 1e9));
  if (f[2].empty()) fail(line_no, "model is empty");
  j.model = std::string(f[2]);
  j.persistent_mb = number(f[3], line_no, "persistent_mb");
  if (j.persistent_mb < 0) fail(line_no, fmt::format("persistent_mb {} is negative", f[3]));
  j.ephemeral_mb = number(f[4], line_no, "ephemeral_mb");
  if (j.ephemeral_mb < 0) fail(line_no, fmt::format("ephemeral_mb {} is negative", f[4]));
  j.iter_ms = number(f[5], line_no, "iter_ms");
  if (j.iter_ms <= 0) fail(line_no, fmt::format("iter_ms {} must be positive", f[5]));
  // The simulator's clock ticks in nanoseconds; a shorter iteration would be rounded up.
  if (j.iter_ms < 1e-6)
    fail(line_no,
         fmt::format("iter_ms {} is below 1 ns (0.000001 ms), the simulator's resolution", f[5]));
  // Past ~292 years of virtual time the nanosecond clock would overflow.
  if (j.iter_ms > 1e9) fail(line_no, fmt::format("iter_ms {} is unreasonably large", f[5]));
  if (j.arrival_s > 1e9) fail(line_no, fmt::format("arrival_s {} is unreasonably large", f[1]));
  j.iters = integer<std::uint64_t>(f[6], line_no, "iters");
  if (j.iters == 0) fail(line_no, "iters must be at least 1");
  j.util = number(f[7], line_no, "util");
  if (!(j.util > 0.0 && j.util <= 1.0))
    fail(line_no, fmt::format("util {} must be in (0, 1]", f[7]));
  if (f.size() >= 9 && !f[8].empty()) j.priority = integer<std::int32_t>(f[8], line_no, "priority");
  if (f.size() == 10) j.user = std::string(f[9]);
  return j;
}

std::vector<TraceJob> parse_trace(std::istream& in) {
  std::vector<TraceJob> jobs;
  std::unordered_set<std::string> names;
  std::string line;
  std::size_t line_no = 0;
  bool first = true;
  while (std::getline(in, line)) {
    ++line_no;
    // Spreadsheet exports often start with a UTF-8 byte-order mark.
    if (line_no == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);
    if (is_comment_or_blank(line)) continue;
    if (first) {
      first = false;
      const std::vector<std::string_view> f = split(line);
      if (equal_ci(f[0], "job")) {
        check_header(f, line_no);
        continue;
      }
    }
    TraceJob j = parse_trace_line(line, line_no);
    if (!names.insert(j.name).second) fail(line_no, fmt::format("duplicate job name '{}'", j.name));
    jobs.push_back(std::move(j));
  }
  if (in.bad()) throw TraceError(line_no, "read error");
  if (jobs.empty()) throw TraceError(line_no, "the trace has no jobs");
  return jobs;
}

std::vector<TraceJob> parse_trace_text(std::string_view text) {
  std::istringstream in{std::string(text)};
  return parse_trace(in);
}

void write_trace(std::ostream& out, const std::vector<TraceJob>& jobs) {
  bool users = false;
  for (const TraceJob& j : jobs) users = users || !j.user.empty();
  out << (users ? kTraceHeaderWithUser : kTraceHeader) << '\n';
  for (const TraceJob& j : jobs) {
    out << fmt::format("{},{},{},{},{},{},{},{},{}", j.name, j.arrival_s, j.model, j.persistent_mb,
                       j.ephemeral_mb, j.iter_ms, j.iters, j.util, j.priority);
    out << (users ? fmt::format(",{}\n", j.user) : std::string("\n"));
  }
}

}  // namespace salus::sched
