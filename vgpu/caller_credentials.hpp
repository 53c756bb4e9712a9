// Who a session's caller is, captured once from /proc when a write arrives (uid,
// gid, supplementary groups, umask, root directory), and the per-thread switch to
// those credentials under which salusd touches the caller's files.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace salus::vgpu {

struct CallerIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;  // resolves the caller's root; 0 means this process's root
};

struct CallerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups, as the kernel has them for the process
  mode_t umask = 022;         // for files created on the caller's behalf
  pid_t pid = 0;

  // Reads the groups and umask of `who.pid` from /proc (this process's when pid
  // is 0). A process that is gone leaves no groups and the umask 022.
  static CallerCredentials capture(const CallerIdentity& who);
  // "/proc/PID/root", or "/" for pid 0.
  std::string root_path() const;
};

// Takes on the caller's filesystem identity for the calling thread only
// (setfsuid/setfsgid and the raw setgroups syscall; glibc's setgroups() would
// change every thread), and restores salusd's on destruction.
class ThreadCredentials {
 public:
  explicit ThreadCredentials(const CallerCredentials& who);
  ~ThreadCredentials();
  ThreadCredentials(const ThreadCredentials&) = delete;
  ThreadCredentials& operator=(const ThreadCredentials&) = delete;
  // False when the kernel did not take the ids: nothing must be opened then.
  bool ok() const { return ok_; }

 private:
  std::vector<gid_t> saved_groups_;
  bool ok_ = false;
};

}  // namespace salus::vgpu
