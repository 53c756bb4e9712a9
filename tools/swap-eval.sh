#!/bin/bash
# Issue 15's swap bandwidth on a GPU: an attached program's movable memory
# (libsalus-shim.so, SALUS_SWAP=1) swapped out to pinned host memory and back,
# against a plain pinned cuMemcpy of the same size in the same run.
#
#   tools/swap-eval.sh [MIB [ROUNDS]]      (defaults: 4096 MiB, 5 rounds)
#
# Run from the repository root with a build that has the shim (SALUS_BUILD,
# default ./build: tools/salusd, client/shim/libsalus-shim.so,
# tests/integration/swap_program). SWAP_EVAL_SPILL_DIR=DIR also runs it with
# every byte going to a spill file in DIR. Each runs twice: MIB in one
# cuMemAlloc, then with MIB more of expandable-segment-style handles. The lines printed are the ones for
# docs/benchmarks.md. tools/swap_eval.py says how it works.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${SALUS_BUILD:-build}
MIB=${1:-4096}
ROUNDS=${2:-5}
args=(--salusd "$B/tools/salusd" --shim "$B/client/shim/libsalus-shim.so"
      --program "$B/tests/integration/swap_program" --mib "$MIB" --rounds "$ROUNDS")
python3 tools/swap_eval.py "${args[@]}"
# The same again with as much memory of the program's own, as PyTorch's
# expandable segments make it (20 MiB handles, its large pool's).
python3 tools/swap_eval.py "${args[@]}" --segments 20
if [[ -n ${SWAP_EVAL_SPILL_DIR:-} ]]; then
  python3 tools/swap_eval.py "${args[@]}" --host-limit 0 --spill-dir "$SWAP_EVAL_SPILL_DIR"
fi
