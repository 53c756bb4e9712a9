#include "vgpu/nvml/nvml_reader.hpp"

#include <dlfcn.h>

#include <fmt/format.h>

namespace salus::vgpu::nvml {

namespace {

template <typename Fn>
Fn symbol(void* lib, const char* name) {
  return reinterpret_cast<Fn>(::dlsym(lib, name));
}

// Whether a failed reading is a property of the GPU (ask no more) rather than
// of this moment.
bool permanent(abi::Return r) {
  return r == abi::kErrorNotSupported || r == abi::kErrorFunctionNotFound;
}

}  // namespace

NvmlReader::NvmlReader(std::vector<std::string> uuids, const std::string& library) {
  gpus_.resize(uuids.size());
  auto fail_all = [&](const std::string& why) {
    for (Entry& e : gpus_) e.why_not = why;
  };
  // RTLD_LOCAL: nothing else in salusd binds to NVML symbols by accident. The
  // library is never dlclose'd: like libcuda it may keep process-wide state,
  // and a second reader's dlopen just takes another reference.
  void* lib = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    fail_all(e ? std::string(e) : library + " not found");
    return;
  }
  // nvmlInit_v2 rather than nvmlInit: nvml.h maps the plain name to _v2, and
  // the unversioned export is the pre-2011 ABI kept for old binaries.
  auto init = symbol<abi::InitV2>(lib, "nvmlInit_v2");
  shutdown_ = symbol<abi::Shutdown>(lib, "nvmlShutdown");
  auto by_uuid = symbol<abi::DeviceGetHandleByUUID>(lib, "nvmlDeviceGetHandleByUUID");
  error_string_ = symbol<abi::ErrorString>(lib, "nvmlErrorString");
  // The readings are optional: an older library without one just lacks it.
  get_utilization_ = symbol<abi::DeviceGetUtilizationRates>(lib, "nvmlDeviceGetUtilizationRates");
  get_power_ = symbol<abi::DeviceGetPowerUsage>(lib, "nvmlDeviceGetPowerUsage");
  get_energy_ =
      symbol<abi::DeviceGetTotalEnergyConsumption>(lib, "nvmlDeviceGetTotalEnergyConsumption");
  get_temperature_ = symbol<abi::DeviceGetTemperature>(lib, "nvmlDeviceGetTemperature");
  get_processes_ =
      symbol<abi::DeviceGetComputeRunningProcesses>(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  if (init == nullptr || shutdown_ == nullptr || by_uuid == nullptr) {
    fail_all(fmt::format("{} lacks {}", library,
                         init == nullptr        ? "nvmlInit_v2"
                         : shutdown_ == nullptr ? "nvmlShutdown"
                                                : "nvmlDeviceGetHandleByUUID"));
    return;
  }
  if (const abi::Return r = init(); r != abi::kSuccess) {
    fail_all(fmt::format("nvmlInit_v2: {}", describe(r)));
    return;
  }
  initialized_ = true;
  for (std::size_t i = 0; i < gpus_.size(); ++i) {
    Entry& e = gpus_[i];
    if (uuids[i].empty()) {
      e.why_not = "the backend gave no UUID to find the GPU by";
      continue;
    }
    abi::Device handle = nullptr;
    if (const abi::Return r = by_uuid(uuids[i].c_str(), &handle); r != abi::kSuccess) {
      e.why_not = fmt::format("nvmlDeviceGetHandleByUUID({}): {}", uuids[i], describe(r));
    } else if (handle == nullptr) {
      e.why_not = fmt::format("nvmlDeviceGetHandleByUUID({}) gave no handle", uuids[i]);
    } else {
      e.handle = handle;
    }
  }
}

NvmlReader::~NvmlReader() {
  // nvmlInit/nvmlShutdown are reference-counted by NVML: other users in the
  // process are unaffected.
  if (initialized_) shutdown_();
}

std::string NvmlReader::why_not(std::size_t gpu) const {
  if (gpu >= gpus_.size()) return "no such GPU";
  return gpus_[gpu].why_not;
}

std::string NvmlReader::describe(abi::Return r) const {
  const char* s = error_string_ ? error_string_(r) : nullptr;
  return s ? fmt::format("{} (NVML error {})", s, r) : fmt::format("NVML error {}", r);
}

GpuReadings NvmlReader::read(std::size_t gpu, std::string& error) {
  error.clear();
  GpuReadings out;
  if (!available(gpu)) return out;
  Entry& e = gpus_[gpu];
  // Runs one NVML call: true on success; otherwise remembers a permanent
  // refusal in `never` and a transient one in `error`.
  auto call = [&](const char* what, bool& never, auto fn) {
    if (never) return false;
    const abi::Return r = fn();
    if (r == abi::kSuccess) return true;
    if (permanent(r)) {
      never = true;
    } else if (error.empty()) {
      error = fmt::format("{}: {}", what, describe(r));
    }
    return false;
  };
  if (get_utilization_ == nullptr) e.no_util = true;
  if (get_power_ == nullptr) e.no_power = true;
  if (get_energy_ == nullptr) e.no_energy = true;
  if (get_temperature_ == nullptr) e.no_temperature = true;
  if (get_processes_ == nullptr) e.no_processes = true;

  abi::Utilization u{};
  if (call("utilization", e.no_util, [&] { return get_utilization_(e.handle, &u); })) {
    out.sm_util = u.gpu / 100.0;
    out.mem_util = u.memory / 100.0;
  }
  unsigned int mw = 0;
  if (call("power", e.no_power, [&] { return get_power_(e.handle, &mw); }))
    out.power_w = mw / 1000.0;
  unsigned long long mj = 0;
  if (call("energy", e.no_energy, [&] { return get_energy_(e.handle, &mj); }))
    out.energy_j = static_cast<double>(mj) / 1000.0;
  unsigned int celsius = 0;
  if (call("temperature", e.no_temperature,
           [&] { return get_temperature_(e.handle, abi::kTemperatureGpu, &celsius); }))
    out.temperature_c = celsius;
  // Attached programs' own memory figure (status memory_gpu). More processes
  // than room is a transient error: the list is left out this time.
  constexpr unsigned kMaxProcesses = 256;
  std::vector<abi::ProcessInfo> procs(kMaxProcesses);
  unsigned count = kMaxProcesses;
  if (call("processes", e.no_processes,
           [&] { return get_processes_(e.handle, &count, procs.data()); })) {
    auto& list = out.processes.emplace();
    for (unsigned i = 0; i < count && i < kMaxProcesses; ++i) {
      GpuReadings::Process p;
      p.pid = procs[i].pid;
      if (procs[i].usedGpuMemory != abi::kValueNotAvailable) p.bytes = procs[i].usedGpuMemory;
      list.push_back(p);
    }
  }
  return out;
}

}  // namespace salus::vgpu::nvml
