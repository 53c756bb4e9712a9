// Admin operations: switching the policy and the /salus/ctl commands.
#include <cerrno>
#include <sstream>

#include <fmt/format.h>

#include "vgpu/broker/broker.hpp"
#include "vgpu/broker/broker_gpu.hpp"

namespace salus::vgpu {

namespace {
std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

}  // namespace

int Broker::set_policy(const std::string& text) {
  const auto words = split_words(text);
  if (words.empty()) return EINVAL;
  const auto kind = sched::policy_from_string(words[0]);
  if (!kind) return EINVAL;
  std::optional<Placement> placement;
  std::optional<arena::QueueMode> queue;
  std::optional<std::int64_t> quantum_ns;
  for (std::size_t i = 1; i < words.size(); ++i) {
    const auto eq = words[i].find('=');
    if (eq == std::string::npos) return EINVAL;
    const std::string key = words[i].substr(0, eq), value = words[i].substr(eq + 1);
    if (key == "placement") {
      placement = sched::placement_from_string(value);
      if (!placement) return EINVAL;
    } else if (key == "queue") {
      if (value == "strict")
        queue = arena::QueueMode::strict_fifo;
      else if (value == "bypass")
        queue = arena::QueueMode::bounded_bypass;
      else
        return EINVAL;
    } else if (key == "quantum_ms") {
      // The fallback slice of unmarked attached programs: 1 ms .. 1 h.
      char* end = nullptr;
      const unsigned long long ms = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || ms < 1 || ms > 3'600'000) return EINVAL;
      quantum_ns = static_cast<std::int64_t>(ms) * 1'000'000;
    } else {
      return EINVAL;
    }
  }
  std::lock_guard lk(mu_);
  config_.policy = *kind;
  if (quantum_ns) {
    config_.quantum_ns = *quantum_ns;
    for (auto& [id, s] : sessions_)
      if (s->gate) gate_store(s->gate->g().quantum_ns, static_cast<std::uint64_t>(*quantum_ns));
  }
  if (placement) config_.placement = *placement;
  for (auto& g : gpus_) {
    g->sched.set_policy(*kind);
    if (queue) g->sched.arena().set_queue_mode(*queue);
    kick(*g);
  }
  return 0;
}

int Broker::admin_command(const std::string& line, std::string& reply) {
  const auto words = split_words(line);
  if (words.empty() || words[0][0] == '#') return 0;
  auto gpu_arg = [&](std::size_t& out) -> int {
    if (words.size() != 2) return EINVAL;
    char* end = nullptr;
    const unsigned long v = std::strtoul(words[1].c_str(), &end, 10);
    if (*end != '\0' || words[1].empty()) return EINVAL;
    if (v >= gpus_.size()) return ENODEV;
    out = v;
    return 0;
  };
  if (words[0] == "kill") {
    if (words.size() != 2) return EINVAL;
    const auto id = find_session(words[1]);
    if (!id) return ENOENT;
    reply += fmt::format("killed {}\n", words[1]);
    return kill_session(*id);
  }
  if (words[0] == "drain" || words[0] == "undrain") {
    std::size_t gi = 0;
    if (int rc = gpu_arg(gi)) return rc;
    std::lock_guard lk(mu_);
    gpus_[gi]->draining = words[0] == "drain";
    reply += fmt::format("gpu {} {}\n", gi, gpus_[gi]->draining ? "draining" : "in service");
    return 0;
  }
  if (words[0] == "queue" && words.size() == 2) {
    arena::QueueMode mode;
    if (words[1] == "strict")
      mode = arena::QueueMode::strict_fifo;
    else if (words[1] == "bypass")
      mode = arena::QueueMode::bounded_bypass;
    else
      return EINVAL;
    std::lock_guard lk(mu_);
    for (auto& g : gpus_) g->sched.arena().set_queue_mode(mode);
    return 0;
  }
  if (words[0] == "placement" && words.size() == 2) {
    const auto p = sched::placement_from_string(words[1]);
    if (!p) return EINVAL;
    std::lock_guard lk(mu_);
    config_.placement = *p;
    return 0;
  }
  return EINVAL;
}

}  // namespace salus::vgpu
