// The /salus tree over the libfuse3 low-level API: lookups, attributes and
// permissions, snapshot files, command writes with deferred replies, mem/ files.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>

#include "vgpu/broker/broker.hpp"

struct fuse_session;

namespace salus::fusefs {

struct Snapshots;  // generated files' content per snapshot inode (filesystem.cpp)

struct FilesystemOptions {
  std::string mountpoint;
  std::optional<gid_t> admin_group;
  unsigned max_threads = 16;
  bool debug = false;
};

class Filesystem {
 public:
  Filesystem(vgpu::Broker& broker, FilesystemOptions options);
  ~Filesystem();

  // Checks the mountpoint and /dev/fuse, then mounts. Returns 0, or a positive
  // errno with a one-line reason in `why` (and mounts nothing): ENOTCONN for a
  // dead FUSE mount, EBUSY for a live mount, the syscall's errno otherwise.
  int mount(std::string& why);
  // Serves requests until unmount() or a signal handler calls exit(); returns 0 on
  // a clean exit.
  int serve();
  // Asks serve() to return; safe from a signal handler.
  void request_exit();
  void unmount();

  vgpu::Broker& broker() { return broker_; }
  const FilesystemOptions& options() const { return options_; }
  Snapshots& snapshots() { return *snapshots_; }

 private:
  vgpu::Broker& broker_;
  FilesystemOptions options_;
  std::unique_ptr<Snapshots> snapshots_;
  fuse_session* session_ = nullptr;
  bool mounted_ = false;
};

}  // namespace salus::fusefs
