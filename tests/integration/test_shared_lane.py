"""Shared lanes of attached programs (issue 15), end to end: a real salusd
(sim backend: the lane memory is a memfd the mock libcuda imports as a VMM
handle), two lane_program processes (CUDA programs) with libsalus-shim.so
preloaded, SALUS_SHARED_LANE=1 and the mock libcuda. Both take their ephemeral
memory from the one lane in turn; each checks its own bytes while it holds it.

Needs the shim, the mock and lane_program (meson sets SALUS_TEST_SHIM,
SALUS_TEST_CUDA_MOCK_DIR and SALUS_TEST_LANE_PROGRAM); skips without them.
"""
import os
import signal
import subprocess

import pytest

from conftest import Session, wait_until

SHIM = os.environ.get("SALUS_TEST_SHIM", "")
MOCK_DIR = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
PROGRAM = os.environ.get("SALUS_TEST_LANE_PROGRAM", "")

pytestmark = pytest.mark.skipif(
    not (os.path.exists(SHIM) and os.path.isdir(MOCK_DIR) and os.path.exists(PROGRAM)),
    reason="needs libsalus-shim.so, the mock libcuda and lane_program (built where cuda.h is)")


def start(salusd, s, seed, mib, iters, hold=None, lane="1"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SALUS_")}
    env.update({
        "LD_PRELOAD": SHIM,
        "LD_LIBRARY_PATH": MOCK_DIR,
        "SALUS_SHIM_LIBCUDA": os.path.join(MOCK_DIR, "libcuda.so.1"),
        "SALUS_MOCK_LEGACY_STREAM": "1",
        "SALUS_SHARED_LANE": lane,
        "SALUS_MOUNT": salusd.mnt,
        "SALUS_SESSION": os.path.dirname(s.file("ctl")),
    })
    args = [PROGRAM, str(seed), str(mib), str(iters)] + ([str(hold)] if hold else [])
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def session(salusd, mib):
    s = Session(salusd)
    s.cmd(f"need persistent=8M ephemeral={mib}M gpu=0\n")
    return s


def finish(p, timeout=20):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


def test_two_programs_alternate_in_one_lane(salusd):
    a, b = session(salusd, 16), session(salusd, 16)
    pa = start(salusd, a, 1, 16, 6)
    pb = start(salusd, b, 2, 16, 6)
    try:
        ra, oa, ea = finish(pa)
        rb, ob, eb = finish(pb)
        assert ra == 0, (oa, ea, a.read("log"))
        assert rb == 0, (ob, eb, b.read("log"))
        for out in (oa, ob):
            for k in range(1, 7):
                assert f"verified {k}" in out
        # One memory, handed back and forth (same uid: not cleared): each found
        # the other's bytes in it at some iteration. First bytes of the
        # patterns: seed 1 -> 0xb1, seed 2 -> 0x62.
        assert "0x62" in oa and "0xb1" in ob, (oa, ob)
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
                p.wait()
        a.close()
        b.close()


def test_status_shows_the_lane_and_hand_overs(salusd, tmp_path):
    a, b = session(salusd, 16), session(salusd, 16)
    hold = tmp_path / "go"
    pa = start(salusd, a, 1, 16, 3, hold=hold)
    try:
        assert pa.stdout.readline().startswith("first 1")
        assert pa.stdout.readline().strip() == "holding"
        st = a.status()
        assert st["shared_lane"] == "held"
        assert st["lane_memory"] == str(16 << 20)
        assert st["memory_budget"] == str(8 << 20), "the lane's 16M is not the program's own"
        pb = start(salusd, b, 2, 16, 2)
        assert wait_until(lambda: b.status().get("gate") == "attached")
        hold.write_text("")
        rb, ob, eb = finish(pb)
        assert rb == 0, (ob, eb, b.read("log"))
        ra, oa, ea = finish(pa)
        assert ra == 0, (oa, ea)
    finally:
        for p in (pa,):
            if p.poll() is None:
                p.kill()
                p.wait()
        a.close()
        b.close()


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_sigkill_of_the_holder_mid_iteration_hands_the_lane_on(salusd, tmp_path):
    a, b = session(salusd, 16), session(salusd, 16)
    fds = fd_count(salusd.proc.pid)
    pa = start(salusd, a, 1, 16, 3, hold=tmp_path / "never")
    pb = None
    try:
        assert pa.stdout.readline().startswith("first 1")
        assert pa.stdout.readline().strip() == "holding"
        pb = start(salusd, b, 2, 16, 2)
        assert wait_until(lambda: b.status().get("gate") == "attached")
        assert b.status()["shared_lane"] == "free"
        pa.send_signal(signal.SIGKILL)
        pa.wait()
        rb, ob, eb = finish(pb)
        assert rb == 0, (ob, eb, b.read("log") if os.path.exists(b.file("log")) else "")
        assert "verified 2" in ob
        # Both sessions ended with their programs; salusd holds none of their
        # fds (gate, bell, pidfd, lane socket) and gave the lane memory back.
        assert wait_until(lambda: fd_count(salusd.proc.pid) <= fds, timeout=3), \
            (fd_count(salusd.proc.pid), fds)
    finally:
        for p in (pa, pb):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        a.close()
        b.close()


def test_without_the_opt_in_there_is_no_lane_memory(salusd):
    a = session(salusd, 16)
    pa = start(salusd, a, 1, 16, 1, lane="0")
    try:
        ra, oa, ea = finish(pa)
        assert ra == 3 and "no lane memory: -107" in oa, (oa, ea)  # -ENOTCONN
    finally:
        if pa.poll() is None:
            pa.kill()
            pa.wait()
        a.close()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_cuda_backend_makes_and_clears_the_lane_memory(isolation):
    """The cuda backend's path against the mock libcuda: the lane memory is a
    cuMemCreate handle exported as a POSIX fd by salusd's device (in salusd,
    or in the GPU's executor process, whose fd salusd takes with pidfd_getfd),
    cleared with cuMemsetD8 before its first holder (fresh mock memory reads
    0xab)."""
    from conftest import Salusd
    d = Salusd(["--gpu-isolation", isolation, "--cuda-memory-fraction", "0.1"])
    d.args[d.args.index("--backend") + 1] = "cuda"
    d.env = {**os.environ, "LD_LIBRARY_PATH": MOCK_DIR}
    d.start(timeout=120)
    a, b = session(d, 8), session(d, 8)
    pa = pb = None
    try:
        pa = start(d, a, 1, 8, 4)
        pb = start(d, b, 2, 8, 4)
        ra, oa, ea = finish(pa)
        rb, ob, eb = finish(pb)
        assert ra == 0 and rb == 0, (oa, ob, a.read("log"), open(d.log_path).read()[-2000:])
        firsts = [line for line in (oa + ob).splitlines() if line.startswith("first 1 ")]
        assert "first 1 0" in firsts, firsts  # whoever came first found it cleared
        assert "0xab" not in oa + ob, "uncleared fresh memory reached a program"
    finally:
        for p in (pa, pb):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        a.close()
        b.close()
        d.stop()


# Runs lane_program as uid 65534 in a session it makes itself (the session is
# the caller's: its clone fd stays open while the program runs).
AS_NOBODY = r"""
import os, subprocess, sys
mnt, prog, seed, mib, iters = sys.argv[1:6]
fd = os.open(mnt + "/clone", os.O_RDWR)
sid = os.read(fd, 64).decode().strip()
os.write(fd, f"need persistent=8M ephemeral={mib}M gpu=0\n".encode())
os.environ["SALUS_SESSION"] = f"{mnt}/sessions/{sid}"
r = subprocess.run([prog, seed, mib, iters], capture_output=True, text=True)
sys.stdout.write(r.stdout)
sys.stderr.write(r.stderr)
sys.exit(r.returncode)
"""


def test_another_uid_never_sees_the_holders_bytes(salusd, tmp_path):
    import shutil
    import sys
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switches to uid 65534: needs root and setpriv")
    a = session(salusd, 16)
    hold = tmp_path / "go"
    pa = start(salusd, a, 1, 16, 2, hold=hold)
    pb = None
    try:
        assert pa.stdout.readline().startswith("first 1")
        assert pa.stdout.readline().strip() == "holding"  # a's bytes are in the lane now
        env = {k: v for k, v in os.environ.items() if not k.startswith("SALUS_")}
        env.update({"LD_PRELOAD": SHIM, "LD_LIBRARY_PATH": MOCK_DIR,
                    "SALUS_SHIM_LIBCUDA": os.path.join(MOCK_DIR, "libcuda.so.1"),
                    "SALUS_MOCK_LEGACY_STREAM": "1", "SALUS_SHARED_LANE": "1",
                    "SALUS_MOUNT": salusd.mnt})
        pb = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               sys.executable, "-c", AS_NOBODY, salusd.mnt, PROGRAM, "2", "16",
                               "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd="/")
        def attached_programs():
            n = 0
            for sid in os.listdir(salusd.path("sessions")):
                try:
                    with open(salusd.path("sessions", sid, "status")) as f:
                        n += "\ngate: attached\n" in f.read()
                except OSError:
                    pass
            return n
        assert wait_until(lambda: attached_programs() == 2, timeout=10)
        hold.write_text("")
        rb, ob, eb = finish(pb)
        ra, oa, ea = finish(pa)
        assert ra == 0, (oa, ea)
        assert rb == 0, (ob, eb)
        # Every time uid 65534 got the lane, a's pattern (first byte 0xb1) was gone.
        firsts = [line for line in ob.splitlines() if line.startswith("first ")]
        assert firsts and all(line.endswith(" 0") for line in firsts), firsts
        # And a, back in the lane after it, found it cleared of 65534's bytes too.
        assert "first 2 0" in oa, oa
    finally:
        for p in (pa, pb):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        a.close()
