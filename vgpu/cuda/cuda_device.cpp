#include "vgpu/cuda/cuda_device.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/cuda/builtin_kernels.hpp"

namespace salus::vgpu::cuda {
namespace {

constexpr Bytes kArenaAlign = Bytes{2} << 20;  // the driver's large-page granule
constexpr Bytes kMinStagingClass = Bytes{64} << 10;
constexpr std::size_t kArgAlign = 16;  // kernel parameters up to float4/double2
constexpr std::uint32_t kMaxParams = 4096;
// set_backing clears new memory this many chunks (128 MiB) at a time, each
// piece as soon as it is mapped.
constexpr std::uint64_t kBackingPiece = 64;

std::runtime_error failure(int index, const std::string& what) {
  return std::runtime_error(fmt::format("gpu{}: {}", index, what));
}

Bytes size_class(Bytes size) {
  Bytes c = kMinStagingClass;
  while (c < size) c <<= 1;
  return c;
}

// a * b, saturating: operand sizes come from the broker, bounded by the arena,
// but a saturated product can only make an overlap test more conservative.
std::uint64_t mul_sat(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > UINT64_MAX / a) return UINT64_MAX;
  return a * b;
}

}  // namespace

// ---------------------------------------------------------------- op scope

class CudaDevice::OpScope {
 public:
  OpScope(CudaDevice& dev, StreamId id) : ctx_(dev.ctx_mu_) {
    s_ = dev.find_stream(id);
    if (!s_)
      throw std::invalid_argument(fmt::format("cuda gpu{}: no stream {}", dev.info_.index, id));
    lock_ = std::unique_lock(s_->mu);
    if (s_->closing)
      throw std::invalid_argument(
          fmt::format("cuda gpu{}: stream {} is being destroyed", dev.info_.index, id));
    dev.set_current();
  }
  Stream& stream() { return *s_; }

 private:
  std::shared_lock<std::shared_mutex> ctx_;
  std::shared_ptr<Stream> s_;
  std::unique_lock<std::mutex> lock_;
};

// ---------------------------------------------------------------- lifetime

CudaDevice::CudaDevice(const CudaDriver& driver, int index, CUdevice device,
                       const CudaOptions& options)
    : drv_(driver), opts_(options), device_(device) {
  if (!(opts_.memory_fraction > 0.0 && opts_.memory_fraction <= 1.0))
    throw failure(index, fmt::format("memory fraction {} is not in (0, 1]", opts_.memory_fraction));
  info_.index = index;
  info_.backend = "cuda";
  info_.driver_version = format_cuda_version(drv_.version());

  char name[256] = {};
  if (drv_.device_get_name(name, static_cast<int>(sizeof name - 1), device_) == CUDA_SUCCESS)
    info_.name = name;
  CUuuid uuid{};
  if (drv_.device_get_uuid(&uuid, device_) == CUDA_SUCCESS)
    info_.uuid = format_gpu_uuid(reinterpret_cast<const unsigned char*>(uuid.bytes));
  std::size_t total = 0;
  if (const CUresult r = drv_.device_total_mem(&total, device_); r != CUDA_SUCCESS)
    throw failure(index, fmt::format("cuDeviceTotalMem: {}", drv_.error_name(r)));
  info_.total_memory = total;
  auto attribute = [&](CUdevice_attribute a, int fallback) {
    int v = 0;
    return drv_.device_get_attribute(&v, a, device_) == CUDA_SUCCESS && v > 0 ? v : fallback;
  };
  info_.sm_count =
      static_cast<std::uint32_t>(attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1));
  threads_per_sm_ = static_cast<std::uint32_t>(
      attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048));
  clock_khz_ = attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 1'500'000);
  if (opts_.back_on_demand && VmmArena::supported(drv_, device_))
    vmm_ = std::make_unique<VmmArena>(drv_, device_, kArenaAlign);
  else if (opts_.back_on_demand)
    spdlog::warn(
        "cuda gpu{}: no virtual memory management in this driver or GPU: the arena is "
        "allocated up front, and attached programs need their budgets free beside it "
        "(--cuda-memory-fraction)",
        index);
  info_.backs_on_demand = vmm_ != nullptr;

  std::string why;
  open_context(true, why);  // throws
  try {
    calibrate_spin(clock_khz_);
    info_.spin_cycles_per_usec = cycles_per_usec_;
    poller_ = std::thread([this] { poll_loop(); });
  } catch (...) {
    // No destructor runs for a constructor that throws: give the context back.
    release_context_resources();
    drv_.primary_ctx_release(device_);
    throw;
  }
  spdlog::info(
      "cuda gpu{}: {} ({}), {} SMs, {} MiB, arena {} MiB at {:#x} ({}), CUDA {}, built-in "
      "kernels: {}, spin {:.1f} cycles/us",
      info_.index, info_.name, info_.uuid, info_.sm_count, info_.total_memory >> 20,
      info_.arena_size >> 20, arena_base_.load(), vmm_ ? "backed on demand" : "allocated up front",
      info_.driver_version, builtins_why_.empty() ? builtin_fatbin_description : builtins_why_,
      cycles_per_usec_);
}

CudaDevice::~CudaDevice() {
  // Let queued work finish and its completions go out, as sim does.
  {
    std::shared_lock ctx(ctx_mu_);
    if (!dead_.load() && fault_.load() == CUDA_SUCCESS) {
      set_current();
      for (const auto& s : all_streams()) {
        std::lock_guard lock(s->mu);
        if (s->handle != nullptr) {
          const CUresult r = drv_.stream_synchronize(s->handle);
          if (is_sticky(r)) note_fault(r);
        }
      }
    }
  }
  {
    std::lock_guard lock(waker_->mu);
    waker_->stop = true;
  }
  waker_->cv.notify_one();
  if (poller_.joinable()) poller_.join();

  std::unique_lock ctx(ctx_mu_);
  if (ctx_ == nullptr) return;  // dead: nothing left to release
  set_current();
  const bool clean = fault_.load() == CUDA_SUCCESS && drv_.ctx_synchronize() == CUDA_SUCCESS;
  if (clean) {
    release_context_resources();
  } else {
    // Everything the context owned goes with the reset. A host function could in
    // principle still hold the waker: leak it rather than risk a use after free.
    drv_.primary_ctx_reset(device_);
    (void)waker_.release();
  }
  drv_.primary_ctx_release(device_);
  ctx_ = nullptr;
}

void CudaDevice::set_current() const {
  if (ctx_ != nullptr) drv_.ctx_set_current(ctx_);
}

void CudaDevice::open_context(bool first, std::string& why) {
  auto bail = [&](const std::string& what, CUresult r) {
    why = r == CUDA_SUCCESS ? what : fmt::format("{}: {}", what, drv_.error_name(r));
    if (first) {
      if (ctx_ != nullptr) {
        release_context_resources();
        drv_.primary_ctx_release(device_);
        ctx_ = nullptr;
      }
      throw failure(info_.index, why);
    }
  };
  if (const CUresult r = drv_.primary_ctx_retain(&ctx_, device_); r != CUDA_SUCCESS) {
    ctx_ = nullptr;
    return bail("cuDevicePrimaryCtxRetain", r);
  }
  set_current();

  if (first) {
    std::size_t free = 0, total = 0;
    if (const CUresult r = drv_.mem_get_info(&free, &total); r != CUDA_SUCCESS)
      return bail("cuMemGetInfo", r);
    info_.arena_size = static_cast<Bytes>(static_cast<double>(free) * opts_.memory_fraction) /
                       kArenaAlign * kArenaAlign;
    if (opts_.arena_bytes != 0) {
      if (opts_.arena_bytes > free)
        return bail(fmt::format("the arena needs {} MiB but only {} MiB are free",
                                opts_.arena_bytes >> 20, free >> 20),
                    CUDA_SUCCESS);
      info_.arena_size = opts_.arena_bytes;
    }
    if (info_.arena_size == 0) return bail("no free device memory for the arena", CUDA_SUCCESS);
  }
  if (const CUresult r = reserve_arena(first); r != CUDA_SUCCESS)
    return bail(fmt::format("cannot reserve the arena ({} MiB)", info_.arena_size >> 20), r);

  if (const CUresult r = drv_.stream_create(&maint_, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS)
    return bail("cuStreamCreate", r);
  if (const CUresult r = drv_.event_create(&discard_event_, CU_EVENT_DISABLE_TIMING);
      r != CUDA_SUCCESS)
    return bail("cuEventCreate", r);
  if (const CUresult r = clear_arena(); r != CUDA_SUCCESS) return bail("clearing the arena", r);
  load_builtins();
}

CUresult CudaDevice::reserve_arena(bool first) {
  if (vmm_) {
    std::lock_guard lock(maint_mu_);
    const CUresult r = vmm_->reserve(info_.arena_size);
    if (r == CUDA_SUCCESS) arena_base_.store(vmm_->base());
    return r;
  }
  // The free figure includes memory the driver cannot hand out in one piece;
  // step down a little until the reservation succeeds (first open only: after a
  // recovery the broker's layout needs exactly the old size).
  CUdeviceptr base = 0;
  for (int attempt = 0;; ++attempt) {
    const CUresult r = drv_.mem_alloc(&base, info_.arena_size);
    if (r == CUDA_SUCCESS) break;
    if (!first || opts_.arena_bytes != 0 || r != CUDA_ERROR_OUT_OF_MEMORY || attempt == 8) return r;
    info_.arena_size = info_.arena_size / 100 * 95 / kArenaAlign * kArenaAlign;
  }
  arena_base_.store(base);
  return CUDA_SUCCESS;
}

// Fresh device memory may hold anything; the contract is that unused memory
// reads as zero. Synchronous: nothing runs before it is done. Backed on demand,
// only what the lost context had backed comes back (cleared); at start-up
// nothing is backed yet.
CUresult CudaDevice::clear_arena() {
  if (vmm_) {
    std::vector<arena::ChunkRun> was;
    {
      std::lock_guard lock(maint_mu_);
      // The runs an empty wish would unmap are exactly those that were backed.
      was = arena::backing_change(backed_before_loss_, {}).unmap;
      backed_before_loss_.clear();
    }
    for (const arena::ChunkRun& run : was)
      if (const CUresult r = back_run(run); r != CUDA_SUCCESS) return r;
  } else if (const CUresult r =
                 drv_.memset_d32_async(arena_base_.load(), 0, info_.arena_size / 4, maint_);
             r != CUDA_SUCCESS) {
    return r;
  }
  return drv_.stream_synchronize(maint_);
}

CUresult CudaDevice::back_run(const arena::ChunkRun& run) {
  // The driver's calls without maint_mu_, which every op's enqueue takes; map()
  // backs a prefix of the run even when it fails part way.
  std::uint64_t mapped = 0;
  const CUresult r = vmm_->map(run, mapped);
  if (mapped > 0) {
    std::lock_guard lock(maint_mu_);
    const Bytes chunk = vmm_->chunk();
    CUresult c = drv_.memset_d8_async(at(run.first * chunk), 0, mapped * chunk, maint_);
    if (c == CUDA_SUCCESS) c = drv_.event_record(discard_event_, maint_);
    if (c != CUDA_SUCCESS) return c;
    ++discard_seq_;
  }
  return r;
}

bool CudaDevice::all_backed(DevOffset offset, Bytes length) const {
  if (!vmm_) return true;
  const Bytes chunk = vmm_->chunk();
  return vmm_->all_backed(offset / chunk, (offset + length - 1) / chunk);
}

int CudaDevice::set_backing(const std::vector<arena::ByteRange>& held, std::string& why) {
  if (!vmm_) return 0;
  std::shared_lock ctx(ctx_mu_);
  if (dead_.load() || maint_ == nullptr) {
    why = dead_.load() ? dead_reason() : "the GPU context is being rebuilt";
    return EIO;
  }
  set_current();
  // One caller at a time (the broker's backer thread, or the executor's): the
  // driver's calls run with no lock that an op's enqueue or a discard takes;
  // maint_mu_ is held only to clear each new piece (back_run).
  const auto change =
      arena::backing_change(vmm_->backed(), arena::chunks_covering(held, vmm_->chunk()));
  if (!change.unmap.empty()) {
    // Nothing but discards (on maint_) may still use memory that nobody holds.
    std::lock_guard lock(maint_mu_);
    if (const CUresult r = drv_.stream_synchronize(maint_); r != CUDA_SUCCESS) {
      why = fmt::format("waiting for the discards before giving memory back: {}", drv_.describe(r));
      if (is_sticky(r)) note_fault(r);
      return EIO;
    }
  }
  for (const arena::ChunkRun& run : change.unmap) vmm_->unmap(run);
  for (const arena::ChunkRun& run : change.map)
    for (const arena::ChunkRun& piece : arena::split_run(run, kBackingPiece)) {
      if (const CUresult r = back_run(piece); r != CUDA_SUCCESS) {
        std::size_t free = 0, total = 0;
        drv_.mem_get_info(&free, &total);
        why = fmt::format(
            "backing {} MiB of the arena at {} MiB: {}; {} MiB of the card are free and salusd "
            "backs {} MiB (memory taken by processes outside salusd?)",
            run.count * vmm_->chunk() >> 20, run.first * vmm_->chunk() >> 20, drv_.describe(r),
            free >> 20, vmm_->backed_bytes() >> 20);
        if (is_sticky(r)) note_fault(r);
        return r == CUDA_ERROR_OUT_OF_MEMORY ? ENOMEM : to_errno(r);
      }
    }
  return 0;
}

Bytes CudaDevice::backed_bytes() const {
  // Not under maint_mu_: set_backing may hold it for a piece of a long change.
  return vmm_ ? vmm_->backed_bytes() : info_.arena_size;
}

void CudaDevice::load_builtins() {
  builtin_module_ = nullptr;
  spin_fn_ = gemm_fn_ = nullptr;
  if (builtin_fatbin_size == 0) {
    builtins_why_ = kNoBuiltinsReason;
    return;
  }
  CUresult r = drv_.module_load_data_ex(&builtin_module_, builtin_fatbin, 0, nullptr, nullptr);
  if (r == CUDA_SUCCESS) r = drv_.module_get_function(&spin_fn_, builtin_module_, "salus_spin");
  if (r == CUDA_SUCCESS) r = drv_.module_get_function(&gemm_fn_, builtin_module_, "salus_gemm");
  if (r != CUDA_SUCCESS) {
    // Most likely a driver older than the nvcc that built salusd, or a GPU older
    // than every architecture in the fatbin. fill/copy/modules still work.
    builtins_why_ = fmt::format(
        "built-in ops unavailable: the embedded kernels ({}) do not load on this GPU/driver: {}",
        builtin_fatbin_description, drv_.describe(r));
    spin_fn_ = gemm_fn_ = nullptr;
    spdlog::warn("cuda gpu{}: {}", info_.index, builtins_why_);
    return;
  }
  builtins_why_.clear();
}

void CudaDevice::calibrate_spin(int clock_khz) {
  // The nominal clock is the fallback; the measurement wins when it is sane,
  // since boost clocks run well above the attribute on most parts.
  const double nominal = clock_khz / 1000.0;
  cycles_per_usec_ = nominal;
  if (spin_fn_ == nullptr) return;
  CUevent e0 = nullptr, e1 = nullptr;
  if (drv_.event_create(&e0, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return;
  if (drv_.event_create(&e1, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
    drv_.event_destroy(e0);
    return;
  }
  auto run = [&](unsigned long long cycles, float& ms) {
    void* params[] = {&cycles};
    if (drv_.event_record(e0, maint_) != CUDA_SUCCESS ||
        drv_.launch_kernel(spin_fn_, 1, 1, 1, 32, 1, 1, 0, maint_, params, nullptr) !=
            CUDA_SUCCESS ||
        drv_.event_record(e1, maint_) != CUDA_SUCCESS ||
        drv_.event_synchronize(e1) != CUDA_SUCCESS ||
        drv_.event_elapsed_time(&ms, e0, e1) != CUDA_SUCCESS)
      return false;
    return true;
  };
  const auto cycles = static_cast<unsigned long long>(nominal * 20'000);  // ~20 ms
  float ms = 0;
  std::vector<double> rates;
  if (run(cycles / 10, ms)) {  // warm-up: wakes the GPU out of its idle clocks
    for (int i = 0; i < 3; ++i)
      if (run(cycles, ms) && ms > 0) rates.push_back(static_cast<double>(cycles) / (ms * 1000.0));
  }
  drv_.event_destroy(e0);
  drv_.event_destroy(e1);
  if (rates.empty()) return;
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  if (median > nominal / 4 && median < nominal * 4) cycles_per_usec_ = median;
}

void CudaDevice::release_context_resources() {
  // Healthy teardown only (the context works): each object is destroyed
  // explicitly. After a fault the context reset frees all of it instead.
  for (const auto& s : all_streams()) {
    std::lock_guard lock(s->mu);
    release_interval(s->open);
    if (s->scratch != 0) drv_.mem_free(s->scratch);
    if (s->handle != nullptr) drv_.stream_destroy(s->handle);
    if (s->wake != nullptr) drv_.stream_destroy(s->wake);
    s->scratch = 0;
    s->handle = nullptr;
    s->wake = nullptr;
  }
  {
    std::lock_guard lock(modules_mu_);
    for (auto& [id, m] : modules_)
      if (m.handle != nullptr) drv_.module_unload(m.handle);
    modules_.clear();
    for (RetiredModule& r : retired_) {
      drv_.module_unload(r.handle);
      for (CUevent e : r.fences) drv_.event_destroy(e);
    }
    retired_.clear();
  }
  {
    std::lock_guard lock(pool_mu_);
    for (CUevent e : free_events_) drv_.event_destroy(e);
    free_events_.clear();
    for (auto& [cls, blocks] : free_blocks_)
      for (void* p : blocks) drv_.mem_free_host(p);
    free_blocks_.clear();
    cached_bytes_ = 0;
  }
  if (builtin_module_ != nullptr) drv_.module_unload(builtin_module_);
  builtin_module_ = nullptr;
  spin_fn_ = gemm_fn_ = nullptr;
  if (discard_event_ != nullptr) drv_.event_destroy(discard_event_);
  discard_event_ = nullptr;
  if (maint_ != nullptr) drv_.stream_destroy(maint_);
  maint_ = nullptr;
  if (const CUdeviceptr base = arena_base_.exchange(0); base != 0) {
    if (vmm_)
      vmm_->release();
    else
      drv_.mem_free(base);
  }
}

void CudaDevice::set_sink(CompletionSink* sink) {
  sink_.store(sink, std::memory_order_release);
}

bool CudaDevice::builtins_available(std::string& why) const {
  std::shared_lock ctx(ctx_mu_);
  if (builtins_why_.empty() && spin_fn_ != nullptr) return true;
  why = builtins_why_.empty() ? "built-in kernels lost in a failed recovery" : builtins_why_;
  return false;
}

// ---------------------------------------------------------------- streams

std::shared_ptr<CudaDevice::Stream> CudaDevice::find_stream(StreamId id) const {
  std::lock_guard lock(table_mu_);
  return id < streams_.size() ? streams_[id] : nullptr;
}

std::vector<std::shared_ptr<CudaDevice::Stream>> CudaDevice::all_streams() const {
  std::lock_guard lock(table_mu_);
  std::vector<std::shared_ptr<Stream>> out;
  for (const auto& s : streams_)
    if (s) out.push_back(s);
  return out;
}

CUstream CudaDevice::create_wake_stream() {
  if (!opts_.host_func_wakeup) return nullptr;
  CUstream wake = nullptr;
  if (const CUresult r = drv_.stream_create(&wake, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
    spdlog::warn("cuda gpu{}: no wake-up stream ({}); completions are polled", info_.index,
                 drv_.describe(r));
    return nullptr;
  }
  return wake;
}

StreamId CudaDevice::create_stream() {
  std::shared_lock ctx(ctx_mu_);
  CUstream handle = nullptr;
  if (!dead_.load()) {
    set_current();
    const CUresult r = drv_.stream_create(&handle, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) {
      handle = nullptr;
      if (is_sticky(r)) {
        // Recovery gives every stream in the table a new handle, this one too;
        // until then its ops complete with EIO.
        note_fault(r);
      } else {
        throw std::runtime_error(
            fmt::format("cuda gpu{}: cuStreamCreate: {}", info_.index, drv_.describe(r)));
      }
    }
  }
  CUstream wake = handle != nullptr ? create_wake_stream() : nullptr;
  std::lock_guard lock(table_mu_);
  std::size_t id = 0;
  while (id < streams_.size() && streams_[id]) ++id;
  if (id == streams_.size()) streams_.emplace_back();
  auto s = std::make_shared<Stream>(static_cast<StreamId>(id));
  s->handle = handle;
  s->wake = wake;
  streams_[id] = std::move(s);
  return static_cast<StreamId>(id);
}

void CudaDevice::destroy_stream(StreamId id) {
  if (std::this_thread::get_id() == poller_.get_id())
    throw std::logic_error(
        fmt::format("cuda gpu{}: stream {} destroyed from a completion callback", info_.index, id));
  const std::shared_ptr<Stream> s = find_stream(id);
  if (!s) throw std::invalid_argument(fmt::format("cuda gpu{}: no stream {}", info_.index, id));
  {
    std::shared_lock ctx(ctx_mu_);
    std::lock_guard lock(s->mu);
    if (s->closing)
      throw std::invalid_argument(
          fmt::format("cuda gpu{}: stream {} is already being destroyed", info_.index, id));
    s->closing = true;
  }
  // Without the context lock: the completion thread may need it exclusively (a
  // recovery) before it can deliver what we wait for.
  {
    std::unique_lock lock(pending_mu_);
    pending_cv_.wait(lock, [&] { return s->pending.empty(); });
  }
  {
    std::shared_lock ctx(ctx_mu_);
    std::lock_guard lock(s->mu);
    if (s->handle != nullptr) {
      set_current();
      // Ops after the last notify still run to the end, as the contract says.
      const CUresult r = drv_.stream_synchronize(s->handle);
      if (r == CUDA_SUCCESS) {
        release_interval(s->open);
        if (s->scratch != 0) drv_.mem_free(s->scratch);
        drv_.stream_destroy(s->handle);
        // Its pending host functions only poke the waker, which outlives it.
        if (s->wake != nullptr) drv_.stream_destroy(s->wake);
      } else if (is_sticky(r)) {
        note_fault(r);  // the handles die with the context reset
      }
      s->handle = nullptr;
      s->wake = nullptr;
      s->scratch = 0;
    }
    s->open = Interval{};
  }
  std::lock_guard lock(table_mu_);
  if (id < streams_.size() && streams_[id] == s) streams_[id] = nullptr;
}

// ---------------------------------------------------------------- op helpers

void CudaDevice::fail(Stream& s, int err, const std::string& why) {
  if (s.open.status == 0) {
    // First failure per interval only: a broken session would otherwise log a
    // line per op.
    spdlog::warn("cuda gpu{} stream {}: {}", info_.index, s.id, why);
    s.open.status = err;
  }
}

bool CudaDevice::check(Stream& s, CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  if (is_sticky(r)) {
    // Not necessarily this op's doing: the recovery decides who gets EFAULT.
    note_fault(r);
    fail(s, EIO, fmt::format("{}: {}", what, drv_.describe(r)));
  } else {
    fail(s, to_errno(r), fmt::format("{}: {}", what, drv_.describe(r)));
  }
  return false;
}

bool CudaDevice::begin_op(Stream& s) {
  ++s.open.ops;
  if (dead_.load()) {
    fail(s, ENODEV, dead_reason());
    return false;
  }
  if (s.handle == nullptr) {
    fail(s, EIO, "the stream was lost in a device fault");
    return false;
  }
  {
    std::lock_guard lock(maint_mu_);
    if (s.discards_seen != discard_seq_) {
      // Freed ranges must read as zero before this stream touches them again.
      if (!check(s, drv_.stream_wait_event(s.handle, discard_event_, 0), "cuStreamWaitEvent"))
        return false;
      s.discards_seen = discard_seq_;
    }
  }
  if (s.open.start == nullptr) {
    CUevent e = nullptr;
    if (!check(s, acquire_event(e), "cuEventCreate")) return false;
    if (!check(s, drv_.event_record(e, s.handle), "cuEventRecord")) {
      release_event(e);
      return false;
    }
    s.open.start = e;
  }
  return true;
}

bool CudaDevice::ensure_scratch(Stream& s) {
  if (s.scratch != 0) return true;
  return check(s, drv_.mem_alloc(&s.scratch, kScratchBytes), "allocating stream scratch");
}

bool CudaDevice::builtins_ok(Stream& s, CUfunction fn) {
  if (fn != nullptr) return true;
  fail(s, ENOSYS,
       builtins_why_.empty() ? std::string("built-in kernels unavailable") : builtins_why_);
  return false;
}

CUresult CudaDevice::acquire_event(CUevent& e) {
  {
    std::lock_guard lock(pool_mu_);
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
      return CUDA_SUCCESS;
    }
  }
  // Timing events (CU_EVENT_DEFAULT): device_ns comes from cuEventElapsedTime.
  const CUresult r = drv_.event_create(&e, CU_EVENT_DEFAULT);
  if (r != CUDA_SUCCESS) e = nullptr;
  return r;
}

void CudaDevice::release_event(CUevent e) {
  if (e == nullptr) return;
  std::lock_guard lock(pool_mu_);
  free_events_.push_back(e);
}

CudaDevice::PinnedBlock CudaDevice::acquire_pinned(Bytes size) {
  const Bytes cls = size_class(size);
  {
    std::lock_guard lock(pool_mu_);
    auto it = free_blocks_.find(cls);
    if (it != free_blocks_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= cls;
      return PinnedBlock{p, cls};
    }
  }
  void* p = nullptr;
  if (drv_.mem_host_alloc(&p, cls, 0) != CUDA_SUCCESS) return PinnedBlock{};
  return PinnedBlock{p, cls};
}

void CudaDevice::release_pinned(PinnedBlock b) {
  if (b.ptr == nullptr) return;
  {
    std::lock_guard lock(pool_mu_);
    if (cached_bytes_ + b.size <= opts_.staging_cache) {
      free_blocks_[b.size].push_back(b.ptr);
      cached_bytes_ += b.size;
      return;
    }
  }
  drv_.mem_free_host(b.ptr);
}

void CudaDevice::release_interval(Interval& iv) {
  release_event(iv.start);
  release_event(iv.end);
  iv.start = iv.end = nullptr;
  for (const PinnedBlock& b : iv.blocks) release_pinned(b);
  iv.blocks.clear();
  iv.copy_out.clear();
}

// ---------------------------------------------------------------- ops

void CudaDevice::fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
                      unsigned width) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s)) return;
  std::vector<FillPiece> pieces;
  if (!plan_fill(at(dst), length, pattern, width, pieces))
    return fail(s, EINVAL, fmt::format("fill width {} is not 1, 2 or 4", width));
  for (const FillPiece& p : pieces) {
    const CUdeviceptr to = at(dst) + p.offset;
    const CUresult r = p.unit == 1 ? drv_.memset_d8_async(to, static_cast<unsigned char>(p.value),
                                                          p.count, s.handle)
                                   : drv_.memset_d32_async(to, p.value, p.count, s.handle);
    if (!check(s, r, "fill")) return;
  }
}

void CudaDevice::copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s)) return;
  std::vector<CopyPiece> pieces;
  plan_copy(dst, src, length, kScratchBytes, pieces);
  for (const CopyPiece& p : pieces) {
    if ((p.dst_scratch || p.src_scratch) && !ensure_scratch(s)) return;
    const CUdeviceptr to = p.dst_scratch ? s.scratch + p.dst : at(p.dst);
    const CUdeviceptr from = p.src_scratch ? s.scratch + p.src : at(p.src);
    if (!check(s, drv_.memcpy_dtod_async(to, from, p.length, s.handle), "copy")) return;
  }
}

void CudaDevice::spin(StreamId stream, std::uint64_t usec, double util) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s) || !builtins_ok(s, spin_fn_)) return;
  unsigned long long cycles = spin_cycles(usec, cycles_per_usec_);
  if (cycles == 0) return;
  const std::uint32_t blocks = spin_blocks(util, info_.sm_count, threads_per_sm_);
  void* params[] = {&cycles};
  check(s,
        drv_.launch_kernel(spin_fn_, blocks, 1, 1, kSpinBlockThreads, 1, 1, 0, s.handle, params,
                           nullptr),
        "spin");
}

void CudaDevice::gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k,
                      DevOffset a, DevOffset b, DevOffset c) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s) || !builtins_ok(s, gemm_fn_)) return;
  if (m == 0 || n == 0) return;
  std::uint32_t grid[2];
  std::string why;
  if (!gemm_grid(m, n, at(a), at(b), at(c), grid, why)) return fail(s, EINVAL, why);
  const std::uint64_t c_bytes = mul_sat(mul_sat(m, n), 4);
  const bool alias = ranges_overlap(c, c_bytes, a, mul_sat(mul_sat(m, k), 4)) ||
                     ranges_overlap(c, c_bytes, b, mul_sat(mul_sat(k, n), 4));
  CUdeviceptr out = at(c);
  if (alias) {
    // The kernel reads A and B tile by tile while other blocks write C: compute
    // into scratch, then copy, so the result is as if the inputs were read first.
    if (c_bytes > kScratchBytes)
      return fail(s, EINVAL,
                  fmt::format("gemm output overlapping its inputs is limited to {} MiB on cuda",
                              kScratchBytes >> 20));
    if (!ensure_scratch(s)) return;
    out = s.scratch;
  }
  CUdeviceptr pa = at(a), pb = at(b);
  unsigned um = m, un = n, uk = k;
  void* params[] = {&um, &un, &uk, &pa, &pb, &out};
  if (!check(s,
             drv_.launch_kernel(gemm_fn_, grid[0], grid[1], 1, kGemmBlockThreads, 1, 1, 0, s.handle,
                                params, nullptr),
             "gemm"))
    return;
  if (alias) check(s, drv_.memcpy_dtod_async(at(c), out, c_bytes, s.handle), "gemm");
}

void CudaDevice::copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s) || length == 0) return;
  if (length <= opts_.staging_limit) {
    if (const PinnedBlock b = acquire_pinned(length); b.ptr != nullptr) {
      s.open.blocks.push_back(b);  // returned to the pool at completion either way
      if (check(s, drv_.memcpy_dtoh_async(b.ptr, at(src), length, s.handle), "copy to host"))
        s.open.copy_out.push_back(CopyOut{host, b.ptr, length});
      return;
    }
  }
  // Pageable memory: the driver returns only once the data has arrived.
  check(s, drv_.memcpy_dtoh_async(host, at(src), length, s.handle), "copy to host");
}

void CudaDevice::copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s) || length == 0) return;
  if (length <= opts_.staging_limit) {
    if (const PinnedBlock b = acquire_pinned(length); b.ptr != nullptr) {
      std::memcpy(b.ptr, host, length);
      s.open.blocks.push_back(b);
      check(s, drv_.memcpy_htod_async(at(dst), b.ptr, length, s.handle), "copy from host");
      return;
    }
  }
  // Pageable memory: the driver stages it itself, after waiting for the stream.
  check(s, drv_.memcpy_htod_async(at(dst), host, length, s.handle), "copy from host");
}

void* CudaDevice::alloc_staging(Bytes size) {
  void* p = Device::alloc_staging(size);
  if (!p) return nullptr;
  StagingBlock b;
  b.size = size;
  {
    std::shared_lock ctx(ctx_mu_);
    if (!dead_.load()) {
      set_current();
      b.generation = generation_.load();
      const CUresult r = drv_.mem_host_register(p, size, 0);
      b.registered = r == CUDA_SUCCESS;
      if (!b.registered)
        spdlog::warn(
            "cuda gpu{}: pinning a {}-byte staging block failed ({}); its copies take "
            "the slower pageable path",
            info_.index, size, drv_.error_name(r));
    }
  }
  std::lock_guard lk(staging_mu_);
  staging_[reinterpret_cast<std::uintptr_t>(p)] = b;
  return p;
}

void CudaDevice::free_staging(void* block, Bytes size) {
  if (!block) return;
  StagingBlock b;
  {
    std::lock_guard lk(staging_mu_);
    auto it = staging_.find(reinterpret_cast<std::uintptr_t>(block));
    if (it != staging_.end()) {
      b = it->second;
      staging_.erase(it);
    }
  }
  if (b.registered) {
    std::shared_lock ctx(ctx_mu_);
    // A registration from an older context died with it.
    if (!dead_.load() && b.generation == generation_.load()) {
      set_current();
      drv_.mem_host_unregister(block);
    }
  }
  Device::free_staging(block, size);
}

bool CudaDevice::staging_pinned(const void* host, Bytes length) {
  const auto at = reinterpret_cast<std::uintptr_t>(host);
  std::uintptr_t base = 0;
  StagingBlock b;
  {
    std::lock_guard lk(staging_mu_);
    auto it = staging_.upper_bound(at);
    if (it == staging_.begin()) return false;
    --it;
    if (at + length > it->first + it->second.size) return false;
    if (it->second.generation == generation_.load()) return it->second.registered;
    base = it->first;
    b = it->second;
  }
  // Registered with a context a fault recovery replaced: register again. The
  // block is in use by the caller, so nobody frees it meanwhile.
  {
    std::shared_lock ctx(ctx_mu_);
    if (dead_.load()) return false;
    set_current();
    b.generation = generation_.load();
    b.registered = drv_.mem_host_register(reinterpret_cast<void*>(base), b.size, 0) == CUDA_SUCCESS;
  }
  std::lock_guard lk(staging_mu_);
  if (auto it = staging_.find(base); it != staging_.end()) it->second = b;
  return b.registered;
}

void CudaDevice::copy_in(StreamId stream, DevOffset dst, const void* host, Bytes length,
                         bool pinned) {
  if (!pinned) return copy_from_host(stream, dst, host, length);
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s) || length == 0) return;
  check(s, drv_.memcpy_htod_async(at(dst), host, length, s.handle), "copy from host");
}

void CudaDevice::copy_out(StreamId stream, void* host, DevOffset src, Bytes length, bool pinned) {
  if (!pinned) return copy_to_host(stream, host, src, length);
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s) || length == 0) return;
  check(s, drv_.memcpy_dtoh_async(host, at(src), length, s.handle), "copy to host");
}

void CudaDevice::copy_from_staging(StreamId stream, DevOffset dst, const void* host, Bytes length) {
  copy_in(stream, dst, host, length, staging_pinned(host, length));
}

void CudaDevice::copy_to_staging(StreamId stream, void* host, DevOffset src, Bytes length) {
  copy_out(stream, host, src, length, staging_pinned(host, length));
}

bool CudaDevice::register_host(void* p, Bytes size, bool writable) {
  const CUresult r = drv_.mem_host_register(p, size, writable ? 0 : CU_MEMHOSTREGISTER_READ_ONLY);
  if (r != CUDA_SUCCESS)
    spdlog::warn(
        "cuda gpu{}: pinning {} bytes of {} host memory failed ({}); its copies take the "
        "slower pageable path",
        info_.index, size, writable ? "writable" : "read-only", drv_.error_name(r));
  return r == CUDA_SUCCESS;
}

int CudaDevice::map_region(int fd, Bytes size, bool writable, RegionId& out, std::string& why) {
  if (const int err = regions_.map(fd, size, writable, out, why)) return err;
  const auto r = regions_.find(out);
  std::shared_lock ctx(ctx_mu_);
  if (!dead_.load()) {
    set_current();
    regions_.set_pinned(out, register_host(r->base, r->size, r->writable), generation_.load());
  }
  return 0;
}

void CudaDevice::unmap_region(RegionId region) {
  const auto r = regions_.remove(region);
  if (!r) return;
  if (r->pinned) {
    std::shared_lock ctx(ctx_mu_);
    if (!dead_.load() && r->pin_generation == generation_.load()) {
      set_current();
      drv_.mem_host_unregister(r->base);
    }
  }
  HostRegions::unmap(*r);
}

bool CudaDevice::region_pinned(RegionId region) {
  const auto r = regions_.find(region);
  if (!r) return false;
  if (r->pin_generation == generation_.load()) return r->pinned;
  // Registered with a context a fault recovery replaced: register again. The
  // region is in use by the caller, so nobody unmaps it meanwhile.
  std::shared_lock ctx(ctx_mu_);
  if (dead_.load()) return false;
  set_current();
  const bool pinned = register_host(r->base, r->size, r->writable);
  regions_.set_pinned(region, pinned, generation_.load());
  return pinned;
}

void CudaDevice::copy_from_region(StreamId stream, DevOffset dst, RegionId region, Bytes offset,
                                  Bytes length) {
  copy_in(stream, dst, regions_.at(region, offset, length, false), length, region_pinned(region));
}

void CudaDevice::copy_to_region(StreamId stream, RegionId region, Bytes offset, DevOffset src,
                                Bytes length) {
  copy_out(stream, regions_.at(region, offset, length, true), src, length, region_pinned(region));
}

void CudaDevice::notify(StreamId stream, std::uint64_t token) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  Interval iv = std::move(s.open);
  s.open = Interval{};
  iv.token = token;
  if (dead_.load()) {
    if (iv.status == 0) iv.status = ENODEV;
  } else if (s.handle == nullptr) {
    if (iv.status == 0) iv.status = EIO;
  } else {
    CUevent e = nullptr;
    CUresult r = acquire_event(e);
    if (r == CUDA_SUCCESS) r = drv_.event_record(e, s.handle);
    if (r == CUDA_SUCCESS) {
      iv.end = e;
      if (s.wake != nullptr) {
        // Wakes the completion thread the moment the stream gets here, without
        // holding up the stream. If it fails, polling still finds the event.
        r = drv_.stream_wait_event(s.wake, e, 0);
        if (r == CUDA_SUCCESS)
          r = drv_.launch_host_func(s.wake, &CudaDevice::on_host_wake, waker_.get());
        if (is_sticky(r)) note_fault(r);
      }
    } else {
      release_event(e);
      if (is_sticky(r)) note_fault(r);
      if (iv.status == 0) {
        spdlog::warn("cuda gpu{} stream {}: notify: {}", info_.index, s.id, drv_.describe(r));
        iv.status = is_sticky(r) ? EIO : to_errno(r);
      }
    }
  }
  const bool immediate = iv.end == nullptr;
  bool first = false;
  {
    std::lock_guard lock(pending_mu_);
    s.pending.push_back(std::move(iv));
    first = pending_total_.fetch_add(1) == 0;
  }
  // The completion thread sleeps without a timeout while nothing is pending; the
  // first notify switches it to polling (which also catches faults).
  if (first || immediate) poke();
}

void CudaDevice::discard(DevOffset offset, Bytes length) {
  if (length == 0) return;
  std::shared_lock ctx(ctx_mu_);
  if (dead_.load() || maint_ == nullptr) return;  // the memory is gone anyway
  set_current();
  std::lock_guard lock(maint_mu_);
  if (!all_backed(offset, length)) {
    // A broker bug, not a user's: clearing it would fault the whole context.
    spdlog::error("cuda gpu{}: discard of {} bytes at {}: not backed; skipped", info_.index, length,
                  offset);
    return;
  }
  CUresult r = drv_.memset_d8_async(at(offset), 0, length, maint_);
  if (r == CUDA_SUCCESS) r = drv_.event_record(discard_event_, maint_);
  if (r == CUDA_SUCCESS) {
    ++discard_seq_;
    return;
  }
  spdlog::error("cuda gpu{}: discard of {} bytes at {}: {}", info_.index, length, offset,
                drv_.describe(r));
  if (is_sticky(r)) note_fault(r);  // the recovery clears the whole arena
}

int CudaDevice::make_lane_memory(Bytes size, UniqueFd& out, std::string& why) {
  if (drv_.mem_create == nullptr) {
    why = "the driver has no VMM with POSIX file descriptor handles";
    return EOPNOTSUPP;
  }
  std::shared_lock ctx(ctx_mu_);
  if (dead_.load()) {
    why = dead_reason();
    return EIO;
  }
  set_current();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = drv_.mem_create(&h, size, &prop, 0);
  if (r != CUDA_SUCCESS) {
    why = fmt::format("cuMemCreate of {} bytes: {}", size, drv_.describe(r));
    return to_errno(r);
  }
  int fd = -1;
  r = drv_.mem_export(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    drv_.mem_release(h);
    why = fmt::format("cuMemExportToShareableHandle: {}", drv_.describe(r));
    return to_errno(r);
  }
  out.reset(fd);
  std::lock_guard lk(lane_mu_);
  lane_handles_[fd] = {h, size};
  return 0;
}

int CudaDevice::clear_lane_memory(int fd, Bytes size, std::string& why) {
  CUmemGenericAllocationHandle h = 0;
  {
    std::lock_guard lk(lane_mu_);
    auto it = lane_handles_.find(fd);
    if (it == lane_handles_.end() || it->second.second != size) {
      why = "not lane memory of this device";
      return EINVAL;
    }
    h = it->second.first;
  }
  std::shared_lock ctx(ctx_mu_);
  if (dead_.load() || maint_ == nullptr) {
    why = dead_reason();
    return EIO;
  }
  set_current();
  CUdeviceptr p = 0;
  CUresult r = drv_.mem_address_reserve(&p, size, 0, 0, 0);
  bool mapped = false;
  if (r == CUDA_SUCCESS) r = drv_.mem_map(p, size, 0, h, 0);
  mapped = r == CUDA_SUCCESS;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (r == CUDA_SUCCESS) r = drv_.mem_set_access(p, size, &access, 1);
  if (r == CUDA_SUCCESS) {
    std::lock_guard lock(maint_mu_);
    r = drv_.memset_d8_async(p, 0, size, maint_);
    if (r == CUDA_SUCCESS) r = drv_.stream_synchronize(maint_);
  }
  if (mapped) drv_.mem_unmap(p, size);
  if (p != 0) drv_.mem_address_free(p, size);
  if (r == CUDA_SUCCESS) return 0;
  why = fmt::format("clearing {} bytes of lane memory: {}", size, drv_.describe(r));
  if (is_sticky(r)) note_fault(r);
  return to_errno(r);
}

void CudaDevice::drop_lane_memory(int fd) {
  CUmemGenericAllocationHandle h = 0;
  {
    std::lock_guard lk(lane_mu_);
    auto it = lane_handles_.find(fd);
    if (it == lane_handles_.end()) return;
    h = it->second.first;
    lane_handles_.erase(it);
  }
  std::shared_lock ctx(ctx_mu_);
  set_current();
  // Freed once no program has it mapped any more.
  if (const CUresult r = drv_.mem_release(h); r != CUDA_SUCCESS)
    spdlog::error("cuda gpu{}: releasing lane memory: {}", info_.index, drv_.describe(r));
}

std::int64_t CudaDevice::busy_ns() const {
  std::lock_guard lock(busy_mu_);
  return busy_.total();
}

// ---------------------------------------------------------------- modules

int CudaDevice::load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                            std::string& why) {
  const ImageKind kind = classify_image(image.data(), image.size());
  if (kind == ImageKind::empty) {
    why = "the module file is empty";
    return EINVAL;
  }
  if (kind == ImageKind::unknown) {
    why = "not a cubin, fatbin or PTX image (the cuda backend does not load host .so modules)";
    return EINVAL;
  }
  std::vector<std::uint8_t> copy = image;
  if (kind == ImageKind::ptx && copy.back() != 0) copy.push_back(0);  // the driver wants a C string

  std::shared_lock ctx(ctx_mu_);
  if (dead_.load()) {
    why = dead_reason();
    return ENODEV;
  }
  set_current();
  // The JIT's own words beat a bare CUDA_ERROR_INVALID_PTX.
  char log[2048] = {};
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log, reinterpret_cast<void*>(static_cast<std::uintptr_t>(sizeof log - 1))};
  CUmodule handle = nullptr;
  const CUresult r = drv_.module_load_data_ex(&handle, copy.data(), 2, options, values);
  if (r != CUDA_SUCCESS) {
    if (is_sticky(r)) note_fault(r);
    std::string detail(log, ::strnlen(log, sizeof log));
    if (const auto nl = detail.find('\n'); nl != std::string::npos) detail.resize(nl);
    switch (r) {
      case CUDA_ERROR_NO_BINARY_FOR_GPU:
        why = "the image has no code for this GPU's architecture and no PTX to compile";
        break;
      case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        why = fmt::format("the PTX is newer than this driver (CUDA {}) can compile",
                          info_.driver_version);
        break;
      default:
        why = drv_.describe(r);
    }
    if (!detail.empty()) why += ": " + detail;
    return to_errno(r) == EFAULT ? EIO : to_errno(r);
  }
  std::lock_guard lock(modules_mu_);
  if (next_module_ == 0) {
    drv_.module_unload(handle);
    why = "module handles exhausted";
    return ENOSPC;
  }
  out = next_module_++;
  Module& m = modules_[out];
  m.image = std::move(copy);
  m.handle = handle;
  return 0;
}

void CudaDevice::unload_module(ModuleHandle module) {
  std::shared_lock ctx(ctx_mu_);
  RetiredModule retired{};
  {
    std::lock_guard lock(modules_mu_);
    auto it = modules_.find(module);
    if (it == modules_.end()) return;
    retired.handle = it->second.handle;
    modules_.erase(it);
  }
  if (retired.handle == nullptr || dead_.load()) return;
  set_current();
  // A fence on every stream: once all have passed, no queued launch can still
  // need the module's code.
  for (const auto& s : all_streams()) {
    std::lock_guard lock(s->mu);
    if (s->handle == nullptr) continue;
    CUevent e = nullptr;
    if (acquire_event(e) == CUDA_SUCCESS && drv_.event_record(e, s->handle) == CUDA_SUCCESS) {
      retired.fences.push_back(e);
    } else {
      release_event(e);
      drv_.stream_synchronize(s->handle);  // no fence: wait instead (rare)
    }
  }
  {
    std::lock_guard lock(modules_mu_);
    retired_.push_back(std::move(retired));
    retired_count_.store(retired_.size());
  }
  poke();
}

int CudaDevice::get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                             std::vector<std::uint32_t>& param_sizes, std::string& why) {
  param_sizes.clear();
  std::shared_lock ctx(ctx_mu_);
  std::lock_guard lock(modules_mu_);
  auto it = modules_.find(module);
  if (it == modules_.end()) {
    why = fmt::format("no module {}", module);
    return ENOENT;
  }
  Module& m = it->second;
  for (std::size_t i = 0; i < m.functions.size(); ++i)
    if (m.functions[i].name == name) {
      out = pack_function(module, static_cast<std::uint32_t>(i));
      param_sizes = m.functions[i].param_sizes;
      return 0;
    }
  if (m.handle == nullptr) {
    why = "the module was lost in a device fault and could not be reloaded";
    return EIO;
  }
  set_current();
  Function f;
  f.name = name;
  if (const CUresult r = drv_.module_get_function(&f.handle, m.handle, name.c_str());
      r != CUDA_SUCCESS) {
    why = r == CUDA_ERROR_NOT_FOUND
              ? fmt::format(
                    "the module has no kernel '{}' (C++ kernels need their mangled name "
                    "or extern \"C\")",
                    name)
              : drv_.describe(r);
    return r == CUDA_ERROR_NOT_FOUND ? ENOENT : to_errno(r);
  }
  if (drv_.func_get_param_info != nullptr) {
    f.sizes_known = true;
    for (std::uint32_t i = 0; i < kMaxParams; ++i) {
      std::size_t offset = 0, size = 0;
      const CUresult r = drv_.func_get_param_info(f.handle, i, &offset, &size);
      if (r == CUDA_ERROR_INVALID_VALUE) {
        // Past the last parameter. At index 0 it may also mean the driver cannot
        // tell for this function: claim nothing rather than "no parameters".
        if (i == 0) f.sizes_known = false;
        break;
      }
      if (r != CUDA_SUCCESS) {
        f.sizes_known = false;
        f.param_sizes.clear();
        break;
      }
      f.param_sizes.push_back(static_cast<std::uint32_t>(size));
    }
  }
  out = pack_function(module, static_cast<std::uint32_t>(m.functions.size()));
  param_sizes = f.param_sizes;
  m.functions.push_back(std::move(f));
  return 0;
}

std::uint64_t CudaDevice::device_address(DevOffset offset) const {
  return at(offset);
}

void CudaDevice::launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
                        const std::uint8_t* args, const std::uint32_t* arg_sizes,
                        std::size_t arg_count) {
  OpScope op(*this, stream);
  Stream& s = op.stream();
  if (!begin_op(s)) return;
  // Each argument in its own aligned slot: the driver reads kernelParams[i] with
  // the parameter's own alignment.
  std::size_t total = 0;
  std::vector<std::size_t> offsets(arg_count);
  for (std::size_t i = 0; i < arg_count; ++i) {
    offsets[i] = total;
    total += (arg_sizes[i] + kArgAlign - 1) / kArgAlign * kArgAlign;
  }
  std::vector<std::uint64_t> storage(total / sizeof(std::uint64_t) + 2);
  auto* base = reinterpret_cast<std::uint8_t*>(storage.data());
  base += (kArgAlign - reinterpret_cast<std::uintptr_t>(base) % kArgAlign) % kArgAlign;
  std::vector<void*> params(arg_count + 1, nullptr);
  std::size_t src = 0;
  for (std::size_t i = 0; i < arg_count; ++i) {
    if (arg_sizes[i] != 0) std::memcpy(base + offsets[i], args + src, arg_sizes[i]);
    src += arg_sizes[i];
    params[i] = base + offsets[i];
  }

  // Held across the launch so a concurrent unload cannot retire the module
  // between the lookup and cuLaunchKernel.
  std::lock_guard lock(modules_mu_);
  auto it = modules_.find(function_module(function));
  const Function* f = nullptr;
  if (it != modules_.end() && function_index(function) < it->second.functions.size())
    f = &it->second.functions[function_index(function)];
  if (f == nullptr || f->handle == nullptr)
    return fail(s, EINVAL, fmt::format("launch: no function with handle {:#x}", function));
  std::string why;
  if (!check_launch_args(f->sizes_known, f->param_sizes, arg_sizes, arg_count, why))
    return fail(s, EINVAL, fmt::format("launch {}: {}", f->name, why));
  const CUresult r = drv_.launch_kernel(f->handle, dims.grid[0], dims.grid[1], dims.grid[2],
                                        dims.block[0], dims.block[1], dims.block[2],
                                        dims.shared_mem, s.handle, params.data(), nullptr);
  if (r == CUDA_SUCCESS) {
    s.open.user_launch = true;  // a suspect if the context faults before the notify
    return;
  }
  check(s, r, "launch");
}

// ---------------------------------------------------------------- completion thread

void CUDA_CB CudaDevice::on_host_wake(void* p) {
  // Runs on the driver's callback thread, in stream order: must not call CUDA,
  // and must be quick (it holds up the stream). Just wake our thread.
  auto* w = static_cast<Waker*>(p);
  {
    std::lock_guard lock(w->mu);
    w->woken = true;
  }
  w->cv.notify_one();
}

void CudaDevice::poke() {
  {
    std::lock_guard lock(waker_->mu);
    waker_->woken = true;
  }
  waker_->cv.notify_one();
}

void CudaDevice::note_fault(CUresult r) {
  int expected = CUDA_SUCCESS;
  if (fault_.compare_exchange_strong(expected, static_cast<int>(r))) {
    spdlog::error("cuda gpu{}: device fault {}; {}", info_.index, drv_.describe(r),
                  opts_.recover_in_process ? "recovering" : "the context is lost for this process");
    poke();
  }
}

void CudaDevice::poll_loop() {
  std::vector<Delivery> out;
  for (;;) {
    {
      std::unique_lock lock(waker_->mu);
      auto idle = [&] {
        return pending_total_.load() == 0 && retired_count_.load() == 0 &&
               fault_.load() == CUDA_SUCCESS;
      };
      auto ready = [&] { return waker_->woken || (waker_->stop && idle()); };
      if (idle())
        waker_->cv.wait(lock, ready);
      else
        waker_->cv.wait_for(lock, opts_.poll_interval, ready);
      waker_->woken = false;
      if (waker_->stop && idle()) return;
    }
    if (fault_.load() != CUDA_SUCCESS) {
      bool stopping;
      {
        std::lock_guard lock(waker_->mu);
        stopping = waker_->stop;
      }
      // No point rebuilding a context the destructor is about to reset.
      flush_after_fault(!stopping);
      continue;
    }
    collect(out);
    deliver(out);
    if (retired_count_.load() > 0) retire_modules();
  }
}

void CudaDevice::collect(std::vector<Delivery>& out) {
  out.clear();
  std::shared_lock ctx(ctx_mu_);
  set_current();
  for (const auto& s : all_streams()) {
    for (std::size_t i = 0;; ++i) {
      // Once the context has faulted nothing it reports can be trusted, not even
      // an interval that failed before reaching the GPU: the recovery decides
      // every status still pending.
      if (fault_.load() != CUDA_SUCCESS) return;
      Interval* iv;
      {
        std::lock_guard lock(pending_mu_);
        if (i >= s->pending.size()) break;
        iv = &s->pending[i];  // only this thread removes entries; deque keeps it in place
      }
      int status = iv->status;
      std::int64_t device_ns = 0;
      if (iv->end != nullptr) {
        const CUresult r = drv_.event_query(iv->end);
        if (r == CUDA_ERROR_NOT_READY) break;
        if (is_sticky(r)) {
          note_fault(r);
          return;  // what was collected so far did complete; the rest is the recovery's
        }
        if (r == CUDA_SUCCESS) {
          float ms = 0;
          if (iv->start != nullptr &&
              drv_.event_elapsed_time(&ms, iv->start, iv->end) == CUDA_SUCCESS)
            device_ns = std::llround(static_cast<double>(ms) * 1e6);
          for (const CopyOut& c : iv->copy_out) std::memcpy(c.host, c.pinned, c.length);
        } else if (status == 0) {
          status = to_errno(r);
        }
      }
      release_interval(*iv);
      out.push_back(Delivery{s, iv->token, status, device_ns});
    }
  }
}

void CudaDevice::deliver(std::vector<Delivery>& out) {
  if (out.empty()) return;
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now() - epoch_)
                               .count();
  {
    std::lock_guard lock(busy_mu_);
    for (const Delivery& d : out) busy_.add(now, d.device_ns);
  }
  CompletionSink* sink = sink_.load(std::memory_order_acquire);
  for (const Delivery& d : out) {
    if (sink == nullptr) continue;
    try {
      sink->on_complete(d.stream->id, d.token, d.status, d.device_ns);
    } catch (const std::exception& e) {
      spdlog::error("cuda gpu{} stream {}: completion handler threw: {}", info_.index, d.stream->id,
                    e.what());
    } catch (...) {
      spdlog::error("cuda gpu{} stream {}: completion handler threw", info_.index, d.stream->id);
    }
  }
  // Removed only now, so destroy_stream returns after its completions went out.
  {
    std::lock_guard lock(pending_mu_);
    for (const Delivery& d : out) {
      d.stream->pending.pop_front();
      pending_total_.fetch_sub(1);
    }
  }
  pending_cv_.notify_all();
  out.clear();
}

void CudaDevice::retire_modules() {
  std::shared_lock ctx(ctx_mu_);
  set_current();
  std::lock_guard lock(modules_mu_);
  for (auto it = retired_.begin(); it != retired_.end();) {
    bool done = true;
    for (CUevent e : it->fences) {
      const CUresult r = drv_.event_query(e);
      if (r == CUDA_ERROR_NOT_READY) {
        done = false;
        break;
      }
      if (is_sticky(r)) {
        note_fault(r);
        return;
      }
    }
    if (!done) {
      ++it;
      continue;
    }
    drv_.module_unload(it->handle);
    for (CUevent e : it->fences) release_event(e);
    it = retired_.erase(it);
  }
  retired_count_.store(retired_.size());
}

void CudaDevice::flush_after_fault(bool rebuild) {
  const auto cause = static_cast<CUresult>(fault_.load());
  const bool kernel = is_kernel_fault(cause);
  const std::string cause_text = drv_.describe(cause);
  // Without in-process recovery the device goes out of service here and the
  // process that owns it (the executor) exits; it hears of the fault before the
  // errored completions go out, so salusd knows why they failed.
  const bool hand_over = rebuild && !opts_.recover_in_process;
  if (hand_over) rebuild = false;
  {
    std::lock_guard lock(text_mu_);
    last_fault_ = cause_text;
    if (hand_over)
      dead_why_ =
          fmt::format("the GPU context was lost to {}; this process cannot recover it", cause_text);
  }
  std::vector<Delivery> out;
  {
    // Waits for API calls in flight; on a faulted context they fail fast.
    std::unique_lock ctx(ctx_mu_);
    fail_pending(kernel, out);
    forget_context();
    if (hand_over) dead_.store(true);

    if (rebuild) rebuild_context(cause, cause_text);
    fault_.store(CUDA_SUCCESS);
  }
  auto report = [&](bool delivered) {
    if (!hand_over || !opts_.on_sticky_fault) return;
    try {
      opts_.on_sticky_fault(cause_text, kernel, delivered);
    } catch (const std::exception& e) {
      spdlog::error("cuda gpu{}: sticky-fault handler threw: {}", info_.index, e.what());
    } catch (...) {
      spdlog::error("cuda gpu{}: sticky-fault handler threw", info_.index);
    }
  };
  report(false);
  deliver(out);
  report(true);
}

// Every pending interval completes with the fault's status (EFAULT for the
// likely culprits); the stream's handles died with the context. Needs ctx_mu_.
void CudaDevice::fail_pending(bool kernel, std::vector<Delivery>& out) {
  for (const auto& s : all_streams()) {
    std::lock_guard lock(pending_mu_);
    for (Interval& iv : s->pending) {
      // EFAULT for the likely culprits; an earlier op error (EINVAL, ...) is
      // kept for the others, whose work is lost either way.
      int status = fault_status(kernel, iv.user_launch);
      if (status != EFAULT && iv.status != 0) status = iv.status;
      out.push_back(Delivery{s, iv.token, status, 0});
      // Events and staging die with the context: forget, do not free.
      iv.start = iv.end = nullptr;
      iv.blocks.clear();
      iv.copy_out.clear();
    }
    // Ops queued since the last notify are lost too; the next notify says so.
    Interval& open = s->open;
    if (open.ops > 0) {
      int status = fault_status(kernel, open.user_launch);
      if (status != EFAULT && open.status != 0) status = open.status;
      open.status = status;
    }
    open.start = open.end = nullptr;
    open.blocks.clear();
    open.copy_out.clear();
    open.user_launch = false;
    s->handle = nullptr;
    s->wake = nullptr;
    s->scratch = 0;
    s->discards_seen = 0;
  }
}

// Forgets (never frees) what lived in the lost context: pooled events and
// staging, module and function handles, the built-in kernels. Needs ctx_mu_.
void CudaDevice::forget_context() {
  {
    std::lock_guard lock(pool_mu_);
    free_events_.clear();
    free_blocks_.clear();
    cached_bytes_ = 0;
  }
  {
    std::lock_guard lock(modules_mu_);
    for (auto& [id, m] : modules_) {
      m.handle = nullptr;
      for (Function& f : m.functions) f.handle = nullptr;
    }
    retired_.clear();
    retired_count_.store(0);
  }
  builtin_module_ = nullptr;
  spin_fn_ = gemm_fn_ = nullptr;
  maint_ = nullptr;
  discard_event_ = nullptr;
  arena_base_.store(0);
  if (vmm_) {
    std::lock_guard lock(maint_mu_);
    backed_before_loss_ = vmm_->forget();
  }
}

// A fresh primary context with the same streams and modules, or the GPU out of
// service when that fails. Needs ctx_mu_.
void CudaDevice::rebuild_context(CUresult cause, const std::string& cause_text) {
  // cuDevicePrimaryCtxReset destroys every allocation, stream, event and
  // module of the context; releasing and retaining again gives a fresh one.
  set_current();
  const CUresult reset = drv_.primary_ctx_reset(device_);
  drv_.primary_ctx_release(device_);
  ctx_ = nullptr;
  std::string why;
  if (reset != CUDA_SUCCESS)
    why = fmt::format("cuDevicePrimaryCtxReset: {}", drv_.error_name(reset));
  if (why.empty()) open_context(false, why);
  if (why.empty()) {
    for (const auto& s : all_streams()) {
      std::lock_guard lock(s->mu);
      if (const CUresult r = drv_.stream_create(&s->handle, CU_STREAM_NON_BLOCKING);
          r != CUDA_SUCCESS) {
        s->handle = nullptr;
        why = fmt::format("cuStreamCreate: {}", drv_.error_name(r));
        break;
      }
      s->wake = create_wake_stream();
    }
  }
  if (why.empty()) {
    std::lock_guard lock(modules_mu_);
    for (auto& [id, m] : modules_) {
      // Same image, same names: the broker's handles keep working.
      if (drv_.module_load_data_ex(&m.handle, m.image.data(), 0, nullptr, nullptr) !=
          CUDA_SUCCESS) {
        m.handle = nullptr;
        spdlog::error("cuda gpu{}: module {} did not reload after the fault", info_.index, id);
        continue;
      }
      for (Function& f : m.functions)
        if (drv_.module_get_function(&f.handle, m.handle, f.name.c_str()) != CUDA_SUCCESS)
          f.handle = nullptr;
    }
  }
  if (!why.empty()) {
    spdlog::critical("cuda gpu{}: recovery failed ({}); the GPU is out of service", info_.index,
                     why);
    {
      std::lock_guard lock(text_mu_);
      dead_why_ = fmt::format("the GPU is unusable after a failed fault recovery ({})", why);
    }
    dead_.store(true);
    if (ctx_ != nullptr) {
      drv_.primary_ctx_reset(device_);
      drv_.primary_ctx_release(device_);
      ctx_ = nullptr;
    }
    for (const auto& s : all_streams()) {
      std::lock_guard lock(s->mu);
      s->handle = nullptr;
      s->wake = nullptr;
    }
  } else {
    spdlog::warn("cuda gpu{}: context rebuilt after {}; device memory was cleared", info_.index,
                 drv_.error_name(cause));
  }
  {
    std::lock_guard lock(text_mu_);
    last_restart_ = cause_text;
  }
  generation_.fetch_add(1);
}

std::string CudaDevice::dead_reason() const {
  std::lock_guard lock(text_mu_);
  return dead_why_.empty() ? std::string("the GPU is out of service") : dead_why_;
}

DeviceHealth CudaDevice::health() const {
  DeviceHealth h;
  h.restarts = generation_.load();
  h.usable = !dead_.load();
  std::lock_guard lock(text_mu_);
  h.last_restart = last_restart_;
  h.last_fault = last_fault_;
  if (!h.usable) h.unusable_why = dead_why_;
  return h;
}

// ---------------------------------------------------------------- factory

}  // namespace salus::vgpu::cuda

namespace salus::vgpu {

std::vector<std::unique_ptr<Device>> open_cuda_devices(const CudaOptions& options,
                                                       std::string& why) {
  std::vector<std::unique_ptr<Device>> out;
  if (!(options.memory_fraction > 0.0 && options.memory_fraction <= 1.0)) {
    why = fmt::format("memory fraction {} is not in (0, 1]", options.memory_fraction);
    return out;
  }
  const cuda::CudaDriver* drv = cuda::CudaDriver::get(why);
  if (drv == nullptr) return out;
  int count = 0;
  if (const CUresult r = drv->device_get_count(&count); r != CUDA_SUCCESS) {
    why = fmt::format("cuDeviceGetCount failed: {}", drv->error_name(r));
    return out;
  }
  if (count == 0) {
    why = "no CUDA GPU visible (check CUDA_VISIBLE_DEVICES)";
    return out;
  }
  std::vector<std::string> failures;
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    if (const CUresult r = drv->device_get(&dev, i); r != CUDA_SUCCESS) {
      failures.push_back(fmt::format("gpu{}: cuDeviceGet: {}", i, drv->error_name(r)));
      continue;
    }
    try {
      out.push_back(
          std::make_unique<cuda::CudaDevice>(*drv, static_cast<int>(out.size()), dev, options));
    } catch (const std::exception& e) {
      failures.push_back(e.what());
      spdlog::warn("cuda: CUDA device {} not used: {}", i, e.what());
    }
  }
  if (out.empty()) {
    why.clear();
    for (const std::string& f : failures) why += (why.empty() ? "" : "; ") + f;
  }
  return out;
}

int cuda_device_count(std::string& why) {
  const cuda::CudaDriver* drv = cuda::CudaDriver::get(why);
  if (drv == nullptr) return -1;
  int count = 0;
  if (const CUresult r = drv->device_get_count(&count); r != CUDA_SUCCESS) {
    why = fmt::format("cuDeviceGetCount failed: {}", drv->error_name(r));
    return -1;
  }
  if (count == 0) why = "no CUDA GPU visible (check CUDA_VISIBLE_DEVICES)";
  return count;
}

std::unique_ptr<Device> open_cuda_device(const CudaOptions& options, int ordinal, int index,
                                         std::string& why) {
  if (!(options.memory_fraction > 0.0 && options.memory_fraction <= 1.0)) {
    why = fmt::format("memory fraction {} is not in (0, 1]", options.memory_fraction);
    return nullptr;
  }
  const cuda::CudaDriver* drv = cuda::CudaDriver::get(why);
  if (drv == nullptr) return nullptr;
  CUdevice dev = 0;
  if (const CUresult r = drv->device_get(&dev, ordinal); r != CUDA_SUCCESS) {
    why = fmt::format("gpu{}: cuDeviceGet: {}", ordinal, drv->error_name(r));
    return nullptr;
  }
  try {
    return std::make_unique<cuda::CudaDevice>(*drv, index, dev, options);
  } catch (const std::exception& e) {
    why = e.what();
    return nullptr;
  }
}

bool cuda_builtins_built(std::string& why) {
  if (cuda::builtin_fatbin_size != 0) return true;
  why = cuda::kNoBuiltinsReason;
  return false;
}

}  // namespace salus::vgpu
