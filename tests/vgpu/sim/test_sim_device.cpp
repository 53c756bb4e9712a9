// Tests for the simulated GPU backend: op results, stream ordering, completion
// reports, contention timing, memory accounting and teardown.
#include "vgpu/sim/sim_device.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "tests/support/recording_sink.hpp"

namespace {

using salus::vgpu::Bytes;
using salus::vgpu::SimDevice;
using salus::vgpu::StreamId;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr Bytes kMiB = Bytes{1} << 20;
constexpr Bytes kGiB = Bytes{1} << 30;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
double ns_to_ms(std::int64_t ns) {
  return static_cast<double>(ns) / 1e6;
}

using salus::test::RecordingSink;

// A device with a sink and one stream, plus a synchronous "run everything queued
// so far" helper.
struct Fixture {
  explicit Fixture(Bytes size = 64 * kMiB) : dev(0, size) {
    dev.set_sink(&sink);
    s = dev.create_stream();
  }
  RecordingSink::Event sync() {
    const std::uint64_t token = next_token++;
    dev.notify(s, token);
    auto e = sink.wait(s, token);
    EXPECT_TRUE(e.has_value()) << "token " << token << " never completed";
    return e.value_or(RecordingSink::Event{});
  }
  std::vector<std::uint8_t> read(Bytes offset, Bytes length) {
    std::vector<std::uint8_t> out(length, 0xee);
    dev.copy_to_host(s, out.data(), offset, length);
    sync();
    return out;
  }

  RecordingSink sink;
  SimDevice dev;
  StreamId s = 0;
  std::uint64_t next_token = 1;
};

std::int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size_pages = 0, resident_pages = 0;
  statm >> size_pages >> resident_pages;
  return resident_pages * ::sysconf(_SC_PAGESIZE);
}

TEST(SimDevice, InfoDescribesASimulatedGpu) {
  SimDevice dev(3, 256 * kMiB);
  const auto& info = dev.info();
  EXPECT_EQ(info.index, 3);
  EXPECT_EQ(info.name, "Salus simulated GPU");
  EXPECT_EQ(info.backend, "sim");
  EXPECT_EQ(info.driver_version, "sim");
  EXPECT_EQ(info.total_memory, 256 * kMiB);
  EXPECT_EQ(info.arena_size, 256 * kMiB);
  EXPECT_GT(info.sm_count, 0u);
  EXPECT_EQ(info.uuid.rfind("GPU-", 0), 0u);
  EXPECT_EQ(info.uuid.size(), 40u);  // "GPU-" + 36-character UUID

  SimDevice same(3, kMiB, "other name");
  SimDevice other(4, kMiB);
  EXPECT_EQ(same.info().uuid, info.uuid);
  EXPECT_NE(other.info().uuid, info.uuid);
  EXPECT_EQ(same.info().name, "other name");
}

TEST(SimDevice, MappingFailureThrowsSystemError) {
  EXPECT_THROW(SimDevice(0, 0), std::system_error);
}

TEST(SimDevice, FillWidthOneSetsEveryByte) {
  Fixture f;
  f.dev.fill(f.s, 1000, 5000, 0x1234abcd, 1);
  auto got = f.read(999, 5002);
  EXPECT_EQ(got.front(), 0);  // untouched neighbours
  EXPECT_EQ(got.back(), 0);
  for (std::size_t i = 1; i <= 5000; ++i) ASSERT_EQ(got[i], 0xcd) << i;
}

TEST(SimDevice, FillWidthFourRepeatsTheLittleEndianElement) {
  Fixture f;
  // 4 KiB + 2: also covers a tail shorter than one element, and a length that
  // crosses the doubling chunk boundaries of the fill.
  const Bytes len = 4096 * 600 + 2;
  f.dev.fill(f.s, 256, len, 0x11223344, 4);
  auto got = f.read(0, 256 + len + 4);
  const std::uint8_t element[4] = {0x44, 0x33, 0x22, 0x11};
  for (std::size_t i = 0; i < 256; ++i) ASSERT_EQ(got[i], 0) << i;
  for (std::size_t i = 0; i < len; ++i) ASSERT_EQ(got[256 + i], element[i % 4]) << i;
  for (std::size_t i = 256 + len; i < got.size(); ++i) ASSERT_EQ(got[i], 0) << i;

  f.dev.fill(f.s, 0, 3, 0xaabbccdd, 4);  // shorter than one element
  auto small = f.read(0, 4);
  EXPECT_EQ(small, (std::vector<std::uint8_t>{0xdd, 0xcc, 0xbb, 0x00}));
}

TEST(SimDevice, FillWithBadWidthCompletesWithEinval) {
  Fixture f;
  f.dev.fill(f.s, 0, 64, 1, 3);
  EXPECT_EQ(f.sync().status, EINVAL);
  EXPECT_EQ(f.sync().status, 0);  // reported once, then cleared
}

TEST(SimDevice, CopyHasMemmoveSemanticsWhenRangesOverlap) {
  Fixture f;
  std::vector<std::uint8_t> pattern(1000);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::uint8_t>(i * 7);
  f.dev.copy_from_host(f.s, 4096, pattern.data(), pattern.size());
  f.dev.copy(f.s, 4096 + 100, 4096, 1000);  // forward overlap
  auto fwd = f.read(4096, 1100);
  for (std::size_t i = 0; i < 100; ++i) ASSERT_EQ(fwd[i], pattern[i]) << i;
  for (std::size_t i = 0; i < 1000; ++i) ASSERT_EQ(fwd[100 + i], pattern[i]) << i;

  f.dev.copy_from_host(f.s, 8192, pattern.data(), pattern.size());
  f.dev.copy(f.s, 8192 - 100, 8192, 1000);  // backward overlap
  auto back = f.read(8192 - 100, 1000);
  EXPECT_EQ(back, pattern);

  f.dev.copy(f.s, 20000, 8192 - 100, 1000);  // disjoint
  EXPECT_EQ(f.read(20000, 1000), pattern);
}

TEST(SimDevice, HostRoundTripAtSeveralOffsets) {
  const Bytes size = 16 * kMiB;
  Fixture f(size);
  std::mt19937 rng(7);
  for (Bytes offset :
       {Bytes{0}, Bytes{1}, Bytes{255}, Bytes{4093}, Bytes{kMiB + 17}, size - 4097, size - 1}) {
    const Bytes len = std::min<Bytes>(4097, size - offset);
    std::vector<std::uint8_t> data(len);
    for (auto& b : data) b = static_cast<std::uint8_t>(rng());
    f.dev.copy_from_host(f.s, offset, data.data(), len);
    EXPECT_EQ(f.read(offset, len), data) << "offset " << offset;
  }
}

// C = A * B with the obvious triple loop in double, for reference.
std::vector<float> naive_gemm(const std::vector<float>& a, const std::vector<float>& b,
                              std::uint32_t m, std::uint32_t n, std::uint32_t k) {
  std::vector<float> c(std::size_t{m} * n);
  for (std::uint32_t i = 0; i < m; ++i)
    for (std::uint32_t j = 0; j < n; ++j) {
      double sum = 0;
      for (std::uint32_t x = 0; x < k; ++x) sum += static_cast<double>(a[i * k + x]) * b[x * n + j];
      c[i * n + j] = static_cast<float>(sum);
    }
  return c;
}

std::vector<float> random_matrix(std::mt19937& rng, std::size_t count) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> run_gemm(Fixture& f, const std::vector<float>& a, const std::vector<float>& b,
                            std::uint32_t m, std::uint32_t n, std::uint32_t k, Bytes a_off,
                            Bytes b_off, Bytes c_off) {
  f.dev.copy_from_host(f.s, a_off, a.data(), a.size() * sizeof(float));
  f.dev.copy_from_host(f.s, b_off, b.data(), b.size() * sizeof(float));
  f.dev.fill(f.s, c_off, std::size_t{m} * n * sizeof(float), 0x7fc00000,
             4);  // NaN: must be overwritten
  f.dev.gemm(f.s, m, n, k, a_off, b_off, c_off);
  std::vector<float> c(std::size_t{m} * n);
  f.dev.copy_to_host(f.s, c.data(), c_off, c.size() * sizeof(float));
  EXPECT_EQ(f.sync().status, 0);
  return c;
}

TEST(SimDevice, GemmMatchesNaiveReference) {
  Fixture f;
  std::mt19937 rng(42);
  struct Shape {
    std::uint32_t m, n, k;
  };
  for (Shape s : {Shape{33, 17, 29}, Shape{1, 1, 1}, Shape{64, 64, 64}, Shape{5, 130, 3}}) {
    auto a = random_matrix(rng, std::size_t{s.m} * s.k);
    auto b = random_matrix(rng, std::size_t{s.k} * s.n);
    auto want = naive_gemm(a, b, s.m, s.n, s.k);
    // Odd offsets too: arena offsets are normally aligned, but need not be.
    for (Bytes skew : {Bytes{0}, Bytes{2}}) {
      auto got = run_gemm(f, a, b, s.m, s.n, s.k, 0 + skew, kMiB + skew, 2 * kMiB + skew);
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t i = 0; i < want.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-4f)
            << s.m << "x" << s.n << "x" << s.k << " skew " << skew << " at " << i;
    }
  }
}

TEST(SimDevice, GemmWithIdentityReturnsTheOtherOperand) {
  Fixture f;
  std::mt19937 rng(1);
  const std::uint32_t n = 24, k = 24, m = 10;
  auto a = random_matrix(rng, std::size_t{m} * k);
  std::vector<float> identity(std::size_t{k} * n, 0.0f);
  for (std::uint32_t i = 0; i < k; ++i) identity[i * n + i] = 1.0f;
  EXPECT_EQ(run_gemm(f, a, identity, m, n, k, 0, kMiB, 2 * kMiB), a);

  // C aliasing A (square case, in place) must still give A * I = A.
  auto sq = random_matrix(rng, std::size_t{n} * n);
  f.dev.copy_from_host(f.s, 0, sq.data(), sq.size() * sizeof(float));
  f.dev.copy_from_host(f.s, kMiB, identity.data(), identity.size() * sizeof(float));
  f.dev.gemm(f.s, n, n, n, 0, kMiB, 0);
  std::vector<float> got(sq.size());
  f.dev.copy_to_host(f.s, got.data(), 0, got.size() * sizeof(float));
  f.sync();
  EXPECT_EQ(got, sq);
}

TEST(SimDevice, NotifyTokensArriveInOrderAfterTheirOps) {
  Fixture f;
  const auto t0 = Clock::now();
  std::vector<std::uint32_t> host(5, 0);
  for (std::uint32_t i = 0; i < 5; ++i) {
    f.dev.spin(f.s, 10'000, 1.0);
    f.dev.fill(f.s, i * 256, 4, 100 + i, 4);
    f.dev.copy_to_host(f.s, &host[i], i * 256, 4);
    f.dev.notify(f.s, 1000 + i);
  }
  ASSERT_TRUE(f.sink.wait(f.s, 1004));
  auto events = f.sink.events();
  ASSERT_EQ(events.size(), 5u);
  for (std::uint32_t i = 0; i < 5; ++i) {
    EXPECT_EQ(events[i].token, 1000 + i);
    EXPECT_EQ(events[i].status, 0);
    EXPECT_EQ(host[i], 100 + i);
    // Token i follows i+1 spins of 10 ms on this stream.
    EXPECT_GE(ms_between(t0, events[i].at), 10.0 * (i + 1) - 1) << i;
  }
}

TEST(SimDevice, DeviceNsCountsOpTimeNotIdleTime) {
  Fixture f;
  f.dev.spin(f.s, 50'000, 1.0);
  auto first = f.sync();
  EXPECT_GE(ns_to_ms(first.device_ns), 49.0);
  EXPECT_LT(ns_to_ms(first.device_ns), 300.0);

  // The stream idles 80 ms before the next spin; that must not count.
  std::this_thread::sleep_for(milliseconds(80));
  f.dev.spin(f.s, 30'000, 0.2);
  auto second = f.sync();
  EXPECT_GE(ns_to_ms(second.device_ns), 29.0);
  EXPECT_LT(ns_to_ms(second.device_ns), 75.0);

  auto empty = f.sync();  // nothing ran since the last notify
  EXPECT_LT(ns_to_ms(empty.device_ns), 5.0);
}

// Two spins of `usec` at `util` on two streams, started together; returns the
// completion times in ms and checks each stream's device_ns against them.
std::pair<double, double> race_two_spins(std::uint64_t usec, double util) {
  RecordingSink sink;
  SimDevice dev(0, kMiB);
  dev.set_sink(&sink);
  const StreamId a = dev.create_stream(), b = dev.create_stream();
  const auto t0 = Clock::now();
  dev.spin(a, usec, util);
  dev.notify(a, 1);
  dev.spin(b, usec, util);
  dev.notify(b, 2);
  auto ea = sink.wait(a, 1), eb = sink.wait(b, 2);
  if (!ea || !eb) {
    ADD_FAILURE() << "spins never completed";
    return {0, 0};
  }
  const double ma = ms_between(t0, ea->at), mb = ms_between(t0, eb->at);
  EXPECT_LE(ns_to_ms(ea->device_ns), ma + 1);
  EXPECT_LE(ns_to_ms(eb->device_ns), mb + 1);
  const double alone_ms = static_cast<double>(usec) / 1000.0;
  EXPECT_GE(ns_to_ms(ea->device_ns), alone_ms - 1);
  EXPECT_GE(ns_to_ms(eb->device_ns), alone_ms - 1);
  return {ma, mb};
}

TEST(SimDevice, TwoFullUtilSpinsShareTheGpu) {
  auto [a, b] = race_two_spins(100'000, 1.0);
  // The pair is 200 ms of whole-GPU work, so the later one cannot end sooner. On a
  // loaded machine one stream may start a little late and the other finish a
  // little early, but still well past the 100 ms it would take alone.
  EXPECT_GE(std::max(a, b), 195.0);
  EXPECT_GE(std::min(a, b), 140.0);
  EXPECT_LT(std::max(a, b), 600.0);
}

TEST(SimDevice, TwoHalfUtilSpinsRunSideBySide) {
  auto [a, b] = race_two_spins(100'000, 0.5);
  EXPECT_GE(a, 99.0);
  EXPECT_GE(b, 99.0);
  EXPECT_LT(a, 170.0);  // well short of the 200 ms a serialized pair would take
  EXPECT_LT(b, 170.0);
}

TEST(SimDevice, SpinRatesFollowKernelsStartingAndEnding) {
  RecordingSink sink;
  SimDevice dev(0, kMiB);
  dev.set_sink(&sink);
  const StreamId a = dev.create_stream(), b = dev.create_stream();
  const auto t0 = Clock::now();
  dev.spin(a, 200'000, 1.0);
  dev.notify(a, 1);
  std::this_thread::sleep_for(milliseconds(100));
  const double s = ms_between(t0, Clock::now());
  dev.spin(b, 200'000, 1.0);
  dev.notify(b, 2);
  auto ea = sink.wait(a, 1), eb = sink.wait(b, 2);
  ASSERT_TRUE(ea && eb);
  // A runs alone until s, then at half speed: done at 400 - s (about 300), not at
  // 200 as if B's start did not slow it.
  const double ma = ms_between(t0, ea->at);
  // (B's stream may start it some ms after s on a loaded machine, shortening A.)
  EXPECT_GE(ma, 400.0 - s - 40);
  EXPECT_GE(ma, 230.0);
  EXPECT_LT(ma, 400.0 - s + 90);
  // Both together are 400 ms of full-GPU work. B must speed up when A ends; at the
  // half rate it saw when it started it would end near s + 400 (about 500).
  const double mb = ms_between(t0, eb->at);
  EXPECT_GE(mb, 390.0);
  EXPECT_LT(mb, std::min(s + 390.0, 490.0));
}

TEST(SimDevice, BusyNsCountsOverlappingOpsOnce) {
  RecordingSink sink;
  const auto t0 = Clock::now();
  SimDevice dev(0, kMiB);
  EXPECT_EQ(dev.busy_ns(), 0);
  dev.set_sink(&sink);
  const StreamId a = dev.create_stream(), b = dev.create_stream();
  dev.spin(a, 100'000, 0.5);
  dev.notify(a, 1);
  dev.spin(b, 100'000, 0.5);
  dev.notify(b, 2);
  ASSERT_TRUE(sink.wait(a, 1) && sink.wait(b, 2));
  const double busy = ns_to_ms(dev.busy_ns());
  EXPECT_GE(busy, 99.0);
  EXPECT_LT(busy, 170.0);  // not the 200 ms of the two spins summed
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_NEAR(ns_to_ms(dev.busy_ns()), busy, 0.001);  // idle time is not busy
  EXPECT_LE(busy, ms_between(t0, Clock::now()));
}

TEST(SimDevice, LargeSparseDeviceKeepsRssSmall) {
  std::ifstream overcommit("/proc/sys/vm/overcommit_memory");
  int mode = 0;
  if (overcommit >> mode && mode == 2)
    GTEST_SKIP() << "vm.overcommit_memory=2 (strict) refuses a 16 GiB MAP_NORESERVE mapping";
  const std::int64_t before = rss_bytes();
  Fixture f(16 * kGiB);
  const std::int64_t after = rss_bytes();
  EXPECT_LT(after - before, static_cast<std::int64_t>(32 * kMiB));
  EXPECT_EQ(f.dev.info().total_memory, 16 * kGiB);

  // The far end is usable, and touching it costs a page, not gigabytes.
  f.dev.fill(f.s, 16 * kGiB - 4096, 4096, 0x5a, 1);
  auto got = f.read(16 * kGiB - 8, 8);
  EXPECT_EQ(got, std::vector<std::uint8_t>(8, 0x5a));
  EXPECT_LT(rss_bytes() - before, static_cast<std::int64_t>(32 * kMiB));
}

TEST(SimDevice, DiscardZeroesWholePagesAndReturnsMemory) {
  Fixture f(128 * kMiB);
  const Bytes page = static_cast<Bytes>(::sysconf(_SC_PAGESIZE));
  const std::int64_t before = rss_bytes();
  f.dev.fill(f.s, 0, 64 * kMiB, 0xab, 1);
  f.sync();
  const std::int64_t filled = rss_bytes();
  EXPECT_GE(filled - before, static_cast<std::int64_t>(60 * kMiB));

  // Exactly the range reads as zero afterwards (whole pages are dropped, partial
  // ones cleared); the half pages outside it belong to someone else and stay.
  f.dev.discard(page / 2, 64 * kMiB - page);
  EXPECT_LE(rss_bytes(), filled - static_cast<std::int64_t>(60 * kMiB));
  auto head = f.read(0, 2 * page);
  for (Bytes i = 0; i < page / 2; ++i) ASSERT_EQ(head[i], 0xab) << i;
  for (Bytes i = page / 2; i < 2 * page; ++i) ASSERT_EQ(head[i], 0) << i;
  auto tail = f.read(64 * kMiB - 2 * page, 2 * page);
  for (Bytes i = 0; i < page + page / 2; ++i) ASSERT_EQ(tail[i], 0) << i;
  for (Bytes i = page + page / 2; i < 2 * page; ++i) ASSERT_EQ(tail[i], 0xab) << i;

  // Discarded memory is still usable.
  f.dev.fill(f.s, 10 * page, 8, 0x77, 1);
  EXPECT_EQ(f.read(10 * page, 8), std::vector<std::uint8_t>(8, 0x77));
}

TEST(SimDevice, DestroyStreamRunsPendingOpsFirst) {
  RecordingSink sink;
  SimDevice dev(0, kMiB);
  dev.set_sink(&sink);
  const StreamId s = dev.create_stream();
  std::uint32_t host = 0;
  dev.spin(s, 50'000, 1.0);
  dev.fill(s, 512, 4, 0xfeedbeef, 4);
  dev.copy_to_host(s, &host, 512, 4);
  dev.notify(s, 7);
  const auto t0 = Clock::now();
  dev.destroy_stream(s);
  EXPECT_GE(ms_between(t0, Clock::now()), 40.0);  // it waited for the spin
  EXPECT_TRUE(sink.find(s, 7).has_value());
  EXPECT_EQ(host, 0xfeedbeefu);
  EXPECT_THROW(dev.notify(s, 8), std::invalid_argument);
  EXPECT_THROW(dev.destroy_stream(s), std::invalid_argument);
}

TEST(SimDevice, DestructorFinishesQueuedOps) {
  RecordingSink sink;
  std::uint32_t host = 0;
  StreamId s = 0;
  {
    SimDevice dev(0, kMiB);
    dev.set_sink(&sink);
    s = dev.create_stream();
    dev.spin(s, 20'000, 1.0);
    dev.fill(s, 0, 4, 0x01020304, 4);
    dev.copy_to_host(s, &host, 0, 4);
    dev.notify(s, 1);
  }
  EXPECT_EQ(host, 0x01020304u);
  EXPECT_TRUE(sink.find(s, 1).has_value());
}

TEST(SimDevice, StreamIdsAreSmallAndReused) {
  SimDevice dev(0, kMiB);
  const StreamId a = dev.create_stream(), b = dev.create_stream(), c = dev.create_stream();
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1u);
  EXPECT_EQ(c, 2u);
  dev.destroy_stream(b);
  EXPECT_EQ(dev.create_stream(), 1u);
  EXPECT_EQ(dev.create_stream(), 3u);
}

TEST(SimDevice, OutOfRangeOpCompletesWithEfaultThenRecovers) {
  Fixture f(kMiB);
  std::vector<std::uint8_t> buf(64);
  f.dev.copy_to_host(f.s, buf.data(), kMiB - 32, 64);
  f.dev.fill(f.s, 0, 4, 0x09, 1);  // later ops still run
  auto e = f.sync();
  EXPECT_EQ(e.status, EFAULT);
  EXPECT_EQ(f.read(0, 4), std::vector<std::uint8_t>(4, 0x09));
  EXPECT_EQ(f.sync().status, 0);
  f.dev.gemm(f.s, 1u << 31, 1u << 31, 4, 0, 0, 0);  // size overflows 64 bits
  EXPECT_EQ(f.sync().status, EFAULT);
}

TEST(SimDevice, OpsOnUnknownStreamThrow) {
  SimDevice dev(0, kMiB);
  EXPECT_THROW(dev.spin(5, 1, 1.0), std::invalid_argument);
  EXPECT_THROW(dev.destroy_stream(0), std::invalid_argument);
}

TEST(SimDevice, NoSinkIsHarmless) {
  SimDevice dev(0, kMiB);
  const StreamId s = dev.create_stream();
  dev.fill(s, 0, 16, 1, 1);
  dev.notify(s, 1);
  dev.destroy_stream(s);
}

TEST(SimDevice, StressEightStreamsWhileStreamsComeAndGo) {
  constexpr int kStreams = 8;
  constexpr std::uint32_t kOps = 1000;
  constexpr Bytes kRegion = 64 * 1024;
  RecordingSink sink;
  SimDevice dev(0, 4 * kMiB);
  dev.set_sink(&sink);

  std::vector<StreamId> ids;
  for (int i = 0; i < kStreams; ++i) ids.push_back(dev.create_stream());
  std::vector<std::vector<std::uint32_t>> results(kStreams, std::vector<std::uint32_t>(kOps / 100));

  std::atomic<bool> done{false};
  // Creates and destroys extra streams (with a little work) while the others run.
  std::thread churn([&] {
    while (!done.load()) {
      const StreamId x = dev.create_stream();
      dev.fill(x, 3 * kMiB, 256, 0xff, 1);
      dev.spin(x, 50, 0.3);
      dev.notify(x, 0);
      dev.destroy_stream(x);
    }
  });

  std::vector<std::thread> producers;
  for (int t = 0; t < kStreams; ++t) {
    producers.emplace_back([&, t] {
      const StreamId s = ids[t];
      const Bytes base = t * kRegion;
      for (std::uint32_t i = 0; i < kOps; ++i) {
        switch (i % 4) {
          case 0:
            dev.fill(s, base, 256, i, 4);
            break;
          case 1:
            dev.copy(s, base + 256, base, 256);
            break;
          case 2:
            dev.spin(s, 20, 0.25);
            break;
          case 3:
            if (i % 100 == 99) {
              dev.copy_to_host(s, &results[t][i / 100], base + 256 + 4 * (i % 64), 4);
              dev.notify(s, i / 100);
            } else {
              dev.copy(s, base + 512, base + 256, 256);
            }
            break;
        }
      }
    });
  }
  for (auto& p : producers) p.join();
  for (int t = 0; t < kStreams; ++t)
    ASSERT_TRUE(sink.wait(ids[t], kOps / 100 - 1, milliseconds(8000)));
  done = true;
  churn.join();

  auto events = sink.events();
  for (int t = 0; t < kStreams; ++t) {
    std::vector<std::uint64_t> tokens;
    for (const auto& e : events)
      if (e.stream == ids[t]) {
        EXPECT_EQ(e.status, 0);
        tokens.push_back(e.token);
      }
    std::vector<std::uint64_t> want(kOps / 100);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = i;
    EXPECT_EQ(tokens, want) << "stream " << t;
    // At op i (i % 100 == 99) the latest fill was at i - 3 and copied at i - 2.
    for (std::uint32_t k = 0; k < kOps / 100; ++k)
      EXPECT_EQ(results[t][k], k * 100 + 96) << "stream " << t << " checkpoint " << k;
  }
}

}  // namespace
