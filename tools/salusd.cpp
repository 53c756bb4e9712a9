// salusd: the daemon. Parses flags and the TOML config, builds the GPU backends,
// mounts /salus, notifies systemd, serves until SIGTERM/SIGINT, then drains.
#include <grp.h>
#include <signal.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <toml++/toml.h>
#include <CLI/CLI.hpp>

#include "arena/size_units.hpp"
#include "fusefs/filesystem.hpp"
#include "salus_config.hpp"
#include "tools/metrics_http.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/cuda/cuda_backend.hpp"
#include "vgpu/executor/remote_device.hpp"
#include "vgpu/mps/mps_control.hpp"
#include "vgpu/nvml/nvml_sampler.hpp"
#include "vgpu/sim/sim_device.hpp"
#include "vgpu/store/session_store.hpp"

namespace {

// How long a restored session may wait for its admission and its bytes.
constexpr std::chrono::milliseconds kRestoreBound{30000};

struct Settings {
  std::string mount = "/salus";
  std::string backend = "auto";
  int sim_gpus = 2;
  std::string sim_memory = "16G";
  std::string policy = "fair";
  std::string placement = "magm";
  salus::sched::RiskFilter risk;  // CARMA's filter for magm and lug (NVML, cuda backend)
  std::string admin_group;
  std::string log_level = "info";
  std::string config;
  std::uint32_t pipeline_depth = 2;
  // The largest priority a user who is not an admin may give a session.
  std::int32_t user_priority_max = 0;
  // FAIR's shares: per user (uid) or per session.
  std::string fair_share = "user";
  double cuda_memory_fraction = 0.9;
  std::string cuda_arena = "on-demand";  // or up-front
  std::string gpu_isolation = "auto";    // process for cuda, thread for sim
  int shutdown_grace_ms = 5000;
  salus::vgpu::Quotas quotas;
  std::string transfer_chunk = "16M";
  std::string segment_cache = "4G";
  unsigned transfers_active = 4;
  bool fuse_debug = false;
  std::string metrics_listen;  // empty: no HTTP endpoint
  // Named sessions are saved here on a clean stop and restored at start; empty:
  // neither.
  std::string state_dir = "/var/lib/salus";
  // GPU indices (or "all") that get an MPS control daemon of salusd's own, and
  // where their pipe and log directories go (cuda backend only).
  std::vector<std::string> mps;
  std::string mps_dir = "/run/salus/mps";
  // Oversubscription: admit up to this many times each GPU's memory (a number, kept
  // as text so that a bad value gets a clear message); host memory for swapped-out
  // sessions per GPU.
  std::string oversubscribe = "1";
  std::string swap_host_limit = "64G";
  // Card memory counted per attached program for its CUDA context (auto: 512M on
  // cuda, 0 on sim, whose attached programs use another driver's memory).
  std::string attach_context_reserve = "auto";
  std::string attach_overrun = "warn";
  // An attached iteration holding its lane longer than this while others wait
  // loses the lane; 0: never.
  double attach_hold_limit_s = 30;
  // A GPU idle this long while sessions wait for it is reported once per
  // episode; 0: never reported (still counted in gpus/N/info and metrics).
  double idle_warn_s = 60;
  // Past the host limit, swapped-out bytes spill to an unnamed (O_TMPFILE) file
  // here, written by salusd; empty: no spill file.
  std::string swap_dir = "/var/tmp";
};

// A salusd started with `&` from a script that has no job control inherits
// SIGINT (and SIGQUIT) ignored, and a parent may leave signals blocked;
// libfuse installs its stop handlers only over the default disposition, so
// Ctrl-C or `kill -INT` would then do nothing. The stop signals start from
// their defaults and an empty mask, whatever the parent left, before any
// thread exists (threads inherit the mask).
void reset_stop_signals() {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

// The --oversubscribe ratio (1 to 16; "2", "1.5") into `out`; false with `why`.
bool parse_oversubscribe(const std::string& text, double& out, std::string& why) {
  char* end = nullptr;
  const double v = text.empty() ? 0.0 : std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || std::isnan(v)) {
    why = fmt::format("oversubscribe '{}': expected a number from 1 to 16, e.g. 1.5", text);
    return false;
  }
  if (v < 1.0) {
    why = fmt::format(
        "oversubscribe {}: below 1 would admit less than the GPU holds; expected "
        "1 (no oversubscription) to 16",
        text);
    return false;
  }
  if (!(v <= 16.0)) {
    why = fmt::format(
        "oversubscribe {}: expected at most 16 (every admitted byte beyond the "
        "card lives in host memory or the spill file)",
        text);
    return false;
  }
  out = v;
  return true;
}

int fail(const std::string& why) {
  std::fprintf(stderr, "salusd: %s\n", why.c_str());
  return 1;
}

// `mps = [0, 2]` or `mps = "all"`. False with `why` for anything else.
bool load_mps(const toml::table& t, Settings& s, std::string& why) {
  const toml::node* n = t.get("mps");
  if (!n) return true;
  s.mps.clear();
  if (auto v = n->value<std::string>()) {
    s.mps.push_back(*v);
  } else if (const toml::array* a = n->as_array()) {
    for (const auto& e : *a) {
      const auto i = e.value<std::int64_t>();
      if (!i) {
        why = "mps: expected GPU indices, e.g. mps = [0, 1], or \"all\"";
        return false;
      }
      s.mps.push_back(std::to_string(*i));
    }
  } else {
    why = "mps: expected a list of GPU indices or \"all\"";
    return false;
  }
  return true;
}

// Reads the config file into `s`; flags given on the command line win later.
// False with `why` for a file that cannot be read or parsed, or a bad `mps`.
bool load_config(const std::string& path, Settings& s, std::string& why) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    why = fmt::format("config {}: {} (line {})", path, e.description(), e.source().begin.line);
    return false;
  }
  s.mount = t["mount"].value_or(s.mount);
  s.backend = t["backend"].value_or(s.backend);
  s.policy = t["policy"].value_or(s.policy);
  s.placement = t["placement"].value_or(s.placement);
  s.risk.enabled = t["risk"]["filter"].value_or(s.risk.enabled);
  s.risk.max_sm = t["risk"]["max_sm"].value_or(s.risk.max_sm);
  s.risk.max_mem = t["risk"]["max_mem"].value_or(s.risk.max_mem);
  s.risk.window_s = t["risk"]["window_s"].value_or(s.risk.window_s);
  s.admin_group = t["admin_group"].value_or(s.admin_group);
  s.log_level = t["log_level"].value_or(s.log_level);
  s.pipeline_depth = t["pipeline_depth"].value_or(s.pipeline_depth);
  s.user_priority_max = t["user_priority_max"].value_or(s.user_priority_max);
  s.fair_share = t["fair_share"].value_or(s.fair_share);
  s.shutdown_grace_ms = t["shutdown_grace_ms"].value_or(s.shutdown_grace_ms);
  s.metrics_listen = t["metrics_listen"].value_or(s.metrics_listen);
  s.state_dir = t["state_dir"].value_or(s.state_dir);
  if (!load_mps(t, s, why)) {
    why = fmt::format("config {}: {}", path, why);
    return false;
  }
  s.mps_dir = t["mps_dir"].value_or(s.mps_dir);
  if (const toml::node* n = t.get("oversubscribe")) {
    if (auto d = n->value<double>())
      s.oversubscribe = fmt::format("{}", *d);
    else {
      why = fmt::format("config {}: oversubscribe: expected a number, e.g. 1.5", path);
      return false;
    }
  }
  s.swap_host_limit = t["swap_host_limit"].value_or(s.swap_host_limit);
  s.swap_dir = t["swap_dir"].value_or(s.swap_dir);
  s.attach_context_reserve = t["attach"]["context_reserve"].value_or(s.attach_context_reserve);
  s.attach_overrun = t["attach"]["overrun"].value_or(s.attach_overrun);
  s.attach_hold_limit_s = t["attach"]["hold_limit_s"].value_or(s.attach_hold_limit_s);
  s.idle_warn_s = t["idle_warn_s"].value_or(s.idle_warn_s);
  s.sim_gpus = t["sim"]["gpus"].value_or(s.sim_gpus);
  s.cuda_memory_fraction = t["cuda"]["memory_fraction"].value_or(s.cuda_memory_fraction);
  s.cuda_arena = t["cuda"]["arena"].value_or(s.cuda_arena);
  s.gpu_isolation = t["gpu_isolation"].value_or(s.gpu_isolation);
  s.sim_memory = t["sim"]["memory"].value_or(s.sim_memory);
  auto& q = s.quotas;
  q.sessions_per_uid = t["quotas"]["sessions_per_uid"].value_or(q.sessions_per_uid);
  q.buffers_per_uid = t["quotas"]["buffers_per_uid"].value_or(q.buffers_per_uid);
  q.queued_iterations_per_uid =
      t["quotas"]["queued_iterations_per_uid"].value_or(q.queued_iterations_per_uid);
  q.bytes_per_write = t["quotas"]["bytes_per_write"].value_or(q.bytes_per_write);
  q.transfers_per_uid = t["quotas"]["transfers_per_uid"].value_or(q.transfers_per_uid);
  s.transfer_chunk = t["transfers"]["chunk"].value_or(s.transfer_chunk);
  s.transfers_active = t["transfers"]["active"].value_or(s.transfers_active);
  s.segment_cache = t["transfers"]["segment_cache"].value_or(s.segment_cache);
  return true;
}

// Checks every setting, from flags and config alike; false with the first bad
// one in `why`.
bool validate(const Settings& s, std::string& why) {
  auto bad = [&why](std::string text) {
    why = std::move(text);
    return false;
  };
  auto one_of = [](const std::string& v, std::initializer_list<const char*> allowed) {
    for (const char* a : allowed)
      if (v == a) return true;
    return false;
  };
  if (!one_of(s.backend, {"auto", "cuda", "sim"}))
    return bad(fmt::format("backend '{}': expected auto, cuda or sim", s.backend));
  if (!one_of(s.gpu_isolation, {"auto", "process", "thread"}))
    return bad(fmt::format("gpu_isolation '{}': expected process or thread", s.gpu_isolation));
  if (!salus::sched::policy_from_string(s.policy))
    return bad(fmt::format("policy '{}': expected fifo, pack, srtf, fair or priority", s.policy));
  if (!salus::sched::placement_from_string(s.placement))
    return bad(fmt::format("placement '{}': expected magm, lug, rr or exclusive", s.placement));
  if (!(s.risk.max_sm >= 0 && s.risk.max_sm <= 1) || !(s.risk.max_mem >= 0 && s.risk.max_mem <= 1))
    return bad(
        fmt::format("risk max_sm {} / max_mem {}: expected 0 to 1", s.risk.max_sm, s.risk.max_mem));
  if (!(s.risk.window_s >= 1 && s.risk.window_s <= 3600))
    return bad(fmt::format("risk window_s {}: expected 1 to 3600", s.risk.window_s));
  if (!one_of(s.log_level, {"trace", "debug", "info", "warn", "error"}))
    return bad(
        fmt::format("log_level '{}': expected trace, debug, info, warn or error", s.log_level));
  if (s.sim_gpus < 1 || s.sim_gpus > 64)
    return bad(fmt::format("sim gpus {}: expected 1 to 64", s.sim_gpus));
  if (s.pipeline_depth < 1 || s.pipeline_depth > 64)
    return bad(fmt::format("pipeline_depth {}: expected 1 to 64", s.pipeline_depth));
  if (s.shutdown_grace_ms < 0) return bad("shutdown_grace_ms must not be negative");
  if (!(s.cuda_memory_fraction > 0.0 && s.cuda_memory_fraction <= 1.0))
    return bad(fmt::format("cuda memory_fraction {}: expected more than 0 and at most 1",
                           s.cuda_memory_fraction));
  if (!one_of(s.cuda_arena, {"on-demand", "up-front"}))
    return bad(fmt::format("cuda arena '{}': expected on-demand or up-front", s.cuda_arena));
  if (s.quotas.bytes_per_write < 64 || s.quotas.bytes_per_write > 1024 * 1024)
    return bad(
        fmt::format("quotas.bytes_per_write {}: expected 64 to 1048576", s.quotas.bytes_per_write));
  const auto chunk = salus::arena::parse_size(s.transfer_chunk);
  if (!chunk || *chunk < (64u << 10) || *chunk > (256u << 20))
    return bad(
        fmt::format("transfers.chunk '{}': expected a size from 64K to 256M", s.transfer_chunk));
  if (s.transfers_active < 1 || s.transfers_active > salus::vgpu::TransferEngine::kMaxActive)
    return bad(fmt::format("transfers.active {}: expected 1 to {}", s.transfers_active,
                           salus::vgpu::TransferEngine::kMaxActive));
  if (!salus::arena::parse_size(s.segment_cache))
    return bad(fmt::format("transfers.segment_cache '{}': expected a size, e.g. 4G or 0",
                           s.segment_cache));
  if (s.quotas.transfers_per_uid < 1) return bad("quotas.transfers_per_uid must be at least 1");
  if (s.mount.empty() || s.mount[0] != '/')
    return bad(fmt::format("mount '{}' must be an absolute path", s.mount));
  for (const auto& g : s.mps)
    if (g != "all" && (g.empty() || g.size() > 4 || g.find_first_not_of("0123456789") != g.npos))
      return bad(fmt::format("mps '{}': expected GPU indices (e.g. 0,1) or all", g));
  if (!s.mps.empty() && (s.mps_dir.empty() || s.mps_dir[0] != '/'))
    return bad(fmt::format("mps_dir '{}' must be an absolute path", s.mps_dir));
  std::string sub_why;
  double ratio = 1.0;
  if (!parse_oversubscribe(s.oversubscribe, ratio, sub_why)) return bad(sub_why);
  if (!salus::arena::parse_size(s.swap_host_limit))
    return bad(fmt::format("swap_host_limit '{}': expected a size, e.g. 64G", s.swap_host_limit));
  if (s.attach_context_reserve != "auto" && !salus::arena::parse_size(s.attach_context_reserve))
    return bad(fmt::format("attach_context_reserve '{}': expected a size, e.g. 512M, or auto",
                           s.attach_context_reserve));
  if (!salus::sched::fair_share_from_string(s.fair_share))
    return bad(
        fmt::format("fair_share '{}': expected user, user-across-lanes or session", s.fair_share));
  if (s.attach_overrun != "warn" && s.attach_overrun != "kill")
    return bad(fmt::format("attach_overrun '{}': expected warn or kill", s.attach_overrun));
  if (!(s.attach_hold_limit_s >= 0 && s.attach_hold_limit_s <= 86400))
    return bad(fmt::format("attach_hold_limit_s {}: expected 0 (never) to 86400 seconds",
                           s.attach_hold_limit_s));
  if (!(s.idle_warn_s >= 0 && s.idle_warn_s <= 86400))
    return bad(fmt::format("idle_warn_s {}: expected 0 (never) to 86400 seconds", s.idle_warn_s));
  if (!s.metrics_listen.empty() && !salus::tools::parse_listen_address(s.metrics_listen, sub_why))
    return bad(fmt::format("metrics_listen {}", sub_why));
  return true;
}

// The flags of attached sessions (salus-run's programs), bound to their settings.
void add_attach_flags(CLI::App& flags, Settings& s) {
  flags.add_option("--attach-context-reserve", s.attach_context_reserve,
                   "Card memory admission counts for each attached program's CUDA context, "
                   "e.g. 512M (auto: 512M on cuda, 0 on sim, raised on each GPU to the largest "
                   "context measured there)");
  flags.add_option("--attach-overrun", s.attach_overrun,
                   "What salusd does with a program the driver shows holding more card memory "
                   "than admission counts for it: warn (and count it), or kill (SIGKILL)");
  flags.add_option("--attach-hold-limit", s.attach_hold_limit_s,
                   "Seconds an attached iteration may hold its lane while other sessions of "
                   "the lane wait; past it they run beside it (0: never)");
}

// Every command-line flag, bound to its setting; the config file's keys are in
// load_config.
void add_flags(CLI::App& flags, Settings& s) {
  // --help shows each option's default: the value salusd uses without the flag
  // (the config file's, when --config is given).
  flags.option_defaults()->always_capture_default();
  flags.set_version_flag("--version",
                         fmt::format("salusd {} api {}", SALUS_VERSION, SALUS_API_VERSION));
  flags.add_option("--config", s.config, "TOML config file (e.g. /etc/salus/salusd.toml)");
  flags.add_option("--mount", s.mount, "Mountpoint")->envname("SALUS_MOUNT");
  flags.add_option("--backend", s.backend, "GPU backend: auto, cuda or sim")
      ->check(CLI::IsMember({"auto", "cuda", "sim"}));
  flags.add_option("--sim-gpus", s.sim_gpus, "Simulated GPUs (sim backend)")
      ->check(CLI::Range(1, 64));
  flags.add_option("--sim-memory", s.sim_memory, "Memory per simulated GPU, e.g. 16G");
  flags.add_option("--policy", s.policy, "fifo, pack, srtf, fair or priority")
      ->check(CLI::IsMember({"fifo", "pack", "srtf", "fair", "priority"}));
  flags.add_option("--placement", s.placement, "magm, lug, rr or exclusive (for gpu=any)")
      ->check(CLI::IsMember({"magm", "lug", "rr", "exclusive"}));
  flags.add_flag("--risk-filter", s.risk.enabled,
                 "magm and lug skip GPUs that NVML shows busy (CARMA's risk filter)");
  flags.add_option("--risk-max-sm", s.risk.max_sm, "risk threshold on SM activity, 0 to 1")
      ->capture_default_str();
  flags.add_option("--risk-max-mem", s.risk.max_mem, "risk threshold on memory activity, 0 to 1")
      ->capture_default_str();
  flags.add_option("--risk-window-s", s.risk.window_s, "risk window in seconds (1 to 3600)")
      ->capture_default_str();
  flags.add_option("--admin-group", s.admin_group, "Group whose members may use the admin files");
  flags.add_option("--log-level", s.log_level, "trace, debug, info, warn, error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  flags
      .add_option("--pipeline-depth", s.pipeline_depth,
                  "Iterations in flight per lane, the running one included")
      ->check(CLI::Range(1, 64));
  flags
      .add_option("--fair-share", s.fair_share,
                  "How the fair policy shares the GPU: user, equally per user (uid) in a lane, "
                  "each user's share split among its sessions; user-across-lanes, that and "
                  "per user across the lanes too (a user ahead runs in one lane at a time); "
                  "session, equally per session")
      ->check(CLI::IsMember({"user", "user-across-lanes", "session"}));
  flags.add_option("--user-priority-max", s.user_priority_max,
                   "The largest priority a user who is not an admin may give a session "
                   "(under the priority policy, larger runs first); lowering is always allowed");
  flags.add_option("--shutdown-grace-ms", s.shutdown_grace_ms,
                   "On SIGTERM, how long running iterations may take to finish");
  flags.add_option("--state-dir", s.state_dir,
                   "Where named sessions are saved on SIGTERM and restored at start (empty: "
                   "not saved)");
  flags.add_option("--quota-sessions", s.quotas.sessions_per_uid, "Sessions per uid");
  flags.add_option("--quota-buffers", s.quotas.buffers_per_uid, "Buffers per uid");
  flags.add_option("--quota-queued", s.quotas.queued_iterations_per_uid,
                   "Queued iterations per uid");
  flags.add_option("--quota-write-bytes", s.quotas.bytes_per_write, "Bytes per command write")
      ->check(CLI::Range(64u, 1024u * 1024u));
  flags.add_option("--quota-transfers", s.quotas.transfers_per_uid,
                   "upload/download commands queued or running per uid");
  flags.add_option("--transfer-chunk", s.transfer_chunk,
                   "Staging block size of upload/download, e.g. 16M (64K to 256M)");
  flags.add_option("--transfers-active", s.transfers_active,
                   "upload/download transfers moving at once per GPU (1 to 16)");
  flags.add_option("--transfer-segment-cache", s.segment_cache,
                   "Bytes of shared-memory segments kept mapped (on cuda, pinned) per GPU "
                   "between a session's transfers, e.g. 4G; 0 maps each for its transfer alone");
  flags.add_option("--cuda-memory-fraction", s.cuda_memory_fraction,
                   "Share of each GPU's free memory salusd reserves for its arena (cuda)");
  flags
      .add_option("--cuda-arena", s.cuda_arena,
                  "on-demand: the arena takes card memory only where salusd holds lanes and "
                  "buffers, leaving the rest to attached programs (VMM; up-front where the "
                  "driver lacks it); up-front: one allocation of the whole arena at start")
      ->check(CLI::IsMember({"on-demand", "up-front"}));
  flags.add_option("--metrics-listen", s.metrics_listen,
                   "Serve GET /metrics (the text of /salus/metrics) over HTTP on [ADDRESS:]PORT; "
                   "without an address, on 127.0.0.1 (loopback) only. Default: off");
  flags
      .add_option("--gpu-isolation", s.gpu_isolation,
                  "process: each GPU in its own executor process, restarted when a kernel "
                  "poisons its context (default for cuda); thread: inside salusd (default for sim)")
      ->check(CLI::IsMember({"auto", "process", "thread"}));
  flags
      .add_option("--mps", s.mps,
                  "GPUs (indices, comma-separated, or all) on which salusd runs an MPS control "
                  "daemon so that attached sessions run concurrently (cuda backend)")
      ->delimiter(',')
      ->default_str("");  // none: not "[]"
  flags.add_option("--mps-dir", s.mps_dir,
                   "Where the MPS pipe and log directories go, one per GPU");
  flags.add_option("--oversubscribe", s.oversubscribe,
                   "Admit sessions whose memory adds up to RATIO x each GPU's (1 to 16; "
                   "1: no oversubscription). Idle sessions are swapped to host memory");
  flags.add_option("--swap-host-limit", s.swap_host_limit,
                   "Host memory per GPU for swapped-out sessions, e.g. 64G");
  flags.add_option("--swap-dir", s.swap_dir,
                   "Past --swap-host-limit, swapped-out bytes spill to an unnamed file here "
                   "(\"\": refuse such swap-outs)");
  flags.add_option("--idle-warn", s.idle_warn_s,
                   "Seconds a GPU may run nothing while sessions wait for it before salusd "
                   "reports it, with why each waits (0: never)");
  add_attach_flags(flags, s);
  flags.add_flag("--fuse-debug", s.fuse_debug, "Log every FUSE request (very verbose)");
}

// The config file, then the flags, then the checks. Returns false when salusd
// must exit now with `exit_code` (a bad value, --help, --version).
bool parse_settings(int argc, char** argv, Settings& s, int& exit_code) {
  // The config file is read before the flags, so that flags override it.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) s.config = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) s.config = a.substr(9);
  }
  if (!s.config.empty()) {
    if (std::string why; !load_config(s.config, s, why)) {
      exit_code = fail(why);
      return false;
    }
  }
  CLI::App flags{"salusd: the Salus GPU-sharing daemon; serves the /salus filesystem"};
  add_flags(flags, s);
  try {
    flags.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    exit_code = flags.exit(e);
    return false;
  }
  // Values from the config file get the same checks as flags.
  if (std::string why; !validate(s, why)) {
    exit_code = fail(why);
    return false;
  }
  return true;
}

struct Devices {
  std::string backend;  // "cuda" or "sim": what `auto` became
  std::vector<std::unique_ptr<salus::vgpu::Device>> list;
};

// The cuda GPUs (in executors or in this process), or with `auto` and no
// usable GPU, none. Returns false with `why` when --backend cuda cannot be had.
bool open_cuda(const Settings& s, const salus::vgpu::executor::RemoteOptions& ro, Devices& d,
               std::string& why) {
  salus::vgpu::CudaOptions co;
  co.memory_fraction = s.cuda_memory_fraction;
  co.back_on_demand = s.cuda_arena == "on-demand";
  std::string not_found;
  if (s.gpu_isolation == "thread") {
    d.list = salus::vgpu::open_cuda_devices(co, not_found);
  } else if (const int n = salus::vgpu::cuda_device_count(not_found); n > 0) {
    auto cuda = ro;
    cuda.executor.backend = "cuda";
    d.list = salus::vgpu::executor::open_remote_devices(cuda, n, not_found);
  }
  if (!d.list.empty()) {
    d.backend = "cuda";
  } else if (s.backend == "cuda") {
    why = fmt::format("--backend cuda: {}", not_found);
    return false;
  } else {
    spdlog::info("backend auto: {}; using the sim backend", not_found);
    d.backend = "sim";
  }
  return true;
}

// The GPUs salusd serves. Returns false with the whole message in `why`.
bool open_devices(const Settings& s, salus::arena::Bytes sim_memory, Devices& d, std::string& why) {
  d.backend = s.backend;
  // Process isolation: the parent creates no CUDA context; each executor opens its GPU.
  salus::vgpu::executor::RemoteOptions ro;
  ro.executor.sim_memory = sim_memory;
  ro.executor.cuda_memory_fraction = s.cuda_memory_fraction;
  ro.executor.cuda_back_on_demand = s.cuda_arena == "on-demand";
  ro.executor.log_level = s.log_level;
  if ((d.backend == "cuda" || d.backend == "auto") && !open_cuda(s, ro, d, why)) return false;
  if (d.backend == "sim" && s.gpu_isolation == "process") {
    ro.executor.backend = "sim";
    std::string not_opened;
    d.list = salus::vgpu::executor::open_remote_devices(ro, s.sim_gpus, not_opened);
    if (d.list.empty()) {
      why = fmt::format("sim backend: {}", not_opened);
      return false;
    }
  } else if (d.backend == "sim") {
    try {
      for (int i = 0; i < s.sim_gpus; ++i)
        d.list.push_back(std::make_unique<salus::vgpu::SimDevice>(i, sim_memory));
    } catch (const std::exception& e) {
      why = fmt::format("sim backend: cannot reserve {} per GPU: {}", s.sim_memory, e.what());
      return false;
    }
  }
  return true;
}

// NVML readings for the cuda backend's GPUs, found by UUID. Optional: without
// libnvidia-ml.so.1 gpus/N/info says why and the metrics leave them out.
// One sample a second; the risk filter scores the last `window` of them.
std::unique_ptr<salus::vgpu::GpuTelemetry> start_telemetry(const Devices& d, std::size_t window) {
  if (d.backend != "cuda") return nullptr;
  std::vector<std::string> uuids;
  for (const auto& dev : d.list) uuids.push_back(dev->info().uuid);
  auto sampler = std::make_unique<salus::vgpu::nvml::NvmlSampler>(
      std::move(uuids), std::chrono::seconds(1), salus::vgpu::nvml::NvmlReader::kLibrary, window);
  for (std::size_t i = 0; i < d.list.size(); ++i) {
    const auto t = sampler->snapshot(i);
    if (t.available)
      spdlog::info("gpu {}: nvml readings available", i);
    else
      spdlog::info("gpu {}: no nvml readings: {}", i, t.why_not);
  }
  return sampler;
}

using MpsDaemons = std::vector<std::unique_ptr<salus::vgpu::MpsControl>>;

// One MPS control daemon per GPU named by --mps, started before the mount and
// stopped after the broker (never from a FUSE thread). Returns false with `why`
// when one cannot be had: salusd then refuses to start rather than serve those
// GPUs time-sliced while the operator asked for MPS.
bool start_mps(const Settings& s, const Devices& d, MpsDaemons& out, std::string& why) {
  if (s.mps.empty()) return true;
  if (d.backend != "cuda") {
    why = fmt::format(
        "--mps needs the cuda backend (MPS shares a real GPU between processes); "
        "this salusd runs the {} backend",
        d.backend);
    return false;
  }
  out.resize(d.list.size());
  for (const auto& g : s.mps) {
    for (std::size_t i = 0; i < d.list.size(); ++i) {
      if (g != "all" && g != std::to_string(i)) continue;
      if (out[i]) continue;
      salus::vgpu::MpsOptions o;
      o.dir = fmt::format("{}/{}", s.mps_dir, i);
      o.visible = d.list[i]->info().uuid.empty() ? std::to_string(i) : d.list[i]->info().uuid;
      out[i] = salus::vgpu::MpsControl::start(o, why);
      if (!out[i]) {
        why = fmt::format("--mps: gpu {}: {}", i, why);
        return false;
      }
      spdlog::info("gpu {}: MPS control daemon (pid {}{}) serving {}", i, out[i]->pid(),
                   out[i]->adopted() ? ", left by an earlier salusd, taken over" : "",
                   out[i]->pipe_directory());
    }
    if (g != "all" && std::stoul(g) >= d.list.size()) {
      why = fmt::format("--mps {}: no such GPU (salusd has {})", g, d.list.size());
      return false;
    }
  }
  return true;
}

void stop_mps(MpsDaemons& daemons) {
  for (std::size_t i = 0; i < daemons.size(); ++i) {
    if (!daemons[i]) continue;
    const bool was_alive = daemons[i]->alive();
    const std::string what = daemons[i]->stop();
    if (was_alive)
      spdlog::info("gpu {}: {}", i, what);
    else
      spdlog::warn("gpu {}: {}", i, what);
  }
}

// What an attached program's CUDA context takes on the card, for admission: a
// PyTorch process on a current datacenter GPU holds a few hundred MiB that no
// allocation hook sees (the context, cuBLAS/cuDNN module code). salusd warns when
// NVML shows a program past it (Broker::check_attached_contexts).
constexpr salus::arena::Bytes kCudaContextReserve = salus::arena::Bytes{512} << 20;

salus::vgpu::BrokerConfig broker_config(const Settings& s, const std::string& backend) {
  salus::vgpu::BrokerConfig bc;
  bc.policy = *salus::sched::policy_from_string(s.policy);
  bc.placement = *salus::sched::placement_from_string(s.placement);
  bc.risk = s.risk;
  bc.quotas = s.quotas;
  bc.pipeline_depth = s.pipeline_depth;
  bc.user_priority_max = s.user_priority_max;
  bc.fair_share = *salus::sched::fair_share_from_string(s.fair_share);
  bc.transfer_chunk = *salus::arena::parse_size(s.transfer_chunk);
  bc.segment_cache = *salus::arena::parse_size(s.segment_cache);
  bc.transfers_active = s.transfers_active;
  std::string why;  // validate() accepted it
  bc.arena.oversubscribe = 1.0;
  parse_oversubscribe(s.oversubscribe, bc.arena.oversubscribe, why);
  bc.swap_host_limit = *salus::arena::parse_size(s.swap_host_limit);
  bc.swap_dir = s.swap_dir;
  bc.attach_context_reserve = s.attach_context_reserve != "auto"
                                  ? *salus::arena::parse_size(s.attach_context_reserve)
                              : backend == "cuda" ? kCudaContextReserve
                                                  : 0;
  bc.attach_context_learn = s.attach_context_reserve == "auto";
  bc.attach_overrun_kill = s.attach_overrun == "kill";
  bc.attach_hold_limit_ns = static_cast<std::int64_t>(s.attach_hold_limit_s * 1e9);
  bc.idle_warn_ns = static_cast<std::int64_t>(s.idle_warn_s * 1e9);
  return bc;
}

// Every queued upload/download holds the caller's file open: allow what the
// hard limit allows rather than the usual 1024.
void raise_fd_limit() {
  if (rlimit nofile{};
      ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
  }
}

// The optional --metrics-listen endpoint; null with `why` when it cannot listen.
std::unique_ptr<salus::tools::MetricsHttpServer> start_metrics_http(const Settings& s,
                                                                    salus::vgpu::Broker& broker,
                                                                    std::string& why) {
  const auto address = salus::tools::parse_listen_address(s.metrics_listen, why);
  if (!address) return nullptr;
  return salus::tools::MetricsHttpServer::start(
      *address, [&broker] { return broker.render_metrics(); }, why);
}

}  // namespace

int main(int argc, char** argv) {
  // salusd re-executes itself as the executor process of each isolated GPU.
  if (salus::vgpu::executor::is_executor_invocation(argc, argv))
    return salus::vgpu::executor::executor_main(argc, argv);
  reset_stop_signals();
  Settings s;
  if (int exit_code = 0; !parse_settings(argc, argv, s, exit_code)) return exit_code;

  auto logger = spdlog::stderr_color_mt("salusd");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(s.log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  const auto sim_memory = salus::arena::parse_size(s.sim_memory);
  if (!sim_memory || *sim_memory < (1u << 20))
    return fail(fmt::format("--sim-memory '{}' is not a size of at least 1M", s.sim_memory));

  std::optional<gid_t> admin_gid;
  if (!s.admin_group.empty()) {
    if (const group* g = ::getgrnam(s.admin_group.c_str())) {
      admin_gid = g->gr_gid;
    } else {
      return fail(fmt::format("--admin-group {}: no such group", s.admin_group));
    }
  }

  Devices devices;
  if (std::string why; !open_devices(s, *sim_memory, devices, why)) return fail(why);
  // Declared before the broker: stopped after it (and on every early return).
  MpsDaemons mps;
  if (std::string why; !start_mps(s, devices, mps, why)) return fail(why);
  auto telemetry = start_telemetry(devices, static_cast<std::size_t>(std::lround(s.risk.window_s)));
  if (s.risk.enabled && !telemetry)
    spdlog::warn("--risk-filter: the {} backend has no NVML readings; the filter leaves no GPU out",
                 devices.backend);
  const std::string backend = devices.backend;
  const bool isolated =
      s.gpu_isolation == "process" || (s.gpu_isolation == "auto" && backend == "cuda");
  raise_fd_limit();
  auto bc = broker_config(s, backend);
  for (const auto& m : mps) bc.mps.push_back(m.get());
  salus::vgpu::Broker broker(std::move(devices.list), std::move(bc), std::move(telemetry));

  // Before the mount, so that a port in use stops salusd before anything is
  // served. Declared after the broker: destroyed, and so stopped, before it.
  std::unique_ptr<salus::tools::MetricsHttpServer> metrics_http;
  if (!s.metrics_listen.empty()) {
    std::string why;
    metrics_http = start_metrics_http(s, broker, why);
    if (!metrics_http) {
      broker.shutdown(std::chrono::milliseconds(0));
      return fail(fmt::format("--metrics-listen {}", why));
    }
    spdlog::info("metrics: serving http://{}/metrics", metrics_http->local_address());
  }

  // Before the mount: users see their named sessions as they left them.
  if (!s.state_dir.empty()) salus::vgpu::restore_sessions(broker, s.state_dir, kRestoreBound);

  salus::fusefs::FilesystemOptions fo;
  fo.mountpoint = s.mount;
  fo.admin_group = admin_gid;
  fo.debug = s.fuse_debug;
  salus::fusefs::Filesystem fs(broker, fo);
  if (std::string why; fs.mount(why)) {
    if (metrics_http) metrics_http->stop();
    broker.shutdown(std::chrono::milliseconds(0));
    return fail(why);
  }
  spdlog::info("salusd {} serving {} with {} {} GPU(s), policy {}, gpu isolation {}", SALUS_VERSION,
               fs.options().mountpoint, broker.gpu_count(), backend, s.policy,
               isolated ? "process" : "thread");
  for (std::size_t i = 0; i < broker.gpu_count(); ++i)
    spdlog::info("gpu {}: {}", i, broker.render_gpu_summary(i));
  sd_notify(0, "READY=1");
  const int rc = fs.serve();
  sd_notify(0, "STOPPING=1");
  if (metrics_http) metrics_http->stop();
  // Nothing new arrives now that serve() has returned; each buffer is read
  // after the work its session queued before it, up to the grace period.
  if (!s.state_dir.empty()) {
    broker.prepare_to_stop();
    salus::vgpu::save_sessions(broker, s.state_dir, std::chrono::milliseconds(s.shutdown_grace_ms));
  }
  spdlog::info("stopping: no new work; letting running iterations finish (up to {} ms)",
               s.shutdown_grace_ms);
  broker.shutdown(std::chrono::milliseconds(s.shutdown_grace_ms));
  fs.unmount();
  stop_mps(mps);
  spdlog::info("stopped; {} unmounted", fo.mountpoint);
  return rc;
}
