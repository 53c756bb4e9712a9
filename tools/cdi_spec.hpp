// CDI (Container Device Interface) spec for a host's salusd: what `salusctl cdi`
// writes to /etc/cdi so that podman, containerd and CRI-O give a container
// `--device salus.io/gpu=0` (or `=any`). A pure function of what salusctl found
// on the host, so its shape is unit-tested without a container engine.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace salus::tools {

struct CdiInput {
  std::string kind = "salus.io/gpu";  // vendor/class, as in --device KIND=NAME
  std::string mount;                  // salusd's mount, symlinks resolved
  std::vector<std::string> gpus;      // the GPU indexes under MOUNT/gpus
  std::optional<std::string> shim;    // host path of libsalus-shim.so, if installed
};

struct CdiSpec {
  std::string json;
  std::vector<std::string> notes;  // what a container will lack, for stderr
};

// Where the shim appears inside containers (LD_PRELOAD names it there): outside
// the image's own library directories, so it shadows nothing.
inline constexpr const char* kContainerShim = "/opt/salus/lib/libsalus-shim.so";

// The spec, or std::invalid_argument with a one-line reason (a bad kind or mount).
CdiSpec make_cdi_spec(const CdiInput& in);

}  // namespace salus::tools
