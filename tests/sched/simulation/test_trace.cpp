// Trace CSV parsing and writing: accepted forms, and line-numbered rejection of bad input.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "sched/trace.hpp"

using salus::sched::parse_trace_line;
using salus::sched::parse_trace_text;
using salus::sched::TraceError;
using salus::sched::TraceJob;
using salus::sched::write_trace;

namespace {

// The line number a parse failure reports, or 0 if it did not fail.
std::size_t error_line(const std::string& text, std::string* message = nullptr) {
  try {
    parse_trace_text(text);
  } catch (const TraceError& e) {
    if (message) *message = e.what();
    return e.line();
  }
  return 0;
}

}  // namespace

TEST(Trace, ParsesHeaderCommentsAndBothFieldCounts) {
  const auto jobs = parse_trace_text(
      "# a comment\n"
      "\n"
      "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority\n"
      "a,0,resnet50_50,290,5410,250,100,0.93,3\n"
      "  b , 1.5 , vae_64 , 15 , 10 , 4 , 7 , 0.1 \r\n"
      "c,2e1,x,0,0,0.5,1,1\n");
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].name, "a");
  EXPECT_EQ(jobs[0].model, "resnet50_50");
  EXPECT_DOUBLE_EQ(jobs[0].persistent_mb, 290);
  EXPECT_DOUBLE_EQ(jobs[0].ephemeral_mb, 5410);
  EXPECT_DOUBLE_EQ(jobs[0].iter_ms, 250);
  EXPECT_EQ(jobs[0].iters, 100u);
  EXPECT_DOUBLE_EQ(jobs[0].util, 0.93);
  EXPECT_EQ(jobs[0].priority, 3);
  EXPECT_EQ(jobs[0].line, 4u);
  EXPECT_EQ(jobs[1].name, "b");
  EXPECT_DOUBLE_EQ(jobs[1].arrival_s, 1.5);
  EXPECT_EQ(jobs[1].priority, 0);  // 8 fields: no priority
  EXPECT_DOUBLE_EQ(jobs[2].arrival_s, 20.0);
  EXPECT_EQ(jobs[2].line, 6u);
}

TEST(Trace, HeaderIsOptional) {
  const auto jobs = parse_trace_text("a,0,m,1,1,10,5,0.5\nb,1,m,1,1,10,5,0.5,-2\n");
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[1].priority, -2);
}

TEST(Trace, RejectsBadLinesWithTheirLineNumber) {
  const std::string head = "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util\n";
  const std::string ok = "a,0,m,1,1,10,5,0.5\n";
  struct Case {
    std::string line;
    std::string mentions;
  };
  const Case cases[] = {
      {"b,0,m,1,1,10,5", "fields"},
      {"b,0,m,1,1,10,5,0.5,1,u,9", "fields"},
      {",0,m,1,1,10,5,0.5", "name"},
      {"b,soon,m,1,1,10,5,0.5", "arrival_s"},
      {"b,-1,m,1,1,10,5,0.5", "negative"},
      {"b,nan,m,1,1,10,5,0.5", "arrival_s"},
      {"b,inf,m,1,1,10,5,0.5", "arrival_s"},
      {"b,0,,1,1,10,5,0.5", "model"},
      {"b,0,m,-5,1,10,5,0.5", "persistent_mb"},
      {"b,0,m,1,x,10,5,0.5", "ephemeral_mb"},
      {"b,0,m,1,1,0,5,0.5", "iter_ms"},
      {"b,0,m,1,1,-3,5,0.5", "iter_ms"},
      {"b,0,m,1,1,10,0,0.5", "iters"},
      {"b,0,m,1,1,10,2.5,0.5", "iters"},
      {"b,0,m,1,1,10,-4,0.5", "iters"},
      {"b,0,m,1,1,10,5,0", "util"},
      {"b,0,m,1,1,10,5,1.5", "util"},
      {"b,0,m,1,1,10,5,0.5,high", "priority"},
      {"b,0,m,1,1,10,5,0.5,99999999999", "priority"},
      {"a,3,m,1,1,10,5,0.5", "duplicate"},
  };
  for (const Case& c : cases) {
    std::string message;
    EXPECT_EQ(error_line(head + ok + c.line + "\n", &message), 3u) << c.line;
    EXPECT_NE(message.find("line 3"), std::string::npos) << message;
    EXPECT_NE(message.find(c.mentions), std::string::npos) << c.line << " -> " << message;
  }
}

TEST(Trace, RejectsAMisspelledHeaderAndAnEmptyTrace) {
  std::string message;
  EXPECT_EQ(
      error_line("job,arrival,model,persistent_mb,ephemeral_mb,iter_ms,iters,util\n", &message),
      1u);
  EXPECT_NE(message.find("arrival_s"), std::string::npos);
  EXPECT_THROW(parse_trace_text("# nothing\n\n"), TraceError);
  EXPECT_THROW(
      parse_trace_text("job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util\n"),
      TraceError);
}

TEST(Trace, SingleLineParserNamesTheLine) {
  EXPECT_EQ(parse_trace_line("x,1,m,2,3,4,5,0.25", 7).line, 7u);
  try {
    parse_trace_line("x,1,m,2,3,4,5", 42);
    FAIL();
  } catch (const TraceError& e) {
    EXPECT_EQ(e.line(), 42u);
  }
}

TEST(Trace, AUserColumnNamesWhoseJobItIs) {
  const auto jobs = parse_trace_text(
      "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority,user\n"
      "a,0,m,1,1,10,5,0.5,0,alice\nb,0,m,1,1,10,5,0.5,,bob\nc,0,m,1,1,10,5,0.5\n");
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].user, "alice");
  EXPECT_EQ(jobs[1].user, "bob");
  EXPECT_EQ(jobs[1].priority, 0);
  EXPECT_EQ(jobs[2].user, "");
  std::ostringstream out;
  write_trace(out, jobs);
  EXPECT_NE(out.str().find(",user\n"), std::string::npos) << out.str();
  const auto back = parse_trace_text(out.str());
  ASSERT_EQ(back.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(back[i].user, jobs[i].user);
  // Without users the header stays the nine columns older readers expect.
  std::ostringstream plain;
  write_trace(plain, {jobs[2]});
  EXPECT_EQ(plain.str().find("user"), std::string::npos) << plain.str();
}

TEST(Trace, WriteThenParseGivesTheSameJobs) {
  std::vector<TraceJob> jobs(2);
  jobs[0] = {"j0", 0.001, "vae_64", 15, 10, 4, 123456, 0.1, 0, 0};
  jobs[1] = {"j1", 12345.678, "resnet152_75", 822.2, 12977.8, 900, 1, 1.0, -7, 0};
  std::ostringstream out;
  write_trace(out, jobs);
  const auto back = parse_trace_text(out.str());
  ASSERT_EQ(back.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back[i].name, jobs[i].name);
    EXPECT_EQ(back[i].arrival_s, jobs[i].arrival_s);
    EXPECT_EQ(back[i].model, jobs[i].model);
    EXPECT_EQ(back[i].persistent_mb, jobs[i].persistent_mb);
    EXPECT_EQ(back[i].ephemeral_mb, jobs[i].ephemeral_mb);
    EXPECT_EQ(back[i].iter_ms, jobs[i].iter_ms);
    EXPECT_EQ(back[i].iters, jobs[i].iters);
    EXPECT_EQ(back[i].util, jobs[i].util);
    EXPECT_EQ(back[i].priority, jobs[i].priority);
  }
}
