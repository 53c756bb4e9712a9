// salus-bench subcommands for a real GPU (cuda backend): overhead against a
// native Driver-API loop, the switch gap between sessions sharing a lane, packing
// small jobs into lanes, many inference sessions on one GPU, and a fixed-length
// "training job" for comparisons with time-slicing and MPS. They start salusd
// with --backend cuda unless --mount names a running one.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "salus_config.hpp"
#include "tools/salus_bench/bench_common.hpp"
#if SALUS_HAVE_CUDA
#include "tools/salus_bench/native_cuda_loop.hpp"
#endif

namespace salus::bench {
namespace {

std::vector<std::string> cuda_args(const std::string& policy,
                                   const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"--backend", "cuda", "--log-level", "warn", "--policy", policy};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

void set_policy(const std::string& mnt, const std::string& policy) {
  const int fd = ::open((mnt + "/policy").c_str(), O_WRONLY);
  if (fd < 0) die(fmt::format("open policy: {}", std::strerror(errno)));
  write_all(fd, policy + "\n");
  ::close(fd);
}

std::string gpu_info(const std::string& mnt) {
  return read_file(mnt + "/gpus/0/info");
}

// The iteration text of an op name: gemm N^3 on A, B, C or spin USEC.
struct Op {
  std::string kind;  // "gemm" or "spin"
  std::uint32_t size = 0;
  std::uint64_t usec = 0;
  std::string body() const {
    return kind == "gemm" ? fmt::format("gemm {0} {0} {0} A B C\n", size)
                          : fmt::format("spin {}\n", usec);
  }
  std::uint64_t matrix_bytes() const { return std::uint64_t{size} * size * 4; }
  std::string label() const {
    return kind == "gemm" ? fmt::format("gemm {0}x{0}x{0} fp32", size)
                          : fmt::format("spin {} us", usec);
  }
};

// Opens a session with A, B, C sized for `op`, filled with 1.0 and 2.0.
std::unique_ptr<Clone> open_job(const std::string& mnt, const Op& op, const std::string& extra) {
  auto c = std::make_unique<Clone>(mnt);
  const std::uint64_t m = std::max<std::uint64_t>(op.matrix_bytes(), 4096);
  c->run_and_wait(fmt::format(
      "need persistent={} ephemeral=0 {}\nalloc A {}\nalloc B {}\nalloc C {}\nfill A 1.0\n"
      "fill B 2.0\n",
      3 * m, extra, m, m, m));
  return c;
}

// Seconds for `n` iterations of `op` in one salusd session after a warm-up.
double salusd_run(const std::string& mnt, const Op& op, long n) {
  auto c = open_job(mnt, op, "");
  c->run_and_wait("begin\n" + op.body() + "end x10\n");  // warm-up: module, clocks
  const auto t0 = Clock::now();
  c->run_and_wait(fmt::format("run {}\n", n));
  return us_since(t0) / 1e6;
}

Op parse_op(const std::string& text) {
  Op op;
  if (text.rfind("gemm", 0) == 0) {
    op.kind = "gemm";
    op.size = static_cast<std::uint32_t>(std::stoul(text.substr(4)));
  } else if (text.rfind("spin", 0) == 0) {
    op.kind = "spin";
    op.usec = std::stoull(text.substr(4));
  } else {
    die("op must be gemmN (e.g. gemm4096) or spinUSEC (e.g. spin5000): " + text);
  }
  return op;
}

// ---- overhead ----
int bench_overhead(Target& t, const std::vector<std::string>& ops, long n) {
#if SALUS_HAVE_CUDA
  struct Row {
    Op op;
    NativeResult native;
    double salusd_s = 0;
  };
  std::vector<Row> rows;
  for (const std::string& text : ops) rows.push_back(Row{parse_op(text), {}, 0});
  // salusd first: its info carries the spin calibration the native loop reuses,
  // so both spin the same number of cycles.
  const std::string& mnt = t.start(cuda_args("fifo", {}));
  const std::string info = gpu_info(mnt);
  const double cycles = std::atof(field(info, "spin_cycles_per_us").c_str());
  for (Row& r : rows) r.salusd_s = salusd_run(mnt, r.op, n);
  t.stop();  // the native loop gets the GPU to itself
  for (Row& r : rows) {
    std::string why;
    NativeSpec spec{r.op.kind, r.op.size, r.op.usec, cycles};
    if (!native_loop(spec, n, 10, r.native, why)) die("native loop: " + why);
  }
  fmt::print("overhead gpu='{}' iterations={} (same kernels, same launch shapes)\n",
             field(info, "name"), n);
  for (const Row& r : rows) {
    const double native_rate = static_cast<double>(n) / r.native.seconds;
    const double salus_rate = static_cast<double>(n) / r.salusd_s;
    fmt::print(
        "  {:<22} native {:9.2f} it/s ({:.3f} ms/it)  salusd {:9.2f} it/s ({:.3f} ms/it)  "
        "ratio {:.4f} (target >= 0.98)\n",
        r.op.label(), native_rate, 1e3 / native_rate, salus_rate, 1e3 / salus_rate,
        salus_rate / native_rate);
  }
  return 0;
#else
  (void)t;
  (void)ops;
  (void)n;
  die("gpu-overhead needs a build with the cuda backend (cuda.h was not found at build time)");
#endif
}

// ---- switch gap ----
// Device timestamps (stamp kernel) before and after every iteration of two
// sessions that share one lane under FAIR; a switch gap is the GPU time between
// one session's last stamp and the other's first.
int bench_switch_gap(Target& t, const std::string& kernels_arg, long n, std::uint64_t spin_us,
                     const std::vector<std::string>& extra) {
  const std::string kernels = std::filesystem::absolute(kernels_arg).string();  // salusd opens it
  if (!std::filesystem::exists(kernels))
    die(fmt::format("bench kernels not found at {} (pass --kernels)", kernels));
  const std::string& mnt = t.start(cuda_args("fair", extra));
  set_policy(mnt, "fair");
  const std::uint64_t capacity = std::stoull(field(gpu_info(mnt), "capacity"));
  // Two lanes of this size cannot fit: Algorithm 1 must put both sessions in one.
  const std::uint64_t lane = (capacity / 5 * 3) & ~std::uint64_t{0xfffff};
  const std::uint64_t stamp_bytes = 8 * (1 + 2 * static_cast<std::uint64_t>(n) + 16);
  std::vector<std::unique_ptr<Clone>> s;
  for (int i = 0; i < 2; ++i) {
    s.push_back(std::make_unique<Clone>(mnt));
    s.back()->run_and_wait(
        fmt::format("need persistent={} ephemeral={}\nalloc T {}\nfill T 0 dtype=u8\nmodule k {}\n",
                    stamp_bytes + 4096, lane, stamp_bytes, kernels));
  }
  const std::string lane0 = field(s[0]->status(), "lane");
  if (lane0.empty() || lane0 != field(s[1]->status(), "lane"))
    die("the two sessions did not share a lane");
  const std::string body = fmt::format(
      "begin\nlaunch k.salus_bench_stamp grid=1 block=1 T\nspin {}\n"
      "launch k.salus_bench_stamp grid=1 block=1 T\nend\n",
      spin_us);
  // Both record first, then both runs go in back to back, so they compete.
  for (auto& c : s) write_all(c->fd, body);
  for (auto& c : s) write_all(c->fd, fmt::format("run {}\n", n - 1));
  for (auto& c : s) wait_done(mnt, c->id);

  struct Interval {
    std::uint64_t begin, end;
    int session;
  };
  std::vector<Interval> all;
  for (int i = 0; i < 2; ++i) {
    const std::string raw = read_file(s[i]->dir + "/mem/T");
    if (raw.size() < 8) die("short read of the stamp buffer");
    std::vector<std::uint64_t> v(raw.size() / 8);
    std::memcpy(v.data(), raw.data(), v.size() * 8);
    const std::uint64_t count = v[0];
    if (count != 2 * static_cast<std::uint64_t>(n))
      die(fmt::format("session {} took {} stamps, expected {}", i, count, 2 * n));
    for (std::uint64_t k = 0; k + 1 < count; k += 2) all.push_back(Interval{v[1 + k], v[2 + k], i});
  }
  std::sort(all.begin(), all.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<double> switch_us, same_us;
  std::vector<double> steady_us;  // switches after the first tenth of the run (warm-up)
  std::vector<std::string> slow;  // where the GPU sat idle for over 100 us
  long slow_total = 0;
  long overlaps = 0;
  for (std::size_t i = 1; i < all.size(); ++i) {
    if (all[i].begin < all[i - 1].end) {
      ++overlaps;  // cannot happen on one stream; counted to prove it
      continue;
    }
    const double gap = static_cast<double>(all[i].begin - all[i - 1].end) / 1e3;
    (all[i].session != all[i - 1].session ? switch_us : same_us).push_back(gap);
    if (all[i].session != all[i - 1].session && i >= all.size() / 10) steady_us.push_back(gap);
    if (gap > 100) slow_total++;
    if (gap > 100 && (slow.size() < 6 || i > all.size() * 9 / 10))
      slow.push_back(fmt::format("#{}@{:.1f}ms:{:.0f}us", i,
                                 static_cast<double>(all[i].begin - all[0].begin) / 1e6, gap));
  }
  fmt::print("switch-gap policy=fair sessions=2 lane={} iterations={} x 2 spin={}us {}\n", lane0, n,
             spin_us, fmt::join(extra, " "));
  fmt::print(
      "  switches {}  p50 {:.2f} us  p99 {:.2f} us  max {:.2f} us  (target p50 <= 20, p99 "
      "<= 100)\n",
      switch_us.size(), percentile(switch_us, 0.5), percentile(switch_us, 0.99),
      percentile(switch_us, 1.0));
  fmt::print("  after the first tenth: switches {}  p50 {:.2f} us  p99 {:.2f} us  max {:.2f} us\n",
             steady_us.size(), percentile(steady_us, 0.5), percentile(steady_us, 0.99),
             percentile(steady_us, 1.0));
  fmt::print("  same-session gaps {}  p50 {:.2f} us  p99 {:.2f} us  (baseline)\n", same_us.size(),
             percentile(same_us, 0.5), percentile(same_us, 0.99));
  if (!slow.empty())
    fmt::print("  {} gaps over 100 us; the first ones and those in the last tenth: {}\n",
               slow_total, fmt::join(slow, " "));
  if (overlaps > 0) fmt::print("  WARNING: {} overlapping intervals\n", overlaps);
  return 0;
}

// ---- packing ----
double run_jobs(const std::string& mnt, const std::vector<std::unique_ptr<Clone>>& jobs, long n) {
  const auto t0 = Clock::now();
  for (auto& c : jobs) write_all(c->fd, fmt::format("run {}\n", n));
  for (auto& c : jobs) wait_done(mnt, c->id);
  return us_since(t0) / 1e6;
}

int bench_pack(Target& t, int sessions, std::uint32_t size, long n) {
  const std::string& mnt = t.start(cuda_args("fifo", {}));
  const Op op{"gemm", size, 0};
  std::vector<std::unique_ptr<Clone>> jobs;
  for (int i = 0; i < sessions; ++i) {
    jobs.push_back(open_job(mnt, op, ""));
    jobs.back()->run_and_wait("begin\n" + op.body() + "end x5\n");
  }
  std::vector<std::string> lanes;
  for (auto& c : jobs) lanes.push_back(field(c->status(), "lane"));
  std::sort(lanes.begin(), lanes.end());
  const auto distinct = std::unique(lanes.begin(), lanes.end()) - lanes.begin();
  set_policy(mnt, "fifo");
  const double fifo_s = run_jobs(mnt, jobs, n);
  set_policy(mnt, "pack");
  const double pack_s = run_jobs(mnt, jobs, n);
  const double total = static_cast<double>(n) * sessions;
  fmt::print("pack sessions={} lanes={} op={} iterations={} per session\n", sessions, distinct,
             op.label(), n);
  fmt::print("  FIFO (one session at a time)  {:.3f} s  {:9.1f} it/s\n", fifo_s, total / fifo_s);
  fmt::print("  PACK ({} lanes concurrently)   {:.3f} s  {:9.1f} it/s\n", distinct, pack_s,
             total / pack_s);
  fmt::print("  aggregate throughput PACK/FIFO {:.2f} (paper, hyper-parameter tuning: 2.38)\n",
             fifo_s / pack_s);
  return 0;
}

// ---- inference ----
// `models` distinct request sizes, `instances` sessions each; every session sends
// requests (one iteration: `layers` gemms of its size) at Poisson arrivals of
// `rate` per second and waits for each. Latency is write -> wait done. The
// baseline is each model alone on the GPU.
std::vector<double> serve(const std::string& mnt, const std::vector<Clone*>& sessions, double rate,
                          double seconds, std::uint64_t seed) {
  std::vector<std::vector<double>> lat(sessions.size());
  std::vector<std::thread> threads;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  for (std::size_t i = 0; i < sessions.size(); ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 rng(seed + i);
      std::exponential_distribution<double> gap(rate);
      auto next = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(gap(rng)));
      while (next < end) {
        std::this_thread::sleep_until(next);
        const auto t0 = Clock::now();
        write_all(sessions[i]->fd, "run 1\n");
        wait_done(mnt, sessions[i]->id);
        lat[i].push_back(us_since(t0) / 1e3);
        next +=
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
        next = std::max(next, Clock::now());
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  return all;
}

int bench_inference(Target& t, int models, int instances, double rate, double seconds,
                    const std::string& policy) {
  const std::string& mnt = t.start(cuda_args(policy, {}));
  set_policy(mnt, policy);
  // Model m's request: 4 gemms of size 256 * (1 + m % 8), from ~0.1 to ~6 GFLOP.
  auto size_of = [](int m) { return static_cast<std::uint32_t>(256 * (1 + m % 8)); };
  std::vector<std::unique_ptr<Clone>> owned;
  std::vector<std::vector<Clone*>> by_model(models);
  for (int m = 0; m < models; ++m) {
    const Op op{"gemm", size_of(m), 0};
    for (int k = 0; k < instances; ++k) {
      owned.push_back(open_job(mnt, op, ""));
      owned.back()->run_and_wait("begin\n" + op.body() + op.body() + op.body() + op.body() +
                                 "end x3\n");
      by_model[m].push_back(owned.back().get());
    }
  }
  // Baseline: one instance of each model alone, same arrival process.
  std::vector<double> alone_mean(models);
  std::vector<double> alone_all;
  for (int m = 0; m < models; ++m) {
    const auto l = serve(mnt, {by_model[m][0]}, rate * 4, std::min(seconds, 3.0), 7 + m);
    alone_mean[m] = mean(l);
    alone_all.insert(alone_all.end(), l.begin(), l.end());
  }
  std::vector<Clone*> everyone;
  for (auto& c : owned) everyone.push_back(c.get());
  const auto shared = serve(mnt, everyone, rate, seconds, 1000);
  std::vector<std::string> lanes;
  for (auto& c : owned) lanes.push_back(field(c->status(), "lane"));
  std::sort(lanes.begin(), lanes.end());
  const auto distinct = std::unique(lanes.begin(), lanes.end()) - lanes.begin();
  fmt::print(
      "inference sessions={} ({} models x {}) lanes={} policy={} rate={}/s per session "
      "seconds={}\n",
      models * instances, models, instances, distinct, policy, rate, seconds);
  fmt::print(
      "  alone (each model by itself)  requests {}  mean {:.3f} ms  p50 {:.3f}  p95 {:.3f}\n",
      alone_all.size(), mean(alone_all), percentile(alone_all, 0.5), percentile(alone_all, 0.95));
  fmt::print(
      "  {} sessions on one GPU       requests {}  mean {:.3f} ms  p50 {:.3f}  p95 {:.3f}  "
      "p99 {:.3f}\n",
      models * instances, shared.size(), mean(shared), percentile(shared, 0.5),
      percentile(shared, 0.95), percentile(shared, 0.99));
  fmt::print("  mean latency overhead {:.3f} ms (paper: < 5 ms with 42 models on 1 GPU)\n",
             mean(shared) - mean(alone_all));
  return 0;
}

// ---- fixed-length job ----
// One "training job" for `seconds`: back-to-back iterations of `op`, either as a
// native Driver-API process or as a salusd session. Run two at once to compare
// time-slicing, MPS and salusd (paper Figure 15).
int bench_job(Target& t, const std::string& op_text, double seconds, bool native) {
  const Op op = parse_op(op_text);
  long done = 0;
  double elapsed = 0;
  if (native) {
#if SALUS_HAVE_CUDA
    std::string why;
    NativeSpec spec{op.kind, op.size, op.usec, 0};
    NativeResult r;
    if (!native_timed_loop(spec, seconds, r, why)) die("native loop: " + why);
    done = r.iterations;
    elapsed = r.seconds;
#else
    die("--native needs a build with the cuda backend");
#endif
  } else {
    if (t.mount.empty()) die("gpu-job --salusd-session needs --mount (a running salusd)");
    const std::string& mnt = t.start({});
    auto c = open_job(mnt, op, "");
    c->run_and_wait("begin\n" + op.body() + "end x3\n");
    const auto t0 = Clock::now();
    write_all(c->fd, "run 1000000\n");
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    done = std::stol(field(c->status(), "iterations_done")) - 3;
    elapsed = us_since(t0) / 1e6;
  }
  fmt::print("job op={} mode={} seconds={:.2f} iterations={} rate={:.2f} it/s\n", op.label(),
             native ? "native" : "salusd", elapsed, done, static_cast<double>(done) / elapsed);
  return 0;
}

}  // namespace

void add_gpu_benches(CLI::App& app, Registry& r) {
  auto* ov = app.add_subcommand("gpu-overhead",
                                "salusd `run N` against a native Driver-API loop (cuda backend)");
  auto ops =
      std::make_shared<std::vector<std::string>>(std::vector<std::string>{"gemm4096", "spin5000"});
  auto ov_n = std::make_shared<long>(1000);
  ov->add_option("--ops", *ops, "Iterations to compare, e.g. gemm4096 spin5000");
  ov->add_option("-n", *ov_n, "Iterations of each");
  r.add(ov, [=](Target& t) { return bench_overhead(t, *ops, *ov_n); });

  auto* sg = app.add_subcommand(
      "gpu-switch-gap", "Device-timestamped idle gap when two sessions alternate in one lane");
  auto kernels = std::make_shared<std::string>(SALUS_BENCH_KERNELS_DEFAULT);
  auto sg_n = std::make_shared<long>(2000);
  auto sg_spin = std::make_shared<std::uint64_t>(1000);
  auto sg_extra = std::make_shared<std::vector<std::string>>();
  sg->add_option("--kernels", *kernels, "PTX of bench_kernels.cu");
  sg->add_option("-n", *sg_n, "Iterations per session");
  sg->add_option("--spin-us", *sg_spin, "Iteration length");
  sg->add_option("--salusd-arg", *sg_extra, "Extra salusd flags, e.g. --pipeline-depth=1");
  r.add(sg, [=](Target& t) { return bench_switch_gap(t, *kernels, *sg_n, *sg_spin, *sg_extra); });

  auto* pk = app.add_subcommand("gpu-pack", "Small gemm jobs: FIFO one at a time vs PACK lanes");
  auto pk_sessions = std::make_shared<int>(8);
  auto pk_size = std::make_shared<std::uint32_t>(512);
  auto pk_n = std::make_shared<long>(2000);
  pk->add_option("--sessions", *pk_sessions, "Jobs");
  pk->add_option("--size", *pk_size, "gemm edge");
  pk->add_option("-n", *pk_n, "Iterations per job");
  r.add(pk, [=](Target& t) { return bench_pack(t, *pk_sessions, *pk_size, *pk_n); });

  auto* inf = app.add_subcommand("gpu-inference", "Request latency of many inference sessions");
  auto models = std::make_shared<int>(14);
  auto instances = std::make_shared<int>(3);
  auto rate = std::make_shared<double>(5.0);
  auto secs = std::make_shared<double>(20.0);
  auto inf_policy = std::make_shared<std::string>("pack");
  inf->add_option("--models", *models, "Distinct request sizes");
  inf->add_option("--instances", *instances, "Sessions per model");
  inf->add_option("--rate", *rate, "Requests per second per session (Poisson)");
  inf->add_option("--seconds", *secs, "Length of the shared run");
  inf->add_option("--policy", *inf_policy, "Scheduling policy");
  r.add(inf, [=](Target& t) {
    return bench_inference(t, *models, *instances, *rate, *secs, *inf_policy);
  });

  auto* job =
      app.add_subcommand("gpu-job", "One fixed-length training-like job (native or salusd)");
  auto job_op = std::make_shared<std::string>("gemm2048");
  auto job_secs = std::make_shared<double>(20.0);
  auto job_native = std::make_shared<bool>(false);
  job->add_option("--op", *job_op, "gemmN or spinUSEC");
  job->add_option("--seconds", *job_secs, "How long to run");
  job->add_flag("--native", *job_native, "A native Driver-API process instead of a session");
  r.add(job, [=](Target& t) { return bench_job(t, *job_op, *job_secs, *job_native); });
}

}  // namespace salus::bench
