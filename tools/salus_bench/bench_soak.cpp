// salus-bench soak: several uids drive a mix of everything a user can do to
// /salus (clone and named sessions, work, mem/ files, polls, reads of the views,
// malformed commands, abandoned sessions) for a fixed time, and the bench reports
// the operation rate, the errors no correct daemon should give, salusd's RSS
// growth and whether every session it made is gone afterwards.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "tools/salus_bench/bench_common.hpp"

namespace salus::bench {
namespace {

namespace fs = std::filesystem;

constexpr const char* kVictim = "soak-victim";  // a session of the bench's own uid

struct Counts {
  std::uint64_t ops = 0;         // actions completed
  std::uint64_t writes = 0;      // command writes
  std::uint64_t expected = 0;    // errors the action asked for (bad input, another uid's session)
  std::uint64_t unexpected = 0;  // anything else that failed
  char first[160] = {};          // the first unexpected error
};

class Worker {
 public:
  Worker(std::string mnt, uid_t uid, unsigned seed) : mnt_(std::move(mnt)), uid_(uid), rng_(seed) {}

  Counts run(Clock::time_point deadline) {
    static constexpr void (Worker::*kActions[])() = {
        &Worker::clone_work, &Worker::clone_work, &Worker::named,
        &Worker::views,      &Worker::bad_input,  &Worker::poll_status,
        &Worker::abandon,    &Worker::mem_files,  &Worker::cross_uid};
    // A worker that only fails measures nothing: it stops after 1,000 failures.
    while (Clock::now() < deadline && c_.unexpected < 1000) {
      (this->*kActions[rng_() % std::size(kActions)])();
      ++c_.ops;
    }
    return c_;
  }

 private:
  void fail(const std::string& what, int err) {
    if (c_.unexpected++ == 0)
      std::snprintf(c_.first, sizeof c_.first, "uid %u: %s: %s", uid_, what.c_str(),
                    std::strerror(err));
  }
  // A write that must succeed (or, with `want`, fail with exactly that errno).
  void write(int fd, const std::string& text, int want = 0) {
    ++c_.writes;
    const int err = try_write(fd, text);
    if (err == want)
      c_.expected += want != 0;
    else
      fail(fmt::format("write '{}'", text.substr(0, text.find('\n'))), err ? err : EINVAL);
  }
  int open_clone(std::string& id) {
    const int fd = ::open((mnt_ + "/clone").c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      fail("open clone", errno);
      return -1;
    }
    char buf[64];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 1) {
      fail("read clone id", n < 0 ? errno : EIO);
      ::close(fd);
      return -1;
    }
    id.assign(buf, static_cast<std::size_t>(n) - 1);
    return fd;
  }
  void read_path(const std::string& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail("open " + p.substr(mnt_.size()), errno);
    char buf[8192];
    while (::read(fd, buf, sizeof buf) > 0) {
    }
    ::close(fd);
  }

  // need, a persistent buffer, a few iterations, wait, status.
  void clone_work() {
    std::string id;
    const int fd = open_clone(id);
    if (fd < 0) return;
    write(fd, "need persistent=4M ephemeral=1M iters=10\nalloc w 64K\nfill w 1.5\n");
    write(fd, fmt::format("begin\nalloc t 64K\nfill t {} dtype=u8\ncopy w t 4K\nspin {}\nend x{}\n",
                          rng_() % 256, rng_() % 200, 1 + rng_() % 4));
    read_path(fmt::format("{}/sessions/{}/wait", mnt_, id));
    read_path(fmt::format("{}/sessions/{}/status", mnt_, id));
    ::close(fd);
  }
  // mkdir, a command, the log, rmdir.
  void named() {
    const std::string dir = fmt::format("{}/sessions/soak-{}-{}-{}", mnt_, uid_, ::getpid(), n_++);
    if (::mkdir(dir.c_str(), 0700) != 0) return fail("mkdir a named session", errno);
    const int fd = ::open((dir + "/ctl").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      write(fd, "need persistent=1M ephemeral=1M\nalloc a 4K\n");
      ::close(fd);
    } else {
      fail("open ctl", errno);
    }
    read_path(dir + "/log");
    if (::rmdir(dir.c_str()) != 0) fail("rmdir a named session", errno);
  }
  void views() {
    read_path(mnt_ + "/stats");
    read_path(mnt_ + "/gpus/0/info");
    read_path(mnt_ + "/gpus/0/lanes");
    std::error_code ec;
    for (auto it = fs::directory_iterator(mnt_ + "/sessions", ec); !ec && it != fs::end(it);
         it.increment(ec)) {
    }
  }
  // Malformed or refused commands: each must fail with its errno, nothing else.
  void bad_input() {
    std::string id;
    const int fd = open_clone(id);
    if (fd < 0) return;
    write(fd, "alloc\n", EINVAL);
    write(fd, "frobnicate 12\n", EINVAL);
    write(fd, "fill nope 1\n", ENXIO);  // no need yet: no GPU
    write(fd, std::string("\xff\xfe garbage\n"), EINVAL);
    ::close(fd);
  }
  void poll_status() {
    std::string id;
    const int fd = open_clone(id);
    if (fd < 0) return;
    const int st = ::open(fmt::format("{}/sessions/{}/status", mnt_, id).c_str(), O_RDONLY);
    if (st >= 0) {
      pollfd p{st, POLLIN | POLLPRI, 0};
      char buf[4096];
      for (int i = 0; i < 8; ++i) {
        ::pread(st, buf, sizeof buf, 0);
        ::poll(&p, 1, 1);
      }
      ::close(st);
    }
    ::close(fd);
  }
  // Queues long work and closes without waiting: the session must still end.
  void abandon() {
    std::string id;
    const int fd = open_clone(id);
    if (fd < 0) return;
    write(fd, "need persistent=1M ephemeral=1M\nbegin\nspin 5000\nend x20\n");
    ::close(fd);
  }
  // Another uid's session (the bench's own, made before the workers): its ctl
  // and mem/ must stay closed to every uid but root.
  void cross_uid() {
    if (uid_ == 0) return;
    for (const char* f : {"ctl", "mem/v"}) {
      const std::string p = fmt::format("{}/sessions/{}/{}", mnt_, kVictim, f);
      const int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0) {
        ::close(fd);
        fail(fmt::format("open another uid's {}", f), EEXIST);
      } else if (errno == EACCES) {
        ++c_.expected;
      } else {
        fail(fmt::format("open another uid's {}", f), errno);
      }
    }
  }
  void mem_files() {
    std::string id;
    const int fd = open_clone(id);
    if (fd < 0) return;
    write(fd, "need persistent=2M ephemeral=1M\nalloc b 256K\n");
    const std::string p = fmt::format("{}/sessions/{}/mem/b", mnt_, id);
    const int m = ::open(p.c_str(), O_RDWR | O_CLOEXEC);
    if (m >= 0) {
      std::string data(4096, static_cast<char>(rng_()));
      std::string back(4096, '\0');
      if (::pwrite(m, data.data(), data.size(), 8192) != 4096) fail("pwrite mem/b", errno);
      if (::pread(m, back.data(), back.size(), 8192) != 4096 || back != data)
        fail("pread mem/b", errno ? errno : EIO);
      ::close(m);
    } else {
      fail("open mem/b", errno);
    }
    ::close(fd);
  }

  std::string mnt_;
  uid_t uid_;
  std::mt19937 rng_;
  Counts c_;
  unsigned n_ = 0;
};

std::vector<uid_t> parse_uids(const std::string& text) {
  std::vector<uid_t> out;
  std::stringstream in(text);
  std::string tok;
  while (std::getline(in, tok, ','))
    if (!tok.empty()) out.push_back(static_cast<uid_t>(std::stoul(tok)));
  if (out.empty()) out.push_back(::geteuid());
  return out;
}

// Runs one worker in a child process as `uid`; its counts come back on `out`.
pid_t spawn(const std::string& mnt, uid_t uid, unsigned seed, Clock::time_point deadline, int out) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (::geteuid() == 0 && uid != 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) std::_Exit(3);
  }
  const Counts c = Worker(mnt, uid, seed).run(deadline);
  const bool ok = ::write(out, &c, sizeof c) == static_cast<ssize_t>(sizeof c);
  std::_Exit(ok ? 0 : 4);
}

std::size_t count_sessions(const std::string& mnt) {
  std::size_t n = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator(mnt + "/sessions", ec); !ec && it != fs::end(it);
       it.increment(ec))
    ++n;
  return n;
}

int bench_soak(Target& t, double seconds, const std::string& uid_list, int per_uid) {
  const std::string& mnt = t.start({"--backend", "sim", "--log-level", "warn", "--sim-memory", "4G",
                                    "--quota-sessions", "100000"});
  const auto uids = parse_uids(uid_list);
  if (::geteuid() != 0 && (uids.size() > 1 || uids[0] != ::geteuid()))
    die("--uids other than your own need root");
  const std::string victim = fmt::format("{}/sessions/{}", mnt, kVictim);
  if (::mkdir(victim.c_str(), 0700) != 0) die("mkdir " + victim + ": " + std::strerror(errno));
  {
    const int fd = ::open((victim + "/ctl").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0 || try_write(fd, "need persistent=1M ephemeral=1M\nalloc v 4K\n") != 0)
      die("could not set up " + victim);
    ::close(fd);
  }
  const std::size_t sessions_before = count_sessions(mnt);
  const long rss0 = t.pid() > 0 ? rss_kib(t.pid()) : -1;
  int pipefd[2];
  if (::pipe(pipefd) != 0) die("pipe");
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(static_cast<long>(seconds * 1000));
  std::vector<pid_t> kids;
  unsigned seed = 1;
  for (uid_t uid : uids)
    for (int i = 0; i < per_uid; ++i) kids.push_back(spawn(mnt, uid, seed++, deadline, pipefd[1]));
  ::close(pipefd[1]);
  long peak = rss0;
  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (t.pid() > 0) peak = std::max(peak, rss_kib(t.pid()));
  }
  Counts total;
  std::string first;
  int failed_workers = 0;
  for (pid_t k : kids) {
    Counts c;
    if (::read(pipefd[0], &c, sizeof c) == static_cast<ssize_t>(sizeof c)) {
      total.ops += c.ops;
      total.writes += c.writes;
      total.expected += c.expected;
      total.unexpected += c.unexpected;
      if (first.empty() && c.first[0]) first = c.first;
    }
    int st = 0;
    ::waitpid(k, &st, 0);
    failed_workers += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  ::close(pipefd[0]);
  const double secs = us_since(t0) / 1e6;
  // Abandoned sessions end once their in-flight work drains (milliseconds).
  std::size_t left = count_sessions(mnt);
  for (int i = 0; i < 100 && left > sessions_before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    left = count_sessions(mnt);
  }
  const long rss1 = t.pid() > 0 ? rss_kib(t.pid()) : -1;
  ::rmdir(victim.c_str());
  const bool alive = t.pid() <= 0 || ::kill(t.pid(), 0) == 0;
  fmt::print("soak seconds={:.1f} uids={} workers={}\n", secs, uid_list, kids.size());
  fmt::print("  operations        {:>10}  {:>10.0f}/s\n", total.ops, total.ops / secs);
  fmt::print("  command writes    {:>10}  {:>10.0f}/s\n", total.writes, total.writes / secs);
  fmt::print("  expected errors   {:>10}  (malformed input, refused on purpose)\n", total.expected);
  fmt::print("  unexpected errors {:>10}  {}\n", total.unexpected, first);
  if (rss0 >= 0)
    fmt::print("  salusd RSS        start {} KiB, peak {} KiB, end {} KiB: growth {} KiB\n", rss0,
               peak, rss1, rss1 - rss0);
  fmt::print("  sessions left     {} (before: {})\n", left, sessions_before);
  fmt::print("  salusd            {}\n", alive ? "alive" : "GONE");
  return total.unexpected == 0 && failed_workers == 0 && left == sessions_before && alive ? 0 : 1;
}

}  // namespace

void add_soak_benches(CLI::App& app, Registry& r) {
  auto* soak = app.add_subcommand(
      "soak", "Mixed commands from several uids for a fixed time: rate, errors, RSS growth");
  static double seconds = 60;
  static std::string uids;
  static int per_uid = 4;
  soak->add_option("--seconds", seconds, "How long to run (default 60)");
  soak->add_option("--uids", uids, "Comma-separated uids to act as (root only; default: yours)");
  soak->add_option("--workers", per_uid, "Worker processes per uid (default 4)");
  r.add(soak, [](Target& t) {
    return bench_soak(t, seconds, uids.empty() ? std::to_string(::geteuid()) : uids, per_uid);
  });
}

}  // namespace salus::bench
