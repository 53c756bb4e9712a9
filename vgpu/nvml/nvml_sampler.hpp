// GpuTelemetry from NVML: one background thread reads every GPU once a period
// and caches the result, so that rendering /salus files never calls the driver.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "vgpu/gpu_telemetry.hpp"
#include "vgpu/nvml/nvml_reader.hpp"

namespace salus::vgpu::nvml {

class NvmlSampler final : public GpuTelemetry {
 public:
  // `uuids[i]` is the UUID of the broker's GPU i. Loads NVML and takes the first
  // sample before returning, so the first read of gpus/N/info already has
  // values; then samples every `period` on its own thread (none is started
  // when no GPU could be found in NVML). The risk scores cover the last `window`
  // samples (CARMA: 30 of one a second).
  explicit NvmlSampler(std::vector<std::string> uuids,
                       std::chrono::milliseconds period = std::chrono::seconds(1),
                       const std::string& library = NvmlReader::kLibrary, std::size_t window = 30);
  ~NvmlSampler() override;  // stops and joins the thread, then shuts NVML down
  NvmlSampler(const NvmlSampler&) = delete;
  NvmlSampler& operator=(const NvmlSampler&) = delete;

  GpuTelemetrySnapshot snapshot(std::size_t gpu) const override;
  GpuRisk risk(std::size_t gpu) const override;

  // Sampling rounds completed so far (one per period, plus the first).
  std::uint64_t rounds() const;

 private:
  void sample_all();
  void loop();

  NvmlReader reader_;  // used by the sampling thread only, after construction
  const std::chrono::milliseconds period_;
  mutable std::mutex mu_;  // guards everything below; never held across NVML calls
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<GpuTelemetrySnapshot> cache_;
  // The last `window_` readings of each GPU (oldest first) and their risk scores.
  struct History {
    std::deque<double> sm, mem;
  };
  const std::size_t window_;
  std::vector<History> history_;
  std::vector<GpuRisk> risk_;
  std::uint64_t rounds_ = 0;
  std::thread thread_;
};

}  // namespace salus::vgpu::nvml
