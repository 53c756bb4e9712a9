#include "tools/salus_bench/bench_common.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>
#include <utility>

#include <fmt/format.h>

namespace salus::bench {

namespace fs = std::filesystem;

// The daemon alive now, so die() can stop and unmount it: exit() runs no
// destructors of locals.
Daemon* live_daemon = nullptr;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

void die(const std::string& why) {
  std::fprintf(stderr, "salus-bench: %s\n", why.c_str());
  if (Daemon* d = std::exchange(live_daemon, nullptr)) d->~Daemon();
  std::exit(1);
}

int try_write(int fd, const std::string& s) {
  const ssize_t n = ::write(fd, s.data(), s.size());
  if (n == static_cast<ssize_t>(s.size())) return 0;
  return n < 0 ? errno : EIO;
}

void write_all(int fd, const std::string& s) {
  if (const int err = try_write(fd, s))
    die(fmt::format("write '{}': {}", s.substr(0, s.find('\n')), std::strerror(err)));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

long rss_kib(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      long v;
      in >> v;
      return v;
    }
    in.ignore(1 << 12, '\n');
  }
  return -1;
}

Daemon::Daemon(const std::string& salusd, const std::vector<std::string>& extra) {
  char tmpl[] = "/tmp/salus-bench-XXXXXX";
  if (!::mkdtemp(tmpl)) die("mkdtemp failed");
  dir = tmpl;
  mnt = dir + "/mnt";
  ::chmod(dir.c_str(), 0755);  // other uids (salus-bench soak --uids) reach the mount
  ::mkdir(mnt.c_str(), 0755);
  const std::string log = dir + "/salusd.log";
  pid = ::fork();
  if (pid == 0) {
    // Its named sessions are saved in its own temp dir, never in /var/lib/salus.
    std::vector<std::string> args = {salusd, "--mount", mnt, "--state-dir", dir + "/state"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execv(argv[0], argv.data());
    std::_Exit(127);
  }
  live_daemon = this;
  // A CUDA start-up (context, arena, calibration) takes seconds; allow 60.
  for (int i = 0; i < 6000; ++i) {
    if (fs::exists(mnt + "/version")) return;
    int st;
    if (::waitpid(pid, &st, WNOHANG) == pid) {
      pid = -1;
      die("salusd exited during start-up:\n" + read_file(log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  die("salusd did not mount:\n" + read_file(log));
}

Daemon::~Daemon() {
  if (live_daemon == this) live_daemon = nullptr;
  if (pid > 0) {
    ::kill(pid, SIGTERM);
    int st;
    ::waitpid(pid, &st, 0);
  }
  std::system(fmt::format("fusermount3 -u -z {} 2>/dev/null", mnt).c_str());
  fs::remove_all(dir);
}

Clone::Clone(const std::string& mnt) {
  fd = ::open((mnt + "/clone").c_str(), O_RDWR);
  if (fd < 0) die(fmt::format("open clone: {}", std::strerror(errno)));
  char buf[64];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  if (n <= 0) die("read clone id");
  id.assign(buf, static_cast<std::size_t>(n) - 1);
  dir = fmt::format("{}/sessions/{}", mnt, id);
}

Clone::~Clone() {
  if (fd >= 0) ::close(fd);
}

void Clone::run_and_wait(const std::string& commands) const {
  write_all(fd, commands);
  const std::string text = read_file(dir + "/wait");
  if (text.rfind("done", 0) != 0) die(fmt::format("session {}: {}", id, text));
}

std::string Clone::status() const {
  return read_file(dir + "/status");
}

void wait_done(const std::string& mnt, const std::string& id) {
  const std::string text = read_file(fmt::format("{}/sessions/{}/wait", mnt, id));
  if (text.rfind("done", 0) != 0) die("wait failed: " + text);
}

std::string field(const std::string& text, const std::string& key) {
  const std::string k = key + ":";
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t eol = std::min(text.find('\n', pos), text.size());
    if (text.compare(pos, k.size(), k) == 0) {
      std::size_t v = pos + k.size();
      while (v < eol && text[v] == ' ') ++v;
      return text.substr(v, eol - v);
    }
    pos = eol + 1;
  }
  return "";
}

const std::string& Target::start(const std::vector<std::string>& args) {
  if (!mount.empty()) {
    external_ = true;
    return mount;
  }
  daemon_.reset();  // one at a time: a restart with other flags replaces it
  std::vector<std::string> all = args;
  if (!gpu_isolation.empty()) {
    all.push_back("--gpu-isolation");
    all.push_back(gpu_isolation);
  }
  daemon_ = std::make_unique<Daemon>(salusd, all);
  started_mount_ = daemon_->mnt;
  return started_mount_;
}

}  // namespace salus::bench
