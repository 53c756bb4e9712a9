// Inode numbers of the /salus tree. Every inode encodes what it is, so the
// filesystem keeps no inode table: kind in the top byte, a session id (or GPU
// index) in the middle, a sub-id (file kind or buffer id) in the low 24 bits.
#pragma once

#include <cstdint>

namespace salus::fusefs {

enum class Kind : std::uint8_t {
  root = 0,
  top_file = 1,  // sub: TopFile
  gpus_dir = 2,
  gpu_dir = 3,   // id: gpu index
  gpu_file = 4,  // id: gpu index, sub: GpuFile
  sessions_dir = 5,
  session_dir = 6,   // id: session
  session_file = 7,  // id: session, sub: SessionFile
  mem_dir = 8,       // id: session
  mem_file = 9,      // id: session, sub: buffer id
  // What a lookup of /salus/clone returns: a fresh inode every time, because the
  // kernel serializes direct-I/O writes per inode, and clone files whose writes
  // wait (sync, admission) must not hold up other sessions' clone files.
  clone_file = 10,  // id and sub: a unique instance number
  // What a lookup of a generated file (stats, metrics, gpus/N/*, a session's
  // status and log) returns: a fresh inode holding the content rendered at that
  // lookup, whose size is that content's. sendfile() and splice() read through
  // the page cache up to the inode's size, so a size of 0 made busybox cat/cp and
  // shutil.copyfile see empty files.
  snapshot_file = 11,  // id and sub: a unique instance number
};

enum class TopFile : std::uint32_t { readme, version, clone, policy, ctl, stats, metrics, count };
enum class GpuFile : std::uint32_t { info, memory, lanes, queue, processes, count };
enum class SessionFile : std::uint32_t { ctl, status, log, wait, count };

struct Inode {
  Kind kind = Kind::root;
  std::uint64_t id = 0;
  std::uint32_t sub = 0;
};

inline constexpr std::uint64_t kRootIno = 1;  // FUSE_ROOT_ID

inline std::uint64_t encode(Inode in) {
  if (in.kind == Kind::root) return kRootIno;
  return (static_cast<std::uint64_t>(in.kind) << 56) | ((in.id & 0xffffffffULL) << 24) |
         (in.sub & 0xffffffu);
}

inline Inode decode(std::uint64_t ino) {
  if (ino == kRootIno) return Inode{};
  return Inode{static_cast<Kind>(ino >> 56), (ino >> 24) & 0xffffffffULL,
               static_cast<std::uint32_t>(ino & 0xffffffu)};
}

}  // namespace salus::fusefs
