// Named sessions across a restart, without FUSE: session.state's format and
// parser, and a save by one broker restored by another (sim devices), including
// a save cut off before its commit and corrupt state set aside.
#include "vgpu/store/session_store.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>

#include "fusefs/command_parser.hpp"
#include "vgpu/broker/broker.hpp"
#include "vgpu/sim/sim_device.hpp"

using namespace salus;
using namespace salus::vgpu;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// `user_priority_max`: the populated broker lets alice give her session priority 3;
// the brokers that restore it keep salusd's default, 0, so a restore that ran as
// alice would be refused it.
std::unique_ptr<Broker> make_broker(std::int32_t user_priority_max = 0) {
  std::vector<std::unique_ptr<Device>> devs;
  devs.push_back(std::make_unique<SimDevice>(0, Bytes{256} << 20));
  BrokerConfig cfg;
  cfg.user_priority_max = user_priority_max;
  return std::make_unique<Broker>(std::move(devs), cfg);
}

const Caller kAlice{1000, 1001, ::getpid(), false};

int run(Broker& b, SessionId id, const std::string& text) {
  auto parsed = fusefs::parse_commands(text);
  EXPECT_FALSE(parsed.error) << text;
  std::promise<int> p;
  auto f = p.get_future();
  b.submit(id, kAlice, text.size(), std::move(parsed.commands), std::nullopt,
           [&p](int err, std::string) { p.set_value(err); });
  return f.wait_for(10s) == std::future_status::ready ? f.get() : ETIMEDOUT;
}

std::string read_all(Broker& b, SessionId id, const std::string& name) {
  const auto v = b.find_buffer(id, name);
  if (!v) return "<no buffer>";
  std::promise<std::string> p;
  auto f = p.get_future();
  b.read_buffer(id, v->id, 0, v->size, [&p](int err, std::span<const char> d) {
    p.set_value(err ? "<error>" : std::string(d.data(), d.size()));
  });
  return f.wait_for(10s) == std::future_status::ready ? f.get() : "<timeout>";
}

void write_all(Broker& b, SessionId id, const std::string& name, const std::string& data) {
  const auto v = b.find_buffer(id, name);
  ASSERT_TRUE(v);
  std::promise<int> p;
  auto f = p.get_future();
  b.write_buffer(id, v->id, 0, data.data(), data.size(),
                 [&p](int err, Bytes) { p.set_value(err); });
  ASSERT_EQ(f.get(), 0);
}

std::string random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

class SessionStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/salus-store-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/state";
  }
  void TearDown() override { fs::remove_all(base_); }

  // A broker with session "model": need, priority, two buffers with data.
  std::unique_ptr<Broker> populated(const std::string& w, const std::string& b) {
    auto br = make_broker(3);
    const auto id = static_cast<SessionId>(br->create_session(kAlice, "model"));
    EXPECT_EQ(run(*br, id,
                  fmt::format("need persistent=64M ephemeral=8M iters=500 name=resnet\npriority 3\n"
                              "alloc w {}\nalloc bias {}\n",
                              w.size(), b.size())),
              0);
    EXPECT_GT(br->create_buffer(id, kAlice, "empty"), 0);  // a mem/ file never resized
    write_all(*br, id, "w", w);
    write_all(*br, id, "bias", b);
    br->create_session(kAlice, "");  // a clone session: not saved
    return br;
  }

  std::string base_, dir_;
};

}  // namespace

TEST(SessionState, RoundTripsAndRejectsWhatIsMalformed) {
  SavedSession s;
  s.name = "model";
  s.uid = 1000;
  s.gid = 1001;
  s.need_declared = true;
  s.persistent = 64 << 20;
  s.ephemeral = 8 << 20;
  s.iters = 500;
  s.gpu = 1;
  s.label = "resnet";
  s.priority = -2;
  s.buffers = {{"w", 4096, 0x0123456789abcdefULL}, {"empty", 0, kHashStart}};
  const std::string text = format_session_state(s);
  std::string why;
  const auto back = parse_session_state(text, why);
  ASSERT_TRUE(back) << why << "\n" << text;
  EXPECT_EQ(format_session_state(*back), text);
  EXPECT_EQ(back->uid, 1000u);
  EXPECT_EQ(back->gid, 1001u);
  EXPECT_EQ(back->iters, std::optional<std::uint64_t>(500));
  EXPECT_EQ(back->gpu, std::optional<int>(1));
  EXPECT_EQ(back->label, std::optional<std::string>("resnet"));
  EXPECT_EQ(back->priority, -2);
  ASSERT_EQ(back->buffers.size(), 2u);
  EXPECT_EQ(back->buffers[0].hash, 0x0123456789abcdefULL);

  const std::string bad[] = {
      "",
      text.substr(0, text.size() - 4),                               // truncated: no end
      "salus-session-state 2\n" + text.substr(text.find('\n') + 1),  // another version
      text + "extra\n",
      std::string(text).replace(text.find("owner 1000"), 10, "owner -1  "),
      std::string(text).replace(text.find("buffer w"), 8, "buffer ."),  // invalid name
      std::string(text).replace(text.find("buffers 2"), 9, "buffers 3"),
      std::string(text).replace(text.find("name model"), 10, "name ../x "),
      std::string(text).replace(text.find("name=resnet"), 11, "name=../etc"),
  };
  for (const auto& t : bad) {
    why.clear();
    EXPECT_FALSE(parse_session_state(t, why)) << t;
    EXPECT_FALSE(why.empty());
  }
}

TEST(StateHash, SeesEveryByteAndItsPlace) {
  std::string a = random_bytes(1000, 7);
  const auto h = state_hash(kHashStart, a.data(), a.size());
  EXPECT_EQ(h, state_hash(kHashStart, a.data(), a.size()));
  for (std::size_t i : {0, 31, 32, 500, 995, 999}) {
    std::string b = a;
    b[i] ^= 1;
    EXPECT_NE(state_hash(kHashStart, b.data(), b.size()), h) << i;
  }
  std::string swapped = a;
  std::swap(swapped[0], swapped[8]);  // same bytes, another lane
  EXPECT_NE(state_hash(kHashStart, swapped.data(), swapped.size()), h);
  EXPECT_NE(state_hash(kHashStart, a.data(), 999), h);  // length counts
}

TEST_F(SessionStoreTest, ANamedSessionSurvivesARestartByteForByte) {
  const std::string w = random_bytes(3 << 20, 1), b = random_bytes(4096, 2);
  {
    auto br = populated(w, b);
    const auto r = save_sessions(*br, dir_, 5s);
    EXPECT_EQ(r.error, 0) << r.why;
    EXPECT_EQ(r.sessions, 1u);
    EXPECT_EQ(r.bytes, w.size() + b.size());
    br->shutdown(1s);
  }
  struct stat st;
  ASSERT_EQ(::stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat((dir_ + "/sessions/model/buf-0").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());  // salusd's own files, whoever the session's owner

  auto br = make_broker();
  const auto r = restore_sessions(*br, dir_, 5s);
  EXPECT_EQ(r.sessions, 1u);
  EXPECT_EQ(r.skipped, 0u);
  const auto id = br->find_session("model");
  ASSERT_TRUE(id);
  EXPECT_EQ(br->session_owner(*id), std::make_optional(std::make_pair(uid_t{1000}, gid_t{1001})));
  EXPECT_TRUE(br->session_is_named(*id));
  EXPECT_EQ(read_all(*br, *id, "w"), w);
  EXPECT_EQ(read_all(*br, *id, "bias"), b);
  EXPECT_EQ(br->find_buffer(*id, "empty")->size, 0u);
  const std::string status = br->render_status(*id);
  EXPECT_NE(status.find("state: admitted"), std::string::npos) << status;
  EXPECT_NE(status.find("priority: 3"), std::string::npos) << status;
  EXPECT_NE(status.find("name: resnet"), std::string::npos) << status;
  EXPECT_NE(br->render_log(*id).find("restored after a restart"), std::string::npos);
  // Only named sessions come back.
  EXPECT_EQ(br->list_sessions().size(), 1u);
  // The owner can use it as before.
  EXPECT_EQ(run(*br, *id, "fill bias 7 dtype=u8\n"), 0);
  br->shutdown(1s);
}

TEST_F(SessionStoreTest, ASaveCutOffBeforeItsCommitLeavesThePreviousState) {
  const std::string w = random_bytes(1 << 20, 3);
  {
    auto br = populated(w, "x");
    ASSERT_EQ(save_sessions(*br, dir_, 5s).error, 0);
    br->shutdown(1s);
  }
  // What a SIGKILL in the middle of the next save leaves: a partial sessions.new.
  fs::create_directories(dir_ + "/sessions.new/model");
  std::ofstream(dir_ + "/sessions.new/model/buf-0") << "half";
  auto br = make_broker();
  EXPECT_EQ(restore_sessions(*br, dir_, 5s).sessions, 1u);
  EXPECT_FALSE(fs::exists(dir_ + "/sessions.new"));
  const auto id = br->find_session("model");
  ASSERT_TRUE(id);
  EXPECT_EQ(read_all(*br, *id, "w"), w);
  br->shutdown(1s);
}

TEST_F(SessionStoreTest, CorruptStateIsSetAsideNeverACrash) {
  {
    auto br = populated(random_bytes(8192, 4), "b");
    const auto id = static_cast<SessionId>(br->create_session(kAlice, "other"));
    ASSERT_EQ(run(*br, id, "need persistent=1M ephemeral=1M\nalloc v 4K\n"), 0);
    br->create_session(kAlice, "idle");  // no need yet: comes back idle
    ASSERT_EQ(save_sessions(*br, dir_, 5s).sessions, 3u);
    br->shutdown(1s);
  }
  // One flipped byte in model's data; other's state file cut short.
  {
    std::fstream f(dir_ + "/sessions/model/buf-2", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
    f.seekp(101);
    f.put('\xa5');
  }
  fs::resize_file(dir_ + "/sessions/other/session.state", 30);
  auto br = make_broker();
  const auto r = restore_sessions(*br, dir_, 5s);
  EXPECT_EQ(r.sessions, 1u);
  EXPECT_EQ(r.skipped, 2u);
  EXPECT_FALSE(br->find_session("model"));
  EXPECT_FALSE(br->find_session("other"));
  const auto idle = br->find_session("idle");
  ASSERT_TRUE(idle);
  EXPECT_NE(br->render_status(*idle).find("state: idle"), std::string::npos);
  // Set aside, not deleted, and no longer in the way of the next start.
  std::size_t aside = 0;
  for (const auto& e : fs::directory_iterator(dir_ + "/set-aside")) aside += e.is_directory();
  EXPECT_EQ(aside, 2u);
  EXPECT_FALSE(fs::exists(dir_ + "/sessions/model"));
  br->shutdown(1s);
}

// With no grace period left, an idle session is still saved (its data must
// move), and one whose queued work runs on is left out rather than waited for.
TEST_F(SessionStoreTest, ASaveWithoutGraceSkipsOnlySessionsStillWorking) {
  auto br = populated(random_bytes(4096, 5), "b");
  const auto id = static_cast<SessionId>(br->create_session(kAlice, "busy"));
  ASSERT_EQ(run(*br, id, "need persistent=1M ephemeral=1M\nalloc v 4K\n"), 0);
  auto parsed = fusefs::parse_commands("begin\nspin 3000000\nend\n");
  br->submit(id, kAlice, 0, std::move(parsed.commands), std::nullopt, [](int, std::string) {});
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = save_sessions(*br, dir_, 0ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2500ms);
  EXPECT_EQ(r.sessions, 1u);
  EXPECT_EQ(r.skipped, 1u);
  EXPECT_TRUE(fs::exists(dir_ + "/sessions/model/session.state"));
  EXPECT_FALSE(fs::exists(dir_ + "/sessions/busy"));
  br->shutdown(0ms);
}

TEST_F(SessionStoreTest, RefusesAStateDirOthersCanRead) {
  fs::create_directories(dir_);
  ::chmod(dir_.c_str(), 0755);
  auto br = make_broker();
  br->create_session(kAlice, "model");
  const auto r = save_sessions(*br, dir_, 1s);
  EXPECT_EQ(r.error, EACCES);
  EXPECT_NE(r.why.find("must be salusd's own"), std::string::npos) << r.why;
  EXPECT_EQ(restore_sessions(*br, dir_, 1s).error, EACCES);
  EXPECT_FALSE(fs::exists(dir_ + "/sessions"));
  br->shutdown(1s);
}
