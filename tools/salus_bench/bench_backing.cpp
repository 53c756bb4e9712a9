// salus-bench backing: what backing the cuda arena on demand costs (design.md,
// "The arena backed on demand"). For each size, one session allocates a buffer
// of it through its ctl file and frees it; timed are the `alloc` write (which
// maps 2 MiB chunks of card memory under the buffer before it returns) and the
// time until `gpus/0/memory` shows the chunks given back to the card. Meanwhile
// a second session's `status` is read in a loop: salusd backs under its broker
// lock, so the longest of those reads is how long every other user waited. The
// baseline in the same run is the same allocations on a salusd whose arena is
// backed up front (`--cuda-arena up-front`), where `alloc` maps nothing.
#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "arena/size_units.hpp"
#include "tools/salus_bench/bench_common.hpp"

namespace salus::bench {
namespace {

// Reads `status` of `dir`'s session until `stop`: the read latencies in us.
std::vector<double> read_status_until(const std::string& dir, const std::atomic<bool>& stop) {
  std::vector<double> lat;
  const std::string path = dir + "/status";
  while (!stop.load()) {
    const auto t0 = Clock::now();
    if (read_file(path).empty()) die("reading " + path + ": nothing");
    lat.push_back(us_since(t0));
  }
  return lat;
}

std::uint64_t backed_bytes(const std::string& mnt) {
  const std::string v = field(read_file(mnt + "/gpus/0/memory"), "backed");
  return v.empty() ? 0 : std::stoull(v);
}

struct Timed {
  double ms = 0;             // the write, or until the memory was given back
  double others_max_us = 0;  // the longest `status` read of another session meanwhile
  double others_p50_us = 0;
};

// Runs `op` while another session's status is read in a loop.
template <class Op>
Timed timed_with_others(const std::string& other_dir, Op op) {
  std::atomic<bool> stop{false};
  std::vector<double> lat;
  std::thread reader([&] { lat = read_status_until(other_dir, stop); });
  const auto t0 = Clock::now();
  op();
  Timed t;
  t.ms = us_since(t0) / 1e3;
  stop = true;
  reader.join();
  t.others_max_us = lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end());
  t.others_p50_us = percentile(lat, 0.5);
  return t;
}

struct Row {
  std::string size;
  Timed alloc, give_back;
  std::uint64_t backed_delta = 0;
};

Row measure(const std::string& mnt, const std::string& size, std::uint64_t bytes) {
  Clone other(mnt);
  write_all(other.fd, "need persistent=1M ephemeral=0\n");
  Clone c(mnt);
  write_all(c.fd, fmt::format("need persistent={} ephemeral=0\n", size));
  Row r;
  r.size = size;
  const std::uint64_t before = backed_bytes(mnt);
  r.alloc =
      timed_with_others(other.dir, [&] { write_all(c.fd, fmt::format("alloc b {}\n", bytes)); });
  r.backed_delta = backed_bytes(mnt) - before;
  r.give_back = timed_with_others(other.dir, [&] {
    write_all(c.fd, "free b\n");
    // Given back within a dispatch pass; only an on-demand arena changes.
    for (int i = 0; i < 600'000 && r.backed_delta != 0 && backed_bytes(mnt) > before; ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  });
  return r;
}

int bench_backing(Target& t, const std::vector<std::string>& sizes,
                  const std::vector<std::string>& extra) {
  std::vector<std::uint64_t> bytes;
  for (const std::string& s : sizes) {
    const auto b = arena::parse_size(s);
    if (!b || *b == 0) die(fmt::format("--sizes: '{}' is not a size", s));
    bytes.push_back(*b);
  }
  for (const char* mode : {"up-front", "on-demand"}) {
    std::vector<std::string> args = {"--backend", "cuda",         "--log-level",
                                     "warn",      "--cuda-arena", mode};
    args.insert(args.end(), extra.begin(), extra.end());
    const std::string& mnt = t.start(args);
    const std::string mem = read_file(mnt + "/gpus/0/memory");
    fmt::print("arena {}: capacity {} B, backing {}\n", mode, field(mem, "capacity"),
               field(mem, "backing"));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const Row r = measure(mnt, sizes[i], bytes[i]);
      fmt::print(
          "  {:>6}: alloc {:9.2f} ms (backed +{} MiB; another session's status read meanwhile: "
          "p50 {:.0f} us, max {:.0f} us); free until given back {:9.2f} ms (status max {:.0f} "
          "us)\n",
          r.size, r.alloc.ms, r.backed_delta >> 20, r.alloc.others_p50_us, r.alloc.others_max_us,
          r.give_back.ms, r.give_back.others_max_us);
    }
    t.stop();
  }
  return 0;
}

}  // namespace

void add_backing_benches(CLI::App& app, Registry& r) {
  auto* cmd = app.add_subcommand(
      "backing", "Cost of backing the cuda arena on demand: alloc and free of large buffers");
  auto sizes =
      std::make_shared<std::vector<std::string>>(std::vector<std::string>{"1G", "10G", "40G"});
  auto extra = std::make_shared<std::vector<std::string>>();
  cmd->add_option("--sizes", *sizes, "Buffer sizes, e.g. 1G 10G 40G")->delimiter(',');
  cmd->add_option("--salusd-arg", *extra, "Extra salusd flags, e.g. --cuda-memory-fraction=0.5");
  r.add(cmd, [=](Target& t) { return bench_backing(t, *sizes, *extra); });
}

}  // namespace salus::bench
