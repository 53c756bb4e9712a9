// The arithmetic of the CUDA backend, kept free of cuda.h and of any device so it
// is unit-tested on every machine: how a fill becomes memsets, how an overlapping
// copy is split, spin and gemm launch shapes, module image kinds, handle packing,
// busy-time accounting and the wording of device identities.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace salus::vgpu::cuda {

// ---- fill ----
// One cuMemsetD8Async (unit 1, low byte of value) or cuMemsetD32Async (unit 4) of
// `count` units starting `offset` bytes into the fill.
struct FillPiece {
  std::uint64_t offset;
  std::uint64_t count;
  std::uint32_t value;
  unsigned unit;
};
// Splits a fill of `length` bytes at device address `address` with the `width`-
// byte little-endian element `pattern` (1, 2 or 4; a trailing partial element
// gets the element's leading bytes, as on sim) into at most 7 memsets: byte
// memsets up to the first 4-byte boundary, one 32-bit memset over the aligned
// middle (the element repeats every 4 bytes because width divides 4), byte
// memsets for the rest. A pattern whose bytes are all equal is one byte memset.
// Returns false (and no pieces) for any other width.
bool plan_fill(std::uint64_t address, std::uint64_t length, std::uint32_t pattern, unsigned width,
               std::vector<FillPiece>& pieces);

// ---- copy ----
// One cuMemcpyDtoDAsync, between arena offsets or the stream's scratch buffer.
struct CopyPiece {
  std::uint64_t dst;
  std::uint64_t src;
  std::uint64_t length;
  bool dst_scratch = false;  // dst is an offset into scratch, not the arena
  bool src_scratch = false;
};
// cuMemcpy is undefined for overlapping ranges, but the command language allows
// `copy` within one buffer. Disjoint ranges are one piece; dst == src is none.
// Overlapping ones are walked away from the overlap in pieces no longer than the
// distance between the ranges, so no piece overlaps itself or a range a later
// piece still has to read; if that would take more than `max_direct` pieces,
// each piece goes through `scratch_size` bytes of scratch instead (two copies).
// Returns false if scratch is needed but scratch_size is 0.
bool plan_copy(std::uint64_t dst, std::uint64_t src, std::uint64_t length,
               std::uint64_t scratch_size, std::vector<CopyPiece>& pieces,
               std::size_t max_direct = 16);

// ---- spin ----
// Threads per spin block: small enough that every architecture fits several per
// SM (sm_75 holds 1024 threads per SM, sm_80/90 2048).
constexpr unsigned kSpinBlockThreads = 256;
// Blocks for a spin that should occupy `util` of the GPU: util >= 1 (or NaN)
// fills every SM's thread slots (sm_count * threads_per_sm / 256 blocks), so a
// second kernel has to wait for the spin's blocks, as it would for real work;
// util < 1 launches that many times fewer blocks (at least one), leaving the
// rest of the GPU to other streams.
std::uint32_t spin_blocks(double util, std::uint32_t sm_count, std::uint32_t threads_per_sm);
// Clock cycles for `usec` microseconds at `cycles_per_usec`, capped like sim's
// spin (about 11 days) so the product cannot overflow.
std::uint64_t spin_cycles(std::uint64_t usec, double cycles_per_usec);

// ---- gemm ----
constexpr unsigned kGemmTile = 64;           // C tile edge per block (builtin_kernels.cu)
constexpr unsigned kGemmBlockThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
// Grid for C[m x n]; false with a reason if it exceeds the grid limits or an
// operand is not 4-byte aligned (a misaligned float load would fault the context).
bool gemm_grid(std::uint32_t m, std::uint32_t n, std::uint64_t a_addr, std::uint64_t b_addr,
               std::uint64_t c_addr, std::uint32_t grid[2], std::string& why);
// True if [a, a+alen) and [b, b+blen) share a byte.
bool ranges_overlap(std::uint64_t a, std::uint64_t alen, std::uint64_t b, std::uint64_t blen);

// ---- modules ----
enum class ImageKind { empty, cubin, fatbin, ptx, unknown };
// Classifies a module image by its first bytes: ELF (cubin), the fatbin magic
// 0xBA55ED50, or printable text that looks like PTX.
ImageKind classify_image(const std::uint8_t* data, std::size_t size);

// FunctionHandle = module << 32 | index of the function within the module.
constexpr std::uint64_t pack_function(std::uint32_t module, std::uint32_t index) {
  return std::uint64_t{module} << 32 | index;
}
constexpr std::uint32_t function_module(std::uint64_t handle) {
  return static_cast<std::uint32_t>(handle >> 32);
}
constexpr std::uint32_t function_index(std::uint64_t handle) {
  return static_cast<std::uint32_t>(handle);
}

// Checks a launch's argument sizes against the kernel's parameter sizes (when the
// driver could tell them: `known`). False with a reason on a mismatch.
bool check_launch_args(bool known, const std::vector<std::uint32_t>& param_sizes,
                       const std::uint32_t* arg_sizes, std::size_t arg_count, std::string& why);

// ---- faults ----
// The status a notify interrupted by a sticky error completes with: EFAULT where
// the interval ran a user kernel and the error is one a kernel causes (the likely
// culprit; if several streams were running user kernels, each is a suspect), EIO
// for everything else, whose work was lost with the context.
int fault_status(bool kernel_fault, bool had_user_launch);

// ---- busy time ----
// The union length of busy intervals reported one by one as (end, duration),
// mostly in order of their ends. Kept as a watermark: the part of an interval
// before the latest end already seen counts as covered. Exact for intervals
// arriving in end order whose overlaps chain; an interval arriving late that lies
// wholly before the watermark is assumed covered (under-counts, never
// over-counts, never exceeds wall time).
class BusyUnion {
 public:
  void add(std::int64_t end_ns, std::int64_t duration_ns);
  std::int64_t total() const { return total_; }

 private:
  std::int64_t covered_until_ = INT64_MIN;
  std::int64_t total_ = 0;
};

// ---- identity ----
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" as nvidia-smi prints it.
std::string format_gpu_uuid(const unsigned char bytes[16]);
// cuDriverGetVersion's 12040 as "12.4".
std::string format_cuda_version(int version);

}  // namespace salus::vgpu::cuda
