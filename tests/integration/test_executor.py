"""GPU fault recovery with --gpu-isolation process, end to end.

A sim kernel is host code running in the GPU's executor process, so a kernel
that dereferences a bad pointer (crash_store) or aborts (crash_abort) kills that
executor the way a CUDA kernel poisons a context. salusd must stay up, fail the
offending session with a kernel-fault message and the other sessions on that
GPU with "gpu context lost", give the GPU a fresh executor, and serve new
sessions on it; the other GPU is not touched. The last test does the same on
the cuda backend against the mock libcuda, whose bad_store kernel poisons the
context with CUDA_ERROR_ILLEGAL_ADDRESS.
"""
import ctypes
import errno
import os
import shutil
import signal
import struct
import subprocess
import threading
import time

import pytest

from conftest import Salusd, Session, alive, is_mounted, wait_until

MODULE = os.environ.get("SALUS_TEST_SIM_MODULE", "")


@pytest.fixture
def daemon():
    d = Salusd(["--gpu-isolation", "process"]).start()
    yield d
    d.stop()


def info(d, gpu=0):
    with open(d.path("gpus", str(gpu), "info")) as f:
        return dict(line.split(": ", 1) for line in f.read().splitlines())


def wait_back(d, restarts, gpu=0, timeout=20):
    """Waits until the GPU has had `restarts` restarts and its executor is up."""
    ok = wait_until(lambda: info(d, gpu)["restarts"] == str(restarts) and
                    info(d, gpu)["state"] == "ok" and info(d, gpu)["executor_pid"] != "-",
                    timeout=timeout)
    assert ok, f"gpu {gpu}: {info(d, gpu)}\n{d.daemon_log()}"


def busy_bystander(d, gpu=0):
    """A session with long iterations in flight on `gpu`."""
    s = Session(d)
    s.cmd(f"need persistent=4M ephemeral=1M gpu={gpu}\nalloc w 1M\nfill w 1.0\n"
          "begin\nfill w 2.0\nspin 200000\nend x20\n")
    assert wait_until(lambda: s.status()["in_flight"] != "0"), s.status()
    return s


def fresh_session_computes(d, gpu=0):
    """A new session on `gpu` runs fill, gemm and host copies correctly."""
    s = Session(d)
    try:
        s.cmd(f"need persistent=4M ephemeral=1M gpu={gpu}\nalloc a 64\nalloc b 64\nalloc c 64\n"
              "fill a 2.0\nfill b 3.0\nbegin\ngemm 4 4 4 a b c\nend\n")
        assert s.wait().startswith("done"), s.read("log")
        with open(s.file("mem/c"), "rb") as f:
            assert struct.unpack("<16f", f.read(64)) == (24.0,) * 16
        with open(s.file("mem/a"), "r+b") as f:
            f.write(struct.pack("<4f", 1, 2, 3, 4))
        with open(s.file("mem/a"), "rb") as f:
            assert struct.unpack("<4f", f.read(16)) == (1.0, 2.0, 3.0, 4.0)
    finally:
        s.close()


def shm_upload_works(d, gpu=0):
    """A shared-memory segment reaches the GPU's new executor and back."""
    path = f"/dev/shm/salus-test-exec-{os.getpid()}"
    data = bytes(range(256)) * 4096
    with open(path, "wb") as f:
        f.write(data)
    s = Session(d)
    try:
        s.cmd(f"need persistent=4M ephemeral=1M gpu={gpu}\nalloc u 1M\n"
              f"upload u shm:{os.path.basename(path)} 1M\nsync\n")
        with open(s.file("mem/u"), "rb") as f:
            assert f.read() == data
    finally:
        s.close()
        os.unlink(path)


def crash(d, kernel, gpu=0):
    s = Session(d)
    s.cmd(f"need persistent=1M ephemeral=1M gpu={gpu}\nmodule k {MODULE}\n")
    arg = " u64:8" if kernel == "crash_store" else ""
    try:
        s.cmd(f"launch k.{kernel} grid=1 block=1{arg}\n")
    except OSError:
        pass  # the write may already carry the failure
    return s


@pytest.mark.parametrize("kernel,signame", [("crash_store", "SIGSEGV"), ("crash_abort", "SIGABRT")])
def test_a_crashing_kernel_costs_its_gpu_context_but_not_salusd(daemon, kernel, signame):
    if not MODULE or not os.path.exists(MODULE):
        pytest.skip("the sim test kernel module was not built (SALUS_TEST_SIM_MODULE)")
    d = daemon
    old_pid = info(d)["executor_pid"]
    other_gpu_pid = info(d, 1)["executor_pid"]
    bystander = busy_bystander(d)
    far = Session(d)  # on the other GPU: must not notice anything
    far.cmd("need persistent=1M ephemeral=1M gpu=1\nalloc z 64\nfill z 5 dtype=i32\n")
    culprit = crash(d, kernel)
    wait_back(d, 1)

    assert d.proc.poll() is None and is_mounted(d.mnt), d.daemon_log()
    i = info(d)
    assert i["executor_pid"] != old_pid
    assert signame in i["last_restart"] and "user kernel" in i["last_restart"], i
    assert signame in i["last_fault"], i

    # The culprit is told what happened to it, in its status and its log.
    assert wait_until(lambda: culprit.status()["state"] == "failed"), culprit.status()
    err = culprit.status()["error"]
    assert err.startswith("EFAULT kernel fault:") and signame in err, err
    assert "kernel fault" in culprit.read("log")
    with pytest.raises(OSError) as e:
        culprit.wait()
    assert e.value.errno == errno.EFAULT

    # The bystander lost its context and memory, and says so.
    assert wait_until(lambda: "gpu context lost" in bystander.status()["error"]), bystander.status()
    assert bystander.status()["error"].startswith("EIO"), bystander.status()
    assert "kernel fault" not in bystander.read("log")
    # ... and can start over once it says `reset`.
    bystander.cmd("reset\nalloc v 64\nfill v 9 dtype=i32\n")
    with open(bystander.file("mem/v"), "rb") as f:
        assert struct.unpack("<4i", f.read(16)) == (9, 9, 9, 9)

    # A new session on the GPU works on the fresh executor.
    fresh_session_computes(d)

    # The other GPU and its session were not touched.
    assert info(d, 1)["restarts"] == "0" and info(d, 1)["executor_pid"] == other_gpu_pid
    assert far.status()["error"] == "-", far.status()
    with open(far.file("mem/z"), "rb") as f:
        assert struct.unpack("<2i", f.read(8)) == (5, 5)

    # One executor per GPU, none leaked.
    assert sorted(map(str, d.executors())) == sorted([info(d)["executor_pid"], other_gpu_pid])
    for s in (culprit, bystander, far):
        s.close()


def test_an_executor_killed_from_outside_is_replaced(daemon):
    d = daemon
    old_pid = int(info(d)["executor_pid"])
    # Staging blocks are shared with the executor (memfd regions) and pooled:
    # the new executor must map the pooled ones again.
    warm = Session(d)
    warm.cmd("need persistent=4M ephemeral=1M gpu=0\nalloc m 1M\n")
    with open(warm.file("mem/m"), "r+b") as f:
        f.write(b"x" * 65536)
    warm.close()
    bystander = busy_bystander(d)
    os.kill(old_pid, signal.SIGKILL)
    wait_back(d, 1)
    assert d.proc.poll() is None and is_mounted(d.mnt)
    assert "SIGKILL" in info(d)["last_restart"]
    assert info(d)["last_fault"] == "-"  # nobody's kernel is blamed
    assert wait_until(lambda: "gpu context lost" in bystander.status()["error"]), bystander.status()
    assert "SIGKILL" in bystander.status()["error"]
    fresh_session_computes(d)
    shm_upload_works(d)
    assert not alive(old_pid)
    assert len(d.executors()) == 2
    with open(d.path("metrics")) as f:
        assert 'salus_gpu_restarts_total{gpu="0"} 1' in f.read()
    bystander.close()


def test_idle_sessions_on_the_gpu_are_told_too(daemon):
    d = daemon
    idle = Session(d)
    idle.cmd("need persistent=1M ephemeral=1M gpu=0\nalloc p 64\nfill p 3 dtype=i32\n")
    assert idle.wait().startswith("done")
    os.kill(int(info(d)["executor_pid"]), signal.SIGKILL)
    wait_back(d, 1)
    assert wait_until(lambda: "gpu context lost" in idle.status()["error"]), idle.status()
    assert "gpu context lost" in idle.read("log")
    idle.close()


def test_a_gpu_whose_executor_keeps_dying_goes_out_of_service(daemon):
    d = daemon
    s = Session(d)
    s.cmd("need persistent=1M ephemeral=1M gpu=0\nalloc v 64\n")
    # Killed from outside right after each start: nothing a kernel did explains
    # it, so after five quick deaths in a row the GPU is taken out of service.
    for n in range(5):
        pid = info(d)["executor_pid"]
        os.kill(int(pid), signal.SIGKILL)
        if n < 4:
            wait_back(d, n + 1)
    assert wait_until(lambda: info(d)["state"].startswith("out-of-service"), timeout=20), info(d)
    i = info(d)
    assert "5 times in a row" in i["state"] and i["executor_pid"] == "-", i
    assert d.proc.poll() is None and is_mounted(d.mnt)
    assert len(d.executors()) == 1  # only gpu 1's
    # The session hears of the last loss; after that, work on the GPU fails at
    # once, saying why. The other GPU still serves.
    assert wait_until(lambda: f"pid {pid} " in s.read("log")), s.read("log")
    s.cmd("reset\n")
    with pytest.raises(OSError):
        s.cmd("fill v 1 dtype=i32\nsync\n")
    assert "out of service" in s.status()["error"], s.status()
    fresh_session_computes(d, gpu=1)
    s.close()


def test_executors_go_away_with_salusd():
    # An orderly stop (SIGTERM) shuts them down itself: no help from teardown.
    d = Salusd(["--gpu-isolation", "process"]).start()
    try:
        pids = d.executors()
        assert len(pids) == 2
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=20) == 0, d.daemon_log()
        assert not any(alive(p) for p in pids), pids
        assert "starting a new executor" not in d.daemon_log(), d.daemon_log()
    finally:
        d.stop()
    d = Salusd(["--gpu-isolation", "process"]).start()
    try:
        pids = d.executors()
        assert len(pids) == 2 and all(alive(p) for p in pids)
        with open(d.path("gpus", "0", "info")) as f:
            assert "isolation: process" in f.read()
        # Even when salusd is killed without a chance to clean up.
        d.proc.kill()
        d.proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in pids), timeout=5), pids
    finally:
        d.stop()


def real_gpu_missing():
    """Why the real-driver variant cannot run here, or None."""
    if not os.environ.get("SALUS_TEST_CUDA_REAL"):
        return "the real-driver variant runs in the gpu suite (SALUS_TEST_CUDA_REAL=1)"
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return "cuInit failed"
    except (OSError, AttributeError) as e:
        return f"no NVIDIA driver ({e})"
    n = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
        return "no CUDA GPU visible"
    return None


def gpu_context_pids():
    """Pids nvidia-smi lists as holding a CUDA context, or None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return {int(x) for x in out.stdout.split()} if out.returncode == 0 else None


@pytest.mark.parametrize("driver", ["mock", "real"])
def test_a_cuda_kernel_fault_restarts_the_executor(driver):
    fatbin = os.environ.get("SALUS_TEST_CUDA_FATBIN", "")
    if not fatbin or not os.path.exists(fatbin):
        pytest.skip("built without the cuda backend's test kernels (no nvcc)")
    mock = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
    if driver == "mock" and not mock:
        pytest.skip("built without the cuda backend's mock driver")
    if driver == "real" and (why := real_gpu_missing()) is not None:
        pytest.skip(why)
    d = Salusd(["--gpu-isolation", "process", "--cuda-memory-fraction", "0.2"])
    d.args[d.args.index("--backend") + 1] = "cuda"
    if driver == "mock":
        d.env = {**os.environ, "LD_LIBRARY_PATH": mock}
    d.start(timeout=120)
    try:
        i = info(d)
        assert i["backend"] == "cuda" and i["isolation"] == "process", i
        gpus = len(os.listdir(d.path("gpus")))
        assert len(d.executors()) == gpus
        if driver == "real" and (held := gpu_context_pids()) is not None:
            # salusd itself holds no context: only its executors do.
            assert d.proc.pid not in held and set(d.executors()) <= held, (held, d.executors())
        bystander = Session(d)
        bystander.cmd("need persistent=4M ephemeral=1M gpu=0\nalloc w 64\nfill w 1.0\n"
                      "begin\nspin 200000 util=0.1\nend x20\n")
        assert wait_until(lambda: bystander.status()["in_flight"] != "0"), bystander.status()
        culprit = Session(d)
        culprit.cmd(f"need persistent=1M ephemeral=1M gpu=0\nmodule k {fatbin}\n")
        try:
            culprit.cmd("launch k.bad_store grid=1 block=1 u64:16\n")
        except OSError:
            pass
        wait_back(d, 1, timeout=60)
        assert d.proc.poll() is None and is_mounted(d.mnt)
        i = info(d)
        assert "kernel fault" in i["last_restart"], i
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in i["last_fault"], i
        assert wait_until(lambda: culprit.status()["state"] == "failed"), culprit.status()
        err = culprit.status()["error"]
        assert err.startswith("EFAULT kernel fault: CUDA_ERROR_ILLEGAL_ADDRESS"), err
        assert wait_until(lambda: "gpu context lost" in bystander.status()["error"]), \
            bystander.status()
        fresh_session_computes(d)
        assert len(d.executors()) == gpus
        for s in (culprit, bystander):
            s.close()
    finally:
        d.stop()


def test_work_waits_while_a_new_executor_cannot_back_the_arena(tmp_path):
    """cuda backend on the mock driver, arena backed on demand: an executor
    replaced while the card has no memory to give (the mock's cuMemCreate fails
    while a file exists) cannot back the arena where salusd still holds memory.
    salusd must then treat nothing as backed: a mem/ write to a buffer held from
    before waits (an op on unbacked memory would abort the mock's executor)
    and completes, with its bytes, once the card has room again."""
    mock = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
    if not mock:
        pytest.skip("built without the cuda backend's mock driver")
    no_memory = tmp_path / "no-memory"
    d = Salusd(["--gpu-isolation", "process", "--cuda-memory-fraction", "0.2"])
    d.args[d.args.index("--backend") + 1] = "cuda"
    d.env = {**os.environ, "LD_LIBRARY_PATH": mock, "SALUS_MOCK_NO_MEMORY_FILE": str(no_memory)}
    d.start(timeout=120)
    s = None
    try:
        s = Session(d)
        s.cmd("need persistent=4M ephemeral=1M gpu=0\nalloc m 1M\n")
        with open(s.file("mem/m"), "r+b") as f:
            f.write(b"a" * 4096)
        no_memory.write_text("")
        os.kill(int(info(d)["executor_pid"]), signal.SIGKILL)
        wait_back(d, 1, timeout=60)
        assert wait_until(lambda: "gpu context lost" in s.status()["error"]), s.status()
        assert wait_until(lambda: "not backed where salusd holds memory" in d.daemon_log())
        s.cmd("reset\n")
        done = []

        def write_and_read():
            # The write is queued as the session's next op; the read waits for it.
            fd = os.open(s.file("mem/m"), os.O_RDWR)
            try:
                os.pwrite(fd, b"b" * 4096, 0)
                done.append(os.pread(fd, 4096, 0))
            finally:
                os.close(fd)
        t = threading.Thread(target=write_and_read)
        t.start()
        t.join(1.0)
        assert t.is_alive() and not done, "the write ran on memory the executor has not backed"
        assert "lost the arena's backing" in d.daemon_log(), d.daemon_log()
        no_memory.unlink()
        t.join(20)
        assert done == [b"b" * 4096], d.daemon_log()
        assert info(d)["restarts"] == "1", info(d)
    finally:
        if s is not None:
            s.close()
        d.stop()


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_large_allocation_holds_up_no_other_session(isolation):
    """cuda backend on the mock driver, each cuMemCreate taking 5 ms: backing
    a 400 MiB buffer (200 chunks) takes about a second. Meanwhile another
    session's status, its commands and its work on memory already backed
    complete, in both isolations, while the allocation still waits (before,
    salusd backed under its broker lock and the executor on its one request
    thread, so everyone waited for the whole job); the allocating write
    returns only once its memory is there, and it reads zero."""
    mock = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
    if not mock:
        pytest.skip("built without the cuda backend's mock driver")
    d = Salusd(["--gpu-isolation", isolation, "--cuda-memory-fraction", "0.9"])
    d.args[d.args.index("--backend") + 1] = "cuda"
    d.env = {**os.environ, "LD_LIBRARY_PATH": mock, "SALUS_MOCK_CREATE_US": "5000"}
    d.start(timeout=120)
    a = b = None
    try:
        b = Session(d)
        b.cmd("need persistent=4M ephemeral=2M gpu=0\nalloc x 1M\nfill x 1 dtype=u8\n")
        b.wait()
        a = Session(d)
        a.cmd("need persistent=400M ephemeral=0 gpu=0\n")
        done = []
        t = threading.Thread(target=lambda: done.append(a.cmd("alloc big 400M\n")))
        t.start()
        time.sleep(0.1)  # the backing job is under way
        assert b.status()["state"] == "admitted"
        b.cmd("begin\nfill x 2 dtype=u8\nend x3\nfill x 3 dtype=u8\n")
        b.wait()
        with open(b.file("mem/x"), "rb") as f:
            assert f.read(4) == b"\x03" * 4
        assert t.is_alive() and not done, "another session waited for the backing job to end"
        t.join(30)
        assert not t.is_alive()
        with open(a.file("mem/big"), "rb") as f:
            assert f.read(4096) == bytes(4096)
    finally:
        for s in (a, b):
            if s is not None:
                s.close()
        d.stop()


def test_the_config_file_selects_the_isolation(salusd_factory, tmp_path):
    conf = tmp_path / "salusd.toml"
    conf.write_text('gpu_isolation = "process"\n')
    d = salusd_factory(extra_args=["--config", str(conf)]).start()
    assert info(d)["isolation"] == "process" and len(d.executors()) == 2
    conf.write_text('gpu_isolation = "sideways"\n')
    d = salusd_factory(extra_args=["--config", str(conf)])
    with pytest.raises(RuntimeError) as e:
        d.start()
    assert "gpu_isolation 'sideways'" in str(e.value)
