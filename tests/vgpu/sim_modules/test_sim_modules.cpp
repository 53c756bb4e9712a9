// Sim-backend user modules: loading a host .so from memory, symbol lookup limited
// to the module, signature tables, argument marshalling for every type, launch
// shapes, errors reported at notify, and module lifetime against queued launches.
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tests/support/recording_sink.hpp"
#include "vgpu/sim/sim_device.hpp"
#include "vgpu/sim/sim_modules.hpp"

namespace {

using salus::vgpu::Bytes;
using salus::vgpu::FunctionHandle;
using salus::vgpu::LaunchDims;
using salus::vgpu::ModuleHandle;
using salus::vgpu::SimDevice;
using salus::vgpu::StreamId;

constexpr Bytes kMiB = Bytes{1} << 20;

using Sink = salus::test::RecordingSink;

std::vector<std::uint8_t> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Packs launch arguments the way the broker does: values back to back.
struct Args {
  std::vector<std::uint8_t> bytes;
  std::vector<std::uint32_t> sizes;
  template <typename T>
  Args& add(T v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof v);
    sizes.push_back(sizeof v);
    return *this;
  }
};

class SimModules : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* path = std::getenv("SALUS_TEST_SIM_MODULE");
    ASSERT_NE(path, nullptr) << "SALUS_TEST_SIM_MODULE is not set (run through meson test)";
    image_ = read_file(path);
    ASSERT_FALSE(image_.empty()) << "cannot read " << path;
    dev_.set_sink(&sink_);
    stream_ = dev_.create_stream();
  }

  ModuleHandle load() {
    ModuleHandle m = 0;
    std::string why;
    EXPECT_EQ(dev_.load_module(image_, m, why), 0) << why;
    return m;
  }
  FunctionHandle function(ModuleHandle m, const std::string& name,
                          std::vector<std::uint32_t>* sizes = nullptr) {
    FunctionHandle f = 0;
    std::vector<std::uint32_t> s;
    std::string why;
    EXPECT_EQ(dev_.get_function(m, name, f, s, why), 0) << name << ": " << why;
    if (sizes) *sizes = s;
    return f;
  }
  void launch(FunctionHandle f, const Args& a, LaunchDims dims = {}) {
    dev_.launch(stream_, f, dims, a.bytes.data(), a.sizes.data(), a.sizes.size());
  }
  // Notifies and returns the status the stream reports.
  int sync() {
    const std::uint64_t token = next_token_++;
    dev_.notify(stream_, token);
    const auto done = sink_.wait(stream_, token);
    EXPECT_TRUE(done.has_value()) << "no completion";
    return done ? done->status : -1;
  }
  std::vector<std::uint8_t> read(Bytes offset, Bytes length) {
    std::vector<std::uint8_t> out(length);
    dev_.copy_to_host(stream_, out.data(), offset, length);
    EXPECT_EQ(sync(), 0);
    return out;
  }
  std::uint64_t addr(Bytes offset) const { return dev_.device_address(offset); }

  std::vector<std::uint8_t> image_;
  Sink sink_;
  SimDevice dev_{0, 64 * kMiB};
  StreamId stream_ = 0;
  std::uint64_t next_token_ = 1;
};

TEST(SimSignature, ParsesEveryTypeAndRejectsUnknownOnes) {
  std::vector<std::uint32_t> sizes;
  std::string why;
  ASSERT_TRUE(salus::vgpu::sim::parse_signature("ptr,i32,u32,i64,u64,f32,f64", sizes, why));
  EXPECT_EQ(sizes, (std::vector<std::uint32_t>{8, 4, 4, 8, 8, 4, 8}));
  ASSERT_TRUE(salus::vgpu::sim::parse_signature(" ptr ,\tf32 ", sizes, why));
  EXPECT_EQ(sizes, (std::vector<std::uint32_t>{8, 4}));
  ASSERT_TRUE(salus::vgpu::sim::parse_signature("  ", sizes, why));
  EXPECT_TRUE(sizes.empty());
  EXPECT_FALSE(salus::vgpu::sim::parse_signature("ptr,float", sizes, why));
  EXPECT_NE(why.find("float"), std::string::npos) << why;
  EXPECT_FALSE(salus::vgpu::sim::parse_signature("ptr,,u32", sizes, why));
  EXPECT_FALSE(salus::vgpu::sim::parse_signature("ptr,", sizes, why));
}

TEST_F(SimModules, RejectsImagesThatAreNotHostSharedObjects) {
  ModuleHandle m = 0;
  std::string why;
  EXPECT_EQ(dev_.load_module({}, m, why), EINVAL);
  const std::string ptx = ".version 8.0\n.target sm_80\n";
  EXPECT_EQ(dev_.load_module({ptx.begin(), ptx.end()}, m, why), EINVAL);
  EXPECT_NE(why.find("not an ELF"), std::string::npos) << why;
  // A valid ELF header followed by nothing: dlopen itself must refuse it.
  std::vector<std::uint8_t> truncated(image_.begin(), image_.begin() + 256);
  EXPECT_EQ(dev_.load_module(truncated, m, why), EINVAL);
  EXPECT_FALSE(why.empty());
}

TEST_F(SimModules, LooksUpOnlyFunctionsTheModuleDefines) {
  const ModuleHandle m = load();
  FunctionHandle f = 0;
  std::vector<std::uint32_t> sizes;
  std::string why;
  EXPECT_EQ(dev_.get_function(m, "no_such_kernel", f, sizes, why), ENOENT);
  // Resolvable through the module's dependencies, but not defined by it.
  EXPECT_EQ(dev_.get_function(m, "malloc", f, sizes, why), ENOENT) << why;
  EXPECT_EQ(dev_.get_function(m, "system", f, sizes, why), ENOENT) << why;
  EXPECT_EQ(dev_.get_function(m, "not_a_function", f, sizes, why), EINVAL) << why;
  EXPECT_EQ(dev_.get_function(m, "bad_signature", f, sizes, why), EINVAL);
  EXPECT_NE(why.find("salus_signature_bad_signature"), std::string::npos) << why;
  EXPECT_EQ(dev_.get_function(m + 100, "saxpy", f, sizes, why), ENOENT);
}

TEST_F(SimModules, ReportsSignatureSizesAndReusesHandles) {
  const ModuleHandle m = load();
  std::vector<std::uint32_t> sizes;
  const FunctionHandle f = function(m, "all_types", &sizes);
  EXPECT_EQ(sizes, (std::vector<std::uint32_t>{8, 4, 4, 8, 8, 4, 8}));
  EXPECT_EQ(function(m, "all_types"), f);
  function(m, "shape", &sizes);
  EXPECT_TRUE(sizes.empty()) << "a kernel without a table has unknown parameters";
  function(m, "throws", &sizes);
  EXPECT_TRUE(sizes.empty());
}

TEST_F(SimModules, PassesEveryArgumentType) {
  const ModuleHandle m = load();
  const FunctionHandle f = function(m, "all_types");
  Args a;
  a.add(addr(4096))
      .add(std::int32_t{-7})
      .add(std::uint32_t{0xdeadbeef})
      .add(std::int64_t{-1234567890123})
      .add(std::uint64_t{0xfedcba9876543210})
      .add(1.5f)
      .add(-2.25);
  launch(f, a);
  ASSERT_EQ(sync(), 0);
  const auto out = read(4096, 44);
  std::int32_t i32;
  std::uint32_t u32, abi;
  std::int64_t i64;
  std::uint64_t u64;
  float f32;
  double f64;
  std::memcpy(&i32, &out[0], 4);
  std::memcpy(&u32, &out[4], 4);
  std::memcpy(&i64, &out[8], 8);
  std::memcpy(&u64, &out[16], 8);
  std::memcpy(&f32, &out[24], 4);
  std::memcpy(&f64, &out[32], 8);
  std::memcpy(&abi, &out[40], 4);
  EXPECT_EQ(i32, -7);
  EXPECT_EQ(u32, 0xdeadbeefu);
  EXPECT_EQ(i64, -1234567890123);
  EXPECT_EQ(u64, 0xfedcba9876543210u);
  EXPECT_EQ(f32, 1.5f);
  EXPECT_EQ(f64, -2.25);
  EXPECT_EQ(abi, static_cast<std::uint32_t>(SALUS_SIM_KERNEL_ABI));
}

TEST_F(SimModules, ComputesOnDeviceMemoryInStreamOrder) {
  const ModuleHandle m = load();
  const FunctionHandle saxpy = function(m, "saxpy");
  constexpr std::uint32_t n = 1000;
  std::vector<float> x(n), y(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  const Bytes xo = 0, yo = 8192;
  dev_.copy_from_host(stream_, xo, x.data(), n * 4);
  dev_.copy_from_host(stream_, yo, y.data(), n * 4);
  LaunchDims dims;
  dims.grid[0] = 4;
  dims.block[0] = 256;  // 1024 threads cover n
  // Launched twice: the second sees the first's result, as on a GPU stream.
  Args a;
  a.add(addr(yo)).add(addr(xo)).add(2.0f).add(n);
  launch(saxpy, a, dims);
  launch(saxpy, a, dims);
  std::vector<float> out(n);
  dev_.copy_to_host(stream_, out.data(), yo, n * 4);
  ASSERT_EQ(sync(), 0);
  for (std::uint32_t i = 0; i < n; ++i) ASSERT_EQ(out[i], 1.0f + 4.0f * i) << i;
}

TEST_F(SimModules, PassesLaunchShapeAndZeroedSharedMemory) {
  const ModuleHandle m = load();
  const FunctionHandle shape = function(m, "shape");
  LaunchDims dims;
  dims.grid[0] = 3;
  dims.grid[1] = 5;
  dims.grid[2] = 7;
  dims.block[0] = 32;
  dims.block[1] = 2;
  dims.block[2] = 1;
  dims.shared_mem = 4096;
  Args a;
  a.add(addr(0));
  launch(shape, a, dims);
  ASSERT_EQ(sync(), 0);
  auto raw = read(0, 40);
  std::uint32_t v[10];
  std::memcpy(v, raw.data(), sizeof v);
  EXPECT_EQ(v[0], 3u);
  EXPECT_EQ(v[1], 5u);
  EXPECT_EQ(v[2], 7u);
  EXPECT_EQ(v[3], 32u);
  EXPECT_EQ(v[4], 2u);
  EXPECT_EQ(v[5], 1u);
  EXPECT_EQ(v[6], 4096u);
  EXPECT_EQ(v[7], 1u) << "shared memory not zeroed";
  EXPECT_EQ(v[8], 1u);
  EXPECT_EQ(v[9], 1u) << "shared memory not 16-byte aligned";

  dims = LaunchDims{};  // no shared memory: the pointer is NULL
  launch(shape, a, dims);
  ASSERT_EQ(sync(), 0);
  raw = read(0, 40);
  std::memcpy(v, raw.data(), sizeof v);
  EXPECT_EQ(v[6], 0u);
  EXPECT_EQ(v[8], 1u);
}

TEST_F(SimModules, BadLaunchesCompleteWithEinvalAndTheStreamGoesOn) {
  const ModuleHandle m = load();
  const FunctionHandle all = function(m, "all_types");
  const FunctionHandle shape = function(m, "shape");
  Args too_few;
  too_few.add(addr(0)).add(std::int32_t{1});
  launch(all, too_few);
  EXPECT_EQ(sync(), EINVAL);

  Args wrong_size;  // u64 where the table says i32
  wrong_size.add(addr(0))
      .add(std::uint64_t{1})
      .add(std::uint32_t{1})
      .add(std::int64_t{1})
      .add(std::uint64_t{1})
      .add(1.0f)
      .add(1.0);
  launch(all, wrong_size);
  EXPECT_EQ(sync(), EINVAL);

  Args one;
  one.add(addr(0));
  LaunchDims zero;
  zero.grid[1] = 0;
  launch(shape, one, zero);
  EXPECT_EQ(sync(), EINVAL);

  launch((FunctionHandle{m} << 32) | 999, one);
  EXPECT_EQ(sync(), EINVAL);

  // An exception out of a kernel becomes EIO, not a dead stream thread.
  launch(function(m, "throws"), Args{});
  EXPECT_EQ(sync(), EIO);

  launch(shape, one);
  EXPECT_EQ(sync(), 0) << "the stream must keep working after failed launches";
}

TEST_F(SimModules, TwoLoadsOfOneImageAreSeparateCopies) {
  const ModuleHandle a = load();
  const ModuleHandle b = load();
  ASSERT_NE(a, b);
  const FunctionHandle ca = function(a, "count");
  const FunctionHandle cb = function(b, "count");
  Args at0, at4;
  at0.add(addr(0));
  at4.add(addr(4));
  launch(ca, at0);
  launch(ca, at0);
  launch(cb, at4);
  ASSERT_EQ(sync(), 0);
  const auto out = read(0, 8);
  std::int32_t v[2];
  std::memcpy(v, out.data(), 8);
  EXPECT_EQ(v[0], 2);
  EXPECT_EQ(v[1], 1) << "the second load shares the first's statics";
}

TEST_F(SimModules, ReloadingAfterUnloadGetsAFreshCopy) {
  // The same /proc/self/fd/N name comes back after an unload; dlopen must load the
  // new image, not return a stale object by name.
  for (int round = 0; round < 20; ++round) {
    const ModuleHandle m = load();
    Args a;
    a.add(addr(0));
    launch(function(m, "count"), a);
    ASSERT_EQ(sync(), 0);
    const auto out = read(0, 4);
    std::int32_t v;
    std::memcpy(&v, out.data(), 4);
    ASSERT_EQ(v, 1) << "round " << round;
    dev_.unload_module(m);
  }
}

TEST_F(SimModules, UnloadWhileALaunchIsQueuedKeepsTheCodeLoaded) {
  const ModuleHandle m = load();
  const FunctionHandle f = function(m, "count");
  dev_.spin(stream_, 50'000, 1.0);  // keeps the launch queued behind it
  Args a;
  a.add(addr(0));
  launch(f, a);
  dev_.unload_module(m);
  ASSERT_EQ(sync(), 0);
  const auto out = read(0, 4);
  std::int32_t v;
  std::memcpy(&v, out.data(), 4);
  EXPECT_EQ(v, 1);
  // The handle is gone for new lookups and launches.
  FunctionHandle g = 0;
  std::vector<std::uint32_t> sizes;
  std::string why;
  EXPECT_EQ(dev_.get_function(m, "count", g, sizes, why), ENOENT);
  launch(f, a);
  EXPECT_EQ(sync(), EINVAL);
}

TEST_F(SimModules, DeviceAddressIsTheHostMappingOfTheOffset) {
  EXPECT_EQ(addr(4096) - addr(0), 4096u);
  const std::uint32_t value = 0x5a1a5;
  std::memcpy(reinterpret_cast<void*>(addr(100)), &value, 4);
  const auto out = read(100, 4);
  std::uint32_t back;
  std::memcpy(&back, out.data(), 4);
  EXPECT_EQ(back, value);
}

}  // namespace
