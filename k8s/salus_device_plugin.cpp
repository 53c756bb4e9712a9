// salus-device-plugin: a kubelet device plugin (API v1beta1 over gRPC) that
// advertises shares of each salusd GPU as an extended resource (salus.io/gpu),
// reports a GPU's shares Unhealthy while salusd has it out of service or
// draining, answers Allocate with the CDI device `salusctl cdi` describes (or
// with the mount and environment), and registers with the kubelet again
// whenever the kubelet restarts (it removes the plugin's socket and makes a new
// kubelet.sock). docs/kubernetes.md.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <CLI/CLI.hpp>

#include "deviceplugin.grpc.pb.h"
#include "k8s/plugin_core.hpp"

namespace {

using namespace std::chrono_literals;
using salus::k8s::GpuHealth;
using salus::k8s::Share;

void log(const std::string& line) {
  fmt::print(stderr, "salus-device-plugin: {}\n", line);
}

// The advertised shares, shared by the poller (writer) and the ListAndWatch
// streams (readers, one per kubelet connection).
class Devices {
 public:
  void set(std::vector<Share> shares) {
    std::lock_guard lk(mu_);
    if (shares == shares_ && version_ > 0) return;
    shares_ = std::move(shares);
    ++version_;
    cv_.notify_all();
  }
  std::pair<std::uint64_t, std::vector<Share>> get() const {
    std::lock_guard lk(mu_);
    return {version_, shares_};
  }
  // Returns when the shares changed since `seen`, or after `timeout`.
  void wait_change(std::uint64_t seen, std::chrono::milliseconds timeout) {
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, timeout, [&] { return version_ != seen; });
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Share> shares_;
  std::uint64_t version_ = 0;
};

class PluginService final : public v1beta1::DevicePlugin::Service {
 public:
  PluginService(Devices& devices, salus::k8s::AllocateConfig config)
      : devices_(devices), config_(std::move(config)) {}

  void stop() { stopping_ = true; }

  grpc::Status GetDevicePluginOptions(grpc::ServerContext*, const v1beta1::Empty*,
                                      v1beta1::DevicePluginOptions*) override {
    return grpc::Status::OK;
  }

  grpc::Status ListAndWatch(grpc::ServerContext* ctx, const v1beta1::Empty*,
                            grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) override {
    std::uint64_t sent = 0;
    while (!stopping_ && !ctx->IsCancelled()) {
      const auto [version, shares] = devices_.get();
      if (version != sent) {
        v1beta1::ListAndWatchResponse resp;
        for (const auto& s : shares) {
          auto* d = resp.add_devices();
          d->set_id(s.id);
          d->set_health(s.healthy ? "Healthy" : "Unhealthy");
        }
        if (!writer->Write(resp)) break;  // the kubelet went away
        sent = version;
      }
      devices_.wait_change(sent, 200ms);
    }
    return grpc::Status::OK;
  }

  grpc::Status Allocate(grpc::ServerContext*, const v1beta1::AllocateRequest* req,
                        v1beta1::AllocateResponse* resp) override {
    for (const auto& creq : req->container_requests()) {
      const std::vector<std::string> ids(creq.devices_ids().begin(), creq.devices_ids().end());
      salus::k8s::ContainerAllocation a;
      if (const auto err = salus::k8s::allocate(config_, ids, a)) {
        log("Allocate refused: " + *err);
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, *err);
      }
      auto* c = resp->add_container_responses();
      for (const auto& [k, v] : a.envs) (*c->mutable_envs())[k] = v;
      for (const auto& [k, v] : a.annotations) (*c->mutable_annotations())[k] = v;
      for (const auto& m : a.mounts) {
        auto* mount = c->add_mounts();
        mount->set_host_path(m.host_path);
        mount->set_container_path(m.container_path);
        mount->set_read_only(false);  // sessions are made by writing clone and ctl
      }
      for (const auto& d : a.cdi_devices) c->add_cdi_devices()->set_name(d);
      log(fmt::format(
          "Allocate {} -> {}", fmt::join(ids, ","),
          a.cdi_devices.empty() ? "SALUS_GPU=" + a.envs["SALUS_GPU"] : a.cdi_devices.front()));
    }
    return grpc::Status::OK;
  }

  grpc::Status PreStartContainer(grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
                                 v1beta1::PreStartContainerResponse*) override {
    return grpc::Status::OK;
  }

 private:
  Devices& devices_;
  const salus::k8s::AllocateConfig config_;
  std::atomic<bool> stopping_{false};
};

struct Options {
  std::string mount = "/salus";
  std::string plugin_dir = "/var/lib/kubelet/device-plugins";
  std::string kubelet_socket;  // default: PLUGIN_DIR/kubelet.sock
  std::string socket_name = "salus.sock";
  std::string resource = "salus.io/gpu";
  unsigned shares = 4;
  std::string allocate = "cdi";
  std::string cdi_kind = "salus.io/gpu";
  unsigned poll_ms = 1000;
};

// The GPUs under MOUNT/gpus with their health. If salusd cannot be read, the
// GPUs seen last are all reported unhealthy (the kubelet then stops placing
// pods on them) rather than dropped.
std::vector<GpuHealth> read_gpus(const std::string& mount, const std::vector<GpuHealth>& last) {
  const std::string dir = mount + "/gpus";
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    const std::string why = fmt::format("salusd not reachable: {}: {}", dir, std::strerror(errno));
    std::vector<GpuHealth> out = last;
    for (auto& g : out) g = GpuHealth{g.index, false, why};
    return out;
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (!n.empty() && n.size() < 6 && n.find_first_not_of("0123456789") == std::string::npos)
      names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    return std::stoul(a) < std::stoul(b);
  });
  std::vector<GpuHealth> out;
  for (const auto& n : names) {
    std::ifstream f(dir + "/" + n + "/info");
    std::stringstream text;
    text << f.rdbuf();
    out.push_back(f ? salus::k8s::parse_gpu_info(n, text.str())
                    : GpuHealth{n, false, "cannot read gpus/" + n + "/info"});
  }
  return out;
}

bool register_with_kubelet(const Options& o, std::string& why) {
  auto channel =
      grpc::CreateChannel("unix:" + o.kubelet_socket, grpc::InsecureChannelCredentials());
  auto stub = v1beta1::Registration::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  v1beta1::RegisterRequest req;
  req.set_version("v1beta1");
  req.set_endpoint(o.socket_name);
  req.set_resource_name(o.resource);
  req.mutable_options()->set_pre_start_required(false);
  req.mutable_options()->set_get_preferred_allocation_available(false);
  v1beta1::Empty resp;
  const grpc::Status st = stub->Register(&ctx, req, &resp);
  if (!st.ok()) why = st.error_message();
  return st.ok();
}

// One gRPC server on PLUGIN_DIR/SOCKET_NAME, replaced when the kubelet restarts.
struct Server {
  std::unique_ptr<PluginService> service;
  std::unique_ptr<grpc::Server> server;

  void stop() {
    if (!server) return;
    service->stop();
    server->Shutdown(std::chrono::system_clock::now() + 2s);
    server->Wait();
    server.reset();
    service.reset();
  }
};

bool start_server(Server& s, const Options& o, Devices& devices,
                  const salus::k8s::AllocateConfig& config, const std::string& path) {
  ::unlink(path.c_str());
  s.service = std::make_unique<PluginService>(devices, config);
  grpc::ServerBuilder b;
  b.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  b.RegisterService(s.service.get());
  s.server = b.BuildAndStart();
  if (!s.server) {
    log(fmt::format("cannot serve on {}", path));
    s.service.reset();
    return false;
  }
  (void)o;
  return true;
}

std::string health_summary(const std::vector<GpuHealth>& gpus) {
  std::vector<std::string> parts;
  for (const auto& g : gpus)
    parts.push_back(
        fmt::format("gpu{} {}", g.index, g.healthy ? "healthy" : "unhealthy (" + g.why + ")"));
  return parts.empty() ? std::string("no GPUs") : fmt::format("{}", fmt::join(parts, ", "));
}

int run(const Options& o) {
  salus::k8s::AllocateConfig config;
  config.mode =
      o.allocate == "mounts" ? salus::k8s::AllocateMode::mounts : salus::k8s::AllocateMode::cdi;
  config.cdi_kind = o.cdi_kind;
  config.mount = o.mount;
  const std::string path = o.plugin_dir + "/" + o.socket_name;

  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);  // before gRPC starts its threads

  Devices devices;
  std::vector<GpuHealth> gpus;
  std::string last_summary;
  Server server;
  bool registered = false;
  ino_t kubelet_ino = 0;
  for (;;) {
    gpus = read_gpus(o.mount, gpus);
    devices.set(salus::k8s::shares_of(gpus, o.shares));
    if (const auto summary = health_summary(gpus); summary != last_summary) {
      log(summary);
      last_summary = summary;
    }
    struct stat kst {};
    const bool kubelet_up = ::stat(o.kubelet_socket.c_str(), &kst) == 0;
    struct stat pst {};
    const bool ours = ::stat(path.c_str(), &pst) == 0;
    if (registered && (!ours || !kubelet_up || kst.st_ino != kubelet_ino)) {
      log("the kubelet restarted (plugin socket removed or kubelet.sock replaced): registering "
          "again");
      registered = false;
      server.stop();
    }
    if (!registered && kubelet_up) {
      // A kubelet starting up removes every socket in its directory, ours too,
      // possibly after we made it: serve on a file that exists before registering.
      if (server.server && ::stat(path.c_str(), &pst) != 0) server.stop();
      if (!server.server && !start_server(server, o, devices, config, path)) return 1;
      std::string why;
      if (register_with_kubelet(o, why)) {
        registered = true;
        kubelet_ino = kst.st_ino;
        log(fmt::format("registered {} at {} with the kubelet at {}", o.resource, path,
                        o.kubelet_socket));
      } else {
        log(fmt::format("registration with {} failed: {} (retrying)", o.kubelet_socket, why));
      }
    }
    timespec ts{static_cast<time_t>(o.poll_ms / 1000),
                static_cast<long>(o.poll_ms % 1000) * 1'000'000L};
    const int sig = ::sigtimedwait(&sigs, nullptr, &ts);
    if (sig == SIGTERM || sig == SIGINT) break;
  }
  log("stopping");
  server.stop();
  ::unlink(path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const char* m = std::getenv("SALUS_MOUNT"); m && *m) o.mount = m;
  CLI::App app{"salus-device-plugin: advertises salusd GPU shares to the kubelet"};
  app.add_option("--mount", o.mount, "salusd's mount on the host (default $SALUS_MOUNT or /salus)");
  app.add_option("--plugin-dir", o.plugin_dir,
                 "The kubelet's device plugin directory (default /var/lib/kubelet/device-plugins)");
  app.add_option("--kubelet-socket", o.kubelet_socket,
                 "The kubelet's registration socket (default PLUGIN_DIR/kubelet.sock)");
  app.add_option("--socket-name", o.socket_name, "This plugin's socket in PLUGIN_DIR")
      ->check([](const std::string& s) {
        return s.empty() || s.find('/') != std::string::npos ? std::string("a file name") : "";
      });
  app.add_option("--resource", o.resource, "Extended resource name (default salus.io/gpu)");
  app.add_option("--shares", o.shares, "Shares advertised per GPU (default 4)")
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--allocate", o.allocate,
                 "What Allocate returns: cdi (the CDI device of `salusctl cdi`) or mounts "
                 "(a bind mount and SALUS_MOUNT/SALUS_GPU)")
      ->check(CLI::IsMember({"cdi", "mounts"}));
  app.add_option("--cdi-kind", o.cdi_kind,
                 "CDI kind of `salusctl cdi --kind` (default salus.io/gpu)");
  app.add_option("--poll-ms", o.poll_ms, "How often salusd and the kubelet socket are checked")
      ->check(CLI::Range(50u, 60000u));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (o.kubelet_socket.empty()) o.kubelet_socket = o.plugin_dir + "/kubelet.sock";
  while (o.mount.size() > 1 && o.mount.back() == '/') o.mount.pop_back();
  return run(o);
}
