// Typed session commands: what one line of the command language means once parsed.
// fusefs parses text into these; the broker validates them against a session and
// executes them. Nothing here touches a device.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "arena/size_units.hpp"

namespace salus::vgpu {

using arena::Bytes;

// BUF or BUF+OFF.
struct BufRef {
  std::string name;
  Bytes offset = 0;
};

inline constexpr int kAnyGpu = -1;

struct NeedCmd {
  Bytes persistent = 0;
  Bytes ephemeral = 0;
  std::optional<std::uint64_t> iters;    // declared total iterations (SRTF)
  std::optional<std::int32_t> priority;  // PRIORITY policy; larger runs first
  std::optional<int> gpu;                // index, or kAnyGpu
  std::optional<std::string> name;       // display name
  // kind=attached: the session is for a program that will attach (salus-run
  // says so), so placement and admission count it as one from the first need.
  std::optional<bool> attached;
};

struct AllocCmd {
  std::string name;
  Bytes size = 0;
};

struct FreeCmd {
  std::string name;
};

struct BeginCmd {};

struct EndCmd {
  std::uint64_t repeat = 1;  // `end xN`
};

struct RunCmd {
  std::uint64_t count = 1;
};

enum class DType : std::uint8_t { f32, i32, u8 };

struct FillCmd {
  BufRef dst;  // offset from off=
  DType dtype = DType::f32;
  std::uint32_t bits = 0;       // one element's bit pattern (low byte only for u8)
  std::optional<Bytes> length;  // len=; default: to the end of the buffer
};

struct CopyCmd {
  BufRef dst;
  BufRef src;
  Bytes length = 0;
};

struct SpinCmd {
  std::uint64_t usec = 0;
  double util = 1.0;  // fraction of the GPU the kernel occupies alone, in (0, 1]
};

// C[MxN] = A[MxK] * B[KxN], fp32, row-major.
struct GemmCmd {
  std::uint32_t m = 0, n = 0, k = 0;
  std::string a, b, c;
};

struct SyncCmd {};

struct PriorityCmd {
  std::int32_t priority = 0;
};

// Clears a failed session's error so it can submit work again.
struct ResetCmd {};

struct ModuleCmd {
  std::string name;
  std::string path;
};

struct LaunchArg {
  enum class Kind : std::uint8_t { buffer, i32, u32, i64, u64, f32, f64 };
  Kind kind = Kind::buffer;
  BufRef buffer;           // kind == buffer
  std::uint64_t bits = 0;  // the value's bit pattern, little-endian, for scalars
};

struct LaunchCmd {
  std::string module;
  std::string function;
  std::uint32_t grid[3] = {1, 1, 1};
  std::uint32_t block[3] = {1, 1, 1};
  std::uint32_t shared_mem = 0;
  std::vector<LaunchArg> args;
};

// upload BUF[+OFF] shm:SEG[+OFF] LEN | file:PATH[+OFF] LEN, and download likewise.
struct TransferCmd {
  enum class Direction : std::uint8_t { upload, download };
  enum class Endpoint : std::uint8_t { shm, file };
  Direction direction = Direction::upload;
  BufRef buffer;
  Endpoint endpoint = Endpoint::shm;
  std::string source;  // segment name or path
  Bytes source_offset = 0;
  Bytes length = 0;
};

// attach gate=FD bell=FD: the writing process hands salusd its gate (a sealed
// memfd holding struct salus_gate) and its doorbell (an eventfd); the numbers
// are file descriptors of the writer, taken with pidfd_getfd. lane=FD
// (optional): the writer's end of a SOCK_SEQPACKET Unix socket pair that opts
// the session into its lane's shared memory (client/salus_gate.h).
// lane_room=1 (with lane=): the program takes the lane as room for its own
// cuMemCreate (SALUS_SHARED_LANE=segments), so salusd holds no lane memory
// while it holds the lane.
struct AttachCmd {
  int gate_fd = -1;
  int bell_fd = -1;
  int lane_fd = -1;
  bool lane_room = false;
};

using Command = std::variant<NeedCmd, AllocCmd, FreeCmd, BeginCmd, EndCmd, RunCmd, FillCmd, CopyCmd,
                             SpinCmd, GemmCmd, SyncCmd, PriorityCmd, ResetCmd, ModuleCmd, LaunchCmd,
                             TransferCmd, AttachCmd>;

struct CommandLine {
  std::uint32_t line = 0;  // 1-based line number within the write
  Command command;
};

// Buffer and module names become file names under mem/, so they are restricted:
// 1..64 chars of [A-Za-z0-9_.-], not starting with '.'.
inline constexpr std::size_t kMaxNameLength = 64;
bool is_valid_name(std::string_view name);

}  // namespace salus::vgpu
