// Who a session's caller is, captured once from /proc when a write arrives (uid,
// gid, supplementary groups, umask, capabilities, root directory), and the
// per-thread switch to those credentials under which salusd touches the caller's
// files: the caller's fsuid, fsgid and groups, and no capability of salusd's that
// the caller's own process lacks, so that salusd is never a confused deputy.
#pragma once

#include <sys/types.h>

#include <cstdint>
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
  // The effective capabilities (bit N = capability N) held while acting as the
  // caller: the caller's own, when it lives in salusd's user namespace (a
  // capability of another namespace grants nothing here); otherwise none.
  std::uint64_t caps = 0;
  // Set by capture when nothing may be done as this caller: an errno, and why.
  int refused = 0;
  std::string refused_why;

  // Reads the groups, umask and capabilities of `who.pid` from /proc. A process
  // that is gone leaves no groups, no capabilities and the umask 022. A pid of 0
  // is what FUSE reports for a caller outside salusd's pid namespace: nothing
  // can be learned about it, so such credentials come back refused (EPERM).
  // (A CallerCredentials built by hand with pid 0 stands for this process.)
  static CallerCredentials capture(const CallerIdentity& who);
  // "/proc/PID/root", or "/" for pid 0.
  std::string root_path() const;
};

// Takes on the caller's filesystem identity for the calling thread only
// (setfsuid/setfsgid and the raw setgroups syscall; glibc's setgroups() would
// change every thread), lowers the thread's effective capabilities to the
// caller's (capset acts on the calling thread only), and restores salusd's on
// destruction.
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
  std::uint32_t saved_caps_[2] = {0, 0};  // effective, low and high words
  bool caps_saved_ = false;
  bool entered_ = false;  // anything was changed, so the destructor restores
  bool ok_ = false;
};

}  // namespace salus::vgpu
