"""salusd is never a confused deputy (issue 17, items 5 and 6): what it opens
for a session it opens with the caller's ids, groups and capabilities only, never
on /proc, /sys or another kernel filesystem, and never for a caller whose
process it cannot see (outside its pid namespace, which FUSE reports as pid 0).
Clients run as uid 65534 (setpriv) and check the errno of each write and the
reason in the session log."""
import errno
import os
import shutil
import signal
import subprocess
import tempfile
import time
import glob

import pytest

from conftest import Salusd, children, alive, is_mounted
from nobody import as_nobody, last_line, skip_unless_root_with_setpriv

@pytest.fixture(autouse=True)
def need_root():
    skip_unless_root_with_setpriv()


@pytest.fixture(scope="module")
def daemon():
    d = Salusd(gpus=1, sim_memory="256M").start()
    yield d
    d.stop()


@pytest.fixture
def scratch():
    d = tempfile.mkdtemp(prefix="salus-deputy-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sysfs_config_space_is_refused(daemon):
    # Read directly, nobody gets 64 bytes of a PCI device's config space; with
    # root's CAP_SYS_ADMIN salusd used to read all 256 for it.
    configs = sorted(glob.glob("/sys/bus/pci/devices/*/config"))
    if not configs:
        pytest.skip("no PCI device in /sys/bus/pci/devices")
    [(err, log)] = as_nobody(daemon.mnt, f"upload w file:{configs[0]} 256")
    assert err == errno.EACCES, log
    assert "sysfs, a kernel filesystem" in last_line(log), log


def test_proc_of_a_root_process_is_refused_without_naming_what_is_behind(daemon, scratch):
    # A root process whose working directory nobody may search into by name only
    # (0711): /proc/PID/cwd is a link nobody cannot read (ptrace check), so its
    # own open fails; salusd with CAP_SYS_PTRACE used to follow it and read x.
    hidden = os.path.join(scratch, "hidden-f7c1e0")
    os.mkdir(hidden, 0o711)
    with open(os.path.join(hidden, "x"), "wb") as f:
        f.write(b"root's secret")
    os.chmod(os.path.join(hidden, "x"), 0o644)
    sleeper = subprocess.Popen(["sleep", "60"], cwd=hidden)
    try:
        [(err, log)] = as_nobody(daemon.mnt, f"upload w file:/proc/{sleeper.pid}/cwd/x 13")
        assert err == errno.EACCES, log
        assert "procfs, a kernel filesystem" in last_line(log), log
        assert "hidden-f7c1e0" not in log
    finally:
        sleeper.kill()
        sleeper.wait()


def test_roots_files_stay_roots(daemon, scratch):
    closed = os.path.join(scratch, "closed")
    os.mkdir(closed, 0o700)
    with open(os.path.join(closed, "f"), "wb") as f:
        f.write(b"0600 in 0700")
    os.chmod(os.path.join(closed, "f"), 0o600)
    # Readable and writable by all, but not searchable: CAP_DAC_READ_SEARCH territory.
    noexec = os.path.join(scratch, "noexec")
    os.mkdir(noexec)
    with open(os.path.join(noexec, "f"), "wb") as f:
        f.write(b"open file")
    os.chmod(os.path.join(noexec, "f"), 0o644)
    os.chmod(noexec, 0o766)
    results = as_nobody(daemon.mnt, f"upload w file:{closed}/f 4", f"upload w file:{noexec}/f 4")
    for err, log in results:
        assert err == errno.EACCES, log
        assert "Permission denied" in last_line(log), log


def salusd_pid_in_namespace(d):
    """salusd's pid, the child of `unshare --fork` (or of setpriv under it)."""
    deadline = time.time() + 10
    while time.time() < deadline:
        pids = children(d.proc.pid)
        if pids:
            return pids[0]
        time.sleep(0.05)
    raise RuntimeError("no salusd under unshare")


def test_a_caller_outside_the_pid_namespace_is_refused(tmp_path):
    # salusd in a child pid namespace, with the shadow group (as --groups 42
    # in the attack run): a caller outside has no pid there, and /proc/self
    # would have lent it salusd's own groups. Now nothing is done as it.
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("cannot make a pid namespace here: " + probe.stderr.strip())
    shadow_gid = os.stat("/etc/shadow").st_gid
    d = Salusd(gpus=1, sim_memory="256M")
    d.args = ["unshare", "--pid", "--fork", "--kill-child=SIGTERM",
              "setpriv", f"--groups={shadow_gid}", "--"] + d.args
    inner = None
    out = f"/tmp/salus-deputy-out-{os.getpid()}"
    try:
        d.start()
        inner = salusd_pid_in_namespace(d)
        results = as_nobody(d.mnt, "upload w file:/etc/shadow 1", "upload w file:/etc/hostname 1",
                            f"download w file:{out} 1", "fill w 1")
        for err, log in results[:3]:
            assert err == errno.EPERM, log
            assert "outside salusd's pid namespace" in last_line(log), log
        assert results[3][0] == 0, results[3][1]  # what is not done as the caller still works
        assert not os.path.exists(out)
    finally:
        if os.path.lexists(out):
            os.unlink(out)
        if inner and alive(inner):
            os.kill(inner, signal.SIGTERM)
            deadline = time.time() + 10
            while alive(inner) and time.time() < deadline:
                time.sleep(0.05)
        d.stop()
        assert not is_mounted(d.mnt)
