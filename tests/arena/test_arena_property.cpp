// Seeded random event streams against GpuArena, checked after every event against an
// independent model: no physical overlap, the safety condition, exact byte accounting,
// and at the end liveness: with everyone else gone, every queued request gets in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "arena/gpu_arena.hpp"

namespace salus::arena {
namespace {

constexpr Bytes M = Bytes{1} << 20;

struct Config {
  std::uint64_t seed;
  Bytes capacity;
  ArenaOptions options;
  int events;
};

class Harness {
 public:
  explicit Harness(const Config& cfg)
      : cfg_(cfg), arena_(cfg.capacity, cfg.options), rng_(cfg.seed) {}

  // Returns the first problem found, or an empty string.
  std::string run() {
    for (event_ = 0; event_ < cfg_.events; ++event_) {
      step();
      if (!error_.empty()) return where() + error_;
      check();
      if (event_ % kQuietEvery == kQuietEvery - 1) quiet_check();
      if (!error_.empty()) return where() + error_;
    }
    drain();
    if (!error_.empty()) return where() + error_;
    return {};
  }

  // What the stream exercised, beyond the arena's own stats.
  struct Coverage {
    std::uint64_t alloc_results[8] = {};  // by ArenaError
    std::uint64_t extra_chunks = 0;       // moves beyond the first for a chunked buffer
    std::uint64_t most_chunks = 0;        // the most moves one buffer took in one plan
    std::uint64_t staged = 0;             // first copies of two-step moves
  };

  const ArenaStats& stats() const { return arena_.stats(); }
  const Coverage& coverage() const { return coverage_; }
  int quiet_checks() const { return quiet_checks_; }

 private:
  struct Sess {
    Bytes p = 0, e = 0;
    std::uint64_t arrival = 0;
    bool admitted = false;
    std::optional<LaneId> lane;
    Bytes used = 0;
    std::set<BufferHandle> buffers;
    std::vector<PersistentMove> moves;  // handed out, not finished
  };

  std::string where() const {
    return fmt::format("seed {} event {} (last op: {}): ", cfg_.seed, event_, last_op_);
  }
  void fail(std::string what) {
    if (error_.empty()) error_ = std::move(what);
  }
  std::uint64_t pick(std::uint64_t n) {
    return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng_);
  }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  Bytes usable() const { return cfg_.capacity & ~(kAlignment - 1); }

  Bytes random_size(Bytes max) {
    if (max == 0) return 0;
    switch (pick(4)) {
      case 0:
        return pick(max / M + 1) * M;  // whole MiB
      case 1:
        return pick(max / kAlignment + 1) * kAlignment;  // aligned
      case 2:
        return pick(max + 1);  // anything
      default:
        return pick(std::min<Bytes>(max, 4 * M) + 1);  // small
    }
  }

  template <typename Map>
  auto random_key(const Map& m) -> std::optional<typename Map::key_type> {
    if (m.empty()) return std::nullopt;
    auto it = m.begin();
    std::advance(it, static_cast<long>(pick(m.size())));
    return it->first;
  }

  void take_admissions() {
    for (const Admitted& a : arena_.take_admissions()) {
      auto it = sessions_.find(a.session);
      if (it == sessions_.end())
        return fail(fmt::format("admission of unknown session {}", a.session));
      if (it->second.admitted) return fail(fmt::format("session {} admitted twice", a.session));
      it->second.admitted = true;
      it->second.lane = a.lane;
    }
  }

  void forget_buffers(Sess& s) {
    for (BufferHandle h : s.buffers) buffers_.erase(h);
    s.buffers.clear();
    s.used = 0;
    s.moves.clear();
  }

  Bytes model_reserved() const {
    Bytes r = 0;
    for (const auto& [id, s] : sessions_) r += s.admitted ? std::max(s.p, s.used) : s.used;
    return r;
  }

  void step() {
    const std::uint64_t roll = pick(100);
    if (roll < 10 || sessions_.size() < 3) {
      op_request();
    } else if (roll < 15) {
      op_leave();
    } else if (roll < 18) {
      op_change_need();
    } else if (roll < 34) {
      op_alloc();
    } else if (roll < 44) {
      op_free();
    } else if (roll < 60) {
      op_begin();
    } else if (roll < 78) {
      op_end();
    } else if (roll < 89) {
      op_idle();
    } else {
      op_finish();
    }
    take_admissions();
  }

  void op_request() {
    last_op_ = "request";
    if (sessions_.size() >= 24) return op_leave();
    const SessionId id = next_session_++;
    const Bytes p = random_size(usable() / 4), e = random_size(usable() / 4);
    const ArenaError err = arena_.request(id, {p, e}, event_);
    const bool fits = align_up(p) + align_up(e) <= usable();
    if (err != (fits ? ArenaError::ok : ArenaError::too_large))
      return fail(fmt::format("request({}, {}) gave {}", p, e, to_string(err)));
    if (err != ArenaError::ok) return;
    Sess& s = sessions_[id];
    s.p = align_up(p);
    s.e = align_up(e);
    s.arrival = id;
  }

  void op_leave() {
    last_op_ = "leave";
    const auto id = random_key(sessions_);
    if (!id) return;
    arena_.leave(*id, event_);
    forget_buffers(sessions_[*id]);
    sessions_.erase(*id);
  }

  void op_change_need() {
    last_op_ = "change_need";
    const auto id = random_key(sessions_);
    if (!id) return;
    Sess& s = sessions_[*id];
    const Bytes p = random_size(usable() / 3), e = random_size(usable() / 3);
    const ArenaError err = arena_.change_need(*id, {p, e}, event_);
    const bool fits = std::max(align_up(p), s.used) + align_up(e) <= usable();
    if (err != (fits ? ArenaError::ok : ArenaError::too_large))
      return fail(fmt::format("change_need gave {}", to_string(err)));
    if (err != ArenaError::ok) return;
    s.p = align_up(p);
    s.e = align_up(e);
    s.admitted = false;
    s.lane.reset();
  }

  void op_alloc() {
    last_op_ = "alloc_persistent";
    std::optional<SessionId> id;
    if (chance(0.9)) {
      std::vector<SessionId> admitted;
      for (const auto& [sid, s] : sessions_)
        if (s.admitted) admitted.push_back(sid);
      if (!admitted.empty()) id = admitted[pick(admitted.size())];
    }
    if (!id) id = random_key(sessions_);
    if (!id) return;
    Sess& s = sessions_[*id];
    // Mostly what is left of the declared P, in pieces or whole, so that the persistent
    // region fills up and fragments; sometimes more than declared.
    const Bytes left = s.p > s.used ? s.p - s.used : 0;
    Bytes size = 0;
    switch (pick(5)) {
      case 0:
        size = left;
        break;
      case 1:
      case 2:
        size = random_size(std::max<Bytes>(left, kAlignment));
        break;
      case 3:
        size = random_size(std::max<Bytes>(left / 4, kAlignment));
        break;
      default:
        size = random_size(usable() / 8);
        break;
    }
    const AllocResult r = arena_.alloc_persistent(*id, size);
    ++coverage_.alloc_results[static_cast<int>(r.error)];
    if (!s.admitted) {
      if (r.error != ArenaError::not_admitted)
        fail("alloc for a queued session did not say not_admitted");
      return;
    }
    const Bytes rounded = align_up(std::max<Bytes>(size, 1));
    const Bytes delta = std::max(s.p, s.used + rounded) - std::max(s.p, s.used);
    const bool fits = model_reserved() + delta + arena_.memory().lane_total <= usable();
    if (r.error == ArenaError::no_memory) {
      if (fits) fail(fmt::format("alloc {} said no_memory though the accounting fits", size));
      return;
    }
    if (!fits)
      return fail(
          fmt::format("alloc {} gave {} past the safety condition", size, to_string(r.error)));
    if (r.error == ArenaError::fragmented) return;
    if (r.error != ArenaError::ok) return fail(fmt::format("alloc gave {}", to_string(r.error)));
    if (r.offset % kAlignment != 0) return fail("unaligned buffer");
    s.used += rounded;
    s.buffers.insert(r.handle);
    buffers_[r.handle] = {*id, rounded};
  }

  void op_free() {
    last_op_ = "free_persistent";
    if (chance(0.05) || buffers_.empty()) {
      arena_.free_persistent(1'000'000'000 + pick(1000));  // unknown: must be harmless
      return;
    }
    const BufferHandle h = *random_key(buffers_);
    const auto [owner, size] = buffers_[h];
    arena_.free_persistent(h);
    Sess& s = sessions_[owner];
    s.used -= size;
    s.buffers.erase(h);
    std::erase_if(s.moves, [h](const PersistentMove& m) { return m.buffer == h; });
    buffers_.erase(h);
  }

  void op_begin() {
    last_op_ = "begin_iteration";
    std::vector<LaneView> ready;
    for (LaneView& v : arena_.lanes())
      if (!v.busy && !v.sessions.empty() && arena_.lane_ready(v.id)) ready.push_back(std::move(v));
    if (ready.empty()) return;
    const LaneView& v = ready[pick(ready.size())];
    const SessionId s = v.sessions[pick(v.sessions.size())];
    if (!sessions_[s].moves.empty()) return;  // mid-compaction: not at a boundary
    const Bytes used = pick(v.size / kAlignment + 1) * kAlignment;
    arena_.begin_iteration(v.id, s, used);
    for (const LaneView& after : arena_.lanes())
      if (after.id == v.id && (!after.busy || after.running != s || after.used != used))
        fail("begin_iteration on a ready lane did not start");
  }

  void op_end() {
    last_op_ = "end_iteration";
    std::vector<LaneId> busy;
    for (const LaneView& v : arena_.lanes())
      if (v.busy) busy.push_back(v.id);
    if (busy.empty()) return;
    arena_.end_iteration(busy[pick(busy.size())], event_);
  }

  bool running(SessionId id) {
    for (const LaneView& v : arena_.lanes())
      if (v.busy && v.running == id) return true;
    return false;
  }

  void op_idle() {
    last_op_ = "session_idle";
    const auto id = random_key(sessions_);
    if (!id || running(*id)) return;
    Sess& s = sessions_[*id];
    // Compaction names every session it may still need idle (the broker stops
    // pipelining their iterations): whoever gets moves was on that list.
    arena_.compaction_owners(owners_);
    const auto moves = arena_.session_idle(*id);
    if (!moves.empty() && !std::binary_search(owners_.begin(), owners_.end(), *id))
      return fail("moves for a session compaction_owners did not name");
    if (!moves.empty() && !s.moves.empty()) return fail("moves handed out twice");
    for (const PersistentMove& m : moves) {
      if (m.owner != *id || !s.buffers.count(m.buffer)) return fail("move of a buffer not owned");
      if (!(m.from + m.size <= m.to || m.to + m.size <= m.from)) return fail("overlapping move");
      // Only the first copy of a two-step move may go down, and it is never chunked.
      if (m.to <= m.from && m.size != buffers_[m.buffer].second) return fail("chunk moving down");
      if (m.to < m.from) ++coverage_.staged;
      if (m.from % kAlignment || m.to % kAlignment || m.size % kAlignment)
        return fail("unaligned move");
    }
    // An empty answer while moves are out must not forget them: they still need finishing.
    if (!moves.empty()) s.moves = moves;
    std::set<BufferHandle> distinct;
    for (const PersistentMove& m : moves) distinct.insert(m.buffer);
    coverage_.extra_chunks += moves.size() - distinct.size();
    for (BufferHandle b : distinct) {
      const auto n = static_cast<std::uint64_t>(std::count_if(
          moves.begin(), moves.end(), [b](const PersistentMove& m) { return m.buffer == b; }));
      coverage_.most_chunks = std::max(coverage_.most_chunks, n);
    }
    if (chance(0.7)) finish(*id);
  }

  void op_finish() {
    last_op_ = "finish_moves";
    std::vector<SessionId> with_moves;
    for (const auto& [id, s] : sessions_)
      if (!s.moves.empty()) with_moves.push_back(id);
    if (with_moves.empty()) return arena_.finish_moves(next_session_ + 7, event_);  // harmless
    finish(with_moves[pick(with_moves.size())]);
  }

  void finish(SessionId id) {
    Sess& s = sessions_[id];
    // Where each buffer ends up: its chunks all move by the same distance.
    std::map<BufferHandle, Bytes> expect;
    for (const PersistentMove& m : s.moves) {
      const Bytes start = arena_.buffer_offset(m.buffer);
      if (m.from < start || m.from + m.size > start + buffers_[m.buffer].second)
        return fail("move outside its buffer");
      expect[m.buffer] = start + (m.to - m.from);
    }
    arena_.finish_moves(id, event_);
    s.moves.clear();
    for (const auto& [h, offset] : expect)
      if (arena_.buffer_offset(h) != offset)
        return fail("buffer did not land where its moves went");
  }

  // ---- the checks after every event ----
  void check() {
    const std::string inv = arena_.check_invariants();
    if (!inv.empty()) return fail("invariant: " + inv);
    const MemorySummary mem = arena_.memory();
    const std::vector<LaneView> lanes = arena_.lanes();

    // Physical: lanes (public view), buffers and reserved destinations never overlap.
    std::vector<std::pair<Bytes, Bytes>> ranges;
    for (const PhysicalRegion& r : arena_.physical_regions())
      ranges.emplace_back(r.offset, r.offset + r.size);
    for (const LaneView& v : lanes) {
      if (v.offset && !v.move_pending && *v.offset + v.size > usable())
        return fail("lane past the top");
      if (v.move_pending && !v.busy) return fail("an idle lane waits for a boundary");
      if (!v.offset && v.busy) return fail("a busy lane has no place");
    }
    Bytes live = 0;
    for (const auto& [h, owner_size] : buffers_) {
      const Bytes off = arena_.buffer_offset(h);
      if (off + owner_size.second > usable()) return fail("buffer past the top");
      live += owner_size.second;
    }
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second && ranges[i].first != ranges[i].second)
        return fail(fmt::format("physical regions overlap at {}", ranges[i].first));
    std::vector<std::pair<Bytes, Bytes>> views;
    // Lanes that wait for their boundary (move_pending) still hold their old extent, which
    // physical_regions() covers above; the rest hold exactly [offset, offset + size).
    for (const LaneView& v : lanes)
      if (v.offset && v.size && !v.move_pending) views.emplace_back(*v.offset, *v.offset + v.size);
    for (const auto& [h, os] : buffers_)
      views.emplace_back(arena_.buffer_offset(h), arena_.buffer_offset(h) + os.second);
    std::sort(views.begin(), views.end());
    for (std::size_t i = 1; i < views.size(); ++i)
      if (views[i].first < views[i - 1].second) return fail("lane and buffer views overlap");

    // Accounting.
    if (mem.persistent_used != live)
      return fail(fmt::format("persistent_used {} != live {}", mem.persistent_used, live));
    const Bytes reserved = model_reserved();
    if (mem.persistent_reserved != reserved)
      return fail(
          fmt::format("persistent_reserved {} != model {}", mem.persistent_reserved, reserved));
    Bytes lane_sum = 0;
    for (const LaneView& v : lanes) lane_sum += v.size;
    if (mem.lane_total != lane_sum) return fail("lane_total is not the sum of lane sizes");
    if (mem.persistent_reserved + mem.lane_total > cfg_.capacity)
      return fail("safety condition broken");
    if (mem.free != cfg_.capacity - mem.persistent_reserved - mem.lane_total)
      return fail("free is off");
    if (mem.lanes != lanes.size() || mem.queued != arena_.queue().size())
      return fail("counts are off");

    // Lanes hold exactly the admitted sessions, sized to their largest E (a busy lane
    // shrinks only at its boundary, so it may be larger).
    std::size_t members = 0;
    for (const LaneView& v : lanes) {
      Bytes largest = 0;
      for (SessionId s : v.sessions) {
        auto it = sessions_.find(s);
        if (it == sessions_.end() || !it->second.admitted || it->second.lane != v.id)
          return fail(fmt::format("lane {} lists session {} wrongly", v.id, s));
        largest = std::max(largest, it->second.e);
      }
      members += v.sessions.size();
      if (v.busy ? v.size < largest : v.size != largest)
        return fail(fmt::format("lane {} size {} != largest E {}", v.id, v.size, largest));
    }
    std::size_t admitted = 0;
    std::vector<SessionId> waiting;
    for (const auto& [id, s] : sessions_) {
      if (s.admitted)
        ++admitted;
      else
        waiting.push_back(id);  // ids are handed out in arrival order
    }
    if (members != admitted) return fail("admitted sessions missing from lanes");
    std::vector<SessionId> q;
    for (const QueueEntry& e : arena_.queue()) q.push_back(e.session);
    if (q != waiting) return fail("queue is not the waiting sessions in arrival order");
  }

  // ---- the end: drain everything and demand that every request gets in ----
  void complete_compaction() {
    for (int round = 0; round < 10000; ++round) {
      for (auto& [id, s] : sessions_)
        if (!s.moves.empty()) finish(id);
      if (!arena_.compaction_pending()) return;
      for (auto& [id, s] : sessions_) {
        s.moves = arena_.session_idle(id);
        if (!s.moves.empty()) finish(id);
      }
      take_admissions();
      check();
      if (!error_.empty()) return;
    }
    fail("compaction never completes");
  }

  // Lets every iteration end and compaction finish, then demands that the head of the
  // queue is not left waiting for a new lane that the accounting allows: nothing
  // physical may stand in its way on a quiet GPU.
  static constexpr int kQuietEvery = 2500;
  void quiet_check() {
    last_op_ = "quiet check";
    for (const LaneView& v : arena_.lanes())
      if (v.busy) arena_.end_iteration(v.id, event_);
    take_admissions();
    complete_compaction();
    if (!error_.empty()) return;
    const std::vector<QueueEntry> q = arena_.queue();
    if (q.empty()) return;
    const Sess& head = sessions_[q.front().session];
    const MemorySummary mem = arena_.memory();
    const Bytes p_new = std::max(head.p, head.used) - head.used;
    if (mem.persistent_reserved + mem.lane_total + p_new + head.e <= usable())
      fail(fmt::format("liveness: session {} fits a new lane on a quiet GPU but waits",
                       q.front().session));
    for (const LaneView& v : arena_.lanes())
      if (!v.offset || v.move_pending)
        fail(fmt::format("lane {} not in place on a quiet GPU", v.id));
    ++quiet_checks_;
  }

  void drain() {
    last_op_ = "drain";
    for (int round = 0; round < 100000 && error_.empty(); ++round) {
      for (const LaneView& v : arena_.lanes())
        if (v.busy) arena_.end_iteration(v.id, event_);
      take_admissions();
      complete_compaction();
      if (!error_.empty() || sessions_.empty()) return;
      std::vector<SessionId> admitted;
      for (const auto& [id, s] : sessions_)
        if (s.admitted) admitted.push_back(id);
      if (!admitted.empty()) {
        for (SessionId id : admitted) {
          arena_.leave(id, event_);
          forget_buffers(sessions_[id]);
          sessions_.erase(id);
          take_admissions();
          check();
          if (!error_.empty()) return;
        }
        continue;
      }
      // Nobody is admitted. Queued sessions may still hold buffers from before a
      // change_need; those are "the others", so the last of them leaves.
      const SessionId head = arena_.queue().front().session;
      std::optional<SessionId> holder;
      for (const auto& [id, s] : sessions_)
        if (id != head && s.used > 0) holder = id;
      if (holder) {
        arena_.leave(*holder, event_);
        forget_buffers(sessions_[*holder]);
        sessions_.erase(*holder);
        take_admissions();
        continue;
      }
      // The GPU holds nothing but the head's own buffers and compaction is done: the head
      // fits alone, so it must have been admitted.
      if (!sessions_[head].admitted)
        return fail(
            fmt::format("liveness: session {} (P {} E {} used {}) not admitted on an empty GPU",
                        head, sessions_[head].p, sessions_[head].e, sessions_[head].used));
    }
    if (error_.empty() && !sessions_.empty()) fail("drain did not finish");
    if (error_.empty() && (!arena_.lanes().empty() || arena_.memory().free != cfg_.capacity))
      fail("memory not all free after everyone left");
  }

  Config cfg_;
  GpuArena arena_;
  std::mt19937_64 rng_;
  int event_ = 0;
  const char* last_op_ = "";
  std::string error_;
  SessionId next_session_ = 1;
  std::map<SessionId, Sess> sessions_;
  std::map<BufferHandle, std::pair<SessionId, Bytes>> buffers_;
  Coverage coverage_;
  int quiet_checks_ = 0;
  std::vector<SessionId> owners_;  // compaction_owners, reused
};

constexpr int kEvents = 100'000;

void run_config(const Config& cfg) {
  // Printed first so that even an abort inside the arena names the seed.
  std::printf("[ seed %llu ] capacity %llu\n", static_cast<unsigned long long>(cfg.seed),
              static_cast<unsigned long long>(cfg.capacity));
  std::fflush(stdout);
  Harness h(cfg);
  const std::string problem = h.run();
  const ArenaStats& st = h.stats();
  const Harness::Coverage& cov = h.coverage();
  const auto result = [&](ArenaError e) { return cov.alloc_results[static_cast<int>(e)]; };
  fmt::print(
      "admissions {} lanes opened {} grown {} closed {} moved {}; allocations ok {} no_memory {} "
      "fragmented {} not_admitted {}; persistent moves {} ({} bytes), extra chunks {} (at most "
      "{} for one buffer), two-step {}\n",
      st.admissions, st.lanes_opened, st.lanes_grown, st.lanes_closed, st.lane_moves,
      result(ArenaError::ok), result(ArenaError::no_memory), result(ArenaError::fragmented),
      result(ArenaError::not_admitted), st.persistent_moves, st.persistent_bytes_moved,
      cov.extra_chunks, cov.most_chunks, cov.staged);
  EXPECT_EQ(problem, "") << "reproduce with seed " << cfg.seed;
  // The stream must actually exercise the interesting paths.
  EXPECT_EQ(h.quiet_checks(), cfg.events / 2500) << "seed " << cfg.seed;
  EXPECT_GT(st.admissions, 1000u) << "seed " << cfg.seed;
  EXPECT_GT(st.lane_moves, 0u) << "seed " << cfg.seed;
  if (cfg.options.lane_mode == LaneMode::salus)
    EXPECT_GT(st.lanes_grown, 0u) << "seed " << cfg.seed;
  else
    EXPECT_EQ(st.lanes_grown, 0u) << "seed " << cfg.seed;
  EXPECT_GT(result(ArenaError::fragmented), 0u) << "seed " << cfg.seed;
  EXPECT_GT(result(ArenaError::no_memory), 0u) << "seed " << cfg.seed;
  EXPECT_GT(st.persistent_moves, 0u) << "seed " << cfg.seed;
}

TEST(ArenaProperty, BoundedBypass) {
  for (std::uint64_t seed : {1ull, 2ull}) run_config({seed, 64 * M + 100, {}, kEvents});
}

TEST(ArenaProperty, BoundedBypassOfTwo) {
  run_config({3, 48 * M, {QueueMode::bounded_bypass, 2, LaneMode::salus}, kEvents});
}

TEST(ArenaProperty, StrictFifo) {
  run_config({4, 64 * M, {QueueMode::strict_fifo, 16, LaneMode::salus}, kEvents});
}

TEST(ArenaProperty, LanePerSession) {
  run_config({5, 96 * M, {QueueMode::bounded_bypass, 4, LaneMode::lane_per_session}, kEvents});
}

}  // namespace
}  // namespace salus::arena
