#!/bin/bash
# salus-trace-import from the outside: each format converted from a small file and run
# through salus-sim, the summary on stderr, and exit 2 with the line on bad input.
# Usage: test_import_cli.sh SALUS_TRACE_IMPORT SALUS_SIM
set -u
imp=$1 sim=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

expect_exit() {
  local want=$1; shift
  "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  [ "$got" = "$want" ] || fail "'$*' exited $got, wanted $want: $(cat "$tmp/err")"
}

cat >"$tmp/philly.json" <<'JSON'
[{"status": "Pass", "jobid": "application_1", "user": "u", "vc": "v",
  "submitted_time": "2017-10-03 02:00:00",
  "attempts": [{"start_time": "2017-10-03 02:00:00", "end_time": "2017-10-03 02:00:20",
                "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]}]}]},
 {"status": "Killed", "jobid": "application_2", "user": "u", "vc": "v",
  "submitted_time": "2017-10-03 02:00:05",
  "attempts": [{"start_time": "2017-10-03 02:00:05", "end_time": "2017-10-03 02:00:15",
                "detail": [{"ip": "m2", "gpus": ["gpu0"]}]}]},
 {"status": "Failed", "jobid": "application_3", "user": "u", "vc": "v",
  "submitted_time": "2017-10-03 02:00:06", "attempts": []}]
JSON
expect_exit 0 "$imp" --format philly "$tmp/philly.json" --iter-ms 100 -o "$tmp/philly.csv"
[ "$(cat "$tmp/philly.csv")" = "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority
application_1,0,imported,500,4500,100,400,1,0
application_2,5,imported,500,4500,100,100,1,0" ] || fail "philly output: $(cat "$tmp/philly.csv")"
grep -q "3 records, 2 jobs imported" "$tmp/err" || fail "philly summary: $(cat "$tmp/err")"
expect_exit 0 "$imp" --format philly "$tmp/philly.json" --iter-ms 100 --users -o "$tmp/philly-users.csv"
[ "$(head -2 "$tmp/philly-users.csv" | tail -1)" = "application_1,0,imported,500,4500,100,400,1,0,u" ] ||
  fail "philly --users output: $(cat "$tmp/philly-users.csv")"
grep -q "salus-trace-import: 1 user$" "$tmp/err" || fail "philly --users summary: $(cat "$tmp/err")"
grep -q "skipped 1: never ran" "$tmp/err" || fail "philly skip reason: $(cat "$tmp/err")"
# One GPU: application_1 runs 40 s (2 GPUs x 20 s), application_2 its 10 s after it.
expect_exit 0 "$sim" --trace "$tmp/philly.csv" --policy fifo
[ "$(awk '$1=="fifo"{print $2}' "$tmp/out")" = "50.000" ] || fail "philly sim: $(cat "$tmp/out")"

cat >"$tmp/pods.csv" <<'CSV'
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0000,8000,30517,1,500,,BE,Succeeded,1000,1030,1000
openb-pod-0001,8000,30517,1,500,,BE,Succeeded,1000,1030,1000
openb-pod-0002,12500,57344,1,1000,,LS,Pending,1001,1002,
CSV
expect_exit 0 "$imp" --format openb "$tmp/pods.csv" --iter-ms 100 -o "$tmp/pods-trace.csv"
grep -q "2 jobs imported" "$tmp/err" || fail "openb summary: $(cat "$tmp/err")"
# Two half-GPU pods pack onto one GPU and take 30 s together, not 60.
expect_exit 0 "$sim" --trace "$tmp/pods-trace.csv" --policy pack
[ "$(awk '$1=="pack"{print $2}' "$tmp/out")" = "30.000" ] || fail "openb sim: $(cat "$tmp/out")"

printf 'j1,worker,1.0,Terminated,100.0,110.0,400.0,10.0,100.0,V100\nj2,worker,1.0,Terminated,101.0,121.0,400.0,10.0,100.0,V100\n' >"$tmp/pai.csv"
expect_exit 0 "$imp" --format pai "$tmp/pai.csv" --iter-ms 10 -o "$tmp/pai-trace.csv"
expect_exit 0 "$sim" --trace "$tmp/pai-trace.csv" --policy fifo --gpus 2
[ "$(awk '$1=="fifo"{print $2}' "$tmp/out")" = "21.000" ] || fail "pai sim: $(cat "$tmp/out")"

printf 'job_id,submit_time,gpu_num,duration,state\na,0,1,10,COMPLETED\nb,5,1,10,FAILED\n' >"$tmp/jobs.csv"
expect_exit 0 "$imp" --format jobs-csv "$tmp/jobs.csv" --completed-only
[ "$(tail -n +2 "$tmp/out")" = "a,0,imported,500,4500,1000,10,1,0" ] || fail "completed-only: $(cat "$tmp/out")"
grep -q "skipped 1: failed or killed" "$tmp/err" || fail "completed-only summary: $(cat "$tmp/err")"

# Bad input: exit 2, the file, the line and the column; nothing on standard output.
printf 'job_id,submit_time,gpu_num,duration\na,0,1,10\nb,0,two,10\n' >"$tmp/bad.csv"
expect_exit 2 "$imp" --format jobs-csv "$tmp/bad.csv"
grep -q "bad.csv: line 3: column 3 (gpu_num): 'two' is not a number" "$tmp/err" || fail "bad csv: $(cat "$tmp/err")"
[ ! -s "$tmp/out" ] || fail "no output on bad input"
printf '[{"jobid": "a", "attempts": [}]' >"$tmp/bad.json"
expect_exit 2 "$imp" --format philly "$tmp/bad.json"
grep -q "line 1: expected a JSON value" "$tmp/err" || fail "bad json: $(cat "$tmp/err")"
expect_exit 2 "$imp" --format openb "$tmp/missing.csv"
grep -q "cannot open" "$tmp/err" || fail "missing file: $(cat "$tmp/err")"
expect_exit 2 "$imp" --format nosuch "$tmp/jobs.csv"
expect_exit 2 "$imp" --format openb "$tmp/jobs.csv" --pai-jobs "$tmp/jobs.csv"

[ "$failures" = 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all salus-trace-import checks passed"
