#!/bin/bash
# salus-sim and salus-trace-gen from the outside: output format, exit codes, error
# messages with line numbers, and the documented commands behind the shipped traces.
# Usage: test_cli.sh SALUS_SIM SALUS_TRACE_GEN SOURCE_DIR
set -u
sim=$1 gen=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# expect_exit CODE CMD...: runs CMD, stderr to $tmp/err, stdout to $tmp/out.
expect_exit() {
  local want=$1; shift
  "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  [ "$got" = "$want" ] || fail "'$*' exited $got, wanted $want: $(cat "$tmp/err")"
}

cat >"$tmp/good.csv" <<'EOF'
job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util
a,0,m,100,1000,10,100,1
b,0.1,m,100,1000,10,10,1
EOF

# Summary: the stable header, then one line per policy in Table 2's order.
expect_exit 0 "$sim" --trace "$tmp/good.csv" --policy all
[ "$(head -1 "$tmp/out")" = "policy makespan_s avg_queue_s avg_jct_s p95_jct_s" ] || fail "header: $(head -1 "$tmp/out")"
[ "$(awk 'NR>1{print $1}' "$tmp/out" | tr '\n' ' ')" = "fifo srtf pack fair " ] || fail "policies: $(cat "$tmp/out")"
[ "$(awk '$1=="fifo"{print $2, $4}' "$tmp/out")" = "1.100 1.000" ] || fail "fifo line: $(cat "$tmp/out")"
[ "$(awk '$1=="srtf"{print $2, $4}' "$tmp/out")" = "1.100 0.600" ] || fail "srtf line: $(cat "$tmp/out")"
[ "$(awk 'NF!=5' "$tmp/out" | wc -l)" = 0 ] || fail "every line has 5 fields"

# Per-job output.
expect_exit 0 "$sim" --trace "$tmp/good.csv" --policy srtf --gpus 2 --gpu-memory 8G --placement rr \
  --jobs-out "$tmp/jobs.csv"
[ "$(head -1 "$tmp/jobs.csv")" = "job,policy,arrival_s,start_s,finish_s,jct_s,queue_s,gpu,lane,admit_s,user" ] || fail "jobs-out header"
[ "$(wc -l <"$tmp/jobs.csv")" = 3 ] || fail "jobs-out rows: $(cat "$tmp/jobs.csv")"
grep -q '^b,srtf,0.100000,0.100000,0.200000,0.100000,0.000000,1,' "$tmp/jobs.csv" || fail "jobs-out b: $(cat "$tmp/jobs.csv")"

# A per-boundary overhead of 1 ms: a's 100 iterations end at 1.1 s, b's 10 at 1.21 s.
expect_exit 0 "$sim" --trace "$tmp/good.csv" --policy fifo --iteration-overhead-us 1000
[ "$(awk '$1=="fifo"{print $2}' "$tmp/out")" = "1.210" ] || fail "overhead: $(cat "$tmp/out")"
expect_exit 2 "$sim" --trace "$tmp/good.csv" --iteration-overhead-us -5

# Share windows.
expect_exit 0 "$sim" --trace "$src/traces/fair-3.csv" --policy fair --share-window 10 --share-out "$tmp/share.csv"
[ "$(head -1 "$tmp/share.csv")" = "policy,window_start_s,window_end_s,job,work_s,share" ] || fail "share header"
[ "$(wc -l <"$tmp/share.csv")" -gt 100 ] || fail "share rows"
awk -F, 'NR>1 && ($6 < 0.2833 || $6 > 0.3834) {bad=1} END{exit bad}' "$tmp/share.csv" || fail "fair-3 share outside 1/3 +- 0.05"
grep -q "windows of 10.000 s" "$tmp/err" || fail "share summary on stderr: $(cat "$tmp/err")"

# Bad traces: exit 2 and the file and line in the message.
printf 'job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util\na,0,m,1,1,10,5,0.5\nb,0,m,1,1,10,5,2\n' >"$tmp/bad.csv"
expect_exit 2 "$sim" --trace "$tmp/bad.csv" --policy fifo
grep -q "bad.csv:line 3: util" "$tmp/err" || fail "bad util message: $(cat "$tmp/err")"
[ ! -s "$tmp/out" ] || fail "no summary on a bad trace"
printf 'a,0,m,1,1,10\n' >"$tmp/short.csv"
expect_exit 2 "$sim" --trace "$tmp/short.csv" --policy fifo
grep -q "line 1: 6 fields" "$tmp/err" || fail "field count message: $(cat "$tmp/err")"
printf 'a,0,m,1,1,10,5,0.5\nhuge,0,m,9000,9000,10,5,0.5\n' >"$tmp/huge.csv"
expect_exit 2 "$sim" --trace "$tmp/huge.csv" --policy pack
grep -q "line 2: job huge" "$tmp/err" || fail "too large message: $(cat "$tmp/err")"
expect_exit 2 "$sim" --trace "$tmp/nonexistent.csv"
grep -q "cannot open trace '$tmp/nonexistent.csv': No such file or directory" "$tmp/err" || fail "open message: $(cat "$tmp/err")"
expect_exit 2 "$sim" --trace "$tmp/good.csv" --policy lottery
expect_exit 2 "$sim" --trace "$tmp/good.csv" --placement best
expect_exit 2 "$sim" --trace "$tmp/good.csv" --gpus 0
expect_exit 2 "$sim" --trace "$tmp/good.csv" --gpu-memory lots
expect_exit 2 "$sim" --trace "$tmp/good.csv" --share-out "$tmp/x.csv"
expect_exit 2 "$sim"

# Issue 19: the four jobs whose FAIR run aborted at 9e6 s; a byte-order mark; progress.
cat >"$tmp/four.csv" <<'EOF'
job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority
a,8842326.112,resnet50_25,230,2770,135,22869,0.850,0
b,8844106.082,seq2seq_small,40,460,20,123563,0.300,0
c,8845238.790,seq2seq_large,300,3200,150,14268,0.850,0
d,8847342.392,vae_64,15,10,4,7108,0.100,0
EOF
expect_exit 0 "$sim" --trace "$tmp/four.csv" --policy fair
[ "$(awk '$1=="fair"{print $2}' "$tmp/out")" = "7727.207" ] || fail "four-job fair: $(cat "$tmp/out")"
printf '\xef\xbb\xbf' | cat - "$tmp/good.csv" >"$tmp/bom.csv"
expect_exit 0 "$sim" --trace "$tmp/bom.csv" --policy fifo --progress
grep -q "^salus-sim: fifo: 100.0% of the work, 2/2 jobs done, .*, done$" "$tmp/err" || fail "progress line: $(cat "$tmp/err")"
expect_exit 0 "$sim" --trace "$tmp/good.csv" --policy fifo
[ ! -s "$tmp/err" ] || fail "progress without --progress on a pipe: $(cat "$tmp/err")"
printf 'a,0,m,1,1,0.0000001,5,0.5\n' >"$tmp/subns.csv"
expect_exit 2 "$sim" --trace "$tmp/subns.csv" --policy fifo
grep -q "line 1: iter_ms 0.0000001 is below 1 ns" "$tmp/err" || fail "sub-ns message: $(cat "$tmp/err")"

# The documented commands regenerate the shipped traces byte for byte.
expect_exit 0 "$gen" --arrivals 0,15,30 --workloads inception3_50 --iters 900 --prefix fair -o "$tmp/f3.csv"
cmp -s "$tmp/f3.csv" "$src/traces/fair-3.csv" || fail "fair-3.csv differs from the generator's output"
expect_exit 0 "$gen" --jobs 100 --seed 1 --interarrival 20 -o "$tmp/o100.csv"
cmp -s "$tmp/o100.csv" "$src/traces/online-100.csv" || fail "online-100.csv differs from the generator's output"
expect_exit 0 "$gen" --jobs 300 --seed 1 --interarrival 0 --workloads superres_128 --util 0.3 \
  --duration-mean 60 --duration-sigma 1 --prefix hp -o "$tmp/hp.csv"
cmp -s "$tmp/hp.csv" "$src/traces/hyperparam-300.csv" || fail "hyperparam-300.csv differs from the generator's output"
expect_exit 2 "$gen" --workloads resnet51
# Shapes: defaults for the docs/benchmarks.md traces; explicit options win.
expect_exit 0 "$gen" --shape burst --jobs 20 --seed 7 -o "$tmp/burst.csv"
[ "$(wc -l <"$tmp/burst.csv")" = 21 ] || fail "burst rows"
[ "$(awk -F, 'NR>1 && $2!=0' "$tmp/burst.csv" | wc -l)" = 0 ] || fail "burst arrivals not all at 0"
expect_exit 0 "$gen" --shape cluster --jobs 200 --seed 7 -o "$tmp/cluster.csv"
[ "$(awk -F, 'END{print ($2 > 20000)}' "$tmp/cluster.csv")" = 1 ] || fail "cluster arrivals not spread"
expect_exit 0 "$sim" --trace "$tmp/cluster.csv" --gpus 2 --policy all
# year: the cluster's load per GPU on 100 GPUs, so gaps of 32 s instead of 400 s.
expect_exit 0 "$gen" --shape year --jobs 200 --seed 7 -o "$tmp/year.csv"
[ "$(awk -F, 'END{print ($2 > 2000 && $2 < 20000)}' "$tmp/year.csv")" = 1 ] || fail "year gaps: $(tail -1 "$tmp/year.csv")"
expect_exit 2 "$gen" --shape philly
expect_exit 2 "$gen" --arrivals 0,x
expect_exit 0 "$gen" --list
[ "$(wc -l <"$tmp/out")" = 46 ] || fail "--list shows 45 workloads"

# tools/srtf-bound: exact preemptive SRTF on one GPU. a (10 s) runs 0-1, b (2 s) preempts
# it and ends at 3, a ends at 12: JCTs 12 and 2, average 7. salus-sim's SRTF matches it
# when memory does not bind.
cat >"$tmp/bound.csv" <<'EOF2'
job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util
a,0,m,100,1000,10,1000,1
b,1,m,100,1000,10,200,1
EOF2
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound.csv" --compare 7.07
[ "$(head -1 "$tmp/out")" = "jobs 2 makespan_s 12.000 avg_jct_s 7.000" ] || fail "srtf-bound: $(cat "$tmp/out")"
grep -q "ratio 1.0100" "$tmp/out" || fail "srtf-bound compare: $(cat "$tmp/out")"
expect_exit 0 "$sim" --trace "$tmp/bound.csv" --policy srtf
[ "$(awk '$1=="srtf"{print $4}' "$tmp/out")" = "7.000" ] || fail "salus-sim srtf vs bound: $(cat "$tmp/out")"
expect_exit 2 python3 "$src/tools/srtf-bound" "$tmp/missing.csv"
grep -q "srtf-bound: .*missing.csv: No such file" "$tmp/err" || fail "srtf-bound missing: $(cat "$tmp/err")"
head -1 "$tmp/bound.csv" >"$tmp/header-only.csv"
expect_exit 2 python3 "$src/tools/srtf-bound" "$tmp/header-only.csv"
# --gpus M: ideal migrating SRTF on M GPUs. a (10 s) and b (4 s) at 0, c (2 s) at 1. Two
# GPUs: a and b run from 0; at 1 c (2) displaces a (9 left): c ends at 3, b at 4, a resumes
# at 3 and ends at 12: JCTs 12, 4, 2, average 6. One GPU: b runs, c preempts it at 1 and
# ends at 3, b at 6, a at 16: average 8. Three GPUs: all at once, average (10+4+2)/3.
cat >"$tmp/bound3.csv" <<'EOF2'
job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util
a,0,m,100,1000,10,1000,1
b,0,m,100,1000,10,400,1
c,1,m,100,1000,10,200,1
EOF2
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --gpus 2
[ "$(cat "$tmp/out")" = "jobs 3 makespan_s 12.000 avg_jct_s 6.000" ] || fail "srtf-bound --gpus 2: $(cat "$tmp/out")"
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --gpus 1
[ "$(cat "$tmp/out")" = "jobs 3 makespan_s 16.000 avg_jct_s 8.000" ] || fail "srtf-bound --gpus 1: $(cat "$tmp/out")"
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --gpus 3
[ "$(cat "$tmp/out")" = "jobs 3 makespan_s 10.000 avg_jct_s 5.333" ] || fail "srtf-bound --gpus 3: $(cat "$tmp/out")"
# --gpus 1 is the default, and prints what one GPU printed before --gpus existed.
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound.csv" --gpus 1
[ "$(cat "$tmp/out")" = "jobs 2 makespan_s 12.000 avg_jct_s 7.000" ] || fail "srtf-bound --gpus 1 default: $(cat "$tmp/out")"
# --ps: ideal processor sharing, each of n ready jobs at rate min(1, M/n). One GPU: a and
# b at 1/2 until 1 (9.5 and 3.5 left), then three at 1/3: c (2) ends at 7, b (1.5 left)
# at 10 at 1/2, a alone at 16: JCTs 16, 10, 6. Two GPUs: a and b at full speed until 1
# (9 and 3), three at 2/3: c ends at 4, b (1 left) at 5, a (7 left) at 11: 11, 5, 3.
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --ps
[ "$(cat "$tmp/out")" = "jobs 3 makespan_s 16.000 avg_jct_s 10.667" ] || fail "srtf-bound --ps: $(cat "$tmp/out")"
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --ps --gpus 2
[ "$(cat "$tmp/out")" = "jobs 3 makespan_s 11.000 avg_jct_s 6.333" ] || fail "srtf-bound --ps --gpus 2: $(cat "$tmp/out")"
expect_exit 0 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --ps --gpus 3
[ "$(cat "$tmp/out")" = "jobs 3 makespan_s 10.000 avg_jct_s 5.333" ] || fail "srtf-bound --ps --gpus 3: $(cat "$tmp/out")"
for bad in 0 -1 two 1.5; do
  expect_exit 2 python3 "$src/tools/srtf-bound" "$tmp/bound3.csv" --gpus "$bad"
  grep -q "argument --gpus: '$bad' is not a number of GPUs (a whole number >= 1)" "$tmp/err" ||
    fail "srtf-bound --gpus $bad: $(cat "$tmp/err")"
done

# FAIR by user, the default as in salusd: alice's one job against bob's three (1 s of
# work each) gets half the GPU and ends at 2 s; per job (--fair-share session), at 4 s.
cat >"$tmp/users.csv" <<'EOF'
job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority,user
a,0,m,100,1000,10,100,1,0,alice
b1,0,m,100,1000,10,100,1,0,bob
b2,0,m,100,1000,10,100,1,0,bob
b3,0,m,100,1000,10,100,1,0,bob
EOF
expect_exit 0 "$sim" --trace "$tmp/users.csv" --policy fair --jobs-out "$tmp/users-jobs.csv"
alice=$(awk -F, '$1=="a"{printf "%.1f %s", $5, $11}' "$tmp/users-jobs.csv")
[ "$alice" = "2.0 alice" ] || fail "fair by user: a ends at 2 s as alice's, got '$alice'"
expect_exit 0 "$sim" --trace "$tmp/users.csv" --policy fair --fair-share session --jobs-out "$tmp/users-jobs.csv"
alice=$(awk -F, '$1=="a"{printf "%.1f", $5}' "$tmp/users-jobs.csv")
[ "$alice" = "4.0" ] || fail "fair by session: a ends at 4 s, got '$alice'"
expect_exit 2 "$sim" --trace "$tmp/users.csv" --fair-share group
grep -q "fair-share" "$tmp/err" || fail "bad --fair-share: $(cat "$tmp/err")"

if [ "$failures" -gt 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all salus-sim CLI checks passed"
