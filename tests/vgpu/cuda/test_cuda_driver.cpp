// The run-time loaded CUDA driver: loading (or a clear reason why not), versioned
// entry points, error naming and the factory's empty answer without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "vgpu/cuda/cuda_backend.hpp"
#include "vgpu/cuda/cuda_driver.hpp"

namespace {

using salus::vgpu::cuda::CudaDriver;

TEST(CudaDriver, LoadsOrSaysWhyNot) {
  std::string why;
  const CudaDriver* drv = CudaDriver::get(why);
  if (drv == nullptr) {
    // The reason is the one-line message salusd logs before falling back to sim.
    EXPECT_FALSE(why.empty());
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    const bool known = why.rfind("libcuda.so.1 not found", 0) == 0 ||
                       why.rfind("cuInit failed: ", 0) == 0 ||
                       why.find("needs a newer driver") != std::string::npos ||
                       why.find("salusd needs") != std::string::npos;
    EXPECT_TRUE(known) << why;
    // Cached: asking again gives the same answer without retrying.
    std::string again;
    EXPECT_EQ(CudaDriver::get(again), nullptr);
    EXPECT_EQ(again, why);
    GTEST_SKIP() << "no usable CUDA driver: " << why;
  }
  EXPECT_GE(drv->version(), CudaDriver::kAbiVersion);
  std::string again;
  EXPECT_EQ(CudaDriver::get(again), drv);
}

TEST(CudaDriver, NamesErrors) {
  std::string why;
  const CudaDriver* drv = CudaDriver::get(why);
  if (drv == nullptr) GTEST_SKIP() << "no usable CUDA driver: " << why;
  EXPECT_EQ(drv->error_name(CUDA_ERROR_NO_DEVICE), "CUDA_ERROR_NO_DEVICE");
  EXPECT_EQ(drv->error_name(CUDA_ERROR_ILLEGAL_ADDRESS), "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_NE(drv->describe(CUDA_ERROR_OUT_OF_MEMORY).find("("), std::string::npos);
  EXPECT_EQ(drv->error_name(static_cast<CUresult>(123456)), "CUresult 123456");
}

TEST(CudaDriver, SeesDevices) {
  std::string why;
  const CudaDriver* drv = CudaDriver::get(why);
  if (drv == nullptr) GTEST_SKIP() << "no usable CUDA driver: " << why;
  int count = 0;
  ASSERT_EQ(drv->device_get_count(&count), CUDA_SUCCESS);
  if (count == 0) GTEST_SKIP() << "the driver loads but sees no GPU";
  CUdevice dev = 0;
  ASSERT_EQ(drv->device_get(&dev, 0), CUDA_SUCCESS);
  char name[256] = {};
  ASSERT_EQ(drv->device_get_name(name, sizeof name - 1, dev), CUDA_SUCCESS);
  EXPECT_GT(std::string(name).size(), 0u);
  int major = 0;
  ASSERT_EQ(drv->device_get_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
            CUDA_SUCCESS);
  EXPECT_GE(major, 3);
}

TEST(CudaErrors, StickyAndErrnoMapping) {
  using namespace salus::vgpu::cuda;
  EXPECT_TRUE(is_sticky(CUDA_ERROR_ILLEGAL_ADDRESS));
  EXPECT_TRUE(is_kernel_fault(CUDA_ERROR_ILLEGAL_ADDRESS));
  EXPECT_TRUE(is_sticky(CUDA_ERROR_ECC_UNCORRECTABLE));
  EXPECT_FALSE(is_kernel_fault(CUDA_ERROR_ECC_UNCORRECTABLE));
  EXPECT_FALSE(is_sticky(CUDA_ERROR_INVALID_VALUE));
  EXPECT_FALSE(is_sticky(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES));
  EXPECT_FALSE(is_sticky(CUDA_ERROR_NOT_READY));
  EXPECT_EQ(to_errno(CUDA_SUCCESS), 0);
  EXPECT_EQ(to_errno(CUDA_ERROR_OUT_OF_MEMORY), ENOMEM);
  EXPECT_EQ(to_errno(CUDA_ERROR_INVALID_VALUE), EINVAL);
  EXPECT_EQ(to_errno(CUDA_ERROR_NO_BINARY_FOR_GPU), EINVAL);
  EXPECT_EQ(to_errno(CUDA_ERROR_ILLEGAL_ADDRESS), EFAULT);
  EXPECT_EQ(to_errno(CUDA_ERROR_ECC_UNCORRECTABLE), EIO);
}

TEST(CudaFactory, EmptyWithAReasonOrDevices) {
  std::string why;
  salus::vgpu::CudaOptions options;
  options.memory_fraction = 0.05;  // small: the test only opens and closes
  auto devices = salus::vgpu::open_cuda_devices(options, why);
  if (devices.empty()) {
    EXPECT_FALSE(why.empty());
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    GTEST_SKIP() << "no CUDA GPU: " << why;
  }
  for (std::size_t i = 0; i < devices.size(); ++i) {
    const auto& info = devices[i]->info();
    EXPECT_EQ(info.index, static_cast<int>(i));
    EXPECT_EQ(info.backend, "cuda");
    EXPECT_EQ(info.uuid.rfind("GPU-", 0), 0u) << info.uuid;
    EXPECT_EQ(info.uuid.size(), 40u) << info.uuid;
    EXPECT_GT(info.sm_count, 0u);
    EXPECT_GT(info.arena_size, 0u);
    EXPECT_LE(info.arena_size, info.total_memory);
  }
}

TEST(CudaFactory, RejectsABadMemoryFraction) {
  std::string why;
  salus::vgpu::CudaOptions options;
  options.memory_fraction = 1.5;
  EXPECT_TRUE(salus::vgpu::open_cuda_devices(options, why).empty());
  EXPECT_NE(why.find("fraction"), std::string::npos) << why;
}

}  // namespace
