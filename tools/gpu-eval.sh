#!/bin/bash
# The whole GPU evaluation of Salus on one machine with an NVIDIA GPU, run from
# the repository root against binaries gathered by tools/bundle.sh (or a build
# directory: a bundle has its layout):
#
#   tools/gpu-eval.sh BUNDLE OUT [PART...]
#
# PARTs (default: all of them, in this order):
#   tests    the gpu device tests (gtest), the cuda integration tests (mount,
#            executor, data plane), plus sim-backend integration tests as a
#            smoke check of the box
#   bench    salus-bench gpu-overhead, gpu-switch-gap (pipeline depth 2 and 1),
#            gpu-pack, dataplane bandwidth, gpu-inference
#   compare  two fixed-length jobs under time-slicing, MPS and salusd (Figure 15)
#   replay   the online-100 trace through salusd on the GPU under FIFO, SRTF,
#            PACK and FAIR, beside salus-sim's prediction of the same trace with
#            salusd's measured per-boundary cost (tools/replay-bench.sh)
#   dataplane  the data-plane bandwidth bench alone, with each GPU isolation
#
# Environment: SALUS_COMPARE_POLICIES (default "pack fair"),
# SALUS_COMPARE_SALUSD_ONLY=1 (skip the native and MPS runs), SALUS_REPLAY_SCALE
# (default 256), SALUS_REPLAY_POLICIES (default "fifo srtf pack fair"),
# SALUS_REPLAY_DEPTH (salusd --pipeline-depth for the replay, default 2: at depth 1 the
# H100 replay strays from salus-sim, see docs/benchmarks.md),
# SALUS_REPLAY_KERNEL_US (salus-replay --kernel-us; default 500: a DL iteration is many
# kernels, and a GPU does not time-slice one that holds every SM).
#
# Each part writes OUT/PART.txt (what is recorded in docs/benchmarks.md) and
# leaves no daemon, mount or MPS server behind.
set -u
bundle=$(realpath "${1:?usage: tools/gpu-eval.sh BUNDLE OUT [PART...]}")
out=$(realpath -m "${2:?usage: tools/gpu-eval.sh BUNDLE OUT [PART...]}")
shift 2
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench compare replay)
mkdir -p "$out"
# The bundle's programs find its libraries through their RPATH; its
# fusermount3 serves a box without fuse3.
export PATH="$PATH:$bundle/tools"
bin=$bundle/tools
gtests=$bundle/tests/vgpu/cuda
work=$(mktemp -d /tmp/salus-gpu-eval-XXXXXX)
daemon_pid=""
mps_dir=""

cleanup() {
  [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  if [ -n "$mps_dir" ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe nvidia-cuda-mps-control 2>/dev/null
  fi
  grep -q " $work/" /proc/mounts && fusermount3 -u -z "$work/mnt" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# Starts salusd on $work/mnt with the given flags; waits for the mount.
start_salusd() {
  mkdir -p "$work/mnt"
  "$bin/salusd" --backend cuda --mount "$work/mnt" --state-dir "$work/state" --log-level warn "$@" >"$work/salusd.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 600); do
    [ -e "$work/mnt/version" ] && return 0
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "salusd did not start:"; cat "$work/salusd.log"; return 1
}
stop_salusd() {
  [ -n "$daemon_pid" ] && kill "$daemon_pid" && wait "$daemon_pid" 2>/dev/null
  daemon_pid=""
}

part_tests() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  export SALUS_TEST_CUDA_FATBIN=$gtests/test_kernels.fatbin SALUS_TEST_CUDA_PTX=$gtests/test_kernels.ptx
  local t faults="RecoversFromAKernelFault RecoversWhileAnotherThreadKeepsEnqueueing WithoutInProcessRecoveryAFaultTakesTheDeviceOutOfService"
  # A kernel fault can poison the process for good: each fault test gets its own.
  local exclude
  exclude=$(for f in $faults; do printf '*.%s:' "$f"; done)
  run_gtest() {
    echo "== $*"
    timeout 300 "$@" 2>&1 | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|Which is|Expected|Skipped|no CUDA' 
    echo "exit status ${PIPESTATUS[0]}"
  }
  run_gtest "$gtests/test_cuda_driver"
  run_gtest "$gtests/test_cuda_device" "--gtest_filter=-${exclude%:}"
  for t in $faults; do run_gtest "$gtests/test_cuda_device" "--gtest_filter=*.$t"; done
  run_gtest "$gtests/test_nvml_gpu"
  echo "== integration (cuda backend, default isolation: one executor process per GPU)"
  SALUSD=$bin/salusd timeout 400 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/integration/test_cuda_backend.py 2>&1 | tail -30
  echo "== executor on the real driver (test_executor.py -k real)"
  SALUSD=$bin/salusd SALUS_TEST_CUDA_REAL=1 SALUS_TEST_CUDA_FATBIN=$gtests/test_kernels.fatbin \
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -k real \
    tests/integration/test_executor.py 2>&1 | tail -30
  echo "== data plane on the cuda backend (SALUS_TEST_BACKEND=cuda)"
  SALUSD=$bin/salusd SALUS_TEST_BACKEND=cuda timeout 400 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/integration/test_dataplane.py tests/integration/test_dataplane_security.py 2>&1 | tail -30
  echo "== integration (sim backend smoke)"
  SALUSD=$bin/salusd SALUSCTL=$bin/salusctl timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_tree.py tests/integration/test_sessions.py \
    tests/integration/test_lanes.py tests/integration/test_isolation.py 2>&1 | tail -5
}

part_bench() {
  local b="$bin/salus-bench --salusd $bin/salusd"
  echo "\$ salus-bench gpu-overhead -n 1000"
  $b gpu-overhead -n 1000
  echo "\$ salus-bench --gpu-isolation thread gpu-overhead -n 1000"
  $b --gpu-isolation thread gpu-overhead -n 1000
  echo "\$ salus-bench gpu-switch-gap -n 2000"
  $b gpu-switch-gap --kernels "$bin/salus_bench_kernels.ptx" -n 2000
  echo "\$ salus-bench gpu-switch-gap -n 2000 --salusd-arg=--pipeline-depth=1"
  $b gpu-switch-gap --kernels "$bin/salus_bench_kernels.ptx" -n 2000 --salusd-arg=--pipeline-depth=1
  echo "\$ salus-bench --gpu-isolation thread gpu-switch-gap -n 2000"
  $b --gpu-isolation thread gpu-switch-gap --kernels "$bin/salus_bench_kernels.ptx" -n 2000
  echo "\$ salus-bench gpu-pack --sessions 8 --size 512 -n 2000"
  $b gpu-pack --sessions 8 --size 512 -n 2000
  echo "\$ salus-bench dataplane --backend cuda --size 1G --repeat 3"
  $b dataplane --backend cuda --size 1G --repeat 3
  echo "\$ salus-bench gpu-inference --models 14 --instances 3 --rate 5 --seconds 20"
  $b gpu-inference --models 14 --instances 3 --rate 5 --seconds 20
}

# Two identical jobs (gemm 2048^3 back to back) for $secs each, started together.
# (A bare `wait` would also wait for salusd.)
two_jobs() {
  local first
  if [ "$1" = --native ]; then
    $b gpu-job --native --op $op --seconds $secs & first=$!
    $b gpu-job --native --op $op --seconds $secs
  else
    $b --mount "$2" gpu-job --op $op --seconds $secs & first=$!
    $b --mount "$2" gpu-job --op $op --seconds $secs
  fi
  wait $first
}
compare_native() {
  echo "== alone (one native job)"
  $b gpu-job --native --op $op --seconds $secs
  echo "== time-slicing (two native processes, no MPS)"
  two_jobs --native
  echo "== MPS (two native processes through nvidia-cuda-mps-control)"
  mps_dir=$work/mps
  mkdir -p "$mps_dir/pipe" "$mps_dir/log"
  export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
  if nvidia-cuda-mps-control -d; then
    sleep 1
    two_jobs --native
    echo quit | nvidia-cuda-mps-control
    sleep 1
    tail -3 "$mps_dir/log/control.log" 2>/dev/null
  else
    echo "MPS could not be started"
  fi
  mps_dir=""
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
part_compare() {
  local secs=20 op=gemm2048 b="$bin/salus-bench"
  local policies=${SALUS_COMPARE_POLICIES:-pack fair}
  [ -z "${SALUS_COMPARE_SALUSD_ONLY:-}" ] && compare_native
  for policy in $policies; do
    echo "== salusd, two sessions, policy $policy"
    start_salusd --policy $policy || return 1
    two_jobs --mount "$work/mnt"
    stop_salusd
  done
}

# online-100 scaled to end in about a minute on a 16 GiB arena (like the
# paper's P100), each job's iterations spin kernels of its iter_ms and util.
part_replay() {
  SCALE=${SALUS_REPLAY_SCALE:-256} DEPTH=${SALUS_REPLAY_DEPTH:-2} \
    KERNEL_US=${SALUS_REPLAY_KERNEL_US:-500} \
    BACKEND_ARGS="--backend cuda --cuda-memory-fraction 0.2" \
    tools/replay-bench.sh "$bin" "$work/replay" ${SALUS_REPLAY_POLICIES:-fifo srtf pack fair}
  cp "$work"/replay/replay-*.csv "$work"/replay/sim-all.csv "$out"/ 2>/dev/null || true
}

part_dataplane() {
  local b="$bin/salus-bench --salusd $bin/salusd" iso
  for iso in process thread; do
    echo "\$ salus-bench --gpu-isolation $iso dataplane --backend cuda --size 1G --repeat 5"
    $b --gpu-isolation $iso dataplane --backend cuda --size 1G --repeat 5
  done
}

rc=0
for p in "${parts[@]}"; do
  echo "######## $p"
  start=$(date +%s)
  "part_$p" 2>&1 | tee "$out/$p.txt" || rc=1
  echo "######## $p took $(( $(date +%s) - start )) s"
done
exit $rc
