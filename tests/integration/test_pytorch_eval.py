"""tools/pytorch-eval.sh, issue 14's GPU evaluation, kept working without a GPU:
its shell and Python parse, and its `compat` part runs end to end as a --dry-run
(CPU, tiny models, a sim-backend salusd), where the losses of every run under
salus-run must be bit-identical to the native run's; so does its `oversub` part
(issue 15). The GPU figures themselves
come from a machine with a GPU (docs/benchmarks.md)."""
import os
import subprocess
import sys

import pytest

from conftest import SALUSD

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tools", "pytorch-eval.sh")
WORKLOADS = os.path.join(ROOT, "tools", "pytorch_eval", "workloads.py")
BUILD = os.path.dirname(os.path.dirname(os.path.abspath(SALUSD)))


def test_script_and_workloads_parse():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    with open(WORKLOADS) as f:
        compile(f.read(), WORKLOADS, "exec")  # a SyntaxError fails the test


def dry_run(tmp_path, part):
    """Runs one part of the script as a --dry-run; returns its OUT/PART.txt."""
    shim = os.path.join(BUILD, "client", "shim", "libsalus-shim.so")
    if not os.path.exists(shim):
        pytest.skip(f"libsalus-shim.so not built at {shim} (needs cuda.h)")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode:
        pytest.skip("python3-torch is not installed")
    for t in ("salus-run", "salus-sim"):
        if not os.path.exists(os.path.join(BUILD, "tools", t)):
            pytest.fail(f"{t} is not built in {BUILD}/tools")
    out = tmp_path / "out"
    env = {**os.environ, "SALUS_BUILD": BUILD, "PYTHON": sys.executable}
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([SCRIPT, "--dry-run", str(out), part], capture_output=True, text=True,
                       timeout=280, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return (out / f"{part}.txt").read_text() + (out / f"{part}.err").read_text()


def test_dry_run_compat(tmp_path):
    text = dry_run(tmp_path, "compat")
    for model in ("resnet", "gpt"):
        assert f"{model}-eager-default: 6 steps, losses bit-identical; under salus-run: attached" \
            in text, text
        assert f"{model} inference_mode: native p50" in text, text
    # The sim backend has no driver figure: nothing measured, and no reserve.
    assert "largest context measured on gpu 0: 0 B (reserve 0 B), outside sessions: -" in text, text
    assert "torchrun: skipped in a dry run" in text, text  # the GPU run checks the worker


def test_dry_run_oversub(tmp_path):
    """Issue 15's part: back to back, then both at once under an oversubscribed
    salusd (the sim card is smaller than the two needs), then the unified-memory
    row, which the dry run skips."""
    text = dry_run(tmp_path, "oversub")
    assert "each with 665 MiB of live state on a 1024 MiB GPU" in text, text
    assert "back to back, native:" in text, text
    for conf in ("default", "expandable"):
        assert f"SALUS_SWAP=1, allocator {conf}):" in text, text
    for name in ("over0", "over1"):
        assert text.count(f"  {name}: 4 steps, swaps out") == 2, text
    assert "  driver-figure warnings for swapped-out jobs: 0\n" in text, text
    assert "unified memory, no gate: skipped" in text, text


def test_dry_run_lanes(tmp_path):
    """Issue 15's shared-lane part: the job alone twice (own memory, then
    --shared-lane=alloc), then two at once each way (and with expandable
    segments, the lane as room); on the CPU the shim sees no allocation, so only
    the plumbing and the losses are checked."""
    text = dry_run(tmp_path, "lanes")
    assert "GPT job alone: 64 MiB with its own memory" in text, text
    for how in ("own", "lane", "segments"):
        assert f"{how} memory: 2 jobs, at most " in text, text
        assert "losses bit-identical to the job alone in 2/2" in text, text
