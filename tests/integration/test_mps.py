"""salusd --mps: the lifecycle of the MPS control daemons salusd runs, and the
environment salus-run gives a program on an MPS GPU.

These tests do NOT run MPS. There is no GPU here: salusd runs the cuda backend
against the mock libcuda (tests/vgpu/cuda/mock_libcuda.cpp) and finds a stand-in
nvidia-cuda-mps-control (mps_control_standin.py) first on PATH. What they check
is salusd's own process management: the daemon is started with -d, its GPU's
UUID and its own pipe/log directories; salusd waits until its control pipe
answers; gpus/N/info shows it; at shutdown it is sent `quit` and, if it does not
go, killed within the bound; a daemon that died is reported, not hidden. Two
programs sharing a real MPS server (throughput, fault containment) is
tools/mps-eval.sh, for a GPU machine.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import SALUSD, Salusd, alive, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.dirname(os.path.abspath(SALUSD))
SALUS_RUN = os.path.join(TOOLS, "salus-run")
SHIM = os.path.join(os.path.dirname(TOOLS), "client", "shim", "libsalus-shim.so")
MOCK = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")

needs_mock = pytest.mark.skipif(not MOCK, reason="built without the cuda backend's mock driver")


def info(d, gpu=0):
    with open(d.path("gpus", str(gpu), "info")) as f:
        return dict(l.split(": ", 1) for l in f.read().splitlines() if ": " in l)


def calls(mps_dir, gpu=0):
    with open(os.path.join(mps_dir, str(gpu), "log", "calls.jsonl")) as f:
        return [json.loads(l) for l in f]


def daemon_pid(mps_dir, gpu=0):
    try:
        with open(os.path.join(mps_dir, str(gpu), "pipe", "nvidia-cuda-mps-control.pid")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def running(pid):
    return alive(pid)  # a zombie (killed, not yet reaped by init) counts as gone


class MpsSalusd(Salusd):
    """salusd on the mock cuda backend with --mps all and the stand-in on PATH;
    stop() also kills a stand-in daemon a failed test left behind. The log and
    the MPS directories live outside the daemon's temp dir, so that tests can
    read them after stop(); cleanup() removes them."""

    def __init__(self, mode="", extra_args=(), keep=None):
        # The mock driver's contexts take no card memory: no context reserve.
        super().__init__(["--gpu-isolation", "process", "--cuda-memory-fraction", "0.2",
                          "--attach-context-reserve", "0", *extra_args], backend="cuda")
        self.keep = keep or tempfile.mkdtemp(prefix="salus-test-mps-")
        os.chmod(self.keep, 0o755)
        self.mps_dir = os.path.join(self.keep, "mps")
        self.log_path = os.path.join(self.keep, "salusd.log")
        self.args += ["--mps", "all", "--mps-dir", self.mps_dir]
        bin_dir = os.path.join(self.tmp, "bin")
        os.mkdir(bin_dir)
        os.symlink(os.path.join(HERE, "mps_control_standin.py"),
                   os.path.join(bin_dir, "nvidia-cuda-mps-control"))
        self.env = {**os.environ, "LD_LIBRARY_PATH": MOCK,
                    "PATH": bin_dir + ":" + os.environ.get("PATH", ""), "MPS_STANDIN_MODE": mode}

    def stop(self, timeout=20):
        pids = [daemon_pid(self.mps_dir, g) for g in range(8)]
        rc = super().stop(timeout) if self.proc else None
        for p in pids:
            if p and running(p):
                os.kill(p, signal.SIGKILL)
        return rc

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.keep, ignore_errors=True)


@pytest.fixture
def mps_salusd():
    d = MpsSalusd()
    try:
        d.start(timeout=60)
        yield d
    finally:
        d.cleanup()


def test_mps_on_the_sim_backend_is_a_clear_error(tmp_path):
    r = subprocess.run([SALUSD, "--backend", "sim", "--mps", "0", "--mount", str(tmp_path),
                        "--state-dir", ""], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "--mps needs the cuda backend" in r.stderr and "sim backend" in r.stderr, r.stderr


def test_bad_mps_values_are_refused(tmp_path):
    r = subprocess.run([SALUSD, "--backend", "sim", "--mps", "0,x", "--mount", str(tmp_path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "mps 'x': expected GPU indices" in r.stderr, r.stderr
    conf = tmp_path / "salusd.toml"
    conf.write_text('mps = ["zero"]\n')
    r = subprocess.run([SALUSD, "--config", str(conf), "--mount", str(tmp_path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "mps: expected GPU indices" in r.stderr, r.stderr


@needs_mock
def test_daemon_started_with_its_gpu_and_directories_then_quit(mps_salusd):
    d = mps_salusd
    gpus = len(os.listdir(d.path("gpus")))
    for g in range(gpus):
        i = info(d, g)
        pipe = os.path.join(d.mps_dir, str(g), "pipe")
        assert i["mps"] == "on" and i["mps_pipe_directory"] == pipe, i
        assert os.stat(pipe).st_mode & 0o777 == 0o755
        first = calls(d.mps_dir, g)[0]
        assert first["argv"] == ["-d"]
        assert first["env"]["CUDA_VISIBLE_DEVICES"] == i["uuid"]
        assert first["env"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert first["env"]["CUDA_MPS_LOG_DIRECTORY"] == os.path.join(d.mps_dir, str(g), "log")
        assert any(c["argv"] == [] for c in calls(d.mps_dir, g))  # the readiness query
    pids = [daemon_pid(d.mps_dir, g) for g in range(gpus)]
    assert all(p and running(p) for p in pids)
    assert d.stop() == 0
    assert not any(running(p) for p in pids)
    log = d.daemon_log()
    assert "MPS control daemon" in log and "quit" in log, log
    with open(os.path.join(d.mps_dir, "0", "log", "control.log")) as f:
        assert "quit" in f.read()


@needs_mock
@pytest.mark.skipif(not os.path.exists(SHIM), reason="libsalus-shim.so not built")
def test_salus_run_points_the_program_at_the_mps_server(mps_salusd):
    d = mps_salusd
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS", "LD_PRELOAD"))}
    r = subprocess.run([SALUS_RUN, "--mount", d.mnt, "--gpu", "0", "--persistent", "3M",
                        "--ephemeral", "2M", "--mps-threads", "40", "--no-automark", "--", "sh",
                        "-c", 'echo "P=$CUDA_MPS_PIPE_DIRECTORY L=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT '
                        'T=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"'],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    pipe = os.path.join(d.mps_dir, "0", "pipe")
    assert f"P={pipe} L=0=5M T=40" in r.stdout, r.stdout


@needs_mock
def test_a_crashed_daemon_shows_as_down_and_is_reported_at_stop(mps_salusd):
    d = mps_salusd
    pid = daemon_pid(d.mps_dir)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not running(pid))
    wait_until(lambda: info(d)["mps"] == "down")
    assert d.stop() == 0
    assert "had already exited: it crashed" in d.daemon_log()


@needs_mock
def test_a_daemon_that_ignores_quit_is_killed_within_the_bound():
    d = MpsSalusd(mode="ignore_quit")
    try:
        d.start(timeout=60)
        pid = daemon_pid(d.mps_dir)
        t0 = time.time()
        assert d.stop() == 0
        assert time.time() - t0 < 15
        assert not running(pid)
        assert "did not quit within 5000 ms" in d.daemon_log() and "killed it" in d.daemon_log()
    finally:
        d.cleanup()


@needs_mock
@pytest.mark.parametrize("mode,message", [
    ("fail", "-d failed (exit status 1): An instance of this daemon is already running"),
    ("never_ready", "did not answer within 10000 ms"),
])
def test_a_daemon_that_does_not_come_up_stops_salusd_with_the_reason(mode, message):
    d = MpsSalusd(mode=mode)
    try:
        with pytest.raises(RuntimeError) as e:
            d.start(timeout=60)
        assert "--mps: gpu 0: " in str(e.value) and message in str(e.value), str(e.value)
        pid = daemon_pid(d.mps_dir)
        assert pid is None or not running(pid)  # never left behind
    finally:
        d.cleanup()


@needs_mock
def test_a_daemon_left_by_a_killed_salusd_is_taken_over():
    first = MpsSalusd()
    second = None
    try:
        first.start(timeout=60)
        pid = daemon_pid(first.mps_dir)
        first.proc.kill()  # no clean stop: the control daemon stays
        first.proc.wait()
        assert running(pid)
        second = MpsSalusd(keep=first.keep)
        second.start(timeout=60)
        assert info(second)["mps"] == "on" and daemon_pid(second.mps_dir) == pid
        assert not any(c["argv"] == ["-d"] for c in calls(second.mps_dir)[1:])  # not started again
        assert "taken over" in second.daemon_log()
        assert second.stop() == 0
        assert not running(pid)
    finally:
        if second:
            second.stop()
        first.cleanup()


def test_directories_it_did_not_make_keep_their_mode(tmp_path):
    """salusd makes --mps-dir and its parents 0755 where it makes them, but never
    changes a parent that was already there (it once made /tmp 0755)."""
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    (parent / "keep").mkdir()
    d = MpsSalusd(keep=str(parent / "keep"))
    try:
        d.start()
        assert os.stat(parent).st_mode & 0o7777 == 0o1777
        assert os.stat(os.path.join(d.mps_dir, "0", "pipe")).st_mode & 0o777 == 0o755
    finally:
        d.stop()
        d.cleanup()
