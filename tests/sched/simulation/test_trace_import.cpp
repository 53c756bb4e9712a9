// The importers' rules (sched/trace_import): each public format on small files written
// here, the documented mapping of time, GPUs, fractions and failures, and the errors.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "sched/trace.hpp"
#include "sched/trace_import.hpp"

namespace salus::sched {
namespace {

ImportOptions opts() {
  ImportOptions o;
  o.iter_ms = 100;
  return o;
}

std::string error_of(std::string_view text, ImportFormat f, ImportOptions o = opts()) {
  try {
    import_trace_text(text, f, o);
  } catch (const TraceError& e) {
    return e.what();
  }
  return "no error";
}

TEST(TraceImport, ParsesTimes) {
  EXPECT_EQ(parse_trace_time("1970-01-01 00:00:10"), 10.0);
  EXPECT_EQ(parse_trace_time("2017-10-03 02:53:09"), 1506999189.0);
  EXPECT_EQ(parse_trace_time("2017-10-03T02:53:09Z"), 1506999189.0);
  EXPECT_EQ(parse_trace_time("2000-03-01 00:00:00.5"), 951868800.5);
  EXPECT_EQ(parse_trace_time("4550879.0"), 4550879.0);
  EXPECT_FALSE(parse_trace_time("None"));
  EXPECT_FALSE(parse_trace_time(""));
  EXPECT_THROW(parse_trace_time("2017-13-03 02:53:09"), std::invalid_argument);
  EXPECT_THROW(parse_trace_time("yesterday"), std::invalid_argument);
}

constexpr std::string_view kPhilly = R"([
  {"status": "Pass", "vc": "vc1", "jobid": "app_1", "user": "u",
   "submitted_time": "2017-10-03 02:00:00",
   "attempts": [{"start_time": "2017-10-03 02:00:10", "end_time": "2017-10-03 02:01:10",
                 "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]},
                            {"ip": "m2", "gpus": ["gpu0", "gpu1"]}]}]},
  {"status": "Killed", "vc": "vc1", "jobid": "app_2", "user": "u",
   "submitted_time": "2017-10-03 01:59:00",
   "attempts": [{"start_time": "2017-10-03 02:00:00", "end_time": "2017-10-03 02:00:30",
                 "detail": [{"ip": "m1", "gpus": ["gpu3"]}]},
                {"start_time": "2017-10-03 02:05:00", "end_time": "2017-10-03 02:05:10",
                 "detail": [{"ip": "m1", "gpus": ["gpu3"]}]}]},
  {"status": "Failed", "vc": "vc1", "jobid": "app_3", "user": "u",
   "submitted_time": "2017-10-03 02:10:00",
   "attempts": [{"start_time": "None", "end_time": "None", "detail": []}]},
  {"status": "Running", "vc": "vc1", "jobid": "app_4", "user": "u",
   "submitted_time": "2017-10-03 02:11:00",
   "attempts": [{"start_time": "2017-10-03 02:11:00", "end_time": null,
                 "detail": [{"ip": "m1", "gpus": ["gpu0"]}]}]}
])";

TEST(TraceImport, PhillyJobLog) {
  const ImportResult r = import_trace_text(kPhilly, ImportFormat::philly, opts());
  ASSERT_EQ(r.jobs.size(), 2u);
  // By submit time, the first at 0.
  EXPECT_EQ(r.jobs[0].name, "app_2");
  EXPECT_EQ(r.jobs[0].arrival_s, 0.0);
  EXPECT_EQ(r.jobs[0].iters, 400u);  // (30 s + 10 s) x 1 GPU at 100 ms
  EXPECT_EQ(r.jobs[1].name, "app_1");
  EXPECT_EQ(r.jobs[1].arrival_s, 60.0);
  EXPECT_EQ(r.jobs[1].iters, 2400u);  // 60 s x 4 GPUs: k x duration
  EXPECT_EQ(r.jobs[1].util, 1.0);
  EXPECT_EQ(r.jobs[1].persistent_mb, 500.0);
  EXPECT_EQ(r.jobs[1].ephemeral_mb, 4500.0);
  EXPECT_EQ(r.summary.records, 4u);
  EXPECT_EQ(r.summary.imported, 2u);
  EXPECT_EQ(r.summary.multi_gpu, 1u);
  EXPECT_EQ(r.summary.failed_kept, 1u);
  EXPECT_EQ(r.summary.gpu_seconds, 280.0);
  EXPECT_EQ(r.summary.skipped.at("never ran (no attempt with a start and an end)"), 1u);
  EXPECT_EQ(r.summary.skipped.at("not finished (running or waiting)"), 1u);

  ImportOptions o = opts();
  o.keep_failed = false;
  const ImportResult done = import_trace_text(kPhilly, ImportFormat::philly, o);
  ASSERT_EQ(done.jobs.size(), 1u);
  EXPECT_EQ(done.jobs[0].name, "app_1");
  EXPECT_EQ(done.jobs[0].arrival_s, 0.0);
  EXPECT_EQ(done.summary.skipped.at("failed or killed (--completed-only)"), 1u);
}

TEST(TraceImport, UsersAreKeptOnlyWhenAsked) {
  // Off by default: the trace stays one user's.
  for (const TraceJob& j : import_trace_text(kPhilly, ImportFormat::philly, opts()).jobs)
    EXPECT_EQ(j.user, "") << j.name;
  ImportOptions o = opts();
  o.users = true;
  const ImportResult philly = import_trace_text(kPhilly, ImportFormat::philly, o);
  ASSERT_EQ(philly.jobs.size(), 2u);
  EXPECT_EQ(philly.jobs[0].user, "u");
  EXPECT_EQ(philly.summary.users, 1u);
  const ImportResult csv = import_trace_text(
      "job_id,user,gpu_num,submit_time,duration\n"
      "a,alice,1,0,10\nb,\"bob,jr\",1,5,10\nc,,1,6,10\n",
      ImportFormat::jobs_csv, o);
  ASSERT_EQ(csv.jobs.size(), 3u);
  EXPECT_EQ(csv.jobs[0].user, "alice");
  EXPECT_EQ(csv.jobs[1].user, "bob_jr");  // a comma would split the trace's column
  EXPECT_EQ(csv.jobs[2].user, "");        // not recorded: the anonymous user
  EXPECT_EQ(csv.summary.users, 2u);
  const ImportResult pai = import_trace_text(
      "ja,worker,1.0,Terminated,1000.0,1100.0,400.0,10.0,100.0,V100\n"
      "jb,worker,1.0,Terminated,1000.0,1100.0,400.0,10.0,100.0,V100\n",
      ImportFormat::pai, o, "ja,i1,9f3e,Terminated,800.0,1100.0\njb,i2,77aa,Terminated,,\n");
  ASSERT_EQ(pai.jobs.size(), 2u);
  EXPECT_EQ(pai.jobs[0].name, "ja");
  EXPECT_EQ(pai.jobs[0].user, "9f3e");
  EXPECT_EQ(pai.jobs[1].user, "77aa");  // a user without a submit time still counts
  EXPECT_EQ(pai.jobs[1].arrival_s, 200.0);
}

TEST(TraceImport, PhillyErrorsNameTheLine) {
  EXPECT_EQ(error_of("[\n {\"jobid\": \"a\",\n \"attempts\": [}\n]", ImportFormat::philly),
            "line 3: expected a JSON value, got '}'");
  EXPECT_EQ(error_of("[\n {\"jobid\": \"a\", \"submitted_time\": \"noon\", \"attempts\": []}\n]",
                     ImportFormat::philly),
            "line 2: submitted_time 'noon' is not a time (YYYY-MM-DD HH:MM:SS)");
  EXPECT_EQ(error_of("[\n {\"status\": \"Pass\"}\n]", ImportFormat::philly),
            "line 2: job without a \"jobid\" string");
  EXPECT_EQ(error_of("[{\"jobid\": \"a\", \"attempts\": []}] x", ImportFormat::philly),
            "line 1: text after the end of the JSON array");
  EXPECT_EQ(error_of("[]", ImportFormat::philly), "nothing to import: 0 records read");
}

TEST(TraceImport, HeliosJobsCsv) {
  const std::string csv =
      "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,"
      "queue\n"
      "j1,u,v,8,48,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:00:05,2020-04-01 00:01:05,60,5\n"
      "j2,u,v,0,4,1,COMPLETED,2020-04-01 00:00:01,2020-04-01 00:00:05,2020-04-01 00:01:05,60,4\n"
      "j3,u,v,1,4,1,CANCELLED,2020-04-01 00:00:02,2020-04-01 00:00:05,2020-04-01 00:00:05,0,3\n"
      "j4,u,v,1,4,1,FAILED,2020-04-01 00:00:30,2020-04-01 00:00:35,2020-04-01 00:00:45,10,5\n";
  const ImportResult r = import_trace_text(csv, ImportFormat::jobs_csv, opts());
  ASSERT_EQ(r.jobs.size(), 2u);
  EXPECT_EQ(r.jobs[0].name, "j1");
  EXPECT_EQ(r.jobs[0].iters, 4800u);
  EXPECT_EQ(r.jobs[1].name, "j4");
  EXPECT_EQ(r.jobs[1].arrival_s, 30.0);
  EXPECT_EQ(r.jobs[1].iters, 100u);
  EXPECT_EQ(r.summary.skipped.at("no GPU (CPU-only job)"), 1u);
  EXPECT_EQ(r.summary.skipped.at("no GPU time (ran 0 s)"), 1u);

  // Without a duration column, start and end give it.
  const ImportResult se = import_trace_text(
      "jobid,submitted_time,start_time,end_time,num_gpu,status\n"
      "a,100,110,130,2,Pass\n",
      ImportFormat::jobs_csv, opts());
  ASSERT_EQ(se.jobs.size(), 1u);
  EXPECT_EQ(se.jobs[0].iters, 400u);
}

TEST(TraceImport, CsvErrorsNameLineAndColumn) {
  EXPECT_EQ(
      error_of("job_id,submit_time,gpu_num,duration\na,0,1,10\nb,0,x,10\n", ImportFormat::jobs_csv),
      "line 3: column 3 (gpu_num): 'x' is not a number");
  EXPECT_EQ(error_of("job_id,submit_time,gpu_num,duration\na,0,1\n", ImportFormat::jobs_csv),
            "line 2: 3 columns, the header has 4");
  EXPECT_EQ(error_of("job_id,submit_time,duration\na,0,1\n", ImportFormat::jobs_csv),
            "line 1: the header has no column for the GPU count (looked for 'gpu_num', 'num_gpu', "
            "'num_gpus', 'gpus', 'gpu', 'gpu_count')");
  EXPECT_EQ(error_of("job_id,submit_time,gpu_num,duration\na,soon,1,10\n", ImportFormat::jobs_csv),
            "line 2: column 2 (submit_time): 'soon' is not a time (seconds, or YYYY-MM-DD "
            "HH:MM:SS)");
}

TEST(TraceImport, QuotedFieldsAndDuplicates) {
  const ImportResult r = import_trace_text(
      "job_id,submit_time,gpu_num,duration\n\"a,1\",0,1,10\n\"b \"\"x\"\"\",1,1,10\na_1,2,1,10\n"
      "\"a,1\",3,1,10\n",
      ImportFormat::jobs_csv, opts());
  // A trace name cannot hold a comma, so "a,1" becomes a_1, and the later a_1 repeats it.
  ASSERT_EQ(r.jobs.size(), 2u);
  EXPECT_EQ(r.jobs[0].name, "a_1");
  EXPECT_EQ(r.jobs[1].name, "b \"x\"");
  EXPECT_EQ(r.summary.skipped.at("duplicate job name"), 2u);
  EXPECT_EQ(error_of("job_id,submit_time,gpu_num,duration\n\"a,0,1,10\n", ImportFormat::jobs_csv),
            "line 2: unterminated quoted field");
}

TEST(TraceImport, AlibabaPaiTasks) {
  // No header, as published: plan_gpu is percent of a GPU, CPU tasks have none.
  const std::string tasks =
      "ja,ps,1.0,Terminated,1000.0,1100.0,600.0,29.3,,\n"
      "ja,worker,2.0,Terminated,1000.0,1100.0,400.0,10.0,50.0,V100\n"
      "jb,tensorflow,1.0,Terminated,900.0,960.0,600.0,29.3,200.0,P100\n"
      "jc,tensorflow,1.0,Failed,950.0,970.0,600.0,29.3,100.0,T4\n"
      "jd,tensorflow,1.0,Running,990.0,,600.0,29.3,100.0,T4\n"
      "je,ps,1.0,Terminated,990.0,995.0,600.0,29.3,0.0,\n";
  const ImportResult r = import_trace_text(tasks, ImportFormat::pai, opts());
  ASSERT_EQ(r.jobs.size(), 3u);
  EXPECT_EQ(r.jobs[0].name, "jb");
  EXPECT_EQ(r.jobs[0].arrival_s, 0.0);
  EXPECT_EQ(r.jobs[0].iters, 1200u);  // 60 s x 2 GPUs
  EXPECT_EQ(r.jobs[0].util, 1.0);
  EXPECT_EQ(r.jobs[1].name, "jc");
  EXPECT_EQ(r.jobs[2].name, "ja");
  EXPECT_EQ(r.jobs[2].arrival_s, 100.0);
  EXPECT_EQ(r.jobs[2].iters, 2000u);  // 2 instances x 100 s, each on half a GPU
  EXPECT_DOUBLE_EQ(r.jobs[2].util, 0.5);
  EXPECT_EQ(r.summary.fractional, 1u);
  EXPECT_EQ(r.summary.skipped.at("not finished (running or waiting)"), 1u);
  EXPECT_EQ(r.summary.skipped.at("no GPU (CPU-only job)"), 1u);

  // The job table's start_time is the submission.
  const ImportResult joined =
      import_trace_text(tasks, ImportFormat::pai, opts(),
                        "job_name,inst_id,user,status,start_time,end_time\n"
                        "ja,i1,u,Terminated,800.0,1100.0\njb,i2,u,Terminated,850.0,960.0\n");
  EXPECT_EQ(joined.jobs[0].name, "ja");
  EXPECT_EQ(joined.jobs[1].name, "jb");
  EXPECT_EQ(joined.jobs[1].arrival_s, 50.0);

  EXPECT_EQ(error_of("ja,ps,1.0,Terminated,1000.0,1100.0,600.0,29.3,\n", ImportFormat::pai),
            "line 1: 9 columns, expected 10 (job_name,task_name,inst_num,status,start_time,"
            "end_time,plan_cpu,plan_mem,plan_gpu,gpu_type)");
  EXPECT_EQ(error_of("ja,w,1.0,Terminated,1000.0,900.0,600.0,29.3,100,T4\n", ImportFormat::pai),
            "line 1: column 6 (end_time): '900.0' is before the start time");
}

TEST(TraceImport, AlibabaOpenbPods) {
  const std::string pods =
      "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
      "deletion_time,scheduled_time\n"
      "openb-pod-0000,20000,65536,0,0,,LS,Running,2332613,12475899,2332615\n"
      "openb-pod-0001,8000,30517,1,250,,BE,Succeeded,9565025,9565125,9565030\n"
      "openb-pod-0002,8000,30517,2,1000,V100M32,LS,Failed,9565000,9565010,9565005\n"
      "openb-pod-0003,12500,57344,1,1000,,LS,Pending,9661695,9661708,\n";
  const ImportResult r = import_trace_text(pods, ImportFormat::openb, opts());
  ASSERT_EQ(r.jobs.size(), 2u);
  EXPECT_EQ(r.jobs[0].name, "openb-pod-0002");
  EXPECT_EQ(r.jobs[0].iters, 100u);  // 5 s x 2 GPUs
  EXPECT_EQ(r.jobs[1].name, "openb-pod-0001");
  EXPECT_EQ(r.jobs[1].arrival_s, 25.0);
  EXPECT_EQ(r.jobs[1].iters, 950u);
  EXPECT_DOUBLE_EQ(r.jobs[1].util, 0.25);
  EXPECT_EQ(r.summary.skipped.at("never scheduled (Pending)"), 1u);
  EXPECT_EQ(r.summary.skipped.at("no GPU (CPU-only job)"), 1u);
  EXPECT_EQ(error_of("name,num_gpu\na,1\n", ImportFormat::openb),
            "line 1: the header has no column for the GPU share (looked for 'gpu_milli')");
}

TEST(TraceImport, OutputParsesAsATrace) {
  ImportOptions o = opts();
  o.model = "philly";
  const ImportResult r = import_trace_text(kPhilly, ImportFormat::philly, o);
  std::ostringstream out;
  write_trace(out, r.jobs);
  const std::vector<TraceJob> back = parse_trace_text(out.str());
  ASSERT_EQ(back.size(), r.jobs.size());
  for (std::size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].name, r.jobs[i].name);
    EXPECT_EQ(back[i].arrival_s, r.jobs[i].arrival_s);
    EXPECT_EQ(back[i].iters, r.jobs[i].iters);
    EXPECT_EQ(back[i].model, "philly");
  }
}

}  // namespace
}  // namespace salus::sched
