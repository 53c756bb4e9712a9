// The decisions of salus-device-plugin, free of gRPC and files: which shares
// of which GPUs to advertise and whether each is healthy (from salusd's
// gpus/N/info), and what a container gets for the shares the kubelet allocated
// to it. salus-device-plugin.cpp does the I/O around it.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace salus::k8s {

// One GPU as salusd shows it.
struct GpuHealth {
  std::string index;  // the directory name under gpus/
  bool healthy = false;
  std::string why;  // when not healthy: "draining", "out-of-service: ...", "salusd not reachable"
};

// A GPU is healthy for new pods when salusd serves it (state: ok) and admits new
// sessions on it (draining: no). `info` is the text of gpus/N/info.
GpuHealth parse_gpu_info(const std::string& index, const std::string& info);

struct Share {
  std::string id;  // "gpu<N>-<k>"
  std::string gpu;
  bool healthy = false;
  bool operator==(const Share&) const = default;
};

// `shares` devices per GPU, in GPU order.
std::vector<Share> shares_of(const std::vector<GpuHealth>& gpus, unsigned shares);

// The GPU a share id names; nullopt for an id this plugin never made.
std::optional<std::string> gpu_of_share(const std::string& id);

enum class AllocateMode { cdi, mounts };

struct AllocateConfig {
  AllocateMode mode = AllocateMode::cdi;
  std::string cdi_kind = "salus.io/gpu";
  std::string mount = "/salus";  // salusd's mount on the host (and in the container)
};

struct MountSpec {
  std::string host_path;
  std::string container_path;
};

// What one container gets: the kubelet copies it into the container's config.
struct ContainerAllocation {
  std::map<std::string, std::string> envs;
  std::map<std::string, std::string> annotations;
  std::vector<MountSpec> mounts;
  std::vector<std::string> cdi_devices;  // "vendor/class=name"
};

// For the share ids of one container: its GPU (SALUS_GPU) when all shares are on
// one GPU, else "any". cdi mode names the CDI device (`salusctl cdi` writes its
// spec), both as a CDI device and as the cdi.k8s.io/ annotation older
// containerd/CRI-O read; mounts mode binds the directory above the mount (or
// the mount itself below /) and sets SALUS_MOUNT and SALUS_GPU. Returns an error
// message instead for an unknown share id.
std::optional<std::string> allocate(const AllocateConfig& config,
                                    const std::vector<std::string>& share_ids,
                                    ContainerAllocation& out);

}  // namespace salus::k8s
