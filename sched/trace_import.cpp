#include "sched/trace_import.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <istream>
#include <iterator>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>

namespace salus::sched {

std::string_view to_string(ImportFormat f) {
  switch (f) {
    case ImportFormat::philly:
      return "philly";
    case ImportFormat::jobs_csv:
      return "jobs-csv";
    case ImportFormat::pai:
      return "pai";
    case ImportFormat::openb:
      return "openb";
  }
  return "unknown";
}

std::optional<ImportFormat> import_format_from_string(std::string_view name) {
  for (ImportFormat f :
       {ImportFormat::philly, ImportFormat::jobs_csv, ImportFormat::pai, ImportFormat::openb})
    if (to_string(f) == name) return f;
  return std::nullopt;
}

namespace {

[[noreturn]] void fail(std::size_t line, const std::string& what) {
  throw TraceError(line, fmt::format("line {}: {}", line, what));
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string_view trim(std::string_view s) {
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!s.empty() && blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && blank(s.back())) s.remove_suffix(1);
  return s;
}

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
std::int64_t days_from_civil(std::int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const auto yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<std::int64_t>(doe) - 719468;
}

bool digits(std::string_view s, std::size_t pos, std::size_t n, int& out) {
  if (pos + n > s.size()) return false;
  out = 0;
  for (std::size_t i = pos; i < pos + n; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    out = out * 10 + (s[i] - '0');
  }
  return true;
}

double number_or_throw(std::string_view t) {
  double v = 0;
  const auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || p != t.data() + t.size() || !std::isfinite(v))
    throw std::invalid_argument("not a number");
  return v;
}

}  // namespace

std::optional<double> parse_trace_time(std::string_view text) {
  const std::string_view t = trim(text);
  const std::string l = lower(t);
  if (t.empty() || l == "none" || l == "null" || l == "nan") return std::nullopt;
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, s = 0;
  if (t.size() >= 19 && digits(t, 0, 4, y) && t[4] == '-' && digits(t, 5, 2, mo) && t[7] == '-' &&
      digits(t, 8, 2, d) && (t[10] == ' ' || t[10] == 'T') && digits(t, 11, 2, h) && t[13] == ':' &&
      digits(t, 14, 2, mi) && t[16] == ':' && digits(t, 17, 2, s)) {
    double frac = 0;
    std::string_view rest = t.substr(19);
    if (!rest.empty() && rest.back() == 'Z') rest.remove_suffix(1);
    if (!rest.empty()) {
      if (rest.front() != '.') throw std::invalid_argument("not a time");
      frac = number_or_throw(fmt::format("0{}", rest));
    }
    if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || s > 60)
      throw std::invalid_argument("not a valid date and time");
    const std::int64_t days =
        days_from_civil(y, static_cast<unsigned>(mo), static_cast<unsigned>(d));
    return static_cast<double>(days * 86400 + h * 3600 + mi * 60 + s) + frac;
  }
  return number_or_throw(t);
}

namespace {

// ---------------------------------------------------------------- accumulation

// One job as the rules see it before it becomes a trace line.
struct Pending {
  std::string name;
  std::size_t line = 0;
  std::size_t order = 0;
  std::optional<double> submit;
  double work = 0.0;  // GPU-seconds: the sum of duration x GPUs
  double busy = 0.0;  // the same weighted by each GPU's share (fractional GPUs)
  double gpus = 0.0;  // most GPUs held at once
  std::string user;   // who submitted it, where the trace says
  bool failed = false;
  std::string skip;  // non-empty: why it is not imported
};

class Collector {
 public:
  explicit Collector(const ImportOptions& o) : o_(o) {}

  void skip(const std::string& why) { ++summary_.skipped[why]; }

  void add(Pending p) {
    ++summary_.records;
    if (p.skip.empty() && p.failed && !o_.keep_failed)
      p.skip = "failed or killed (--completed-only)";
    if (p.skip.empty() && p.gpus <= 0) p.skip = "no GPU (CPU-only job)";
    if (p.skip.empty() && !p.submit) p.skip = "no submit time";
    if (p.skip.empty() && !(p.work > 0)) p.skip = "no GPU time (ran 0 s)";
    if (p.skip.empty() && !names_.insert(p.name).second) p.skip = "duplicate job name";
    if (!p.skip.empty()) {
      skip(p.skip);
      return;
    }
    p.order = pending_.size();
    pending_.push_back(std::move(p));
  }

  ImportResult finish() {
    ImportResult res;
    if (pending_.empty()) {
      std::string why;
      for (const auto& [reason, n] : summary_.skipped) why += fmt::format("; {} {}", n, reason);
      throw TraceError(0,
                       fmt::format("nothing to import: {} records read{}", summary_.records, why));
    }
    std::stable_sort(pending_.begin(), pending_.end(),
                     [](const Pending& a, const Pending& b) { return *a.submit < *b.submit; });
    const double base = *pending_.front().submit;
    std::unordered_set<std::string> users;
    for (const Pending& p : pending_) {
      TraceJob j;
      j.name = p.name;
      if (o_.users && !p.user.empty()) {
        j.user = p.user;
        users.insert(p.user);
      }
      j.line = p.line;
      // Microseconds: the traces record seconds, and this keeps the text exact.
      j.arrival_s = std::round((*p.submit - base) * 1e6) / 1e6;
      j.model = o_.model;
      j.persistent_mb = o_.persistent_mb;
      j.ephemeral_mb = o_.ephemeral_mb;
      j.iter_ms = o_.iter_ms;
      j.iters = static_cast<std::uint64_t>(std::max(1.0, std::round(p.work * 1e3 / o_.iter_ms)));
      const double share = std::min(1.0, p.busy / p.work);
      j.util = std::clamp(o_.util * share, 1e-6, 1.0);
      if (share < 1.0 - 1e-9) ++summary_.fractional;
      if (p.gpus > 1.0 + 1e-9) ++summary_.multi_gpu;
      if (p.failed) ++summary_.failed_kept;
      summary_.gpu_seconds += p.work;
      res.jobs.push_back(std::move(j));
    }
    summary_.imported = res.jobs.size();
    summary_.users = users.size();
    res.summary = summary_;
    return res;
  }

 private:
  const ImportOptions& o_;
  ImportSummary summary_;
  std::vector<Pending> pending_;
  std::unordered_set<std::string> names_;
};

// Trace names become CSV fields.
std::string clean_name(std::string_view s) {
  std::string out(trim(s));
  for (char& c : out)
    if (c == ',' || c == '\n' || c == '\r' || c == '#') c = '_';
  return out;
}

enum class Outcome { ok, failed, unfinished };

Outcome classify(std::string_view status) {
  const std::string s = lower(trim(status));
  if (s == "failed" || s == "killed" || s == "cancelled" || s == "canceled" || s == "timeout" ||
      s == "node_fail" || s == "out_of_memory" || s == "preempted")
    return Outcome::failed;
  if (s == "running" || s == "waiting" || s == "pending" || s == "queued" || s == "submitted")
    return Outcome::unfinished;
  return Outcome::ok;  // Pass, Terminated, COMPLETED, Succeeded, and traces without one
}

// ---------------------------------------------------------------- CSV

std::vector<std::string_view> split_csv(std::string_view line, std::vector<std::string>& unquoted,
                                        std::size_t line_no) {
  std::vector<std::string_view> out;
  unquoted.clear();
  std::size_t i = 0;
  for (;;) {
    if (i < line.size() && line[i] == '"') {
      std::string v;
      for (++i;; ++i) {
        if (i >= line.size()) fail(line_no, "unterminated quoted field");
        if (line[i] == '"') {
          if (i + 1 < line.size() && line[i + 1] == '"') {
            v += '"';
            ++i;
            continue;
          }
          ++i;
          break;
        }
        v += line[i];
      }
      unquoted.push_back(std::move(v));
      out.emplace_back();  // replaced below, once `unquoted` stops moving
      if (i < line.size() && line[i] != ',')
        fail(line_no, fmt::format("text after a quoted field in column {}", out.size()));
    } else {
      const std::size_t comma = line.find(',', i);
      out.push_back(trim(line.substr(i, comma == std::string_view::npos ? comma : comma - i)));
      i = comma == std::string_view::npos ? line.size() : comma;
    }
    if (i >= line.size()) break;
    ++i;  // the comma
  }
  std::size_t q = 0;
  for (std::size_t c = 0; c < out.size(); ++c)
    if (out[c].data() == nullptr) out[c] = unquoted[q++];
  return out;
}

// Reads data rows, calling row(fields, line) for each; the first non-blank line goes to
// header(fields, line), which says whether it was a header.
template <typename Header, typename Row>
void read_csv(std::istream& in, Header header, Row row) {
  std::string line;
  std::vector<std::string> unquoted;
  std::size_t line_no = 0;
  bool first = true;
  while (std::getline(in, line)) {
    ++line_no;
    if (line_no == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);
    if (trim(line).empty()) continue;
    const std::vector<std::string_view> f = split_csv(line, unquoted, line_no);
    if (first) {
      first = false;
      if (header(f, line_no)) continue;
    }
    row(f, line_no);
  }
  if (in.bad()) throw TraceError(line_no, "read error");
}

// Column positions by name, for the formats whose header names them.
class Columns {
 public:
  Columns(const std::vector<std::string_view>& header, std::size_t line) : line_(line) {
    for (std::size_t i = 0; i < header.size(); ++i) names_.push_back(lower(header[i]));
  }
  std::optional<std::size_t> find(std::initializer_list<std::string_view> names) const {
    for (std::string_view n : names)
      for (std::size_t i = 0; i < names_.size(); ++i)
        if (names_[i] == n) return i;
    return std::nullopt;
  }
  std::size_t need(std::initializer_list<std::string_view> names, std::string_view what) const {
    if (auto i = find(names)) return *i;
    std::string list;
    for (std::string_view n : names) list += fmt::format("{}'{}'", list.empty() ? "" : ", ", n);
    fail(line_, fmt::format("the header has no column for {} (looked for {})", what, list));
  }
  std::size_t size() const { return names_.size(); }
  const std::string& name(std::size_t i) const { return names_[i]; }

 private:
  std::size_t line_;
  std::vector<std::string> names_;
};

struct Field {
  const std::vector<std::string_view>& f;
  std::size_t line;
  const std::vector<std::string>& names;
  std::string_view text(std::size_t c) const { return f[c]; }
  [[noreturn]] void bad(std::size_t c, std::string_view what) const {
    fail(line, fmt::format("column {} ({}): '{}' {}", c + 1, names[c], f[c], what));
  }
  std::optional<double> time(std::size_t c) const {
    try {
      return parse_trace_time(f[c]);
    } catch (const std::invalid_argument&) {
      bad(c, "is not a time (seconds, or YYYY-MM-DD HH:MM:SS)");
    }
  }
  // An empty field or NaN reads as 0 (the PAI tables leave CPU tasks' plan_gpu empty).
  double number(std::size_t c) const {
    const std::string l = lower(f[c]);
    if (f[c].empty() || l == "nan" || l == "none" || l == "null") return 0.0;
    try {
      const double v = number_or_throw(f[c]);
      if (v < 0) bad(c, "is negative");
      return v;
    } catch (const std::invalid_argument&) {
      bad(c, "is not a number");
    }
  }
};

void check_width(const std::vector<std::string_view>& f, std::size_t want, std::size_t line) {
  if (f.size() != want) fail(line, fmt::format("{} columns, the header has {}", f.size(), want));
}

// Helios' cluster_log.csv and Philly-derived job tables: one job per row.
void import_jobs_csv(std::istream& in, Collector& out) {
  std::optional<Columns> cols;
  std::size_t name = 0, submit = 0, gpus = 0;
  std::optional<std::size_t> duration, start, end, status, user;
  std::vector<std::string> names;
  read_csv(
      in,
      [&](const std::vector<std::string_view>& h, std::size_t line) {
        cols.emplace(h, line);
        name = cols->need({"job_id", "jobid", "job", "job_name", "name", "id"}, "the job's name");
        submit = cols->need(
            {"submit_time", "submitted_time", "arrival_s", "submit", "arrival", "creation_time"},
            "the submit time");
        gpus = cols->need({"gpu_num", "num_gpu", "num_gpus", "gpus", "gpu", "gpu_count"},
                          "the GPU count");
        duration = cols->find({"duration", "runtime", "run_time", "duration_s"});
        start = cols->find({"start_time", "started_time"});
        end = cols->find({"end_time", "finished_time", "finish_time"});
        status = cols->find({"state", "status"});
        user = cols->find({"user", "user_name", "username", "user_id"});
        if (!duration && !(start && end))
          fail(line, "the header has no 'duration' column and no 'start_time' and 'end_time'");
        for (std::size_t i = 0; i < cols->size(); ++i) names.push_back(cols->name(i));
        return true;
      },
      [&](const std::vector<std::string_view>& f, std::size_t line) {
        check_width(f, names.size(), line);
        const Field fd{f, line, names};
        Pending p;
        p.name = clean_name(f[name]);
        p.line = line;
        if (p.name.empty()) fd.bad(name, "is an empty job name");
        if (user) p.user = clean_name(f[*user]);
        p.submit = fd.time(submit);
        const Outcome o = status ? classify(f[*status]) : Outcome::ok;
        p.failed = o == Outcome::failed;
        if (o == Outcome::unfinished) p.skip = "not finished (running or waiting)";
        double seconds = 0;
        if (duration && !f[*duration].empty()) {
          seconds = fd.number(*duration);
        } else if (start && end) {
          const std::optional<double> s = fd.time(*start), e = fd.time(*end);
          if (!s || !e) {
            if (p.skip.empty()) p.skip = "never ran (no start or end time)";
          } else if (*e < *s) {
            fd.bad(*end, "is before the start time");
          } else {
            seconds = *e - *s;
          }
        }
        p.gpus = fd.number(gpus);
        p.work = seconds * p.gpus;
        p.busy = p.work;
        out.add(std::move(p));
      });
  if (!cols) throw TraceError(0, "the file is empty");
}

// Alibaba cluster-trace-gpu-v2023 openb_pod_list: one pod per row.
void import_openb(std::istream& in, Collector& out) {
  std::optional<Columns> cols;
  std::size_t name = 0, num_gpu = 0, gpu_milli = 0, phase = 0, created = 0, deleted = 0,
              scheduled = 0;
  std::vector<std::string> names;
  read_csv(
      in,
      [&](const std::vector<std::string_view>& h, std::size_t line) {
        cols.emplace(h, line);
        name = cols->need({"name"}, "the pod's name");
        num_gpu = cols->need({"num_gpu"}, "the GPU count");
        gpu_milli = cols->need({"gpu_milli"}, "the GPU share");
        phase = cols->need({"pod_phase"}, "the pod phase");
        created = cols->need({"creation_time"}, "the creation time");
        deleted = cols->need({"deletion_time"}, "the deletion time");
        scheduled = cols->need({"scheduled_time"}, "the scheduled time");
        for (std::size_t i = 0; i < cols->size(); ++i) names.push_back(cols->name(i));
        return true;
      },
      [&](const std::vector<std::string_view>& f, std::size_t line) {
        check_width(f, names.size(), line);
        const Field fd{f, line, names};
        Pending p;
        p.name = clean_name(f[name]);
        p.line = line;
        if (p.name.empty()) fd.bad(name, "is an empty pod name");
        p.submit = fd.time(created);
        const Outcome o = classify(f[phase]);
        p.failed = o == Outcome::failed;
        const std::optional<double> s = fd.time(scheduled), e = fd.time(deleted);
        if (!s) {
          p.skip = "never scheduled (Pending)";
        } else if (!e) {
          p.skip = "no deletion time";
        } else if (*e < *s) {
          fd.bad(deleted, "is before the scheduled time");
        }
        p.gpus = fd.number(num_gpu);
        // gpu_milli is the share of each GPU the pod holds: 1000 for whole GPUs.
        double share = fd.number(gpu_milli) / 1000.0;
        if (!(share > 0) || share > 1) share = 1;
        if (s && e && *e >= *s) {
          p.work = (*e - *s) * p.gpus;
          p.busy = p.work * share;
        }
        out.add(std::move(p));
      });
  if (!cols) throw TraceError(0, "the file is empty");
}

// Alibaba cluster-trace-gpu-v2020: tasks grouped into jobs by job_name. The published
// CSVs have no header line (it ships as a separate .header file), so the documented
// column order is the default and a header line, if present, is checked against it.
constexpr std::string_view kPaiTaskHeader =
    "job_name,task_name,inst_num,status,start_time,end_time,plan_cpu,plan_mem,plan_gpu,gpu_type";
constexpr std::string_view kPaiJobHeader = "job_name,inst_id,user,status,start_time,end_time";

std::vector<std::string> header_names(std::string_view header) {
  std::vector<std::string> out;
  std::vector<std::string> unquoted;
  for (std::string_view f : split_csv(header, unquoted, 0)) out.emplace_back(f);
  return out;
}

bool check_fixed_header(const std::vector<std::string_view>& f, std::size_t line,
                        std::string_view expected) {
  if (lower(f[0]) != "job_name") return false;
  const std::vector<std::string> want = header_names(expected);
  if (f.size() != want.size())
    fail(line, fmt::format("header has {} columns, expected {}", f.size(), expected));
  for (std::size_t i = 0; i < f.size(); ++i)
    if (lower(f[i]) != want[i])
      fail(line, fmt::format("header column {} is '{}', expected '{}' ({})", i + 1, f[i], want[i],
                             expected));
  return true;
}

// What the pai_job_table adds to a job: when it was submitted, and by whom.
struct PaiJob {
  std::optional<double> submit;
  std::string user;
};

std::unordered_map<std::string, PaiJob> read_pai_jobs(std::istream& in) {
  std::unordered_map<std::string, PaiJob> jobs;
  const std::vector<std::string> names = header_names(kPaiJobHeader);
  read_csv(
      in,
      [&](const std::vector<std::string_view>& f, std::size_t line) {
        return check_fixed_header(f, line, kPaiJobHeader);
      },
      [&](const std::vector<std::string_view>& f, std::size_t line) {
        if (f.size() != names.size())
          fail(line, fmt::format("pai_job_table: {} columns, expected {} ({})", f.size(),
                                 names.size(), kPaiJobHeader));
        const Field fd{f, line, names};
        jobs.emplace(clean_name(f[0]), PaiJob{fd.time(4), clean_name(f[2])});
      });
  return jobs;
}

void import_pai(std::istream& in, std::istream* jobs_table, Collector& out) {
  const std::unordered_map<std::string, PaiJob> table =
      jobs_table ? read_pai_jobs(*jobs_table) : std::unordered_map<std::string, PaiJob>{};
  const std::vector<std::string> names = header_names(kPaiTaskHeader);
  std::vector<Pending> jobs;
  std::unordered_map<std::string, std::size_t> index;
  read_csv(
      in,
      [&](const std::vector<std::string_view>& f, std::size_t line) {
        return check_fixed_header(f, line, kPaiTaskHeader);
      },
      [&](const std::vector<std::string_view>& f, std::size_t line) {
        if (f.size() != names.size())
          fail(line,
               fmt::format("{} columns, expected {} ({})", f.size(), names.size(), kPaiTaskHeader));
        const Field fd{f, line, names};
        const std::string name = clean_name(f[0]);
        if (name.empty()) fd.bad(0, "is an empty job name");
        auto [it, fresh] = index.emplace(name, jobs.size());
        if (fresh) {
          jobs.emplace_back();
          jobs.back().name = name;
          jobs.back().line = line;
        }
        Pending& p = jobs[it->second];
        const double share = fd.number(8) / 100.0;  // plan_gpu: percent of one GPU
        const double inst = fd.number(2);
        const Outcome o = classify(f[3]);
        const std::optional<double> s = fd.time(4), e = fd.time(5);
        if (s && (!p.submit || *s < *p.submit)) p.submit = s;
        if (!(share > 0) || !(inst > 0)) return;  // a CPU task (parameter server, ...)
        if (o == Outcome::unfinished || !s || !e) {
          p.skip = "not finished (running or waiting)";
          return;
        }
        if (*e < *s) fd.bad(5, "is before the start time");
        p.failed = p.failed || o == Outcome::failed;
        // Each instance holds `share` of a GPU, or share/100 whole GPUs above 100%.
        const double per_instance = std::max(share, 1.0);
        p.gpus += inst * per_instance;
        p.work += (*e - *s) * inst * per_instance;
        p.busy += (*e - *s) * inst * std::min(share, 1.0) * per_instance;
      });
  for (Pending& p : jobs) {
    if (auto it = table.find(p.name); it != table.end()) {
      if (it->second.submit) p.submit = it->second.submit;
      p.user = it->second.user;
    }
    out.add(std::move(p));
  }
}

// ---------------------------------------------------------------- JSON (Philly)

// The few JSON values a Philly job log holds.
struct Json {
  using Object = std::vector<std::pair<std::string, Json>>;
  using Array = std::vector<Json>;
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<Object>,
               std::shared_ptr<Array>>
      v;
  const Json* get(std::string_view key) const {
    if (auto* o = std::get_if<std::shared_ptr<Object>>(&v))
      for (const auto& [k, val] : **o)
        if (k == key) return &val;
    return nullptr;
  }
  const Array* array() const {
    auto* a = std::get_if<std::shared_ptr<Array>>(&v);
    return a ? a->get() : nullptr;
  }
  const std::string* string() const { return std::get_if<std::string>(&v); }
  bool is_null() const { return std::holds_alternative<std::nullptr_t>(v); }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : s_(text) {}

  // Calls element(value, line) for each element of the top-level array.
  template <typename F>
  void each_element(F element) {
    ws();
    expect('[');
    ws();
    if (peek() == ']') {
      ++i_;
      return end_of_document();
    }
    for (;;) {
      ws();
      const std::size_t line = line_;
      element(value(0), line);
      ws();
      const char c = next();
      if (c == ']') return end_of_document();
      if (c != ',')
        fail(line_, fmt::format("expected ',' or ']' after an array element, got {}", describe(c)));
    }
  }

 private:
  void end_of_document() {
    ws();
    if (i_ < s_.size()) fail(line_, "text after the end of the JSON array");
  }
  static std::string describe(char c) {
    return c == '\0' ? "the end of the file" : fmt::format("'{}'", c);
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  char next() { return i_ < s_.size() ? s_[i_++] : '\0'; }
  void ws() {
    for (; i_ < s_.size(); ++i_) {
      const char c = s_[i_];
      if (c == '\n')
        ++line_;
      else if (c != ' ' && c != '\t' && c != '\r')
        break;
    }
  }
  void expect(char want) {
    const char c = next();
    if (c != want) fail(line_, fmt::format("expected '{}', got {}", want, describe(c)));
  }
  Json value(int depth) {
    if (depth > 64) fail(line_, "JSON nested too deeply");
    ws();
    const char c = peek();
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return Json{string()};
    if (literal("null")) return Json{nullptr};
    if (literal("true")) return Json{true};
    if (literal("false")) return Json{false};
    if (literal("NaN")) return Json{nullptr};  // Python's json.dump writes NaN
    const std::size_t b = i_;
    while (i_ < s_.size() &&
           std::string_view("+-.0123456789eE").find(s_[i_]) != std::string_view::npos)
      ++i_;
    double v = 0;
    const auto [p, ec] = std::from_chars(s_.data() + b, s_.data() + i_, v);
    if (b == i_ || ec != std::errc() || p != s_.data() + i_)
      fail(line_, fmt::format("expected a JSON value, got {}", describe(c)));
    return Json{v};
  }
  bool literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) return false;
    i_ += word.size();
    return true;
  }
  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      const char c = next();
      if (c == '\0' && i_ >= s_.size()) fail(line_, "unterminated string");
      if (c == '"') return out;
      if (c == '\n') fail(line_, "line break inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char e = next();
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u':
          // Names and times are ASCII; anything else is kept as a placeholder.
          if (i_ + 4 > s_.size()) fail(line_, "truncated \\u escape");
          i_ += 4;
          out += '?';
          break;
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        default:
          fail(line_, fmt::format("bad escape \\{} in a string", e));
      }
    }
  }
  Json object(int depth) {
    expect('{');
    auto o = std::make_shared<Json::Object>();
    ws();
    if (peek() == '}') {
      ++i_;
      return Json{o};
    }
    for (;;) {
      ws();
      if (peek() != '"')
        fail(line_, fmt::format("expected a key in quotes, got {}", describe(peek())));
      std::string key = string();
      ws();
      expect(':');
      o->emplace_back(std::move(key), value(depth + 1));
      ws();
      const char c = next();
      if (c == '}') return Json{o};
      if (c != ',')
        fail(line_, fmt::format("expected ',' or '}}' in an object, got {}", describe(c)));
    }
  }
  Json array(int depth) {
    expect('[');
    auto a = std::make_shared<Json::Array>();
    ws();
    if (peek() == ']') {
      ++i_;
      return Json{a};
    }
    for (;;) {
      a->push_back(value(depth + 1));
      ws();
      const char c = next();
      if (c == ']') return Json{a};
      if (c != ',')
        fail(line_, fmt::format("expected ',' or ']' in an array, got {}", describe(c)));
    }
  }

  std::string_view s_;
  std::size_t i_ = 0;
  std::size_t line_ = 1;
};

std::optional<double> json_time(const Json* v, std::size_t line, std::string_view key) {
  if (!v || v->is_null()) return std::nullopt;
  if (const auto* d = std::get_if<double>(&v->v)) return *d;
  const std::string* s = v->string();
  if (!s) fail(line, fmt::format("{} is neither a string nor a number", key));
  try {
    return parse_trace_time(*s);
  } catch (const std::invalid_argument&) {
    fail(line, fmt::format("{} '{}' is not a time (YYYY-MM-DD HH:MM:SS)", key, *s));
  }
}

// One job of a Philly cluster_job_log: its GPU time is the sum over attempts of the
// attempt's span times the GPUs its machines' `gpus` lists name.
Pending philly_job(const Json& job, std::size_t line) {
  if (!std::holds_alternative<std::shared_ptr<Json::Object>>(job.v))
    fail(line, "a job must be a JSON object");
  Pending p;
  p.line = line;
  const Json* id = job.get("jobid");
  if (!id || !id->string() || id->string()->empty()) fail(line, "job without a \"jobid\" string");
  p.name = clean_name(*id->string());
  if (const Json* user = job.get("user"); user && user->string())
    p.user = clean_name(*user->string());
  p.submit = json_time(job.get("submitted_time"), line, "submitted_time");
  const Json* status = job.get("status");
  const Outcome o = status && status->string() ? classify(*status->string()) : Outcome::ok;
  p.failed = o == Outcome::failed;
  const Json* attempts = job.get("attempts");
  if (!attempts || !attempts->array())
    fail(line, fmt::format("job {}: no \"attempts\" array", p.name));
  bool ran = false;
  for (const Json& a : *attempts->array()) {
    const std::optional<double> s = json_time(a.get("start_time"), line, "start_time");
    const std::optional<double> e = json_time(a.get("end_time"), line, "end_time");
    double gpus = 0;
    if (const Json* detail = a.get("detail"); detail && detail->array())
      for (const Json& machine : *detail->array())
        if (const Json* g = machine.get("gpus"); g && g->array())
          gpus += static_cast<double>(g->array()->size());
    p.gpus = std::max(p.gpus, gpus);
    if (!s || !e) continue;
    if (*e < *s) fail(line, fmt::format("job {}: an attempt ends before it starts", p.name));
    ran = true;
    p.work += (*e - *s) * gpus;
  }
  p.busy = p.work;
  if (o == Outcome::unfinished)
    p.skip = "not finished (running or waiting)";
  else if (!ran)
    p.skip = "never ran (no attempt with a start and an end)";
  return p;
}

void import_philly(std::istream& in, Collector& out) {
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) throw TraceError(0, "read error");
  std::string_view view = text;
  if (view.starts_with("\xEF\xBB\xBF")) view.remove_prefix(3);
  JsonReader reader(view);
  reader.each_element([&](const Json& job, std::size_t line) { out.add(philly_job(job, line)); });
}

}  // namespace

ImportResult import_trace(std::istream& in, ImportFormat format, const ImportOptions& options,
                          std::istream* pai_jobs) {
  if (!(options.iter_ms >= 1e-6)) throw std::invalid_argument("iter_ms must be at least 1 ns");
  if (!(options.util > 0 && options.util <= 1))
    throw std::invalid_argument("util must be in (0, 1]");
  if (!(options.persistent_mb >= 0) || !(options.ephemeral_mb >= 0))
    throw std::invalid_argument("memory must not be negative");
  Collector out(options);
  switch (format) {
    case ImportFormat::philly:
      import_philly(in, out);
      break;
    case ImportFormat::jobs_csv:
      import_jobs_csv(in, out);
      break;
    case ImportFormat::pai:
      import_pai(in, pai_jobs, out);
      break;
    case ImportFormat::openb:
      import_openb(in, out);
      break;
  }
  return out.finish();
}

ImportResult import_trace_text(std::string_view text, ImportFormat format,
                               const ImportOptions& options,
                               std::optional<std::string_view> pai_jobs) {
  std::istringstream in{std::string(text)};
  if (!pai_jobs) return import_trace(in, format, options);
  std::istringstream jobs{std::string(*pai_jobs)};
  return import_trace(in, format, options, &jobs);
}

}  // namespace salus::sched
