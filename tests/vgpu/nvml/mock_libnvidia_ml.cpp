// A stand-in libnvidia-ml.so.1 for testing salusd's NVML reader without a GPU.
// It exports the NVML entry points salusd looks up, with the C signatures of
// nvml.h, written out again here independently of vgpu/nvml/nvml_abi.hpp. Its
// GPUs and their failures come from the environment, read when NVML is first
// initialized:
//   MOCK_NVML_DEVICES      comma-separated UUIDs, in NVML's index order
//   MOCK_NVML_UNSUPPORTED  comma-separated UUID:READING pairs answered with
//                          NVML_ERROR_NOT_SUPPORTED; READING is util, power,
//                          energy or temperature
//   MOCK_NVML_LOST         comma-separated UUIDs whose readings fail with
//                          NVML_ERROR_GPU_IS_LOST
//   MOCK_NVML_INIT         an nvmlReturn_t for nvmlInit_v2 to fail with
//   MOCK_NVML_PROCESSES    comma-separated UUID:PID:BYTES compute processes
//                          (BYTES "na": NVML_VALUE_NOT_AVAILABLE)
//   MOCK_NVML_PROCESSES_FILE  a file with the same list, read again at each
//                          query (a test changes a process's figure as it runs)
// GPU k (by NVML index) reads utilization 37+k % (memory 12+k %), power
// 71234+1000k mW, temperature 40+k C, and energy (k+1)*10^6 mJ plus 500 mJ per
// call. mock_nvml_calls(NAME) counts calls per entry point, for the tests.
//
// Only for tests: selected with LD_LIBRARY_PATH by tests/vgpu/nvml/meson.build.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

extern "C" {
// From nvml.h.
typedef enum nvmlReturn_enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_GPU_IS_LOST = 15,
  NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;
typedef struct nvmlDevice_st* nvmlDevice_t;
typedef struct nvmlUtilization_st {
  unsigned int gpu;
  unsigned int memory;
} nvmlUtilization_t;
typedef struct nvmlProcessInfo_st {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlProcessInfo_t;
typedef enum nvmlTemperatureSensors_enum {
  NVML_TEMPERATURE_GPU = 0,
  NVML_TEMPERATURE_COUNT
} nvmlTemperatureSensors_t;
}

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct MockDevice {
  std::string uuid;
  unsigned index = 0;
  std::set<std::string> unsupported;  // util, power, energy, temperature
  bool lost = false;
  std::vector<std::pair<unsigned, unsigned long long>> processes;
  unsigned long long energy_calls = 0;
};

std::mutex g_mu;
int g_refs = 0;  // nvmlInit_v2 minus nvmlShutdown, as NVML counts them
std::vector<MockDevice> g_devices;
std::map<std::string, unsigned> g_calls;

std::vector<std::string> split(const char* text) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = text ? text : ""; *p; ++p) {
    if (*p == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += *p;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// UUID:PID:BYTES entries, comma-separated (and newline-ended in a file).
void set_processes(const char* text) {
  for (MockDevice& d : g_devices) d.processes.clear();
  for (std::string entry : split(text)) {
    while (!entry.empty() && (entry.back() == '\n' || entry.back() == ' ')) entry.pop_back();
    const auto b = entry.rfind(':');
    if (b == std::string::npos || b == 0) continue;
    const auto a = entry.rfind(':', b - 1);
    if (a == std::string::npos) continue;
    const std::string bytes = entry.substr(b + 1);
    for (MockDevice& d : g_devices)
      if (d.uuid == entry.substr(0, a))
        d.processes.emplace_back(static_cast<unsigned>(std::stoul(entry.substr(a + 1, b - a - 1))),
                                 bytes == "na" ? ~0ull : std::stoull(bytes));
  }
}

// MOCK_NVML_PROCESSES_FILE, when set, replaces the list at each query.
void reread_processes() {
  const char* path = std::getenv("MOCK_NVML_PROCESSES_FILE");
  if (!path) return;
  std::string text;
  if (FILE* f = std::fopen(path, "r")) {
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
    std::fclose(f);
  }
  for (char& c : text)
    if (c == '\n') c = ',';
  set_processes(text.c_str());
}

void configure() {
  g_devices.clear();
  for (const std::string& uuid : split(std::getenv("MOCK_NVML_DEVICES"))) {
    MockDevice d;
    d.uuid = uuid;
    d.index = static_cast<unsigned>(g_devices.size());
    g_devices.push_back(d);
  }
  set_processes(std::getenv("MOCK_NVML_PROCESSES"));
  for (const std::string& pair : split(std::getenv("MOCK_NVML_UNSUPPORTED"))) {
    const auto colon = pair.rfind(':');
    for (MockDevice& d : g_devices)
      if (colon != std::string::npos && d.uuid == pair.substr(0, colon))
        d.unsupported.insert(pair.substr(colon + 1));
  }
  for (const std::string& uuid : split(std::getenv("MOCK_NVML_LOST")))
    for (MockDevice& d : g_devices)
      if (d.uuid == uuid) d.lost = true;
}

// A handle the mock gave out, or abort: salusd must never pass anything else.
MockDevice* device_of(nvmlDevice_t h) {
  for (MockDevice& d : g_devices)
    if (reinterpret_cast<nvmlDevice_t>(&d) == h) return &d;
  std::fprintf(stderr, "MOCK libnvidia-ml: misuse: unknown device handle %p\n",
               static_cast<void*>(h));
  std::abort();
}

// Common checks of a reading call; NVML_SUCCESS means go ahead.
nvmlReturn_t check(const char* name, nvmlDevice_t h, const void* out, const char* reading,
                   MockDevice*& d) {
  ++g_calls[name];
  if (g_refs == 0) return NVML_ERROR_UNINITIALIZED;
  if (out == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  d = device_of(h);
  if (d->unsupported.count(reading)) return NVML_ERROR_NOT_SUPPORTED;
  if (d->lost) return NVML_ERROR_GPU_IS_LOST;
  return NVML_SUCCESS;
}

}  // namespace

EXPORT nvmlReturn_t nvmlInit_v2(void) {
  std::lock_guard lk(g_mu);
  ++g_calls["nvmlInit_v2"];
  if (const char* fail = std::getenv("MOCK_NVML_INIT"))
    return static_cast<nvmlReturn_t>(std::atoi(fail));
  if (g_refs++ == 0) configure();
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
  std::lock_guard lk(g_mu);
  ++g_calls["nvmlShutdown"];
  if (g_refs == 0) return NVML_ERROR_UNINITIALIZED;
  --g_refs;
  return NVML_SUCCESS;
}

EXPORT const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS:
      return "Success";
    case NVML_ERROR_UNINITIALIZED:
      return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
      return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
      return "Not Supported";
    case NVML_ERROR_NOT_FOUND:
      return "Not Found";
    case NVML_ERROR_DRIVER_NOT_LOADED:
      return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST:
      return "GPU is lost";
    default:
      return "Unknown Error";
  }
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
  std::lock_guard lk(g_mu);
  ++g_calls["nvmlDeviceGetHandleByUUID"];
  if (g_refs == 0) return NVML_ERROR_UNINITIALIZED;
  if (uuid == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (MockDevice& d : g_devices) {
    if (d.uuid == uuid) {
      *device = reinterpret_cast<nvmlDevice_t>(&d);
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t* utilization) {
  std::lock_guard lk(g_mu);
  MockDevice* d = nullptr;
  if (auto r = check(__func__, device, utilization, "util", d); r != NVML_SUCCESS) return r;
  utilization->gpu = 37 + d->index;
  utilization->memory = 12 + d->index;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int* power) {
  std::lock_guard lk(g_mu);
  MockDevice* d = nullptr;
  if (auto r = check(__func__, device, power, "power", d); r != NVML_SUCCESS) return r;
  *power = 71234 + 1000 * d->index;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long* energy) {
  std::lock_guard lk(g_mu);
  MockDevice* d = nullptr;
  if (auto r = check(__func__, device, energy, "energy", d); r != NVML_SUCCESS) return r;
  *energy = 1'000'000ull * (d->index + 1) + 500ull * d->energy_calls++;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                             nvmlTemperatureSensors_t sensorType,
                                             unsigned int* temp) {
  std::lock_guard lk(g_mu);
  MockDevice* d = nullptr;
  if (auto r = check(__func__, device, temp, "temperature", d); r != NVML_SUCCESS) return r;
  if (sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
  *temp = 40 + d->index;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int* infoCount,
                                                            nvmlProcessInfo_t* infos) {
  std::lock_guard lk(g_mu);
  MockDevice* d = nullptr;
  if (auto r = check(__func__, device, infoCount, "processes", d); r != NVML_SUCCESS) return r;
  reread_processes();
  const unsigned room = *infoCount;
  *infoCount = static_cast<unsigned>(d->processes.size());
  if (room < d->processes.size()) return static_cast<nvmlReturn_t>(7);  // INSUFFICIENT_SIZE
  for (std::size_t i = 0; i < d->processes.size(); ++i)
    infos[i] = {d->processes[i].first, d->processes[i].second, 0, 0};
  return NVML_SUCCESS;
}

// ---- for the tests ----
EXPORT unsigned mock_nvml_calls(const char* name) {
  std::lock_guard lk(g_mu);
  auto it = g_calls.find(name);
  return it == g_calls.end() ? 0 : it->second;
}

EXPORT int mock_nvml_refs(void) {
  std::lock_guard lk(g_mu);
  return g_refs;
}
