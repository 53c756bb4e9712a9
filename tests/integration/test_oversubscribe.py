"""Oversubscription on the sim backend (salusd(8) --oversubscribe, design.md
"Oversubscription"): two hosted sessions whose persistent memory together exceeds
the GPU are both admitted, both make progress, and their buffers survive every swap
bit for bit; status, gpus/N/memory and metrics show residency; bad ratios are refused;
a three-job trace runs under every policy with its contents kept and no thrash."""
import errno
import hashlib
import os
import subprocess

import pytest

from conftest import SALUSD, Salusd, Session, gpu_memory, start_on_mock_cuda, wait_until

M = 1 << 20


def status(s):
    return s.status()


def write_pattern(s, name, size, seed):
    data = hashlib.shake_256(f"{seed}".encode()).digest(size)
    with open(s.file(os.path.join("mem", name)), "r+b", buffering=0) as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def read_hash(s, name):
    with open(s.file(os.path.join("mem", name)), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def oversub():
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair"], sim_memory="64M",
               gpus=1).start()
    yield d
    d.stop()


def test_two_sessions_beyond_the_gpu_both_progress_and_keep_their_bytes(oversub):
    d = oversub
    a, b = Session(d), Session(d)
    try:
        for s in (a, b):
            s.cmd("need persistent=36M ephemeral=2M gpu=0\n")
        # 2 x 38M on a 64M card: both admitted, one of them resident.
        assert wait_until(lambda: status(a)["state"] == "admitted"
                          and status(b)["state"] == "admitted")
        mem = gpu_memory(d)
        assert mem["oversubscribe"] == "2"
        assert int(mem["admit_capacity"]) == 128 * M
        a.cmd("alloc w 36M\n")
        b.cmd("alloc w 36M\n")  # waits until a is swapped out
        ha = write_pattern(a, "w", 36 * M, "a")
        hb = write_pattern(b, "w", 36 * M, "b")
        for rnd in range(2):
            # Each round both sessions run iterations that read their buffer; only one
            # fits at a time, so the two take turns through swaps.
            for s in (a, b):
                s.cmd("begin\nalloc t 1M\ncopy t w 1M\nspin 2000\nend x10\n")
            a.wait()
            b.wait()
            assert read_hash(a, "w") == ha, f"round {rnd}: a's buffer changed"
            assert read_hash(b, "w") == hb, f"round {rnd}: b's buffer changed"
        sa, sb = status(a), status(b)
        assert int(sa["iterations_done"]) == 20 and int(sb["iterations_done"]) == 20
        assert sa["error"] == "-" and sb["error"] == "-"
        for st in (sa, sb):
            assert st["residency"] in ("resident", "swapped", "swapping_in", "swapping_out")
            assert float(st["resident_quantum_ms"]) >= 50.0
        assert int(sa["swaps_out"]) + int(sb["swaps_out"]) >= 2
        mem = gpu_memory(d)
        # Never more resident than the card, and swapped bytes are exactly one buffer
        # (the session that is out) or none.
        assert int(mem["resident"]) <= 64 * M
        assert int(mem["swapped"]) in (0, 36 * M)
        with open(d.path("metrics")) as f:
            metrics = f.read()
        assert 'salus_swaps_total{gpu="0",direction="out"}' in metrics
        with open(d.path("policy")) as f:
            policy = f.read()
        assert "oversubscribe: 2\n" in policy and "resident_quantum_ms_per_gib:" in policy
    finally:
        a.close()
        b.close()
    # Both gone: nothing stays held, on the card or in host memory.
    assert wait_until(lambda: gpu_memory(d)["persistent_used"] == "0"
                      and gpu_memory(d)["host_swapped"] == "0")


def test_kill_while_swapped_leaks_nothing(oversub):
    d = oversub
    a, b = Session(d), Session(d)
    for s in (a, b):
        s.cmd("need persistent=36M ephemeral=2M gpu=0\n")
    a.cmd("alloc w 36M\nfill w 3 dtype=u8\n")
    b.cmd("alloc w 36M\n")
    assert wait_until(lambda: int(gpu_memory(d)["swapped"]) == 36 * M, timeout=10)
    b.cmd("begin\nspin 1000\nend x5\n")
    a.close()  # the swapped (or swapping) session goes away mid-flight
    b.wait()
    b.close()
    assert wait_until(lambda: gpu_memory(d)["persistent_used"] == "0"
                      and gpu_memory(d)["swapped"] == "0" and gpu_memory(d)["host_swapped"] == "0",
                      timeout=10)


@pytest.mark.parametrize("value,words", [
    ("0.5", "below 1"), ("nan", "expected a number"), ("1e9", "at most 16"),
    ("abc", "expected a number"), ("-2", "below 1")])
def test_bad_ratio_is_refused(tmp_path, value, words):
    r = subprocess.run([SALUSD, "--backend", "sim", "--mount", str(tmp_path), "--oversubscribe",
                        value], capture_output=True, text=True, timeout=20)
    assert r.returncode != 0
    assert words in r.stderr, r.stderr


def test_bad_ratio_in_config_is_refused(tmp_path):
    cfg = tmp_path / "salusd.toml"
    cfg.write_text('oversubscribe = "lots"\n')
    r = subprocess.run([SALUSD, "--backend", "sim", "--mount", str(tmp_path), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode != 0 and "oversubscribe" in r.stderr, r.stderr


def test_policy_file_sets_the_ratio(salusd):
    with open(salusd.path("policy"), "w") as f:
        f.write("fair oversubscribe=1.5\n")
    with open(salusd.path("policy")) as f:
        assert "oversubscribe: 1.5\n" in f.read()
    with open(salusd.path("gpus", "0", "memory")) as f:
        assert "oversubscribe: 1.5\n" in f.read()
    for bad in ("fair oversubscribe=0.5\n", "fair oversubscribe=nan\n", "fair oversubscribe=99\n"):
        with pytest.raises(OSError) as e:
            with open(salusd.path("policy"), "w") as f:
                f.write(bad)
        assert e.value.errno == errno.EINVAL


def test_stop_saves_swapped_named_sessions_and_restart_restores_them(tmp_path):
    state = str(tmp_path / "state")
    args = ["--oversubscribe", "2", "--state-dir", state]
    hashes = {}
    d = Salusd(extra_args=args, sim_memory="64M", gpus=1).start()
    try:
        for name in ("ja", "jb"):
            os.mkdir(d.path("sessions", name))
            with open(d.path("sessions", name, "ctl"), "w") as f:
                f.write("need persistent=36M ephemeral=2M gpu=0\nalloc w 36M\n")
            data = hashlib.shake_256(name.encode()).digest(36 * M)
            with open(d.path("sessions", name, "mem", "w"), "r+b", buffering=0) as f:
                f.write(data)
            hashes[name] = hashlib.sha256(data).hexdigest()
        assert int(gpu_memory(d)["swapped"]) == 36 * M  # one of them is out at the stop
    finally:
        d.stop(timeout=30)
    d = Salusd(extra_args=args, sim_memory="64M", gpus=1).start(timeout=60)
    try:
        for name, h in hashes.items():
            with open(d.path("sessions", name, "mem", "w"), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == h, name
    finally:
        d.stop(timeout=30)


def test_cuda_backend_swaps_through_the_device_interface():
    """The cuda backend's path (copies to and from pinned staging blocks through
    CudaDevice), against the mock libcuda: no GPU needed."""
    mock = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
    if not mock:
        pytest.skip("built without the cuda backend's mock driver")
    d = start_on_mock_cuda(["--oversubscribe", "2", "--gpu-isolation", "thread",
                            "--cuda-memory-fraction", "0.1"], [mock])
    a, b = Session(d), Session(d)
    try:
        cap = int(gpu_memory(d)["capacity"])
        size = (cap * 3 // 4) >> 20  # two of these do not fit together
        for s in (a, b):
            s.cmd(f"need persistent={size}M ephemeral=1M gpu=0\n")
        a.cmd(f"alloc w {size}M\n")
        b.cmd(f"alloc w {size}M\n")
        ha = write_pattern(a, "w", size * M, "ca")
        hb = write_pattern(b, "w", size * M, "cb")
        for _ in range(2):
            for s in (a, b):
                s.cmd("begin\nalloc t 64K\ncopy t w 64K\nend x3\n")
            a.wait()
            b.wait()
            assert read_hash(a, "w") == ha and read_hash(b, "w") == hb
        assert int(status(a)["swaps_out"]) + int(status(b)["swaps_out"]) >= 1
    finally:
        a.close()
        b.close()
        d.stop()


# name, iterations, priority: three jobs of 24M persistent on a 64M card (72M in
# all), different lengths so that SRTF and PRIORITY order them differently.
TRACE = [("a", 300, 0), ("b", 100, 2), ("c", 200, 1)]


@pytest.mark.parametrize("policy", ["fifo", "pack", "srtf", "fair", "priority"])
def test_every_policy_runs_an_oversubscribed_trace_without_thrash(policy):
    """No thrash: a session swapped in stays resident for at least its quantum,
    20 times its measured swap time (design.md), so each job is swapped out only
    a few times. Counted, not timed: a swap's time on the sim backend is host
    memory's, which varies several-fold with the machine (15-22% of the GPU time
    here, against 25-33% without the quantum). With 1 ms iterations and no
    quantum (tried: the check in ResidencyPlanner::victims disabled) PACK, SRTF,
    FAIR and PRIORITY swap out 37-44 times here; with it, 3 (FIFO 6, setup's
    swaps included)."""
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", policy], sim_memory="64M",
               gpus=1).start()
    sessions = []
    try:
        for name, iters, prio in TRACE:
            s = Session(d)
            sessions.append(s)
            s.cmd(f"need persistent=24M ephemeral=2M gpu=0 iters={iters} priority={prio}\n")
        assert wait_until(lambda: all(s.status()["state"] == "admitted" for s in sessions))
        hashes = []
        for s, (name, _, _) in zip(sessions, TRACE):
            s.cmd("alloc w 24M\n")
            hashes.append(write_pattern(s, "w", 24 * M, name))
        for s, (_, iters, _) in zip(sessions, TRACE):
            s.cmd(f"begin\nalloc t 1M\ncopy t w 1M\nspin 1000\nend x{iters}\n")
        for s in sessions:
            s.wait()
        swaps, swap_ms, gpu_ms = 0, 0.0, 0.0
        for s, (name, iters, _), h in zip(sessions, TRACE, hashes):
            st = s.status()
            assert read_hash(s, "w") == h, f"{policy}: {name}'s buffer changed"
            assert int(st["iterations_done"]) == iters and st["error"] == "-", st
            assert float(st["resident_quantum_ms"]) >= 50.0, st
            swaps += int(st["swaps_out"])
            swap_ms += float(st["swap_ms"])
            gpu_ms += float(st["gpu_time_ms"])
        assert swaps <= 4 * len(TRACE), \
            f"{policy}: thrash: {swaps} swaps out, {swap_ms:.1f} ms swapping, {gpu_ms:.1f} ms GPU"
        assert swaps >= 1, f"{policy}: 72M on a 64M card ran without a swap"
        assert int(gpu_memory(d)["resident"]) <= 64 * M
    finally:
        for s in sessions:
            s.close()
        d.stop()
