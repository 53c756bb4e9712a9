// Host regions: a file mapped for direct copies, its bounds and access checked,
// and a file that shrinks under its mapping costing zeros, not the process.
#include "vgpu/host_regions.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <vector>

using namespace salus::vgpu;

namespace {

constexpr Bytes kSize = 1 << 20;

int make_file(Bytes size, char fill) {
  const int fd = ::memfd_create("salus-test-region", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  std::vector<char> v(size, fill);
  EXPECT_EQ(::pwrite(fd, v.data(), v.size(), 0), static_cast<ssize_t>(size));
  return fd;
}

TEST(HostRegions, MapsAFileAndChecksRangesAndAccess) {
  HostRegions t;
  const int fd = make_file(kSize, 'a');
  RegionId id = 0;
  std::string why;
  ASSERT_EQ(t.map(fd, kSize, false, id, why), 0) << why;
  ::close(fd);  // the mapping keeps the pages
  EXPECT_NE(id, 0u);
  EXPECT_EQ(*t.at(id, kSize - 1, 1, false), 'a');
  EXPECT_THROW(t.at(id, kSize - 1, 2, false), std::invalid_argument);
  EXPECT_THROW(t.at(id, kSize + 1, 0, false), std::invalid_argument);
  EXPECT_THROW(t.at(id, 0, 1, true), std::invalid_argument) << "read-only";
  EXPECT_THROW(t.at(id + 1, 0, 1, false), std::invalid_argument) << "unknown";
  const auto r = t.remove(id);
  ASSERT_TRUE(r);
  HostRegions::unmap(*r);
  EXPECT_FALSE(t.find(id));
  EXPECT_FALSE(t.remove(id));
}

TEST(HostRegions, AWritableRegionWritesThroughToTheFile) {
  HostRegions t;
  const int fd = make_file(kSize, 'a');
  RegionId id = 0;
  std::string why;
  ASSERT_EQ(t.map(fd, kSize, true, id, why), 0) << why;
  std::memset(t.at(id, 4096, 10, true), 'b', 10);
  char got[10];
  ASSERT_EQ(::pread(fd, got, sizeof got, 4096), 10);
  EXPECT_EQ(std::string(got, 10), std::string(10, 'b'));
  ::close(fd);
}

TEST(HostRegions, AFileThatShrankUnderItsMappingReadsAsZerosInsteadOfKillingTheProcess) {
  HostRegions t;
  const int fd = make_file(kSize, 'a');
  RegionId id = 0;
  std::string why;
  ASSERT_EQ(t.map(fd, kSize, true, id, why), 0) << why;
  const std::uint64_t faults = host_region_faults();
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  // Past the new end of the file: SIGBUS without the guard.
  volatile char* p = t.at(id, 0, kSize, true);
  EXPECT_EQ(p[kSize - 1], 0);
  EXPECT_EQ(host_region_faults(), faults + 1);
  p[kSize - 1] = 'x';  // and writes land somewhere harmless
  EXPECT_EQ(p[kSize - 1], 'x');
  ::close(fd);
}

TEST(HostRegions, AFaultOutsideEveryRegionStillKills) {
  // The handler must not swallow faults it does not own.
  EXPECT_EXIT(
      {
        HostRegions t;
        const int guarded = make_file(kSize, 'a');
        RegionId id = 0;
        std::string why;
        if (t.map(guarded, kSize, false, id, why) != 0) ::_exit(3);
        const int other = make_file(kSize, 'a');
        auto* q =
            static_cast<volatile char*>(::mmap(nullptr, kSize, PROT_READ, MAP_SHARED, other, 0));
        if (::ftruncate(other, 0) != 0) ::_exit(4);
        (void)q[kSize - 1];
        ::_exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

}  // namespace
