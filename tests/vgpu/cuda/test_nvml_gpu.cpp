// NVML on a real GPU: every GPU the CUDA driver lists is found in NVML by the
// UUID string salusd builds from cuDeviceGetUuid, and gives the readings an
// H100-class board supports. Skips, saying why, without a driver or a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "vgpu/cuda/cuda_driver.hpp"
#include "vgpu/cuda/cuda_plans.hpp"
#include "vgpu/nvml/nvml_reader.hpp"
#include "vgpu/nvml/nvml_sampler.hpp"

namespace {

using salus::vgpu::GpuReadings;
using salus::vgpu::cuda::CudaDriver;
using salus::vgpu::nvml::NvmlReader;

// The UUIDs of the CUDA GPUs, formatted as the cuda backend formats them.
std::vector<std::string> cuda_uuids(std::string& why) {
  const CudaDriver* drv = CudaDriver::get(why);
  if (drv == nullptr) return {};
  int count = 0;
  if (drv->device_get_count(&count) != CUDA_SUCCESS || count == 0) {
    why = "the driver sees no GPU";
    return {};
  }
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    CUuuid uuid{};
    if (drv->device_get(&dev, i) != CUDA_SUCCESS ||
        drv->device_get_uuid(&uuid, dev) != CUDA_SUCCESS) {
      out.emplace_back();
      continue;
    }
    out.push_back(
        salus::vgpu::cuda::format_gpu_uuid(reinterpret_cast<const unsigned char*>(uuid.bytes)));
  }
  return out;
}

TEST(NvmlGpu, FindsEveryCudaGpuByUuidAndReadsIt) {
  std::string why;
  const auto uuids = cuda_uuids(why);
  if (uuids.empty()) GTEST_SKIP() << "no CUDA GPU: " << why;
  NvmlReader r(uuids);
  if (!r.available(0) && r.why_not(0).find("libnvidia-ml") != std::string::npos)
    GTEST_SKIP() << "no NVML: " << r.why_not(0);
  for (std::size_t i = 0; i < uuids.size(); ++i) {
    ASSERT_TRUE(r.available(i)) << uuids[i] << ": " << r.why_not(i);
    std::string err;
    const GpuReadings g = r.read(i, err);
    EXPECT_EQ(err, "") << uuids[i];
    ASSERT_TRUE(g.sm_util.has_value()) << uuids[i];
    EXPECT_GE(*g.sm_util, 0.0);
    EXPECT_LE(*g.sm_util, 1.0);
    ASSERT_TRUE(g.mem_util.has_value());
    EXPECT_LE(*g.mem_util, 1.0);
    ASSERT_TRUE(g.power_w.has_value()) << uuids[i];
    EXPECT_GT(*g.power_w, 1.0) << "a powered board draws more than 1 W";
    EXPECT_LT(*g.power_w, 2000.0);
    if (g.energy_j) {
      EXPECT_GT(*g.energy_j, 0.0);
    }
    if (g.temperature_c) {
      EXPECT_LT(*g.temperature_c, 150.0);
    }
    std::printf("gpu %zu %s: sm_util %.2f mem_util %.2f power %.3f W energy %s J temp %s C\n", i,
                uuids[i].c_str(), *g.sm_util, *g.mem_util, *g.power_w,
                g.energy_j ? std::to_string(*g.energy_j).c_str() : "-",
                g.temperature_c ? std::to_string(*g.temperature_c).c_str() : "-");
  }
}

TEST(NvmlGpu, SamplerHasReadingsAtOnce) {
  std::string why;
  const auto uuids = cuda_uuids(why);
  if (uuids.empty()) GTEST_SKIP() << "no CUDA GPU: " << why;
  salus::vgpu::nvml::NvmlSampler s(uuids);
  const auto t = s.snapshot(0);
  if (!t.available && t.why_not.find("libnvidia-ml") != std::string::npos)
    GTEST_SKIP() << "no NVML: " << t.why_not;
  ASSERT_TRUE(t.available) << t.why_not;
  EXPECT_TRUE(t.readings.power_w.has_value());
  EXPECT_EQ(s.rounds(), 1u);
}

}  // namespace
