// Starting and reaping executor processes: fork + exec of salusd itself with
// only the socket and the staging memfd inherited, and the staging memfd itself.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace salus::vgpu::executor {

struct ExecutorProcess {
  pid_t pid = -1;
  int socket = -1;  // salusd's end of the SOCK_SEQPACKET pair, O_CLOEXEC
};

// A memfd of `bytes` (sealed against shrinking, so a mapping can never fault on
// a truncated file). Returns the fd (O_CLOEXEC), or -1 with a reason.
int create_staging(std::uint64_t bytes, std::string& why);

// Forks and execs `exe` with `args` (argv[1..]), the child's end of a fresh
// socketpair at fd 3 and `staging_fd` at fd 4, every other fd above 2 closed,
// the signal mask cleared, and SIGKILL as its parent-death signal (so it never
// outlives the thread that spawned it). Exec, not a bare fork: forking a
// multi-threaded process that may have touched CUDA is unsafe. Returns 0, or an
// errno with a reason.
int spawn_executor(const std::string& exe, const std::vector<std::string>& args, int staging_fd,
                   ExecutorProcess& out, std::string& why);

// Waits up to `grace` for `pid` to exit, then SIGKILLs and waits. Returns the
// wait status, or -1 if the child could not be waited for.
int reap_executor(pid_t pid, std::chrono::milliseconds grace);
// "exited with status 3", "killed by SIGSEGV (Segmentation fault)".
std::string describe_wait_status(int status);
// Whether a wait status is a crash a kernel can cause (SIGSEGV, SIGBUS,
// SIGILL, SIGFPE, SIGABRT, SIGTRAP), as opposed to being killed from outside.
bool is_crash(int status);

}  // namespace salus::vgpu::executor
