#!/bin/bash
# Issue 14's MPS evaluation: two attached PyTorch programs on one GPU, with
# salusd's MPS server (--mps 0) and without (time-slicing), on a real GPU.
#
#   tools/mps-eval.sh OUT [PART...]
#
# Run from the repository root with a build that has the cuda backend and the
# shim (SALUS_BUILD, default ./build), nvidia-cuda-mps-control on PATH, and a
# PYTHON (default python3) that imports a CUDA torch. No other CUDA process may
# use GPU 0 meanwhile. PARTs (default: both):
#   throughput  SALUS_MPS_N (2) ResNet inference programs (small batch, so each
#               leaves SMs idle) at once on GPU 0, each in its own lane under
#               FAIR: their summed inferences/s with MPS and without, beside one
#               alone. The ratio MPS / time-slicing is the figure.
#   fault       a GPT training program plus, 5 s later, a program whose kernel
#               faults (an out-of-bounds index: a device-side assert), both on
#               GPU 0: the training program's exit status and steps, with MPS
#               and without. Expected: without MPS the training run is
#               untouched; with MPS the fault reaches it (design.md, *MPS*).
# Each part writes OUT/PART.txt (the lines for docs/benchmarks.md) and OUT/PART/
# (the JSON and logs of every run). No daemon or mount is left behind.
set -u
out=$(realpath -m "${1:?usage: tools/mps-eval.sh OUT [PART...]}")
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(throughput fault)
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath "${SALUS_BUILD:-build}")
salusd=$build/tools/salusd salus_run=$build/tools/salus-run
py=${PYTHON:-python3}
wl="$py $here/pytorch_eval/workloads.py"
n=${SALUS_MPS_N:-2}
for f in "$salusd" "$salus_run" "$build/client/shim/libsalus-shim.so"; do
  [ -e "$f" ] || { echo "mps-eval: $f is not built" >&2; exit 1; }
done
command -v nvidia-cuda-mps-control >/dev/null || { echo "mps-eval: nvidia-cuda-mps-control not on PATH" >&2; exit 1; }
mkdir -p "$out"
work=$(mktemp -d /tmp/salus-mps-eval-XXXXXX)
chmod 755 "$work"
daemon_pid=""

stop_salusd() {
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null; fi
  daemon_pid=""
  grep -q " $work/mnt " /proc/mounts && fusermount3 -u -z "$work/mnt" 2>/dev/null
}
cleanup() { stop_salusd; rm -rf "$work"; }
trap cleanup EXIT

# start_salusd LOG [ARGS...]: salusd on the cuda backend, FAIR, at $work/mnt.
start_salusd() {
  local log=$1; shift
  mkdir -p "$work/mnt"
  # Half the card for the arena, half for the programs' own memory beside it
  # (design.md, Placement in the arena).
  "$salusd" --backend cuda --cuda-memory-fraction "${SALUS_EVAL_ARENA_FRACTION:-0.9}" \
    --policy fair --mount "$work/mnt" --state-dir "" \
    --mps-dir "$work/mps" "$@" >"$log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 1200); do
    [ -e "$work/mnt/version" ] && return 0
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.05
  done
  echo "mps-eval: salusd did not start:" >&2
  cat "$log" >&2
  exit 1
}

srun=("$salus_run" --mount "$work/mnt" --gpu 0 --persistent 4G --ephemeral 2G)
header() { echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), torch $($py -c 'import torch; print(torch.__version__)')"; }
jget() { $py -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

# infer_all DIR: n inference programs at once; sets `rate` to their summed
# inferences/s (not a $(...) subshell: salusd's pid must stay in this shell).
infer_all() {
  local d=$1 i
  mkdir -p "$d"
  for i in $(seq "$n"); do
    "${srun[@]}" -- $wl infer --model resnet --device cuda --batch 8 --iters 2000 --warmup 50 \
      >"$d/$i.json" 2>"$d/$i.err" &
  done
  wait
  rate=$($py - "$d" "$n" <<'PY'
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
print(f"{sum(1e3 / json.load(open(f'{d}/{i}.json'))['mean_ms'] for i in range(1, n + 1)):.1f}")
PY
)
}

part_throughput() {
  local d=$out/throughput alone ts mps rate
  mkdir -p "$d"
  start_salusd "$d/salusd-timeslice.log"
  "${srun[@]}" -- $wl infer --model resnet --device cuda --batch 8 --iters 2000 --warmup 50 >"$d/alone.json"
  alone=$($py -c "import json; print(f\"{1e3 / json.load(open('$d/alone.json'))['mean_ms']:.1f}\")")
  infer_all "$d/timeslice"
  ts=$rate
  stop_salusd
  start_salusd "$d/salusd-mps.log" --mps 0
  grep -q "^mps: on" "$work/mnt/gpus/0/info" || { echo "mps-eval: gpu 0 has no MPS" >&2; exit 1; }
  infer_all "$d/mps"
  mps=$rate
  stop_salusd
  echo "$n ResNet inference programs (batch 8) on GPU 0: alone $alone/s; together, time-slicing $ts/s, MPS $mps/s; MPS / time-slicing $($py -c "print(f'{$mps / $ts:.2f}')")"
}

# fault_run LABEL DIR [SALUSD ARGS...]: prints one line.
fault_run() {
  local label=$1 d=$2; shift 2
  mkdir -p "$d"
  start_salusd "$d/salusd.log" "$@"
  # Its own need: a GPT-2-small step at batch 8 peaks near 11 GB, past srun's
  # 6 GiB (and MPS would hold it to that).
  "$salus_run" --mount "$work/mnt" --gpu 0 --persistent 16G --ephemeral 0 -- \
    $wl train --model gpt --device cuda --duration 30 >"$d/train.json" 2>"$d/train.err" &
  local train=$!
  sleep 5
  "${srun[@]}" --no-automark -- $py -c 'import torch
x = torch.zeros(16, device="cuda"); i = torch.tensor([1 << 20], device="cuda")
x[i] = 1; torch.cuda.synchronize()' >"$d/fault.out" 2>&1
  local frc=$?
  wait "$train"
  local trc=$?
  local steps
  steps=$(jget "$d/train.json" 'd["steps"]' 2>/dev/null || echo "-")
  stop_salusd
  echo "$label faulting program exit $frc; training program exit $trc, steps $steps"
}

part_fault() {
  local d=$out/fault
  fault_run "without MPS:" "$d/timeslice"
  fault_run "with MPS:   " "$d/mps" --mps 0
}

for p in "${parts[@]}"; do
  case $p in
    throughput | fault) { header; "part_$p"; } > >(tee "$out/$p.txt") ;;
    *) echo "mps-eval: unknown part $p" >&2; exit 2 ;;
  esac
done
