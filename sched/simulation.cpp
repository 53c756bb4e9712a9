#include "sched/simulation.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <stdexcept>
#include <string_view>
#include <unordered_map>

#include "arena/admission_queue.hpp"
#include "sched/contention_model.hpp"
#include "sched/gpu_scheduler.hpp"
#include "sched/owner_placements.hpp"

namespace salus::sched {

using arena::Bytes;
using arena::LaneId;
using arena::SessionId;
using arena::TimeNs;
using KernelId = ContentionModel::KernelId;

std::string_view to_string(LaneModel m) {
  switch (m) {
    case LaneModel::automatic:
      return "auto";
    case LaneModel::exclusive:
      return "exclusive";
    case LaneModel::algorithm1:
      return "algorithm1";
    case LaneModel::shared:
      return "shared";
  }
  return "unknown";
}

std::optional<LaneModel> lane_model_from_string(std::string_view name) {
  for (LaneModel m :
       {LaneModel::automatic, LaneModel::exclusive, LaneModel::algorithm1, LaneModel::shared})
    if (to_string(m) == name) return m;
  return std::nullopt;
}

LaneModel resolve_lanes(PolicyKind policy, LaneModel requested) {
  if (requested != LaneModel::automatic) return requested;
  // The paper's FIFO is TensorFlow without Salus: one job owns the GPU. Its PACK opens as
  // many lanes as fit; its SRTF and FAIR (and so our PRIORITY) time-share one lane
  // (section 5.1.2, and Table 2, where their makespans match FIFO's).
  switch (policy) {
    case PolicyKind::fifo:
      return LaneModel::exclusive;
    case PolicyKind::pack:
      return LaneModel::algorithm1;
    case PolicyKind::srtf:
    case PolicyKind::fair:
    case PolicyKind::priority:
      return LaneModel::shared;
  }
  return LaneModel::algorithm1;
}

namespace {

constexpr double kMiB = 1048576.0;
// Jobs longer than this (alone) would push the nanosecond clock toward overflow once
// stretched by contention and queueing.
constexpr double kMaxJobNs = 1e17;
// Below 2^63 ns with room for the events that round up past a kernel's end.
constexpr double kMaxClockNs = 9e18;
// A run that alternates sessions keeps one piece per turn; this bounds its memory.
constexpr std::uint64_t kMaxRunIterations = std::uint64_t{1} << 20;

struct Job {
  const TraceJob* spec = nullptr;
  std::size_t index = 0;
  SessionId id = 0;
  TimeNs arrival = 0;
  TimeNs iter_ns = 1;
  Bytes persistent = 0;
  Bytes ephemeral = 0;
  arena::Need declared;  // what the arena is told (see LaneModel::shared)
  double util = 1.0;
  std::uint32_t owner = 0;  // the trace's user, numbered in order of first appearance
  std::uint64_t done = 0;
  std::uint32_t gpu = 0;
  std::optional<LaneId> lane;
  TimeNs admit = -1;
  TimeNs start = -1;
  TimeNs finish = -1;
  std::int64_t device_ns = 0;
  double work = 0.0;  // alone-equivalent ns done so far
  // Scratch for forecast_turns(): iterations planned for it in the run being planned,
  // and its virtual time at the end of its latest turn there.
  std::uint64_t forecast = 0;
  std::int64_t forecast_vt = 0;
  std::uint64_t left() const { return spec->iters - done; }
};

// A stretch of one rate in a run: from `t` on, progress grows by `rate` per ns.
struct Segment {
  TimeNs t;
  double progress;
  double rate;
};

// Back-to-back iterations of one session inside a run.
struct Piece {
  SessionId session;
  std::uint64_t count;
  TimeNs iter_ns;
};

// One session's iterations in a FAIR run of several sessions (Engine::forecast_merged):
// its n-th iteration there (from 0) is picked at virtual time v + n d.
struct Turner {
  SessionId id = 0;
  std::int64_t v = 0;       // virtual time at its first pick in the run
  std::int64_t d = 1;       // what one iteration adds to it: the measured device time
  TimeNs iter = 1;          // lane time of one iteration (alone on the GPU)
  std::uint64_t tie = 0;    // the scheduler's tie-break among equal virtual times
  std::uint64_t limit = 0;  // iterations the job has left
  std::uint64_t count = 0;  // iterations in the run
  RankKey key;              // its entry in LaneState::waiting (all but the first)
};

// An iteration of such a run, in the scheduler's pick order.
struct Elem {
  std::int64_t key;
  std::uint64_t tie;
  friend bool operator<(const Elem& a, const Elem& b) {
    return a.key != b.key ? a.key < b.key : a.tie < b.tie;
  }
};

// One kernel in the contention model standing for `planned` consecutive iterations of a
// lane: of one session, or, under FAIR on an otherwise idle GPU, of several in turn.
struct Run {
  std::vector<Piece> pieces;  // in order; the last one's session runs at the end
  // Waiting entries (original keys) of sessions that take a turn inside the run; they
  // are re-keyed when it ends.
  std::vector<std::pair<RankKey, SessionId>> stale;
  std::uint64_t planned = 1;
  double alone = 0.0;  // alone-equivalent ns of all planned iterations
  KernelId kernel = 0;
  TimeNs t0 = 0;
  // A mirror of the kernel's progress (alone-equivalent ns) so that the iteration
  // boundaries inside a coalesced run can be placed exactly when it is replayed.
  TimeNs t_last = 0;
  double progress = 0.0;
  std::vector<Segment> segments;
  bool predicted = false;  // its length relies on a forecast at the current rate
  bool mixed = false;      // the kernel spans turns of sessions with different utils
  // FAIR turns in closed form instead of `pieces`: `turners[0]` was dispatched at t0,
  // `turners[last]` runs the run's last iteration. O(sessions), whatever the turns.
  bool merged = false;
  std::vector<Turner> turners;
  std::size_t last = 0;
};

struct LaneState {
  std::vector<SessionId> members;   // admitted, in admission order
  std::vector<SessionId> deferred;  // admitted while busy: runnable from its next boundary
  // Runnable members other than the running one, by their scheduler key: the rivals a
  // run is forecast against. A waiting session's key does not change until it runs.
  std::set<std::pair<RankKey, SessionId>> waiting;
  bool busy = false;
  Run run;  // valid while busy; kept between runs so its buffers are reused
};

struct Gpu {
  Gpu(Bytes capacity, PolicyKind policy, arena::ArenaOptions options)
      : sched(capacity, policy, options) {}
  GpuScheduler sched;
  ContentionModel model;
  std::map<LaneId, LaneState> lanes;  // ordered: dispatch visits lanes by id
  std::uint64_t epoch = 0;
  bool touched = false;
  // Oversubscription: the swaps on the GPU's swap stream, in order. Like salusd's copies,
  // they run one after another beside the lanes' kernels: a session swapping in is not
  // picked until its copy ends, and a swap-out frees its room only then.
  struct Swap {
    SessionId id;
    Bytes bytes;
    TimeNs ns;   // the copy's own time, bytes / bandwidth
    TimeNs end;  // when it lands: after the swaps queued before it
    bool out;
  };
  std::deque<Swap> swaps;
  // Since when nothing has run or swapped while sessions wait (-1: not idle so).
  TimeNs idle_since = -1;
  bool quiet = true;  // no lane waits to move or for room: boundaries change nothing
  // Placement bookkeeping.
  std::int64_t waiting_bytes = 0;  // declared P + E of jobs placed here, not admitted
  double placed_util = 0.0;
  std::uint32_t placed_jobs = 0;
};

struct HeapEntry {
  TimeNs t;
  std::uint32_t gpu;
  std::uint64_t epoch;
  bool operator>(const HeapEntry& o) const { return t != o.t ? t > o.t : gpu > o.gpu; }
};

using Keyed = std::pair<RankKey, SessionId>;

// Iterations of `s` picked before `e` (strictly, or `e` included), within its limit.
std::uint64_t count_before(const Turner& s, Elem e, bool inclusive) {
  if (e.key < s.v) return 0;
  const std::int64_t off = e.key - s.v;
  const std::int64_t q = off / s.d;  // one division: this is the walk's inner loop
  auto n = static_cast<std::uint64_t>(q);
  if (off != q * s.d) {
    ++n;  // keys below e.key: q + 1
  } else if (inclusive ? s.tie <= e.tie : s.tie < e.tie) {
    ++n;  // and the one at e.key comes first
  }
  return std::min(n, s.limit);
}

// Lane time of the run's iterations up to and including `e`.
std::int64_t elapsed_upto(const std::vector<Turner>& ts, Elem e) {
  std::int64_t sum = 0;
  for (const Turner& s : ts) sum += static_cast<std::int64_t>(count_before(s, e, true)) * s.iter;
  return sum;
}

// The first iteration, in pick order and at or before `bound`, whose end is at least
// `target` into the run (`bound` if none is): a search over virtual time, O(sessions) a
// step.
Elem first_reaching(const std::vector<Turner>& ts, std::int64_t target, Elem bound) {
  target = std::max<std::int64_t>(target, 1);
  if (elapsed_upto(ts, bound) < target) return bound;
  const auto at = [&](std::int64_t key) {
    return elapsed_upto(ts, std::min(Elem{key, std::numeric_limits<std::uint64_t>::max()}, bound));
  };
  std::int64_t lo = ts.front().v - 1, hi = bound.key;  // at(lo) < target <= at(hi)
  for (const Turner& s : ts) lo = std::min(lo, s.v - 1);
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    (at(mid) >= target ? hi : lo) = mid;
  }
  // The iterations picked at virtual time `hi`, by tie-break, until the target is reached.
  std::int64_t sum = at(hi - 1);
  Elem best = bound;
  std::vector<std::pair<std::uint64_t, TimeNs>> here;
  for (const Turner& s : ts) {
    if (hi < s.v || (hi - s.v) % s.d != 0) continue;
    if (static_cast<std::uint64_t>((hi - s.v) / s.d) >= s.limit) continue;
    if (bound < Elem{hi, s.tie}) continue;
    here.emplace_back(s.tie, s.iter);
  }
  std::sort(here.begin(), here.end());
  for (const auto& [tie, iter] : here) {
    sum += iter;
    if (sum >= target) {
      best = Elem{hi, tie};
      break;
    }
  }
  return best;
}

// Sets each session's count to its iterations up to `e`, the run's last; returns its index.
std::size_t take_prefix(std::vector<Turner>& ts, Elem e) {
  std::size_t last = 0;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    ts[i].count = count_before(ts[i], e, true);
    if (ts[i].tie == e.tie) last = i;
  }
  return last;
}

// Decisions inside the run that changed session. The session with the shortest iterations
// (`m`) is not walked: its iterations between two others' are counted. Every other
// session's iteration is at least as long, so between two of its iterations in a row at
// least one of m's comes, once m has started and until m is done: a turn of such a session
// (its iterations up to the next other session's) is settled in O(1), and a run costs
// O(turns of the other sessions), nothing for a lane of two.
std::uint64_t count_switches(const std::vector<Turner>& ts) {
  std::size_t m = ts.size();
  for (std::size_t i = 0; i < ts.size(); ++i)
    if (ts[i].count > 0 &&
        (m == ts.size() || ts[i].d < ts[m].d || (ts[i].d == ts[m].d && ts[i].count > ts[m].count)))
      m = i;
  Turner bm = ts[m];
  bm.limit = bm.count;
  const Elem m_first{bm.v, bm.tie};
  const Elem m_last{bm.v + static_cast<std::int64_t>(bm.count - 1) * bm.d, bm.tie};
  // m's iterations picked before e.
  const auto before = [&](Elem e) { return count_before(bm, e, false); };
  const auto elem = [&](const Turner& s, std::uint64_t n) {
    return Elem{s.v + static_cast<std::int64_t>(n) * s.d, s.tie};
  };
  using Next = std::pair<Elem, std::size_t>;  // a session's next iteration
  std::vector<Next> heap;
  std::vector<std::uint64_t> n(ts.size(), 0);
  const auto later = [](const Next& a, const Next& b) { return b.first < a.first; };
  // Per session, the iterations n that have one of m's between n and n + 1 (when n + 1
  // follows in a row) are [from, to): m has begun before n + 1 and not ended before n.
  std::vector<std::uint64_t> from(ts.size(), 0), to(ts.size(), 0);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    if (i == m || ts[i].count == 0) continue;
    heap.push_back({elem(ts[i], 0), i});
    const std::uint64_t n0 = count_before(ts[i], m_first, false);
    from[i] = n0 > 0 ? n0 - 1 : 0;
    to[i] = count_before(ts[i], m_last, false);
  }
  std::make_heap(heap.begin(), heap.end(), later);
  // The root replaced in place: one sift per turn instead of a pop and a push.
  const auto sift_down = [&]() {
    const std::size_t size = heap.size();
    std::size_t at = 0;
    const Next x = heap[0];
    for (;;) {
      std::size_t c = 2 * at + 1;
      if (c >= size) break;
      if (c + 1 < size && heap[c + 1].first < heap[c].first) ++c;
      if (!(heap[c].first < x.first)) break;
      heap[at] = heap[c];
      at = c;
    }
    heap[at] = x;
  };
  std::uint64_t switches = 0, prev_g = 0;
  std::size_t prev = ts.size();
  while (!heap.empty()) {
    const std::size_t i = heap.front().second;
    const Turner& s = ts[i];
    // Its iterations a..b-1 come in a row, up to the next other session's (the smaller
    // child of the root).
    const std::uint64_t a = n[i];
    std::uint64_t b = s.count;
    if (heap.size() > 1) {
      const Elem next =
          heap.size() > 2 && heap[2].first < heap[1].first ? heap[2].first : heap[1].first;
      b = std::min(b, count_before(s, next, false));
    }
    b = std::max(b, a + 1);
    const std::uint64_t g = before(elem(s, a));
    if (prev == ts.size()) {
      switches += g > 0 ? 1 : 0;  // m's iterations, then this one
    } else if (g > prev_g) {
      switches += 2;  // prev, m's iterations, this one
    } else if (prev != i) {
      switches += 1;
    }
    // Within the turn, iterations n and n + 1 have m's between them (two switches) iff m
    // has one before n + 1 and one after n: n in [n0 - 1, n1).
    const std::uint64_t lo = std::max(a, from[i]), hi = std::min(b - 1, to[i]);
    if (hi > lo) switches += 2 * (hi - lo);
    prev = i;
    prev_g = before(elem(s, b - 1));
    n[i] = b;
    if (b < s.count) {
      heap[0].first = elem(s, b);
    } else {
      heap[0] = heap.back();
      heap.pop_back();
      if (heap.empty()) break;
    }
    sift_down();
  }
  if (prev != ts.size() && bm.count > prev_g) ++switches;  // m's iterations after the last
  return switches;
}

class Engine {
 public:
  Engine(const std::vector<TraceJob>& trace, const SimConfig& cfg) : cfg_(cfg) {
    if (cfg_.gpus == 0) throw SimError("at least one GPU is needed");
    if (cfg_.iteration_overhead_ns < 0 ||
        static_cast<double>(cfg_.iteration_overhead_ns) > kMaxJobNs)
      throw SimError("the iteration overhead must be between 0 and 1e17 ns");
    lanes_ = resolve_lanes(cfg_.policy, cfg_.lanes);
    // One job per GPU needs a cluster-wide queue (a GPU takes the next job when it empties),
    // and exclusive placement gives one job per GPU whatever the lane model.
    if (lanes_ == LaneModel::exclusive) cfg_.placement = Placement::exclusive;
    if (cfg_.placement == Placement::exclusive) lanes_ = LaneModel::exclusive;
    // Exclusive: jobs take idle GPUs in arrival order (the host-wide queue strictly FIFO).
    if (cfg_.placement == Placement::exclusive)
      host_options_.queue_mode = arena::QueueMode::strict_fifo;
    arena::ArenaOptions opts;  // salusd's defaults: bounded bypass, Algorithm 1
    if (lanes_ == LaneModel::exclusive) {
      // Alone on its GPU, a job gets its own lane; keep admission strictly ordered.
      opts.queue_mode = arena::QueueMode::strict_fifo;
      opts.lane_mode = arena::LaneMode::lane_per_session;
    }
    if (!(cfg_.oversubscribe >= 1.0 && cfg_.oversubscribe <= 16.0))
      throw SimError("oversubscribe must be a number from 1 to 16");
    if (!(cfg_.swap_gbps > 0.0)) throw SimError("the swap bandwidth must be positive");
    opts.oversubscribe = cfg_.oversubscribe;
    // A coalesced run assumes no decision changes before the next event, but a resident
    // session's quantum runs out at no event: simulate iteration by iteration.
    if (cfg_.oversubscribe > 1.0) cfg_.coalesce = false;
    gpus_.reserve(cfg_.gpus);
    for (std::uint32_t g = 0; g < cfg_.gpus; ++g) {
      gpus_.emplace_back(cfg_.gpu_memory, cfg_.policy, opts);
      gpus_.back().sched.residency().cost().bytes_per_s = cfg_.swap_gbps * 1e9;
    }
    views_.resize(cfg_.gpus);
    if (cfg_.risk.enabled) {
      if (!(cfg_.risk.window_s >= 1 && cfg_.risk.window_s <= 3600))
        throw SimError("the risk window must be between 1 and 3600 s");
      const auto keep = static_cast<TimeNs>(std::llround((cfg_.risk.window_s + 1) * 1e9));
      for (Gpu& gpu : gpus_) gpu.model.track_activity(keep);
    }
    usable_ = cfg_.gpu_memory & ~(arena::kAlignment - 1);
    load(trace);
    share_by_owner();
  }

  SimResult run();

 private:
  void load(const std::vector<TraceJob>& trace);
  void share_by_owner();
  double host_key(const Job& j, std::uint64_t arrival) const;
  void rekey_host_queue();
  void fill_views(TimeNs t);
  PlacementOptions placement_options() const { return {cfg_.placement, cfg_.risk}; }
  void place_host(TimeNs t);
  double runs_below(const Gpu& gpu) const;
  void submit(std::uint32_t g, Job& j, TimeNs t);
  void handle_admissions(std::uint32_t g, TimeNs t);
  void check_quiet(Gpu& gpu, TimeNs t);
  void make_runnable(Gpu& gpu, LaneState& ls, SessionId id);
  void resort_waiting(Gpu& gpu, LaneState& ls);
  void fold(Gpu& gpu, TimeNs t);
  void cut(Gpu& gpu, LaneState& ls, TimeNs t);
  void cut_all(Gpu& gpu, TimeNs t);
  void complete(std::uint32_t g, TimeNs t);
  void replay(Gpu& gpu, LaneId lane, const Run& r, TimeNs end);
  void boundary(std::uint32_t g, LaneId lane, TimeNs t);
  void depart(std::uint32_t g, SessionId id, TimeNs t);
  void plan(Gpu& gpu, LaneState& ls);
  std::uint64_t forecast_one(Gpu& gpu, const LaneState& ls, const Job& j, TimeNs t0);
  void forecast_turns(Gpu& gpu, LaneState& ls);
  bool forecast_merged(Gpu& gpu, LaneState& ls);
  void cut_merged(Gpu& gpu, LaneState& ls, TimeNs t);
  void replay_merged(Gpu& gpu, LaneId lane, const Run& r, TimeNs end);
  // When the next job arrives: the earliest event that may cut a run. Forecasting past
  // it is mostly wasted, since the run is then cut and forecast again.
  TimeNs horizon() const {
    return pos_ < order_.size() ? jobs_[order_[pos_]].arrival : std::numeric_limits<TimeNs>::max();
  }
  void dispatch(std::uint32_t g, TimeNs t);
  // Oversubscription: lands the swaps that ended, queues the ones the planner asks for.
  void drive_swaps(std::uint32_t g, TimeNs t);
  void land_swaps(Gpu& gpu, TimeNs t);
  void queue_swap(Gpu& gpu, SessionId id, Bytes bytes, bool out, TimeNs t);
  void check_not_stalled(std::uint32_t g, TimeNs t);
  void close_instant(std::uint32_t g, TimeNs t);
  void record_work(const Job& j, TimeNs t, double work);
  Job& job_of(SessionId id) { return jobs_[id - 1]; }
  // What salusd measures for an iteration that took `span` of lane time: the device's
  // part, without the broker's overhead at the boundary.
  TimeNs device_time(TimeNs span) const {
    const TimeNs o = cfg_.iteration_overhead_ns;
    return o > 0 ? std::max<TimeNs>(1, span - o) : span;
  }

  SimConfig cfg_;
  LaneModel lanes_;
  double total_alone_ = 0;  // alone-equivalent ns of the whole trace
  double work_done_ = 0;    // alone-equivalent ns credited so far
  std::size_t jobs_done_ = 0;
  void report(TimeNs t) {
    cfg_.progress(
        SimProgress{t, work_done_, total_alone_, jobs_done_, jobs_.size(), counters_.events});
  }
  Bytes usable_ = 0;
  std::vector<Job> jobs_;
  std::vector<Gpu> gpus_;
  std::vector<std::size_t> order_;  // jobs by arrival
  std::size_t pos_ = 0;             // next in order_ to arrive
  // Late binding (issue 19 item 8): every other placement keeps jobs in one host-wide
  // queue, in the policy's order with the arena's bypass bound, and places a job on a
  // GPU only once one admits it at once. Keyed by job id; arrival = position in order_.
  arena::AdmissionQueue host_queue_;
  arena::ArenaOptions host_options_;
  // FAIR by owner: the host-wide queue's order (salusd's rule), re-keyed when stale.
  bool by_owner_ = false;
  std::uint32_t owners_ = 0;  // distinct users in the trace
  OwnerPlacements owner_placements_;
  bool host_keys_stale_ = false;
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, std::greater<>> heap_;
  std::vector<LaneId> started_;  // scratch for dispatch()
  // Jobs whose last iteration ended this instant; they leave after its decisions.
  std::vector<std::pair<std::uint32_t, SessionId>> leaving_;
  std::vector<Keyed> turns_;  // scratch heap for forecast_turns()
  std::size_t rr_next_ = 0;
  std::vector<GpuView> views_;   // scratch for place_host()
  std::vector<double> samples_;  // scratch for the risk filter
  SimCounters counters_;
  std::vector<WorkTimeline> work_;
};

void Engine::load(const std::vector<TraceJob>& trace) {
  jobs_.resize(trace.size());
  long double total_alone = 0;
  TimeNs last_arrival = 0;
  const Bytes half = arena::align_up(usable_ / 2 + 1);
  std::unordered_map<std::string_view, std::uint32_t> users;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceJob& t = trace[i];
    Job& j = jobs_[i];
    j.spec = &t;
    j.index = i;
    j.id = static_cast<SessionId>(i + 1);
    j.owner = users.emplace(t.user, static_cast<std::uint32_t>(users.size())).first->second;
    const std::string where =
        t.line ? fmt::format("line {}: job {}", t.line, t.name) : fmt::format("job {}", t.name);
    if (t.persistent_mb * kMiB > 1e18 || t.ephemeral_mb * kMiB > 1e18)
      throw SimError(fmt::format("{}: memory need is absurdly large", where));
    j.persistent = static_cast<Bytes>(std::llround(t.persistent_mb * kMiB));
    j.ephemeral = static_cast<Bytes>(std::llround(t.ephemeral_mb * kMiB));
    j.iter_ns = std::max<TimeNs>(1, std::llround(t.iter_ms * 1e6)) + cfg_.iteration_overhead_ns;
    if (!(t.arrival_s >= 0 && t.arrival_s <= 1e9))
      throw SimError(fmt::format("{}: arrival {} s is outside [0, 1e9]", where, t.arrival_s));
    j.arrival = t.arrival_ns >= 0 ? t.arrival_ns : std::llround(t.arrival_s * 1e9);
    j.util = t.util;
    const long double alone = static_cast<long double>(t.iters) * j.iter_ns;
    if (alone > kMaxJobNs)
      throw SimError(fmt::format("{}: {} iterations of {} ms are too long to simulate", where,
                                 t.iters, t.iter_ms));
    total_alone += alone;
    last_arrival = std::max(last_arrival, j.arrival);
    // The arena's own too_large test, so that no job can stall the simulation.
    const Bytes p = arena::align_up(j.persistent), e = arena::align_up(j.ephemeral);
    if (p > usable_ || e > usable_ - p)
      throw SimError(fmt::format("{}: needs {} persistent + {} ephemeral, more than a GPU's {}",
                                 where, arena::format_size(j.persistent),
                                 arena::format_size(j.ephemeral),
                                 arena::format_size(cfg_.gpu_memory)));
    j.declared = {j.persistent, j.ephemeral};
    if (lanes_ == LaneModel::shared) {
      // Algorithm 1 opens a new lane whenever P + E fits the free memory. Declaring an
      // ephemeral need above half the GPU makes that impossible once one lane exists, so
      // every later job joins (step 2) or grows (step 3) the one lane, admitted by the
      // safety condition. The lane is at least half the GPU as a result; see the docs.
      j.declared.ephemeral = std::max(j.ephemeral, std::min(half, usable_ - p));
    }
  }
  // While any job waits, some kernel runs and does at least one alone-nanosecond of work
  // per nanosecond, so every job ends by the last arrival plus all the work; twice the
  // work covers the nanosecond rounding of each kernel. Each job alone may be in range
  // while their sum runs the 64-bit clock past 2^63 ns (292 years).
  if (static_cast<long double>(last_arrival) + 2 * total_alone > kMaxClockNs)
    throw SimError(fmt::format(
        "the trace's jobs add up to {:.3g} s of GPU time alone; with the last arrival at {:.3g} "
        "s that could run the simulator's nanosecond clock past {:.3g} s (2^63 ns). Split the "
        "trace or shorten its jobs",
        static_cast<double>(total_alone / 1e9), static_cast<double>(last_arrival) / 1e9,
        kMaxClockNs / 1e9));
  total_alone_ = static_cast<double>(total_alone);
  owners_ = static_cast<std::uint32_t>(users.size());
  order_.resize(jobs_.size());
  for (std::size_t i = 0; i < order_.size(); ++i) order_[i] = i;
  std::stable_sort(order_.begin(), order_.end(), [this](std::size_t a, std::size_t b) {
    return jobs_[a].arrival < jobs_[b].arrival;
  });
  if (cfg_.track_work) work_.resize(jobs_.size());
}

// FAIR by owner, salusd's default: a lane is shared per user (GpuScheduler::fair_factor)
// and the host-wide queue places the user with the fewest jobs placed first. With two
// users or more an iteration's charge depends on who else is runnable, which the closed
// forms of coalesced runs do not model: those traces are simulated iteration by iteration.
void Engine::share_by_owner() {
  if (!by_owner(cfg_.fair_share)) return;
  for (Gpu& gpu : gpus_) gpu.sched.set_fair_share(cfg_.fair_share);
  by_owner_ = cfg_.policy == PolicyKind::fair && cfg_.placement != Placement::exclusive;
  if (cfg_.policy == PolicyKind::fair && owners_ >= 2) cfg_.coalesce = false;
}

// A job's key in the host-wide queue (sched::host_queue_key, salusd's too).
double Engine::host_key(const Job& j, std::uint64_t arrival) const {
  RankInputs in;
  in.arrival = arrival;
  in.priority = j.spec->priority;
  in.iters = j.spec->iters;
  return host_queue_key(cfg_.policy, cfg_.placement == Placement::exclusive,
                        by_owner_ ? &owner_placements_ : nullptr, j.owner, in);
}

void Engine::rekey_host_queue() {
  host_keys_stale_ = false;
  std::vector<std::pair<SessionId, std::uint64_t>> waiting;
  host_queue_.for_each(
      [&](const arena::QueuedRequest& q) { waiting.emplace_back(q.session, q.arrival); });
  for (const auto& [id, arrival] : waiting) host_queue_.set_key(id, host_key(job_of(id), arrival));
}

// ---------------------------------------------------------------- placement

// This instant's view of each GPU for the shared placement rule (sched/placement.hpp):
// the arena's free memory less what waits there, the summed util of the jobs placed
// there (lug), and, with the risk filter, CARMA's score of the compute activity the
// contention model recorded over the window, one sample a second.
void Engine::fill_views(TimeNs t) {
  // rr and exclusive ignore the filter (placement.hpp): no need to score.
  const bool risk =
      cfg_.risk.enabled && (cfg_.placement == Placement::magm || cfg_.placement == Placement::lug);
  const auto window = static_cast<std::size_t>(std::max(1.0, std::round(cfg_.risk.window_s)));
  for (std::uint32_t g = 0; g < cfg_.gpus; ++g) {
    const Gpu& gpu = gpus_[g];
    GpuView& v = views_[g];
    v.capacity = usable_;
    v.available = static_cast<std::int64_t>(gpu.sched.arena().memory().free) - gpu.waiting_bytes;
    v.load = gpu.placed_util;
    v.placed = gpu.placed_jobs;
    v.eligible = true;
    v.sm_activity.reset();
    if (risk && gpu.model.activity()) {
      gpu.model.activity()->samples(t, 1'000'000'000, window, samples_);
      v.sm_activity = risk_score(samples_);
    }
  }
}

// One pass over the host-wide queue, as the arena passes over its own: in the policy's
// order, each job that some GPU admits now goes to the one placement picks among those.
void Engine::place_host(TimeNs t) {
  if (host_queue_.empty()) return;
  if (host_keys_stale_) rekey_host_queue();
  auto bounds = [this] {
    arena::AdmissionBounds b{0, 0, -std::numeric_limits<double>::infinity()};
    for (const Gpu& gpu : gpus_) {
      const arena::AdmissionBounds g = gpu.sched.arena().admission_bounds();
      b.room = std::max(b.room, g.room);
      b.total = std::max(b.total, g.total);
      b.key_below = std::max(b.key_below, runs_below(gpu));
    }
    return b;
  };
  auto admits = [this](const arena::QueuedRequest& q, std::uint32_t g) {
    return q.key < runs_below(gpus_[g]) &&
           gpus_[g].sched.arena().would_admit(job_of(q.session).declared);
  };
  auto place = [&](const arena::QueuedRequest& q, std::uint32_t g, const PlacementChoice& c) {
    if (c.risky) ++counters_.risky_skips;
    owner_placements_.waiting(job_of(q.session).owner, -1);
    submit(g, job_of(q.session), t);
  };
  sched::bind_late(
      host_queue_, host_options_.queue_mode, host_options_.max_bypass, bounds,
      std::span<GpuView>(views_), placement_options(), rr_next_,
      [&](std::span<GpuView>) { fill_views(t); }, admits, place);
}

// Under SRTF and PRIORITY one job of a shared lane runs at a time: a job placed on a GPU
// where another ranks first would only wait there, bound to it while another GPU may
// go idle first. So it is placed only where it runs at once (the GPU is empty, or it
// ranks before every job there); otherwise it waits host-wide for the first GPU that
// frees up. FAIR runs every job of a lane in turn at once, and PACK's lanes run side by
// side: for them admission is enough. Returns the bound a job's admission key must be
// below to run on `gpu` at once (the same function ranks both); it also bounds the
// host-wide pass, which thus stops at the first job that runs nowhere.
double Engine::runs_below(const Gpu& gpu) const {
  constexpr double kAny = std::numeric_limits<double>::infinity();
  const PolicyKind p = gpu.sched.policy();
  if (lanes_ != LaneModel::shared || (p != PolicyKind::srtf && p != PolicyKind::priority))
    return kAny;
  // A job placed there that still waits for admission: nothing more goes there.
  if (gpu.waiting_bytes > 0) return -kAny;
  double below = kAny;
  for (const auto& [lane, ls] : gpu.lanes)
    for (SessionId id : ls.members)
      if (const SessionSched* s = gpu.sched.find(id))
        below = std::min(below, rank(p, s->in).primary);
  return below;
}

void Engine::submit(std::uint32_t g, Job& j, TimeNs t) {
  Gpu& gpu = gpus_[g];
  fold(gpu, t);
  const arena::ArenaError err =
      gpu.sched.arrive(j.id, j.declared, j.spec->priority, j.spec->iters, t, j.owner);
  if (err != arena::ArenaError::ok)
    throw SimError(
        fmt::format("job {}: admission request failed: {}", j.spec->name, arena::to_string(err)));
  j.gpu = g;
  owner_placements_.placed(j.owner, +1);
  host_keys_stale_ = host_keys_stale_ || (by_owner_ && !host_queue_.empty());
  gpu.waiting_bytes += static_cast<std::int64_t>(j.declared.persistent + j.declared.ephemeral);
  gpu.placed_util += j.util;
  ++gpu.placed_jobs;
  handle_admissions(g, t);
}

// ---------------------------------------------------------------- lanes and admission

void Engine::handle_admissions(std::uint32_t g, TimeNs t) {
  Gpu& gpu = gpus_[g];
  gpu.touched = true;
  const std::vector<arena::Admitted> admitted = gpu.sched.take_admissions();
  for (const arena::Admitted& a : admitted) {
    Job& j = job_of(a.session);
    j.lane = a.lane;
    j.admit = t;
    gpu.waiting_bytes -= static_cast<std::int64_t>(j.declared.persistent + j.declared.ephemeral);
    LaneState& ls = gpu.lanes[a.lane];
    ls.members.push_back(a.session);
    if (ls.busy) {
      // Decisions happen at iteration boundaries: the newcomer competes from the lane's
      // next one, which a coalesced run must therefore not skip.
      ls.deferred.push_back(a.session);
      cut(gpu, ls, t);
    } else {
      make_runnable(gpu, ls, a.session);
    }
  }
  counters_.max_lanes = std::max<std::uint64_t>(counters_.max_lanes, gpu.lanes.size());
  if (admitted.empty()) return;
  // FIFO lets only the lane of the GPU's oldest runnable session dispatch. A job that
  // arrived before the running one but waited for memory may be admitted to another lane
  // now, and then the running lane must stop at its next boundary.
  if (gpu.sched.policy() == PolicyKind::fifo) cut_all(gpu, t);
  check_quiet(gpu, t);
}

void Engine::check_quiet(Gpu& gpu, TimeNs t) {
  bool quiet = true;
  for (const arena::LaneView& v : gpu.sched.arena().lanes())
    if (!v.offset || v.move_pending) quiet = false;
  gpu.quiet = quiet;
  // Lanes that must slide or wait for room move only at iteration boundaries.
  if (!quiet) cut_all(gpu, t);
}

// FAIR by owner: the pick passed over sessions for their owners and moved them to
// the lane's clock (GpuScheduler::reranked_by_pick); their entries follow.
void Engine::resort_waiting(Gpu& gpu, LaneState& ls) {
  for (SessionId id : gpu.sched.reranked_by_pick()) {
    const auto it = std::find_if(ls.waiting.begin(), ls.waiting.end(),
                                 [id](const Keyed& k) { return k.second == id; });
    if (it == ls.waiting.end()) continue;
    ls.waiting.erase(it);
    ls.waiting.insert({gpu.sched.find(id)->key, id});
  }
}

void Engine::make_runnable(Gpu& gpu, LaneState& ls, SessionId id) {
  gpu.sched.set_runnable(id, true);
  ls.waiting.insert({gpu.sched.find(id)->key, id});
}

// ---------------------------------------------------------------- runs

void Engine::fold(Gpu& gpu, TimeNs t) {
  for (auto& [id, ls] : gpu.lanes) {
    if (!ls.busy || t <= ls.run.t_last) continue;
    Run& r = ls.run;
    r.progress += static_cast<double>(t - r.t_last) * r.segments.back().rate;
    r.t_last = t;
  }
}

// Shortens a coalesced run to end at its next iteration boundary.
void Engine::cut(Gpu& gpu, LaneState& ls, TimeNs t) {
  if (!ls.busy || ls.run.planned <= 1 || !gpu.model.running(ls.run.kernel)) return;
  fold(gpu, t);
  if (ls.run.merged) return cut_merged(gpu, ls, t);
  Run& r = ls.run;
  const double p = r.progress;
  // The first boundary not behind us, allowing a nanosecond for the rounding of kernel
  // times: which piece it falls in, how many iterations lead up to it, where it lies.
  double cum = 0.0;
  std::uint64_t m = 0;
  std::size_t k = 0;
  std::uint64_t within = 0;
  for (; k < r.pieces.size(); ++k) {
    const Piece& pc = r.pieces[k];
    const double iter = static_cast<double>(pc.iter_ns);
    const double len = static_cast<double>(pc.count) * iter;
    if (cum + len < p - 1.0 && k + 1 < r.pieces.size()) {
      cum += len;
      m += pc.count;
      continue;
    }
    within = static_cast<std::uint64_t>(std::max(1.0, std::ceil((p - 1.0 - cum) / iter)));
    within = std::min(within, pc.count);
    break;
  }
  m += within;
  // Nothing to shorten, unless the kernel carries another session's util into the turn
  // that is in progress.
  if (m >= r.planned && !r.mixed) return;
  const double boundary =
      cum + static_cast<double>(within) * static_cast<double>(r.pieces[k].iter_ns);
  r.pieces.resize(k + 1);
  r.pieces[k].count = within;
  // A boundary on this very instant ends the run now: per iteration, it would be an event
  // of this instant and would see whatever caused the cut. A zero-length kernel completes
  // in a second pass over the instant.
  const bool now = p > 0.5 && boundary <= p + 1.0;
  const TimeNs left = now ? 0 : std::max<TimeNs>(1, static_cast<TimeNs>(std::ceil(boundary - p)));
  gpu.model.cancel(r.kernel, t);
  r.kernel = gpu.model.start(t, job_of(r.pieces[k].session).util, left);
  r.planned = m;
  r.alone = boundary;
  r.predicted = false;
  r.mixed = false;  // what is left of the kernel belongs to one session
  ++counters_.kernels;
}

void Engine::cut_all(Gpu& gpu, TimeNs t) {
  for (auto& [id, ls] : gpu.lanes) cut(gpu, ls, t);
}

void Engine::complete(std::uint32_t g, TimeNs t) {
  Gpu& gpu = gpus_[g];
  fold(gpu, t);
  gpu.touched = true;
  for (KernelId k : gpu.model.advance(t)) {
    // A GPU has a handful of lanes: a scan beats keeping a kernel-to-lane map.
    for (auto& [lane, ls] : gpu.lanes) {
      if (ls.busy && ls.run.kernel == k) {
        boundary(g, lane, t);
        break;
      }
    }
  }
}

void Engine::record_work(const Job& j, TimeNs t, double work) {
  WorkTimeline& w = work_[j.index];
  if (!w.empty() && w.back().first == t) {
    w.back().second = work;
  } else {
    w.emplace_back(t, work);
  }
}

// Feeds the scheduler the calls salusd would have made at each iteration boundary inside
// the run: iteration_done with the measured time, then the next pick. The first
// iteration of each piece is replayed call by call, its pick checked against the plan;
// the rest of the piece picks the same session at every boundary, and the scheduler
// takes them at once (GpuScheduler::iterations_repeated), so a run costs O(pieces).
void Engine::replay(Gpu& gpu, LaneId lane, const Run& r, TimeNs end) {
  if (r.merged) return replay_merged(gpu, lane, r, end);
  TimeNs prev = r.t0;
  std::size_t seg = 0;
  // The boundary after `cum` alone-equivalent ns of the run, the index-th iteration's end.
  // Relative to the run's start: absolute times near 2^53 ns (104 days) have no room for
  // the half that rounds, and the boundaries would then depend on where the trace's
  // clock starts (FAIR's forecast of the turns relies on them).
  auto boundary_at = [&](double cum, std::uint64_t index) {
    if (index >= r.planned) return end;
    while (seg + 1 < r.segments.size() && r.segments[seg + 1].progress <= cum) ++seg;
    const Segment& s = r.segments[seg];
    const double at = static_cast<double>(s.t - r.t0) + (cum - s.progress) / s.rate;
    return std::clamp<TimeNs>(r.t0 + static_cast<TimeNs>(at + 0.5), prev, end);
  };
  const TimeNs o = cfg_.iteration_overhead_ns;
  double cum = 0.0;
  std::uint64_t i = 0;
  for (const Piece& pc : r.pieces) {
    if (pc.count == 0) continue;
    Job& j = job_of(pc.session);
    const TimeNs piece_start = prev;
    const double cum_start = cum;
    const double iter = static_cast<double>(pc.iter_ns);
    if (j.start < 0) j.start = piece_start;
    ++i;
    cum += iter;
    TimeNs ti = boundary_at(cum, i);
    TimeNs measured = device_time(ti - prev);
    if (i > 1) {
      const std::optional<SessionId> chosen =
          gpu.sched.lane_may_dispatch(lane) ? gpu.sched.pick(lane) : std::nullopt;
      if (!chosen || *chosen != pc.session)
        throw std::logic_error(
            fmt::format("salus-sim: coalesced run of job {} diverged from per-iteration scheduling",
                        j.spec->name));
      gpu.sched.iteration_cycle(pc.session, measured);
    } else {
      gpu.sched.iteration_done(pc.session, measured);  // dispatched at the run's start
    }
    j.device_ns += measured;
    prev = ti;
    if (const std::uint64_t rest = pc.count - 1; rest > 0) {
      // Every span is at least the iteration's alone time (rates are at most 1), so the
      // overhead never clamps a measured time and the sum telescopes.
      const TimeNs first = prev;
      i += rest - 1;
      cum = cum_start + static_cast<double>(pc.count - 1) * iter;
      const TimeNs before_last = boundary_at(cum, i);
      prev = before_last;
      ++i;
      cum += iter;
      ti = boundary_at(cum, i);
      const TimeNs total =
          std::max<TimeNs>(static_cast<TimeNs>(rest), (ti - first) - static_cast<TimeNs>(rest) * o);
      measured = device_time(ti - before_last);
      gpu.sched.iterations_repeated(pc.session, rest, total, measured);
      j.device_ns += total;
      prev = ti;
    }
    j.done += pc.count;
    if (cfg_.track_work) {
      record_work(j, piece_start, j.work);
      for (const Segment& s : r.segments)
        if (s.t > piece_start && s.t < prev) record_work(j, s.t, j.work + (s.progress - cum_start));
    }
    j.work += static_cast<double>(pc.count) * iter;
    work_done_ += static_cast<double>(pc.count) * iter;
    if (cfg_.track_work) record_work(j, prev, j.work);
  }
  counters_.iterations += r.planned;
}

void Engine::boundary(std::uint32_t g, LaneId lane, TimeNs t) {
  Gpu& gpu = gpus_[g];
  LaneState& ls = gpu.lanes.at(lane);
  Run& r = ls.run;
  ls.busy = false;
  replay(gpu, lane, r, t);
  Job& j = job_of(r.merged ? r.turners[r.last].id : r.pieces.back().session);

  gpu.sched.arena().end_iteration(lane, t);
  // Newcomers join before a finished job leaves, so the lane's FAIR clock survives.
  for (SessionId s : ls.deferred) make_runnable(gpu, ls, s);
  ls.deferred.clear();
  // Sessions that took a turn inside the run wait again, under their new keys.
  if (r.merged) {
    for (std::size_t i = 1; i < r.turners.size(); ++i)
      if (r.turners[i].count > 0) ls.waiting.erase({r.turners[i].key, r.turners[i].id});
    for (const Turner& x : r.turners)
      if (x.count > 0 && x.id != j.id) ls.waiting.insert({gpu.sched.find(x.id)->key, x.id});
  }
  for (const Keyed& k : r.stale) ls.waiting.erase(k);
  for (const Keyed& k : r.stale)
    if (k.second != j.id) ls.waiting.insert({gpu.sched.find(k.second)->key, k.second});
  for (const Piece& pc : r.pieces)
    if (!r.merged && pc.session != j.id)
      ls.waiting.insert({gpu.sched.find(pc.session)->key, pc.session});
  if (j.done < j.spec->iters) {
    ls.waiting.insert({gpu.sched.find(j.id)->key, j.id});
  } else {
    // Finished, but still a session: its client ends it once told of the last
    // iteration, as salusd's sessions end when their client closes them. So the
    // decisions of this boundary are made before the job's memory is released.
    j.finish = t;
    ++jobs_done_;
    gpu.sched.set_runnable(j.id, false);
    leaving_.emplace_back(g, j.id);
  }
  handle_admissions(g, t);
  if (!gpu.quiet) check_quiet(gpu, t);
}

void Engine::depart(std::uint32_t g, SessionId id, TimeNs t) {
  Gpu& gpu = gpus_[g];
  Job& j = job_of(id);
  fold(gpu, t);
  gpu.sched.leave(id, t);
  auto it = gpu.lanes.find(*j.lane);
  std::erase(it->second.members, id);
  // Only members run in a lane, so one without members is idle.
  if (it->second.members.empty()) gpu.lanes.erase(it);
  gpu.placed_util -= j.util;
  if (--gpu.placed_jobs == 0) gpu.placed_util = 0.0;  // no drift once empty
  owner_placements_.placed(j.owner, -1);
  host_keys_stale_ = host_keys_stale_ || (by_owner_ && !host_queue_.empty());
  handle_admissions(g, t);
  check_quiet(gpu, t);
}

// How far the run just started in `ls` can go before a decision could differ from the
// one it has already made. Runs are never planned across an event: arrivals, admissions,
// departures and lane moves cut them at their next boundary.
void Engine::plan(Gpu& gpu, LaneState& ls) {
  Run& r = ls.run;
  Piece& first = r.pieces.front();
  const Job& j = job_of(first.session);
  const std::uint64_t left = j.left();
  if (left <= 1 || !cfg_.coalesce || !gpu.quiet) return;
  std::uint64_t count = left;
  // Alone in the lane, every pick until the next event is this session, whatever the
  // policy. FIFO, PACK and PRIORITY keys never change while a session runs.
  if (!ls.waiting.empty()) {
    switch (gpu.sched.policy()) {
      case PolicyKind::fifo:
      case PolicyKind::pack:
      case PolicyKind::priority:
        break;
      case PolicyKind::fair:
        if (gpu.model.active() == 1) {
          if (!forecast_merged(gpu, ls)) forecast_turns(gpu, ls);
          return;
        }
        [[fallthrough]];
      case PolicyKind::srtf:
        count = forecast_one(gpu, ls, j, r.t0);
        r.predicted = true;
        break;
    }
  }
  first.count = count;
  r.planned = count;
  r.alone = static_cast<double>(count) * static_cast<double>(first.iter_ns);
}

// SRTF and FAIR keys move as a session runs: SRTF's remaining time shrinks while its
// measured mean drifts toward the current (contention-stretched) iteration time, and
// FAIR's virtual time grows by that time. Forecast the key at each boundary at the
// current rate and stop at the first boundary where the best rival could win; the pick
// there is a real one. close_instant() cuts the run if the rate changes. The scheduler
// keeps integer sums, so the key after k iterations has a closed form and the first
// boundary where the rival could win is found in O(1), not by stepping through them.
std::uint64_t Engine::forecast_one(Gpu& gpu, const LaneState& ls, const Job& j, TimeNs t0) {
  const RankKey& rival = ls.waiting.begin()->first;
  const bool fair = gpu.sched.policy() == PolicyKind::fair;
  const SessionSched* self = gpu.sched.find(j.id);
  const RankInputs& in = self->in;
  // FAIR's virtual time includes the estimate charged when the first iteration was
  // dispatched; iteration_done swaps it for the measured time.
  const double v0 =
      static_cast<double>(in.vtime - (self->charged.empty() ? 0 : self->charged.back()));
  const double span = static_cast<double>(j.iter_ns) * gpu.model.slowdown();
  const double d = std::max(1.0, span - static_cast<double>(cfg_.iteration_overhead_ns));
  // Margin for the nanosecond rounding of the measured times that replay() feeds.
  const double margin = std::max(1e3, std::abs(rival.primary) * 1e-6);
  const double c = rival.primary - margin;  // the key must stay below this
  const double left = static_cast<double>(j.left());
  const double done = static_cast<double>(in.done);
  const double sum = static_cast<double>(in.measured_ns);
  // The key at the boundary after k iterations of this run, as the scheduler will rank it.
  auto key = [&](double k) {
    return fair ? v0 + k * d : (left - k) * ((sum + k * d) / (done + k));
  };
  // The run ends at the first boundary past the next arrival, or with the job.
  const double until = static_cast<double>(horizon() - t0);
  double cap = std::min(left, std::max(1.0, std::ceil(until / span)));
  if (!(cap < 1e18)) cap = 1e18;
  double k = 1;
  if (key(1) < c) {
    if (fair) {
      k = std::ceil((c - v0) / d);
    } else {
      // (left - k)(sum + k d) >= c (done + k): a concave quadratic in k; the first whole k
      // at or past its smaller root, if any lies within the run.
      const double qa = -d, qb = left * d - sum - c, qc = left * sum - c * done;
      const double disc = qb * qb - 4 * qa * qc;
      if (disc < 0) {
        k = cap;
      } else {
        const double r1 = (-qb + std::sqrt(disc)) / (2 * qa);
        const double r2 = (-qb - std::sqrt(disc)) / (2 * qa);
        k = std::max(r1, r2) < 1 ? cap : std::ceil(std::min(r1, r2));
      }
    }
    k = std::clamp(k, 1.0, cap);
    // The root is computed in floating point: settle on the exact first boundary.
    while (k > 1 && key(k - 1) >= c) --k;
    for (int step = 0; k < cap && key(k) < c && step < 4; ++step) ++k;
    if (key(k) < c) k = cap;
  }
  return static_cast<std::uint64_t>(std::clamp(k, 1.0, cap));
}

// FAIR on a GPU where this lane's kernel is the only one: every iteration takes exactly
// its alone time, so the turns the lane's sessions will take are known in advance, down
// to the tie-breaks: follow them until a job would finish. Utils do not matter while the
// kernel runs alone; close_instant() cuts the run once another kernel starts. A turn is
// followed in O(1): its session runs until its virtual time passes the best rival's.
void Engine::forecast_turns(Gpu& gpu, LaneState& ls) {
  Run& r = ls.run;
  turns_.assign(ls.waiting.begin(), ls.waiting.end());  // sorted, hence a valid min-heap
  const auto later = [](const Keyed& a, const Keyed& b) { return b < a; };
  SessionId cur = r.pieces.front().session;
  const SessionSched* first = gpu.sched.find(cur);
  // At a boundary the running session's virtual time is the one at its dispatch (without
  // the estimate charged then) plus the measured times: the charges cancel.
  std::int64_t vt = first->in.vtime - (first->charged.empty() ? 0 : first->charged.back());
  std::uint64_t tie = first->key.tiebreak;
  std::uint64_t total = 0;
  const double until = static_cast<double>(horizon() - r.t0);
  double elapsed = 0.0;
  r.pieces.front().count = 0;
  for (;;) {
    Job& j = job_of(cur);
    const std::int64_t d = std::max<TimeNs>(device_time(j.iter_ns), 1);
    const double iter = static_cast<double>(j.iter_ns);
    // Turns this session keeps: up to a limit, or until the best rival ranks first.
    std::uint64_t m = std::min(j.left() - j.forecast, kMaxRunIterations - total);
    const double m_until = std::max(1.0, std::ceil((until - elapsed) / iter));
    if (m_until < static_cast<double>(m)) m = static_cast<std::uint64_t>(m_until);
    bool switched = false;
    if (!turns_.empty()) {
      const Keyed& best = turns_.front();
      const auto rival_first = [&](std::uint64_t n) {
        return best <
               Keyed{RankKey{static_cast<double>(vt + static_cast<std::int64_t>(n) * d), tie}, cur};
      };
      const double gap = best.first.primary - static_cast<double>(vt);
      std::uint64_t n = gap <= 0 ? 1 : static_cast<std::uint64_t>(std::max(1.0, gap / d));
      while (n > 1 && rival_first(n - 1)) --n;
      while (n < m && !rival_first(n)) ++n;
      if (n <= m && rival_first(n)) {
        m = n;
        switched = true;
      }
    }
    r.pieces.back().count += m;
    j.forecast += m;
    total += m;
    vt += static_cast<std::int64_t>(m) * d;
    elapsed += static_cast<double>(m) * iter;
    if (j.forecast >= j.left() || total >= kMaxRunIterations || elapsed >= until || !switched)
      break;
    std::pop_heap(turns_.begin(), turns_.end(), later);
    const Keyed next = turns_.back();
    turns_.back() = {RankKey{static_cast<double>(vt), tie}, cur};
    std::push_heap(turns_.begin(), turns_.end(), later);
    j.forecast_vt = vt;
    cur = next.second;
    tie = next.first.tiebreak;
    // A session that already took a turn in this run comes back with the time it left with.
    if (job_of(cur).forecast == 0) {
      r.stale.push_back(next);
      vt = gpu.sched.find(cur)->in.vtime;
    } else {
      vt = job_of(cur).forecast_vt;
    }
    r.pieces.push_back({cur, 0, job_of(cur).iter_ns});
  }
  double alone = 0.0;
  for (const Piece& pc : r.pieces) {
    alone += static_cast<double>(pc.count) * static_cast<double>(pc.iter_ns);
    job_of(pc.session).forecast = 0;
  }
  r.planned = total;
  r.alone = alone;
  r.predicted = true;
  r.mixed = r.pieces.size() > 1;
}

// FAIR on a GPU where this lane's kernel runs alone, in closed form. Every iteration then
// takes exactly its alone time and adds its device time to its session's virtual time,
// and no key changes but the running one's: the picks are the sessions' arithmetic
// progressions of virtual times merged, ties broken as the scheduler breaks them. So the
// iterations each session runs up to any point, and the lane time they take, are sums of
// quotients: the run goes on until the first job finishes, and a cut finds its new end by a
// search over virtual time: O(sessions x 64), whatever the number of turns. Exact while virtual
// times stay below 2^53, where the scheduler's double keys hold them; beyond, and when work is
// tracked per turn, forecast_turns().
bool Engine::forecast_merged(Gpu& gpu, LaneState& ls) {
  if (cfg_.track_work) return false;
  Run& r = ls.run;
  std::vector<Turner>& ts = r.turners;
  ts.clear();
  const auto add = [&](SessionId id, std::int64_t v, std::uint64_t tie, const RankKey& key) {
    const Job& j = job_of(id);
    ts.push_back(Turner{id, v, std::max<TimeNs>(device_time(j.iter_ns), 1), j.iter_ns, tie,
                        j.left(), 0, key});
  };
  const SessionSched* first = gpu.sched.find(r.pieces.front().session);
  // Its virtual time at the boundary: without the estimate charged at its dispatch.
  add(first->id, first->in.vtime - (first->charged.empty() ? 0 : first->charged.back()),
      first->key.tiebreak, first->key);
  for (const Keyed& k : ls.waiting)
    add(k.second, gpu.sched.find(k.second)->in.vtime, k.first.tiebreak, k.first);
  // The run ends with the first job to finish, if nothing comes first.
  Elem end{std::numeric_limits<std::int64_t>::max(), 0};
  std::int64_t max_d = 0;
  constexpr double kExact = 9007199254740992.0;  // 2^53
  for (const Turner& t : ts) {
    const double last = static_cast<double>(t.v) + static_cast<double>(t.limit - 1) * t.d;
    if (t.v < 0 || last >= kExact) continue;  // finishes beyond exactness: not the first
    end = std::min(end, Elem{t.v + static_cast<std::int64_t>(t.limit - 1) * t.d, t.tie});
    max_d = std::max(max_d, t.d);
  }
  if (end.key == std::numeric_limits<std::int64_t>::max() ||
      static_cast<double>(end.key) + static_cast<double>(max_d) >= kExact)
    return false;
  for (const Turner& t : ts)
    if (t.v < 0 || static_cast<double>(end.key) + static_cast<double>(t.d) >= kExact) return false;
  // Not bounded by the next arrival, unlike the forecasts at a rate: nothing but an event on
  // this GPU (an admission, another kernel, a lane move) can change these picks, and each of
  // those cuts the run at its next boundary, in O(sessions).
  const Elem stop = end;
  r.last = take_prefix(ts, stop);
  std::uint64_t total = 0;
  std::size_t sessions = 0;
  for (const Turner& t : ts) {
    total += t.count;
    sessions += t.count > 0 ? 1 : 0;
  }
  r.planned = total;
  r.alone = static_cast<double>(elapsed_upto(ts, stop));
  r.predicted = true;
  if (sessions == 1) {  // the first session's alone: an ordinary run
    r.pieces.front().count = total;
    return true;
  }
  r.merged = true;
  r.mixed = true;
  return true;
}

// cut() for a merged run: the prefix of the turns that ends at the first boundary not
// behind the kernel's progress.
void Engine::cut_merged(Gpu& gpu, LaneState& ls, TimeNs t) {
  Run& r = ls.run;
  const double p = r.progress;
  std::vector<Turner>& ts = r.turners;
  const Turner& lt = ts[r.last];
  const Elem bound{lt.v + static_cast<std::int64_t>(lt.count - 1) * lt.d, lt.tie};
  const auto target = static_cast<std::int64_t>(std::ceil(p - 1.0));
  const Elem stop = first_reaching(ts, target, bound);
  std::uint64_t m = 0;
  for (const Turner& x : ts) m += count_before(x, stop, true);
  if (m >= r.planned && !r.mixed) return;
  const double boundary = static_cast<double>(elapsed_upto(ts, stop));
  r.last = take_prefix(ts, stop);
  const bool now = p > 0.5 && boundary <= p + 1.0;
  const TimeNs left = now ? 0 : std::max<TimeNs>(1, static_cast<TimeNs>(std::ceil(boundary - p)));
  gpu.model.cancel(r.kernel, t);
  r.kernel = gpu.model.start(t, job_of(ts[r.last].id).util, left);
  r.planned = m;
  r.alone = boundary;
  r.predicted = false;
  r.mixed = false;
  ++counters_.kernels;
}

// replay() for a merged run: every iteration but the last took its alone time (the kernel
// ran alone until any cut); the last ends at `end`. The scheduler takes each session's
// iterations at once, with the decisions and switches they made.
void Engine::replay_merged(Gpu& gpu, LaneId lane, const Run& r, TimeNs end) {
  const std::vector<Turner>& ts = r.turners;
  const Turner& lt = ts[r.last];
  const auto last_start = static_cast<TimeNs>(std::llround(r.alone)) - lt.iter;
  const TimeNs last_ns = device_time(end - (r.t0 + last_start));
  std::vector<GpuScheduler::Turns> turns;
  turns.reserve(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const Turner& x = ts[i];
    if (x.count == 0) continue;
    std::int64_t device = static_cast<std::int64_t>(x.count) * x.d;
    if (i == r.last) device += last_ns - x.d;
    Job& j = job_of(x.id);
    if (j.start < 0)
      j.start = r.t0 + elapsed_upto(ts, Elem{x.v, x.tie}) - x.iter;  // its first pick
    j.done += x.count;
    j.device_ns += device;
    const double work = static_cast<double>(x.count) * static_cast<double>(x.iter);
    j.work += work;
    work_done_ += work;
    turns.push_back({x.id, x.count, device});
  }
  // The first iteration was dispatched at the run's start: settle it as salusd would.
  const std::int64_t first_ns = r.last == 0 && ts[0].count == 1 ? last_ns : ts[0].d;
  gpu.sched.iteration_done(ts[0].id, first_ns);
  turns.front().count -= 1;
  turns.front().device_ns -= first_ns;
  const std::int64_t last_vtime = lt.v + static_cast<std::int64_t>(lt.count - 1) * lt.d;
  gpu.sched.turns_repeated(lane, turns, r.planned - 1, count_switches(ts), lt.id, last_vtime);
  counters_.iterations += r.planned;
}

void Engine::land_swaps(Gpu& gpu, TimeNs t) {
  ResidencyPlanner& rp = gpu.sched.residency();
  while (!gpu.swaps.empty() && gpu.swaps.front().end <= t) {
    const Gpu::Swap s = gpu.swaps.front();
    gpu.swaps.pop_front();
    if (s.out) {
      gpu.sched.arena().finish_swap_out(s.id, t);  // its copy is on the host: room is free
      rp.swap_out_done(s.id, s.bytes, s.ns, t, true);
    } else {
      rp.swap_in_done(s.id, s.bytes, s.ns, t);
    }
  }
}

void Engine::queue_swap(Gpu& gpu, SessionId id, Bytes bytes, bool out, TimeNs t) {
  ResidencyPlanner& rp = gpu.sched.residency();
  rp.swap_started(id, t);
  const TimeNs ns = rp.cost().swap_ns(bytes);
  const TimeNs start = gpu.swaps.empty() ? t : std::max(t, gpu.swaps.back().end);
  gpu.swaps.push_back({id, bytes, ns, start + ns, out});
  counters_.swap_ns += ns;
  ++(out ? counters_.swaps_out : counters_.swaps_in);
}

void Engine::drive_swaps(std::uint32_t g, TimeNs t) {
  Gpu& gpu = gpus_[g];
  arena::GpuArena& ar = gpu.sched.arena();
  land_swaps(gpu, t);
  std::vector<arena::SwapBuffer> bufs;
  auto swap_out = [&](SessionId v) {
    if (!ar.begin_swap_out(v, bufs)) return;  // its iteration still runs: at its boundary
    queue_swap(gpu, v, ar.swap_in_bytes(v), true, t);
  };
  for (const auto& [lane, ls] : gpu.lanes)
    for (SessionId id : ls.members)
      if (gpu.sched.residency().evicting(id)) swap_out(id);
  // A job that ran its last iteration leaves at the end of this instant: never a victim.
  const ResidencyPlan plan = gpu.sched.plan_residency(
      [this](SessionId id) { return job_of(id).done < job_of(id).spec->iters; }, t);
  for (SessionId v : plan.swap_out) swap_out(v);
  if (plan.swap_in && ar.swap_in(*plan.swap_in, bufs) == arena::ArenaError::ok)
    queue_swap(gpu, *plan.swap_in, ar.swap_in_bytes(*plan.swap_in), false, t);
}

void Engine::dispatch(std::uint32_t g, TimeNs t) {
  Gpu& gpu = gpus_[g];
  arena::GpuArena& ar = gpu.sched.arena();
  started_.clear();
  if (gpu.sched.oversubscribed()) drive_swaps(g, t);
  for (auto& [lane, ls] : gpu.lanes) {
    // The broker's order: lane ready, lane allowed (FIFO runs one session per GPU), pick,
    // begin_iteration, iteration_dispatched.
    if (ls.busy || !ar.lane_ready(lane) || !gpu.sched.lane_may_dispatch(lane)) continue;
    const std::optional<SessionId> sid = gpu.sched.pick(lane);
    if (!sid) continue;
    // The pick may pass over sessions ranked ahead of it: swapped ones when
    // oversubscribed, held owners' under FAIR by owner.
    auto w = ls.waiting.begin();
    if (gpu.sched.passes_over_ranks())
      while (w != ls.waiting.end() && w->second != *sid) ++w;
    if (w == ls.waiting.end() || w->second != *sid)
      throw std::logic_error("salus-sim: lane bookkeeping disagrees with the scheduler");
    ls.waiting.erase(w);
    resort_waiting(gpu, ls);
    Job& j = job_of(*sid);
    ar.begin_iteration(lane, *sid, j.ephemeral);
    gpu.sched.iteration_dispatched(*sid);
    if (j.start < 0) j.start = t;
    Run& r = ls.run;
    r.pieces.assign(1, Piece{*sid, 1, j.iter_ns});
    r.stale.clear();
    r.planned = 1;
    r.alone = static_cast<double>(j.iter_ns);
    r.t0 = r.t_last = t;
    r.progress = 0.0;
    r.segments.clear();
    r.predicted = false;
    r.mixed = false;
    r.merged = false;
    r.kernel = gpu.model.start(t, j.util, j.iter_ns);
    ls.busy = true;
    started_.push_back(lane);
    ++counters_.kernels;
  }
  // The picks noted whom the lanes want back: start those swaps now.
  if (gpu.sched.oversubscribed()) drive_swaps(g, t);
  // Lengths are decided once every lane has started, at the rate they will all run at.
  for (LaneId lane : started_) {
    LaneState& ls = gpu.lanes.at(lane);
    Run& r = ls.run;
    plan(gpu, ls);
    if (r.planned <= 1) continue;
    gpu.model.cancel(r.kernel, t);
    r.kernel = gpu.model.start(t, job_of(r.pieces.front().session).util,
                               static_cast<TimeNs>(std::llround(r.alone)));
  }
}

void Engine::close_instant(std::uint32_t g, TimeNs t) {
  Gpu& gpu = gpus_[g];
  fold(gpu, t);
  dispatch(g, t);
  // Forecasts made at another rate no longer hold, and a kernel standing for several
  // sessions' turns must not meet another kernel: cut those runs to their next boundary
  // (a cut keeps the total util unless it ends a mixed kernel, hence the loop).
  for (bool again = true; again;) {
    again = false;
    const double rate = 1.0 / gpu.model.slowdown();
    for (auto& [lane, ls] : gpu.lanes) {
      if (!ls.busy) continue;
      Run& r = ls.run;
      const bool rate_changed = !r.segments.empty() && r.segments.back().rate != rate;
      if ((r.predicted && rate_changed) || (r.mixed && gpu.model.active() > 1)) {
        const double before = gpu.model.total_util();
        cut(gpu, ls, t);
        r.predicted = false;
        r.mixed = false;
        again = again || gpu.model.total_util() != before;
      }
    }
  }
  const double rate = 1.0 / gpu.model.slowdown();
  for (auto& [lane, ls] : gpu.lanes) {
    if (!ls.busy) continue;
    Run& r = ls.run;
    if (r.segments.empty() || r.segments.back().rate != rate)
      r.segments.push_back({t, r.progress, rate});
  }
  ++gpu.epoch;
  if (const std::optional<TimeNs> next = gpu.model.next_completion())
    heap_.push({*next, g, gpu.epoch});
  if (!gpu.swaps.empty()) {
    gpu.idle_since = -1;
    heap_.push({gpu.swaps.front().end, g, gpu.epoch});
  } else if (gpu.sched.oversubscribed() && gpu.model.active() == 0) {
    // Idle, with someone perhaps waiting for a resident session's quantum to end.
    bool waits = false;
    for (const auto& [lane, ls] : gpu.lanes) waits = waits || !ls.waiting.empty();
    if (waits) {
      check_not_stalled(g, t);
      heap_.push({t + gpu.sched.residency().cost().min_quantum_ns, g, gpu.epoch});
    } else {
      gpu.idle_since = -1;
    }
  } else {
    gpu.idle_since = -1;
  }
}

// An oversubscribed GPU may idle while a session waits for a victim's quantum, but no
// longer than the longest quantum a session of this GPU could have: past that,
// nothing will ever change, and the simulation would run on for ever. A scheduler
// stall is a bug (the residency planner's and the arena's liveness rules exist so
// that there are none): say so and stop.
void Engine::check_not_stalled(std::uint32_t g, TimeNs t) {
  Gpu& gpu = gpus_[g];
  if (gpu.idle_since < 0) {
    gpu.idle_since = t;
    return;
  }
  const SwapCostModel& cost = gpu.sched.residency().cost();
  const TimeNs bound = cost.quantum_ns(gpu.sched.arena().memory().capacity) + 1'000'000'000;
  if (t - gpu.idle_since <= bound) return;
  std::size_t waiting = 0;
  for (const auto& [lane, ls] : gpu.lanes) waiting += ls.waiting.size();
  throw std::logic_error(fmt::format(
      "salus-sim: GPU {} idle since {:.3f} s with {} sessions waiting and nothing to swap "
      "in (a scheduler stall)",
      g, static_cast<double>(gpu.idle_since) / 1e9, waiting));
}

SimResult Engine::run() {
  std::size_t& pos = pos_;
  for (;;) {
    while (!heap_.empty() && heap_.top().epoch != gpus_[heap_.top().gpu].epoch) heap_.pop();
    const bool have_arrival = pos < order_.size();
    if (!have_arrival && heap_.empty()) break;
    TimeNs t = std::numeric_limits<TimeNs>::max();
    if (have_arrival) t = jobs_[order_[pos]].arrival;
    if (!heap_.empty()) t = std::min(t, heap_.top().t);
    ++counters_.events;
    if (cfg_.progress && counters_.events % std::max<std::uint64_t>(cfg_.progress_every, 1) == 0)
      report(t);
    // Within an instant: arrivals first, so that a boundary at the same time sees them.
    for (; pos < order_.size() && jobs_[order_[pos]].arrival == t; ++pos) {
      Job& j = jobs_[order_[pos]];
      if (cfg_.gpus == 1 && cfg_.placement != Placement::exclusive) {
        // One GPU: binding early costs nothing, and the GPU's own queue (salusd's) keeps
        // the scheduler's arrival order the trace's.
        submit(0, j, t);
      } else {
        owner_placements_.waiting(j.owner, +1);
        host_keys_stale_ = by_owner_;  // a new owner may make the queue per owner
        host_queue_.push(j.id, pos, t, arena::align_up(j.declared.persistent),
                         arena::align_up(j.declared.ephemeral), host_key(j, pos));
      }
    }
    place_host(t);
    while (!heap_.empty() && heap_.top().t == t) {
      const HeapEntry e = heap_.top();
      heap_.pop();
      if (e.epoch == gpus_[e.gpu].epoch) complete(e.gpu, t);
    }
    place_host(t);
    for (std::uint32_t g = 0; g < cfg_.gpus; ++g) {
      if (!gpus_[g].touched) continue;
      gpus_[g].touched = false;
      close_instant(g, t);
    }
    // Then jobs that finished leave, and what they free is used within the same
    // instant, but only by lanes that had not started an iteration yet.
    if (leaving_.empty()) continue;
    for (const auto& [g, id] : leaving_) depart(g, id, t);
    leaving_.clear();
    place_host(t);
    for (std::uint32_t g = 0; g < cfg_.gpus; ++g) {
      if (!gpus_[g].touched) continue;
      gpus_[g].touched = false;
      close_instant(g, t);
    }
  }
  for (const Job& j : jobs_)
    if (j.finish < 0)
      throw std::logic_error(fmt::format("salus-sim: job {} never finished", j.spec->name));

  SimResult res;
  res.config = cfg_;
  res.lanes = lanes_;
  res.jobs.reserve(jobs_.size());
  for (const Job& j : jobs_) {
    JobResult r;
    r.index = j.index;
    r.arrival = j.arrival;
    r.admit = j.admit;
    r.start = j.start;
    r.finish = j.finish;
    r.gpu = j.gpu;
    r.lane = j.lane.value_or(0);
    r.device_ns = j.device_ns;
    res.jobs.push_back(r);
  }
  res.summary = summarize(res.jobs);
  for (const Gpu& gpu : gpus_) {
    const SchedStats& s = gpu.sched.stats();
    counters_.decisions += s.decisions;
    counters_.switches += s.switches;
    counters_.preemptions += s.preemptions;
  }
  res.counters = counters_;
  res.work = std::move(work_);
  return res;
}

double interpolate(const WorkTimeline& w, TimeNs t) {
  if (w.empty() || t <= w.front().first) return w.empty() ? 0.0 : w.front().second;
  if (t >= w.back().first) return w.back().second;
  auto hi =
      std::lower_bound(w.begin(), w.end(), t, [](const auto& p, TimeNs x) { return p.first < x; });
  auto lo = std::prev(hi);
  if (hi->first == lo->first) return hi->second;
  const double f = static_cast<double>(t - lo->first) / static_cast<double>(hi->first - lo->first);
  return lo->second + f * (hi->second - lo->second);
}

}  // namespace

SimResult simulate(const std::vector<TraceJob>& trace, const SimConfig& config) {
  if (trace.empty()) throw SimError("the trace has no jobs");
  Engine engine(trace, config);
  return engine.run();
}

Summary summarize(const std::vector<JobResult>& jobs) {
  Summary s;
  if (jobs.empty()) return s;
  TimeNs first = std::numeric_limits<TimeNs>::max(), last = std::numeric_limits<TimeNs>::min();
  double queue = 0, jct = 0;
  std::vector<TimeNs> jcts;
  jcts.reserve(jobs.size());
  for (const JobResult& j : jobs) {
    first = std::min(first, j.arrival);
    last = std::max(last, j.finish);
    queue += static_cast<double>(j.queue());
    jct += static_cast<double>(j.jct());
    jcts.push_back(j.jct());
  }
  std::sort(jcts.begin(), jcts.end());
  const double n = static_cast<double>(jobs.size());
  const auto rank = static_cast<std::size_t>(std::ceil(0.95 * n));
  s.makespan_s = static_cast<double>(last - first) / 1e9;
  s.avg_queue_s = queue / n / 1e9;
  s.avg_jct_s = jct / n / 1e9;
  s.p95_jct_s = static_cast<double>(jcts[std::max<std::size_t>(rank, 1) - 1]) / 1e9;
  return s;
}

std::vector<ShareWindow> share_windows(const SimResult& result, TimeNs window, TimeNs step) {
  std::vector<ShareWindow> out;
  if (result.work.size() != result.jobs.size() || result.jobs.empty() || window <= 0 || step <= 0)
    return out;
  TimeNs begin = std::numeric_limits<TimeNs>::min(), end = std::numeric_limits<TimeNs>::max();
  for (const JobResult& j : result.jobs) {
    begin = std::max(begin, j.arrival);
    end = std::min(end, j.finish);
  }
  for (TimeNs b = begin; b + window <= end; b += step) {
    ShareWindow w;
    w.begin = b;
    w.end = b + window;
    double total = 0;
    for (const WorkTimeline& tl : result.work) {
      w.work.push_back(interpolate(tl, w.end) - interpolate(tl, w.begin));
      total += w.work.back();
    }
    for (double x : w.work) w.share.push_back(total > 0 ? x / total : 0.0);
    out.push_back(std::move(w));
  }
  return out;
}

}  // namespace salus::sched
