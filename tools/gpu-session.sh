#!/bin/bash
# The GPU checks of issues 14 and 15 sized for one short lease of a GPU box: a
# list of steps in priority order, each run only while the time budget allows
# it, each bounded by a timeout, the results written as they come, so that a
# lease cut short still brings back everything finished before.
#
#   tools/gpu-session.sh [--dry-run] BUNDLE OUT [--budget SECONDS] [STEP...]
#
# BUNDLE: made by tools/bundle.sh (or a build directory). OUT gets exactly two
# files, rewritten after every step: summary.txt (each step's figures, its
# time, or why it was skipped) and details.tar.gz (every step's JSON and logs).
# --budget (default 540) is wall time for the whole run: a step starts only if
# its estimate fits in what is left, and is stopped at what is left.
#
# STEPs (default: all, in this order; estimates for an H100/H200):
#   env         GPU, driver, torch, /dev/fuse, the bundle's salusd (5 s)
#   compat      pytorch-eval --quick compat: ResNet-50-style and GPT-2-style
#               training, 100 steps, losses native vs salus-run, both
#               allocators; inference; torchrun's worker holds the session;
#               the largest context measured (150 s)
#   gate        salus-bench gate; bench_shim_launch on the real driver (30 s)
#   throughput  pytorch-eval --quick throughput (60 s)
#   fair        pytorch-eval --quick fair (70 s)
#   inference   pytorch-eval --quick inference: 42 sessions (120 s)
#   swap        tools/swap-eval.sh 4096 3 with a spill pass (/var/tmp) (90 s)
#   oversub     pytorch-eval --quick oversub (180 s)
#   backing     salus-bench backing --sizes 1G,10G,40G (60 s)
#   handover    tools/lane-eval.sh 256,1024,4096,16384 3 (45 s)
#   trace       pytorch-eval --quick trace (150 s)
#   lanes       pytorch-eval --quick lanes (150 s)
#   mps         tools/mps-eval.sh (150 s)
#   tests       tools/gpu-eval.sh tests (300 s)
#
# A 15-minute lease: `--budget 540` (the first 9 minutes: env to swap), then,
# with what is left and at once (the machine stays warm 30 s), `--budget 210
# oversub backing handover` with SALUS_HOST_MIB set to the machine's memory
# (a microVM's MemTotal starts far lower); a later lease `trace lanes mps
# tests`, then the full runs (pytorch-eval.sh without --quick).
#
# --dry-run: the same plumbing without a GPU (what CI runs, with the bundle made
# from the test build): CPU torch and a sim-backend salusd for the PyTorch
# steps, the mock libcuda (SALUS_TEST_CUDA_MOCK_DIR) for gate, swap and
# backing; handover, mps and tests are skipped. Its figures mean nothing.
set -u
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
usage="usage: tools/gpu-session.sh [--dry-run] BUNDLE OUT [--budget SECONDS] [STEP...]"
bundle=$(realpath "${1:?$usage}")
out=$(realpath -m "${2:?$usage}")
shift 2
budget=540
if [ "${1:-}" = "--budget" ]; then budget=${2:?$usage}; shift 2; fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env compat gate throughput fair inference swap oversub backing
  handover trace lanes mps tests)
cd "$(dirname "$0")/.."
declare -A estimate=([env]=5 [compat]=150 [gate]=30 [throughput]=60 [fair]=70 [inference]=120
  [swap]=90 [oversub]=180 [backing]=60 [handover]=45 [trace]=150 [lanes]=150 [mps]=150
  [tests]=300)
for s in "${steps[@]}"; do
  [ -n "${estimate[$s]:-}" ] || { echo "gpu-session: unknown step '$s'" >&2; exit 2; }
done
[ -x "$bundle/tools/salusd" ] || { echo "gpu-session: $bundle/tools/salusd: no salusd in the bundle" >&2; exit 1; }
mkdir -p "$out"
work=$(mktemp -d /tmp/salus-gpu-session-XXXXXX)
chmod 755 "$work"
mkdir -p "$work/details"
trap 'rm -rf "$work"' EXIT
export PATH="$PATH:$bundle/tools" SALUS_BUILD=$bundle PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
t_start=$(date +%s)
summary=$out/summary.txt
: >"$summary"

pe=(tools/pytorch-eval.sh --quick)
[ $dry = 1 ] && pe=(tools/pytorch-eval.sh --dry-run)
mock_env=()
if [ $dry = 1 ]; then
  [ -n "${SALUS_TEST_CUDA_MOCK_DIR:-}" ] && mock_env=(env "LD_LIBRARY_PATH=$SALUS_TEST_CUDA_MOCK_DIR")
fi
# Steps that need the mock driver in a dry run say so when it is missing.
need_driver() {
  [ $dry = 0 ] && return 0
  [ ${#mock_env[@]} -gt 0 ] && return 0
  echo "skipped: a dry run needs SALUS_TEST_CUDA_MOCK_DIR (the mock libcuda) for this step"
  return 1
}
no_dry() {
  [ $dry = 0 ] && return 0
  echo "skipped in a dry run: needs a GPU"
  return 1
}

step_env() {
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1
  uname -sr
  echo "cpus $(nproc), $(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo) MiB MemTotal" \
    "(oversub sizes from SALUS_HOST_MIB=${SALUS_HOST_MIB:-unset} where set)"
  if [ -c /dev/fuse ]; then echo "/dev/fuse present"; else echo "/dev/fuse MISSING: salusd cannot mount"; fi
  "$bundle/tools/salusd" --version 2>&1 | head -1
}

# pytorch-eval PART: its figures, its JSON into the details.
pytorch_part() {
  "${pe[@]}" "$work/details/pytorch" "$1" | grep -v '^== '
}

step_compat() { pytorch_part compat; }
step_throughput() { pytorch_part throughput; }
step_fair() { pytorch_part fair; }
step_inference() { pytorch_part inference; }
step_oversub() { pytorch_part oversub; }
step_trace() { pytorch_part trace; }
step_lanes() { pytorch_part lanes; }

step_gate() {
  need_driver || return 0
  echo "\$ salus-bench gate"
  "$bundle/tools/salus-bench" --salusd "$bundle/tools/salusd" gate
  echo "\$ bench_shim_launch libsalus-shim.so"
  "${mock_env[@]}" "$bundle/tests/vgpu/cuda/bench_shim_launch" "$bundle/client/shim/libsalus-shim.so"
}

step_swap() {
  need_driver || return 0
  if [ $dry = 1 ]; then
    local a=(--salusd "$bundle/tools/salusd" --shim "$bundle/client/shim/libsalus-shim.so"
      --program "$bundle/tests/integration/swap_program" --mib 16 --rounds 2
      --libcuda "$SALUS_TEST_CUDA_MOCK_DIR/libcuda.so.1")
    $py tools/swap_eval.py "${a[@]}" && $py tools/swap_eval.py "${a[@]}" --segments 4
  else
    SWAP_EVAL_SPILL_DIR=/var/tmp tools/swap-eval.sh 4096 3
  fi
}

step_handover() { no_dry || return 0; tools/lane-eval.sh 256,1024,4096,16384 3; }

step_backing() {
  need_driver || return 0
  local sizes=1G,10G,40G
  [ $dry = 1 ] && sizes=64M,256M
  "${mock_env[@]}" "$bundle/tools/salus-bench" --salusd "$bundle/tools/salusd" backing --sizes $sizes
}

step_mps() {
  no_dry || return 0
  tools/mps-eval.sh "$work/details/mps" | grep -v '^== '
}

step_tests() { no_dry || return 0; tools/gpu-eval.sh "$bundle" "$work/details/gpu-eval" tests; }

# Rewrites OUT/details.tar.gz from what the steps left so far.
save_details() {
  tar -C "$work" -czf "$out/details.tar.gz.new" details 2>/dev/null &&
    mv "$out/details.tar.gz.new" "$out/details.tar.gz"
}

for s in "${steps[@]}"; do
  left=$((budget - ($(date +%s) - t_start)))
  [ "$left" -lt 0 ] && left=0  # a stopped step's kill may take past the budget
  est=${estimate[$s]}
  [ $dry = 1 ] && est=1
  echo "######## $s" >>"$summary"
  if [ "$left" -lt "$est" ]; then
    echo "skipped: ${left} s of the budget left, the step needs about ${est} s" >>"$summary"
    continue
  fi
  t0=$(date +%s)
  # timeout stops the step's whole process group (daemons it started too); the
  # step runs in a fresh bash given this script's functions and settings.
  timeout -k 10 "$left" bash -c "$(declare -p bundle work dry py pe mock_env; declare -f)
    cd $PWD && step_$s" >"$work/details/$s.log" 2>&1 </dev/null
  rc=$?
  cat "$work/details/$s.log" >>"$summary"
  case $rc in
    0) echo "######## $s: done in $(($(date +%s) - t0)) s" >>"$summary" ;;
    124 | 137) echo "######## $s: STOPPED at the budget after $(($(date +%s) - t0)) s" >>"$summary" ;;
    *) echo "######## $s: FAILED (exit $rc) after $(($(date +%s) - t0)) s" >>"$summary" ;;
  esac
  save_details
done
echo "######## total $(($(date +%s) - t_start)) s of a ${budget} s budget" >>"$summary"
save_details
cat "$summary"
