#!/bin/bash
# Issue 15's shared-lane hand-over cost on a GPU, per step and per GiB:
# salusd's device makes the lane memory (cuMemCreate with a POSIX-fd handle)
# and clears it (cuMemsetD8 + synchronize); the program imports and maps it,
# and at its yield synchronizes and unmaps it. A hand-over between two uids is
# yield + clear + map; within one uid yield + map. The baseline in the same
# run is a plain cuMemsetD8 + synchronize of a cuMemAlloc buffer of the same
# size.
#
#   tools/lane-eval.sh [MIB,MIB,... [ROUNDS]]   (defaults: 256,1024,4096,16384; 5 rounds)
#
# Run from the repository root with a build that has the cuda backend
# (SALUS_BUILD, default ./build: tests/vgpu/cuda/bench_lane_handover). Exits
# 77 without a GPU. The lines printed are the ones for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${SALUS_BUILD:-build}
SIZES=${1:-256,1024,4096,16384}
ROUNDS=${2:-5}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
exec "$B/tests/vgpu/cuda/bench_lane_handover" --sizes "$SIZES" --rounds "$ROUNDS"
