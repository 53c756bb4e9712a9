#include "vgpu/cuda/cuda_plans.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>

#include <fmt/format.h>

namespace salus::vgpu::cuda {
namespace {

std::uint8_t pattern_byte(std::uint32_t pattern, unsigned width, std::uint64_t i) {
  return static_cast<std::uint8_t>(pattern >> (8 * (i % width)));
}

}  // namespace

bool plan_fill(std::uint64_t address, std::uint64_t length, std::uint32_t pattern, unsigned width,
               std::vector<FillPiece>& pieces) {
  pieces.clear();
  if (width != 1 && width != 2 && width != 4) return false;
  if (length == 0) return true;
  bool uniform = true;
  for (unsigned i = 1; i < width; ++i)
    uniform = uniform && pattern_byte(pattern, width, i) == pattern_byte(pattern, width, 0);
  if (uniform) {
    pieces.push_back(FillPiece{0, length, pattern_byte(pattern, width, 0), 1});
    return true;
  }
  const std::uint64_t head = std::min<std::uint64_t>((4 - address % 4) % 4, length);
  const std::uint64_t words = (length - head) / 4;
  for (std::uint64_t i = 0; i < head; ++i)
    pieces.push_back(FillPiece{i, 1, pattern_byte(pattern, width, i), 1});
  if (words > 0) {
    std::uint32_t word = 0;
    for (unsigned j = 0; j < 4; ++j)
      word |= std::uint32_t{pattern_byte(pattern, width, head + j)} << (8 * j);
    pieces.push_back(FillPiece{head, words, word, 4});
  }
  for (std::uint64_t i = head + words * 4; i < length; ++i)
    pieces.push_back(FillPiece{i, 1, pattern_byte(pattern, width, i), 1});
  return true;
}

bool ranges_overlap(std::uint64_t a, std::uint64_t alen, std::uint64_t b, std::uint64_t blen) {
  if (alen == 0 || blen == 0) return false;
  return a < b ? b - a < alen : a - b < blen;
}

bool plan_copy(std::uint64_t dst, std::uint64_t src, std::uint64_t length,
               std::uint64_t scratch_size, std::vector<CopyPiece>& pieces, std::size_t max_direct) {
  pieces.clear();
  if (length == 0 || dst == src) return true;
  if (!ranges_overlap(dst, length, src, length)) {
    pieces.push_back(CopyPiece{dst, src, length});
    return true;
  }
  const bool backward = dst > src;  // walk away from the overlap
  const std::uint64_t distance = backward ? dst - src : src - dst;
  const bool direct = (length + distance - 1) / distance <= max_direct;
  const std::uint64_t chunk = direct ? distance : scratch_size;
  if (chunk == 0) return false;
  const std::uint64_t n = (length + chunk - 1) / chunk;
  for (std::uint64_t i = 0; i < n; ++i) {
    // Forward: [i*chunk, ...); backward: the same pieces from the top down.
    const std::uint64_t start = backward ? (n - 1 - i) * chunk : i * chunk;
    const std::uint64_t len = std::min(chunk, length - start);
    if (direct) {
      pieces.push_back(CopyPiece{dst + start, src + start, len});
    } else {
      pieces.push_back(CopyPiece{0, src + start, len, true, false});
      pieces.push_back(CopyPiece{dst + start, 0, len, false, true});
    }
  }
  return true;
}

std::uint32_t spin_blocks(double util, std::uint32_t sm_count, std::uint32_t threads_per_sm) {
  const std::uint64_t per_sm = std::max<std::uint64_t>(1, threads_per_sm / kSpinBlockThreads);
  const std::uint64_t full =
      std::min<std::uint64_t>(std::max<std::uint64_t>(1, std::uint64_t{sm_count} * per_sm),
                              std::numeric_limits<std::int32_t>::max());
  if (std::isnan(util) || util >= 1.0) return static_cast<std::uint32_t>(full);
  if (util <= 0.0) return 1;
  const auto blocks = static_cast<std::uint64_t>(std::llround(util * static_cast<double>(full)));
  return static_cast<std::uint32_t>(std::clamp<std::uint64_t>(blocks, 1, full));
}

std::uint64_t spin_cycles(std::uint64_t usec, double cycles_per_usec) {
  constexpr std::uint64_t kMaxUsec = 1'000'000'000'000;  // as sim: about 11 days
  if (!(cycles_per_usec > 0.0) || std::isinf(cycles_per_usec)) return 0;
  const double cycles = static_cast<double>(std::min(usec, kMaxUsec)) * cycles_per_usec;
  constexpr double kMaxCycles = 4.0e18;  // below 2^63: clock64 is signed
  return static_cast<std::uint64_t>(std::min(cycles, kMaxCycles));
}

bool gemm_grid(std::uint32_t m, std::uint32_t n, std::uint64_t a_addr, std::uint64_t b_addr,
               std::uint64_t c_addr, std::uint32_t grid[2], std::string& why) {
  grid[0] = static_cast<std::uint32_t>((std::uint64_t{n} + kGemmTile - 1) / kGemmTile);
  grid[1] = static_cast<std::uint32_t>((std::uint64_t{m} + kGemmTile - 1) / kGemmTile);
  if (a_addr % 4 != 0 || b_addr % 4 != 0 || c_addr % 4 != 0) {
    why = "gemm operands must start on a 4-byte boundary";
    return false;
  }
  if (grid[1] > 65535) {  // gridDim.y limit
    why = fmt::format("gemm with M={} rows is over the limit of {}", m, 65535u * kGemmTile);
    return false;
  }
  return true;
}

ImageKind classify_image(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return ImageKind::empty;
  if (size >= 4 && std::memcmp(data,
                               "\x7f"
                               "ELF",
                               4) == 0)
    return ImageKind::cubin;
  if (size >= 4) {
    const std::uint32_t magic = std::uint32_t{data[0]} | std::uint32_t{data[1]} << 8 |
                                std::uint32_t{data[2]} << 16 | std::uint32_t{data[3]} << 24;
    if (magic == 0xBA55ED50u) return ImageKind::fatbin;
  }
  // PTX is plain text; a NUL may end it. Anything else is not something the
  // driver would take, and saying so beats CUDA_ERROR_INVALID_IMAGE.
  std::size_t end = size;
  while (end > 0 && data[end - 1] == 0) --end;
  for (std::size_t i = 0; i < end; ++i) {
    const std::uint8_t c = data[i];
    if (!(c == '\t' || c == '\n' || c == '\r' || (c >= 0x20 && c < 0x7f)))
      return ImageKind::unknown;
  }
  const std::string_view text(reinterpret_cast<const char*>(data), end);
  if (text.find(".version") != std::string_view::npos &&
      text.find(".target") != std::string_view::npos)
    return ImageKind::ptx;
  return ImageKind::unknown;
}

bool check_launch_args(bool known, const std::vector<std::uint32_t>& param_sizes,
                       const std::uint32_t* arg_sizes, std::size_t arg_count, std::string& why) {
  if (!known) return true;
  if (param_sizes.size() != arg_count) {
    why = fmt::format("the kernel takes {} arguments, the launch passed {}", param_sizes.size(),
                      arg_count);
    return false;
  }
  for (std::size_t i = 0; i < arg_count; ++i)
    if (param_sizes[i] != arg_sizes[i]) {
      why = fmt::format("argument {} has {} bytes, the kernel expects {}", i + 1, arg_sizes[i],
                        param_sizes[i]);
      return false;
    }
  return true;
}

int fault_status(bool kernel_fault, bool had_user_launch) {
  return kernel_fault && had_user_launch ? EFAULT : EIO;
}

void BusyUnion::add(std::int64_t end_ns, std::int64_t duration_ns) {
  if (duration_ns <= 0) return;
  const std::int64_t start = end_ns - duration_ns;
  if (start >= covered_until_) {
    total_ += duration_ns;
  } else if (end_ns > covered_until_) {
    total_ += end_ns - covered_until_;
  }
  covered_until_ = std::max(covered_until_, end_ns);
}

std::string format_gpu_uuid(const unsigned char b[16]) {
  return fmt::format(
      "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-"
      "{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
      b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
      b[15]);
}

std::string format_cuda_version(int version) {
  return fmt::format("{}.{}", version / 1000, version % 1000 / 10);
}

}  // namespace salus::vgpu::cuda
