"""Fixtures that run a real salusd (sim backend) on a temporary FUSE mount.

Every daemon started here is stopped and every mount removed, even when a test
fails: teardown sends SIGTERM, then SIGKILL, then `fusermount3 -u -z`, and
kills any GPU executor process the daemon left behind.

SALUS_TEST_GPU_ISOLATION=process|thread runs every daemon with that
--gpu-isolation (meson runs a subset of the tests both ways).
"""
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

SALUSD = os.environ.get("SALUSD", os.path.join(os.environ.get("BUILD_ROOT", "build"), "tools", "salusd"))
GPU_ISOLATION = os.environ.get("SALUS_TEST_GPU_ISOLATION", "")


def children(pid):
    """Pids of the live children (zombies included) of `pid`, from all its threads."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    out += [int(p) for p in f.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def is_mounted(path):
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


class Salusd:
    # backend="cuda" runs on the machine's GPUs (sim_memory and gpus then do not apply).
    def __init__(self, extra_args=(), sim_memory="1G", gpus=2, backend="sim"):
        self.tmp = tempfile.mkdtemp(prefix="salus-test-")
        os.chmod(self.tmp, 0o755)
        self.mnt = os.path.join(self.tmp, "mnt")
        os.mkdir(self.mnt)
        self.log_path = os.path.join(self.tmp, "salusd.log")
        self.backend = backend
        sim = ["--sim-gpus", str(gpus), "--sim-memory", sim_memory] if backend == "sim" else []
        # Named sessions are saved on stop: into this daemon's own temp dir unless
        # a test shares one between daemons (never the host's /var/lib/salus).
        state = [] if "--state-dir" in extra_args else ["--state-dir", os.path.join(self.tmp, "state")]
        self.args = [SALUSD, "--backend", backend, *sim,
                     "--mount", self.mnt, "--log-level", "debug", *state, *extra_args]
        self.env = None  # the daemon's environment; None: this one
        self.isolation = None  # what the environment asked for, checked at start
        if GPU_ISOLATION and "--gpu-isolation" not in extra_args:
            self.args += ["--gpu-isolation", GPU_ISOLATION]
            self.isolation = GPU_ISOLATION
        self.proc = None

    def start(self, timeout=10):
        try:
            return self._start(timeout)
        except Exception:
            self.stop()  # unmount and remove the temp dir even when start-up failed
            raise

    def _start(self, timeout):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"salusd exited with {self.proc.returncode}: {self.daemon_log()}")
            if is_mounted(self.mnt) and os.path.exists(self.path("version")):
                if self.isolation:
                    with open(self.path("gpus", "0", "info")) as f:
                        assert f"isolation: {self.isolation}\n" in f.read(), "isolation not applied"
                return self
            time.sleep(0.02)
        raise RuntimeError("salusd did not mount in time: " + self.daemon_log())

    def path(self, *parts):
        return os.path.join(self.mnt, *parts)

    def daemon_log(self):
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def executors(self):
        """The daemon's GPU executor processes (its only children)."""
        return children(self.proc.pid) if self.proc and self.proc.poll() is None else []

    def stop(self, timeout=10):
        rc = None
        execs = self.executors()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif self.proc:
            rc = self.proc.returncode
        # They die with the daemon (parent-death signal); make sure of it.
        for pid in execs:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)
        if hasattr(self, "log"):
            self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return rc



def gpu_memory(d, gpu=0):
    """gpus/N/memory of salusd `d`, as a dict of its `key: value` lines."""
    out = {}
    with open(d.path("gpus", str(gpu), "memory")) as f:
        for line in f:
            k, _, v = line.strip().partition(": ")
            out[k] = v
    return out


def start_on_mock_cuda(extra_args, mock_dirs, env_extra=None, timeout=120):
    """A started Salusd on the cuda backend over the mock driver
    (tests/vgpu/cuda/mock_libcuda.cpp: one GPU of 512 MiB); `mock_dirs` go first
    on its LD_LIBRARY_PATH."""
    # The mock's contexts take no card memory: no reserve for them (on a real
    # GPU salusd counts 512M per attached program), unless a test names one.
    args = list(extra_args)
    if "--attach-context-reserve" not in args:
        args += ["--attach-context-reserve", "0"]
    d = Salusd(args, backend="cuda")
    d.env = {**os.environ, "LD_LIBRARY_PATH": ":".join(mock_dirs), **(env_extra or {})}
    d.start(timeout=timeout)
    return d


def start_on_backend(backend, **kw):
    """A started Salusd on `backend` ("sim" or "cuda", e.g. from
    SALUS_TEST_BACKEND). Skips the calling tests when salusd finds no GPU, so
    the same file runs on the sim backend in CI and on a GPU where there is one."""
    if backend not in ("sim", "cuda"):
        pytest.skip(f"SALUS_TEST_BACKEND={backend!r}: expected sim or cuda")
    d = Salusd(backend=backend, **kw)
    try:
        d.start(timeout=60)
    except RuntimeError as e:
        # Only salusd's own refusal ("--backend cuda: REASON", e.g. no driver)
        # means there is no GPU here; any other failure to start is a failure.
        text = str(e)
        if backend == "cuda" and "--backend cuda:" in text:
            reason = text.split("--backend cuda:", 1)[1].strip().splitlines()[0]
            pytest.skip("no CUDA GPU: " + reason)
        raise
    return d

@pytest.fixture
def salusd():
    d = Salusd().start()
    yield d
    d.stop()


@pytest.fixture
def salusd_factory():
    started = []

    def make(*args, **kw):
        d = Salusd(*args, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


class Session:
    """A clone session held open by this process."""

    def __init__(self, d):
        self.d = d
        self.fd = os.open(d.path("clone"), os.O_RDWR)
        self.id = os.read(self.fd, 64).decode().strip()

    def cmd(self, text):
        data = text.encode() if isinstance(text, str) else text
        return os.write(self.fd, data)

    def file(self, name):
        return self.d.path("sessions", self.id, name)

    def read(self, name):
        with open(self.file(name)) as f:
            return f.read()

    def status(self):
        out = {}
        for line in self.read("status").splitlines():
            k, _, v = line.partition(": ")
            out[k] = v
        return out

    def wait(self):
        with open(self.file("wait")) as f:
            return f.read()

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def session(salusd):
    s = Session(salusd)
    yield s
    s.close()


def wait_until(pred, timeout=5.0, step=0.01):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def pytest_sessionfinish(session, exitstatus):
    """Exit 77 (meson's SKIP) when every test of the file skipped, e.g. the cuda
    tests on a machine without a GPU, so the summary shows SKIP, not OK."""
    rep = session.config.pluginmanager.get_plugin("terminalreporter")
    if exitstatus == 0 and rep is not None:
        stats = rep.stats
        if stats.get("skipped") and not stats.get("passed") and not stats.get("failed"):
            session.exitstatus = 77


_own_basetemp = None


def pytest_configure(config):
    """pytest 7.2 keeps the temporary folders of its last three runs under
    /tmp/pytest-of-USER; tests here leave nothing behind, so each run gets a folder of
    its own, removed when the run ends, skipped or not."""
    global _own_basetemp
    if config.option.basetemp is None:
        _own_basetemp = tempfile.mkdtemp(prefix="salus-pytest-")
        config.option.basetemp = _own_basetemp


def pytest_unconfigure(config):
    if _own_basetemp is not None:
        shutil.rmtree(_own_basetemp, ignore_errors=True)
