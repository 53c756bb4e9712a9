// The cuda backend's device-free arithmetic, checked on the host: fills split into
// memsets reproduce the sim fill byte for byte, overlapping copies split into
// pieces reproduce memmove, spin and gemm shapes, image classification, handle
// packing, busy-time union and identity formatting.
#include "vgpu/cuda/cuda_plans.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace salus::vgpu::cuda;

// What the fill must produce (the sim backend's definition).
std::vector<std::uint8_t> reference_fill(std::size_t length, std::uint32_t pattern,
                                         unsigned width) {
  std::vector<std::uint8_t> out(length);
  for (std::size_t i = 0; i < length; ++i)
    out[i] = static_cast<std::uint8_t>(pattern >> (8 * (i % width)));
  return out;
}

// Executes memset pieces the way cuMemsetD8/D32 would, checking the D32
// alignment precondition against the device address.
std::vector<std::uint8_t> run_fill(std::uint64_t address, std::size_t length,
                                   const std::vector<FillPiece>& pieces) {
  std::vector<std::uint8_t> out(length, 0xcc);
  for (const FillPiece& p : pieces) {
    if (p.unit == 4) {
      EXPECT_EQ((address + p.offset) % 4, 0u) << "cuMemsetD32 needs 4-byte alignment";
      for (std::uint64_t i = 0; i < p.count; ++i) std::memcpy(&out[p.offset + 4 * i], &p.value, 4);
    } else {
      EXPECT_EQ(p.unit, 1u);
      for (std::uint64_t i = 0; i < p.count; ++i)
        out[p.offset + i] = static_cast<std::uint8_t>(p.value);
    }
  }
  return out;
}

TEST(CudaFillPlan, MatchesTheSimFillForEveryWidthAlignmentAndLength) {
  const std::uint32_t patterns[] = {0x00000000, 0x11111111, 0x04030201, 0xdeadbeef, 0x0000abcd};
  for (unsigned width : {1u, 2u, 4u})
    for (std::uint32_t pattern : patterns)
      for (std::uint64_t address = 0x1000; address < 0x1008; ++address)
        for (std::size_t length : {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1001}) {
          std::vector<FillPiece> pieces;
          ASSERT_TRUE(plan_fill(address, length, pattern, width, pieces));
          EXPECT_LE(pieces.size(), 7u);
          EXPECT_EQ(run_fill(address, length, pieces), reference_fill(length, pattern, width))
              << "width " << width << " pattern " << std::hex << pattern << " address " << address
              << std::dec << " length " << length;
        }
}

TEST(CudaFillPlan, UniformPatternsAndAlignedFillsAreOneMemset) {
  std::vector<FillPiece> pieces;
  ASSERT_TRUE(plan_fill(0x1001, 12345, 0, 4, pieces));
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].unit, 1u);
  ASSERT_TRUE(plan_fill(0x1000, 4096, 0x3f800000, 4, pieces));  // 1.0f
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].unit, 4u);
  EXPECT_EQ(pieces[0].count, 1024u);
  EXPECT_EQ(pieces[0].value, 0x3f800000u);
}

TEST(CudaFillPlan, RejectsOtherWidths) {
  std::vector<FillPiece> pieces;
  EXPECT_FALSE(plan_fill(0, 16, 1, 3, pieces));
  EXPECT_FALSE(plan_fill(0, 16, 1, 8, pieces));
  EXPECT_FALSE(plan_fill(0, 16, 1, 0, pieces));
  EXPECT_TRUE(pieces.empty());
}

// Applies copy pieces to a host "arena", each with memcpy semantics: a piece must
// never overlap itself (cuMemcpy is undefined then).
void run_copy(std::vector<std::uint8_t>& arena, std::vector<std::uint8_t>& scratch,
              const std::vector<CopyPiece>& pieces) {
  for (const CopyPiece& p : pieces) {
    std::uint8_t* to = p.dst_scratch ? &scratch[p.dst] : &arena[p.dst];
    const std::uint8_t* from = p.src_scratch ? &scratch[p.src] : &arena[p.src];
    ASSERT_LE(p.dst + p.length, p.dst_scratch ? scratch.size() : arena.size());
    ASSERT_LE(p.src + p.length, p.src_scratch ? scratch.size() : arena.size());
    ASSERT_FALSE(p.dst_scratch == p.src_scratch && ranges_overlap(p.dst, p.length, p.src, p.length))
        << "a piece overlaps itself";
    std::memcpy(to, from, p.length);
  }
}

TEST(CudaCopyPlan, ReproducesMemmoveForOverlappingAndDisjointRanges) {
  std::mt19937 rng(7);
  const std::size_t n = 4096;
  std::vector<std::uint8_t> init(n);
  for (auto& b : init) b = static_cast<std::uint8_t>(rng());
  for (std::size_t scratch_size : {std::size_t{64}, std::size_t{1000}})
    for (int trial = 0; trial < 3000; ++trial) {
      const std::size_t length = rng() % 1500;
      const std::size_t dst = rng() % (n - length + 1);
      // Half the trials overlap, including by a few bytes in either direction.
      std::size_t src = rng() % (n - length + 1);
      if (trial % 2 == 0) {
        const long shift = static_cast<long>(rng() % 9) - 4;
        const long s = static_cast<long>(dst) + shift;
        if (s >= 0 && static_cast<std::size_t>(s) + length <= n) src = static_cast<std::size_t>(s);
      }
      std::vector<CopyPiece> pieces;
      ASSERT_TRUE(plan_copy(dst, src, length, scratch_size, pieces));
      std::vector<std::uint8_t> arena = init, scratch(scratch_size), expect = init;
      std::memmove(&expect[dst], &init[src], length);
      run_copy(arena, scratch, pieces);
      ASSERT_EQ(arena, expect) << "dst " << dst << " src " << src << " length " << length;
    }
}

TEST(CudaCopyPlan, PieceCounts) {
  std::vector<CopyPiece> pieces;
  ASSERT_TRUE(plan_copy(0, 1000, 1000, 64, pieces));
  EXPECT_EQ(pieces.size(), 1u) << "disjoint: one copy";
  ASSERT_TRUE(plan_copy(100, 100, 1000, 64, pieces));
  EXPECT_TRUE(pieces.empty()) << "same place: nothing to do";
  ASSERT_TRUE(plan_copy(0, 500, 1000, 64, pieces));
  EXPECT_EQ(pieces.size(), 2u) << "distance 500: two direct pieces";
  ASSERT_TRUE(plan_copy(0, 4, 1000, 256, pieces));
  EXPECT_EQ(pieces.size(), 8u) << "distance 4: four scratch round trips of 256";
  EXPECT_FALSE(plan_copy(0, 4, 1000, 0, pieces)) << "needs scratch, has none";
}

TEST(CudaSpin, BlocksScaleWithUtilization) {
  // H100: 132 SMs x 2048 threads = 132 * 8 blocks of 256.
  EXPECT_EQ(spin_blocks(1.0, 132, 2048), 1056u);
  EXPECT_EQ(spin_blocks(2.0, 132, 2048), 1056u);
  EXPECT_EQ(spin_blocks(std::nan(""), 132, 2048), 1056u);
  EXPECT_EQ(spin_blocks(0.5, 132, 2048), 528u);
  EXPECT_EQ(spin_blocks(0.25, 80, 1024), 80u);  // sm_75: 4 blocks per SM
  EXPECT_EQ(spin_blocks(0.0, 132, 2048), 1u);
  EXPECT_EQ(spin_blocks(-3.0, 132, 2048), 1u);
  EXPECT_EQ(spin_blocks(1e-9, 132, 2048), 1u);
  EXPECT_EQ(spin_blocks(1.0, 0, 0), 1u);
}

TEST(CudaSpin, CyclesAreCappedAndNeverOverflow) {
  EXPECT_EQ(spin_cycles(1000, 1755.0), 1'755'000u);
  EXPECT_EQ(spin_cycles(0, 1755.0), 0u);
  EXPECT_EQ(spin_cycles(1000, 0.0), 0u);
  EXPECT_EQ(spin_cycles(1000, std::nan("")), 0u);
  const std::uint64_t huge = spin_cycles(std::numeric_limits<std::uint64_t>::max(), 3000.0);
  EXPECT_GT(huge, 0u);
  EXPECT_LT(huge, std::uint64_t{1} << 63);
}

TEST(CudaGemm, GridCoversEveryTileAndChecksLimits) {
  std::uint32_t grid[2];
  std::string why;
  ASSERT_TRUE(gemm_grid(1, 1, 0, 0, 0, grid, why));
  EXPECT_EQ(grid[0], 1u);
  EXPECT_EQ(grid[1], 1u);
  ASSERT_TRUE(gemm_grid(65, 129, 0, 0, 0, grid, why));
  EXPECT_EQ(grid[0], 3u);  // columns: ceil(129/64)
  EXPECT_EQ(grid[1], 2u);  // rows: ceil(65/64)
  EXPECT_FALSE(gemm_grid(65535u * 64 + 1, 1, 0, 0, 0, grid, why));
  EXPECT_FALSE(gemm_grid(4, 4, 2, 0, 0, grid, why)) << "misaligned A";
  EXPECT_NE(why.find("4-byte"), std::string::npos);
}

TEST(CudaGemm, Overlap) {
  EXPECT_TRUE(ranges_overlap(0, 10, 9, 10));
  EXPECT_FALSE(ranges_overlap(0, 10, 10, 10));
  EXPECT_TRUE(ranges_overlap(9, 10, 0, 10));
  EXPECT_FALSE(ranges_overlap(10, 10, 0, 10));
  EXPECT_FALSE(ranges_overlap(0, 0, 0, 10));
  EXPECT_TRUE(ranges_overlap(5, 1, 0, 10));
}

std::vector<std::uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

TEST(CudaImages, ClassifiesByContent) {
  EXPECT_EQ(classify_image(nullptr, 0), ImageKind::empty);
  auto elf = bytes(
      "\x7f"
      "ELF\x02\x01\x01");
  EXPECT_EQ(classify_image(elf.data(), elf.size()), ImageKind::cubin);
  const std::uint8_t fatbin[] = {0x50, 0xed, 0x55, 0xba, 0x01, 0x00, 0x10, 0x00};
  EXPECT_EQ(classify_image(fatbin, sizeof fatbin), ImageKind::fatbin);
  auto ptx = bytes("//\n.version 8.0\n.target sm_80\n.address_size 64\n");
  EXPECT_EQ(classify_image(ptx.data(), ptx.size()), ImageKind::ptx);
  ptx.push_back(0);  // NUL-terminated PTX is still PTX
  EXPECT_EQ(classify_image(ptx.data(), ptx.size()), ImageKind::ptx);
  auto text = bytes("hello world\n");
  EXPECT_EQ(classify_image(text.data(), text.size()), ImageKind::unknown);
  auto binary = bytes(".version\x01.target");
  EXPECT_EQ(classify_image(binary.data(), binary.size()), ImageKind::unknown);
}

TEST(CudaHandles, PackAndUnpack) {
  constexpr auto h = pack_function(0xfffffffe, 7);
  static_assert(function_module(h) == 0xfffffffe);
  static_assert(function_index(h) == 7);
  EXPECT_NE(pack_function(1, 0), pack_function(0, 1));
}

TEST(CudaLaunchArgs, ChecksCountsAndSizesOnlyWhenKnown) {
  std::string why;
  const std::uint32_t sizes[] = {8, 4, 8};
  EXPECT_TRUE(check_launch_args(false, {}, sizes, 3, why));
  EXPECT_TRUE(check_launch_args(true, {8, 4, 8}, sizes, 3, why));
  EXPECT_FALSE(check_launch_args(true, {8, 4}, sizes, 3, why));
  EXPECT_NE(why.find("takes 2"), std::string::npos) << why;
  EXPECT_FALSE(check_launch_args(true, {8, 8, 8}, sizes, 3, why));
  EXPECT_NE(why.find("argument 2"), std::string::npos) << why;
  EXPECT_TRUE(check_launch_args(true, {}, nullptr, 0, why));
}

TEST(CudaFaults, CulpritsGetEfaultOthersEio) {
  EXPECT_EQ(fault_status(true, true), EFAULT);
  EXPECT_EQ(fault_status(true, false), EIO);
  EXPECT_EQ(fault_status(false, true), EIO);  // ECC and the like: nobody's fault
  EXPECT_EQ(fault_status(false, false), EIO);
}

TEST(CudaBusy, UnionOfIntervals) {
  BusyUnion u;
  u.add(100, 50);  // [50, 100)
  EXPECT_EQ(u.total(), 50);
  u.add(120, 40);  // [80, 120): overlaps by 20
  EXPECT_EQ(u.total(), 70);
  u.add(300, 100);  // [200, 300): disjoint
  EXPECT_EQ(u.total(), 170);
  u.add(250, 10);  // inside what is covered
  EXPECT_EQ(u.total(), 170);
  u.add(400, 0);  // empty intervals count nothing
  EXPECT_EQ(u.total(), 170);
  // Two streams busy over the same 1000 ns count once, not twice.
  BusyUnion two;
  two.add(1000, 1000);
  two.add(1000, 1000);
  EXPECT_EQ(two.total(), 1000);
}

TEST(CudaIdentity, FormatsUuidAndVersion) {
  const unsigned char uuid[16] = {0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0,
                                  0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef};
  EXPECT_EQ(format_gpu_uuid(uuid), "GPU-12345678-9abc-def0-0123-456789abcdef");
  EXPECT_EQ(format_cuda_version(12040), "12.4");
  EXPECT_EQ(format_cuda_version(13000), "13.0");
  EXPECT_EQ(format_cuda_version(12080), "12.8");
}

}  // namespace
