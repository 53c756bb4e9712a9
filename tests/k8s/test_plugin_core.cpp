#include <gtest/gtest.h>

#include "k8s/plugin_core.hpp"
#include "tools/cdi_spec.hpp"

namespace salus::k8s {
namespace {

const char* kInfo =
    "index: 1\nname: sim\ndraining: {}\nbusy_1s: 0.000\nisolation: thread\nstate: {}\n"
    "restarts: 0\n";

std::string info(const std::string& draining, const std::string& state) {
  // Spliced, not replace()d in place: GCC 12's -Wrestrict false positive at -O3.
  std::string s = kInfo;
  const std::size_t first = s.find("{}");
  s = s.substr(0, first) + draining + s.substr(first + 2);
  const std::size_t second = s.find("{}");
  return s.substr(0, second) + state + s.substr(second + 2);
}

TEST(PluginCore, HealthFromGpuInfo) {
  EXPECT_TRUE(parse_gpu_info("1", info("no", "ok")).healthy);
  const auto drained = parse_gpu_info("1", info("yes", "ok"));
  EXPECT_FALSE(drained.healthy);
  EXPECT_EQ(drained.why, "draining");
  const auto lost = parse_gpu_info("1", info("no", "out-of-service: context lost (fault)"));
  EXPECT_FALSE(lost.healthy);
  EXPECT_EQ(lost.why, "out-of-service: context lost (fault)");
  // A state line with a longer key is not the state line.
  EXPECT_FALSE(parse_gpu_info("1", "xstate: ok\ndraining: no\n").healthy);
  EXPECT_FALSE(parse_gpu_info("1", "").healthy);
}

TEST(PluginCore, SharesPerGpu) {
  const auto s = shares_of({{"0", true, ""}, {"3", false, "draining"}}, 2);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].id, "gpu0-0");
  EXPECT_EQ(s[3].id, "gpu3-1");
  EXPECT_TRUE(s[1].healthy);
  EXPECT_FALSE(s[2].healthy);
  EXPECT_EQ(gpu_of_share("gpu12-3"), "12");
  for (const char* bad : {"gpu-1", "gpu1-", "gpux-1", "nvidia0", "gpu1-a", "gpu1"})
    EXPECT_FALSE(gpu_of_share(bad)) << bad;
}

TEST(PluginCore, AllocateCdiAndMounts) {
  AllocateConfig cdi;
  ContainerAllocation a;
  EXPECT_FALSE(allocate(cdi, {"gpu1-0", "gpu1-2"}, a));
  EXPECT_EQ(a.cdi_devices, std::vector<std::string>{"salus.io/gpu=1"});
  ContainerAllocation b;
  EXPECT_FALSE(allocate(cdi, {"gpu1-0", "gpu0-2"}, b));
  EXPECT_EQ(b.cdi_devices, std::vector<std::string>{"salus.io/gpu=any"});
  ContainerAllocation c;
  EXPECT_TRUE(allocate(cdi, {"gpu1-0", "bogus"}, c));
  EXPECT_TRUE(allocate(cdi, {}, c));

  AllocateConfig mounts{AllocateMode::mounts, "salus.io/gpu", "/run/salus/fs"};
  ContainerAllocation m;
  EXPECT_FALSE(allocate(mounts, {"gpu0-1"}, m));
  ASSERT_EQ(m.mounts.size(), 1u);
  EXPECT_EQ(m.mounts[0].host_path, "/run/salus");
  EXPECT_EQ(m.envs.at("SALUS_GPU"), "0");
  EXPECT_EQ(m.envs.at("SALUS_MOUNT"), "/run/salus/fs");
  mounts.mount = "/salus";  // directly below /: the mount itself
  ContainerAllocation top;
  EXPECT_FALSE(allocate(mounts, {"gpu0-1"}, top));
  EXPECT_EQ(top.mounts[0].host_path, "/salus");
}

TEST(CdiSpec, KindsAndMounts) {
  tools::CdiInput in;
  in.mount = "/run/salus/fs";
  in.gpus = {"0", "1"};
  auto spec = tools::make_cdi_spec(in);
  EXPECT_NE(
      spec.json.find(
          R"("hostPath": "/run/salus", "containerPath": "/run/salus", "options": ["rbind", "rslave", "rw"])"),
      std::string::npos)
      << spec.json;
  EXPECT_NE(spec.json.find(R"({"name": "any", "containerEdits": {"env": ["SALUS_GPU=any"]}})"),
            std::string::npos);
  EXPECT_EQ(spec.notes.size(), 1u);  // no shim
  in.mount = "/salus";
  in.shim = "/usr/lib/x\"y.so";  // quoted in JSON
  spec = tools::make_cdi_spec(in);
  EXPECT_NE(spec.json.find(R"("hostPath": "/usr/lib/x\"y.so")"), std::string::npos) << spec.json;
  EXPECT_EQ(spec.notes.size(), 1u);  // the restart warning
  for (const char* bad : {"salus", "/gpu", "salus.io/", "1salus.io/gpu", "salus.io/gp u"}) {
    in.kind = bad;
    EXPECT_THROW(tools::make_cdi_spec(in), std::invalid_argument) << bad;
  }
}

}  // namespace
}  // namespace salus::k8s
