#include "vgpu/nvml/nvml_sampler.hpp"

#include <algorithm>
#include <exception>

#include <spdlog/spdlog.h>

#include "sched/placement.hpp"

namespace salus::vgpu::nvml {

NvmlSampler::NvmlSampler(std::vector<std::string> uuids, std::chrono::milliseconds period,
                         const std::string& library, std::size_t window)
    : reader_(std::move(uuids), library),
      period_(period),
      window_(std::max<std::size_t>(window, 1)) {
  cache_.resize(reader_.size());
  history_.resize(reader_.size());
  risk_.resize(reader_.size());
  bool any = false;
  for (std::size_t i = 0; i < reader_.size(); ++i) {
    cache_[i].available = reader_.available(i);
    cache_[i].why_not = reader_.why_not(i);
    any = any || cache_[i].available;
  }
  if (!any) return;
  sample_all();
  thread_ = std::thread([this] { loop(); });
}

NvmlSampler::~NvmlSampler() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

GpuTelemetrySnapshot NvmlSampler::snapshot(std::size_t gpu) const {
  std::lock_guard lk(mu_);
  if (gpu >= cache_.size()) return GpuTelemetrySnapshot{false, "no such GPU", {}, {}};
  return cache_[gpu];
}

GpuRisk NvmlSampler::risk(std::size_t gpu) const {
  std::lock_guard lk(mu_);
  return gpu < risk_.size() ? risk_[gpu] : GpuRisk{};
}

namespace {

// Adds `v` (when read) to the window and scores the window again.
std::optional<double> push_score(std::deque<double>& h, std::optional<double> v,
                                 std::size_t window) {
  if (v) {
    h.push_back(*v);
    if (h.size() > window) h.pop_front();
  }
  if (h.empty()) return std::nullopt;
  const std::vector<double> samples(h.begin(), h.end());
  return sched::risk_score(samples);
}

}  // namespace

std::uint64_t NvmlSampler::rounds() const {
  std::lock_guard lk(mu_);
  return rounds_;
}

void NvmlSampler::sample_all() {
  // Driver calls happen here, outside mu_: a slow one delays the next sample,
  // never a reader of the cache.
  std::vector<std::pair<GpuReadings, std::string>> fresh(reader_.size());
  for (std::size_t i = 0; i < reader_.size(); ++i)
    if (reader_.available(i)) fresh[i].first = reader_.read(i, fresh[i].second);
  std::lock_guard lk(mu_);
  for (std::size_t i = 0; i < fresh.size(); ++i) {
    if (!cache_[i].available) continue;
    cache_[i].readings = fresh[i].first;
    cache_[i].error = std::move(fresh[i].second);
    const GpuReadings& r = cache_[i].readings;
    risk_[i].sm = push_score(history_[i].sm, r.sm_util, window_);
    risk_[i].mem = push_score(history_[i].mem, r.mem_util, window_);
  }
  ++rounds_;
}

void NvmlSampler::loop() {
  std::unique_lock lk(mu_);
  while (!cv_.wait_for(lk, period_, [this] { return stop_; })) {
    lk.unlock();
    // Nothing may escape the thread: a failed round keeps the previous values.
    try {
      sample_all();
    } catch (const std::exception& e) {
      spdlog::warn("nvml: sampling failed: {}", e.what());
    } catch (...) {
      spdlog::warn("nvml: sampling failed");
    }
    lk.lock();
  }
}

}  // namespace salus::vgpu::nvml
