"""Late binding of `need gpu=any` in salusd (issue 19 item 8) on a 2-GPU sim salusd: a
session that no GPU admits waits in one host-wide queue, bound to no GPU, and is placed
on whichever GPU frees up first; gpu=N still binds at once."""
import threading
import time

from conftest import Session, wait_until


def test_gpu_any_waits_host_wide_and_takes_the_gpu_that_frees_first(salusd):
    a = Session(salusd)
    a.cmd("need persistent=600M ephemeral=100M gpu=0\n")
    b = Session(salusd)
    b.cmd("need persistent=500M ephemeral=100M gpu=1\n")
    assert a.status()["state"] == "admitted" and b.status()["state"] == "admitted"
    # Fits neither GPU beside a or b (not even sharing their lanes). Placed at arrival, magm would have bound it to GPU 1
    # (more free memory); bound late, it waits for either.
    c = Session(salusd)
    c.cmd("need persistent=400M ephemeral=200M\n")
    st = c.status()
    assert st["state"] == "queued" and st["gpu"] == "-" and st["host_queue"] == "1 of 1", st
    assert "queued host-wide at position 1 of 1" in c.read("log")
    # gpu=N still binds at once, and waits in that GPU's own queue.
    d = Session(salusd)
    d.cmd("need persistent=800M ephemeral=100M gpu=1\n")
    st = d.status()
    assert st["state"] == "queued" and st["gpu"] == "1" and st["host_queue"] == "-", st
    # A command that needs the GPU waits for the binding.
    done = []
    t = threading.Thread(target=lambda: done.append(c.cmd("alloc w 1M\n")))
    t.start()
    time.sleep(0.2)
    assert not done
    a.close()  # GPU 0 frees first
    t.join(5)
    assert done
    st = c.status()
    assert st["state"] == "admitted" and st["gpu"] == "0" and st["host_queue"] == "-", st
    log = c.read("log")
    assert "placed on gpu 0 after" in log and "admitted on gpu 0" in log, log
    assert d.status()["gpu"] == "1"
    for s in (b, c, d):
        s.close()


def test_host_queue_follows_the_policy_and_a_closed_waiter_leaves_it(salusd):
    a = Session(salusd)
    a.cmd("need persistent=700M ephemeral=100M gpu=0\n")
    b = Session(salusd)
    b.cmd("need persistent=700M ephemeral=100M gpu=1\n")
    w1, w2, w3 = Session(salusd), Session(salusd), Session(salusd)
    w1.cmd("need persistent=300M ephemeral=100M\n")
    w2.cmd("need persistent=300M ephemeral=100M\n")
    w3.cmd("need persistent=300M ephemeral=100M\n")
    assert [w.status()["host_queue"] for w in (w1, w2, w3)] == ["1 of 3", "2 of 3", "3 of 3"]
    w2.close()
    assert wait_until(lambda: w3.status()["host_queue"] == "2 of 2")
    b.close()  # GPU 1 frees: the first waiter takes it, then the next one fits beside it
    assert wait_until(lambda: w1.status()["gpu"] == "1" and w3.status()["gpu"] == "1")
    assert w1.status()["state"] == "admitted" and w3.status()["state"] == "admitted"
    for s in (a, w1, w3):
        s.close()


def test_gpu_any_that_fits_no_gpu_fails_at_once(salusd):
    s = Session(salusd)
    try:
        s.cmd("need persistent=2G ephemeral=100M\n")
        raise AssertionError("accepted a need larger than every GPU")
    except OSError as e:
        assert e.errno == 12  # ENOMEM
    assert "fits no GPU that admits new sessions" in s.read("log")
    s.close()


def test_risk_filter_options_are_checked_and_sim_places_without_readings(salusd_factory, tmp_path):
    from conftest import SALUSD
    import subprocess
    bad = subprocess.run([SALUSD, "--backend", "sim", "--mount", str(tmp_path / "m"),
                          "--risk-max-sm", "2"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "risk max_sm 2" in bad.stderr, bad.stderr
    cfg = tmp_path / "salusd.toml"
    cfg.write_text("[risk]\nfilter = true\nwindow_s = 0\n")
    bad = subprocess.run([SALUSD, "--config", str(cfg), "--backend", "sim", "--mount",
                          str(tmp_path / "m")], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "risk window_s 0: expected 1 to 3600" in bad.stderr, bad.stderr
    d = salusd_factory(["--risk-filter"]).start()
    assert "the sim backend has no NVML readings" in d.daemon_log()
    s = Session(d)
    s.cmd("need persistent=1M ephemeral=1M\n")
    assert s.status()["state"] == "admitted" and s.status()["gpu"] == "0"
    s.close()


def test_a_waiting_session_that_names_a_gpu_leaves_the_host_queue(salusd):
    a = Session(salusd)
    a.cmd("need persistent=700M ephemeral=100M gpu=0\n")
    b = Session(salusd)
    b.cmd("need persistent=700M ephemeral=100M gpu=1\n")
    c = Session(salusd)
    c.cmd("need persistent=400M ephemeral=100M\n")
    assert c.status()["host_queue"] == "1 of 1"
    c.cmd("need persistent=400M ephemeral=100M gpu=1\n")
    st = c.status()
    assert st["gpu"] == "1" and st["host_queue"] == "-" and st["state"] == "queued", st
    a.close()  # GPU 0 frees, but c is bound to GPU 1 now
    time.sleep(0.2)
    assert c.status()["gpu"] == "1" and c.status()["state"] == "queued"
    b.close()
    assert wait_until(lambda: c.status()["state"] == "admitted")
    assert c.status()["gpu"] == "1"
    c.close()


def test_risk_filter_reads_nvml_on_the_cuda_backend(salusd_factory):
    """NVML -> NvmlSampler's risk scores -> placement, against the mock libcuda (one GPU,
    UUID a0..af) and the mock NVML (SM activity 0.37, memory 0.12, constant). On one GPU
    the filter cannot move a session; it logs when every GPU that fits is past the
    thresholds and the session is placed anyway."""
    import os
    import pytest
    cuda, nvml = (os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", ""),
                  os.environ.get("SALUS_TEST_NVML_MOCK_DIR", ""))
    if not cuda or not nvml:
        pytest.skip("built without the cuda backend's mock driver or the mock NVML")
    for threshold, risky in (("0.3", True), ("0.9", False)):
        d = salusd_factory(["--gpu-isolation", "thread", "--cuda-memory-fraction", "0.1",
                            "--risk-filter", "--risk-max-sm", threshold])
        d.args[d.args.index("--backend") + 1] = "cuda"
        d.env = {**os.environ, "LD_LIBRARY_PATH": cuda + ":" + nvml,
                 "MOCK_NVML_DEVICES": "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"}
        d.start(timeout=120)
        with open(d.path("gpus", "0", "info")) as f:
            assert "sm_util: 0.37\n" in f.read()
        s = Session(d)
        s.cmd("need persistent=1M ephemeral=1M\n")
        assert s.status()["gpu"] == "0"
        log = s.read("log")
        assert ("busy past the risk thresholds; placed on gpu 0 anyway" in log) == risky, log
        s.close()
        d.stop()


def test_exclusive_placement_gives_idle_gpus_in_arrival_order(salusd_factory):
    d = salusd_factory(["--placement", "exclusive"]).start()
    a, b, c, e = Session(d), Session(d), Session(d), Session(d)
    a.cmd("need persistent=1M ephemeral=1M\n")
    b.cmd("need persistent=1M ephemeral=1M\n")
    assert {a.status()["gpu"], b.status()["gpu"]} == {"0", "1"}
    c.cmd("need persistent=1M ephemeral=1M\n")  # both GPUs hold a session: c waits
    e.cmd("need persistent=1M ephemeral=1M\n")
    assert c.status()["host_queue"] == "1 of 2" and e.status()["host_queue"] == "2 of 2"
    freed = a.status()["gpu"]
    a.close()
    assert wait_until(lambda: c.status()["gpu"] == freed)
    assert e.status()["gpu"] == "-" and e.status()["host_queue"] == "1 of 1"
    for s in (b, c, e):
        s.close()
