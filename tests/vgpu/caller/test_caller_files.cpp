// Opening files as a session's caller: path resolution one step at a time, the
// symlink rule, file types, permissions of another uid, files created later, and
// the checks of upload/download endpoints. Cases that switch uid need root.
#include "vgpu/caller/caller_files.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <linux/magic.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>

#include "vgpu/transfer/transfer_endpoint.hpp"

using namespace salus::vgpu;
namespace fs = std::filesystem;

namespace {

constexpr uid_t kNobody = 65534;
constexpr uid_t kOther = 4242;  // a uid that owns nothing of the caller's

class CallerFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/salus-caller-files-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ::chmod(dir_.c_str(), 0755);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string make_file(const std::string& name, const std::string& text = "hello",
                        mode_t mode = 0644) {
    const std::string p = path(name);
    std::ofstream(p) << text;
    ::chmod(p.c_str(), mode);
    return p;
  }
  static CallerCredentials as(uid_t uid, gid_t gid = 0) {
    CallerCredentials c;
    c.uid = uid;
    c.gid = gid == 0 ? uid : gid;
    c.umask = 022;
    return c;
  }
  // A root caller with every capability, as a root shell has.
  static CallerCredentials root() {
    auto c = as(0, 0);
    c.caps = ~std::uint64_t{0};
    return c;
  }
  static std::string read_all(int fd) {
    std::string out(64, '\0');
    const ssize_t n = ::pread(fd, out.data(), out.size(), 0);
    out.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    return out;
  }
  int open(const CallerCredentials& who, const std::string& p, FileIntent intent, CallerFile& f) {
    why_.clear();
    return open_caller_file(who, p, intent, f, why_);
  }
  static bool is_root() { return ::geteuid() == 0; }

  std::string dir_;
  std::string why_;
};

#define NEED_ROOT() \
  if (!is_root()) GTEST_SKIP() << "switching uid needs root"

TEST(SymlinkRule, FollowsOnlyTheCallersRootsOrTheDirectoryOwners) {
  EXPECT_TRUE(may_follow_symlink(1000, 1000, 0));     // the caller's own
  EXPECT_TRUE(may_follow_symlink(1000, 0, 1001));     // root's
  EXPECT_TRUE(may_follow_symlink(1000, 1001, 1001));  // the directory owner's
  EXPECT_FALSE(may_follow_symlink(1000, 1001, 0));    // planted in /tmp by another user
  EXPECT_FALSE(may_follow_symlink(0, 1001, 0));       // root is not fooled either
}

TEST_F(CallerFilesTest, ReadsARegularFile) {
  const auto p = make_file("a", "abc");
  CallerFile f;
  ASSERT_EQ(open(root(), p, FileIntent::read, f), 0) << why_;
  EXPECT_TRUE(f.exists());
  EXPECT_EQ(f.st.st_size, 3);
  EXPECT_EQ(read_all(f.fd.get()), "abc");
  // O_NONBLOCK, used while opening, is cleared again.
  EXPECT_EQ(::fcntl(f.fd.get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_EQ(::fcntl(f.fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST_F(CallerFilesTest, ResolvesDotsWithoutLeavingTheRoot) {
  make_file("a", "abc");
  CallerFile f;
  ASSERT_EQ(open(root(), "/../../.." + dir_ + "/./x/../a", FileIntent::read, f), ENOENT)
      << "x does not exist, so x/.. does not either: " << why_;
  fs::create_directory(path("x"));
  ASSERT_EQ(open(root(), "/../../.." + dir_ + "/./x/../a", FileIntent::read, f), 0) << why_;
  EXPECT_EQ(read_all(f.fd.get()), "abc");
}

TEST_F(CallerFilesTest, RejectsWhatIsNotARegularFile) {
  CallerFile f;
  EXPECT_EQ(open(root(), path("missing"), FileIntent::read, f), ENOENT);
  EXPECT_NE(why_.find("No such file"), std::string::npos) << why_;
  EXPECT_EQ(open(root(), dir_, FileIntent::read, f), EISDIR);
  EXPECT_EQ(open(root(), "/", FileIntent::read, f), EISDIR);
  // A FIFO nobody writes to would block a plain open: it must fail at once.
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0666), 0);
  EXPECT_EQ(open(root(), path("fifo"), FileIntent::read, f), EINVAL);
  EXPECT_NE(why_.find("a FIFO"), std::string::npos) << why_;
  EXPECT_EQ(open(root(), path("fifo"), FileIntent::write, f), EINVAL);
  EXPECT_EQ(open(root(), "/dev/null", FileIntent::read, f), EINVAL);
  EXPECT_NE(why_.find("a character device"), std::string::npos) << why_;
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sp = path("sock");
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sp.c_str());
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(open(root(), sp, FileIntent::read, f), EINVAL);
  ::close(sock);
  make_file("file");
  EXPECT_EQ(open(root(), path("file") + "/x", FileIntent::read, f), ENOTDIR);
  EXPECT_EQ(open(root(), "relative/path", FileIntent::read, f), EINVAL);
  EXPECT_FALSE(f.exists());
}

TEST_F(CallerFilesTest, FollowsTrustedSymlinksRelativeAndAbsolute) {
  make_file("target", "t");
  fs::create_directory(path("sub"));
  fs::create_symlink("../target", path("sub/rel"));
  fs::create_symlink(path("target"), path("abs"));
  fs::create_symlink("sub/rel", path("chain"));
  CallerFile f;
  for (const char* name : {"sub/rel", "abs", "chain"}) {
    ASSERT_EQ(open(root(), path(name), FileIntent::read, f), 0) << name << ": " << why_;
    EXPECT_EQ(read_all(f.fd.get()), "t");
  }
  fs::create_symlink("loop2", path("loop1"));
  fs::create_symlink("loop1", path("loop2"));
  EXPECT_EQ(open(root(), path("loop1"), FileIntent::read, f), ELOOP);
  fs::create_symlink("nowhere", path("dangling"));
  EXPECT_EQ(open(root(), path("dangling"), FileIntent::read, f), ENOENT);
}

TEST_F(CallerFilesTest, RefusesASymlinkPlantedByAnotherUid) {
  NEED_ROOT();
  make_file("target", "secret-free", 0644);
  fs::create_symlink(path("target"), path("planted"));
  ASSERT_EQ(::lchown(path("planted").c_str(), kOther, kOther), 0);
  CallerFile f;
  // The target is readable by everyone; the link is what is refused.
  EXPECT_EQ(open(as(kNobody), path("planted"), FileIntent::read, f), EACCES);
  EXPECT_NE(why_.find("refusing to follow symlink 'planted' owned by uid 4242"), std::string::npos)
      << why_;
  EXPECT_EQ(open(root(), path("planted"), FileIntent::read, f), EACCES) << "root too";
  // Its owner may use it, and so may anyone once the directory is the owner's.
  EXPECT_EQ(open(as(kOther), path("planted"), FileIntent::read, f), 0) << why_;
  ASSERT_EQ(::chown(dir_.c_str(), kOther, kOther), 0);
  EXPECT_EQ(open(as(kNobody), path("planted"), FileIntent::read, f), 0) << why_;
  // In the middle of a path as well.
  ASSERT_EQ(::chown(dir_.c_str(), 0, 0), 0);
  fs::create_directory(path("d"));
  make_file("d/x", "x");
  fs::create_symlink(path("d"), path("dirlink"));
  ASSERT_EQ(::lchown(path("dirlink").c_str(), kOther, kOther), 0);
  EXPECT_EQ(open(as(kNobody), path("dirlink/x"), FileIntent::read, f), EACCES);
}

TEST_F(CallerFilesTest, AppliesTheCallersPermissions) {
  NEED_ROOT();
  const auto secret = make_file("secret", "s", 0600);
  CallerFile f;
  EXPECT_EQ(open(as(kNobody), secret, FileIntent::read, f), EACCES);
  EXPECT_EQ(open(as(kNobody), secret, FileIntent::write, f), EACCES);
  EXPECT_EQ(open(root(), secret, FileIntent::read, f), 0);
  // Groups count: a file of a group the caller is in.
  ASSERT_EQ(::chown(secret.c_str(), 0, 777), 0);
  ::chmod(secret.c_str(), 0640);
  auto member = as(kNobody);
  EXPECT_EQ(open(member, secret, FileIntent::read, f), EACCES);
  member.groups = {777};
  EXPECT_EQ(open(member, secret, FileIntent::read, f), 0) << why_;
  // Search permission on the way is checked too.
  fs::create_directory(path("closed"));
  make_file("closed/f", "f", 0644);
  ::chmod(path("closed").c_str(), 0700);
  EXPECT_EQ(open(as(kNobody), path("closed/f"), FileIntent::read, f), EACCES);
  // /etc/shadow is the classic.
  if (fs::exists("/etc/shadow")) {
    EXPECT_EQ(open(as(kNobody), "/etc/shadow", FileIntent::read, f), EACCES);
  }
}

TEST(KernelFilesystems, AreNamedByTheirMagic) {
  EXPECT_STREQ(kernel_filesystem(PROC_SUPER_MAGIC), "procfs");
  EXPECT_STREQ(kernel_filesystem(SYSFS_MAGIC), "sysfs");
  EXPECT_STREQ(kernel_filesystem(DEBUGFS_MAGIC), "debugfs");
  EXPECT_STREQ(kernel_filesystem(CGROUP2_SUPER_MAGIC), "cgroup2fs");
  EXPECT_EQ(kernel_filesystem(0xEF53), nullptr);      // ext4
  EXPECT_EQ(kernel_filesystem(0x01021994), nullptr);  // tmpfs
}

// Regression (issue 17, item 5): /proc and /sys answer to the opener's
// capabilities and identity in ways salusd cannot pass on; they are refused,
// also through a symlink, and the message names only the path the caller gave.
TEST_F(CallerFilesTest, RefusesKernelFilesystemsEvenThroughASymlink) {
  CallerFile f;
  EXPECT_EQ(open(root(), "/proc/self/status", FileIntent::read, f), EACCES);
  EXPECT_NE(why_.find("procfs, a kernel filesystem"), std::string::npos) << why_;
  EXPECT_EQ(open(as(kNobody), "/proc/1/cwd/x", FileIntent::read, f), EACCES);
  EXPECT_NE(why_.find("procfs"), std::string::npos) << why_;
  fs::create_symlink("/proc/self/environ", path("env"));
  EXPECT_EQ(open(root(), path("env"), FileIntent::read, f), EACCES);
  EXPECT_EQ(why_.find("environ"), std::string::npos) << why_;
  EXPECT_FALSE(f.exists());
  if (fs::exists("/sys/kernel/uevent_seqnum")) {
    EXPECT_EQ(open(root(), "/sys/kernel/uevent_seqnum", FileIntent::read, f), EACCES);
    EXPECT_NE(why_.find("sysfs"), std::string::npos) << why_;
  }
}

std::uint64_t effective_caps() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2];
  if (::syscall(SYS_capget, &hdr, data) != 0) return 0;
  return data[0].effective | (std::uint64_t{data[1].effective} << 32);
}

// Regression (issue 17, item 5): the open runs with the caller's capabilities,
// not salusd's. Root without CAP_DAC_OVERRIDE cannot read another uid's 0600
// file, and the thread gets its own capabilities back afterwards.
TEST_F(CallerFilesTest, OpensWithTheCallersCapabilitiesOnly) {
  NEED_ROOT();
  const auto before = effective_caps();
  if ((before & (1ULL << CAP_DAC_OVERRIDE)) == 0) GTEST_SKIP() << "needs CAP_DAC_OVERRIDE";
  const auto secret = make_file("theirs", "t", 0600);
  ASSERT_EQ(::chown(secret.c_str(), kOther, kOther), 0);
  CallerFile f;
  auto bare_root = as(0, 0);  // uid 0 with no capabilities (e.g. a capability-dropped job)
  EXPECT_EQ(open(bare_root, secret, FileIntent::read, f), EACCES) << why_;
  EXPECT_EQ(effective_caps(), before);
  EXPECT_EQ(open(root(), secret, FileIntent::read, f), 0) << why_;
  EXPECT_EQ(effective_caps(), before);
  // CAP_DAC_READ_SEARCH would search a directory without x for anyone.
  fs::create_directory(path("noexec"));
  make_file("noexec/f", "f", 0644);
  ::chmod(path("noexec").c_str(), 0600);
  EXPECT_EQ(open(as(kNobody), path("noexec/f"), FileIntent::read, f), EACCES);
  EXPECT_EQ(open(bare_root, path("noexec/f"), FileIntent::read, f), EACCES);
  EXPECT_EQ(open(root(), path("noexec/f"), FileIntent::read, f), 0) << why_;
  EXPECT_EQ(effective_caps(), before);
}

// Regression (issue 17, item 6): FUSE reports pid 0 for a caller outside
// salusd's pid namespace; /proc/self would then be salusd's own credentials.
TEST_F(CallerFilesTest, RefusesACallerWithoutAPid) {
  const auto p = make_file("open", "o", 0644);
  const auto who = CallerCredentials::capture({kNobody, kNobody, 0});
  EXPECT_EQ(who.refused, EPERM);
  EXPECT_TRUE(who.groups.empty());
  EXPECT_EQ(who.caps, 0u);
  CallerFile f;
  EXPECT_EQ(open(who, p, FileIntent::read, f), EPERM);
  EXPECT_NE(why_.find("outside salusd's pid namespace"), std::string::npos) << why_;
  EXPECT_EQ(open(who, path("new"), FileIntent::write, f), EPERM);
  std::vector<std::uint8_t> bytes;
  EXPECT_EQ(read_file_as_caller(who, p, 1024, bytes, why_), EPERM);
  // A caller with a pid is read from its /proc entry: this process.
  const auto self = CallerCredentials::capture({::geteuid(), ::getegid(), ::getpid()});
  EXPECT_EQ(self.refused, 0);
  EXPECT_EQ(self.caps, effective_caps());
  EXPECT_EQ(open(self, p, FileIntent::read, f), 0) << why_;
}

TEST_F(CallerFilesTest, WritesExistingFilesWithoutTruncatingThem) {
  const auto p = make_file("w", "0123456789");
  CallerFile f;
  ASSERT_EQ(open(root(), p, FileIntent::write, f), 0) << why_;
  ASSERT_TRUE(f.exists());
  ASSERT_EQ(::pwrite(f.fd.get(), "ab", 2, 4), 2);
  f = CallerFile{};
  std::ifstream in(p);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "0123ab6789");
}

TEST_F(CallerFilesTest, NeverWritesThroughASymlink) {
  make_file("real", "r");
  fs::create_symlink(path("real"), path("link"));
  CallerFile f;
  EXPECT_EQ(open(root(), path("link"), FileIntent::write, f), ELOOP);
  EXPECT_NE(why_.find("never writes through"), std::string::npos) << why_;
  EXPECT_EQ(open(root(), path("link"), FileIntent::write_existing, f), ELOOP);
  // A symlinked directory on the way is fine: only the last component matters.
  fs::create_symlink(dir_, path("dirlink"));
  EXPECT_EQ(open(root(), path("dirlink/real"), FileIntent::write, f), 0) << why_;
}

TEST_F(CallerFilesTest, CreatesAMissingFileLaterAsTheCaller) {
  NEED_ROOT();
  ::chmod(dir_.c_str(), 0777);
  auto who = as(kNobody);
  who.umask = 027;
  CallerFile f;
  ASSERT_EQ(open(who, path("new"), FileIntent::write, f), 0) << why_;
  EXPECT_FALSE(f.exists());
  EXPECT_FALSE(fs::exists(path("new"))) << "nothing is created before the transfer runs";
  EXPECT_EQ(f.name, "new");
  ASSERT_EQ(create_caller_file(who, f, path("new"), why_), 0) << why_;
  ASSERT_TRUE(f.exists());
  struct stat st;
  ASSERT_EQ(::stat(path("new").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, kNobody);
  EXPECT_EQ(st.st_gid, kNobody);
  EXPECT_EQ(st.st_mode & 07777, 0640u) << "0666 & ~umask";
  // write_existing never creates.
  CallerFile g;
  EXPECT_EQ(open(who, path("other"), FileIntent::write_existing, g), ENOENT);
}

TEST_F(CallerFilesTest, CreationUsesWhatAppearedMeanwhileOnlyIfItIsARegularFile) {
  CallerFile f;
  ASSERT_EQ(open(root(), path("later"), FileIntent::write, f), 0) << why_;
  fs::create_symlink("/etc/hostname", path("later"));
  EXPECT_EQ(create_caller_file(root(), f, path("later"), why_), ELOOP);
  fs::remove(path("later"));
  CallerFile g;
  ASSERT_EQ(open(root(), path("later"), FileIntent::write, g), 0) << why_;
  make_file("later", "existing");
  ASSERT_EQ(create_caller_file(root(), g, path("later"), why_), 0) << why_;
  EXPECT_EQ(read_all(::open(path("later").c_str(), O_RDONLY)), "existing");
}

TEST_F(CallerFilesTest, CannotCreateInADirectoryTheCallerMayNotWrite) {
  NEED_ROOT();
  CallerFile f;
  EXPECT_EQ(open(as(kNobody), path("nope"), FileIntent::write, f), EACCES);
  EXPECT_NE(why_.find("cannot create it"), std::string::npos) << why_;
  EXPECT_EQ(open(as(kNobody), path("missing-dir/x"), FileIntent::write, f), ENOENT);
}

// ---------------------------------------------------------------- endpoints

TransferCmd transfer(bool up, TransferCmd::Endpoint e, std::string source, Bytes off, Bytes len) {
  TransferCmd c;
  c.direction = up ? TransferCmd::Direction::upload : TransferCmd::Direction::download;
  c.buffer.name = std::string("w");  // not = "w": GCC 12 -Wrestrict false positive at -O3
  c.endpoint = e;
  c.source = std::move(source);
  c.source_offset = off;
  c.length = len;
  return c;
}

class ShmEndpointTest : public CallerFilesTest {
 protected:
  void SetUp() override {
    CallerFilesTest::SetUp();
    name_ = fmt_name();
    shm_ = std::string(kShmDir) + "/" + name_;
    std::ofstream(shm_) << std::string(4096, 'x');
    ::chmod(shm_.c_str(), 0666);
  }
  void TearDown() override {
    ::unlink(shm_.c_str());
    CallerFilesTest::TearDown();
  }
  static std::string fmt_name() { return "salus-test-" + std::to_string(::getpid()); }
  std::string name_, shm_;
};

TEST_F(ShmEndpointTest, OpensTheCallersSegmentOfTheRightSize) {
  using E = TransferCmd::Endpoint;
  auto ep = open_transfer_endpoint(root(), transfer(true, E::shm, name_, 1024, 3072));
  ASSERT_EQ(ep.error, 0) << ep.why;
  EXPECT_TRUE(ep.file.exists());
  EXPECT_EQ(ep.shown, "shm:" + name_);
  ep = open_transfer_endpoint(root(), transfer(false, E::shm, name_, 0, 4096));
  EXPECT_EQ(ep.error, 0) << ep.why;
  ep = open_transfer_endpoint(root(), transfer(true, E::shm, name_, 1024, 3073));
  EXPECT_EQ(ep.error, ERANGE);
  EXPECT_NE(ep.why.find("the segment holds 4096"), std::string::npos) << ep.why;
  EXPECT_FALSE(ep.file.exists()) << "closed on failure";
  ep = open_transfer_endpoint(root(), transfer(false, E::shm, name_, 4096, 1));
  EXPECT_EQ(ep.error, ERANGE) << "downloads never grow a segment";
  ep = open_transfer_endpoint(root(), transfer(true, E::shm, name_ + "-missing", 0, 1));
  EXPECT_EQ(ep.error, ENOENT);
  ep = open_transfer_endpoint(root(), transfer(false, E::shm, name_ + "-missing", 0, 1));
  EXPECT_EQ(ep.error, ENOENT) << "downloads never create a segment";
  for (const char* bad : {"..", "a/b", ".hidden", ""}) {
    ep = open_transfer_endpoint(root(), transfer(true, E::shm, bad, 0, 1));
    EXPECT_EQ(ep.error, EINVAL) << bad;
  }
  ep = open_transfer_endpoint(root(), transfer(true, E::shm, name_, ~Bytes{0} - 5, 10));
  EXPECT_EQ(ep.error, ERANGE);
}

TEST_F(ShmEndpointTest, RefusesASegmentOfAnotherUidWhateverItsMode) {
  NEED_ROOT();
  using E = TransferCmd::Endpoint;
  // 0666: readable and writable by nobody, but not nobody's.
  auto ep = open_transfer_endpoint(as(kNobody), transfer(true, E::shm, name_, 0, 16));
  EXPECT_EQ(ep.error, EACCES);
  EXPECT_NE(ep.why.find("belongs to uid 0"), std::string::npos) << ep.why;
  ep = open_transfer_endpoint(as(kNobody), transfer(false, E::shm, name_, 0, 16));
  EXPECT_EQ(ep.error, EACCES);
  ASSERT_EQ(::chown(shm_.c_str(), kNobody, kNobody), 0);
  ep = open_transfer_endpoint(as(kNobody), transfer(true, E::shm, name_, 0, 16));
  EXPECT_EQ(ep.error, 0) << ep.why;
  ep = open_transfer_endpoint(root(), transfer(true, E::shm, name_, 0, 16));
  EXPECT_EQ(ep.error, EACCES) << "root's session cannot read nobody's segment either";
}

TEST_F(CallerFilesTest, FileEndpointsCheckTheSourceSize) {
  using E = TransferCmd::Endpoint;
  const auto p = make_file("src", std::string(100, 'y'));
  auto ep = open_transfer_endpoint(root(), transfer(true, E::file, p, 50, 50));
  EXPECT_EQ(ep.error, 0) << ep.why;
  ep = open_transfer_endpoint(root(), transfer(true, E::file, p, 50, 51));
  EXPECT_EQ(ep.error, ERANGE);
  EXPECT_NE(ep.why.find("the file holds 100"), std::string::npos) << ep.why;
  ep = open_transfer_endpoint(root(), transfer(false, E::file, p, 1000, 51));
  EXPECT_EQ(ep.error, 0) << "a download may extend a file: " << ep.why;
  ep = open_transfer_endpoint(root(), transfer(false, E::file, path("fresh"), 0, 1));
  EXPECT_EQ(ep.error, 0) << ep.why;
  EXPECT_FALSE(ep.file.exists());
  ep = open_transfer_endpoint(root(), transfer(true, E::file, path("fresh"), 0, 1));
  EXPECT_EQ(ep.error, ENOENT);
  EXPECT_EQ(ep.why.rfind("file:", 0), 0u) << ep.why;
}

}  // namespace
