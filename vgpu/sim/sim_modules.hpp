// User modules on the sim backend: an ELF host shared object loaded from memory
// (memfd + dlopen), kernels looked up with their optional signature tables, and
// launches run on a host thread of the device with the same argument marshalling as cuda.
// The C ABI a module implements is client/salus_sim_kernel.h (docs/modules.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/salus_sim_kernel.h"
#include "vgpu/device.hpp"

namespace salus::vgpu::sim {

// Parses a signature table ("ptr,u32,f32") into parameter sizes. Returns false
// with a reason for an unknown token; "" (or only blanks) is no parameters.
bool parse_signature(const std::string& signature, std::vector<std::uint32_t>& sizes,
                     std::string& why);

// One loaded shared object. Shared by the device's table and by every launch still
// queued, so unloading while kernels are queued cannot unmap their code.
class SimModule {
 public:
  // Returns 0, or an errno (EINVAL for an image that is not a loadable ELF shared
  // object, or whatever the kernel reports for memfd_create/write) and `why`.
  // Note: loading runs the object's constructors inside salusd.
  static int load(const std::vector<std::uint8_t>& image, std::shared_ptr<SimModule>& out,
                  std::string& why);
  ~SimModule();
  SimModule(const SimModule&) = delete;
  SimModule& operator=(const SimModule&) = delete;

  // Finds a function *defined in this object* (not in a library it links against,
  // which dlsym alone would also return) and its signature table, if exported.
  int find(const std::string& name, salus_sim_kernel_fn& fn, std::vector<std::uint32_t>& sizes,
           bool& has_signature, std::string& why) const;

 private:
  SimModule(void* handle, int fd) : handle_(handle), fd_(fd) {}

  void* handle_;
  // Kept open while loaded: dlopen identifies objects by path, and the path is
  // /proc/self/fd/N, so N must not be reused for another image until dlclose.
  int fd_;
};

// Everything a queued launch needs, copied out of the caller's buffers.
struct SimLaunch {
  std::shared_ptr<const SimModule> module;  // keeps `fn` mapped
  salus_sim_kernel_fn fn = nullptr;
  LaunchDims dims;
  int status = 0;  // nonzero: report this instead of running (bad handle, bad args)
  std::vector<std::uint64_t> storage;  // argument values, each at a 16-byte boundary
  std::vector<std::uint32_t> offsets;  // byte offset of each argument in storage
};

// Builds a launch, checking the arguments against `param_sizes` when the module
// exported a signature (`checked`). A bad launch becomes one whose status is EINVAL,
// logged with `why`, so the error arrives with the stream's next notify as for cuda.
std::shared_ptr<const SimLaunch> make_sim_launch(
    std::shared_ptr<const SimModule> module, salus_sim_kernel_fn fn, const LaunchDims& dims,
    const std::uint8_t* args, const std::uint32_t* arg_sizes, std::size_t arg_count, bool checked,
    const std::vector<std::uint32_t>& param_sizes, std::string& why);

// Runs a launch on the calling (stream) thread. Returns 0 or an errno.
int run_sim_launch(const SimLaunch& launch);

}  // namespace salus::vgpu::sim
