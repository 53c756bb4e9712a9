#!/bin/bash
# Issue 14's GPU evaluation: real PyTorch jobs, unmodified, under salus-run.
#
#   tools/pytorch-eval.sh [--dry-run | --quick] OUT [PART...]
#
# Run from the repository root with a build that has the cuda backend and the
# shim (SALUS_BUILD, default ./build: tools/salusd, tools/salus-run, tools/salus-sim,
# client/shim/libsalus-shim.so). The workloads are tools/pytorch_eval/workloads.py.
# PARTs (default: all, in this order):
#   compat      ResNet-50-style CNN (AMP) and GPT-2-small-style transformer (SDPA),
#               eager / torch.compile / CUDA graphs, expandable segments off and on:
#               100 deterministic steps natively and under salus-run, losses
#               compared bit for bit; inference under inference_mode both ways;
#               torchrun --nproc_per_node gpu under salus-run (its worker must
#               hold the session)
#   throughput  samples/s of both models (cudnn.benchmark, AMP) alone, native vs
#               under salus-run: the ratio (target >= 0.98)
#   fair        two identical GPT jobs for SALUS_FAIR_S seconds under FAIR: each
#               one's share of GPU time (salusd's gpu_time_ms) and of steps; and the
#               same two natively (time-slicing) for comparison
#   trace       12 GPT jobs of different lengths arriving 2 s apart, under FIFO and
#               SRTF: average JCT, beside salus-sim's prediction of the same trace
#               built from the measured time per step
#   inference   SALUS_INFER_N (42) ResNet inference sessions at once under FAIR:
#               p50/p95 latency beside the same model alone (native and salus-run)
#   oversub     issue 15, nvshare's experiment: two GPT jobs that each hold
#               SALUS_OVERSUB_SHARE (0.65) of the GPU's memory in live state, run
#               back to back natively, then both at once under salusd
#               --oversubscribe 2 (FAIR, movable memory: SALUS_SWAP=1; with
#               PyTorch's default allocator, then with expandable segments, whose
#               handles the shim moves too; SALUS_OVERSUB_ALLOC picks), then,
#               with SALUS_OVERSUB_UM=1 only, both at once natively on unified
#               memory with no gate (um_alloc.c; "scheduler off": managed memory
#               past the card's free memory can hang the GPU on some machines):
#               total completion times and their ratios. A swapped-out job waits
#               in pinned host memory: where 65% of the card is more than 40% of
#               the host's memory (MemTotal, or SALUS_HOST_MIB where MemTotal
#               understates it; an H200 on a 128 GB host), a ballast process
#               holds the rest of the card for the whole part and the output
#               says so
#   lanes       issue 15, shared lanes with real jobs: SALUS_LANES_N GPT jobs (by
#               default one more than fit with their own memory, at most 8: on
#               a large card each job gets live state until 7 fill it) at once under
#               FAIR, first each with its own memory (need P + E), then with
#               salus-run --shared-lane=alloc (need P, the lane's E once per GPU),
#               then with PyTorch's expandable segments on, which salus-run serves
#               as --shared-lane=segments (the lane as room for their cuMemCreate):
#               the most sessions admitted at once, total time, steps/s, and each
#               job's losses against the same job run alone
#
# On a GPU salusd runs the cuda backend with --cuda-memory-fraction
# SALUS_EVAL_ARENA_FRACTION (0.9) and its arena backed on demand, so the card
# memory salusd does not hold is the attached jobs' (design.md, The arena backed
# on demand); oversub runs a sim-backend salusd sized to the card instead.
#
# --dry-run: the same steps on the CPU with tiny models against a sim-backend
# salusd (fewer jobs, seconds not minutes, compile/graphs/expandable segments
# skipped): what CI runs to keep this script working. Its figures mean nothing.
#
# --quick: on the GPU, sized for a short lease (tools/gpu-session.sh): eager
# mode only in compat (still 100 steps, both allocators), 100 steps for
# throughput, 20 s for fair, 100 inferences per session, the trace's jobs 3x
# its lengths rather than 10x, and 40 steps per oversub job.
#
# Each part writes OUT/PART.txt (the lines for docs/benchmarks.md) and OUT/PART/
# (the JSON of every run). No daemon or mount is left behind.
set -u
dry=0 quick=0
case "${1:-}" in
  --dry-run) dry=1; shift ;;
  --quick) quick=1; shift ;;
esac
out=$(realpath -m "${1:?usage: tools/pytorch-eval.sh [--dry-run | --quick] OUT [PART...]}")
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(compat throughput fair trace inference oversub lanes)
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath "${SALUS_BUILD:-build}")
salusd=$build/tools/salusd salus_run=$build/tools/salus-run salus_sim=$build/tools/salus-sim
py=${PYTHON:-python3}
wl="$py $here/pytorch_eval/workloads.py"
for f in "$salusd" "$salus_run" "$salus_sim" "$build/client/shim/libsalus-shim.so"; do
  [ -e "$f" ] || { echo "pytorch-eval: $f is not built" >&2; exit 1; }
done
mkdir -p "$out"
work=$(mktemp -d /tmp/salus-pytorch-eval-XXXXXX)
daemon_pid=""
if [ $dry = 1 ]; then
  dev=(--device cpu --tiny) backend=(--backend sim --sim-gpus 1 --sim-memory 64G)
  steps=6 tput_steps=8 fair_s=4 infer_n=${SALUS_INFER_N:-3} infer_iters=10 warm=2
  modes=(eager) alloc_confs=(default) trace_scale=1
else
  # The arena takes its fraction of the card up front and attached programs
  # allocate beside it (design.md, Placement in the arena): half and half lets
  # the jobs' needs be admitted and also be free on the card.
  dev=(--device cuda) backend=(--backend cuda --cuda-memory-fraction "${SALUS_EVAL_ARENA_FRACTION:-0.9}")
  steps=100 tput_steps=300 fair_s=${SALUS_FAIR_S:-60} infer_n=${SALUS_INFER_N:-42}
  infer_iters=500 warm=20 modes=(eager compile graphs) alloc_confs=(default expandable)
  trace_scale=10 oversub_steps=200
  if [ $quick = 1 ]; then
    tput_steps=100 fair_s=${SALUS_FAIR_S:-20} infer_iters=100 warm=10 modes=(eager)
    trace_scale=3 oversub_steps=40
  fi
fi

ballast_pid=""
cleanup() {
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null; fi
  if [ -n "$ballast_pid" ]; then kill "$ballast_pid" 2>/dev/null; wait "$ballast_pid" 2>/dev/null; fi
  grep -q " $work/mnt " /proc/mounts && fusermount3 -u -z "$work/mnt" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

start_salusd() {
  mkdir -p "$work/mnt"
  "$salusd" "${backend[@]}" --mount "$work/mnt" --log-level warn "$@" >"$work/salusd.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 600); do
    [ -e "$work/mnt/version" ] && return 0
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.05
  done
  echo "pytorch-eval: salusd did not start:" >&2
  cat "$work/salusd.log" >&2
  exit 1
}

stop_salusd() {
  kill "$daemon_pid" 2>/dev/null
  wait "$daemon_pid" 2>/dev/null
  daemon_pid=""
  grep -q " $work/mnt " /proc/mounts && fusermount3 -u -z "$work/mnt" 2>/dev/null
  return 0
}

# Runs salusd with these extra arguments (and the current `backend`), restarting
# it if it runs with others. The parts run in a pipeline (a subshell): only this
# loop, in the script's own shell, may start or stop the daemon.
running_args=""
ensure_salusd() {
  local want="${backend[*]} $*"
  [ -n "$daemon_pid" ] && [ "$running_args" = "$want" ] && return 0
  [ -n "$daemon_pid" ] && stop_salusd
  start_salusd "$@"
  running_args=$want
}

policy() { echo "$1" >"$work/mnt/policy"; }
# salus-run with the eval's mount (an array, so that `env` can run it too); the
# need is measured unless given.
srun=("$salus_run" --mount "$work/mnt")
alloc_env() { [ "$1" = expandable ] && echo "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" || echo "PYTORCH_CUDA_ALLOC_CONF="; }
jget() { $py -c 'import json,sys; d=json.load(open(sys.argv[1])); v=eval(sys.argv[2], {}, {"d": d}); print(v)' "$@"; }

versions() {
  $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  [ $dry = 1 ] && echo "DRY RUN (CPU, tiny models, sim salusd): these figures mean nothing"
  [ $quick = 1 ] && echo "quick profile (--quick): eager only, fewer steps and shorter runs than the full evaluation"
}

part_compat() {
  local d=$out/compat; mkdir -p "$d"
  policy fifo
  for model in resnet gpt; do
    local amp=(); [ $model = resnet ] && amp=(--amp)
    for mode in "${modes[@]}"; do
      for ac in "${alloc_confs[@]}"; do
        local tag=$model-$mode-$ac
        env "$(alloc_env "$ac")" $wl train --model $model --mode $mode "${amp[@]}" "${dev[@]}" \
          --steps $steps --deterministic >"$d/$tag-native.json" || echo "$tag native: FAILED"
        env "$(alloc_env "$ac")" "${srun[@]}" -- $wl train --model $model --mode $mode "${amp[@]}" \
          "${dev[@]}" --steps $steps --deterministic >"$d/$tag-salus.json" || echo "$tag salus-run: FAILED"
        $py - "$d/$tag-native.json" "$d/$tag-salus.json" "$tag" <<'EOF'
import json, sys
try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except Exception as e:
    print(f"{sys.argv[3]}: no result ({e})"); sys.exit(0)
if "skipped" in a:
    print(f"{sys.argv[3]}: skipped: {a['skipped']}"); sys.exit(0)
la, lb = a["losses"], b["losses"]
diff = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)
same = diff is None and len(la) == len(lb)
s = b.get("session") or {}
b_ = lambda v: f"{v} B" if str(v).isdigit() else str(v)  # "unavailable (why)" as it is
print(f"{sys.argv[3]}: {len(la)} steps, losses {'bit-identical' if same else f'DIFFER from step {diff}'}"
      f"; under salus-run: {s.get('kind')} session, {s.get('iterations_completed')} iterations,"
      f" peak {s.get('memory_peak')} B; the driver's figure {b_(s.get('memory_gpu'))},"
      f" beyond the charge (context) {b_(s.get('memory_context'))},"
      f" reserve {b_(s.get('memory_context_reserve'))}")
EOF
      done
    done
    $wl infer --model $model "${dev[@]}" --iters 50 --warmup $warm >"$d/$model-infer-native.json"
    "${srun[@]}" -- $wl infer --model $model "${dev[@]}" --iters 50 --warmup $warm >"$d/$model-infer-salus.json"
    echo "$model inference_mode: native p50 $(jget "$d/$model-infer-native.json" 'round(d["p50_ms"],3)') ms," \
      "salus-run p50 $(jget "$d/$model-infer-salus.json" 'round(d["p50_ms"],3)') ms," \
      "$(jget "$d/$model-infer-salus.json" 'd["session"]["iterations_completed"]') iterations seen by salusd"
  done
  # A launcher: torchrun's agent imports torch (so it attaches first) and, with
  # --nproc_per_node gpu, initialises CUDA (torch.cuda.is_available); its worker,
  # which allocates GPU memory, must take the session over and count its steps.
  # --redirects 2 --tee 2: PyTorch 1.13's torchrun fails on Python 3.11 with its
  # default 0 (test_salus_run.py, TORCHRUN_PY311); stderr still reaches us.
  if [ $dry = 1 ]; then
    echo "torchrun: skipped in a dry run (--nproc_per_node gpu needs a GPU; test_salus_run.py runs Debian's torchrun on the mock driver)"
  else
    "${srun[@]}" -- $py -m torch.distributed.run --standalone --nproc_per_node gpu \
      --redirects 2 --tee 2 --log_dir "$d/torchrun-logs" \
      "$here/pytorch_eval/workloads.py" train --model gpt "${dev[@]}" --steps 20 \
      >"$d/torchrun.json" 2>"$d/torchrun.err" || echo "torchrun: FAILED (see compat/torchrun.err)"
    $py - "$d/torchrun.json" <<'EOF'
import json, sys
try:
    lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
    s = json.loads(lines[-1])["session"]
except Exception as e:
    print(f"torchrun: no result ({e})"); sys.exit(0)
held = "the worker holds it" if s.get("pid") == s.get("self_pid") else "NOT the worker"
print(f"torchrun --nproc_per_node gpu (one GPU visible), 20 steps: the session's pid {s.get('pid')}, the worker's"
      f" {s.get('self_pid')} ({held}), {s.get('iterations_completed')} iterations")
EOF
  fi
  # The largest context salusd measured (NVML less charge): --attach-context-reserve's value.
  # With auto the reserve has learned that context; processes of no session should
  # be none here (salusd's own and the jobs' are classified: broker_processes.cpp).
  outside=$(sed -n 's/^outside_sessions: //p' "$work/mnt/gpus/0/memory")
  case $outside in '' | -) outside="-" ;; *) outside="$outside B" ;; esac
  echo "largest context measured on gpu 0: $(sed -n 's/^context_measured: //p' "$work/mnt/gpus/0/memory") B" \
    "(reserve $(sed -n 's/^context_reserve: //p' "$work/mnt/gpus/0/memory") B), outside sessions: $outside"
  # Who holds the card now, as the census sorted it (salusd's executor: "salusd").
  cp "$work/mnt/gpus/0/processes" "$d/processes.txt" 2>/dev/null || true
}

part_throughput() {
  local d=$out/throughput; mkdir -p "$d"
  policy fifo
  for model in resnet gpt; do
    local amp=(); [ $model = resnet ] && amp=(--amp)
    $wl train --model $model "${amp[@]}" "${dev[@]}" --steps $tput_steps --warmup $warm >"$d/$model-native.json"
    "${srun[@]}" -- $wl train --model $model "${amp[@]}" "${dev[@]}" --steps $tput_steps --warmup $warm >"$d/$model-salus.json"
    local a b
    a=$(jget "$d/$model-native.json" 'd["samples_per_s"]')
    b=$(jget "$d/$model-salus.json" 'd["samples_per_s"]')
    echo "$model: native $a samples/s, salus-run $b samples/s, ratio $($py -c "print(round($b/$a, 4))")"
  done
}

part_fair() {
  local d=$out/fair; mkdir -p "$d"
  policy fair
  for i in 0 1; do
    "${srun[@]}" --gpu 0 --persistent 16G --ephemeral 0 --policy-hint name=fair$i -- $wl train --model gpt "${dev[@]}" --duration $fair_s \
      --tag fair$i >"$d/salus-$i.json" &
  done
  wait
  $py - "$d/salus-0.json" "$d/salus-1.json" <<'EOF'
import json, sys
r = [json.load(open(p)) for p in sys.argv[1:]]
g = [float(x["session"]["gpu_time_ms"]) for x in r]
s = [x["steps"] for x in r]
print("FAIR under salusd: GPU time share " + " / ".join(f"{100 * v / sum(g):.1f}%" for v in g)
      + ", steps " + " / ".join(str(v) for v in s) + f" (target 50% +-5%)")
EOF
  for i in 0 1; do
    $wl train --model gpt "${dev[@]}" --duration $fair_s --tag native$i >"$d/native-$i.json" &
  done
  wait
  echo "time-slicing (two native processes): steps $(jget "$d/native-0.json" 'd["steps"]') / $(jget "$d/native-1.json" 'd["steps"]')"
}

part_trace() {
  local d=$out/trace; mkdir -p "$d"
  # time per step and peak memory alone (under salus-run --measure), for the
  # jobs' declared need and the trace given to salus-sim
  policy fifo
  local t_a t_b
  t_a=$($py -c 'import time; print(time.time())')
  "${srun[@]}" -- $wl train --model gpt "${dev[@]}" --steps $((tput_steps / 3 + 2)) --warmup 2 >"$d/alone.json"
  t_b=$($py -c 'import time; print(time.time())')
  local step_ms need_mb startup_s
  step_ms=$(jget "$d/alone.json" 'round(1000 * d["wall_s"] / d["steps"], 3)')
  # salus-sim knows iterations only: a job's start-up (python, import torch, the
  # CUDA context) is reported beside its prediction
  startup_s=$($py -c "print(round($t_b - $t_a - $(jget "$d/alone.json" 'd["wall_s"]'), 3))")
  need_mb=$(jget "$d/alone.json" 'max(64, int(int(d["session"].get("memory_peak") or 0) * 1.1 / 2**20) + 1)')
  local lens=(5 40 12 25 3 30 8 18 35 6 15 22)
  # The simulated GPU is the one salusd admits on: its admission capacity, and
  # each job's need with the context reserve salusd counts beside it.
  local sim_mib ctx_mib
  sim_mib=$(($(sed -n 's/^admit_capacity: //p' "$work/mnt/gpus/0/memory") >> 20))
  ctx_mib=$(($(sed -n 's/^context_reserve: //p' "$work/mnt/gpus/0/memory") >> 20))
  {
    echo "job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util,priority"
    for i in "${!lens[@]}"; do
      echo "job$i,$((2 * i)),gpt,$((need_mb + ctx_mib)),0,$step_ms,$((lens[i] * trace_scale)),1.0,0"
    done
  } >"$d/trace.csv"
  for p in fifo srtf; do
    policy $p
    local t0; t0=$($py -c 'import time; print(time.time())')
    for i in "${!lens[@]}"; do
      (
        sleep $((2 * i))
        local s e
        s=$($py -c 'import time; print(time.time())')
        "${srun[@]}" --gpu 0 --iters $((lens[i] * trace_scale)) --persistent ${need_mb}M --ephemeral 0 -- \
          $wl train --model gpt "${dev[@]}" --steps $((lens[i] * trace_scale)) --tag job$i \
          >"$d/$p-job$i.json"
        e=$($py -c 'import time; print(time.time())')
        echo "job$i $s $e" >>"$d/$p-times.txt"
      ) &
    done
    wait
    local avg
    avg=$($py -c "
import sys
rows=[l.split() for l in open('$d/$p-times.txt')]
t0=$t0
print(round(sum(float(e)-t0-2*int(j[3:]) for j,s,e in rows)/len(rows),3))")
    local sim
    sim=$("$salus_sim" --trace "$d/trace.csv" --policy $p --gpu-memory "$sim_mib"M |
      awk -v p=$p '$1==p {print $4}')
    echo "$p: measured avg JCT ${avg} s; salus-sim predicts ${sim} s from the iterations alone" \
      "(step ${step_ms} ms alone, need ${need_mb} MiB each; each job's start-up, ${startup_s} s alone, is not in the prediction)"
  done
}

part_inference() {
  local d=$out/inference; mkdir -p "$d"
  # 42 x (768M + 384M + salusd's 512M context reserve per attached program) = 68 GiB:
  # within the default arena (0.9) of an 80 GB card. A ResNet-50 at batch 1 peaks
  # far below 1 GiB; set SALUS_INFER_NEED="--persistent P --ephemeral E" to change it.
  local need=(${SALUS_INFER_NEED:---persistent 768M --ephemeral 384M})
  policy fair
  $wl infer --model resnet "${dev[@]}" --batch 1 --iters $infer_iters --warmup $warm >"$d/alone-native.json"
  "${srun[@]}" "${need[@]}" -- $wl infer --model resnet "${dev[@]}" --batch 1 \
    --iters $infer_iters --warmup $warm >"$d/alone-salus.json"
  for i in $(seq $infer_n); do
    "${srun[@]}" --gpu 0 "${need[@]}" -- $wl infer --model resnet "${dev[@]}" --batch 1 \
      --iters $infer_iters --warmup $warm --tag s$i >"$d/shared-$i.json" &
  done
  wait
  $py - "$d" "$infer_n" <<'EOF'
import json, os, sys
d, n = sys.argv[1], int(sys.argv[2])
alone = json.load(open(os.path.join(d, "alone-native.json")))
alone_s = json.load(open(os.path.join(d, "alone-salus.json")))
shared = [json.load(open(os.path.join(d, f"shared-{i}.json"))) for i in range(1, n + 1)]
p50 = sorted(x["p50_ms"] for x in shared)
p95 = sorted(x["p95_ms"] for x in shared)
print(f"alone: native p50 {alone['p50_ms']:.3f} ms, salus-run p50 {alone_s['p50_ms']:.3f} ms")
print(f"{n} sessions at once under FAIR: p50 of the sessions' p50 {p50[len(p50)//2]:.3f} ms "
      f"(max {p50[-1]:.3f}), worst p95 {p95[-1]:.3f} ms; overhead vs alone "
      f"{p50[len(p50)//2] - alone['p50_ms']:.3f} ms (paper: < 5 ms)")
EOF
}

part_oversub() {
  local d=$out/oversub; mkdir -p "$d"
  local cap_mib extra_mib eph_mib steps
  if [ $dry = 1 ]; then
    cap_mib=1024 extra_mib=64 eph_mib=64 steps=4
  else
    cap_mib=$oversub_card_mib
    extra_mib=${SALUS_OVERSUB_EXTRA_MIB:-3072} eph_mib=${SALUS_OVERSUB_EPHEMERAL_MIB:-12288}
    steps=${SALUS_OVERSUB_STEPS:-$oversub_steps}
  fi
  local state_mib
  state_mib=$($py -c "print(int($cap_mib * ${SALUS_OVERSUB_SHARE:-0.65}))")
  local job=($wl train --model gpt "${dev[@]}" --steps "$steps" --warmup 0 --state-mib "$state_mib")
  echo "two GPT jobs of $steps steps, each with $state_mib MiB of live state on a $cap_mib MiB GPU" \
    "${oversub_note:-}"
  local t0 t1 seq_s over_s um_s
  t0=$(date +%s.%N)
  "${job[@]}" --tag seq0 >"$d/seq-0.json" && "${job[@]}" --tag seq1 >"$d/seq-1.json"
  t1=$(date +%s.%N)
  seq_s=$($py -c "print(round($t1 - $t0, 3))")
  echo "back to back, native: $seq_s s"
  policy fair
  # PyTorch's default allocator, then expandable segments (the program's own
  # cuMemCreate handles, which the shim moves too: memory_unswappable ~0).
  local conf
  for conf in ${SALUS_OVERSUB_ALLOC:-default expandable}; do
    t0=$(date +%s.%N)
    for i in 0 1; do
      env SALUS_SWAP=1 $(alloc_env "$conf") "${srun[@]}" --gpu 0 \
        --persistent "$((state_mib + extra_mib))M" --ephemeral "${eph_mib}M" \
        --policy-hint name=over$i -- "${job[@]}" --tag over$i >"$d/over-$conf-$i.json" &
    done
    wait
    t1=$(date +%s.%N)
    over_s=$($py -c "print(round($t1 - $t0, 3))")
    echo "both at once under salusd --oversubscribe 2 (FAIR, SALUS_SWAP=1, allocator $conf):" \
      "$over_s s, $($py -c "print(round($seq_s / $over_s, 3))")x back to back (nvshare: 1.35x)"
    $py -c '
import json, sys
for p in sys.argv[1:]:
    r = json.load(open(p))
    s = r.get("session") or {}
    g = lambda k: s.get(k) or "-"
    print("  %s: %s steps, swaps out %s / in %s, swap %s ms, gpu %s ms, unswappable %s" % (
        g("name"), r.get("steps"), g("swaps_out"), g("swaps_in"), g("swap_ms"),
        g("gpu_time_ms"), g("memory_unswappable")))
' "$d"/over-"$conf"-*.json
  done
  # Honest programs give none: each would mean the driver showed a swapped-out
  # PyTorch job holding more than its context and reported part (+16 MiB).
  echo "  driver-figure warnings for swapped-out jobs: $(grep -c "warning: swapped out" "$work/salusd.log")"
  if [ $dry = 1 ]; then
    echo "unified memory, no gate: skipped (needs a GPU and torch >= 2.0)"
    return 0
  fi
  # Managed memory past what the card has free is the point of this row, and on
  # some machines it can hang the GPU itself (a lent machine's rules forbid it):
  # only when asked for.
  if [ "${SALUS_OVERSUB_UM:-0}" != 1 ]; then
    echo "unified memory, no gate: skipped (SALUS_OVERSUB_UM=1 runs it: managed memory" \
      "past the card's free memory can hang the GPU on some machines)"
    return 0
  fi
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  cc -shared -fPIC -O2 -o "$work/um_alloc.so" "$here/pytorch_eval/um_alloc.c" -I"$cuda/include" \
    -L"$cuda/lib64/stubs" -L"$cuda/targets/x86_64-linux/lib/stubs" -lcuda ||
    { echo "um_alloc.so: build failed"; return 1; }
  t0=$(date +%s.%N)
  for i in 0 1; do "${job[@]}" --managed-alloc "$work/um_alloc.so" --tag um$i >"$d/um-$i.json" & done
  wait
  t1=$(date +%s.%N)
  um_s=$($py -c "print(round($t1 - $t0, 3))")
  echo "both at once natively on unified memory, no gate: $um_s s," \
    "$($py -c "print(round($seq_s / $um_s, 3))")x back to back"
}

# The card the oversub part runs on (oversub_card_mib). A swapped-out job's
# state waits in pinned host memory, so it must stay well inside the host's
# memory: 65% of an H200 (93 GB) is most of a 128 GB host, and pinning it could
# take the machine down. Where the card holds more than that allows (the state
# under 40% of the host), a ballast process takes the rest of the card for the
# whole part, native runs included, so every row of the comparison sees the
# same smaller GPU; said in the part's output.
oversub_card() {
  local card host fit
  card=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
  # SALUS_HOST_MIB: the host's memory where MemTotal understates it (a
  # microVM whose memory grows as it is used starts with a low MemTotal).
  host=${SALUS_HOST_MIB:-$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)}
  fit=$($py -c "print(int(0.4 * $host / ${SALUS_OVERSUB_SHARE:-0.65}))")
  oversub_card_mib=$card oversub_note=""
  [ "$fit" -ge $((card - 2048)) ] && return 0
  local ready=$work/ballast.ready
  CUDA_VISIBLE_DEVICES=0 $py -c '
import sys, time, torch
x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
open(sys.argv[2], "w").close()
time.sleep(1e6)' "$((card - fit))" "$ready" &
  ballast_pid=$!
  for _ in $(seq 600); do [ -e "$ready" ] || ! kill -0 "$ballast_pid" 2>/dev/null && break; sleep 0.1; done
  [ -e "$ready" ] || { echo "pytorch-eval: the ballast process did not take the card" >&2; exit 1; }
  oversub_card_mib=$fit
  oversub_note="(the card's $card MiB are more than this host's $host MiB can hold swapped out: a ballast process holds $((card - fit)) MiB of it for the whole part)"
}

# The most sessions in state admitted at once, sampled until FILE exists.
max_admitted() {
  local stop=$1 most=0 now
  while [ ! -e "$stop" ]; do
    now=$(grep -lx "state: admitted" "$work"/mnt/sessions/*/status 2>/dev/null | wc -l)
    [ "$now" -gt "$most" ] && most=$now
    sleep 0.1
  done
  echo "$most"
}

part_lanes() {
  local d=$out/lanes; mkdir -p "$d"
  local steps=$((tput_steps / 4 + 2)) mib=$((1 << 20))
  local job=($wl train --model gpt "${dev[@]}" --steps $steps --warmup 0 --deterministic)
  policy fifo
  # One job alone: its peak with its own memory (P + E), then with the lane (what
  # it keeps, P; the lane generous); E is the difference.
  "${srun[@]}" -- "${job[@]}" --tag alone >"$d/alone-own.json"
  local own_mib p_mib e_mib cap_mib n state_mib=0
  own_mib=$(jget "$d/alone-own.json" "max(64, int(int(d['session'].get('memory_peak') or 0) * 1.1 / $mib) + 1)")
  cap_mib=$(($(sed -n 's/^admit_capacity: //p' "$work/mnt/gpus/0/memory") / mib))
  # One job more than fit with their own memory, 8 at most (time): on a large
  # card each job gets live state (--state-mib) until 7 of them fill it, so
  # that the eighth is the one that does not fit.
  if [ $dry = 0 ] && [ -z "${SALUS_LANES_N:-}" ] && [ $((cap_mib / own_mib)) -gt 7 ]; then
    state_mib=$((cap_mib / 7 + 1 - own_mib))
    job+=(--state-mib "$state_mib")
    own_mib=$((own_mib + state_mib))
  fi
  "${srun[@]}" --shared-lane=alloc --persistent "${own_mib}M" --ephemeral "${own_mib}M" \
    -- "${job[@]}" --tag alone-lane >"$d/alone-lane.json"
  p_mib=$(jget "$d/alone-lane.json" "max(16, int(int(d['session'].get('memory_peak') or 0) * 1.1 / $mib) + 1)")
  # With expandable segments what it keeps is whole live segments (20 MiB
  # pages), which may be more than the alloc hook's 2 MiB granules.
  local es=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ps_mib
  env "${es[@]}" "${srun[@]}" --shared-lane=alloc --persistent "${own_mib}M" \
    --ephemeral "${own_mib}M" -- "${job[@]}" --tag alone-segments >"$d/alone-segments.json"
  ps_mib=$(jget "$d/alone-segments.json" "max(16, int(int(d['session'].get('memory_peak') or 0) * 1.1 / $mib) + 1)")
  e_mib=$((own_mib > p_mib ? own_mib - p_mib : 16))
  n=${SALUS_LANES_N:-$((cap_mib / own_mib + 1))}
  [ $dry = 1 ] && [ -z "${SALUS_LANES_N:-}" ] && n=2  # the sim card holds any number
  echo "GPT job alone: ${own_mib} MiB with its own memory, ${p_mib} MiB kept with the lane" \
    "(${ps_mib} MiB with expandable segments)" \
    "(lane ${e_mib} MiB; ${state_mib} MiB of it live state); ${n} jobs of ${steps} steps on ${cap_mib} MiB:" \
    "own memory needs $((n * own_mib)) MiB, the shared lane $((n * p_mib + e_mib)) MiB"
  policy fair
  local how
  for how in own lane segments; do
    local args=(--persistent "${own_mib}M" --ephemeral 0) conf=()
    [ $how = lane ] && args=(--shared-lane=alloc --persistent "${p_mib}M" --ephemeral "${e_mib}M")
    [ $how = segments ] && conf=("${es[@]}") &&
      args=(--shared-lane=alloc --persistent "${ps_mib}M" --ephemeral "${e_mib}M")
    rm -f "$work/stop"
    max_admitted "$work/stop" >"$d/$how-admitted.txt" &
    local sampler=$! t0 t1 i pids=()
    t0=$(date +%s.%N)
    for i in $(seq "$n"); do
      env "${conf[@]}" "${srun[@]}" --gpu 0 "${args[@]}" -- "${job[@]}" --tag "$how$i" \
        >"$d/$how-$i.json" &
      pids+=($!)
    done
    wait "${pids[@]}"
    t1=$(date +%s.%N)
    touch "$work/stop"
    wait "$sampler"
    $py "$here/pytorch_eval/lanes_report.py" "$d/alone-own.json" "$how" \
      "$(cat "$d/$how-admitted.txt")" "$t0" "$t1" "$d/$how"-[0-9]*.json
  done
}

default_backend=("${backend[@]}")
for part in "${parts[@]}"; do
  case $part in
    compat | throughput | fair | trace | inference | lanes) backend=("${default_backend[@]}"); ensure_salusd ;;
    oversub)
      # On the sim backend (dry run) the card is as small as the part pretends,
      # so that the two jobs are admitted only by oversubscription. On a GPU
      # salusd runs the sim backend sized to the card: it only accounts and
      # gates here (the jobs' memory is their own, in their own contexts), and
      # a cuda arena would hold part of the card that the jobs need (two jobs
      # of 65% each cannot fit beside any arena).
      if [ $dry = 1 ]; then
        backend=(--backend sim --sim-gpus 1 --sim-memory 1024M)
      else
        oversub_card
        backend=(--backend sim --sim-gpus 1 --sim-memory "${oversub_card_mib}M")
      fi
      ensure_salusd --oversubscribe 2 ;;
    *) echo "pytorch-eval: unknown part '$part'" >&2; exit 2 ;;
  esac
  echo "== $part"
  { versions; "part_$part"; } 2>"$out/$part.err" | tee "$out/$part.txt"
  if [ -n "$ballast_pid" ]; then kill "$ballast_pid"; wait "$ballast_pid" 2>/dev/null; ballast_pid=""; fi
done
stop_salusd
