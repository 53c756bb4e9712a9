// The executor process: salusd re-executed with hidden flags, owning one GPU
// (cuda, or sim for tests) and serving salusd's requests over a socket, so that a
// context a kernel poisons dies with this process and not with salusd.
#pragma once

#include <string>
#include <vector>

#include "vgpu/device.hpp"

namespace salus::vgpu::executor {

// What an executor is started with; salusd turns it into flags (to_args) and
// the executor parses them back (parse).
struct ExecutorOptions {
  int gpu = 0;                        // --executor-gpu: the CUDA ordinal (cuda) or sim index
  std::string backend = "sim";        // --backend: cuda or sim
  Bytes sim_memory = Bytes{1} << 30;  // --sim-memory (bytes)
  double cuda_memory_fraction = 0.9;  // --cuda-memory-fraction
  bool cuda_back_on_demand = true;    // --cuda-arena on-demand|up-front
  Bytes arena_bytes = 0;              // --executor-arena-size: exact arena (0: by fraction)
  std::string log_level = "info";     // --log-level
  int socket_fd = 3;                  // --executor-fd: the SOCK_SEQPACKET end
  int staging_fd = 4;                 // --executor-staging-fd: the shared staging memfd
  Bytes staging_size = 0;             // --executor-staging-size

  std::vector<std::string> to_args() const;
};

// True when argv asks for an executor (its first argument is --executor-gpu);
// salusd checks this before parsing its own flags.
bool is_executor_invocation(int argc, char** argv);
// Parses the executor flags; false with a reason for anything unexpected.
bool parse_executor_args(int argc, char** argv, ExecutorOptions& out, std::string& why);

// The executor's main: opens the device, sends the hello, serves requests until
// salusd says shutdown or goes away. Returns the process exit code; on a sticky
// CUDA fault it does not return but _exits with kExitStickyFault once the fault
// report and the errored completions are out.
int run_executor(const ExecutorOptions& options);
// salusd's entry point for `salusd --executor-gpu ...`.
int executor_main(int argc, char** argv);

constexpr int kExitStickyFault = 3;
constexpr int kExitNoDevice = 4;

}  // namespace salus::vgpu::executor
