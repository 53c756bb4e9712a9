"""salusd on the cuda backend, end to end through the mount: device identity,
built-in ops with checked results, mem/ reads and writes, a user PTX module
with typed arguments, two sessions in two lanes at once, and a faulting kernel.

Runs only where a GPU answers: each test skips with the reason salusd gives
(e.g. "libcuda.so.1 not found") elsewhere, so CI without a GPU reports SKIP.
"""
import os
import random
import struct
import time

import pytest

from conftest import Session, start_on_backend, wait_until

PTX = os.environ.get("SALUS_TEST_CUDA_PTX", "")


@pytest.fixture(scope="module")
def gpu_salusd():
    d = start_on_backend("cuda", extra_args=["--cuda-memory-fraction", "0.1"])
    yield d
    d.stop()


def info(d):
    out = {}
    with open(d.path("gpus", "0", "info")) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition(": ")
            out[k] = v
    return out


def floats(path, n, offset=0):
    with open(path, "rb") as f:
        f.seek(offset)
        return struct.unpack(f"<{n}f", f.read(4 * n))


def test_info_names_the_real_device(gpu_salusd):
    i = info(gpu_salusd)
    assert i["backend"] == "cuda"
    assert i["uuid"].startswith("GPU-")
    assert int(i["sms"]) > 0
    assert int(i["capacity"]) > 0 and int(i["memory_total"]) >= int(i["capacity"])
    assert float(i["spin_cycles_per_us"]) > 100  # a GPU clock above 100 MHz
    assert i["driver"] and i["driver"] != "sim"


def test_gemm_fill_copy_and_mem_round_trip(gpu_salusd):
    s = Session(gpu_salusd)
    try:
        n = 96  # not a multiple of the 64-wide tile: exercises the edges
        rng = random.Random(5)
        a = [float(rng.randint(-4, 4)) for _ in range(n * n)]
        b = [float(rng.randint(-4, 4)) for _ in range(n * n)]
        s.cmd(f"need persistent=1M ephemeral=0\nalloc A {4*n*n}\nalloc B {4*n*n}\nalloc C {4*n*n}\n"
              f"alloc D {4*n*n}\n")
        with open(s.file("mem/A"), "r+b") as f:
            f.write(struct.pack(f"<{n*n}f", *a))
        with open(s.file("mem/B"), "r+b") as f:
            f.write(struct.pack(f"<{n*n}f", *b))
        s.cmd(f"gemm {n} {n} {n} A B C\ncopy D C {4*n*n}\nfill A 0.5\n")
        assert s.wait().startswith("done")
        c = floats(s.file("mem/D"), n * n)
        for r in range(0, n, 7):
            for col in range(0, n, 5):
                want = sum(a[r * n + k] * b[k * n + col] for k in range(n))
                assert c[r * n + col] == want, (r, col)
        assert floats(s.file("mem/A"), 4) == (0.5, 0.5, 0.5, 0.5)
    finally:
        s.close()


def test_spin_keeps_the_gpu_busy_for_its_length(gpu_salusd):
    s = Session(gpu_salusd)
    try:
        s.cmd("need persistent=0 ephemeral=0\nbegin\nspin 20000\nend x5\n")
        assert s.wait().startswith("done")
        mean_ms = float(s.status()["mean_iteration_ms"])
        assert 19.0 <= mean_ms <= 23.0, mean_ms  # device time, measured by events
    finally:
        s.close()


@pytest.fixture
def ptx():
    if not PTX or not os.path.exists(PTX):
        pytest.skip("tests/vgpu/cuda/test_kernels.ptx was not built (nvcc absent at build time)")
    return PTX


def test_ptx_module_launch_with_every_argument_type(gpu_salusd, ptx):
    s = Session(gpu_salusd)
    try:
        s.cmd(f"need persistent=1M ephemeral=0\nalloc out 64\nalloc y 64\nalloc x 64\n"
              f"fill y 1.0\nfill x 2.0\nmodule k {ptx}\n")
        s.cmd("launch k.all_types grid=1 block=1 out i32:-7 u32:4000000000 i64:-9000000000 "
              "u64:18000000000000000000 f32:1.5 f64:-2.25\n")
        s.cmd("launch k.saxpy grid=1 block=16 y x f32:3 u32:16\n")
        assert s.wait().startswith("done")
        with open(s.file("mem/out"), "rb") as f:
            raw = f.read(40)
        assert struct.unpack_from("<iIqQf", raw, 0) == (-7, 4000000000, -9000000000,
                                                        18000000000000000000, 1.5)
        assert struct.unpack_from("<d", raw, 32) == (-2.25,)
        assert floats(s.file("mem/y"), 16) == (7.0,) * 16
    finally:
        s.close()


def test_two_sessions_run_in_two_lanes_at_once(gpu_salusd):
    d = gpu_salusd
    with open(d.path("policy"), "w") as f:
        f.write("pack\n")
    a, b = Session(d), Session(d)
    try:
        for s in (a, b):
            s.cmd("need persistent=0 ephemeral=1M\n")
        wait_until(lambda: a.status()["state"] == "admitted" and b.status()["state"] == "admitted")
        assert a.status()["lane"] != b.status()["lane"]
        t0 = time.monotonic()
        for s in (a, b):
            s.cmd("begin\nspin 10000 util=0.4\nend x50\n")
        for s in (a, b):
            assert s.wait().startswith("done")
        took = time.monotonic() - t0
        # 2 x 50 x 10 ms one after the other would be 1.0 s; overlapped, ~0.5 s.
        assert took < 0.85, took
    finally:
        a.close()
        b.close()
        with open(d.path("policy"), "w") as f:
            f.write("fair\n")


def test_a_faulting_kernel_fails_its_session_and_the_gpu_recovers(gpu_salusd, ptx):
    d = gpu_salusd
    bad, bystander = Session(d), Session(d)
    try:
        bystander.cmd("need persistent=1M ephemeral=0\nalloc keep 4K\nfill keep 7 dtype=u8\n")
        assert bystander.wait().startswith("done")
        bad.cmd(f"need persistent=1M ephemeral=0\nmodule k {ptx}\n")
        bad.cmd("launch k.bad_store grid=1 block=1 u64:16\n")
        try:
            outcome = bad.wait()
        except OSError as e:  # wait fails with the session's error
            outcome = f"errno {e.errno}"
        assert not outcome.startswith("done")
        wait_until(lambda: bad.status()["state"] == "failed", timeout=30)
        assert "fault" in bad.read("log").lower()
        wait_until(lambda: "gpu context lost" in bystander.read("log"), timeout=30)
        # The GPU is back in service without a daemon restart.
        assert d.proc.poll() is None
        fresh = Session(d)
        try:
            fresh.cmd("need persistent=1M ephemeral=0\nalloc A 4K\nalloc B 4K\nalloc C 4K\n"
                      "fill A 1.0\nfill B 2.0\ngemm 32 32 32 A B C\n")
            assert fresh.wait().startswith("done")
            assert floats(fresh.file("mem/C"), 4) == (64.0,) * 4
        finally:
            fresh.close()
    finally:
        bad.close()
        bystander.close()
