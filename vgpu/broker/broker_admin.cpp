// Admin operations: switching the policy and the /salus/ctl commands.
#include <cerrno>
#include <optional>
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

// The words of the two admin files, for the reasons given back (salus(5)).
constexpr const char* kPolicies = "fifo, pack, srtf, fair or priority";
constexpr const char* kPlacements = "magm, lug, rr or exclusive";
constexpr const char* kCtlCommands =
    "kill S, drain N, undrain N, queue strict|bypass, placement P or swap out|in S";

std::optional<arena::QueueMode> queue_mode(const std::string& word) {
  if (word == "strict") return arena::QueueMode::strict_fifo;
  if (word == "bypass") return arena::QueueMode::bounded_bypass;
  return std::nullopt;
}

// What a write to /salus/policy sets besides the policy's name.
struct PolicySettings {
  std::optional<Placement> placement;
  std::optional<arena::QueueMode> queue;
  std::optional<std::int64_t> quantum_ns;
  std::optional<double> oversubscribe;
  std::optional<sched::FairShare> fair_share;
};

// The key=value settings after the policy's name, into `c`; 0, or EINVAL with `why`.
int parse_policy_settings(const std::vector<std::string>& words, PolicySettings& c,
                          std::string& why) {
  auto fail = [&](std::string msg) {
    why = std::move(msg);
    return EINVAL;
  };
  for (std::size_t i = 1; i < words.size(); ++i) {
    const auto eq = words[i].find('=');
    if (eq == std::string::npos)
      return fail(
          fmt::format("'{}' after the policy name is not key=value (placement=, queue=, "
                      "quantum_ms=, oversubscribe= or fair_share=); write one setting per write",
                      words[i]));
    const std::string key = words[i].substr(0, eq), value = words[i].substr(eq + 1);
    if (key == "placement") {
      c.placement = sched::placement_from_string(value);
      if (!c.placement) return fail(fmt::format("placement '{}': expected {}", value, kPlacements));
    } else if (key == "queue") {
      c.queue = queue_mode(value);
      if (!c.queue) return fail(fmt::format("queue '{}': expected strict or bypass", value));
    } else if (key == "fair_share") {
      c.fair_share = sched::fair_share_from_string(value);
      if (!c.fair_share)
        return fail(
            fmt::format("fair_share '{}': expected user, user-across-lanes or session", value));
    } else if (key == "oversubscribe") {
      // Admission's bound as a multiple of each GPU's memory: 1 (off) to 16.
      char* end = nullptr;
      const double r = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(r >= 1.0 && r <= 16.0))
        return fail(fmt::format("oversubscribe '{}': expected a number from 1 to 16", value));
      c.oversubscribe = r;
    } else if (key == "quantum_ms") {
      // The fallback slice of unmarked attached programs: 1 ms .. 1 h.
      char* end = nullptr;
      const unsigned long long ms = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || ms < 1 || ms > 3'600'000)
        return fail(fmt::format("quantum_ms '{}': expected 1 to 3600000", value));
      c.quantum_ns = static_cast<std::int64_t>(ms) * 1'000'000;
    } else {
      return fail(fmt::format(
          "unknown key '{}'; expected placement=, queue=, quantum_ms=, oversubscribe= or "
          "fair_share=",
          key));
    }
  }
  return 0;
}

}  // namespace

int Broker::set_policy(const std::string& text, std::string& why) {
  const auto words = split_words(text);
  auto fail = [&](std::string msg) {
    why = std::move(msg);
    return EINVAL;
  };
  if (words.empty())
    return fail(
        "nothing written; expected NAME [placement=P] [queue=strict|bypass] "
        "[quantum_ms=N] [oversubscribe=R] [fair_share=user|user-across-lanes|session]");
  const auto kind = sched::policy_from_string(words[0]);
  if (!kind) return fail(fmt::format("unknown policy '{}'; expected {}", words[0], kPolicies));
  PolicySettings c;
  if (const int err = parse_policy_settings(words, c, why)) return err;
  const auto& [placement, queue, quantum_ns, oversubscribe, fair_share] = c;
  Deferred later;
  std::unique_lock lk(mu_);
  if (oversubscribe) {
    // All GPUs or none: check first, so that a refusal changes nothing.
    for (auto& g : gpus_) {
      const arena::MemorySummary m = g->sched.arena().memory();
      const double cap = static_cast<double>(m.capacity) * *oversubscribe;
      if (static_cast<double>(m.persistent_reserved + m.lane_total) > cap) {
        why = fmt::format("oversubscribe {}: what is admitted already needs more than that",
                          *oversubscribe);
        return EBUSY;
      }
      if (*oversubscribe <= 1.0 && m.resident_reserved != m.persistent_reserved) {
        why = "oversubscribe 1: sessions are still swapped out; try again once they are back";
        return EBUSY;
      }
    }
    for (auto& g : gpus_)
      if (!g->sched.arena().set_oversubscribe(*oversubscribe)) {
        why = fmt::format("oversubscribe {}: refused by the arena of a GPU", *oversubscribe);
        return EBUSY;
      }
    config_.arena.oversubscribe = *oversubscribe;
  }
  config_.policy = *kind;
  if (fair_share) config_.fair_share = *fair_share;
  if (quantum_ns) {
    config_.quantum_ns = *quantum_ns;
    for (auto& [id, s] : sessions_)
      if (s->gate) gate_store(s->gate->g().quantum_ns, static_cast<std::uint64_t>(*quantum_ns));
  }
  if (placement) config_.placement = *placement;
  if (queue) config_.arena.queue_mode = *queue;  // the host-wide queue's mode too
  rekey_host_queue();
  for (auto& g : gpus_) {
    g->sched.set_policy(*kind);
    if (fair_share) g->sched.set_fair_share(*fair_share);
    if (queue) g->sched.arena().set_queue_mode(*queue);
    // The queue follows the new policy's order, and a mode change may admit at once.
    handle_admissions(*g, later, false);
    kick(*g);
  }
  lk.unlock();
  run_deferred(later);
  return 0;
}

int Broker::admin_command(const std::string& line, std::string& reply, std::string& why) {
  const auto words = split_words(line);
  if (words.empty() || words[0][0] == '#') return 0;
  auto fail = [&](int err, std::string msg) {
    why = std::move(msg);
    return err;
  };
  const std::string& cmd = words[0];
  auto gpu_arg = [&](std::size_t& out) -> int {
    if (words.size() != 2)
      return fail(EINVAL, fmt::format("{} takes one GPU index: {} N", cmd, cmd));
    char* end = nullptr;
    const unsigned long v = std::strtoul(words[1].c_str(), &end, 10);
    if (*end != '\0' || words[1].empty() || words[1][0] == '-')
      return fail(EINVAL, fmt::format("{} {}: not a GPU index", cmd, words[1]));
    if (v >= gpus_.size())
      return fail(ENODEV, fmt::format("no GPU {} (salusd has {}, from 0)", words[1], gpus_.size()));
    out = v;
    return 0;
  };
  if (cmd == "kill") {
    if (words.size() != 2) return fail(EINVAL, "kill takes one session id or name: kill S");
    const auto id = find_session(words[1]);
    // kill_session fails only for a session that ended since the lookup.
    if (!id || kill_session(*id) != 0) return fail(ENOENT, fmt::format("no session {}", words[1]));
    reply += fmt::format("killed {}\n", words[1]);
    return 0;
  }
  if (cmd == "drain" || cmd == "undrain") {
    std::size_t gi = 0;
    if (int rc = gpu_arg(gi)) return rc;
    std::lock_guard lk(mu_);
    gpus_[gi]->draining = cmd == "drain";
    reply += fmt::format("gpu {} {}\n", gi, gpus_[gi]->draining ? "draining" : "in service");
    return 0;
  }
  if (cmd == "queue") {
    const auto mode = words.size() == 2 ? queue_mode(words[1]) : std::nullopt;
    if (!mode) return fail(EINVAL, "queue takes one word: queue strict or queue bypass");
    std::lock_guard lk(mu_);
    for (auto& g : gpus_) g->sched.arena().set_queue_mode(*mode);
    return 0;
  }
  if (cmd == "swap") {
    if (words.size() != 3 || (words[1] != "out" && words[1] != "in"))
      return fail(EINVAL, "swap takes a direction and a session: swap out|in S");
    return admin_swap(words[2], words[1] == "out", reply, why);
  }
  if (cmd == "placement") {
    const auto p = words.size() == 2 ? sched::placement_from_string(words[1]) : std::nullopt;
    if (!p) return fail(EINVAL, fmt::format("placement takes one of {}", kPlacements));
    std::lock_guard lk(mu_);
    config_.placement = *p;
    return 0;
  }
  return fail(EINVAL, fmt::format("unknown command '{}'; expected {}", cmd, kCtlCommands));
}

}  // namespace salus::vgpu
