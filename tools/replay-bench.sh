#!/bin/bash
# Replays a trace through a salusd of its own (sim backend, 1 GPU, 16G) once per
# policy, predicts the same scaled trace with salus-sim (--lanes algorithm1), and
# compares the two with tools/replay-compare. Results go to OUT.
#
#   tools/replay-bench.sh BUILD OUT [policy...]        (default: fifo srtf fair)
#   env: TRACE (traces/online-100.csv), SCALE (256), ITER_SCALE (sqrt(SCALE)),
#        DEPTH (salusd --pipeline-depth, 1), TIE (seconds, 0.05),
#        KERNEL_US (salus-replay --kernel-us: spins of at most this many us, 0 = one)
#
# Needs root and /dev/fuse. The daemon and its mount are removed on any exit.
set -eu
build=${1:?usage: replay-bench.sh BUILD OUT [policy...]}
out=${2:?usage: replay-bench.sh BUILD OUT [policy...]}
shift 2
policies=("$@")
[ ${#policies[@]} -eq 0 ] && policies=(fifo srtf fair)
here=$(cd "$(dirname "$0")" && pwd)
trace=${TRACE:-$here/../traces/online-100.csv}
scale=${SCALE:-256}
depth=${DEPTH:-1}
tie=${TIE:-0.05}
iter_args=()
[ -n "${ITER_SCALE:-}" ] && iter_args=(--iter-scale "$ITER_SCALE")
[ -n "${KERNEL_US:-}" ] && iter_args+=(--kernel-us "$KERNEL_US")
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

for p in "${policies[@]}"; do
  # A fresh daemon per policy, so no run inherits another's lanes or clocks.
  mnt=$(mktemp -d /tmp/salus-replay-bench.XXXXXX)
  "$build/tools/salusd" --backend sim --sim-gpus 1 --sim-memory 16G --log-level warn \
    --pipeline-depth "$depth" --mount "$mnt" >"$out/salusd-$p.log" 2>&1 &
  dpid=$!
  for _ in $(seq 100); do [ -e "$mnt/version" ] && break; sleep 0.1; done
  [ -e "$mnt/version" ] || { echo "replay-bench: salusd did not mount $mnt" >&2; exit 1; }
  python3 "$here/salus-replay" --mount "$mnt" --trace "$trace" --scale "$scale" \
    "${iter_args[@]}" --policy "$p" --scaled-out "$out/scaled.csv" \
    --jobs-out "$out/replay-$p.csv" | tail -1 >"$out/replay-$p.summary"
  cleanup
done

"$build/tools/salus-sim" --trace "$out/scaled.csv" --policy all --lanes algorithm1 \
  --jobs-out "$out/sim-all.csv" >"$out/sim.summary"
for p in "${policies[@]}"; do
  echo "== $p (salusd --pipeline-depth $depth, scale $scale)"
  python3 "$here/replay-compare" "$out/replay-$p.csv" "$out/sim-all.csv" --policy "$p" --tie "$tie" |
    tee "$out/compare-$p.txt"
done
