#!/bin/bash
# Replays a trace through a salusd of its own (default: sim backend, 1 GPU, 16G) once
# per policy, predicts the same scaled trace with salus-sim (--lanes algorithm1, the
# GPU's arena capacity as read from the mount), and compares the two with
# tools/replay-compare. Results go to OUT.
#
#   tools/replay-bench.sh BUILD OUT [policy...]        (default: fifo srtf pack fair)
#   BUILD: a build directory or a bundle (BUILD/tools/salusd), or its tools/ (BUILD/salusd)
#   env: TRACE (traces/online-100.csv), SCALE (256), ITER_SCALE (4: iterations 1/4 as
#        long and 1/64 as many; fewer boundaries, so less of salusd's jitter adds up),
#        DEPTH (salusd --pipeline-depth, 1), TIE (seconds, 0.05),
#        KERNEL_US (salus-replay --kernel-us: spins of at most this many us, 0 = one),
#        OVERHEAD_US (salus-sim --iteration-overhead-us; default: measured here first),
#        GPUS (1: GPUs of the default sim backend, and salus-sim --gpus; with more, jobs
#        bind late to a GPU in both, and replay-compare also counts the jobs that ran
#        on the same GPU), MEMORY (16G: per sim GPU), PLACEMENT (magm),
#        BACKEND_ARGS (salusd flags; default --backend sim --sim-gpus GPUS --sim-memory
#        MEMORY; on a GPU, e.g. --backend cuda --cuda-memory-fraction 0.2),
#        FAIR_SHARE (user: both sides' default; session: salusd --fair-share session
#        and salus-sim --fair-share session). A trace with a user column is replayed
#        with each user's sessions as a uid of its own (tools/salus-replay).
#        OVERSUBSCRIBE (1: salusd and salus-sim --oversubscribe; a replayed job
#        declares its memory with `need` and allocates no buffer, so its swaps move
#        no bytes and take salusd's bookkeeping only), HOLD_PERSISTENT (1: each job
#        allocates its persistent size and keeps it, so that swaps move its bytes:
#        salus-replay --hold-persistent), SWAP_GBPS (salus-sim --swap-gbps; default
#        10000: near-free swaps, as the replay's are without HOLD_PERSISTENT;
#        `measured`: the median of what salusd measured in the replays, from its
#        policy file's swap_bandwidth_gbps).
#
# The overhead is salusd's host-side cost per iteration boundary on this machine at
# this depth: one job of 1 ms iterations is replayed alone with 200 and 1200 iterations,
# three times each; the median of (JCT difference / 1000 - 1 ms) goes to salus-sim.
#
# OUT/sim-command.txt is the salus-sim command run, to compare another salus-sim on the
# same scaled trace. Needs root and /dev/fuse. The daemon and its mount are removed on any exit.
set -eu
build=${1:?usage: replay-bench.sh BUILD OUT [policy...]}
out=${2:?usage: replay-bench.sh BUILD OUT [policy...]}
shift 2
policies=("$@")
[ ${#policies[@]} -eq 0 ] && policies=(fifo srtf pack fair)
here=$(cd "$(dirname "$0")" && pwd)
salusd=$build/tools/salusd salus_sim=$build/tools/salus-sim
[ -x "$salusd" ] || salusd=$build/salusd salus_sim=$build/salus-sim
gpus=${GPUS:-1}
placement=${PLACEMENT:-magm}
fair_share=${FAIR_SHARE:-user}
oversubscribe=${OVERSUBSCRIBE:-1}
swap_gbps=${SWAP_GBPS:-10000}
read -r -a backend_args <<<"${BACKEND_ARGS:---backend sim --sim-gpus $gpus --sim-memory ${MEMORY:-16G}}"
trace=${TRACE:-$here/../traces/online-100.csv}
scale=${SCALE:-256}
depth=${DEPTH:-1}
tie=${TIE:-0.05}
iter_args=(--iter-scale "${ITER_SCALE:-4}")
[ -n "${KERNEL_US:-}" ] && iter_args+=(--kernel-us "$KERNEL_US")
[ "${HOLD_PERSISTENT:-0}" = 1 ] && iter_args+=(--hold-persistent)
mkdir -p "$out"

mnt=""
dpid=""
cleanup() {
  if [ -n "$dpid" ]; then
    kill "$dpid" 2>/dev/null || true
    wait "$dpid" 2>/dev/null || true
  fi
  if [ -n "$mnt" ]; then
    fusermount3 -u "$mnt" 2>/dev/null || true
    rmdir "$mnt" 2>/dev/null || true
  fi
  dpid=""
  mnt=""
}
trap cleanup EXIT INT TERM

start_salusd() {  # LOG: a fresh daemon, so no run inherits another's lanes or clocks
  mnt=$(mktemp -d /tmp/salus-replay-bench.XXXXXX)
  # --state-dir '': no named session of another run (or of the host) comes back.
  "$salusd" "${backend_args[@]}" --placement "$placement" --fair-share "$fair_share" --log-level warn \
    --pipeline-depth "$depth" --oversubscribe "$oversubscribe" --mount "$mnt" --state-dir '' >"$1" 2>&1 &
  dpid=$!
  for _ in $(seq 600); do [ -e "$mnt/version" ] && break; sleep 0.1; done
  [ -e "$mnt/version" ] || { echo "replay-bench: salusd did not mount $mnt" >&2; exit 1; }
  capacity=$(awk '/^capacity:/ {print $2}' "$mnt/gpus/0/info")
}

overhead=${OVERHEAD_US:-}
if [ -z "$overhead" ]; then
  start_salusd "$out/salusd-calibrate.log"
  : >"$out/calibrate.txt"
  for n in 200 1200 200 1200 200 1200; do
    printf 'job,arrival_s,model,persistent_mb,ephemeral_mb,iter_ms,iters,util\n' >"$out/calibrate.csv"
    printf 'c,0,calibrate,16,16,1.0,%s,0.5\n' "$n" >>"$out/calibrate.csv"
    python3 "$here/salus-replay" --mount "$mnt" --trace "$out/calibrate.csv" --scale 1 \
      --iter-scale 1 --jobs-out "$out/calibrate-$n.csv" >/dev/null
    echo "$n $(awk -F, 'NR==2{print $4}' "$out/calibrate-$n.csv")" >>"$out/calibrate.txt"
  done
  cleanup
  overhead=$(python3 -c '
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
short = [float(j) for n, j in rows if n == "200"]
long_ = [float(j) for n, j in rows if n == "1200"]
gaps = [(l - s) / 1000 * 1e6 - 1000 for s, l in zip(short, long_)]
print(f"{max(0.0, statistics.median(gaps)):.0f}")' "$out/calibrate.txt")
  echo "replay-bench: salusd's cost per iteration boundary here: $overhead us" \
    "(depth $depth; pairs of JCTs in $out/calibrate.txt)"
fi

for p in "${policies[@]}"; do
  start_salusd "$out/salusd-$p.log"
  python3 "$here/salus-replay" --mount "$mnt" --trace "$trace" --scale "$scale" \
    "${iter_args[@]}" --policy "$p" --scaled-out "$out/scaled.csv" \
    --jobs-out "$out/replay-$p.csv" | tail -1 >"$out/replay-$p.summary"
  cat "$mnt/policy" >"$out/policy-$p.txt"  # swap totals and bandwidth, when oversubscribed
  cleanup
done

if [ "$swap_gbps" = measured ]; then
  swap_gbps=$(python3 -c '
import statistics, sys
seen = [float(l.split()[1]) for f in sys.argv[1:] for l in open(f)
        if l.startswith("swap_bandwidth_gbps:") and "not measured" not in l]
print(f"{statistics.median(seen):.3f}" if seen else "10000")' "$out"/policy-*.txt)
  echo "replay-bench: salus-sim --swap-gbps $swap_gbps (what salusd measured in the replays)"
fi
sim_args=(--trace "$out/scaled.csv" --policy all --lanes algorithm1 --gpu-memory "$capacity"
  --gpus "$gpus" --placement "$placement" --fair-share "$fair_share"
  --oversubscribe "$oversubscribe" --swap-gbps "$swap_gbps"
  --iteration-overhead-us "$overhead" --jobs-out "$out/sim-all.csv")
echo "salus-sim ${sim_args[*]}" >"$out/sim-command.txt"  # to predict again with another build
"$salus_sim" "${sim_args[@]}" >"$out/sim.summary"
for p in "${policies[@]}"; do
  echo "== $p (salusd --pipeline-depth $depth, scale $scale, salus-sim --iteration-overhead-us $overhead)"
  python3 "$here/replay-compare" "$out/replay-$p.csv" "$out/sim-all.csv" --policy "$p" --tie "$tie" |
    tee "$out/compare-$p.txt"
done
