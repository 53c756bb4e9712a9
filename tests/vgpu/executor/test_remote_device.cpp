// RemoteDevice against real executor processes running a SimDevice: this test
// binary is its own executor (main() below dispatches on --executor-gpu, as
// salusd does), so every test exercises the fork/exec, the socket protocol and
// the shared staging area for real.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "tests/support/recording_sink.hpp"
#include "vgpu/executor/executor_main.hpp"
#include "vgpu/executor/remote_device.hpp"

namespace salus::vgpu::executor {
namespace {

using namespace std::chrono_literals;

using salus::test::RecordingSink;

RemoteOptions sim_options(Bytes staging = Bytes{8} << 20) {
  RemoteOptions o;
  o.executor.backend = "sim";
  o.executor.sim_memory = Bytes{64} << 20;
  o.executor.log_level = "warn";
  o.staging_bytes = staging;
  o.backoff_initial = 10ms;
  return o;
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds limit = 20s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

// The executor is up again after a restart (a new pid, running).
bool wait_restarted(RemoteDevice& d, pid_t old) {
  return wait_until([&] {
    const DeviceHealth h = d.health();
    return h.executor_pid > 0 && h.executor_pid != old;
  });
}

// Children of this process that still exist (zombies included), whichever of
// its threads started them.
int live_children() {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "children");
    for (long pid; in >> pid;) ++n;
  }
  return n;
}

std::vector<std::uint8_t> read_module() {
  const char* path = std::getenv("SALUS_TEST_SIM_MODULE");
  if (path == nullptr) return {};
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(RemoteDevice, FillCopyAndReadBack) {
  RecordingSink sink;
  RemoteDevice d(sim_options());
  d.set_sink(&sink);
  EXPECT_EQ(d.info().backend, "sim");
  EXPECT_EQ(d.info().arena_size, Bytes{64} << 20);
  EXPECT_EQ(d.health().isolation, "process");
  EXPECT_GT(d.executor_pid(), 0);
  const StreamId s = d.create_stream();
  d.fill(s, 0, 4096, 0x01020304, 4);
  d.copy(s, 8192, 0, 4096);
  std::vector<std::uint32_t> out(1024, 0);
  d.copy_to_host(s, out.data(), 8192, 4096);
  d.notify(s, 1);
  ASSERT_EQ(sink.status_of(1), 0);
  for (std::uint32_t v : out) ASSERT_EQ(v, 0x01020304u);
  d.destroy_stream(s);
}

TEST(RemoteDevice, CompletionsKeepEachStreamsOrder) {
  RecordingSink sink;
  RemoteDevice d(sim_options(Bytes{1} << 20));
  d.set_sink(&sink);
  const StreamId a = d.create_stream(), b = d.create_stream();
  std::vector<std::vector<std::uint32_t>> back(200, std::vector<std::uint32_t>(64));
  for (std::uint32_t i = 0; i < 200; ++i) {
    const StreamId s = i % 2 ? b : a;
    const DevOffset at = (i % 2) * 4096;
    std::vector<std::uint32_t> v(64, i);
    d.copy_from_host(s, at, v.data(), 256);
    d.copy_to_host(s, back[i].data(), at, 256);
    d.notify(s, 1000 + i);
  }
  ASSERT_EQ(sink.status_of(1198), 0);
  ASSERT_EQ(sink.status_of(1199), 0);
  std::map<StreamId, std::uint64_t> last;
  for (const RecordingSink::Event& x : sink.events()) {
    EXPECT_EQ(x.status, 0);
    EXPECT_GT(x.token, last[x.stream]) << "stream " << x.stream;
    last[x.stream] = x.token;
  }
  for (std::uint32_t i = 0; i < 200; ++i) ASSERT_EQ(back[i][63], i) << i;
}

TEST(RemoteDevice, HostCopiesLargerThanTheStagingAreaAreSplit) {
  RecordingSink sink;
  // 1 MiB of staging for 5 MiB copies: both directions need several rounds of
  // the ring within one notify interval, so the device fences its own slots.
  RemoteDevice d(sim_options(Bytes{1} << 20));
  d.set_sink(&sink);
  const StreamId s = d.create_stream();
  const std::size_t n = 5u << 20;
  std::vector<std::uint8_t> in(n), out(n, 0);
  for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<std::uint8_t>(i * 7 + i / 4096);
  d.copy_from_host(s, 4096, in.data(), n);
  d.copy_to_host(s, out.data(), 4096, n);
  d.notify(s, 1);
  ASSERT_EQ(sink.status_of(1), 0);
  EXPECT_TRUE(std::memcmp(in.data(), out.data(), n) == 0);
  // The fences are internal: the sink saw exactly one completion.
  EXPECT_EQ(sink.events().size(), 1u);
}

TEST(RemoteDevice, ModulesAndHandlesSurviveAnExecutorRestart) {
  const std::vector<std::uint8_t> image = read_module();
  if (image.empty()) GTEST_SKIP() << "SALUS_TEST_SIM_MODULE not set";
  RecordingSink sink;
  RemoteDevice d(sim_options());
  d.set_sink(&sink);
  const StreamId s = d.create_stream();
  ModuleHandle m = 0;
  std::string why;
  ASSERT_EQ(d.load_module(image, m, why), 0) << why;
  FunctionHandle count = 0;
  std::vector<std::uint32_t> sizes;
  ASSERT_EQ(d.get_function(m, "count", count, sizes, why), 0) << why;
  EXPECT_EQ(sizes, std::vector<std::uint32_t>{8});

  auto run_count = [&](std::uint64_t token) {
    const std::uint64_t out = d.device_address(0);
    const std::uint32_t arg_size = 8;
    d.launch(s, count, LaunchDims{}, reinterpret_cast<const std::uint8_t*>(&out), &arg_size, 1);
    std::int32_t value = -1;
    d.copy_to_host(s, &value, 0, 4);
    d.notify(s, token);
    EXPECT_EQ(sink.status_of(token), 0);
    return value;
  };
  EXPECT_EQ(run_count(1), 1);
  EXPECT_EQ(run_count(2), 2);  // the module's static counter

  const pid_t old = d.executor_pid();
  d.spin(s, 2'000'000, 1.0);  // in flight when the executor dies
  d.notify(s, 3);
  ::kill(old, SIGKILL);
  EXPECT_EQ(sink.status_of(3), EIO);  // killed from outside: nobody's kernel is blamed
  ASSERT_TRUE(wait_restarted(d, old));
  EXPECT_EQ(d.generation(), 1u);
  const DeviceHealth h = d.health();
  EXPECT_EQ(h.restarts, 1u);
  EXPECT_NE(h.last_restart.find("SIGKILL"), std::string::npos) << h.last_restart;
  EXPECT_TRUE(h.last_fault.empty()) << h.last_fault;

  // Same stream id, same function handle; a freshly loaded copy of the module.
  EXPECT_EQ(run_count(4), 1);
  FunctionHandle again = 0;
  ASSERT_EQ(d.get_function(m, "count", again, sizes, why), 0);
  EXPECT_EQ(again, count);
  d.unload_module(m);
  d.destroy_stream(s);
}

TEST(RemoteDevice, ACrashingKernelIsBlamedOnItsStreamOnly) {
  const std::vector<std::uint8_t> image = read_module();
  if (image.empty()) GTEST_SKIP() << "SALUS_TEST_SIM_MODULE not set";
  RecordingSink sink;
  RemoteDevice d(sim_options());
  d.set_sink(&sink);
  const StreamId culprit = d.create_stream(), bystander = d.create_stream();
  ModuleHandle m = 0;
  std::string why;
  ASSERT_EQ(d.load_module(image, m, why), 0) << why;
  FunctionHandle crash = 0;
  std::vector<std::uint32_t> sizes;
  ASSERT_EQ(d.get_function(m, "crash_store", crash, sizes, why), 0) << why;

  d.spin(bystander, 500'000, 0.1);
  d.notify(bystander, 1);
  d.spin(culprit, 50'000, 0.1);  // the bystander is surely running by then
  const std::uint64_t bad = 8;
  const std::uint32_t arg_size = 8;
  d.launch(culprit, crash, LaunchDims{}, reinterpret_cast<const std::uint8_t*>(&bad), &arg_size, 1);
  d.notify(culprit, 2);
  const pid_t old = d.executor_pid();
  EXPECT_EQ(sink.status_of(2), EFAULT);
  EXPECT_EQ(sink.status_of(1), EIO);
  EXPECT_EQ(d.generation(), 1u);
  EXPECT_NE(d.health().last_fault.find("SIGSEGV"), std::string::npos) << d.health().last_fault;
  ASSERT_TRUE(wait_restarted(d, old));

  // Both streams work on the new executor, and its memory reads as zero.
  std::vector<std::uint32_t> out(16, 99);
  d.copy_to_host(culprit, out.data(), 0, 64);
  d.notify(culprit, 3);
  d.fill(bystander, 4096, 64, 5, 4);
  d.notify(bystander, 4);
  EXPECT_EQ(sink.status_of(3), 0);
  EXPECT_EQ(sink.status_of(4), 0);
  EXPECT_EQ(out, std::vector<std::uint32_t>(16, 0));
}

TEST(RemoteDevice, RepeatedQuickDeathsTakeTheGpuOutOfService) {
  RecordingSink sink;
  RemoteOptions o = sim_options();
  o.max_quick_failures = 3;
  o.quick_death = 5000ms;
  RemoteDevice d(o);
  d.set_sink(&sink);
  const StreamId s = d.create_stream();
  for (int i = 0; i < 3; ++i) {
    const pid_t pid = d.executor_pid();
    ASSERT_GT(pid, 0);
    ::kill(pid, SIGKILL);
    if (i < 2) {
      ASSERT_TRUE(wait_restarted(d, pid)) << i;
    }
  }
  ASSERT_TRUE(wait_until([&] { return !d.health().usable; }));
  EXPECT_NE(d.health().unusable_why.find("3 times in a row"), std::string::npos)
      << d.health().unusable_why;
  d.fill(s, 0, 64, 1, 1);
  d.notify(s, 7);
  EXPECT_EQ(sink.status_of(7), ENODEV);
  std::string why;
  ModuleHandle m;
  EXPECT_EQ(d.load_module({1, 2, 3}, m, why), ENODEV);
  EXPECT_EQ(d.executor_pid(), -1);
}

TEST(RemoteDevice, ExecutorsAreReapedAndAnExecutorThatCannotOpenItsGpuSaysWhy) {
  const int before = live_children();
  {
    RemoteDevice d(sim_options());
    EXPECT_EQ(live_children(), before + 1);
  }
  EXPECT_EQ(live_children(), before);
  RemoteOptions o = sim_options();
  o.executor.sim_memory = Bytes{1} << 62;  // no address space for that
  try {
    RemoteDevice d(o);
    FAIL() << "a device that cannot open must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reserve"), std::string::npos) << e.what();
  }
  EXPECT_EQ(live_children(), before);
}

TEST(StagingRing, AllocatesInOrderAndFreesInAnyOrder) {
  StagingRing r(1024);
  std::uint64_t a, b, c, d;
  ASSERT_TRUE(r.allocate(400, a));
  ASSERT_TRUE(r.allocate(400, b));
  EXPECT_FALSE(r.allocate(400, c));  // 832 used, 192 left at the end
  r.free(b);                         // not the oldest: nothing comes back yet
  EXPECT_FALSE(r.allocate(400, c));
  r.free(a);  // both gone: the ring is empty again
  EXPECT_TRUE(r.empty());
  ASSERT_TRUE(r.allocate(600, a));
  ASSERT_TRUE(r.allocate(300, b));
  r.free(a);
  ASSERT_TRUE(r.allocate(500, c));  // wraps to the start
  EXPECT_EQ(c, 0u);
  EXPECT_FALSE(r.allocate(200, d));  // [512, 640) is free but too small
  r.free(b);
  r.free(c);
  EXPECT_TRUE(r.empty());
  EXPECT_TRUE(r.allocate(1024, d));
  EXPECT_FALSE(r.allocate(1025, d));
}

}  // namespace
}  // namespace salus::vgpu::executor

int main(int argc, char** argv) {
  // This binary is also the executor its RemoteDevices start.
  if (salus::vgpu::executor::is_executor_invocation(argc, argv))
    return salus::vgpu::executor::executor_main(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
