// salus-run's command line and --measure's rule (tools/salus_run_options.hpp);
// the binary's behaviour against salusd is tests/integration/test_salus_run.py.
#include "tools/salus_run_options.hpp"

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

namespace {

using salus::run::expandable_segments_on;
using salus::run::RunOptions;
constexpr unsigned long long MiB = 1ULL << 20;

std::optional<std::string> parse(std::initializer_list<const char*> args, RunOptions& o) {
  std::vector<std::string> words = {"salus-run"};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  std::string mount;
  return salus::run::parse_args(static_cast<int>(argv.size()), argv.data(), o, mount);
}

TEST(SalusRunOptions, ProgramAfterDoubleDashKeepsItsOwnOptions) {
  RunOptions o;
  EXPECT_EQ(parse({"--persistent", "1M", "--ephemeral", "2M", "--iters", "7", "--", "python3",
                   "train.py", "--persistent", "x"},
                  o),
            std::nullopt);
  EXPECT_EQ(o.command, (std::vector<std::string>{"python3", "train.py", "--persistent", "x"}));
  EXPECT_FALSE(o.measure);
  EXPECT_EQ(salus::run::need_line(o, *o.persistent, *o.ephemeral, std::string("any")),
            "need persistent=1M ephemeral=2M iters=7 gpu=any kind=attached");
}

TEST(SalusRunOptions, NoSizesMeansMeasure) {
  RunOptions o;
  EXPECT_EQ(parse({"--policy-hint", "name=bert", "prog"}, o), std::nullopt);
  EXPECT_TRUE(o.measure);
  EXPECT_EQ(o.command, std::vector<std::string>{"prog"});
  EXPECT_EQ(salus::run::need_line(o, "0", "5", std::nullopt),
            "need persistent=0 ephemeral=5 name=bert kind=attached");
}

TEST(SalusRunOptions, BadArgumentsSayWhy) {
  RunOptions o0, o1, o2, o3;
  EXPECT_EQ(parse({"--", "--x"}, o0), std::nullopt);  // after --, a program may start with -
  EXPECT_NE(parse({"--x"}, o0)->find("unknown option '--x'"), std::string::npos);
  EXPECT_NE(parse({"--persistent", "1.5Q", "--", "p"}, o1)->find("bad size '1.5Q'"),
            std::string::npos);
  EXPECT_NE(parse({"--measure", "--ephemeral", "1M", "--", "p"}, o2)->find("exclude"),
            std::string::npos);
  EXPECT_NE(parse({"--gpu", "-1", "--", "p"}, o3)->find("bad --gpu"), std::string::npos);
}

TEST(SalusRunOptions, SharedLaneAloneIsTheExplicitLaneAndAllocIsTheAllocatorHook) {
  RunOptions off, plain, one, alloc, bad;
  EXPECT_EQ(parse({"prog"}, off), std::nullopt);
  EXPECT_EQ(off.shared_lane, "");
  EXPECT_EQ(parse({"--shared-lane", "prog", "x"}, plain), std::nullopt);
  EXPECT_EQ(plain.shared_lane, "1");
  EXPECT_EQ(plain.command, (std::vector<std::string>{"prog", "x"}));  // not taken as a value
  EXPECT_EQ(parse({"--shared-lane=1", "prog"}, one), std::nullopt);
  EXPECT_EQ(one.shared_lane, "1");
  EXPECT_EQ(parse({"--shared-lane=alloc", "--", "prog"}, alloc), std::nullopt);
  EXPECT_EQ(alloc.shared_lane, "alloc");
  RunOptions segments;
  EXPECT_EQ(parse({"--shared-lane=segments", "prog"}, segments), std::nullopt);
  EXPECT_EQ(segments.shared_lane, "segments");
  EXPECT_NE(parse({"--shared-lane=yes", "prog"}, bad), std::nullopt);
}

TEST(SalusRunOptions, ExpandableSegmentsAreSeenAsPyTorchReadsTheSetting) {
  EXPECT_TRUE(expandable_segments_on("expandable_segments:True"));
  EXPECT_TRUE(expandable_segments_on("max_split_size_mb:128, expandable_segments : True"));
  EXPECT_FALSE(expandable_segments_on(""));
  EXPECT_FALSE(expandable_segments_on("expandable_segments:False"));
  EXPECT_FALSE(expandable_segments_on("expandable_segments:true"));  // PyTorch wants True
  EXPECT_FALSE(expandable_segments_on("expandable_segments:True,expandable_segments:False"));
  EXPECT_FALSE(expandable_segments_on("my_expandable_segments:True"));
}

TEST(SalusRunMeasure, PersistentIsWhatWasHeldAndTheRestIsEphemeralWithAMargin) {
  // 100 MiB peak, 60 MiB held throughout: 60M persistent, 40M + 100M/16 ephemeral.
  const auto [p, e] = salus::run::measured_need(100 * MiB, 60 * MiB);
  EXPECT_EQ(p, 60 * MiB);
  EXPECT_EQ(e, 47 * MiB);  // 46.25 MiB rounded up to whole MiB
}

TEST(SalusRunMeasure, NothingChargedGetsTheFloorAndHeldNeverPassesThePeak) {
  EXPECT_EQ(salus::run::measured_need(0, ~0ULL), std::make_pair(0ULL, MiB));
  const auto [p, e] = salus::run::measured_need(10 * MiB, 20 * MiB);
  EXPECT_EQ(p, 10 * MiB);
  EXPECT_EQ(e, MiB);
}

}  // namespace

TEST(SalusRunRestart, TheNeedIsPinnedToTheGpuTheProgramRunsOn) {
  using salus::run::need_after_restart;
  EXPECT_EQ(need_after_restart("need persistent=1M ephemeral=2M iters=5 gpu=any name=x", "1"),
            "persistent=1M ephemeral=2M iters=5 name=x gpu=1");
  EXPECT_EQ(need_after_restart("need persistent=0 ephemeral=3G", "0"),
            "persistent=0 ephemeral=3G gpu=0");
  EXPECT_EQ(need_after_restart("need  persistent=1M  gpu=2 ", "2"), "persistent=1M gpu=2");
}
