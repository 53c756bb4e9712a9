// salus-bench dataplane: bandwidth of the three data paths into and out of one
// buffer (mem/ files, upload/download through shared memory, and through files
// on the caller-I/O threads), each next to a baseline measured in the same run on the same
// machine: a plain memcpy (sim) or cuMemcpyHtoD/DtoH from pinned memory (cuda)
// for shared memory, a plain sequential read()/write() of the same file for files.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "arena/size_units.hpp"
#include "tools/salus_bench/bench_common.hpp"
#if SALUS_BENCH_CUDA
#include "vgpu/cuda/cuda_driver.hpp"
#endif

namespace salus::bench {
namespace {

struct Options {
  std::string size = "1G";
  std::string backend = "sim";
  std::string chunk = "16M";
  std::string dir = "/tmp";
  int repeat = 3;
};

double gbps(std::size_t bytes, double us) {
  return static_cast<double>(bytes) / (us * 1e3);
}

// A mapping that has been touched page by page, so no run pays for faults.
struct Mapping {
  char* p = nullptr;
  std::size_t n = 0;
  Mapping(int fd, std::size_t size) : n(size) {
    void* m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                     fd < 0 ? MAP_PRIVATE | MAP_ANONYMOUS : MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) die(fmt::format("mmap of {} bytes: {}", size, std::strerror(errno)));
    p = static_cast<char*>(m);
    for (std::size_t i = 0; i < n; i += 4096) p[i] = static_cast<char>(i >> 12);
  }
  ~Mapping() { ::munmap(p, n); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

void write_file(const std::string& path, const char* data, std::size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) die(fmt::format("{}: {}", path, std::strerror(errno)));
  for (std::size_t done = 0; done < n;) {
    const ssize_t w = ::write(fd, data + done, std::min<std::size_t>(n - done, 64 << 20));
    if (w <= 0) die(fmt::format("{}: write: {}", path, std::strerror(errno)));
    done += static_cast<std::size_t>(w);
  }
  ::close(fd);
}

// Sequential read() or write() of the whole file in 8 MiB calls, as a program
// that does not know about salusd would do it: into (out of) `mem`, which is
// either as large as the file (the file is loaded into memory, as upload loads it
// into the buffer) or one 8 MiB block used over and over (it stays in the CPU
// caches: an upper bound for the kernel's copy).
void plain_io(const std::string& path, std::size_t n, bool reading, char* mem, bool whole) {
  const int fd = ::open(path.c_str(), reading ? O_RDONLY : O_WRONLY);
  if (fd < 0) die(fmt::format("{}: {}", path, std::strerror(errno)));
  constexpr std::size_t kCall = 8u << 20;
  for (std::size_t done = 0; done < n;) {
    const std::size_t len = std::min(n - done, kCall);
    char* p = whole ? mem + done : mem;
    const ssize_t r = reading ? ::read(fd, p, len) : ::write(fd, p, len);
    if (r <= 0) die(fmt::format("{}: {}", path, std::strerror(errno)));
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
}

// mem/NAME through pwrite/pread in 64 MiB calls (the kernel splits them into
// FUSE requests of at most max_write/max_pages).
void mem_io(const std::string& path, char* data, std::size_t n, bool reading) {
  const int fd = ::open(path.c_str(), reading ? O_RDONLY : O_WRONLY);
  if (fd < 0) die(fmt::format("{}: {}", path, std::strerror(errno)));
  for (std::size_t done = 0; done < n;) {
    const std::size_t len = std::min<std::size_t>(n - done, 64 << 20);
    const auto off = static_cast<off_t>(done);
    const ssize_t r =
        reading ? ::pread(fd, data + done, len, off) : ::pwrite(fd, data + done, len, off);
    if (r <= 0) die(fmt::format("{}: {}", path, r < 0 ? std::strerror(errno) : "short"));
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
}

#if SALUS_BENCH_CUDA
// cuMemcpyHtoD and DtoH of n bytes between pinned memory and GPU 0, from this
// process (salusd has its own context on the same GPU).
class CudaBaseline {
 public:
  explicit CudaBaseline(std::size_t n) : n_(n) {
    std::string why;
    d_ = vgpu::cuda::CudaDriver::get(why);
    if (!d_) {
      fmt::print("  (no cuda baseline: {})\n", why);
      return;
    }
    if (d_->device_get(&dev_, 0) != CUDA_SUCCESS ||
        d_->primary_ctx_retain(&ctx_, dev_) != CUDA_SUCCESS ||
        d_->ctx_set_current(ctx_) != CUDA_SUCCESS || d_->mem_alloc(&dptr_, n) != CUDA_SUCCESS ||
        d_->mem_host_alloc(&host_, n, 0) != CUDA_SUCCESS) {
      fmt::print("  (no cuda baseline: the driver refused a context or {} bytes)\n", n);
      return;
    }
    std::memset(host_, 1, n);
    ok_ = true;
  }
  ~CudaBaseline() {
    if (!d_) return;
    if (host_) d_->mem_free_host(host_);
    if (dptr_) d_->mem_free(dptr_);
    if (ctx_) d_->primary_ctx_release(dev_);
  }
  bool ok() const { return ok_; }
  void htod() {
    d_->memcpy_htod_async(dptr_, host_, n_, nullptr);
    d_->ctx_synchronize();
  }
  void dtoh() {
    d_->memcpy_dtoh_async(host_, dptr_, n_, nullptr);
    d_->ctx_synchronize();
  }

 private:
  const vgpu::cuda::CudaDriver* d_ = nullptr;
  std::size_t n_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUdeviceptr dptr_ = 0;
  void* host_ = nullptr;
  bool ok_ = false;
};
#endif

// One figure: a path and its baseline, timed alternately `repeat` times so that
// both see the same machine (it is shared and noisy); the medians of each and of
// the per-round ratios are reported.
struct Pair {
  double base_gbps = 0, path_gbps = 0, ratio = 0;
};
Pair measure(std::size_t n, int repeat, const std::function<void()>& base,
             const std::function<void()>& path) {
  std::vector<double> b, p, r;
  for (int i = 0; i < repeat; ++i) {
    double tb = 0;
    if (base) {
      const auto t0 = Clock::now();
      base();
      tb = us_since(t0);
    }
    const auto t1 = Clock::now();
    path();
    const double tp = us_since(t1);
    b.push_back(tb > 0 ? gbps(n, tb) : 0);
    p.push_back(gbps(n, tp));
    r.push_back(tb > 0 ? tb / tp : 0);
  }
  return {percentile(b, 0.5), percentile(p, 0.5), percentile(r, 0.5)};
}

// One result line of the report, and its ratio against the baseline.
void row(const char* what, double g, const std::string& note = "") {
  fmt::print("  {:<32} {:8.2f} GB/s{}\n", what, g, note);
}
std::string vs(const Pair& p, const char* base, const char* target) {
  return p.ratio > 0 ? fmt::format("  {:.2f} x {}{}", p.ratio, base, target) : std::string();
}

// Files through the caller-I/O threads, against plain read()/write() of the same files.
void bench_files(Clone& c, std::size_t n, const Options& o, char* host, const std::string& file,
                 const std::string& out_file, const std::string& seg_path) {
  auto cmd = [&](const std::string& text) { return [&c, text] { write_all(c.fd, text); }; };
  const auto fup = cmd(fmt::format("upload w file:{} {}\nsync\n", file, n));
  const auto fdown = cmd(fmt::format("download w file:{} {}\nsync\n", out_file, n));
  const Pair file_up = measure(
      n, o.repeat, [&] { plain_io(file, n, true, host, true); }, fup);
  const Pair file_down = measure(
      n, o.repeat, [&] { plain_io(out_file, n, false, host, true); }, fdown);
  const Pair cached = measure(n, o.repeat, nullptr, [&] { plain_io(file, n, true, host, false); });
  const Pair tmpfs =
      measure(n, o.repeat, nullptr, [&] { plain_io(seg_path, n, true, host, true); });
  row("baseline: read() into memory", file_up.base_gbps);
  row("file upload", file_up.path_gbps, vs(file_up, "read()", " (target >= 0.80)"));
  row("baseline: write() from memory", file_down.base_gbps);
  row("file download", file_down.path_gbps, vs(file_down, "write()", ""));
  row("(read() into one cached 8M block)", cached.path_gbps);
  row("(read() of the shm segment, tmpfs)", tmpfs.path_gbps);
}

int bench_dataplane(Target& t, const Options& o) {
  const auto size = arena::parse_size(o.size);
  if (!size || *size == 0) die("--size: not a size");
  const std::size_t n = *size;
  std::vector<std::string> args = {"--log-level", "warn", "--transfer-chunk", o.chunk};
  if (o.backend == "sim") {
    args.insert(args.end(), {"--backend", "sim", "--sim-gpus", "1", "--sim-memory",
                             std::to_string(2 * n + (256u << 20))});
  } else {
    args.insert(args.end(), {"--backend", "cuda"});
  }
  const std::string& mnt = t.start(args);
  Clone c(mnt);
  write_all(c.fd, fmt::format("need persistent={} ephemeral=1M\nalloc w {}\n", n + (1u << 20), n));
  // First touch of sim device memory costs page faults: pay them now.
  c.run_and_wait("fill w 1 dtype=u8\n");

  const std::string seg_name = fmt::format("salus-bench-{}", ::getpid());
  const std::string seg_path = "/dev/shm/" + seg_name;
  const std::string file = fmt::format("{}/salus-bench-{}.bin", o.dir, ::getpid());
  const std::string out_file = file + ".out";
  // die() exits without unwinding: remove the segment and files at exit.
  static std::vector<std::string> cleanup;
  cleanup = {seg_path, file, out_file};
  std::atexit([] {
    for (const auto& p : cleanup) ::unlink(p.c_str());
  });
  const int seg_fd = ::open(seg_path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (seg_fd < 0) die(fmt::format("{}: {}", seg_path, std::strerror(errno)));
  if (::ftruncate(seg_fd, static_cast<off_t>(n)) != 0) die("ftruncate of the segment");
  Mapping seg(seg_fd, n);
  ::close(seg_fd);
  Mapping host(-1, n);
  write_file(file, seg.p, n);
  write_file(out_file, seg.p, n);
  plain_io(file, n, true, host.p, true);  // the page cache holds both files now

  fmt::print("dataplane backend={} size={} chunk={} rounds={} (medians; ratios per round)\n",
             o.backend, arena::format_size(n), o.chunk, o.repeat);
  auto cmd = [&](const std::string& text) { return [&c, text] { write_all(c.fd, text); }; };

  // Shared memory, against memcpy (sim) or pinned cuMemcpy (cuda).
  std::function<void()> base_up, base_down;
  const char* base_name = "memcpy";
  if (o.backend == "sim") {
    base_up = [&] { std::memcpy(host.p, seg.p, n); };
    base_down = [&] { std::memcpy(seg.p, host.p, n); };
  }
#if SALUS_BENCH_CUDA
  std::unique_ptr<CudaBaseline> cuda;
  if (o.backend == "cuda") {
    cuda = std::make_unique<CudaBaseline>(n);
    if (cuda->ok()) {
      base_up = [&] { cuda->htod(); };
      base_down = [&] { cuda->dtoh(); };
      base_name = "cuMemcpy";
    }
  }
#endif
  const auto up = cmd(fmt::format("upload w shm:{} {}\nsync\n", seg_name, n));
  const auto down = cmd(fmt::format("download w shm:{} {}\nsync\n", seg_name, n));
  // The first upload maps the segment (on cuda: pins it) for the session's
  // later transfers: shown apart, the rounds below reuse the mapping.
  const auto t_first = Clock::now();
  up();
  const double first_gbps = gbps(n, us_since(t_first));
  const Pair shm_up = measure(n, o.repeat, base_up, up);
  const Pair shm_down = measure(n, o.repeat, base_down, down);
  if (base_up)
    row(o.backend == "sim" ? "baseline: memcpy in" : "baseline: HtoD, pinned", shm_up.base_gbps);
  row("shm upload, first (maps it)", first_gbps);
  row("shm upload", shm_up.path_gbps, vs(shm_up, base_name, " (target >= 0.80)"));
  if (base_down)
    row(o.backend == "sim" ? "baseline: memcpy out" : "baseline: DtoH, pinned", shm_down.base_gbps);
  row("shm download", shm_down.path_gbps, vs(shm_down, base_name, ""));

  bench_files(c, n, o, host.p, file, out_file, seg_path);

  // mem/ files, reported next to the shared-memory baseline.
  const std::string mem = c.dir + "/mem/w";
  const Pair mem_w = measure(n, o.repeat, base_up, [&] { mem_io(mem, host.p, n, false); });
  const Pair mem_r = measure(n, o.repeat, base_down, [&] { mem_io(mem, host.p, n, true); });
  row("mem/ pwrite (64 MiB calls)", mem_w.path_gbps, vs(mem_w, base_name, ""));
  row("mem/ pread (64 MiB calls)", mem_r.path_gbps, vs(mem_r, base_name, ""));
  return 0;
}

}  // namespace

void add_dataplane_benches(CLI::App& app, Registry& r) {
  auto* cmd = app.add_subcommand("dataplane",
                                 "Bandwidth of mem/, shm and file transfers against baselines");
  auto o = std::make_shared<Options>();
  cmd->add_option("--size", o->size, "Buffer size (default 1G)");
  cmd->add_option("--backend", o->backend, "sim or cuda (default sim)")
      ->check(CLI::IsMember({"sim", "cuda"}));
  cmd->add_option("--chunk", o->chunk, "salusd --transfer-chunk (default 16M)");
  cmd->add_option("--dir", o->dir, "Where the test file goes (default /tmp)");
  cmd->add_option("--repeat", o->repeat, "Timed runs per figure; the median is shown")
      ->check(CLI::Range(1, 100));
  r.add(cmd, [o](Target& t) { return bench_dataplane(t, *o); });
}

}  // namespace salus::bench
