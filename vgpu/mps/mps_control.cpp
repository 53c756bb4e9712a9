// MpsControl: start, readiness check and bounded stop of one MPS control daemon.
#include "vgpu/mps/mps_control.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "vgpu/unique_fd.hpp"

extern char** environ;

namespace salus::vgpu {
namespace {

using Clock = std::chrono::steady_clock;

// The control daemon writes its pid here (as the real one does); the stand-in
// used by the tests does the same.
constexpr const char* kPidFile = "nvidia-cuda-mps-control.pid";

// Makes `path`. Its mode becomes 0755 whatever the umask (clients of other
// uids must reach the pipe) where salusd made it, and for the leaf always; a
// parent that already existed (/run, /tmp, ...) is never touched.
bool make_dir(const std::string& path, bool leaf, std::string& why) {
  const bool made = ::mkdir(path.c_str(), 0755) == 0;
  if (!made && errno != EEXIST) {
    why = fmt::format("cannot create {}: {}", path, std::strerror(errno));
    return false;
  }
  if (made || leaf) ::chmod(path.c_str(), 0755);
  return true;
}

bool make_dirs(const std::string& path, std::string& why) {
  for (std::size_t i = 1; i <= path.size(); ++i)
    if ((i == path.size() || path[i] == '/') && !make_dir(path.substr(0, i), i == path.size(), why))
      return false;
  return true;
}

pid_t read_pid(const std::string& pipe_dir) {
  std::ifstream in(pipe_dir + "/" + kPidFile);
  long pid = -1;
  if (!(in >> pid) || pid <= 1) return -1;
  return static_cast<pid_t>(pid);
}

// A killed daemon stays a zombie until its new parent (init or a subreaper)
// reaps it: that counts as gone.
bool pid_alive(pid_t pid) {
  if (pid <= 1 || (::kill(pid, 0) != 0 && errno != EPERM)) return false;
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::getline(in, stat);
  const auto paren = stat.rfind(") ");
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

struct Outcome {
  int rc = -1;  // exit status; -1: did not finish in time (killed) or not started
  std::string output;
};

// Runs the control program with `args`, `input` on its stdin and the daemon's
// environment, up to `bound`; kills it past that.
Outcome run_control(const MpsOptions& o, const std::string& pipe_dir, const std::string& log_dir,
                    const std::vector<std::string>& args, const std::string& input,
                    Clock::duration bound) {
  Outcome out;
  int in_p[2], out_p[2];
  if (::pipe2(in_p, O_CLOEXEC) != 0) return out;
  UniqueFd in_r(in_p[0]), in_w(in_p[1]);
  if (::pipe2(out_p, O_CLOEXEC) != 0) return out;
  UniqueFd out_r(out_p[0]), out_w(out_p[1]);
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    const std::string v = *e;
    if (v.rfind("CUDA_VISIBLE_DEVICES=", 0) && v.rfind("CUDA_MPS_", 0)) env_s.push_back(v);
  }
  env_s.push_back("CUDA_VISIBLE_DEVICES=" + o.visible);
  env_s.push_back("CUDA_MPS_PIPE_DIRECTORY=" + pipe_dir);
  env_s.push_back("CUDA_MPS_LOG_DIRECTORY=" + log_dir);
  std::vector<char*> envp, argv{const_cast<char*>(o.executable.c_str())};
  for (auto& v : env_s) envp.push_back(v.data());
  envp.push_back(nullptr);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in_r.get(), 0);
  posix_spawn_file_actions_adddup2(&fa, out_w.get(), 1);
  posix_spawn_file_actions_adddup2(&fa, out_w.get(), 2);
  pid_t pid = -1;
  const int err =
      ::posix_spawnp(&pid, o.executable.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) {
    out.output = fmt::format("cannot run {}: {}", o.executable, std::strerror(err));
    return out;
  }
  in_r.reset();
  out_w.reset();
  if (!input.empty()) (void)!::write(in_w.get(), input.data(), input.size());
  in_w.reset();
  // The daemonised grandchild may keep stdout open: read until the child
  // exits or the bound passes, never until EOF alone.
  const auto deadline = Clock::now() + bound;
  int status = 0;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) {  // reaped elsewhere: its status is lost
      out.output += fmt::format("(lost its status: {})", std::strerror(errno));
      return out;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      out.output +=
          fmt::format("(no answer within {} ms)",
                      std::chrono::duration_cast<std::chrono::milliseconds>(bound).count());
      return out;
    }
    pollfd p{out_r.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long>(left.count(), 20))) > 0) {
      char buf[512];
      const ssize_t n = ::read(out_r.get(), buf, sizeof buf);
      if (n > 0 && out.output.size() < 4096) out.output.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::fcntl(out_r.get(), F_SETFL, O_NONBLOCK);
  char buf[512];
  for (ssize_t n; (n = ::read(out_r.get(), buf, sizeof buf)) > 0 && out.output.size() < 4096;)
    out.output.append(buf, static_cast<std::size_t>(n));
  out.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "no output" : s;
}

}  // namespace

std::unique_ptr<MpsControl> MpsControl::start(const MpsOptions& o, std::string& why) {
  const std::string pipe_dir = o.dir + "/pipe", log_dir = o.dir + "/log";
  if (!make_dirs(pipe_dir, why) || !make_dirs(log_dir, why)) return nullptr;
  const auto deadline = Clock::now() + o.ready_bound;
  // A daemon left in this (salusd-owned) directory by a salusd that was killed
  // is taken over, so that the programs using its server survive the restart.
  if (const pid_t old = read_pid(pipe_dir); pid_alive(old)) {
    const Outcome q = run_control(o, pipe_dir, log_dir, {}, "get_server_list\n", o.ready_bound);
    if (q.rc == 0) {
      std::unique_ptr<MpsControl> c(new MpsControl(o, pipe_dir, log_dir, old));
      c->adopted_ = true;
      return c;
    }
    why = fmt::format("an MPS control daemon (pid {}) holds {} but does not answer ({}); stop it",
                      old, pipe_dir, trimmed(q.output));
    return nullptr;
  }
  const Outcome d = run_control(o, pipe_dir, log_dir, {"-d"}, "", o.ready_bound);
  if (d.rc != 0) {
    why =
        fmt::format("{} -d failed ({}): {}", o.executable,
                    d.rc < 0 ? "not run" : fmt::format("exit status {}", d.rc), trimmed(d.output));
    return nullptr;
  }
  // Ready when the control pipe exists and answers.
  Outcome q;
  while (Clock::now() < deadline) {
    struct stat st {};
    if (::stat((pipe_dir + "/control").c_str(), &st) == 0 && S_ISFIFO(st.st_mode)) {
      q = run_control(o, pipe_dir, log_dir, {}, "get_server_list\n", deadline - Clock::now());
      if (q.rc == 0) {
        std::unique_ptr<MpsControl> c(new MpsControl(o, pipe_dir, log_dir, read_pid(pipe_dir)));
        return c;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  why = fmt::format("the MPS control daemon did not answer within {} ms ({}); see {}/control.log",
                    o.ready_bound.count(),
                    q.rc < 0 && q.output.empty() ? "no control pipe" : trimmed(q.output), log_dir);
  if (const pid_t p = read_pid(pipe_dir); pid_alive(p)) ::kill(p, SIGKILL);
  return nullptr;
}

bool MpsControl::alive() const {
  if (stopped_) return false;
  if (pid_ > 1) return pid_alive(pid_);
  struct stat st {};
  return ::stat((pipe_dir_ + "/control").c_str(), &st) == 0;
}

std::string MpsControl::stop() {
  if (stopped_) return "already stopped";
  if (!alive()) {
    stopped_ = true;
    return fmt::format(
        "the MPS control daemon (pid {}) had already exited: it crashed or was "
        "stopped by someone else; see {}/control.log",
        pid_, log_dir_);
  }
  const auto deadline = Clock::now() + o_.stop_bound;
  const Outcome q = run_control(o_, pipe_dir_, log_dir_, {}, "quit\n", o_.stop_bound);
  while (Clock::now() < deadline && alive())
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const bool gone = !alive();
  stopped_ = true;
  if (gone) return fmt::format("the MPS control daemon (pid {}) quit", pid_);
  if (pid_ > 1) ::kill(pid_, SIGKILL);
  return fmt::format("the MPS control daemon (pid {}) did not quit within {} ms ({}); killed it",
                     pid_, o_.stop_bound.count(), trimmed(q.output));
}

MpsControl::~MpsControl() {
  stop();
}

}  // namespace salus::vgpu
