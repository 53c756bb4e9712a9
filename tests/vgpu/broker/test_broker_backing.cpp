// The arena backed on demand, seen from the broker: a device that backs on
// demand (a sim device behind a wrapper that keeps the backed chunks) must never
// get an op on memory that is not backed, gets freed memory back, and a card
// with no room fails an allocation with a clear error and loses nothing.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <future>
#include <mutex>
#include <random>
#include <span>
#include <thread>

#include "arena/backing_plan.hpp"
#include "tests/support/broker_driver.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/sim/sim_device.hpp"

using namespace salus;
using namespace salus::vgpu;

namespace {

constexpr Bytes kChunk = Bytes{2} << 20;

// Forwards to a SimDevice; keeps the chunks set_backing backed and counts every
// op that touches a byte outside them.
class BackingDevice final : public Device {
 public:
  explicit BackingDevice(Bytes memory) : sim_(0, memory), info_(sim_.info()) {
    info_.backs_on_demand = true;
  }
  const DeviceInfo& info() const override { return info_; }
  void set_sink(CompletionSink* sink) override { sim_.set_sink(sink); }
  StreamId create_stream() override { return sim_.create_stream(); }
  void destroy_stream(StreamId s) override { sim_.destroy_stream(s); }
  void fill(StreamId s, DevOffset dst, Bytes n, std::uint32_t pattern, unsigned width) override {
    touch(dst, n);
    sim_.fill(s, dst, n, pattern, width);
  }
  void copy(StreamId s, DevOffset dst, DevOffset src, Bytes n) override {
    touch(dst, n);
    touch(src, n);
    sim_.copy(s, dst, src, n);
  }
  void spin(StreamId s, std::uint64_t usec, double util) override { sim_.spin(s, usec, util); }
  void gemm(StreamId s, std::uint32_t m, std::uint32_t n, std::uint32_t k, DevOffset a, DevOffset b,
            DevOffset c) override {
    sim_.gemm(s, m, n, k, a, b, c);
  }
  void copy_to_host(StreamId s, void* host, DevOffset src, Bytes n) override {
    touch(src, n);
    sim_.copy_to_host(s, host, src, n);
  }
  void copy_from_host(StreamId s, DevOffset dst, const void* host, Bytes n) override {
    touch(dst, n);
    sim_.copy_from_host(s, dst, host, n);
  }
  void notify(StreamId s, std::uint64_t token) override { sim_.notify(s, token); }
  void discard(DevOffset offset, Bytes n) override {
    touch(offset, n);
    sim_.discard(offset, n);
  }
  std::int64_t busy_ns() const override { return sim_.busy_ns(); }

  int set_backing(const std::vector<arena::ByteRange>& held, std::string& why) override {
    if (const int us = delay_us_.load(); us > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    {
      // A driver mapping gigabytes, for as long as the test says.
      std::unique_lock hold(hold_mu_);
      if (hold_) {
        blocked_ = true;
        hold_cv_.wait(hold, [&] { return !hold_; });
        blocked_ = false;
      }
    }
    std::lock_guard lk(mu_);
    ++calls_;
    const auto wanted = arena::chunks_covering(held, kChunk);
    std::vector<bool> next(info_.arena_size / kChunk + 1);
    for (const arena::ChunkRun& r : wanted)
      for (std::uint64_t i = r.first; i < r.first + r.count; ++i) next[i] = true;
    Bytes add = 0;
    for (std::size_t i = 0; i < next.size(); ++i)
      if (next[i] && !(i < backed_.size() && backed_[i])) add += kChunk;
    if (add > 0 && room_ < ~Bytes{0} && backed_bytes_locked() + add > room_) {
      why = "no room on the card";
      return ENOMEM;
    }
    backed_ = std::move(next);
    return 0;
  }
  Bytes backed_bytes() const override {
    std::lock_guard lk(mu_);
    return backed_bytes_locked();
  }

  std::uint64_t backing_epoch() const override { return epoch_.load(); }
  // What a restarted executor that could not back the arena again looks like.
  void lose_backing() {
    std::lock_guard lk(mu_);
    backed_.clear();
    ++epoch_;
  }

  void hold_backing() {
    std::lock_guard lk(hold_mu_);
    hold_ = true;
  }
  void release_backing() {
    {
      std::lock_guard lk(hold_mu_);
      hold_ = false;
    }
    hold_cv_.notify_all();
  }
  bool backing_blocked() const { return blocked_.load(); }
  // Whether a set_backing call comes to the hold within a second.
  bool blocked_soon() const {
    for (int i = 0; i < 500 && !backing_blocked(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return backing_blocked();
  }

  // Each set_backing takes this long, as a driver mapping many chunks does.
  void set_delay(std::chrono::microseconds d) { delay_us_ = static_cast<int>(d.count()); }
  void limit_room(Bytes room) {
    std::lock_guard lk(mu_);
    room_ = room;
  }
  int violations() const { return violations_.load(); }
  int calls() const {
    std::lock_guard lk(mu_);
    return calls_;
  }

 private:
  Bytes backed_bytes_locked() const {
    Bytes n = 0;
    for (bool b : backed_) n += b ? kChunk : 0;
    return n;
  }
  void touch(DevOffset offset, Bytes n) {
    if (n == 0) return;
    std::lock_guard lk(mu_);
    for (Bytes i = offset / kChunk; i <= (offset + n - 1) / kChunk; ++i)
      if (i >= backed_.size() || !backed_[i]) {
        ++violations_;
        return;
      }
  }

  SimDevice sim_;
  DeviceInfo info_;
  mutable std::mutex mu_;
  std::vector<bool> backed_;
  Bytes room_ = ~Bytes{0};
  int calls_ = 0;
  std::atomic<int> violations_{0};
  std::atomic<std::uint64_t> epoch_{0};
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  bool hold_ = false;
  std::atomic<bool> blocked_{false};
  std::atomic<int> delay_us_{0};
};

const Caller kAlice{1000, 1000, 0, false};

struct Fixture {
  BackingDevice* dev = nullptr;
  std::unique_ptr<Broker> broker;
  explicit Fixture(BrokerConfig config = {}) {
    auto d = std::make_unique<BackingDevice>(Bytes{64} << 20);
    dev = d.get();
    std::vector<std::unique_ptr<Device>> devs;
    devs.push_back(std::move(d));
    broker = std::make_unique<Broker>(std::move(devs), std::move(config));
  }
  std::vector<char> read(SessionId id, const std::string& name, Bytes n) {
    const auto buf = broker->find_buffer(id, name);
    if (!buf) return {};
    std::promise<std::vector<char>> p;
    broker->read_buffer(id, buf->id, 0, n, [&p](int err, std::span<const char> data) {
      p.set_value(err ? std::vector<char>{} : std::vector<char>(data.begin(), data.end()));
    });
    return p.get_future().get();
  }
  std::pair<int, std::string> run(SessionId id, const std::string& text) {
    return test::run_commands(*broker, id, text, kAlice);
  }
  // Whether the device backs exactly `bytes` within `limit` (memory goes back
  // to the card a moment after it is freed).
  bool backed_within(Bytes bytes, std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (dev->backed_bytes() != bytes && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return dev->backed_bytes() == bytes;
  }
};

TEST(BrokerBacking, NoOpEverTouchesMemoryThatIsNotBacked) {
  Fixture f;
  EXPECT_EQ(f.dev->backed_bytes(), 0u);
  std::vector<SessionId> ids;
  for (int i = 0; i < 3; ++i) {
    const auto id = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
    ids.push_back(id);
    ASSERT_EQ(f.run(id, "need persistent=8M ephemeral=4M\nalloc a 3M\nalloc b 1M\n").first, 0);
    ASSERT_EQ(f.run(id,
                    "fill a 7 dtype=i32\nbegin\nfill b 1 dtype=u8\ncopy b a 4096\n"
                    "end x20\nfree a\nalloc c 5M\nfill c 3 dtype=u8\n")
                  .first,
              0);
  }
  for (SessionId id : ids) ASSERT_EQ(test::wait_session(*f.broker, id).first, 0);
  EXPECT_EQ(f.dev->violations(), 0);
  EXPECT_GT(f.dev->backed_bytes(), 0u);
  for (SessionId id : ids) f.broker->end_session(id);
  // What is no longer held goes back to the card once it has stayed free 200 ms.
  const auto id = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(id, "need persistent=1M ephemeral=0\nalloc z 4K\n").first, 0);
  EXPECT_TRUE(f.backed_within(kChunk, std::chrono::seconds(3))) << f.dev->backed_bytes();
  EXPECT_EQ(f.dev->violations(), 0);
}

TEST(BrokerBacking, ACardWithNoRoomFailsTheAllocationClearlyAndLosesNothing) {
  Fixture f;
  const auto id = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(id, "need persistent=32M ephemeral=0\nalloc a 4M\nfill a 9 dtype=u8\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, id).first, 0);
  f.dev->limit_room(Bytes{6} << 20);
  auto [err, reply] = f.run(id, "alloc b 4M\n");
  EXPECT_EQ(err, ENOMEM);
  EXPECT_NE(f.broker->render_log(id).find("has no card memory to back it: no room on the card"),
            std::string::npos)
      << f.broker->render_log(id);
  f.dev->limit_room(~Bytes{0});
  // The card is tried again for the same memory at most every 50 ms.
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  ASSERT_EQ(f.run(id, "alloc b 4M\ncopy b a 4M\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, id).first, 0);
  EXPECT_EQ(f.dev->violations(), 0);
  EXPECT_EQ(f.dev->backed_bytes(), Bytes{8} << 20);
}

// Backing gigabytes takes the driver long (salus-bench backing): it runs off the
// broker lock, so that while one session's new buffer is being backed, another
// session's status, commands and work on memory already backed go on; only the
// allocating write waits, and gets its memory with nothing touched unbacked.
TEST(BrokerBacking, WhileNewMemoryIsBackedEveryoneElseGoesOn) {
  Fixture f;
  const auto a = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  const auto b = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(a, "need persistent=32M ephemeral=0\nalloc small 1M\n").first, 0);
  ASSERT_EQ(f.run(b, "need persistent=8M ephemeral=2M\nalloc x 1M\nfill x 1 dtype=u8\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, b).first, 0);
  f.dev->hold_backing();
  auto big = std::async(std::launch::async,
                        [&] { return f.run(a, "alloc big 20M\nfill big 5 dtype=u8\n"); });
  ASSERT_TRUE(f.dev->blocked_soon()) << "the allocation never asked the device for memory";
  // The device is busy backing a's buffer: b is served meanwhile.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(f.broker->render_status(b).find("state: admitted"), std::string::npos);
  ASSERT_EQ(f.run(b, "begin\nfill x 2 dtype=u8\nend x5\nfill x 3 dtype=u8\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, b).first, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(f.read(b, "x", 1)[0], 3);
  EXPECT_EQ(big.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "the allocation returned before its memory was backed";
  f.dev->release_backing();
  ASSERT_EQ(big.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(big.get().first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, a).first, 0);
  const auto v = f.read(a, "big", Bytes{20} << 20);
  ASSERT_EQ(v.size(), Bytes{20} << 20);
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](char c) { return c == 5; }));
  EXPECT_EQ(f.dev->violations(), 0);
}

// A job for a new lane holds up only the work that needs that lane: another
// session's iterations on memory already backed go out meanwhile.
TEST(BrokerBacking, ANewLaneBeingBackedHoldsUpOnlyItsOwnWork) {
  Fixture f;
  const auto b = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(b, "need persistent=4M ephemeral=2M\nalloc x 1M\nfill x 1 dtype=u8\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, b).first, 0);
  f.dev->hold_backing();
  const auto c = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(c,
                  "need persistent=1M ephemeral=20M\nbegin\nalloc e 16M\nfill e 4 dtype=u8\n"
                  "end\n")
                .first,
            0);
  auto c_done = std::async(std::launch::async, [&] { return test::wait_session(*f.broker, c); });
  ASSERT_TRUE(f.dev->blocked_soon()) << "c's lane never asked the device for memory";
  ASSERT_EQ(f.run(b, "begin\nfill x 2 dtype=u8\nend x5\n").first, 0);
  auto b_done = std::async(std::launch::async, [&] { return test::wait_session(*f.broker, b); });
  ASSERT_EQ(b_done.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "b waited for the job backing c's lane";
  EXPECT_EQ(b_done.get().first, 0);
  EXPECT_EQ(c_done.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "c's iteration ran before its lane was backed";
  f.dev->release_backing();
  ASSERT_EQ(c_done.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(c_done.get().first, 0);
  EXPECT_EQ(f.dev->violations(), 0);
}

// Compaction copies within memory already backed go out while a job backs a
// new lane: a fragmented allocation waits for its compaction, not for another
// session's new memory.
TEST(BrokerBacking, CompactionWithinBackedMemoryDoesNotWaitForANewLane) {
  Fixture f;
  const auto x = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(x, "need persistent=40M ephemeral=0\n").first, 0);
  for (int i = 1; i <= 5; ++i)
    ASSERT_EQ(f.run(x, fmt::format("alloc b{} 8M\nfill b{} {} dtype=u8\n", i, i, i)).first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, x).first, 0);
  ASSERT_EQ(f.run(x, "free b2\nfree b4\n").first, 0);
  f.dev->hold_backing();
  const auto c = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(
      f.run(c, "need persistent=1M ephemeral=20M\nbegin\nalloc e 16M\nfill e 4 dtype=u8\nend\n")
          .first,
      0);
  auto c_done = std::async(std::launch::async, [&] { return test::wait_session(*f.broker, c); });
  ASSERT_TRUE(f.dev->blocked_soon()) << "c's lane never asked the device for memory";
  // 12M fits x's reservation but no hole: compaction first, inside what is backed.
  auto big = std::async(std::launch::async, [&] { return f.run(x, "alloc big 12M\n"); });
  ASSERT_EQ(big.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "the compaction waited for the job backing c's lane";
  EXPECT_EQ(big.get().first, 0) << f.broker->render_log(x);
  EXPECT_EQ(f.broker->render_stats().find("\npersistent_bytes_moved 0\n"), std::string::npos)
      << "no compaction ran";
  EXPECT_EQ(c_done.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "c's iteration ran before its lane was backed";
  f.dev->release_backing();
  ASSERT_EQ(c_done.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(c_done.get().first, 0);
  for (int i : {1, 3, 5}) {
    const auto v = f.read(x, fmt::format("b{}", i), Bytes{8} << 20);
    ASSERT_EQ(v.size(), Bytes{8} << 20);
    EXPECT_TRUE(std::all_of(v.begin(), v.end(), [i](char ch) { return ch == i; })) << "b" << i;
  }
  EXPECT_EQ(f.dev->violations(), 0);
}

// Seeded random work of three sessions (allocations, frees, iterations,
// copies) while backing jobs take a random while and the card's room comes
// and goes: no op ever touches memory that is not backed, every write is
// answered, a failure is only ever ENOMEM, and every byte written last is read
// back.
TEST(BrokerBacking, RandomWorkWithSlowAndFailingBackingTouchesOnlyBackedMemory) {
  for (const unsigned seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(fmt::format("seed {}", seed));
    BrokerConfig config;
    config.give_back_delay_ns = 10'000'000;  // more jobs: memory goes back sooner
    Fixture f(config);
    std::mt19937 pick(seed);
    f.dev->set_delay(std::chrono::microseconds(500 + pick() % 2500));
    std::atomic<bool> done{false};
    std::thread room([&] {
      std::mt19937 r(seed * 7);
      while (!done) {  // roomy for 30-60 ms, then no new memory for 10-25 ms
        f.dev->limit_room(~Bytes{0});
        std::this_thread::sleep_for(std::chrono::milliseconds(30 + r() % 30));
        f.dev->limit_room(f.dev->backed_bytes());
        std::this_thread::sleep_for(std::chrono::milliseconds(10 + r() % 15));
      }
      f.dev->limit_room(~Bytes{0});
    });
    struct Live {
      std::string name;
      Bytes size;
      int value;
    };
    std::vector<std::vector<Live>> live(3);
    std::vector<SessionId> ids;
    for (int i = 0; i < 3; ++i) {
      ids.push_back(static_cast<SessionId>(f.broker->create_session(kAlice, "")));
      ASSERT_EQ(f.run(ids.back(), "need persistent=12M ephemeral=4M\n").first, 0);
    }
    std::atomic<int> oks{0};
    auto work = [&](int i) {
      std::mt19937 r(seed * 100 + static_cast<unsigned>(i));
      std::vector<Live>& mine = live[static_cast<std::size_t>(i)];
      for (int op = 0, next = 0; op < 30; ++op) {
        std::this_thread::sleep_for(std::chrono::microseconds(2000 + r() % 10000));
        const unsigned what = r() % 4;
        std::pair<int, std::string> res;
        if (what == 0 || mine.empty()) {
          if (mine.size() >= 3) continue;
          const Live b{fmt::format("b{}", next++), Bytes{1 + r() % 3} << 20,
                       static_cast<int>(1 + r() % 100)};
          res = f.run(
              ids[static_cast<std::size_t>(i)],
              fmt::format("alloc {} {}\nfill {} {} dtype=u8\n", b.name, b.size, b.name, b.value));
          if (res.first == 0) mine.push_back(b);
        } else if (what == 1) {
          const std::size_t k = r() % mine.size();
          res = f.run(ids[static_cast<std::size_t>(i)], fmt::format("free {}\n", mine[k].name));
          if (res.first == 0) mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        } else {
          Live& b = mine[r() % mine.size()];
          const int v = static_cast<int>(1 + r() % 100);
          res = f.run(ids[static_cast<std::size_t>(i)],
                      fmt::format("begin\nalloc t 1M\nfill t {} dtype=u8\ncopy {} t 4096\nend x2\n"
                                  "fill {} {} dtype=u8\n",
                                  v, b.name, b.name, v));
          if (res.first == 0) b.value = v;
        }
        if (res.first == 0) ++oks;
        EXPECT_TRUE(res.first == 0 || res.first == ENOMEM)
            << "session " << i << " op " << op << ": " << res.first << " " << res.second;
      }
    };
    std::vector<std::thread> threads;
    for (int i = 0; i < 3; ++i) threads.emplace_back(work, i);
    for (auto& t : threads) t.join();
    EXPECT_GT(oks.load(), 30) << "too little work got through to test anything";
    done = true;
    room.join();
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(test::wait_session(*f.broker, ids[static_cast<std::size_t>(i)]).first, 0);
      for (const Live& b : live[static_cast<std::size_t>(i)]) {
        const auto v = f.read(ids[static_cast<std::size_t>(i)], b.name, b.size);
        ASSERT_EQ(v.size(), b.size) << b.name;
        EXPECT_EQ(v.front(), b.value) << b.name;
        EXPECT_EQ(v.back(), b.value) << b.name;
      }
    }
    EXPECT_EQ(f.dev->violations(), 0);
  }
}

// Memory a hosted session freed stays backed for a moment (a retry finds it
// still there), unless the room is promised: an attached program admitted into
// it allocates from its own context at once, and the driver would refuse it
// while salusd still holds the memory. Then it goes back to the card at once.
TEST(BrokerBacking, RoomPromisedToAnAttachedProgramGoesBackToTheCardAtOnce) {
  BrokerConfig config;
  config.give_back_delay_ns = 60'000'000'000;  // here only a promise gives memory back
  Fixture f(config);
  const auto h = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(h, "need persistent=40M ephemeral=0\nalloc a 32M\nfill a 1 dtype=u8\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, h).first, 0);
  ASSERT_GE(f.dev->backed_bytes(), Bytes{32} << 20);
  // Freed within a hosted reservation that fills the card: nobody else was
  // promised it, so it stays for the delay.
  ASSERT_EQ(f.run(h, "free a\nneed persistent=60M ephemeral=0\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, h).first, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_GE(f.dev->backed_bytes(), Bytes{32} << 20) << "given back before the delay";
  f.broker->end_session(h);
  // A program that fits beside what is still backed: nothing needs to go back.
  const auto small = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(small, "need persistent=8M ephemeral=0 kind=attached\n").first, 0);
  EXPECT_NE(f.broker->render_status(small).find("state: admitted"), std::string::npos);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_GE(f.dev->backed_bytes(), Bytes{32} << 20) << "given back before the delay";
  // One that needs the memory still backed: it goes back now.
  const auto large = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(large, "need persistent=40M ephemeral=0 kind=attached\n").first, 0);
  EXPECT_NE(f.broker->render_status(large).find("state: admitted"), std::string::npos);
  EXPECT_TRUE(f.backed_within(0, std::chrono::seconds(3))) << f.dev->backed_bytes();
  EXPECT_EQ(f.dev->violations(), 0);
}

// A restarted executor that could not back the arena again: the layout did not
// change, but no op may touch held memory until the device is told again; while
// the card has no room for it, work waits.
TEST(BrokerBacking, WorkWaitsUntilADeviceThatLostItsBackingIsBackedAgain) {
  Fixture f;
  const auto id = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  ASSERT_EQ(f.run(id, "need persistent=32M ephemeral=0\nalloc a 4M\nfill a 9 dtype=u8\n").first, 0);
  ASSERT_EQ(test::wait_session(*f.broker, id).first, 0);
  const Bytes backed = f.dev->backed_bytes();
  f.dev->lose_backing();
  f.dev->limit_room(0);
  ASSERT_EQ(f.run(id, "fill a 3 dtype=u8\n").first, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(f.dev->violations(), 0) << "an op ran on memory the device lost";
  EXPECT_EQ(f.dev->backed_bytes(), 0u);
  f.dev->limit_room(~Bytes{0});
  ASSERT_EQ(test::wait_session(*f.broker, id).first, 0);
  EXPECT_EQ(f.dev->violations(), 0);
  EXPECT_EQ(f.dev->backed_bytes(), backed);
  EXPECT_EQ(f.read(id, "a", 4)[0], 3);
}

TEST(BrokerBacking, ASwapInWithoutRoomOnTheCardWaitsSwappedAndKeepsEveryByte) {
  BrokerConfig config;
  config.arena.oversubscribe = 2;
  Fixture f(config);
  const auto a = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  const auto b = static_cast<SessionId>(f.broker->create_session(kAlice, ""));
  // 38M + 28M on a 64M card: one of them resident at a time.
  ASSERT_EQ(f.run(a, "need persistent=36M ephemeral=2M\nalloc w 36M\nfill w 17 dtype=u8\n").first,
            0);
  ASSERT_EQ(test::wait_session(*f.broker, a).first, 0);
  ASSERT_EQ(f.run(b, "need persistent=26M ephemeral=2M\nalloc w 26M\nfill w 34 dtype=u8\n").first,
            0);  // a is swapped out for it
  ASSERT_EQ(test::wait_session(*f.broker, b).first, 0);
  // a's memory goes back to the card a moment after a left; then no more room
  // than b's: once b is out, a's swap-in needs memory the card cannot give, so
  // a goes back to swapped and waits.
  for (int i = 0; i < 300 && f.dev->backed_bytes() >= (Bytes{36} << 20); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_LT(f.dev->backed_bytes(), Bytes{36} << 20) << "a's memory was never given back";
  f.dev->limit_room(f.dev->backed_bytes());
  std::promise<std::pair<int, std::string>> done;
  auto waited = done.get_future();
  ASSERT_EQ(f.run(a, "begin\ncopy w w+1M 1M\nend x3\n").first, 0);
  std::thread([&] { done.set_value(test::wait_session(*f.broker, a)); }).detach();
  // After b's resident quantum the planner swaps b out and tries a in: in vain.
  bool waits = false;
  for (int i = 0; i < 1000 && !waits; ++i) {
    waits = f.broker->render_gpu_memory(0).find("backing_wait: no room on the card") !=
            std::string::npos;
    if (!waits) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(waits) << f.broker->render_gpu_memory(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a few retries
  EXPECT_EQ(waited.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  EXPECT_NE(f.broker->render_status(a).find("residency: swapped"), std::string::npos)
      << f.broker->render_status(a);
  f.dev->limit_room(~Bytes{0});
  ASSERT_EQ(waited.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(waited.get().first, 0);
  const auto wa = f.read(a, "w", Bytes{1} << 20);
  ASSERT_EQ(wa.size(), Bytes{1} << 20);
  EXPECT_TRUE(std::all_of(wa.begin(), wa.end(), [](char c) { return c == 17; }));
  const auto wb = f.read(b, "w", Bytes{1} << 20);
  ASSERT_EQ(wb.size(), Bytes{1} << 20);
  EXPECT_TRUE(std::all_of(wb.begin(), wb.end(), [](char c) { return c == 34; }));
  EXPECT_EQ(f.dev->violations(), 0);
}

}  // namespace
