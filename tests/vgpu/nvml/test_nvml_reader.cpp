// The NVML reader and sampler against mock_libnvidia_ml.cpp (a host-only
// libnvidia-ml.so.1 first on LD_LIBRARY_PATH): loading, matching GPUs by UUID
// rather than index, unsupported and failing readings, a missing library, and
// a sampler whose readers never reach the driver.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "vgpu/nvml/nvml_reader.hpp"
#include "vgpu/nvml/nvml_sampler.hpp"

using namespace salus::vgpu;
using namespace salus::vgpu::nvml;
using namespace std::chrono_literals;

namespace {

const std::string kA = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const std::string kB = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

// The mock's test hooks, from the copy the reader loaded.
unsigned calls(const char* name) {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return 0;
  auto fn = reinterpret_cast<unsigned (*)(const char*)>(::dlsym(lib, "mock_nvml_calls"));
  const unsigned n = fn ? fn(name) : 0;
  ::dlclose(lib);
  return n;
}
int refs() {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return -1;
  auto fn = reinterpret_cast<int (*)()>(::dlsym(lib, "mock_nvml_refs"));
  const int n = fn ? fn() : -1;
  ::dlclose(lib);
  return n;
}

class Nvml : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"MOCK_NVML_DEVICES", "MOCK_NVML_UNSUPPORTED", "MOCK_NVML_LOST",
                          "MOCK_NVML_INIT", "MOCK_NVML_PROCESSES"})
      ::unsetenv(v);
    // NVML numbers them B, A: the reader must go by UUID, not by position.
    ::setenv("MOCK_NVML_DEVICES", (kB + "," + kA).c_str(), 1);
  }
};

TEST_F(Nvml, MatchesGpusByUuidNotIndex) {
  NvmlReader r({kA, kB});
  ASSERT_TRUE(r.available(0)) << r.why_not(0);
  ASSERT_TRUE(r.available(1)) << r.why_not(1);
  std::string err;
  const GpuReadings a = r.read(0, err);  // NVML index 1
  EXPECT_EQ(err, "");
  ASSERT_TRUE(a.sm_util && a.mem_util && a.power_w && a.energy_j && a.temperature_c);
  EXPECT_DOUBLE_EQ(*a.sm_util, 0.38);
  EXPECT_DOUBLE_EQ(*a.mem_util, 0.13);
  EXPECT_DOUBLE_EQ(*a.power_w, 72.234);   // mW to W
  EXPECT_DOUBLE_EQ(*a.energy_j, 2000.0);  // mJ to J
  EXPECT_DOUBLE_EQ(*a.temperature_c, 41.0);
  const GpuReadings b = r.read(1, err);  // NVML index 0
  ASSERT_TRUE(b.sm_util && b.power_w);
  EXPECT_DOUBLE_EQ(*b.sm_util, 0.37);
  EXPECT_DOUBLE_EQ(*b.power_w, 71.234);
  // The energy counter moves between reads, as the real one does.
  EXPECT_GT(*r.read(0, err).energy_j, *a.energy_j);
}

TEST_F(Nvml, UnknownOrMissingUuidIsUnavailableWithTheReason) {
  NvmlReader r({kA, "GPU-cccccccc-0000-0000-0000-000000000000", ""});
  EXPECT_TRUE(r.available(0));
  EXPECT_FALSE(r.available(1));
  EXPECT_NE(r.why_not(1).find("GPU-cccccccc"), std::string::npos) << r.why_not(1);
  EXPECT_NE(r.why_not(1).find("Not Found"), std::string::npos) << r.why_not(1);
  EXPECT_FALSE(r.available(2));
  EXPECT_NE(r.why_not(2).find("no UUID"), std::string::npos) << r.why_not(2);
  std::string err;
  const GpuReadings none = r.read(1, err);
  EXPECT_FALSE(none.sm_util || none.power_w || none.energy_j);
  EXPECT_FALSE(r.available(7));
}

TEST_F(Nvml, UnsupportedReadingIsAbsentAndNotAskedAgain) {
  ::setenv("MOCK_NVML_UNSUPPORTED", (kA + ":energy," + kA + ":temperature").c_str(), 1);
  NvmlReader r({kA, kB});
  const unsigned before = calls("nvmlDeviceGetTotalEnergyConsumption");
  std::string err;
  for (int i = 0; i < 3; ++i) {
    const GpuReadings a = r.read(0, err);
    EXPECT_EQ(err, "") << "NOT_SUPPORTED is not an error";
    EXPECT_FALSE(a.energy_j.has_value());
    EXPECT_FALSE(a.temperature_c.has_value());
    EXPECT_TRUE(a.sm_util.has_value());
    EXPECT_TRUE(a.power_w.has_value());
  }
  EXPECT_EQ(calls("nvmlDeviceGetTotalEnergyConsumption") - before, 1u);
  // The other GPU still has its energy counter.
  EXPECT_TRUE(r.read(1, err).energy_j.has_value());
}

TEST_F(Nvml, FailingReadingIsAbsentReportedAndRetried) {
  ::setenv("MOCK_NVML_LOST", kA.c_str(), 1);
  NvmlReader r({kA, kB});
  ASSERT_TRUE(r.available(0));
  std::string err;
  const unsigned before = calls("nvmlDeviceGetPowerUsage");
  const GpuReadings a = r.read(0, err);
  EXPECT_FALSE(a.sm_util || a.power_w || a.energy_j || a.temperature_c);
  EXPECT_NE(err.find("GPU is lost"), std::string::npos) << err;
  r.read(0, err);
  EXPECT_EQ(calls("nvmlDeviceGetPowerUsage") - before, 2u) << "a transient failure is retried";
  r.read(1, err);
  EXPECT_EQ(err, "");
}

TEST_F(Nvml, MissingLibraryMakesEveryGpuUnavailable) {
  NvmlReader r({kA, kB}, "libnvidia-ml-absent.so.1");
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_FALSE(r.available(i));
    EXPECT_NE(r.why_not(i).find("libnvidia-ml-absent.so.1"), std::string::npos) << r.why_not(i);
    EXPECT_EQ(r.why_not(i).find('\n'), std::string::npos);
  }
  std::string err;
  EXPECT_FALSE(r.read(0, err).sm_util.has_value());
}

TEST_F(Nvml, FailedInitSaysWhyAndIsNotShutDown) {
  ::setenv("MOCK_NVML_INIT", "9", 1);  // NVML_ERROR_DRIVER_NOT_LOADED
  const unsigned shutdowns = calls("nvmlShutdown");
  {
    NvmlReader r({kA});
    EXPECT_FALSE(r.available(0));
    EXPECT_EQ(r.why_not(0), "nvmlInit_v2: Driver Not Loaded (NVML error 9)");
  }
  EXPECT_EQ(calls("nvmlShutdown"), shutdowns);
}

TEST_F(Nvml, EveryInitIsShutDown) {
  {
    NvmlReader r1({kA});
    NvmlReader r2({kB});
    EXPECT_EQ(refs(), 2);
  }
  EXPECT_EQ(refs(), 0);
}

TEST_F(Nvml, SamplerAnswersFromItsCacheWithoutCallingTheDriver) {
  // A period long enough that the thread never samples during the test.
  NvmlSampler s({kA, kB, "GPU-dddddddd-0000-0000-0000-000000000000"}, std::chrono::hours(1));
  EXPECT_EQ(s.rounds(), 1u) << "the first sample is taken before the constructor returns";
  const unsigned before = calls("nvmlDeviceGetUtilizationRates");
  for (int i = 0; i < 1000; ++i) {
    const GpuTelemetrySnapshot t = s.snapshot(0);
    ASSERT_TRUE(t.available);
    ASSERT_TRUE(t.readings.sm_util.has_value());
    EXPECT_DOUBLE_EQ(*t.readings.sm_util, 0.38);
  }
  EXPECT_EQ(calls("nvmlDeviceGetUtilizationRates"), before);
  EXPECT_FALSE(s.snapshot(2).available);
  EXPECT_NE(s.snapshot(2).why_not.find("Not Found"), std::string::npos);
  EXPECT_FALSE(s.snapshot(9).available);
  // Destruction wakes the thread at once rather than after its hour.
}

TEST_F(Nvml, SamplerRefreshesInTheBackground) {
  NvmlSampler s({kA}, std::chrono::milliseconds(5));
  const double first = *s.snapshot(0).readings.energy_j;
  // Bounded wait for progress; asserts order (later samples), not timing.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (s.rounds() < 4 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_GE(s.rounds(), 4u);
  EXPECT_GT(*s.snapshot(0).readings.energy_j, first);
}

TEST_F(Nvml, SamplerScoresTheRiskOfItsWindow) {
  // The mock's readings are constant, so CARMA's score of any window is the reading.
  NvmlSampler s({kA, kB}, std::chrono::milliseconds(5), NvmlReader::kLibrary, 3);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (s.rounds() < 5 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_GE(s.rounds(), 5u);
  for (std::size_t i = 0; i < 2; ++i) {
    const GpuRisk r = s.risk(i);
    const GpuReadings t = s.snapshot(i).readings;
    ASSERT_TRUE(r.sm && r.mem && t.sm_util && t.mem_util);
    EXPECT_NEAR(*r.sm, *t.sm_util, 1e-12);
    EXPECT_NEAR(*r.mem, *t.mem_util, 1e-12);
  }
  EXPECT_FALSE(s.risk(9).sm);
}

TEST_F(Nvml, SamplerWithoutLibraryReportsWhyForEveryGpu) {
  NvmlSampler s({kA, kB}, std::chrono::milliseconds(5), "libnvidia-ml-absent.so.1");
  EXPECT_EQ(s.rounds(), 0u) << "nothing to sample, so no thread";
  for (std::size_t i = 0; i < 2; ++i) {
    const GpuTelemetrySnapshot t = s.snapshot(i);
    EXPECT_FALSE(t.available);
    EXPECT_NE(t.why_not.find("libnvidia-ml-absent.so.1"), std::string::npos);
    EXPECT_FALSE(t.readings.power_w.has_value());
  }
}

}  // namespace

TEST_F(Nvml, ComputeProcessesAndTheirMemory) {
  ::setenv("MOCK_NVML_PROCESSES", (kA + ":4242:1048576," + kA + ":77:na").c_str(), 1);
  NvmlReader r({kA, kB});
  std::string err;
  const GpuReadings a = r.read(0, err);
  EXPECT_EQ(err, "");
  ASSERT_TRUE(a.processes);
  ASSERT_EQ(a.processes->size(), 2u);
  EXPECT_EQ((*a.processes)[0].pid, 4242);
  EXPECT_EQ((*a.processes)[0].bytes, std::optional<std::uint64_t>(1048576));
  EXPECT_EQ((*a.processes)[1].pid, 77);
  EXPECT_FALSE((*a.processes)[1].bytes);  // NVML_VALUE_NOT_AVAILABLE
  const GpuReadings b = r.read(1, err);
  ASSERT_TRUE(b.processes);
  EXPECT_TRUE(b.processes->empty());
}
