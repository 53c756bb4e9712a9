#include "vgpu/sim/sim_modules.hpp"
#include "vgpu/unique_fd.hpp"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

namespace salus::vgpu::sim {
namespace {

// Big enough for any real kernel; small enough that a typo cannot make salusd
// allocate gigabytes per launch.
constexpr std::uint32_t kMaxSharedMem = 16u << 20;
constexpr std::size_t kMaxSignature = 4096;
constexpr std::size_t kArgAlign = 16;

#if defined(__x86_64__)
constexpr unsigned kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr unsigned kHostMachine = EM_AARCH64;
#else
constexpr unsigned kHostMachine = EM_NONE;  // not checked; dlopen still refuses
#endif
constexpr unsigned char kHostClass = sizeof(void*) == 8 ? ELFCLASS64 : ELFCLASS32;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string dl_error() {
  const char* e = ::dlerror();
  return e != nullptr ? e : "unknown dlopen error";
}

// The link map of the object that defines `addr`, or nullptr.
const link_map* object_of(const void* addr) {
  Dl_info info{};
  void* extra = nullptr;
  if (::dladdr1(addr, &info, &extra, RTLD_DL_LINKMAP) == 0) return nullptr;
  return static_cast<const link_map*>(extra);
}

bool is_function(const void* addr) {
  Dl_info info{};
  void* extra = nullptr;
  if (::dladdr1(addr, &info, &extra, RTLD_DL_SYMENT) == 0 || extra == nullptr) return false;
  const auto* sym = static_cast<const ElfW(Sym)*>(extra);
  const unsigned type = ELF64_ST_TYPE(sym->st_info);
  return type == STT_FUNC || type == STT_GNU_IFUNC;
}

}  // namespace

bool parse_signature(const std::string& signature, std::vector<std::uint32_t>& sizes,
                     std::string& why) {
  sizes.clear();
  std::string_view rest = signature;
  if (trim(rest).empty()) return true;
  for (;;) {
    const std::size_t comma = rest.find(',');
    const std::string_view token = trim(rest.substr(0, comma));
    if (token == "ptr" || token == "i64" || token == "u64" || token == "f64") {
      sizes.push_back(8);
    } else if (token == "i32" || token == "u32" || token == "f32") {
      sizes.push_back(4);
    } else {
      why = fmt::format("unknown parameter type '{}' (want ptr, i32, u32, i64, u64, f32, f64)",
                        token);
      sizes.clear();
      return false;
    }
    if (comma == std::string_view::npos) return true;
    rest.remove_prefix(comma + 1);
  }
}

int SimModule::load(const std::vector<std::uint8_t>& image, std::shared_ptr<SimModule>& out,
                    std::string& why) {
  // dlopen would say much the same, but this catches a cubin or PTX handed to the
  // sim backend with a message that names the actual mistake.
  if (image.size() < sizeof(ElfW(Ehdr)) || std::memcmp(image.data(), ELFMAG, SELFMAG) != 0) {
    why = "not an ELF shared object (the sim backend loads host .so modules, not cubin/PTX)";
    return EINVAL;
  }
  ElfW(Ehdr) header;
  std::memcpy(&header, image.data(), sizeof header);
  if (header.e_ident[EI_CLASS] != kHostClass || header.e_type != ET_DYN ||
      (kHostMachine != EM_NONE && header.e_machine != kHostMachine)) {
    why =
        "not a shared object for this machine (build the module with -shared -fPIC for the "
        "host that runs salusd)";
    return EINVAL;
  }

  UniqueFd fd(::memfd_create("salus-sim-module", MFD_CLOEXEC));
  if (!fd) {
    const int err = errno;
    why = fmt::format("memfd_create: {}", std::strerror(err));
    return err;
  }
  for (std::size_t done = 0; done < image.size();) {
    const ssize_t n = ::write(fd.get(), image.data() + done, image.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      why = fmt::format("writing the module to memory: {}", std::strerror(err));
      return err;
    }
    done += static_cast<std::size_t>(n);
  }

  // An object that dlclose could not unload keeps its /proc/self/fd/N name, and
  // dlopen of the same name would hand back that stale object: move to an fd
  // number no loaded object is known by.
  for (int attempt = 0;; ++attempt) {
    const std::string path = fmt::format("/proc/self/fd/{}", fd.get());
    if (void* stale = ::dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD); stale != nullptr) {
      ::dlclose(stale);  // drop the reference RTLD_NOLOAD just took
      const int higher = attempt < 64 ? ::fcntl(fd.get(), F_DUPFD_CLOEXEC, fd.get() + 1) : -1;
      if (higher < 0) {
        why = "no free file descriptor name to load the module under";
        return EMFILE;
      }
      fd.reset(higher);
      continue;
    }
    ::dlerror();  // clear
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      why = dl_error();
      return EINVAL;
    }
    out.reset(new SimModule(handle, fd.release()));
    return 0;
  }
}

SimModule::~SimModule() {
  ::dlclose(handle_);
  ::close(fd_);
}

int SimModule::find(const std::string& name, salus_sim_kernel_fn& fn,
                    std::vector<std::uint32_t>& sizes, bool& has_signature,
                    std::string& why) const {
  sizes.clear();
  has_signature = false;
  link_map* self = nullptr;
  if (::dlinfo(handle_, RTLD_DI_LINKMAP, &self) != 0 || self == nullptr) {
    why = fmt::format("cannot inspect the module: {}", dl_error());
    return EIO;
  }
  ::dlerror();
  void* sym = ::dlsym(handle_, name.c_str());
  // dlsym searches the object's dependencies too: "system" would resolve to libc.
  if (sym == nullptr || object_of(sym) != self) {
    why = fmt::format("the module defines no function '{}'", name);
    return ENOENT;
  }
  if (!is_function(sym)) {
    why = fmt::format("'{}' in the module is not a function", name);
    return EINVAL;
  }
  fn = reinterpret_cast<salus_sim_kernel_fn>(sym);

  const std::string sig_name = "salus_signature_" + name;
  void* sig = ::dlsym(handle_, sig_name.c_str());
  if (sig == nullptr || object_of(sig) != self) return 0;  // no table: sizes unknown
  const char* text = *static_cast<const char* const*>(sig);
  if (text == nullptr) return 0;
  const std::size_t len = ::strnlen(text, kMaxSignature);
  if (len == kMaxSignature) {
    why = fmt::format("{} is longer than {} characters", sig_name, kMaxSignature - 1);
    return EINVAL;
  }
  std::string reason;
  if (!parse_signature(std::string(text, len), sizes, reason)) {
    why = fmt::format("{}: {}", sig_name, reason);
    return EINVAL;
  }
  has_signature = true;
  return 0;
}

std::shared_ptr<const SimLaunch> make_sim_launch(
    std::shared_ptr<const SimModule> module, salus_sim_kernel_fn fn, const LaunchDims& dims,
    const std::uint8_t* args, const std::uint32_t* arg_sizes, std::size_t arg_count, bool checked,
    const std::vector<std::uint32_t>& param_sizes, std::string& why) {
  auto launch = std::make_shared<SimLaunch>();
  launch->module = std::move(module);
  launch->fn = fn;
  launch->dims = dims;
  auto reject = [&](std::string reason) {
    why = std::move(reason);
    launch->status = EINVAL;
    launch->fn = nullptr;
    return launch;
  };
  for (int i = 0; i < 3; ++i)
    if (dims.grid[i] == 0 || dims.block[i] == 0)
      return reject("grid and block dimensions must be at least 1");
  if (dims.shared_mem > kMaxSharedMem)
    return reject(
        fmt::format("smem={} is over the sim limit of {}", dims.shared_mem, kMaxSharedMem));
  if (checked) {
    if (param_sizes.size() != arg_count)
      return reject(fmt::format("the kernel takes {} arguments, the launch passed {}",
                                param_sizes.size(), arg_count));
    for (std::size_t i = 0; i < arg_count; ++i)
      if (param_sizes[i] != arg_sizes[i])
        return reject(fmt::format("argument {} has {} bytes, the kernel expects {}", i + 1,
                                  arg_sizes[i], param_sizes[i]));
  }
  // Each value gets its own 16-byte-aligned slot, so a kernel may read a double or
  // a pointer straight through args[i] whatever came before it.
  std::size_t total = 0;
  launch->offsets.reserve(arg_count);
  for (std::size_t i = 0; i < arg_count; ++i) {
    launch->offsets.push_back(static_cast<std::uint32_t>(total));
    total += (static_cast<std::size_t>(arg_sizes[i]) + kArgAlign - 1) / kArgAlign * kArgAlign;
  }
  launch->storage.assign(total / sizeof(std::uint64_t) + 2, 0);
  // vector's allocation is malloc-aligned (16 on x86-64 glibc); align explicitly
  // anyway so the slots are 16-aligned on any allocator.
  auto* base = reinterpret_cast<std::uint8_t*>(launch->storage.data());
  const std::size_t skew =
      (kArgAlign - reinterpret_cast<std::uintptr_t>(base) % kArgAlign) % kArgAlign;
  std::size_t src = 0;
  for (std::size_t i = 0; i < arg_count; ++i) {
    launch->offsets[i] += static_cast<std::uint32_t>(skew);
    if (arg_sizes[i] != 0) std::memcpy(base + launch->offsets[i], args + src, arg_sizes[i]);
    src += arg_sizes[i];
  }
  return launch;
}

int run_sim_launch(const SimLaunch& launch) {
  if (launch.status != 0 || launch.fn == nullptr)
    return launch.status != 0 ? launch.status : EINVAL;
  salus_launch info{};
  info.abi = SALUS_SIM_KERNEL_ABI;
  for (int i = 0; i < 3; ++i) {
    info.grid[i] = launch.dims.grid[i];
    info.block[i] = launch.dims.block[i];
  }
  info.shared_mem = launch.dims.shared_mem;
  struct AlignedFree {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{kArgAlign}); }
  };
  std::unique_ptr<std::byte[], AlignedFree> shared;
  if (info.shared_mem > 0) {
    shared.reset(new (std::align_val_t{kArgAlign}) std::byte[info.shared_mem]());
    info.shared = shared.get();
  }
  const auto* base = reinterpret_cast<const std::uint8_t*>(launch.storage.data());
  std::vector<void*> pointers(launch.offsets.size() + 1, nullptr);
  for (std::size_t i = 0; i < launch.offsets.size(); ++i)
    pointers[i] = const_cast<std::uint8_t*>(base + launch.offsets[i]);
  launch.fn(&info, pointers.data());
  return 0;
}

}  // namespace salus::vgpu::sim
