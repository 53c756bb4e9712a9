// The transfer engine on a sim device: uploads and downloads through staging in
// many chunks, files created when the transfer runs, a source that shrank, a
// device fault, cancellation and stop, and that staging always goes back.
#include "vgpu/transfer/transfer_engine.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "tests/support/recording_sink.hpp"
#include "vgpu/sim/sim_device.hpp"

using namespace salus::vgpu;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

constexpr Bytes kKiB = 1024, kMiB = 1024 * 1024;

// Completions of the engine's streams go to the engine, the test's own to it.
using Sink = salus::test::RecordingSink;

class TransferEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/salus-engine-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    char shm_tmpl[] = "/dev/shm/salus-engine-XXXXXX";  // segments live on tmpfs
    ASSERT_NE(::mkdtemp(shm_tmpl), nullptr);
    shm_dir_ = shm_tmpl;
    dev_ = std::make_unique<SimDevice>(0, 64 * kMiB);
    dev_->set_sink(&sink_);
    stream_ = dev_->create_stream();
    pool_ = std::make_unique<StagingPool>(*dev_, 4 * kMiB);
  }
  void TearDown() override {
    engine_.reset();
    sink_.forward = nullptr;
    dev_->destroy_stream(stream_);
    pool_.reset();
    dev_.reset();
    fs::remove_all(dir_);
    fs::remove_all(shm_dir_);
  }
  // Files go through staging unless `view`: the path every backend but sim takes.
  // Completions of the engine's own streams go to the engine.
  void route_to_engine() {
    sink_.forward = [e = engine_.get()](StreamId stream, std::uint64_t token, int status,
                                        std::int64_t ns) {
      if (!e->owns_stream(stream)) return false;
      e->on_device_complete(stream, token, status, ns);
      return true;
    };
  }
  void make_engine(Bytes chunk = 64 * kKiB, unsigned active = 2, Bytes segment_cache = 64 * kMiB,
                   bool view = false) {
    TransferEngine::Options o{chunk, active};
    o.segment_cache = segment_cache;
    o.device_view = view;
    o.direct_chunk = 256 * kKiB;  // several direct copies per test transfer
    engine_ = std::make_unique<TransferEngine>(*dev_, *pool_, o, 0);
    route_to_engine();
  }
  static std::vector<char> random_bytes(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<char> v(n);
    for (auto& c : v) c = static_cast<char>(rng());
    return v;
  }
  std::string write_file(const std::string& name, const std::vector<char>& data) {
    const std::string p = dir_ + "/" + name;
    std::ofstream(p, std::ios::binary)
        .write(data.data(), static_cast<std::streamsize>(data.size()));
    return p;
  }
  std::vector<char> device_bytes(DevOffset at, Bytes n) {
    std::vector<char> v(n);
    dev_->copy_to_host(stream_, v.data(), at, n);
    const std::uint64_t token = next_token_++;
    dev_->notify(stream_, token);
    EXPECT_EQ(sink_.status_of(token), 0);
    return v;
  }
  void put_device(DevOffset at, const std::vector<char>& v) {
    dev_->copy_from_host(stream_, at, v.data(), v.size());
    const std::uint64_t token = next_token_++;
    dev_->notify(stream_, token);
    ASSERT_EQ(sink_.status_of(token), 0);
  }
  static CallerCredentials root() { return CallerCredentials{}; }
  std::shared_ptr<TransferJob> job(bool upload, const std::string& path, Bytes file_off,
                                   DevOffset dev_off, Bytes length) {
    return job_as(upload ? FileIntent::read : FileIntent::write, upload, path, file_off, dev_off,
                  length);
  }
  // A shared-memory segment of session `session`, opened as transfer_endpoint
  // opens one (a download reads and writes it).
  std::shared_ptr<TransferJob> shm_job(bool upload, const std::string& path, Bytes file_off,
                                       DevOffset dev_off, Bytes length, std::uint64_t session = 7) {
    auto j = job_as(upload ? FileIntent::read : FileIntent::read_write, upload, path, file_off,
                    dev_off, length);
    j->shm = true;
    j->session = session;
    j->shown = "shm:" + path;
    return j;
  }
  std::shared_ptr<TransferJob> job_as(FileIntent intent, bool upload, const std::string& path,
                                      Bytes file_off, DevOffset dev_off, Bytes length) {
    auto j = std::make_shared<TransferJob>();
    j->upload = upload;
    std::string why;
    const int rc = open_caller_file(root(), path, intent, j->file, why);
    EXPECT_EQ(rc, 0) << why;
    j->shown = "file:" + path;
    j->file_offset = file_off;
    j->device_offset = dev_off;
    j->length = length;
    return j;
  }
  TransferResult run(std::shared_ptr<TransferJob> j) {
    auto f = submit(std::move(j));
    EXPECT_EQ(f.wait_for(30s), std::future_status::ready);
    return f.get();
  }
  std::future<TransferResult> submit(std::shared_ptr<TransferJob> j) {
    auto p = std::make_shared<std::promise<TransferResult>>();
    auto f = p->get_future();
    j->done = [p](TransferResult r) { p->set_value(std::move(r)); };
    engine_->submit(std::move(j));
    return f;
  }

  std::string segment(const std::string& name, const std::vector<char>& data) {
    const std::string p = shm_dir_ + "/" + name;
    std::ofstream(p, std::ios::binary)
        .write(data.data(), static_cast<std::streamsize>(data.size()));
    return p;
  }

  std::string dir_;
  std::string shm_dir_;
  Sink sink_;
  std::unique_ptr<SimDevice> dev_;
  StreamId stream_ = 0;
  std::uint64_t next_token_ = 1;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<TransferEngine> engine_;
};

TEST_F(TransferEngineTest, UploadsAFileInManyChunks) {
  make_engine();
  const auto data = random_bytes(kMiB + 12345, 1);
  const auto p = write_file("src", data);
  // From file offset 100, into device offset 4096 + 3: nothing is aligned.
  const Bytes n = data.size() - 100;
  const auto r = run(job(true, p, 100, 4096 + 3, n));
  ASSERT_EQ(r.error, 0) << r.why;
  EXPECT_EQ(r.bytes, n);
  const auto got = device_bytes(4096 + 3, n);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), data.begin() + 100));
  EXPECT_EQ(pool_->stats().in_use, 0u) << "staging goes back";
  const auto st = engine_->stats();
  EXPECT_EQ(st.started, 1u);
  EXPECT_EQ(st.completed, 1u);
}

TEST_F(TransferEngineTest, DownloadsIntoAnExistingFileAtAnOffsetWithoutTruncating) {
  make_engine();
  const auto data = random_bytes(300 * kKiB + 7, 2);
  put_device(kMiB, data);
  const auto p = write_file("dst", std::vector<char>(1000 * kKiB, 'z'));
  const auto r = run(job(false, p, 10, kMiB, data.size()));
  ASSERT_EQ(r.error, 0) << r.why;
  std::ifstream in(p, std::ios::binary);
  std::vector<char> back((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(back.size(), 1000 * kKiB);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 10));
  EXPECT_EQ(back[9], 'z');
  EXPECT_EQ(back[10 + data.size()], 'z');
}

TEST_F(TransferEngineTest, CreatesADownloadsFileWhenItRuns) {
  make_engine();
  const auto data = random_bytes(200 * kKiB, 3);
  put_device(0, data);
  const std::string p = dir_ + "/new.bin";
  auto j = job(false, p, 0, 0, data.size());
  ASSERT_FALSE(j->file.exists());
  ASSERT_FALSE(fs::exists(p));
  const auto r = run(std::move(j));
  ASSERT_EQ(r.error, 0) << r.why;
  ASSERT_EQ(fs::file_size(p), data.size());
  std::ifstream in(p, std::ios::binary);
  std::vector<char> back((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(back, data);
}

TEST_F(TransferEngineTest, ASourceThatShrankFailsWithEio) {
  make_engine();
  const auto p = write_file("src", random_bytes(512 * kKiB, 4));
  auto j = job(true, p, 0, 0, 512 * kKiB);
  ASSERT_EQ(::truncate(p.c_str(), 100 * kKiB), 0);
  const auto r = run(std::move(j));
  EXPECT_EQ(r.error, EIO);
  EXPECT_NE(r.why.find("ended at byte 102400"), std::string::npos) << r.why;
  EXPECT_LT(r.bytes, 512 * kKiB);
  EXPECT_EQ(pool_->stats().in_use, 0u);
  EXPECT_EQ(engine_->stats().failed, 1u);
}

TEST_F(TransferEngineTest, ADeviceFaultFailsTheTransfer) {
  make_engine();
  const auto p = write_file("src", random_bytes(256 * kKiB, 5));
  // Past the end of device memory: the sim completes the copy with EFAULT.
  const auto r = run(job(true, p, 0, 64 * kMiB - 64 * kKiB, 256 * kKiB));
  EXPECT_EQ(r.error, EFAULT) << r.why;
  EXPECT_NE(r.why.find("device copy failed"), std::string::npos) << r.why;
  EXPECT_EQ(pool_->stats().in_use, 0u);
}

TEST_F(TransferEngineTest, MoreTransfersThanActiveSlotsAllComplete) {
  make_engine(64 * kKiB, 2);
  std::vector<std::vector<char>> data;
  std::vector<std::future<TransferResult>> futures;
  for (unsigned i = 0; i < 6; ++i) {
    data.push_back(random_bytes(333 * kKiB + i, 10 + i));
    const auto p = write_file("src" + std::to_string(i), data.back());
    futures.push_back(submit(job(true, p, 0, i * kMiB, data.back().size())));
  }
  for (auto& f : futures) {
    ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
    EXPECT_EQ(f.get().error, 0);
  }
  for (unsigned i = 0; i < 6; ++i) EXPECT_EQ(device_bytes(i * kMiB, data[i].size()), data[i]) << i;
  EXPECT_EQ(engine_->stats().completed, 6u);
  EXPECT_EQ(pool_->stats().in_use, 0u);
}

TEST_F(TransferEngineTest, CancelStopsSoonAndReturnsStaging) {
  make_engine(64 * kKiB, 1);
  const auto p = write_file("src", random_bytes(32 * kMiB, 6));
  auto first = job(true, p, 0, 0, 32 * kMiB);
  auto second = job(true, p, 0, 0, 32 * kMiB);  // waits behind the first
  auto f1 = submit(first);
  auto f2 = submit(second);
  engine_->cancel(second);
  engine_->cancel(first);
  ASSERT_EQ(f1.wait_for(30s), std::future_status::ready);
  ASSERT_EQ(f2.wait_for(30s), std::future_status::ready);
  const auto r1 = f1.get(), r2 = f2.get();
  // 512 chunks of 64 KiB: the first stops long before its end.
  EXPECT_EQ(r1.error, ECANCELED);
  EXPECT_LT(r1.bytes, 32 * kMiB);
  EXPECT_EQ(r2.error, ECANCELED);
  EXPECT_EQ(r2.bytes, 0u);
  EXPECT_FALSE(first->file.exists()) << "the file is closed when the transfer ends";
  EXPECT_EQ(pool_->stats().in_use, 0u);
  EXPECT_EQ(engine_->stats().cancelled, 2u);
}

// A uid whose file I/O never comes back (here: its one CallerIo slot held by a
// job that blocks) stalls only its own transfer: another uid's completes, and
// cancelling the stuck one ends it at once, its memory no longer touched.
TEST_F(TransferEngineTest, AStuckFileCostsOnlyItsOwnUidAndCancelAbandonsIt) {
  CallerIo io(CallerIo::Options{1, 16, 8, std::chrono::milliseconds(1000)});
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_EQ(io.post(65534, [released](CallerIo::Gate&) { released.wait(); }), 0);
  TransferEngine::Options o{64 * kKiB, 1};
  o.io = &io;
  o.device_view = false;
  engine_ = std::make_unique<TransferEngine>(*dev_, *pool_, o, 0);
  route_to_engine();
  const auto data = random_bytes(kMiB, 9);
  const auto src = write_file("src", data);
  auto stuck = job(true, src, 0, 0, kMiB);
  stuck->who.uid = 65534;
  auto f_stuck = submit(stuck);
  const auto r = run(job(true, src, 0, 2 * kMiB, kMiB));  // uid 0, beyond max_active 1
  ASSERT_EQ(r.error, 0) << r.why;
  EXPECT_EQ(device_bytes(2 * kMiB, kMiB), data);
  EXPECT_EQ(f_stuck.wait_for(200ms), std::future_status::timeout);
  put_device(0, std::vector<char>(kMiB, 'z'));
  engine_->cancel(stuck);
  ASSERT_EQ(f_stuck.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(f_stuck.get().error, ECANCELED);
  EXPECT_EQ(pool_->stats().in_use, 0u);
  release.set_value();  // its queued read now runs, finds itself abandoned
  for (int i = 0; i < 100 && io.stats().busy + io.stats().queued > 0; ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(device_bytes(0, kMiB), std::vector<char>(kMiB, 'z'));
}

TEST_F(TransferEngineTest, StopCancelsEverythingAndWaits) {
  make_engine(64 * kKiB, 1);
  const auto p = write_file("src", random_bytes(16 * kMiB, 7));
  std::vector<std::future<TransferResult>> futures;
  for (int i = 0; i < 3; ++i) futures.push_back(submit(job(true, p, 0, 0, 16 * kMiB)));
  engine_->stop();
  for (auto& f : futures) {
    ASSERT_EQ(f.wait_for(0s), std::future_status::ready) << "stop() returns when all are over";
    const auto r = f.get();
    EXPECT_TRUE(r.error == ECANCELED || r.error == 0) << r.error;
  }
  EXPECT_EQ(pool_->stats().in_use, 0u);
  // A job submitted after stop() is cancelled, not lost.
  EXPECT_EQ(run(job(true, p, 0, 0, kMiB)).error, ECANCELED);
}

// ---- shared-memory segments: direct copies, no staging

TEST_F(TransferEngineTest, SegmentsAreCopiedDirectlyAndStayMappedForTheSession) {
  make_engine();
  const auto data = random_bytes(kMiB + 4321, 20);
  const auto p = segment("seg", data);
  auto r = run(shm_job(true, p, 21, 3, data.size() - 21));
  ASSERT_EQ(r.error, 0) << r.why;
  EXPECT_EQ(device_bytes(3, data.size() - 21), std::vector<char>(data.begin() + 21, data.end()));
  EXPECT_EQ(pool_->stats().allocations, 0u) << "no staging was used";
  auto st = engine_->stats();
  EXPECT_EQ(st.direct, 1u);
  EXPECT_EQ(st.segments, 1u);
  EXPECT_EQ(st.segment_bytes, data.size());
  // A download of the same segment maps it again, writable; later uploads of it
  // reuse that mapping.
  const auto other = random_bytes(300 * kKiB, 21);
  put_device(2 * kMiB, other);
  r = run(shm_job(false, p, 1000, 2 * kMiB, other.size()));
  ASSERT_EQ(r.error, 0) << r.why;
  r = run(shm_job(true, p, 1000, 4 * kMiB, other.size()));
  ASSERT_EQ(r.error, 0) << r.why;
  EXPECT_EQ(device_bytes(4 * kMiB, other.size()), other);
  st = engine_->stats();
  EXPECT_EQ(st.direct, 3u);
  EXPECT_EQ(st.segments, 2u) << "read-only and writable";
  // Another session never shares them.
  ASSERT_EQ(run(shm_job(true, p, 0, 0, 10, 8)).error, 0);
  EXPECT_EQ(engine_->stats().segments, 3u);
  engine_->forget_session(7);
  engine_->forget_session(8);
  for (int i = 0; i < 500 && engine_->stats().segments != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(engine_->stats().segments, 0u) << "unmapped once their session is gone";
}

TEST_F(TransferEngineTest, ASegmentThatShrankUnderItsMappingFailsWithEioAndHarmsNothing) {
  make_engine();
  const auto p = segment("seg", random_bytes(512 * kKiB, 22));
  auto j = shm_job(true, p, 0, 0, 512 * kKiB);
  // After the endpoint checked its size: the copies touch pages that are gone.
  ASSERT_EQ(::truncate(p.c_str(), 100 * kKiB), 0);
  const std::uint64_t faults = host_region_faults();
  const auto r = run(std::move(j));
  EXPECT_EQ(r.error, EIO);
  EXPECT_NE(r.why.find("shrank"), std::string::npos) << r.why;
  EXPECT_GT(host_region_faults(), faults) << "the guard took the SIGBUS";
  EXPECT_EQ(engine_->stats().segments, 0u) << "a changed segment is not kept";
  // The engine goes on.
  const auto data = random_bytes(100 * kKiB, 23);
  const auto q = segment("seg2", data);
  ASSERT_EQ(run(shm_job(true, q, 0, 0, data.size())).error, 0);
  EXPECT_EQ(device_bytes(0, data.size()), data);
}

TEST_F(TransferEngineTest, ASegmentChangedBetweenTransfersIsMappedAnew) {
  make_engine();
  const auto p = segment("seg", random_bytes(256 * kKiB, 24));
  ASSERT_EQ(run(shm_job(true, p, 0, 0, 256 * kKiB)).error, 0);
  EXPECT_EQ(engine_->stats().segments, 1u);
  // Replaced by a new file of the same name: a new mapping, the old one dropped.
  const auto data = random_bytes(256 * kKiB, 25);
  fs::remove(p);
  segment("seg", data);
  ASSERT_EQ(run(shm_job(true, p, 0, 0, data.size())).error, 0);
  EXPECT_EQ(device_bytes(0, data.size()), data);
  EXPECT_EQ(engine_->stats().segments, 1u);
  EXPECT_EQ(engine_->stats().direct, 2u);
}

TEST_F(TransferEngineTest, ASegmentOverTheCacheIsMappedForItsTransferAlone) {
  make_engine(64 * kKiB, 2, 0);
  const auto data = random_bytes(300 * kKiB, 26);
  const auto p = segment("seg", data);
  ASSERT_EQ(run(shm_job(true, p, 0, 0, data.size())).error, 0);
  EXPECT_EQ(device_bytes(0, data.size()), data);
  EXPECT_EQ(engine_->stats().direct, 1u);
  EXPECT_EQ(engine_->stats().segments, 0u);
}

TEST_F(TransferEngineTest, AWriteOnlySegmentGoesThroughStaging) {
  make_engine();
  const auto data = random_bytes(200 * kKiB, 27);
  put_device(0, data);
  const auto p = segment("seg", std::vector<char>(200 * kKiB, 'z'));
  auto j = job_as(FileIntent::write_existing, false, p, 0, 0, data.size());
  j->shm = true;
  ASSERT_EQ(run(std::move(j)).error, 0);
  std::ifstream in(p, std::ios::binary);
  EXPECT_EQ(std::vector<char>((std::istreambuf_iterator<char>(in)), {}), data);
  EXPECT_EQ(engine_->stats().direct, 0u);
}

// ---- files straight into device memory the engine can address (sim)

TEST_F(TransferEngineTest, FilesGoStraightIntoAddressableDeviceMemory) {
  make_engine(64 * kKiB, 2, 64 * kMiB, true);
  const auto data = random_bytes(kMiB + 999, 30);
  const auto p = write_file("src", data);
  auto r = run(job(true, p, 7, 4096 + 1, data.size() - 7));
  ASSERT_EQ(r.error, 0) << r.why;
  EXPECT_EQ(device_bytes(4096 + 1, data.size() - 7),
            std::vector<char>(data.begin() + 7, data.end()));
  const std::string dst = dir_ + "/dst";
  r = run(job(false, dst, 0, 4096 + 1, data.size() - 7));
  ASSERT_EQ(r.error, 0) << r.why;
  std::ifstream in(dst, std::ios::binary);
  EXPECT_EQ(std::vector<char>((std::istreambuf_iterator<char>(in)), {}),
            std::vector<char>(data.begin() + 7, data.end()));
  EXPECT_EQ(pool_->stats().allocations, 0u) << "no staging was used";
  // A source that shrank fails as on the staging path.
  auto shrunk = job(true, p, 0, 0, data.size());
  ASSERT_EQ(::truncate(p.c_str(), 1000), 0);
  r = run(std::move(shrunk));
  EXPECT_EQ(r.error, EIO);
  EXPECT_NE(r.why.find("ended at byte 1000"), std::string::npos) << r.why;
  // Past the end of device memory there is no view: staging, and the device's EFAULT.
  const auto q = write_file("q", random_bytes(256 * kKiB, 31));
  EXPECT_EQ(run(job(true, q, 0, 64 * kMiB - 64 * kKiB, 256 * kKiB)).error, EFAULT);
}

TEST_F(TransferEngineTest, CancelStopsADirectFileTransferSoon) {
  make_engine(64 * kKiB, 1, 64 * kMiB, true);
  const auto p = write_file("src", random_bytes(32 * kMiB, 32));
  auto j = job(true, p, 0, 0, 32 * kMiB);
  auto f = submit(j);
  engine_->cancel(j);
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  const auto r = f.get();
  EXPECT_TRUE(r.error == ECANCELED || r.error == 0) << r.error;
  EXPECT_EQ(engine_->stats().active, 0u);
}

}  // namespace
