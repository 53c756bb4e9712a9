#include "tools/metrics_http.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <string_view>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace salus::tools {

namespace {

using Clock = std::chrono::steady_clock;

// One client at a time, so each gets a short budget: a client that trickles its
// request or reads the answer slowly holds the server for at most this long.
constexpr std::chrono::milliseconds kReadTimeout{2000};
constexpr std::chrono::milliseconds kWriteTimeout{5000};
constexpr std::size_t kMaxRequest = 8192;  // request line and headers
// After answering: how long and how much of the client's leftover input is read
// and dropped while waiting for it to close.
constexpr std::chrono::milliseconds kDrainTimeout{250};
constexpr std::size_t kMaxDrain = 256 * 1024;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

std::string format_address(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
  return fmt::format("{}:{}", host, ntohs(a->sin_port));
}

std::string response(std::string_view status, std::string_view content_type,
                     const std::string& body, bool with_body, std::string_view extra = {}) {
  std::string r = fmt::format(
      "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n",
      status, content_type, body.size(), extra);
  if (with_body) r += body;
  return r;
}

}  // namespace

std::optional<ListenAddress> parse_listen_address(const std::string& text, std::string& why) {
  ListenAddress a;
  std::string port = text;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      why = fmt::format("'{}': expected [IPV6]:PORT", text);
      return std::nullopt;
    }
    a.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else if (const auto colon = text.rfind(':'); colon != std::string::npos) {
    if (text.find(':') != colon) {
      why = fmt::format("'{}': put an IPv6 address in brackets, e.g. [::1]:9400", text);
      return std::nullopt;
    }
    a.host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (a.host.empty()) a.host = "127.0.0.1";
  unsigned long value = 0;
  bool digits = !port.empty() && port.size() <= 5;
  for (char c : port) {
    digits = digits && c >= '0' && c <= '9';
    if (digits) value = value * 10 + static_cast<unsigned long>(c - '0');
  }
  if (!digits || value > 65535) {
    why = fmt::format("'{}': expected [ADDRESS:]PORT with a port from 0 to 65535", text);
    return std::nullopt;
  }
  a.port = std::to_string(value);
  return a;
}

std::unique_ptr<MetricsHttpServer> MetricsHttpServer::start(const ListenAddress& address,
                                                            Render render, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(address.host.c_str(), address.port.c_str(), &hints, &found);
      rc != 0) {
    why = fmt::format("{}: {}", address.host, ::gai_strerror(rc));
    return nullptr;
  }
  vgpu::UniqueFd fd;
  int err = 0;
  for (addrinfo* ai = found; ai != nullptr && !fd; ai = ai->ai_next) {
    fd.reset(
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd) {
      err = errno;
      continue;
    }
    // A restarted salusd can take the port back at once, whatever TIME_WAIT
    // connections its predecessor left.
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 16) != 0) {
      err = errno;
      fd.reset();
    }
  }
  ::freeaddrinfo(found);
  if (!fd) {
    why = fmt::format("cannot listen on {}:{}: {}{}", address.host, address.port,
                      std::strerror(err ? err : EADDRNOTAVAIL),
                      err == EAFNOSUPPORT
                          ? " (under salusd.service, install the drop-in salusd-metrics.conf: "
                            "salusd(8), SYSTEMD)"
                          : "");
    return nullptr;
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  vgpu::UniqueFd stop_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop_fd) {
    why = fmt::format("eventfd: {}", std::strerror(errno));
    return nullptr;
  }
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer(
      std::move(fd), std::move(stop_fd), std::move(render), format_address(ss)));
  s->thread_ = std::thread([p = s.get()] { p->loop(); });
  return s;
}

MetricsHttpServer::MetricsHttpServer(vgpu::UniqueFd listen_fd, vgpu::UniqueFd stop_fd,
                                     Render render, std::string local)
    : listen_fd_(std::move(listen_fd)),
      stop_fd_(std::move(stop_fd)),
      render_(std::move(render)),
      local_(std::move(local)) {}

MetricsHttpServer::~MetricsHttpServer() {
  stop();
}

void MetricsHttpServer::stop() {
  if (stopped_.exchange(true)) return;
  const std::uint64_t one = 1;
  if (::write(stop_fd_.get(), &one, sizeof one) < 0)
    spdlog::warn("metrics: cannot wake the server thread: {}", std::strerror(errno));
  if (thread_.joinable()) thread_.join();
  listen_fd_.reset();
  stop_fd_.reset();
}

void MetricsHttpServer::loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics: poll failed, no longer serving: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const vgpu::UniqueFd client(
        ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!client) {
      // Out of descriptors or memory: the connection stays queued and poll
      // would report it again at once, so pause rather than spin.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        pollfd stop{stop_fd_.get(), POLLIN, 0};
        ::poll(&stop, 1, 100);
      }
      continue;
    }
    // Nothing may escape the thread (rendering can throw std::bad_alloc); a
    // failed client is dropped and the next one served.
    try {
      serve_client(client.get());
    } catch (const std::exception& e) {
      spdlog::warn("metrics: request failed: {}", e.what());
    } catch (...) {
      spdlog::warn("metrics: request failed");
    }
  }
}

void MetricsHttpServer::serve_client(int fd) {
  // Waits until `fd` is ready for `events` or the deadline passes; false on
  // timeout, error or stop().
  auto wait = [&](short events, Clock::time_point deadline) {
    for (;;) {
      pollfd fds[2] = {{fd, events, 0}, {stop_fd_.get(), POLLIN, 0}};
      const int n = ::poll(fds, 2, remaining_ms(deadline));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || fds[1].revents != 0) return false;
      return (fds[0].revents & (events | POLLHUP | POLLERR)) != 0;
    }
  };

  // The request line and headers, up to the blank line that ends them.
  std::string request;
  const auto read_deadline = Clock::now() + kReadTimeout;
  bool too_large = false;
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() >= kMaxRequest) {
      too_large = true;
      break;
    }
    if (!wait(POLLIN, read_deadline)) return;
    char buf[2048];
    const ssize_t n = ::recv(fd, buf, std::min(sizeof buf, kMaxRequest - request.size()), 0);
    if (n == 0) return;  // the client gave up
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return;
    }
    request.append(buf, static_cast<std::size_t>(n));
  }

  std::string reply;
  const std::string_view line = std::string_view(request).substr(0, request.find_first_of("\r\n"));
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  const std::string_view method = line.substr(0, sp1);
  std::string_view target, version;
  if (sp2 != std::string_view::npos) {
    target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    version = line.substr(sp2 + 1);
  }
  const char* text = "text/plain; charset=utf-8";
  if (too_large) {
    reply = response("431 Request Header Fields Too Large", text, "request too large\n", true);
  } else if (target.empty() || target[0] != '/' || version.substr(0, 7) != "HTTP/1." ||
             version.find(' ') != std::string_view::npos) {
    reply = response("400 Bad Request", text, "bad request\n", true);
  } else if (method != "GET" && method != "HEAD") {
    reply = response("405 Method Not Allowed", text, "only GET and HEAD\n", true,
                     "Allow: GET, HEAD\r\n");
  } else if (target.substr(0, target.find('?')) != "/metrics") {
    reply =
        response("404 Not Found", text, "not found; metrics are at /metrics\n", method == "GET");
  } else {
    reply =
        response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_(), method == "GET");
  }
  if (reply.compare(9, 3, "200") != 0 && spdlog::should_log(spdlog::level::debug)) {
    // The request line is the client's bytes: only printable ones reach the log.
    std::string shown;
    for (char c : line.substr(0, 80)) shown += (c >= 0x20 && c < 0x7f) ? c : '?';
    spdlog::debug("metrics: answered '{}' with {}", shown, reply.substr(9, 3));
  }

  const auto write_deadline = Clock::now() + kWriteTimeout;
  std::size_t sent = 0;
  while (sent < reply.size()) {
    if (!wait(POLLOUT, write_deadline)) return;
    // MSG_NOSIGNAL: a client that hung up must not SIGPIPE the daemon.
    const ssize_t n = ::send(fd, reply.data() + sent, reply.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return;
    }
    sent += static_cast<std::size_t>(n);
  }
  // Closing with unread request bytes would make the kernel reset the
  // connection, and the client could lose the answer: say we are done, then
  // discard what the client still sends, briefly, until it closes.
  ::shutdown(fd, SHUT_WR);
  const auto drain_deadline = Clock::now() + kDrainTimeout;
  for (std::size_t drained = 0; drained < kMaxDrain && wait(POLLIN, drain_deadline);) {
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;
    if (n > 0) drained += static_cast<std::size_t>(n);
  }
}

}  // namespace salus::tools
