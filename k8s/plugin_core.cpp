#include "k8s/plugin_core.hpp"

#include <set>

#include <fmt/format.h>

namespace salus::k8s {

namespace {

std::string field(const std::string& text, const std::string& key) {
  const std::string tag = key + ": ";
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    if (text.compare(pos, tag.size(), tag) == 0)
      return text.substr(pos + tag.size(), nl - pos - tag.size());
    pos = nl + 1;
  }
  return {};
}

}  // namespace

GpuHealth parse_gpu_info(const std::string& index, const std::string& info) {
  GpuHealth g{index, false, {}};
  const std::string state = field(info, "state");
  if (state.empty()) {
    g.why = "gpus/" + index + "/info has no state";
  } else if (state != "ok") {
    g.why = state;  // "out-of-service: REASON"
  } else if (field(info, "draining") == "yes") {
    g.why = "draining";
  } else {
    g.healthy = true;
  }
  return g;
}

std::vector<Share> shares_of(const std::vector<GpuHealth>& gpus, unsigned shares) {
  std::vector<Share> out;
  out.reserve(gpus.size() * shares);
  for (const auto& g : gpus)
    for (unsigned k = 0; k < shares; ++k)
      out.push_back(Share{fmt::format("gpu{}-{}", g.index, k), g.index, g.healthy});
  return out;
}

std::optional<std::string> gpu_of_share(const std::string& id) {
  if (id.rfind("gpu", 0) != 0) return std::nullopt;
  const auto dash = id.find('-', 3);
  if (dash == std::string::npos || dash == 3 || dash + 1 == id.size()) return std::nullopt;
  const std::string gpu = id.substr(3, dash - 3);
  const std::string k = id.substr(dash + 1);
  if (gpu.find_first_not_of("0123456789") != std::string::npos ||
      k.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return gpu;
}

std::optional<std::string> allocate(const AllocateConfig& config,
                                    const std::vector<std::string>& share_ids,
                                    ContainerAllocation& out) {
  std::set<std::string> gpus;
  for (const auto& id : share_ids) {
    const auto g = gpu_of_share(id);
    if (!g) return fmt::format("unknown device id '{}' (this plugin advertises gpuN-K)", id);
    gpus.insert(*g);
  }
  if (gpus.empty()) return std::string("no device ids in the request");
  const std::string gpu = gpus.size() == 1 ? *gpus.begin() : "any";
  if (config.mode == AllocateMode::cdi) {
    const std::string device = fmt::format("{}={}", config.cdi_kind, gpu);
    out.cdi_devices.push_back(device);
    // containerd 1.7 and CRI-O read CDI requests from annotations with this prefix.
    out.annotations["cdi.k8s.io/salus-device-plugin"] = device;
    return std::nullopt;
  }
  const auto slash = config.mount.rfind('/');
  const std::string bind =
      slash == 0 || slash == std::string::npos ? config.mount : config.mount.substr(0, slash);
  out.mounts.push_back(MountSpec{bind, bind});
  out.envs["SALUS_MOUNT"] = config.mount;
  out.envs["SALUS_GPU"] = gpu;
  return std::nullopt;
}

}  // namespace salus::k8s
