// Shared plumbing of salus-bench: timing and percentiles, a salusd the bench
// starts on a temporary mount, sessions opened through /salus/clone, and the
// registry through which each bench_*.cpp adds its subcommands.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace salus::bench {

using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0);
// Nearest-rank percentile, p in [0, 1]; 0 for an empty sample.
double percentile(std::vector<double> v, double p);
double mean(const std::vector<double>& v);

[[noreturn]] void die(const std::string& why);
// One write(2) of the whole command text; dies on a short or failed write.
void write_all(int fd, const std::string& s);
// Like write_all, but returns the errno (0 on success) instead of dying.
int try_write(int fd, const std::string& s);
std::string read_file(const std::string& path);
long rss_kib(pid_t pid);

// A salusd this tool started; stopped and unmounted on destruction.
struct Daemon {
  pid_t pid = -1;
  std::string dir, mnt;
  // `args` follow the binary and `--mount DIR`, e.g. {"--backend", "sim"}.
  Daemon(const std::string& salusd, const std::vector<std::string>& args);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;
};

// A session opened through /salus/clone, ended when the fd closes.
struct Clone {
  int fd = -1;
  std::string id;
  std::string dir;  // MOUNT/sessions/ID
  explicit Clone(const std::string& mnt);
  ~Clone();
  Clone(const Clone&) = delete;
  Clone& operator=(const Clone&) = delete;
  // Writes a command and waits until everything queued so far has finished.
  void run_and_wait(const std::string& commands) const;
  std::string status() const;
};

// Blocks on sessions/ID/wait; dies unless it reports done.
void wait_done(const std::string& mnt, const std::string& id);
// The value of `key: value` in a status-like text, or "" if absent.
std::string field(const std::string& text, const std::string& key);

// Where the benchmarks find salusd: a running one (--mount) or one started here.
class Target {
 public:
  std::string mount;                          // --mount
  std::string salusd = "build/tools/salusd";  // --salusd
  std::string gpu_isolation;                  // --gpu-isolation; empty: salusd's default
  // Starts salusd with `args` unless --mount named a running one; returns the
  // mountpoint. A second call with other args restarts it.
  const std::string& start(const std::vector<std::string>& args);
  pid_t pid() const { return daemon_ ? daemon_->pid : -1; }
  void stop() { daemon_.reset(); }
  bool external() const { return external_; }

 private:
  std::unique_ptr<Daemon> daemon_;
  bool external_ = false;
  std::string started_mount_;
};

using BenchFn = std::function<int(Target&)>;
struct Registry {
  std::vector<std::pair<CLI::App*, BenchFn>> benches;
  void add(CLI::App* cmd, BenchFn fn) { benches.emplace_back(cmd, std::move(fn)); }
};

// Each bench_*.cpp adds its subcommands here.
void add_broker_benches(CLI::App& app, Registry& r);
void add_sched_benches(CLI::App& app, Registry& r);
void add_gpu_benches(CLI::App& app, Registry& r);
void add_dataplane_benches(CLI::App& app, Registry& r);
void add_soak_benches(CLI::App& app, Registry& r);
void add_gate_benches(CLI::App& app, Registry& r);
void add_backing_benches(CLI::App& app, Registry& r);
void add_census_benches(CLI::App& app, Registry& r);

}  // namespace salus::bench
