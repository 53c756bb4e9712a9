// salus-run's command line; see salus_run_options.hpp.
#include "salus_run_options.hpp"

#include <limits.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "arena/size_units.hpp"
#include "salus_config.hpp"

namespace salus::run {

namespace {

bool is_word(const std::string& s) {
  return !s.empty() && std::none_of(s.begin(), s.end(), [](char c) {
    return std::isspace(static_cast<unsigned char>(c)) || c == '#' || c == '\0';
  });
}

std::optional<std::string> check_size(const char* flag, const std::optional<std::string>& v) {
  if (!v) return std::nullopt;
  if (!is_word(*v) || !salus::arena::parse_size(*v))
    return fmt::format("bad size '{}' for {} (a byte count, or with K/M/G/T: 512M, 1.5G)", *v,
                       flag);
  return std::nullopt;
}

// The checks CLI11 cannot express; the first failure's message.
std::optional<std::string> check(RunOptions& o) {
  if (o.command.empty()) return "no program to run: salus-run [OPTIONS] -- PROGRAM [ARGS...]";
  if (o.command[0].empty()) return "the program's name is empty";
  if (o.measure && (o.persistent || o.ephemeral))
    return "--measure and --persistent/--ephemeral exclude each other: declare the sizes or "
           "measure them";
  if (!o.persistent && !o.ephemeral) o.measure = true;  // nothing declared: measure it
  if (auto e = check_size("--persistent", o.persistent)) return e;
  if (auto e = check_size("--ephemeral", o.ephemeral)) return e;
  if (o.gpu && *o.gpu != "any") {
    const auto& g = *o.gpu;
    if (g.empty() || g.size() > 4 || g.find_first_not_of("0123456789") != std::string::npos ||
        std::stoul(g) > 1023)
      return fmt::format("bad --gpu '{}': a GPU index (0 to 1023) or 'any'", g);
  }
  if (o.iters && *o.iters == 0) return "bad --iters 0: at least 1";
  if (o.measure_iters == 0) return "bad --measure-iters 0: at least 1";
  for (const auto& h : o.hints) {
    const auto eq = h.find('=');
    if (!is_word(h) || eq == std::string::npos || eq == 0 || eq + 1 == h.size())
      return fmt::format("bad --policy-hint '{}': give KEY=VALUE, e.g. name=bert", h);
    const std::string key = h.substr(0, eq);
    for (const char* own : {"persistent", "ephemeral", "iters", "priority", "gpu"})
      if (key == own) return fmt::format("--policy-hint {}: use --{} for {}=", h, key, key);
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> parse_args(int argc, char** argv, RunOptions& o, std::string& mount) {
  CLI::App app{
      "salus-run: run a program (e.g. a PyTorch script) as a Salus session, scheduled by "
      "salusd at its iteration boundaries",
      "salus-run"};
  app.footer(
      "The program and its arguments come after --: salus-run [OPTIONS] -- PROGRAM [ARGS...]\n");
  app.set_version_flag("--version",
                       fmt::format("salus-run {} (api {})", SALUS_VERSION, SALUS_API_VERSION));
  app.prefix_command(true);
  app.add_option("--persistent", o.persistent, "Memory held across iterations, e.g. 512M");
  app.add_option("--ephemeral", o.ephemeral, "Memory used within an iteration, e.g. 1G");
  app.add_flag("--measure", o.measure,
               "Measure the peak over the first iterations and declare it (the default)");
  app.add_option("--measure-iters", o.measure_iters, "Iterations --measure watches (default 3)");
  app.add_option("--iters", o.iters, "Total iterations (used by srtf)");
  app.add_option("--priority", o.priority, "Priority (used by the priority policy)");
  app.add_option("--gpu", o.gpu, "GPU index or 'any'");
  app.add_option("--mps-threads", o.mps_threads,
                 "On an MPS GPU, the share of its SMs the program may use (1-100, "
                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)")
      ->check(CLI::Range(1u, 100u));
  app.add_option("--policy-hint", o.hints, "KEY=VALUE passed on to `need` (e.g. name=bert)")
      ->allow_extra_args(false);  // one value per --policy-hint, so PROGRAM is never taken
  app.add_flag("--retry-on-oom", o.retry_on_oom,
               "If the program runs out of GPU memory, run it once more with a GPU of its own");
  app.add_flag("--shared-lane{1}", o.shared_lane,
               "Take ephemeral memory from the GPU's shared lane: --ephemeral then counts once "
               "for the lane. Alone (or =1): salus_lane_alloc only (SALUS_SHARED_LANE=1); "
               "--shared-lane=alloc: cuMemAlloc too, blocks that outlive an iteration "
               "promoted to the program's own memory (SALUS_SHARED_LANE=alloc), or, with "
               "PyTorch's expandable_segments on, =segments; --shared-lane=segments: the "
               "program's own cuMemCreate is made in the lane's room, what outlives an "
               "iteration charged as persistent (SALUS_SHARED_LANE=segments)")
      ->check(CLI::IsMember({"1", "alloc", "segments"}));
  app.add_flag("--no-automark", o.no_automark,
               "Do not mark PyTorch iterations automatically (explicit salus.step() only)");
  app.add_option("-m,--mount", mount, "Where salusd is mounted (default $SALUS_MOUNT or /salus)");
  app.add_flag("-v,--verbose", o.verbose, "Report admission and the exit status on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    fmt::print("{}", app.help());
    return std::string();
  } catch (const CLI::CallForVersion& e) {
    fmt::print("{}\n", e.what());
    return std::string();
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    return msg;
  }
  o.command = app.remaining();
  if (!o.command.empty() && o.command[0] == "--") {
    o.command.erase(o.command.begin());
  } else if (!o.command.empty() && o.command[0].size() > 1 && o.command[0][0] == '-') {
    return fmt::format("unknown option '{}' (the program goes after --)", o.command[0]);
  }
  return check(o);
}

std::string need_line(const RunOptions& o, const std::string& persistent,
                      const std::string& ephemeral, const std::optional<std::string>& gpu) {
  std::string line = fmt::format("need persistent={} ephemeral={}", persistent, ephemeral);
  if (o.iters) line += fmt::format(" iters={}", *o.iters);
  if (o.priority) line += fmt::format(" priority={}", *o.priority);
  if (gpu) line += fmt::format(" gpu={}", *gpu);
  for (const auto& h : o.hints) line += " " + h;
  // Placed and admitted as the attached session it becomes, context reserve included.
  return line + " kind=attached";
}

std::string need_after_restart(std::string_view need_line, std::string_view gpu) {
  constexpr std::string_view kVerb = "need ";
  if (need_line.substr(0, kVerb.size()) == kVerb) need_line.remove_prefix(kVerb.size());
  std::string out;
  while (!need_line.empty()) {
    const std::size_t end = std::min(need_line.find(' '), need_line.size());
    const std::string_view word = need_line.substr(0, end);
    need_line.remove_prefix(std::min(end + 1, need_line.size()));
    if (word.empty() || word.substr(0, 4) == "gpu=") continue;
    out.append(word).push_back(' ');
  }
  return out.append("gpu=").append(gpu);
}

std::pair<unsigned long long, unsigned long long> measured_need(unsigned long long peak,
                                                                unsigned long long held) {
  constexpr unsigned long long MiB = 1ULL << 20;
  auto round_up = [](unsigned long long n) { return (n + MiB - 1) / MiB * MiB; };
  held = std::min(held, peak);
  const unsigned long long margin = std::max(peak / 16, MiB);
  return {round_up(held), round_up(peak - held + margin)};
}

bool expandable_segments_on(std::string_view alloc_conf) {
  // PyTorch's parser drops spaces and reads the settings in order (the last wins).
  std::string conf;
  for (char c : alloc_conf)
    if (c != ' ') conf.push_back(c);
  bool on = false;
  std::string_view rest = conf;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const std::size_t colon = item.find(':');
    if (colon != std::string_view::npos && item.substr(0, colon) == "expandable_segments")
      on = item.substr(colon + 1) == "True";
  }
  return on;
}

std::string absolute_mount(std::string mount) {
  while (mount.size() > 1 && mount.back() == '/') mount.pop_back();
  if (!mount.empty() && mount[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof cwd)) mount = std::string(cwd) + "/" + mount;
  }
  return mount;
}

}  // namespace salus::run
