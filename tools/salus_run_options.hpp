// salus-run's command line: the options, their checks (every bad argument gets a
// one-line message and exit status 2 before anything is created), and the
// `need` lines built from them, including --measure's rule for turning a
// measured peak into a declaration. Pure functions, unit-tested through the
// binary (tests/integration/test_salus_run.py).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace salus::run {

struct RunOptions {
  std::optional<std::string> persistent, ephemeral, gpu;
  bool measure = false;
  unsigned long long measure_iters = 3;  // K: iterations measured before `need` is set
  std::optional<unsigned long long> iters;
  std::optional<long long> priority;
  // On a GPU where salusd runs MPS: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1-100).
  std::optional<unsigned> mps_threads;
  std::vector<std::string> hints;  // --policy-hint KEY=VALUE, appended to `need`
  bool retry_on_oom = false, no_automark = false, verbose = false;
  // --shared-lane[=alloc|segments]: SALUS_SHARED_LANE for the program ("1", "alloc",
  // "segments"; empty: off)
  std::string shared_lane;
  std::vector<std::string> command;
};

// Parses argv into `o` (and --mount into `mount`). nullopt: go on; "": --help or
// --version was printed, exit 0; otherwise the one-line error.
std::optional<std::string> parse_args(int argc, char** argv, RunOptions& o, std::string& mount);

// `need persistent=P ephemeral=E [iters=] [priority=] [gpu=] [hints...]`.
std::string need_line(const RunOptions& o, const std::string& persistent,
                      const std::string& ephemeral, const std::optional<std::string>& gpu);

// The words of `need` a restarted salusd gets when the shim makes the session
// again ($SALUS_NEED, libsalus-shim(3)): `need_line` without its leading
// "need ", pinned to `gpu`, the GPU the program's context is on.
std::string need_after_restart(std::string_view need_line, std::string_view gpu);

// --measure's rule: from the peak charged over the first K iterations and the
// least charged seen after iteration 1 (memory held across iterations), the
// (persistent, ephemeral) to declare. The margin (1/16 of the peak, at least
// 1 MiB) covers allocator growth after the warm-up; sizes are rounded up to 1 MiB.
std::pair<unsigned long long, unsigned long long> measured_need(unsigned long long peak,
                                                                unsigned long long held);

// Whether a PyTorch allocator setting (PYTORCH_CUDA_ALLOC_CONF or
// PYTORCH_ALLOC_CONF: comma-separated KEY:VALUE) turns expandable segments on.
// Their memory is the program's own cuMemCreate, which --shared-lane=alloc does
// not serve, so salus-run gives such a program the lane as room (segments).
bool expandable_segments_on(std::string_view alloc_conf);

// The mount point without trailing slashes, made absolute from the cwd.
std::string absolute_mount(std::string mount);

}  // namespace salus::run
