// salus-bench: measures salusd through its real /salus files, and the pure
// scheduling cores without a daemon. Starts its own salusd on a temporary mount
// unless --mount names a running one.
#include <fmt/format.h>

#include "tools/salus_bench/bench_common.hpp"

int main(int argc, char** argv) {
  using namespace salus::bench;
  CLI::App app{"salus-bench: benchmarks salusd through /salus"};
  Target target;
  app.add_option("--mount", target.mount, "Use a running salusd mounted here");
  app.add_option("--salusd", target.salusd, "salusd binary to start when --mount is absent");
  app.add_option("--gpu-isolation", target.gpu_isolation,
                 "--gpu-isolation for the salusd started here: process or thread")
      ->check(CLI::IsMember({"process", "thread"}));
  app.require_subcommand(1);
  Registry registry;
  add_broker_benches(app, registry);
  add_sched_benches(app, registry);
  add_gpu_benches(app, registry);
  add_dataplane_benches(app, registry);
  add_soak_benches(app, registry);
  add_gate_benches(app, registry);
  add_backing_benches(app, registry);
  add_census_benches(app, registry);
  CLI11_PARSE(app, argc, argv);
  for (auto& [cmd, run] : registry.benches)
    if (*cmd) return run(target);
  return 2;
}
