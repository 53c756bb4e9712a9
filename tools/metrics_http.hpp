// salusd's optional Prometheus endpoint: a tiny HTTP/1.x server on one thread
// that answers GET /metrics with the text of /salus/metrics.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "vgpu/unique_fd.hpp"

namespace salus::tools {

struct ListenAddress {
  std::string host;  // numeric address or name; "127.0.0.1" when none was given
  std::string port;  // "0" to "65535"
};

// Parses --metrics-listen: "PORT", ":PORT", "HOST:PORT" or "[IPV6]:PORT". Without
// a host it is 127.0.0.1, so nothing is exposed beyond the machine unless an
// address is named. Returns nullopt and a reason for anything else.
std::optional<ListenAddress> parse_listen_address(const std::string& text, std::string& why);

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;

  // Binds, listens and starts the serving thread; nullptr and a one-line reason
  // when the address cannot be used (bad host, port in use, no permission).
  static std::unique_ptr<MetricsHttpServer> start(const ListenAddress& address, Render render,
                                                  std::string& why);
  ~MetricsHttpServer();  // stop()
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Wakes the thread and joins it; a client being served is dropped. Idempotent.
  void stop();
  // Where it listens, "127.0.0.1:9400" or "[::1]:9400", with the port the
  // kernel chose when 0 was asked for.
  const std::string& local_address() const { return local_; }

 private:
  MetricsHttpServer(vgpu::UniqueFd listen_fd, vgpu::UniqueFd stop_fd, Render render,
                    std::string local);
  void loop();
  void serve_client(int fd);

  vgpu::UniqueFd listen_fd_;
  vgpu::UniqueFd stop_fd_;  // eventfd: readable once stop() was called
  Render render_;
  std::string local_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
};

}  // namespace salus::tools
