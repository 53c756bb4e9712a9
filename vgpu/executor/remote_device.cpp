#include "vgpu/executor/remote_device.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "vgpu/executor/executor_process.hpp"

namespace salus::vgpu::executor {
namespace {

using Clock = std::chrono::steady_clock;

// Set by device_address and checked by the launch that follows on the same
// thread: the broker resolves buffer arguments to addresses just before it
// launches, and if the executor was lost in between, those addresses belong to
// the dead one's memory.
thread_local const void* tl_addr_device = nullptr;
thread_local std::uint64_t tl_addr_generation = 0;

constexpr StreamId kMaxStreams = 1u << 24;  // a ticket keeps the stream in its top 24 bits
constexpr std::uint32_t kMaxFunctionsPerModule = 1u << 20;
// A request id space of its own for the restore, so it can never be taken for
// the reply to a caller's request.
constexpr std::uint64_t kRestoreRequest = std::uint64_t{1} << 63;

StreamId ticket_stream(std::uint64_t ticket) {
  return static_cast<StreamId>(ticket >> 40);
}

long ms(std::chrono::steady_clock::duration d) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

UniqueFd make_image_fd(const std::vector<std::uint8_t>& image, std::string& why) {
  UniqueFd fd(::memfd_create("salus-module", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) {
    why = fmt::format("memfd_create: {}", std::strerror(errno));
    return fd;
  }
  std::size_t done = 0;
  while (done < image.size()) {
    const ssize_t n = ::write(fd.get(), image.data() + done, image.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      why = fmt::format("keeping the module image: {}", std::strerror(errno));
      return UniqueFd{};
    }
    done += static_cast<std::size_t>(n);
  }
  // Reloaded after every restart: nobody may change it meanwhile.
  ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  return fd;
}

// A close-on-exec duplicate of `fd` (-1 inside when it cannot be made).
UniqueFd dup_fd(int fd) {
  return UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
}

// Sends one datagram carrying `fd` (SCM_RIGHTS). Returns 0 or an errno.
int send_with_fd(int socket, const RecordWriter& w, int fd) {
  iovec iov{const_cast<char*>(w.data()), w.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  for (;;) {
    if (::sendmsg(socket, &mh, MSG_NOSIGNAL) >= 0) return 0;
    if (errno != EINTR) return errno;
  }
}

int send_datagram(int socket, const char* data, std::size_t size) {
  for (;;) {
    if (::send(socket, data, size, MSG_NOSIGNAL) >= 0) return 0;
    if (errno != EINTR) return errno;
  }
}

}  // namespace

// ---------------------------------------------------------------- lifetime

RemoteDevice::RemoteDevice(RemoteOptions options)
    : opts_(std::move(options)), ring_(opts_.staging_bytes) {
  // A throw below leaves nothing behind: the fds and the mapping are members.
  std::string why;
  staging_fd_.reset(create_staging(opts_.staging_bytes, why));
  if (!staging_fd_)
    throw std::runtime_error(fmt::format("gpu{}: staging area: {}", opts_.index, why));
  staging_ = Mapping::shared(staging_fd_.get(), opts_.staging_bytes);
  if (!staging_)
    throw std::runtime_error(
        fmt::format("gpu{}: mapping the staging area: {}", opts_.index, std::strerror(errno)));
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_)
    throw std::runtime_error(fmt::format("gpu{}: eventfd: {}", opts_.index, std::strerror(errno)));
  opts_.executor.socket_fd = 3;  // where spawn_executor puts them
  opts_.executor.staging_fd = 4;
  opts_.executor.staging_size = opts_.staging_bytes;
  if (!start_child(why, true)) throw std::runtime_error(why);
  io_ = std::thread([this] { io_loop(); });
}

RemoteDevice::~RemoteDevice() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    if (state_ == State::running && child_.socket) {
      // Queued work finishes (the executor drains its streams), then it exits.
      put(Msg::shutdown, ShutdownMsg{});
      flush();
    }
  }
  cv_.notify_all();
  wake();
  if (io_.joinable()) io_.join();
  // The module and region fds, the staging mapping and the fds close with the members.
}

void RemoteDevice::abort_work() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;  // no restart: the I/O thread takes its stopping path
    if (child_.pid > 0) ::kill(child_.pid, SIGKILL);
  }
  cv_.notify_all();
  wake();
}

void RemoteDevice::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
}

bool RemoteDevice::start_child(std::string& why, bool first) {
  const std::string who = fmt::format("gpu{} executor", opts_.index);
  ExecutorProcess p;
  if (spawn_executor(opts_.exe, opts_.executor.to_args(), staging_fd_.get(), p, why) != 0) {
    why = fmt::format("{}: cannot start: {}", who, why);
    return false;
  }
  Child c;
  c.pid = p.pid;
  c.socket.reset(p.socket);
  auto give_up = [&](const std::string& text) {
    ::kill(c.pid, SIGKILL);
    reap_executor(c.pid, std::chrono::milliseconds(0));
    c.socket.reset();
    why = fmt::format("{} (pid {}): {}", who, c.pid, text);
    return false;
  };

  // The hello: the device opened, or why not.
  std::vector<char> buf(kMaxDatagram);
  const auto deadline = Clock::now() + opts_.start_timeout;
  HelloMsg hello{};
  for (bool have = false; !have;) {
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero())
      return give_up(fmt::format("no hello within {} s", ms(opts_.start_timeout) / 1000));
    pollfd fds[2] = {{c.socket.get(), POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
    const int r = ::poll(fds, first ? 1 : 2, static_cast<int>(std::min<long>(ms(left) + 1, 1000)));
    if (r < 0 && errno != EINTR) return give_up(fmt::format("poll: {}", std::strerror(errno)));
    if (!first) {
      if (r > 0 && (fds[1].revents & POLLIN)) {
        // Local completions wait for the I/O loop (local_ready_ stays set);
        // only the wake-up is consumed here, or poll would spin.
        std::uint64_t v;
        [[maybe_unused]] const ssize_t got = ::read(wake_fd_.get(), &v, sizeof v);
      }
      std::lock_guard lk(mu_);
      if (stop_) return give_up("salusd is stopping");
    }
    if (r <= 0 || (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    const ssize_t n = ::recv(c.socket.get(), buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {
      const int st = reap_executor(c.pid, std::chrono::milliseconds(2000));
      c.socket.reset();
      why = fmt::format("{} (pid {}) {} before it was ready", who, c.pid, describe_wait_status(st));
      return false;
    }
    RecordReader rd(buf.data(), static_cast<std::size_t>(n));
    Msg type;
    const char* body;
    std::size_t size;
    if (!rd.next(type, body, size) || type != Msg::hello || !read_fixed(body, size, hello))
      return give_up("its first message was not a hello");
    have = true;
  }
  if (std::string text; !adopt_hello(hello, first, text)) return give_up(text);
  c.arena_base = hello.arena_base;
  if (!first && !restore(c, why)) return give_up(why);

  std::lock_guard lk(mu_);
  // Streams first (created while restarting too: the table is the truth), then
  // what was queued for this executor while it started.
  send_stream_creates(c);
  arena_base_ = c.arena_base;
  child_ = std::move(c);
  base_generation_ = generation_.load();
  child_up_ = Clock::now();
  kill_at_.reset();
  state_ = State::running;
  flush();
  cv_.notify_all();
  if (!first)
    spdlog::info("gpu {}: executor pid {} is up ({} restart{} so far)", opts_.index, child_.pid,
                 generation_.load(), generation_.load() == 1 ? "" : "s");
  else
    spdlog::debug("gpu {}: executor pid {} is up", opts_.index, child_.pid);
  return true;
}

bool RemoteDevice::adopt_hello(const HelloMsg& hello, bool first, std::string& why) {
  if (hello.version != kProtocolVersion) {
    why = fmt::format("speaks protocol {}, not {} (was salusd replaced while running?)",
                      hello.version, kProtocolVersion);
    return false;
  }
  if (hello.status != 0) {
    why = get_text(hello.why);
    return false;
  }
  if (first) {
    info_.index = opts_.index;
    info_.name = get_text(hello.name);
    info_.uuid = get_text(hello.uuid);
    info_.backend = get_text(hello.backend);
    info_.driver_version = get_text(hello.driver_version);
    info_.total_memory = hello.total_memory;
    info_.arena_size = hello.arena_size;
    info_.sm_count = hello.sm_count;
    info_.backs_on_demand = hello.backs_on_demand != 0;
    info_.spin_cycles_per_usec = hello.spin_cycles_per_usec;
    // Later executors must lay out exactly this arena: the broker's layout of
    // lanes and persistent buffers depends on its size.
    opts_.executor.arena_bytes = hello.arena_size;
  } else if (hello.arena_size != info_.arena_size) {
    why = fmt::format("its arena is {} bytes, not the {} salusd laid out", hello.arena_size,
                      info_.arena_size);
    return false;
  }
  return true;
}

void RemoteDevice::send_stream_creates(Child& c) {
  RecordWriter creates;
  auto send_creates = [&] {
    if (!creates.empty()) send_datagram(c.socket.get(), creates.data(), creates.size());
    creates.clear();
  };
  for (StreamId id = 0; id < streams_.size(); ++id) {
    if (!streams_[id]) continue;
    if (!creates.fits(sizeof(CreateStreamMsg))) send_creates();
    creates.put(Msg::create_stream, CreateStreamMsg{id});
  }
  send_creates();
}

bool RemoteDevice::restore(Child& c, std::string& why) {
  struct Snapshot {
    ModuleHandle handle;
    UniqueFd fd;  // a dup: an unload meanwhile must not close it under us
    std::uint64_t size;
    std::vector<std::string> names;
  };
  std::vector<Snapshot> modules;
  {
    std::lock_guard lk(mu_);
    for (const auto& [h, m] : modules_) {
      Snapshot s{h, dup_fd(m.memfd.get()), m.size, {}};
      for (const Function& f : m.functions) s.names.push_back(f.name);
      modules.push_back(std::move(s));
    }
  }
  bool ok = true;
  std::uint64_t request = kRestoreRequest;
  for (Snapshot& s : modules) {
    if (ok && s.fd) {
      RecordWriter w;
      const std::uint64_t req = request++;
      w.put(Msg::load_module, LoadModuleMsg{req, s.handle, s.size});
      Reply r;
      if (const int err = send_with_fd(c.socket.get(), w, s.fd.get()); err != 0) {
        why = fmt::format("sending module {}: {}", s.handle, std::strerror(err));
        ok = false;
      } else if (!await_reply(c.socket.get(), req, r, why)) {
        ok = false;
      } else if (r.status != 0) {
        // Launches of its kernels complete with EINVAL until it is loaded again.
        spdlog::error("gpu {}: module {} did not load into the new executor: {}", opts_.index,
                      s.handle, r.why);
      } else {
        for (std::uint32_t i = 0; ok && i < s.names.size(); ++i) {
          RecordWriter g;
          const std::uint64_t freq = request++;
          const std::string& name = s.names[i];
          g.put(Msg::get_function,
                GetFunctionMsg{freq, s.handle, FunctionHandle{s.handle} << 32 | i,
                               static_cast<std::uint32_t>(name.size())},
                {{name.data(), name.size()}});
          Reply fr;
          if (send_datagram(c.socket.get(), g.data(), g.size()) != 0 ||
              !await_reply(c.socket.get(), freq, fr, why)) {
            ok = false;
          } else if (fr.status != 0) {
            spdlog::error("gpu {}: kernel {} of module {} is gone in the new executor: {}",
                          opts_.index, name, s.handle, fr.why);
          }
        }
      }
    }
  }
  if (!ok) {
    why = "restoring modules: " + why;
    return false;
  }
  if (!restore_regions(c, request, why)) return false;
  restore_backing(c, request);
  return true;
}

// The new executor's arena backs what the old one did. A failure is logged and
// not fatal: the executor is up, and every session's memory was lost anyway. The
// broker sees the new backing_epoch and holds work that touches held memory
// until it has backed it again (Broker::backing_ready).
void RemoteDevice::restore_backing(Child& c, std::uint64_t& request) {
  std::vector<arena::ByteRange> held;
  {
    std::lock_guard lk(backing_mu_);
    held = backing_;
  }
  backed_bytes_.store(0);
  if (held.empty() || !info_.backs_on_demand) return;
  RecordWriter w;
  const std::uint64_t req = request++;
  w.put(Msg::set_backing, SetBackingMsg{req, static_cast<std::uint32_t>(held.size())},
        {{held.data(), held.size() * sizeof(arena::ByteRange)}});
  Reply r;
  std::string why;
  if (send_datagram(c.socket.get(), w.data(), w.size()) != 0 ||
      !await_reply(c.socket.get(), req, r, why) || r.status != 0) {
    spdlog::error("gpu {}: the new executor's arena is not backed where salusd holds memory: {}",
                  opts_.index, why.empty() ? r.why : why);
    backing_epoch_.fetch_add(1);
    return;
  }
  if (r.param_sizes.size() == 1) backed_bytes_.store(Bytes{r.param_sizes[0]} << 20);
}

bool RemoteDevice::restore_regions(Child& c, std::uint64_t& request, std::string& why) {
  struct Snapshot {
    RegionId id;
    UniqueFd fd;  // a dup: an unmap meanwhile must not close it under us
    Bytes size;
    bool writable;
  };
  std::vector<Snapshot> regions;
  {
    std::lock_guard lk(mu_);
    for (const auto& [id, r] : regions_by_id_)
      regions.push_back(Snapshot{id, dup_fd(r.fd.get()), r.size, r.writable});
  }
  bool ok = true;
  std::vector<RegionId> lost;
  for (const Snapshot& r : regions) {
    if (ok && r.fd) {
      RecordWriter w;
      const std::uint64_t req = request++;
      w.put(Msg::map_region, MapRegionMsg{req, r.id, r.writable ? 1u : 0u, r.size});
      Reply reply;
      if (const int err = send_with_fd(c.socket.get(), w, r.fd.get()); err != 0) {
        why = fmt::format("sending host region {}: {}", r.id, std::strerror(err));
        ok = false;
      } else if (!await_reply(c.socket.get(), req, reply, why)) {
        ok = false;
      } else if (reply.status != 0) {
        spdlog::error("gpu {}: host region {} did not map into the new executor: {}", opts_.index,
                      r.id, reply.why);
        lost.push_back(r.id);
      }
    } else if (!r.fd) {
      lost.push_back(r.id);
    }
  }
  if (!ok) {
    why = "restoring host regions: " + why;
    return false;
  }
  std::lock_guard lk(mu_);
  for (RegionId id : lost)
    if (auto it = regions_by_id_.find(id); it != regions_by_id_.end()) it->second.lost = true;
  return true;
}

bool RemoteDevice::await_reply(int socket, std::uint64_t request, Reply& out, std::string& why) {
  std::vector<char> buf(kMaxDatagram);
  const auto deadline = Clock::now() + opts_.call_timeout;
  for (;;) {
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      why = fmt::format("no reply within {} s", ms(opts_.call_timeout) / 1000);
      return false;
    }
    pollfd fd{socket, POLLIN, 0};
    const int r = ::poll(&fd, 1, static_cast<int>(ms(left) + 1));
    if (r < 0 && errno != EINTR) {
      why = fmt::format("poll: {}", std::strerror(errno));
      return false;
    }
    if (r <= 0) continue;
    const ssize_t n = ::recv(socket, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {
      why = "the executor died";
      return false;
    }
    RecordReader rd(buf.data(), static_cast<std::size_t>(n));
    Msg type;
    const char* body;
    std::size_t size;
    while (rd.next(type, body, size)) {
      if (type != Msg::reply) continue;  // nothing else can be outstanding yet
      ReplyMsg m;
      if (!read_fixed(body, size, m) || m.request != request) continue;
      const std::size_t need = sizeof m + m.why_length + std::size_t{m.param_count} * 4;
      if (need > size) continue;
      out.request = m.request;
      out.status = m.status;
      out.why.assign(body + sizeof m, m.why_length);
      out.param_sizes.resize(m.param_count);
      if (m.param_count != 0)
        std::memcpy(out.param_sizes.data(), body + sizeof m + m.why_length, m.param_count * 4);
      return true;
    }
  }
}

// ---------------------------------------------------------------- I/O thread

void RemoteDevice::io_loop() {
  std::vector<Delivery> out;
  for (;;) {
    int sock;
    bool want_restart, stopping;
    Clock::time_point restart_at;
    std::optional<Clock::time_point> kill_at;
    {
      std::lock_guard lk(mu_);
      sock = child_.socket.get();
      stopping = stop_;
      want_restart = state_ == State::restarting && sock < 0 && !stop_;
      restart_at = restart_at_;
      kill_at = kill_at_;
      if (local_ready_) {
        local_ready_ = false;
        for (StreamId id = 0; id < streams_.size(); ++id)
          if (streams_[id]) collect_done(id, *streams_[id], out);
      }
    }
    deliver(out);

    if (stopping) {
      // Let the executor finish its queued work and exit (it was asked to).
      const auto deadline = Clock::now() + opts_.exit_grace;
      while (sock >= 0 && Clock::now() < deadline) {
        pollfd fd{sock, POLLIN, 0};
        if (::poll(&fd, 1, static_cast<int>(ms(deadline - Clock::now()) + 1)) > 0 && !read_socket())
          break;
      }
      pid_t pid;
      {
        std::lock_guard lk(mu_);
        pid = child_.pid;
        child_ = Child{};  // closes the socket
        state_ = State::stopped;
        // Whatever is still pending will not complete any more.
        for (StreamId id = 0; id < streams_.size(); ++id) {
          if (!streams_[id]) continue;
          for (Pending& e : streams_[id]->pending) {
            if (e.done) continue;
            e.done = true;
            e.status = ECANCELED;
            e.orphan = true;
          }
          collect_done(id, *streams_[id], out);
        }
      }
      if (pid > 0) {
        const int st = reap_executor(pid, std::chrono::milliseconds(2000));
        spdlog::debug("gpu {}: executor pid {} {}", opts_.index, pid, describe_wait_status(st));
      }
      deliver(out);
      cv_.notify_all();
      return;
    }

    const auto now = Clock::now();
    if (want_restart && now >= restart_at) {
      std::string why;
      if (!start_child(why, false)) {
        std::lock_guard lk(mu_);
        schedule_restart(true, false, why);
      }
      continue;
    }
    if (kill_at && now >= *kill_at) {
      std::lock_guard lk(mu_);
      if (child_.pid > 0) {
        spdlog::error("gpu {}: executor pid {} did not exit after its fault; killing it",
                      opts_.index, child_.pid);
        ::kill(child_.pid, SIGKILL);
      }
      kill_at_.reset();
      continue;
    }
    int timeout = -1;
    if (want_restart) timeout = static_cast<int>(ms(restart_at - now) + 1);
    if (kill_at) {
      const int k = static_cast<int>(ms(*kill_at - now) + 1);
      timeout = timeout < 0 ? k : std::min(timeout, k);
    }
    pollfd fds[2] = {{wake_fd_.get(), POLLIN, 0}, {sock, POLLIN, 0}};
    const int r = ::poll(fds, sock >= 0 ? 2 : 1, timeout);
    if (r < 0 && errno != EINTR) {
      spdlog::error("gpu {}: executor I/O: poll: {}", opts_.index, std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (r <= 0) continue;
    if (fds[0].revents & POLLIN) {
      std::uint64_t v;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd_.get(), &v, sizeof v);
    }
    if (sock >= 0 && (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) && !read_socket())
      on_executor_gone();
  }
}

bool RemoteDevice::read_socket() {
  // Everything queued in one recvmmsg: in the steady state that is one
  // completion per wake-up, and under load many without a syscall each.
  constexpr unsigned kBatch = 8;
  thread_local std::vector<char> buf(kBatch * kMaxDatagram);
  thread_local std::vector<Delivery> out;
  int sock;
  {
    std::lock_guard lk(mu_);
    sock = child_.socket.get();
  }
  mmsghdr msgs[kBatch];
  iovec iovs[kBatch];
  bool alive = true;
  for (int round = 0; alive && round < 32; ++round) {
    for (unsigned k = 0; k < kBatch; ++k) {
      iovs[k] = iovec{buf.data() + k * kMaxDatagram, kMaxDatagram};
      msgs[k] = mmsghdr{};
      msgs[k].msg_hdr.msg_iov = &iovs[k];
      msgs[k].msg_hdr.msg_iovlen = 1;
    }
    const int got = ::recvmmsg(sock, msgs, kBatch, MSG_DONTWAIT, nullptr);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (got <= 0) {
      alive = false;
      break;
    }
    std::lock_guard lk(mu_);
    for (int k = 0; k < got; ++k) {
      const std::size_t n = msgs[k].msg_len;
      if (n == 0) {  // end of file: the executor is gone (it never sends empty datagrams)
        alive = false;
        break;
      }
      RecordReader rd(buf.data() + k * kMaxDatagram, n);
      Msg type;
      const char* body;
      std::size_t size;
      while (rd.next(type, body, size)) handle_record(type, body, size, out);
      if (rd.error())
        spdlog::error("gpu {}: malformed message from the executor ({} bytes)", opts_.index, n);
    }
    if (got < static_cast<int>(kBatch)) break;  // drained
  }
  deliver(out);
  return alive;
}

void RemoteDevice::handle_record(Msg type, const char* body, std::size_t size,
                                 std::vector<Delivery>& out) {
  switch (type) {
    case Msg::complete: {
      CompleteMsg m;
      if (!read_fixed(body, size, m)) return;
      busy_last_ = m.busy_ns;
      const StreamId id = ticket_stream(m.ticket);
      if (id >= streams_.size() || !streams_[id]) return;
      Stream& s = *streams_[id];
      for (Pending& e : s.pending) {
        if (e.ticket != m.ticket || e.done) continue;
        e.done = true;
        e.by_executor = true;
        e.device_ns = m.device_ns;
        if (e.status == 0) e.status = m.status;
        break;
      }
      collect_done(id, s, out);
      return;
    }
    case Msg::reply: {
      ReplyMsg m;
      if (!read_fixed(body, size, m)) return;
      const std::size_t need = sizeof m + m.why_length + std::size_t{m.param_count} * 4;
      if (need > size) return;
      Reply& r = replies_[m.request];
      r.request = m.request;
      r.status = m.status;
      r.why.assign(body + sizeof m, m.why_length);
      r.param_sizes.resize(m.param_count);
      if (m.param_count != 0)
        std::memcpy(r.param_sizes.data(), body + sizeof m + m.why_length,
                    std::size_t{m.param_count} * 4);
      cv_.notify_all();
      return;
    }
    case Msg::busy: {
      BusyMsg m;
      if (read_fixed(body, size, m)) busy_last_ = m.busy_ns;
      return;
    }
    case Msg::fault: {
      FaultMsg m;
      if (!read_fixed(body, size, m) || state_ != State::running) return;
      // The executor's completions (EFAULT for the streams that ran user
      // kernels) follow; lose it now so they arrive with the new generation.
      const std::string cause = get_text(m.cause);
      fault_reported_ = true;
      fault_kernel_ = m.kernel_fault != 0;
      lose_child(fmt::format("{} in executor pid {}",
                             fault_kernel_ ? "kernel fault" : "device fault", child_.pid) +
                     ": " + cause,
                 cause, fault_kernel_);
      // It exits on its own once they are out; if it hangs, it is killed.
      kill_at_ = Clock::now() + std::chrono::seconds(5);
      return;
    }
    default:
      return;
  }
}

void RemoteDevice::on_executor_gone() {
  pid_t pid;
  {
    std::lock_guard lk(mu_);
    pid = child_.pid;
  }
  const int st = reap_executor(pid, std::chrono::milliseconds(2000));
  std::vector<Delivery> out;
  {
    std::lock_guard lk(mu_);
    child_ = Child{};  // closes the socket
    kill_at_.reset();
    const bool reported = fault_reported_;
    fault_reported_ = false;
    // A crash while user kernels were in flight is blamed on them: on sim a
    // kernel is host code running in the executor.
    bool user_work = false;
    for (const auto& s : streams_) {
      if (!s) continue;
      user_work = user_work || s->open.user_launch;
      for (const Pending& e : s->pending) user_work = user_work || (!e.done && e.user_launch);
    }
    const bool crash_by_kernel = !reported && is_crash(st) && user_work;
    const std::string what = fmt::format("executor pid {} {}{}", pid, describe_wait_status(st),
                                         crash_by_kernel ? " while a user kernel was running" : "");
    if (state_ == State::running) {
      lose_child(what, crash_by_kernel ? what : std::string(), crash_by_kernel);
    }
    fail_orphans(reported ? fault_kernel_ : crash_by_kernel, out);
    const bool quick = Clock::now() - child_up_ < opts_.quick_death;
    if (!stop_) {
      const std::string reason =
          reported ? fmt::format("{} after its fault report ({})", what, last_fault_) : what;
      schedule_restart(quick, reported ? fault_kernel_ : crash_by_kernel, reason);
    }
  }
  deliver(out);
  cv_.notify_all();
}

void RemoteDevice::schedule_restart(bool quick, bool blame_kernel, const std::string& what) {
  if (state_ == State::unusable || stop_) return;
  quick_streak_ = quick ? quick_streak_ + 1 : 0;
  // A kernel that faults is its owner's problem, not the GPU's: it never takes
  // the GPU out of service, however often it happens (it does slow restarts).
  if (!quick) {
    quick_failures_ = 0;
  } else if (!blame_kernel) {
    ++quick_failures_;
  }
  if (quick_failures_ >= opts_.max_quick_failures) {
    go_unusable(
        fmt::format("the executor failed {} times in a row within {} ms of starting; "
                    "last: {}",
                    quick_failures_, opts_.quick_death.count(), what));
    return;
  }
  std::chrono::milliseconds delay{0};
  if (quick_streak_ > 0) {
    delay = opts_.backoff_initial * (1L << std::min(quick_streak_ - 1, 16));
    delay = std::min(delay, opts_.backoff_max);
  }
  restart_at_ = Clock::now() + delay;
  spdlog::error("gpu {}: {}; starting a new executor{} (restart {})", opts_.index, what,
                delay.count() ? fmt::format(" in {} ms", delay.count()) : std::string(),
                generation_.load());
}

void RemoteDevice::go_unusable(const std::string& why) {
  state_ = State::unusable;
  unusable_why_ = why;
  tx_.clear();
  for (auto& s : streams_) {
    if (!s) continue;
    for (Pending& e : s->pending) {
      if (e.done) continue;
      e.done = true;
      e.orphan = true;
      e.status = ENODEV;
    }
    if (s->open.ops > 0) doom(*s, ENODEV);
  }
  local_ready_ = true;
  cv_.notify_all();
  wake();
  spdlog::critical("gpu {}: out of service: {}", opts_.index, why);
}

void RemoteDevice::lose_child(const std::string& reason, const std::string& fault, bool kernel) {
  state_ = State::restarting;
  ++epoch_;
  replies_.clear();  // answers the lost executor will never give, or gave too late
  generation_.fetch_add(1);
  last_restart_ = reason;
  if (!fault.empty()) last_fault_ = fault;
  busy_base_ += busy_last_;
  busy_last_ = 0;
  // Requests not yet sent belonged to the lost executor (the next one gets the
  // stream table and the modules from the restore).
  tx_.clear();
  for (auto& s : streams_) {
    if (!s) continue;
    for (Pending& e : s->pending)
      if (!e.done) e.orphan = true;
    if (s->open.ops > 0) doom(*s, kernel && s->open.user_launch ? EFAULT : EIO);
  }
  cv_.notify_all();
}

void RemoteDevice::fail_orphans(bool kernel, std::vector<Delivery>& out) {
  for (StreamId id = 0; id < streams_.size(); ++id) {
    if (!streams_[id]) continue;
    Stream& s = *streams_[id];
    for (Pending& e : s.pending) {
      if (e.done || !e.orphan) continue;
      e.done = true;
      // EFAULT for the likely culprits; an earlier local error is kept for the
      // others, whose work is lost either way.
      if (kernel && e.user_launch)
        e.status = EFAULT;
      else if (e.status == 0)
        e.status = EIO;
    }
    collect_done(id, s, out);
  }
}

void RemoteDevice::collect_done(StreamId id, Stream& s, std::vector<Delivery>& out) {
  while (!s.pending.empty() && s.pending.front().done) {
    Pending& e = s.pending.front();
    Delivery d{id,
               e.token,
               e.status,
               e.device_ns,
               e.internal,
               e.by_executor && e.status == 0,
               std::move(e.slots)};
    if (e.internal) {
      // A fence of ours: its time and error belong to the caller's next notify.
      if (s.carry_status == 0) s.carry_status = e.status;
      s.carry_ns += e.device_ns;
    } else {
      if (s.carry_status != 0) d.status = s.carry_status;
      d.device_ns += s.carry_ns;
      s.carry_status = 0;
      s.carry_ns = 0;
      ++s.delivering;
    }
    s.pending.pop_front();
    out.push_back(std::move(d));
  }
}

void RemoteDevice::deliver(std::vector<Delivery>& out) {
  if (out.empty()) return;
  // The contract: device-to-host data is in the caller's memory before the
  // completion is reported.
  for (const Delivery& d : out)
    if (d.copy_out)
      for (const Slot& sl : d.slots)
        if (sl.copy_out != nullptr)
          std::memcpy(sl.copy_out, staging_.data() + sl.offset, sl.length);
  bool freed = false;
  {
    std::lock_guard lk(mu_);
    for (const Delivery& d : out)
      for (const Slot& sl : d.slots) {
        ring_.free(sl.offset);
        freed = true;
      }
  }
  if (freed) cv_.notify_all();
  CompletionSink* sink = sink_.load(std::memory_order_acquire);
  for (const Delivery& d : out) {
    if (d.internal || sink == nullptr) continue;
    try {
      sink->on_complete(d.stream, d.token, d.status, d.device_ns);
    } catch (const std::exception& e) {
      spdlog::error("gpu {} stream {}: completion handler threw: {}", opts_.index, d.stream,
                    e.what());
    } catch (...) {
      spdlog::error("gpu {} stream {}: completion handler threw", opts_.index, d.stream);
    }
  }
  {
    std::lock_guard lk(mu_);
    for (const Delivery& d : out)
      if (!d.internal && d.stream < streams_.size() && streams_[d.stream])
        --streams_[d.stream]->delivering;
  }
  cv_.notify_all();
  out.clear();
}

// ---------------------------------------------------------------- request helpers

template <class T>
bool RemoteDevice::put(Msg type, const T& fixed,
                       std::initializer_list<std::pair<const void*, std::size_t>> tail) {
  if (state_ != State::running && state_ != State::restarting) return false;
  std::size_t body = sizeof(T);
  for (const auto& [p, n] : tail) body += n;
  if (!tx_.fits(body)) {
    // While restarting the buffer is all the next executor will get.
    if (state_ != State::running) return false;
    flush();
    if (!tx_.fits(body)) return false;
  }
  tx_.put(type, fixed, tail);
  return true;
}

void RemoteDevice::flush() {
  if (tx_.empty() || state_ != State::running || !child_.socket) return;
  if (const int err = send_datagram(child_.socket.get(), tx_.data(), tx_.size()); err != 0) {
    // The executor is gone; the I/O thread sees the hangup and fails what was sent.
    spdlog::debug("gpu {}: sending to the executor: {}", opts_.index, std::strerror(err));
  }
  tx_.clear();
}

RemoteDevice::Stream& RemoteDevice::op_stream(StreamId id) {
  if (id >= streams_.size() || !streams_[id])
    throw std::invalid_argument(fmt::format("gpu{}: no stream {}", opts_.index, id));
  Stream& s = *streams_[id];
  if (s.closing)
    throw std::invalid_argument(
        fmt::format("gpu{}: stream {} is being destroyed", opts_.index, id));
  return s;
}

bool RemoteDevice::begin_op(Stream& s) {
  ++s.open.ops;
  if (state_ == State::unusable || state_ == State::stopped) {
    doom(s, ENODEV);
    return false;
  }
  return !s.open.doomed;
}

void RemoteDevice::doom(Stream& s, int status) {
  s.open.doomed = true;
  if (s.open.status == 0) s.open.status = status;
}

std::uint64_t RemoteDevice::piece_limit() const {
  return std::max<std::uint64_t>(StagingRing::kAlign,
                                 std::min<std::uint64_t>(opts_.max_piece, ring_.capacity() / 4));
}

bool RemoteDevice::take_slot(std::unique_lock<std::mutex>& lk, Bytes length,
                             std::uint64_t& offset) {
  for (;;) {
    if (state_ != State::running && state_ != State::restarting) return false;
    if (ring_.allocate(length, offset)) return true;
    // Nothing frees slots while the executor is being restarted.
    if (state_ != State::running) return false;
    // Slots come back when the notify after them completes. Open intervals may
    // hold some whose notify has not been sent (the caller's own, with a copy
    // bigger than the area): fence each, so everything in use is on its way.
    for (StreamId id = 0; id < streams_.size(); ++id) {
      Stream* s = streams_[id].get();
      if (s == nullptr || s->open.slots.empty() || s->open.doomed) continue;
      Pending e{};
      e.ticket = make_ticket(id);
      e.internal = true;
      e.user_launch = s->open.user_launch;
      e.slots = std::move(s->open.slots);
      s->open.slots.clear();
      if (!put(Msg::notify, NotifyMsg{id, e.ticket})) {
        s->open.slots = std::move(e.slots);
        continue;
      }
      s->pending.push_back(std::move(e));
    }
    flush();
    cv_.wait(lk);  // a completion freed slots, or the executor was lost
  }
}

int RemoteDevice::sync_call(std::unique_lock<std::mutex>& lk, std::uint64_t request, Reply& out,
                            std::string& why) {
  const std::uint64_t epoch = epoch_;
  const auto deadline = Clock::now() + opts_.call_timeout;
  auto answered = [&] { return replies_.count(request) != 0; };
  while (!answered()) {
    if (epoch_ != epoch || state_ != State::running) {
      why = "the GPU's executor was lost during the call";
      return EIO;
    }
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && !answered()) {
      why = fmt::format("the GPU's executor did not answer within {} s and was killed",
                        ms(opts_.call_timeout) / 1000);
      spdlog::error("gpu {}: executor pid {} did not answer within {} s; killing it", opts_.index,
                    child_.pid, ms(opts_.call_timeout) / 1000);
      if (child_.pid > 0) ::kill(child_.pid, SIGKILL);
      return ETIMEDOUT;
    }
  }
  const auto it = replies_.find(request);
  out = std::move(it->second);
  replies_.erase(it);
  return 0;
}

// ---------------------------------------------------------------- Device

void RemoteDevice::set_sink(CompletionSink* sink) {
  sink_.store(sink, std::memory_order_release);
}

StreamId RemoteDevice::create_stream() {
  std::lock_guard lk(mu_);
  StreamId id = 0;
  while (id < streams_.size() && streams_[id]) ++id;
  if (id >= kMaxStreams)
    throw std::runtime_error(fmt::format("gpu{}: too many streams", opts_.index));
  if (id == streams_.size()) streams_.emplace_back();
  streams_[id] = std::make_unique<Stream>();
  // While restarting, the next executor gets every stream in the table.
  if (state_ == State::running) put(Msg::create_stream, CreateStreamMsg{id});
  return id;
}

void RemoteDevice::destroy_stream(StreamId id) {
  if (std::this_thread::get_id() == io_.get_id())
    throw std::logic_error(
        fmt::format("gpu{}: stream {} destroyed from a completion callback", opts_.index, id));
  {
    std::lock_guard lk(mu_);
    op_stream(id).closing = true;
  }
  for (;;) {
    std::unique_lock sync(sync_mu_);
    std::unique_lock lk(mu_);
    if (state_ == State::restarting) {
      // Its queued work goes to the next executor first; then it is destroyed there.
      sync.unlock();
      cv_.wait(lk, [&] { return state_ != State::restarting; });
      continue;
    }
    if (state_ != State::running) break;
    const std::uint64_t req = next_request_++;
    if (!put(Msg::destroy_stream, DestroyStreamMsg{req, id})) break;
    flush();
    Reply r;
    std::string why;
    if (sync_call(lk, req, r, why) == 0 || state_ != State::restarting) break;
  }
  std::unique_lock lk(mu_);
  Stream& s = *streams_[id];
  cv_.wait(lk, [&] { return s.pending.empty() && s.delivering == 0; });
  for (const Slot& sl : s.open.slots) ring_.free(sl.offset);
  streams_[id].reset();
  cv_.notify_all();
}

void RemoteDevice::fill(StreamId stream, DevOffset dst, Bytes length, std::uint32_t pattern,
                        unsigned width) {
  std::lock_guard lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s)) return;
  if (!put(Msg::fill, FillMsg{stream, pattern, width, dst, length})) doom(s, EIO);
}

void RemoteDevice::copy(StreamId stream, DevOffset dst, DevOffset src, Bytes length) {
  std::lock_guard lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s)) return;
  if (!put(Msg::copy, CopyMsg{stream, dst, src, length})) doom(s, EIO);
}

void RemoteDevice::spin(StreamId stream, std::uint64_t usec, double util) {
  std::lock_guard lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s)) return;
  if (!put(Msg::spin, SpinMsg{stream, usec, util})) doom(s, EIO);
}

void RemoteDevice::gemm(StreamId stream, std::uint32_t m, std::uint32_t n, std::uint32_t k,
                        DevOffset a, DevOffset b, DevOffset c) {
  std::lock_guard lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s)) return;
  if (!put(Msg::gemm, GemmMsg{stream, m, n, k, a, b, c})) doom(s, EIO);
}

void RemoteDevice::copy_to_host(StreamId stream, void* host, DevOffset src, Bytes length) {
  std::unique_lock lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s) || length == 0) return;
  auto* to = static_cast<char*>(host);
  for (Bytes done = 0; done < length;) {
    const Bytes n = std::min<Bytes>(length - done, piece_limit());
    std::uint64_t off = 0;
    if (!take_slot(lk, n, off)) return doom(s, state_ == State::unusable ? ENODEV : EIO);
    if (s.open.doomed) {
      ring_.free(off);
      return;
    }
    s.open.slots.push_back(Slot{off, n, to + done});
    if (!put(Msg::copy_to_host, ToHostMsg{stream, off, src + done, n})) return doom(s, EIO);
    done += n;
  }
}

void RemoteDevice::copy_from_host(StreamId stream, DevOffset dst, const void* host, Bytes length) {
  std::unique_lock lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s) || length == 0) return;
  const auto* from = static_cast<const char*>(host);
  for (Bytes done = 0; done < length;) {
    const Bytes n = std::min<Bytes>(length - done, piece_limit());
    std::uint64_t off = 0;
    if (!take_slot(lk, n, off)) return doom(s, state_ == State::unusable ? ENODEV : EIO);
    // The copy-in can be megabytes: not under the lock the I/O thread needs.
    lk.unlock();
    std::memcpy(staging_.data() + off, from + done, n);
    lk.lock();
    if (s.open.doomed) {
      ring_.free(off);
      cv_.notify_all();
      return;
    }
    s.open.slots.push_back(Slot{off, n, nullptr});
    if (!put(Msg::copy_from_host, FromHostMsg{stream, dst + done, off, n})) return doom(s, EIO);
    done += n;
  }
}

void RemoteDevice::notify(StreamId stream, std::uint64_t token) {
  std::unique_lock lk(mu_);
  Stream& s = op_stream(stream);
  Pending e{};
  e.ticket = make_ticket(stream);
  e.token = token;
  e.user_launch = s.open.user_launch;
  e.slots = std::move(s.open.slots);
  e.status = s.open.status;
  if (state_ == State::unusable || state_ == State::stopped) {
    e.done = true;
    if (e.status == 0) e.status = ENODEV;
  } else if (s.open.doomed) {
    e.done = true;
    if (e.status == 0) e.status = EIO;
  } else if (!put(Msg::notify, NotifyMsg{stream, e.ticket})) {
    e.done = true;
    if (e.status == 0) e.status = EIO;
  } else if (batch_depth_ == 0) {
    flush();
  }
  s.open = Interval{};
  const bool front = s.pending.empty();
  const bool done = e.done;
  s.pending.push_back(std::move(e));
  if (done && front) {
    local_ready_ = true;
    lk.unlock();
    wake();
  }
}

void RemoteDevice::begin_batch() {
  std::lock_guard lk(mu_);
  ++batch_depth_;
}

void RemoteDevice::end_batch() {
  std::lock_guard lk(mu_);
  if (batch_depth_ > 0 && --batch_depth_ == 0) flush();
}

void RemoteDevice::discard(DevOffset offset, Bytes length) {
  std::lock_guard lk(mu_);
  // A new executor's memory reads as zero anyway.
  if (state_ != State::running || length == 0) return;
  put(Msg::discard, DiscardMsg{offset, length});
}

std::int64_t RemoteDevice::busy_ns() const {
  std::lock_guard lk(mu_);
  return busy_base_ + busy_last_;
}

int RemoteDevice::unavailable(std::string& why) const {
  if (state_ == State::unusable) {
    why = "the GPU is out of service: " + unusable_why_;
    return ENODEV;
  }
  if (state_ != State::running) {
    why = "the GPU's executor is being restarted after it was lost; try again in a moment";
    return EAGAIN;
  }
  return 0;
}

int RemoteDevice::load_module(const std::vector<std::uint8_t>& image, ModuleHandle& out,
                              std::string& why) {
  UniqueFd fd = make_image_fd(image, why);
  if (!fd) return EIO;
  std::unique_lock sync(sync_mu_);
  std::unique_lock lk(mu_);
  auto refuse = [&](int err, std::string text) {
    why = std::move(text);
    return err;
  };
  if (std::string text; const int err = unavailable(text)) return refuse(err, std::move(text));
  if (next_module_ == 0) return refuse(ENOSPC, "module handles exhausted");
  const ModuleHandle h = next_module_++;
  const std::uint64_t req = next_request_++;
  flush();  // the image's fd travels alone with its record
  RecordWriter w;
  w.put(Msg::load_module, LoadModuleMsg{req, h, image.size()});
  if (const int err = send_with_fd(child_.socket.get(), w, fd.get()); err != 0)
    return refuse(EIO, fmt::format("sending the module to the executor: {}", std::strerror(err)));
  Reply r;
  if (const int err = sync_call(lk, req, r, why); err != 0) return err;
  if (r.status != 0) return refuse(r.status, r.why);
  Module& m = modules_[h];
  m.memfd = std::move(fd);
  m.size = image.size();
  out = h;
  return 0;
}

int RemoteDevice::map_region(int fd, Bytes size, bool writable, RegionId& out, std::string& why) {
  if (size == 0) {
    why = "an empty region";
    return EINVAL;
  }
  UniqueFd own = dup_fd(fd);
  if (!own) {
    const int err = errno;
    why = fmt::format("keeping the region's file: {}", std::strerror(err));
    return err;
  }
  std::unique_lock sync(sync_mu_);
  std::unique_lock lk(mu_);
  auto refuse = [&](int err, std::string text) {
    why = std::move(text);
    return err;
  };
  if (std::string text; const int err = unavailable(text)) return refuse(err, std::move(text));
  while (next_region_ == 0 || regions_by_id_.count(next_region_)) ++next_region_;
  const RegionId id = next_region_++;
  const std::uint64_t req = next_request_++;
  flush();  // the fd travels alone with its record
  RecordWriter w;
  w.put(Msg::map_region, MapRegionMsg{req, id, writable ? 1u : 0u, size});
  if (const int err = send_with_fd(child_.socket.get(), w, own.get()); err != 0)
    return refuse(EIO, fmt::format("sending the region to the executor: {}", std::strerror(err)));
  Reply r;
  if (const int err = sync_call(lk, req, r, why); err != 0) return err;
  if (r.status != 0) return refuse(r.status, r.why);
  regions_by_id_[id] = Region{std::move(own), size, writable, false};
  out = id;
  return 0;
}

int RemoteDevice::make_lane_memory(Bytes size, UniqueFd& out, std::string& why) {
  std::unique_lock sync(sync_mu_);
  std::unique_lock lk(mu_);
  if (const int err = unavailable(why)) return err;
  const std::uint64_t req = next_request_++;
  put(Msg::lane_make, LaneMakeMsg{req, size});
  flush();
  Reply r;
  if (const int err = sync_call(lk, req, r, why); err != 0) return err;
  if (r.status != 0) {
    why = r.why;
    return r.status;
  }
  const int remote = r.param_sizes.size() == 1 ? static_cast<int>(r.param_sizes[0]) : -1;
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, child_.pid, 0)));
  UniqueFd fd(pidfd ? static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), remote, 0)) : -1);
  if (!fd) {
    const int err = errno;
    if (remote >= 0 && put(Msg::lane_drop, LaneDropMsg{remote})) flush();
    why = fmt::format("taking the lane memory's fd {} from executor pid {}: {}", remote, child_.pid,
                      std::strerror(err));
    return err == ENOSYS ? EOPNOTSUPP : EIO;
  }
  lanes_[fd.get()] = LaneMemory{remote, generation_.load()};
  out = std::move(fd);
  return 0;
}

int RemoteDevice::set_backing(const std::vector<arena::ByteRange>& held, std::string& why) {
  if (!info_.backs_on_demand) return 0;
  const std::vector<arena::ByteRange> sent = arena::merge_to_at_most(held, kMaxBackingRanges);
  {
    std::lock_guard b(backing_mu_);
    backing_ = sent;  // a restarted executor backs this, whatever this call's fate
  }
  // Not sync_mu_: the executor answers set_backing from a thread of its own,
  // and mapping gigabytes takes long; other synchronous calls (a staging
  // block's map_region, under the broker lock) must not wait behind it.
  std::unique_lock sync(backing_call_mu_);
  std::unique_lock lk(mu_);
  if (const int err = unavailable(why)) return err;
  const std::uint64_t req = next_request_++;
  put(Msg::set_backing, SetBackingMsg{req, static_cast<std::uint32_t>(sent.size())},
      {{sent.data(), sent.size() * sizeof(arena::ByteRange)}});
  flush();
  Reply r;
  if (const int err = sync_call(lk, req, r, why); err != 0) return err;
  if (r.param_sizes.size() == 1) backed_bytes_.store(Bytes{r.param_sizes[0]} << 20);
  if (r.status != 0) why = r.why;
  return r.status;
}

Bytes RemoteDevice::backed_bytes() const {
  return info_.backs_on_demand ? backed_bytes_.load() : info_.arena_size;
}

int RemoteDevice::clear_lane_memory(int fd, Bytes size, std::string& why) {
  std::unique_lock sync(sync_mu_);
  std::unique_lock lk(mu_);
  if (const int err = unavailable(why)) return err;
  const auto it = lanes_.find(fd);
  if (it == lanes_.end() || it->second.generation != generation_.load()) {
    why = "the lane memory belonged to an executor that is gone";
    return EIO;
  }
  const std::uint64_t req = next_request_++;
  put(Msg::lane_clear, LaneClearMsg{req, it->second.remote_fd, 0, size});
  flush();
  Reply r;
  if (const int err = sync_call(lk, req, r, why); err != 0) return err;
  if (r.status != 0) why = r.why;
  return r.status;
}

void RemoteDevice::drop_lane_memory(int fd) {
  std::lock_guard lk(mu_);
  const auto it = lanes_.find(fd);
  if (it == lanes_.end()) return;
  // A later executor never had it (and may use the same number for its own).
  if (state_ == State::running && it->second.generation == generation_.load())
    put(Msg::lane_drop, LaneDropMsg{it->second.remote_fd});
  lanes_.erase(it);
}

void RemoteDevice::unmap_region(RegionId region) {
  std::lock_guard lk(mu_);
  const auto it = regions_by_id_.find(region);
  if (it == regions_by_id_.end()) return;
  regions_by_id_.erase(it);  // closes our copy of the fd
  // A new executor never hears of it; this one drops it after the copies sent before.
  if (state_ == State::running) put(Msg::unmap_region, UnmapRegionMsg{region});
}

void RemoteDevice::region_copy(Msg type, StreamId stream, RegionId region, Bytes offset,
                               DevOffset device, Bytes length) {
  std::lock_guard lk(mu_);
  const auto it = regions_by_id_.find(region);
  if (it == regions_by_id_.end())
    throw std::invalid_argument(fmt::format("gpu{}: no host region {}", opts_.index, region));
  const Region& r = it->second;
  if (offset > r.size || length > r.size - offset)
    throw std::invalid_argument(fmt::format("gpu{}: +{} len {} is past host region {} ({} bytes)",
                                            opts_.index, offset, length, region, r.size));
  if (type == Msg::copy_to_region && !r.writable)
    throw std::invalid_argument(
        fmt::format("gpu{}: host region {} is read-only", opts_.index, region));
  Stream& s = op_stream(stream);
  if (!begin_op(s) || length == 0) return;
  if (r.lost) return doom(s, EIO);
  if (!put(type, RegionCopyMsg{stream, region, offset, device, length})) doom(s, EIO);
}

void RemoteDevice::copy_from_region(StreamId stream, DevOffset dst, RegionId region, Bytes offset,
                                    Bytes length) {
  region_copy(Msg::copy_from_region, stream, region, offset, dst, length);
}

void RemoteDevice::copy_to_region(StreamId stream, RegionId region, Bytes offset, DevOffset src,
                                  Bytes length) {
  region_copy(Msg::copy_to_region, stream, region, offset, src, length);
}

void* RemoteDevice::alloc_staging(Bytes size) {
  const UniqueFd fd(::memfd_create("salus-staging", MFD_CLOEXEC));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return nullptr;
  Mapping block = Mapping::shared(fd.get(), size);
  if (!block) return nullptr;
  RegionId region = 0;
  std::string why;
  if (map_region(fd.get(), size, true, region, why) != 0) {
    spdlog::debug("gpu {}: a {}-byte staging block is not shared with the executor: {}",
                  opts_.index, size, why);
    region = 0;
  }
  char* p = block.data();
  std::lock_guard lk(staging_mu_);
  staging_blocks_[reinterpret_cast<std::uintptr_t>(p)] = StagingBlock{std::move(block), region};
  return p;
}

void RemoteDevice::free_staging(void* block, Bytes size) {
  if (block == nullptr) return;
  (void)size;  // the mapping knows its size
  RegionId region = 0;
  Mapping gone;  // unmapped here after the executor let go of it
  {
    std::lock_guard lk(staging_mu_);
    if (auto it = staging_blocks_.find(reinterpret_cast<std::uintptr_t>(block));
        it != staging_blocks_.end()) {
      region = it->second.region;
      gone = std::move(it->second.mapping);
      staging_blocks_.erase(it);
    }
  }
  if (region != 0) unmap_region(region);
}

RegionId RemoteDevice::staging_region(const void* host, Bytes length, Bytes& offset) {
  const auto at = reinterpret_cast<std::uintptr_t>(host);
  std::lock_guard lk(staging_mu_);
  auto it = staging_blocks_.upper_bound(at);
  if (it == staging_blocks_.begin()) return 0;
  --it;
  if (at + length > it->first + it->second.mapping.size()) return 0;
  offset = at - it->first;
  return it->second.region;
}

void RemoteDevice::copy_from_staging(StreamId stream, DevOffset dst, const void* host,
                                     Bytes length) {
  Bytes offset = 0;
  if (const RegionId r = staging_region(host, length, offset); r != 0)
    return copy_from_region(stream, dst, r, offset, length);
  copy_from_host(stream, dst, host, length);
}

void RemoteDevice::copy_to_staging(StreamId stream, void* host, DevOffset src, Bytes length) {
  Bytes offset = 0;
  if (const RegionId r = staging_region(host, length, offset); r != 0)
    return copy_to_region(stream, r, offset, src, length);
  copy_to_host(stream, host, src, length);
}

void RemoteDevice::unload_module(ModuleHandle module) {
  std::lock_guard lk(mu_);
  auto it = modules_.find(module);
  if (it == modules_.end()) return;
  modules_.erase(it);  // closes the image's memfd
  // Ordered after the launches already sent, which keep its code alive there.
  put(Msg::unload_module, UnloadModuleMsg{module});
}

int RemoteDevice::get_function(ModuleHandle module, const std::string& name, FunctionHandle& out,
                               std::vector<std::uint32_t>& param_sizes, std::string& why) {
  param_sizes.clear();
  std::unique_lock sync(sync_mu_);
  std::unique_lock lk(mu_);
  auto it = modules_.find(module);
  if (it == modules_.end()) {
    why = fmt::format("no module {}", module);
    return ENOENT;
  }
  std::vector<Function>& fns = it->second.functions;
  for (std::size_t i = 0; i < fns.size(); ++i)
    if (fns[i].name == name) {
      out = FunctionHandle{module} << 32 | i;
      param_sizes = fns[i].param_sizes;
      return 0;
    }
  if (const int err = unavailable(why)) return err;
  if (fns.size() >= kMaxFunctionsPerModule) {
    why = "too many functions looked up in this module";
    return ENOSPC;
  }
  const FunctionHandle fh = FunctionHandle{module} << 32 | fns.size();
  const std::uint64_t req = next_request_++;
  if (!put(Msg::get_function,
           GetFunctionMsg{req, module, fh, static_cast<std::uint32_t>(name.size())},
           {{name.data(), name.size()}})) {
    why = "the kernel name is too long";
    return ENAMETOOLONG;
  }
  flush();
  Reply r;
  if (const int err = sync_call(lk, req, r, why); err != 0) return err;
  if (r.status != 0) {
    why = r.why;
    return r.status;
  }
  it = modules_.find(module);  // unloaded meanwhile?
  if (it == modules_.end()) {
    why = fmt::format("module {} was unloaded", module);
    return ENOENT;
  }
  it->second.functions.push_back(Function{name, r.param_sizes});
  out = fh;
  param_sizes = std::move(r.param_sizes);
  return 0;
}

std::uint64_t RemoteDevice::device_address(DevOffset offset) const {
  std::lock_guard lk(mu_);
  tl_addr_device = this;
  tl_addr_generation = base_generation_;
  return arena_base_ + offset;
}

void RemoteDevice::launch(StreamId stream, FunctionHandle function, const LaunchDims& dims,
                          const std::uint8_t* args, const std::uint32_t* arg_sizes,
                          std::size_t arg_count) {
  const bool resolved_here = tl_addr_device == this;
  const std::uint64_t resolved_generation = tl_addr_generation;
  tl_addr_device = nullptr;
  std::lock_guard lk(mu_);
  Stream& s = op_stream(stream);
  if (!begin_op(s)) return;
  if (resolved_here && (resolved_generation != generation_.load() || state_ != State::running)) {
    // Its pointers are into the lost executor's memory.
    return doom(s, EIO);
  }
  auto it = modules_.find(static_cast<ModuleHandle>(function >> 32));
  if (it == modules_.end() || static_cast<std::uint32_t>(function) >= it->second.functions.size()) {
    if (s.open.status == 0) {
      spdlog::warn("gpu{} stream {}: launch: no function with handle {:#x}", opts_.index, stream,
                   function);
      s.open.status = EINVAL;
    }
    return;
  }
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < arg_count; ++i) bytes += arg_sizes[i];
  const std::size_t body = sizeof(LaunchMsg) + arg_count * 4 + bytes;
  if (record_size(body) > kMaxDatagram) {
    if (s.open.status == 0) {
      spdlog::warn("gpu{} stream {}: launch: {} bytes of arguments is too much", opts_.index,
                   stream, bytes);
      s.open.status = EINVAL;
    }
    return;
  }
  LaunchMsg m{stream, function, dims, static_cast<std::uint32_t>(arg_count),
              static_cast<std::uint32_t>(bytes)};
  if (!put(Msg::launch, m, {{arg_sizes, arg_count * 4}, {args, bytes}})) return doom(s, EIO);
  s.open.user_launch = true;
}

DeviceHealth RemoteDevice::health() const {
  std::lock_guard lk(mu_);
  DeviceHealth h;
  h.isolation = "process";
  h.executor_pid = state_ == State::running ? child_.pid : 0;
  h.restarts = generation_.load();
  h.last_restart = last_restart_;
  h.last_fault = last_fault_;
  h.usable = state_ != State::unusable;
  h.unusable_why = unusable_why_;
  return h;
}

pid_t RemoteDevice::executor_pid() const {
  std::lock_guard lk(mu_);
  return child_.pid;
}

std::vector<std::unique_ptr<Device>> open_remote_devices(const RemoteOptions& base, int count,
                                                         std::string& why) {
  std::vector<std::unique_ptr<Device>> out;
  std::vector<std::string> failures;
  for (int i = 0; i < count; ++i) {
    RemoteOptions o = base;
    o.executor.gpu = i;
    o.index = static_cast<int>(out.size());
    try {
      out.push_back(std::make_unique<RemoteDevice>(std::move(o)));
    } catch (const std::exception& e) {
      failures.push_back(e.what());
      spdlog::warn("{} GPU {} not used: {}", base.executor.backend, i, e.what());
    }
  }
  if (out.empty()) {
    why.clear();
    for (const std::string& f : failures) why += (why.empty() ? "" : "; ") + f;
  }
  return out;
}

}  // namespace salus::vgpu::executor
