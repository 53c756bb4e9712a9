// MpsControl: one NVIDIA MPS control daemon (nvidia-cuda-mps-control -d) that
// salusd starts for one GPU at startup and stops at shutdown, so that the
// attached sessions placed on that GPU run concurrently (one MPS server, one
// shared context) instead of time-slicing between their own contexts.
//
// Each daemon gets its own pipe and log directory under a salusd-owned runtime
// directory and sees only its GPU (CUDA_VISIBLE_DEVICES=<uuid>). Everything here
// runs outside FUSE threads: start() and stop() are bounded in time, and
// alive() is one kill(pid, 0), cheap enough for a gpus/N/info read.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>

namespace salus::vgpu {

struct MpsOptions {
  std::string executable = "nvidia-cuda-mps-control";  // found on PATH
  std::string dir;      // this GPU's runtime dir: <dir>/pipe and <dir>/log
  std::string visible;  // CUDA_VISIBLE_DEVICES for the daemon: UUID or index
  std::chrono::milliseconds ready_bound{10000};
  std::chrono::milliseconds stop_bound{5000};
};

class MpsControl {
 public:
  // Starts the daemon and waits (up to ready_bound) until its control pipe
  // answers get_server_list, or takes over one that already answers there.
  // Null with `why` when neither.
  static std::unique_ptr<MpsControl> start(const MpsOptions& o, std::string& why);
  // stop(), bounded.
  ~MpsControl();
  MpsControl(const MpsControl&) = delete;
  MpsControl& operator=(const MpsControl&) = delete;

  // Sends `quit` and waits up to stop_bound for the daemon to exit, then kills
  // it. Returns what happened, for the log. Idempotent.
  std::string stop();

  // Whether the daemon still runs; false after stop() or when it crashed.
  bool alive() const;
  pid_t pid() const { return pid_; }
  // Whether start() found this daemon already running in its directory (left
  // by a salusd that was killed) and took it over instead of starting one.
  bool adopted() const { return adopted_; }
  const std::string& pipe_directory() const { return pipe_dir_; }
  const std::string& log_directory() const { return log_dir_; }

 private:
  MpsControl(MpsOptions o, std::string pipe_dir, std::string log_dir, pid_t pid)
      : o_(std::move(o)), pipe_dir_(std::move(pipe_dir)), log_dir_(std::move(log_dir)), pid_(pid) {}

  MpsOptions o_;
  std::string pipe_dir_, log_dir_;
  pid_t pid_ = -1;
  bool stopped_ = false;
  bool adopted_ = false;
};

}  // namespace salus::vgpu
