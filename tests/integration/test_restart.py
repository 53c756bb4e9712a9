"""Named sessions survive a salusd restart (issue 17, item 10): saved on SIGTERM
to --state-dir, restored at start with the same names, owners and bytes; a
SIGKILL in the middle of a save leaves the previous state, and corrupt state is
set aside with a log line, never a crash."""
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time

import pytest

from conftest import Salusd, is_mounted, wait_until

NOBODY = 65534


def start(state, **kw):
    return Salusd(["--state-dir", str(state)], gpus=1, sim_memory="256M", **kw).start()


def as_nobody(script):
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "/bin/sh", "-ec", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def make_session(d, name, data):
    """Session NAME of nobody, admitted, with buffer w holding `data` (a file)."""
    s = d.path("sessions", name)
    as_nobody(f"mkdir {s}\n"
              f"echo 'need persistent=32M ephemeral=4M iters=77' > {s}/ctl\n"
              f"truncate -s {os.path.getsize(data)} {s}/mem/w\n"
              f"dd if={data} of={s}/mem/w conv=notrunc status=none\n"
              f": > {s}/mem/empty\n")
    # Above salusd's --user-priority-max (0) only an admin may raise it: root does.
    with open(f"{s}/ctl", "w") as f:
        f.write("priority 5\n")


def field(d, name, key):
    with open(d.path("sessions", name, "status")) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition(": ")
            if k == key:
                return v
    return None


@pytest.fixture(autouse=True)
def need_root():
    if os.geteuid() != 0:
        pytest.skip("sessions of uid 65534 and a root-only state dir need root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")


@pytest.fixture
def data():
    """5 MiB of random bytes that nobody can read (pytest's tmp_path is 0700)."""
    d = tempfile.mkdtemp(prefix="salus-restart-")
    os.chmod(d, 0o755)
    p = os.path.join(d, "data.bin")
    with open(p, "wb") as f:
        f.write(os.urandom(5 << 20))
    os.chmod(p, 0o644)
    yield p
    shutil.rmtree(d, ignore_errors=True)


def test_a_named_session_survives_a_restart(tmp_path, data):
    state = tmp_path / "state"
    d = start(state)
    try:
        make_session(d, "model", data)
        assert field(d, "model", "state") == "admitted"
    finally:
        assert d.stop() == 0
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    d = start(state)
    try:
        s = d.path("sessions", "model")
        st = os.stat(s)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
        assert field(d, "model", "state") == "admitted"
        assert field(d, "model", "priority") == "5"
        # Byte for byte, read back as its owner.
        as_nobody(f"cmp {s}/mem/w {data}\ntest ! -s {s}/mem/empty\n")
        assert "restored after a restart" in open(d.path("sessions", "model", "log")).read()
        assert "state: restored 1 named session(s)" in d.daemon_log()
        # Its owner can go on using it; others cannot see into it.
        as_nobody(f"echo 'fill w 1 dtype=u8 len=16' > {s}/ctl\n")
    finally:
        assert d.stop() == 0


def test_a_kill_during_a_save_leaves_the_previous_state(tmp_path, data):
    state = tmp_path / "state"
    d = start(state)
    try:
        make_session(d, "model", data)
    finally:
        d.stop()
    # The next run changes the bytes, then is killed in the middle of its save.
    d = Salusd(["--state-dir", str(state)], gpus=1, sim_memory="256M")
    d.env = dict(os.environ, SALUS_TEST_SAVE_PAUSE_MS="30000")
    d.start()
    try:
        as_nobody(f"echo 'fill w 9 dtype=u8' > {d.path('sessions', 'model', 'ctl')}\n")
        d.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "pausing 30000 ms before the commit" in d.daemon_log(), 20)
        assert os.path.isdir(state / "sessions.new" / "model")
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
    finally:
        d.stop()
    assert not is_mounted(d.mnt)
    d = start(state)
    try:
        as_nobody(f"cmp {d.path('sessions', 'model', 'mem', 'w')} {data}\n")
        assert not os.path.exists(state / "sessions.new")
    finally:
        d.stop()


def test_corrupt_state_is_set_aside_with_a_log_line(tmp_path, data):
    state = tmp_path / "state"
    d = start(state)
    try:
        make_session(d, "model", data)
        make_session(d, "other", data)
    finally:
        d.stop()
    with open(state / "sessions" / "model" / "session.state", "r+") as f:
        f.write("garbage")
    (state / "sessions" / "other" / "buf-1").write_bytes(b"short")
    d = start(state)
    try:
        log = d.daemon_log()
        assert "session model is not restored: session.state is corrupt" in log, log
        assert "session other is not restored: buf-1 (buffer w) is missing or not" in log, log
        assert sorted(os.listdir(d.path("sessions"))) == []
        aside = sorted(os.listdir(state / "set-aside"))
        assert [n.split(".")[0] for n in aside] == ["model", "other"]
        # The names are free again, and the next stop saves what is there now.
        make_session(d, "model", data)
    finally:
        assert d.stop() == 0
