#include "vgpu/executor/executor_main.hpp"

#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "vgpu/cuda/cuda_backend.hpp"
#include "vgpu/executor/executor_protocol.hpp"
#include "vgpu/sim/sim_device.hpp"
#include "vgpu/unique_fd.hpp"

namespace salus::vgpu::executor {

// ---------------------------------------------------------------- flags

std::vector<std::string> ExecutorOptions::to_args() const {
  return {"--executor-gpu",
          std::to_string(gpu),
          "--backend",
          backend,
          "--sim-memory",
          std::to_string(sim_memory),
          "--cuda-memory-fraction",
          fmt::format("{}", cuda_memory_fraction),
          "--cuda-arena",
          cuda_back_on_demand ? "on-demand" : "up-front",
          "--executor-arena-size",
          std::to_string(arena_bytes),
          "--log-level",
          log_level,
          "--executor-fd",
          std::to_string(socket_fd),
          "--executor-staging-fd",
          std::to_string(staging_fd),
          "--executor-staging-size",
          std::to_string(staging_size)};
}

bool is_executor_invocation(int argc, char** argv) {
  return argc > 1 && std::strcmp(argv[1], "--executor-gpu") == 0;
}

bool parse_executor_args(int argc, char** argv, ExecutorOptions& out, std::string& why) {
  auto number = [&](const std::string& flag, const char* text, auto& into) {
    try {
      std::size_t used = 0;
      const long long v = std::stoll(text, &used);
      if (used != std::strlen(text) || v < 0) throw std::invalid_argument(text);
      into = static_cast<std::remove_reference_t<decltype(into)>>(v);
      return true;
    } catch (const std::exception&) {
      why = fmt::format("{} {}: not a number", flag, text);
      return false;
    }
  };
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      why = flag + ": missing value";
      return false;
    }
    const char* v = argv[i + 1];
    bool ok = true;
    if (flag == "--executor-gpu") {
      ok = number(flag, v, out.gpu);
    } else if (flag == "--backend") {
      out.backend = v;
      if (out.backend != "sim" && out.backend != "cuda") {
        why = fmt::format("--backend {}: expected cuda or sim", v);
        return false;
      }
    } else if (flag == "--sim-memory") {
      ok = number(flag, v, out.sim_memory);
    } else if (flag == "--cuda-memory-fraction") {
      try {
        out.cuda_memory_fraction = std::stod(v);
      } catch (const std::exception&) {
        why = fmt::format("{} {}: not a number", flag, v);
        return false;
      }
    } else if (flag == "--cuda-arena") {
      const std::string_view mode = v;
      if (mode != "on-demand" && mode != "up-front") {
        why = fmt::format("{} {}: expected on-demand or up-front", flag, mode);
        return false;
      }
      out.cuda_back_on_demand = mode == "on-demand";
    } else if (flag == "--executor-arena-size") {
      ok = number(flag, v, out.arena_bytes);
    } else if (flag == "--log-level") {
      out.log_level = v;
    } else if (flag == "--executor-fd") {
      ok = number(flag, v, out.socket_fd);
    } else if (flag == "--executor-staging-fd") {
      ok = number(flag, v, out.staging_fd);
    } else if (flag == "--executor-staging-size") {
      ok = number(flag, v, out.staging_size);
    } else {
      why = "unknown executor flag " + flag;
      return false;
    }
    if (!ok) return false;
  }
  if (out.staging_size == 0) {
    why = "--executor-staging-size is required";
    return false;
  }
  return true;
}

namespace {

using Clock = std::chrono::steady_clock;

// Everything the executor sends to salusd goes through here. Sends never block
// the caller: if salusd's end is full, the datagram waits in a queue that a
// sender thread drains. So the request loop always keeps reading, and salusd
// (which sends while holding its device lock) can never wait on an executor that
// waits on salusd.
class Outbox {
 public:
  explicit Outbox(int fd) : fd_(fd), thread_([this] { run(); }) {}
  ~Outbox() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void post(const char* data, std::size_t size) {
    std::lock_guard lk(mu_);
    if (dead_) return;
    if (queue_.empty()) {
      for (;;) {
        if (::send(fd_, data, size, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        dead_ = true;  // salusd is gone; the request loop sees EOF and exits
        return;
      }
    }
    queue_.emplace_back(data, data + size);
    cv_.notify_all();
  }
  // Waits until everything posted has been sent (or `limit` passed).
  void drain(std::chrono::milliseconds limit) {
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, limit, [&] { return queue_.empty() || dead_; });
  }

 private:
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || (!queue_.empty() && !dead_); });
      if (stop_) return;
      lk.unlock();
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, 100);
      lk.lock();
      while (!queue_.empty() && !dead_) {
        const std::vector<char>& d = queue_.front();
        if (::send(fd_, d.data(), d.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
          dead_ = true;
          break;
        }
        queue_.pop_front();
      }
      cv_.notify_all();
    }
  }

  const int fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<char>> queue_;
  bool dead_ = false;
  bool stop_ = false;
  std::thread thread_;
};

class Executor final : public CompletionSink {
 public:
  Executor(const ExecutorOptions& o, Outbox& out, char* staging)
      : opts_(o), out_(out), staging_(staging) {}
  ~Executor() { stop_backing(); }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void set_device(std::unique_ptr<Device> d) {
    dev_ = std::move(d);
    raw_ = dev_.get();
    dev_->set_sink(this);
    // The shared staging area as a region of the device: host copies then go
    // straight between it and the GPU (DMA on cuda), with no copy in between.
    std::string why;
    if (const int err =
            dev_->map_region(opts_.staging_fd, opts_.staging_size, true, staging_region_, why)) {
      spdlog::warn("host copies go through the device's own buffers: {}", why);
      staging_region_ = 0;
    }
  }
  Device* device() { return dev_.get(); }
  // Drains every stream (their completions go out) and closes the device.
  void close_device() {
    stop_backing();  // a set_backing under way ends first
    dev_.reset();    // raw_ stays: completions during the drain read it
  }

  // Called on the device's threads.
  void on_complete(StreamId stream, std::uint64_t ticket, int status,
                   std::int64_t device_ns) override {
    (void)stream;
    if (has_overrides_.load(std::memory_order_acquire)) {
      std::lock_guard lk(override_mu_);
      if (auto it = overrides_.find(ticket); it != overrides_.end()) {
        if (status == 0) status = it->second;
        overrides_.erase(it);
        has_overrides_.store(!overrides_.empty(), std::memory_order_release);
      }
    }
    complete(ticket, status, device_ns);
  }

  void complete(std::uint64_t ticket, int status, std::int64_t device_ns) {
    char buf[record_size(sizeof(CompleteMsg))];
    const std::int64_t busy = raw_ != nullptr ? raw_->busy_ns() : 0;
    const std::size_t n =
        encode_one(buf, Msg::complete, CompleteMsg{ticket, status, device_ns, busy});
    out_.post(buf, n);
  }

  // Serves one datagram of requests; `fd` is a descriptor that came with it
  // (or -1). Returns false once salusd asked for shutdown.
  bool serve(const char* data, std::size_t size, int fd) {
    RecordReader rd(data, size);
    Msg type;
    const char* body;
    std::size_t body_size;
    const UniqueFd owned(fd);
    bool go_on = true;
    while (rd.next(type, body, body_size)) {
      try {
        go_on = handle(type, body, body_size, owned.get()) && go_on;
      } catch (const std::exception& e) {
        spdlog::error("request {}: {}", static_cast<int>(type), e.what());
      }
    }
    if (rd.error()) spdlog::error("malformed request datagram ({} bytes)", size);
    return go_on;
  }

  void send_busy_if_changed() {
    const std::int64_t b = dev_->busy_ns();
    if (b == last_busy_) return;
    last_busy_ = b;
    char buf[record_size(sizeof(BusyMsg))];
    out_.post(buf, encode_one(buf, Msg::busy, BusyMsg{b}));
  }

 private:
  // The device's stream for salusd's id, or nullopt.
  std::optional<StreamId> stream(StreamId id) const {
    if (id < streams_.size() && streams_[id]) return streams_[id];
    return std::nullopt;
  }
  void note_error(StreamId id, int err) {
    if (id >= errors_.size()) errors_.resize(id + 1, 0);
    if (errors_[id] == 0) errors_[id] = err;
  }
  bool staged(std::uint64_t slot, Bytes length) const {
    return slot <= opts_.staging_size && length <= opts_.staging_size - slot;
  }

  template <class T>
  bool decode(const char* body, std::size_t size, T& m) {
    if (read_fixed(body, size, m)) return true;
    spdlog::error("short request record ({} bytes)", size);
    return false;
  }

  void reply(std::uint64_t request, int status, const std::string& why,
             const std::vector<std::uint32_t>& sizes = {}) {
    RecordWriter w;
    const std::string text = why.size() > 4096 ? why.substr(0, 4096) : why;
    w.put(Msg::reply,
          ReplyMsg{request, status, static_cast<std::uint32_t>(text.size()),
                   static_cast<std::uint32_t>(sizes.size())},
          {{text.data(), text.size()}, {sizes.data(), sizes.size() * 4}});
    out_.post(w.data(), w.size());
  }

  // One request: decode it and hand it to its handler (`on`, one per message).
  // `fd` is the descriptor that came with the datagram, or -1; serve() closes it.
  // Returns false for shutdown.
  bool handle(Msg type, const char* body, std::size_t size, int fd) {
    switch (type) {
      case Msg::create_stream:
        return dispatch<CreateStreamMsg>(body, size);
      case Msg::destroy_stream:
        return dispatch<DestroyStreamMsg>(body, size);
      case Msg::fill:
        return dispatch<FillMsg>(body, size);
      case Msg::copy:
        return dispatch<CopyMsg>(body, size);
      case Msg::spin:
        return dispatch<SpinMsg>(body, size);
      case Msg::gemm:
        return dispatch<GemmMsg>(body, size);
      case Msg::copy_to_host:
        return dispatch<ToHostMsg>(body, size);
      case Msg::copy_from_host:
        return dispatch<FromHostMsg>(body, size);
      case Msg::map_region:
        return dispatch<MapRegionMsg>(body, size, fd);
      case Msg::unmap_region:
        return dispatch<UnmapRegionMsg>(body, size);
      case Msg::copy_from_region:
        return dispatch<RegionCopyMsg>(body, size, true);
      case Msg::copy_to_region:
        return dispatch<RegionCopyMsg>(body, size, false);
      case Msg::lane_make:
        return dispatch<LaneMakeMsg>(body, size);
      case Msg::lane_clear:
        return dispatch<LaneClearMsg>(body, size);
      case Msg::lane_drop:
        return dispatch<LaneDropMsg>(body, size);
      case Msg::notify:
        return dispatch<NotifyMsg>(body, size);
      case Msg::discard:
        return dispatch<DiscardMsg>(body, size);
      case Msg::load_module:
        return dispatch<LoadModuleMsg>(body, size, fd);
      case Msg::unload_module:
        return dispatch<UnloadModuleMsg>(body, size);
      case Msg::get_function:
        return dispatch<GetFunctionMsg>(body, size, body, size);
      case Msg::set_backing:
        return dispatch<SetBackingMsg>(body, size, body, size);
      case Msg::launch:
        return dispatch<LaunchMsg>(body, size, body, size);
      case Msg::shutdown:
        return false;
      default:
        spdlog::error("unknown request type {}", static_cast<int>(type));
        return true;
    }
  }

  // Decodes the fixed part of a request of type M and calls its handler with
  // `extra`; a short record is logged and skipped.
  template <class M, class... Extra>
  bool dispatch(const char* body, std::size_t size, Extra... extra) {
    M m;
    if (decode(body, size, m)) on(m, extra...);
    return true;
  }

  void on(const CreateStreamMsg& m) {
    if (stream(m.stream)) return;  // a restore and a create raced: one is enough
    if (m.stream >= streams_.size()) streams_.resize(m.stream + 1);
    try {
      streams_[m.stream] = dev_->create_stream();
    } catch (const std::exception& e) {
      spdlog::error("stream {}: cannot create: {}", m.stream, e.what());
    }
  }

  void on(const DestroyStreamMsg& m) {
    if (auto s = stream(m.stream)) {
      try {
        dev_->destroy_stream(*s);  // drains: its completions go out before the reply
      } catch (const std::exception& e) {
        spdlog::error("stream {}: cannot destroy: {}", m.stream, e.what());
      }
      streams_[m.stream].reset();
    }
    if (m.stream < errors_.size()) errors_[m.stream] = 0;
    reply(m.request, 0, {});
  }

  void on(const FillMsg& m) {
    if (auto s = stream(m.stream)) dev_->fill(*s, m.dst, m.length, m.pattern, m.width);
  }
  void on(const CopyMsg& m) {
    if (auto s = stream(m.stream)) dev_->copy(*s, m.dst, m.src, m.length);
  }
  void on(const SpinMsg& m) {
    if (auto s = stream(m.stream)) dev_->spin(*s, m.usec, m.util);
  }
  void on(const GemmMsg& m) {
    if (auto s = stream(m.stream)) dev_->gemm(*s, m.m, m.n, m.k, m.a, m.b, m.c);
  }

  void on(const ToHostMsg& m) {
    if (!staged(m.slot, m.length)) return note_error(m.stream, EINVAL);
    auto s = stream(m.stream);
    if (!s) return;
    if (staging_region_ != 0)
      dev_->copy_to_region(*s, staging_region_, m.slot, m.src, m.length);
    else
      dev_->copy_to_host(*s, staging_ + m.slot, m.src, m.length);
  }

  void on(const FromHostMsg& m) {
    if (!staged(m.slot, m.length)) return note_error(m.stream, EINVAL);
    auto s = stream(m.stream);
    if (!s) return;
    if (staging_region_ != 0)
      dev_->copy_from_region(*s, m.dst, staging_region_, m.slot, m.length);
    else
      dev_->copy_from_host(*s, m.dst, staging_ + m.slot, m.length);
  }

  void on(const MapRegionMsg& m, int fd) {
    std::string why;
    int status = 0;
    RegionId inner = 0;
    if (fd < 0) {
      status = EINVAL;
      why = "the region's file did not arrive";
    } else {
      status = dev_->map_region(fd, m.size, m.writable != 0, inner, why);
    }
    if (status == 0) {
      if (auto old = regions_.find(m.region); old != regions_.end())
        dev_->unmap_region(old->second.inner);
      regions_[m.region] = MappedRegion{inner, m.size, m.writable != 0};
    }
    reply(m.request, status, why);
  }

  void on(const UnmapRegionMsg& m) {
    if (auto it = regions_.find(m.region); it != regions_.end()) {
      dev_->unmap_region(it->second.inner);
      regions_.erase(it);
    }
  }

  // copy_from_region (`in`) and copy_to_region share one record.
  void on(const RegionCopyMsg& m, bool in) {
    const auto it = regions_.find(m.region);
    if (it == regions_.end() || m.offset > it->second.size ||
        m.length > it->second.size - m.offset || (!in && !it->second.writable))
      return note_error(m.stream, EINVAL);
    auto s = stream(m.stream);
    if (!s) return;
    if (in)
      dev_->copy_from_region(*s, m.device, it->second.inner, m.offset, m.length);
    else
      dev_->copy_to_region(*s, it->second.inner, m.offset, m.device, m.length);
  }

  void on(const NotifyMsg& m) {
    auto s = stream(m.stream);
    // Never created (or its creation failed): nothing of it is queued.
    if (!s) return complete(m.ticket, EIO, 0);
    if (m.stream < errors_.size() && errors_[m.stream] != 0) {
      std::lock_guard lk(override_mu_);
      overrides_[m.ticket] = errors_[m.stream];
      has_overrides_.store(true, std::memory_order_release);
      errors_[m.stream] = 0;
    }
    dev_->notify(*s, m.ticket);
  }

  void on(const DiscardMsg& m) { dev_->discard(m.offset, m.length); }

  void on(const LoadModuleMsg& m, int fd) {
    std::vector<std::uint8_t> image;
    std::string why;
    int status = 0;
    if (fd < 0) {
      status = EINVAL;
      why = "the module image did not arrive";
    } else if (!read_image(fd, m.size, image)) {
      status = EIO;
      why = "reading the module image failed";
    }
    ModuleHandle h = 0;
    if (status == 0) status = dev_->load_module(image, h, why);
    if (status == 0) modules_[m.module] = h;
    reply(m.request, status, why);
  }

  static bool read_image(int fd, std::size_t size, std::vector<std::uint8_t>& image) {
    image.resize(size);
    std::size_t done = 0;
    while (done < image.size()) {
      const ssize_t n =
          ::pread(fd, image.data() + done, image.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    return done == image.size();
  }

  void on(const UnloadModuleMsg& m) {
    if (auto it = modules_.find(m.module); it != modules_.end()) {
      dev_->unload_module(it->second);
      modules_.erase(it);
    }
    for (auto it = functions_.begin(); it != functions_.end();) {
      if (static_cast<ModuleHandle>(it->first >> 32) == m.module)
        it = functions_.erase(it);
      else
        ++it;
    }
  }

  // Shared-lane memory: kept here by its fd until salusd drops it.
  void on(const LaneMakeMsg& m) {
    UniqueFd fd;
    std::string why;
    const int status = dev_->make_lane_memory(m.size, fd, why);
    std::vector<std::uint32_t> params;
    if (status == 0) {
      params.push_back(static_cast<std::uint32_t>(fd.get()));
      lanes_[fd.get()] = std::move(fd);
    }
    reply(m.request, status, why, params);
  }
  void on(const LaneClearMsg& m) {
    std::string why = "no such lane memory in this executor";
    const int status = lanes_.count(m.fd) ? dev_->clear_lane_memory(m.fd, m.size, why) : EINVAL;
    reply(m.request, status, status == 0 ? std::string() : why);
  }
  void on(const LaneDropMsg& m) {
    const auto it = lanes_.find(m.fd);
    if (it == lanes_.end()) return;
    dev_->drop_lane_memory(m.fd);
    lanes_.erase(it);
  }

  // The held ranges follow the fixed part of the record. Run on a thread of its
  // own: mapping gigabytes takes the driver long, and the work of the GPU's
  // other sessions keeps arriving meanwhile (salusd sends one set_backing at a
  // time and waits for its reply before anything uses the new memory).
  void on(const SetBackingMsg& m, const char* body, std::size_t size) {
    if (m.count > kMaxBackingRanges || size < sizeof m + m.count * sizeof(arena::ByteRange))
      return reply(m.request, EINVAL, "a set_backing record shorter than its ranges");
    std::vector<arena::ByteRange> held(m.count);
    std::memcpy(held.data(), body + sizeof m, m.count * sizeof(arena::ByteRange));
    {
      std::lock_guard lk(backing_mu_);
      backing_jobs_.emplace_back(m.request, std::move(held));
      if (!backing_thread_.joinable()) backing_thread_ = std::thread([this] { backing_loop(); });
    }
    backing_cv_.notify_one();
  }
  void backing_loop() {
    for (;;) {
      std::pair<std::uint64_t, std::vector<arena::ByteRange>> job;
      {
        std::unique_lock lk(backing_mu_);
        backing_cv_.wait(lk, [&] { return !backing_jobs_.empty() || backing_stop_; });
        if (backing_jobs_.empty()) return;  // stopping, and nothing left to answer
        job = std::move(backing_jobs_.front());
        backing_jobs_.pop_front();
      }
      std::string why;
      int status = 0;
      try {
        status = dev_->set_backing(job.second, why);
      } catch (const std::exception& e) {
        status = EIO;
        why = e.what();
      }
      reply(job.first, status, status == 0 ? std::string() : why,
            {static_cast<std::uint32_t>(dev_->backed_bytes() >> 20)});
    }
  }
  void stop_backing() {
    {
      std::lock_guard lk(backing_mu_);
      backing_stop_ = true;
    }
    backing_cv_.notify_one();
    if (backing_thread_.joinable()) backing_thread_.join();
  }

  // The function's name follows the fixed part of the record.
  void on(const GetFunctionMsg& m, const char* body, std::size_t size) {
    if (size < sizeof m + m.name_length) return;
    const std::string name(body + sizeof m, m.name_length);
    std::string why;
    std::vector<std::uint32_t> sizes;
    int status = ENOENT;
    if (auto it = modules_.find(m.module); it == modules_.end()) {
      why = fmt::format("no module {}", m.module);
    } else {
      FunctionHandle f = 0;
      status = dev_->get_function(it->second, name, f, sizes, why);
      if (status == 0) functions_[m.function] = f;
    }
    reply(m.request, status, why, sizes);
  }

  // The argument sizes, then the argument bytes, follow the fixed part.
  void on(const LaunchMsg& m, const char* body, std::size_t size) {
    const std::size_t need = sizeof m + std::size_t{m.arg_count} * 4 + m.arg_bytes;
    if (need > size) return note_error(m.stream, EINVAL);
    std::vector<std::uint32_t>& sizes = arg_sizes_;
    sizes.resize(m.arg_count);
    if (m.arg_count != 0) std::memcpy(sizes.data(), body + sizeof m, sizes.size() * 4);
    std::size_t sum = 0;
    for (std::uint32_t v : sizes) sum += v;
    if (sum != m.arg_bytes) return note_error(m.stream, EINVAL);
    const auto* args = reinterpret_cast<const std::uint8_t*>(body + sizeof m + sizes.size() * 4);
    // An unknown handle (a module that did not reload) is the device's to
    // refuse: EINVAL at the next notify, with its log line.
    auto f = functions_.find(m.function);
    const FunctionHandle h = f == functions_.end() ? ~FunctionHandle{0} : f->second;
    if (auto s = stream(m.stream)) dev_->launch(*s, h, m.dims, args, sizes.data(), sizes.size());
  }

  const ExecutorOptions& opts_;
  Outbox& out_;
  char* staging_;
  std::unique_ptr<Device> dev_;
  Device* raw_ = nullptr;  // set once, before the first completion can arrive
  std::vector<std::optional<StreamId>> streams_;  // salusd's id -> the device's
  std::vector<int> errors_;                       // salusd's id -> error for its next notify
  std::unordered_map<ModuleHandle, ModuleHandle> modules_;
  std::unordered_map<int, UniqueFd> lanes_;  // shared-lane memory, by its fd
  std::unordered_map<FunctionHandle, FunctionHandle> functions_;
  std::vector<std::uint32_t> arg_sizes_;
  struct MappedRegion {
    RegionId inner;  // the device's id
    Bytes size;
    bool writable;
  };
  std::unordered_map<RegionId, MappedRegion> regions_;  // by salusd's id
  RegionId staging_region_ = 0;                         // the shared staging area
  std::int64_t last_busy_ = -1;
  std::mutex override_mu_;
  std::unordered_map<std::uint64_t, int> overrides_;  // ticket -> status
  std::atomic<bool> has_overrides_{false};
  // set_backing requests, answered in order by backing_thread_.
  std::mutex backing_mu_;
  std::condition_variable backing_cv_;
  std::deque<std::pair<std::uint64_t, std::vector<arena::ByteRange>>> backing_jobs_;
  bool backing_stop_ = false;
  std::thread backing_thread_;  // started by the first set_backing
};

void send_hello(Outbox& out, const Device* d, int status, const std::string& why) {
  HelloMsg h{};
  h.version = kProtocolVersion;
  h.status = status;
  h.pid = ::getpid();
  if (d != nullptr) {
    const DeviceInfo& i = d->info();
    h.arena_base = d->device_address(0);
    h.total_memory = i.total_memory;
    h.arena_size = i.arena_size;
    h.sm_count = i.sm_count;
    h.backs_on_demand = i.backs_on_demand ? 1 : 0;
    h.spin_cycles_per_usec = i.spin_cycles_per_usec;
    put_text(h.name, i.name);
    put_text(h.uuid, i.uuid);
    put_text(h.backend, i.backend);
    put_text(h.driver_version, i.driver_version);
  }
  put_text(h.why, why);
  RecordWriter w;
  w.put(Msg::hello, h);
  out.post(w.data(), w.size());
}

// The process settings an executor runs under, before anything else.
void harden_process(const ExecutorOptions& o) {
  // spawn_executor set it before exec (it survives exec); set it again in case
  // this binary was started some other way.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // Ctrl-C in a terminal signals the whole foreground process group: salusd
  // then drains and stops its executors in order; one dying first would look
  // like a lost GPU context to every session on it.
  ::signal(SIGINT, SIG_IGN);
  // A user kernel that crashes this process is expected (on sim a kernel is
  // host code), not a salusd bug: no core file, which for a process mapping a
  // whole GPU's memory could be huge.
  rlimit no_core{};
  if (::getrlimit(RLIMIT_CORE, &no_core) == 0) {
    no_core.rlim_cur = 0;
    ::setrlimit(RLIMIT_CORE, &no_core);
  }
  ::prctl(PR_SET_NAME, fmt::format("salus-exec{}", o.gpu).c_str());
}

void start_logging(const ExecutorOptions& o) {
  auto logger = spdlog::stderr_color_mt("executor");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(o.log_level));
  spdlog::set_pattern(
      fmt::format("%Y-%m-%dT%H:%M:%S.%e %^%l%$ executor gpu{} pid {}: %v", o.gpu, ::getpid()));
}

// The executor's one device, or null with `why`.
std::unique_ptr<Device> open_device(const ExecutorOptions& o, Outbox& out, std::string& why) {
  if (o.backend == "sim") {
    try {
      return std::make_unique<SimDevice>(o.gpu, o.sim_memory);
    } catch (const std::exception& e) {
      why = fmt::format("sim gpu{}: cannot reserve {} bytes: {}", o.gpu, o.sim_memory, e.what());
      return nullptr;
    }
  }
  CudaOptions co;
  co.memory_fraction = o.cuda_memory_fraction;
  co.back_on_demand = o.cuda_back_on_demand;
  co.arena_bytes = o.arena_bytes;
  // A sticky error stays for the life of this process: report it, let the
  // errored completions go out, and exit; salusd starts a fresh executor.
  co.recover_in_process = false;
  co.on_sticky_fault = [&out](const std::string& cause, bool kernel, bool delivered) {
    if (!delivered) {
      spdlog::error("sticky fault {}; reporting it and exiting", cause);
      FaultMsg f{};
      f.kernel_fault = kernel ? 1 : 0;
      put_text(f.cause, cause);
      char buf[record_size(sizeof(FaultMsg))];
      out.post(buf, encode_one(buf, Msg::fault, f));
      return;
    }
    out.drain(std::chrono::seconds(2));
    ::_exit(kExitStickyFault);
  };
  return open_cuda_device(co, o.gpu, o.gpu, why);
}

// One request datagram into `buf`; `fd` gets the first descriptor that came
// with it (the others are closed), or -1. Returns the datagram's size, 0 on a
// receive timeout, or -1 once salusd is gone.
ssize_t receive(int socket, std::vector<char>& buf, int& fd) {
  iovec iov{buf.data(), buf.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  fd = -1;
  const ssize_t n = ::recvmsg(socket, &mh, MSG_CMSG_CLOEXEC);
  if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) return -1;
  if (n < 0) return 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
      if (fd < 0)
        fd = got;
      else
        UniqueFd extra(got);  // one fd per message: more is the peer's mistake
    }
  }
  return n;
}

}  // namespace

int run_executor(const ExecutorOptions& o) {
  harden_process(o);
  start_logging(o);
  void* map = ::mmap(nullptr, o.staging_size, PROT_READ | PROT_WRITE, MAP_SHARED, o.staging_fd, 0);
  if (map == MAP_FAILED) {
    spdlog::critical("mapping the staging area: {}", std::strerror(errno));
    return kExitNoDevice;
  }
  Outbox out(o.socket_fd);
  Executor ex(o, out, static_cast<char*>(map));

  std::string why;
  std::unique_ptr<Device> dev = open_device(o, out, why);
  if (!dev) {
    spdlog::error("{}", why);
    send_hello(out, nullptr, ENODEV, why);
    out.drain(std::chrono::seconds(2));
    return kExitNoDevice;
  }
  ex.set_device(std::move(dev));
  send_hello(out, ex.device(), 0, {});

  std::vector<char> buf(kMaxDatagram);
  auto last_busy = Clock::now();
  // A blocking receive that times out for the busy-time report: one syscall
  // per request datagram rather than poll + recvmsg.
  const timeval tick{0, 100'000};
  ::setsockopt(o.socket_fd, SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof tick);
  for (;;) {
    int fd = -1;
    const ssize_t n = receive(o.socket_fd, buf, fd);
    // salusd is gone: nobody is left to tell; the parent-death signal is on
    // its way anyway.
    if (n < 0) ::_exit(0);
    if (n > 0 && !ex.serve(buf.data(), static_cast<std::size_t>(n), fd)) break;
    if (Clock::now() - last_busy >= std::chrono::milliseconds(100)) {
      ex.send_busy_if_changed();
      last_busy = Clock::now();
    }
  }
  spdlog::debug("shutting down: draining the streams");
  ex.close_device();
  out.drain(std::chrono::seconds(10));
  return 0;
}

int executor_main(int argc, char** argv) {
  ExecutorOptions o;
  std::string why;
  if (!parse_executor_args(argc, argv, o, why)) {
    std::fprintf(stderr, "salusd executor: %s\n", why.c_str());
    return 2;
  }
  return run_executor(o);
}

}  // namespace salus::vgpu::executor
