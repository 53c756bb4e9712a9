"""Shared lanes of attached programs (issue 15), end to end: a real salusd
(sim backend: the lane memory is a memfd the mock libcuda imports as a VMM
handle), two lane_program processes (CUDA programs) with libsalus-shim.so
preloaded, SALUS_SHARED_LANE=1 (salus_lane_alloc) or alloc (cuMemAlloc served
from the lane, blocks that outlive an iteration promoted) and the mock libcuda.
Both take their ephemeral memory from the one lane in turn; each checks its own
bytes while it holds it.

Needs the shim, the mock and lane_program (meson sets SALUS_TEST_SHIM,
SALUS_TEST_CUDA_MOCK_DIR and SALUS_TEST_LANE_PROGRAM); skips without them.
"""
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import Session, start_on_mock_cuda, wait_until

SHIM = os.environ.get("SALUS_TEST_SHIM", "")
MOCK_DIR = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
PROGRAM = os.environ.get("SALUS_TEST_LANE_PROGRAM", "")

pytestmark = pytest.mark.skipif(
    not (os.path.exists(SHIM) and os.path.isdir(MOCK_DIR) and os.path.exists(PROGRAM)),
    reason="needs libsalus-shim.so, the mock libcuda and lane_program (built where cuda.h is)")


def start(salusd, s, seed, mib, iters, hold=None, lane="1", extra=(), env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SALUS_")}
    env.update({
        "LD_PRELOAD": SHIM,
        "LD_LIBRARY_PATH": MOCK_DIR,
        "SALUS_SHIM_LIBCUDA": os.path.join(MOCK_DIR, "libcuda.so.1"),
        "SALUS_MOCK_LEGACY_STREAM": "1",
        "SALUS_SHARED_LANE": lane,
        "SALUS_MOUNT": salusd.mnt,
        "SALUS_SESSION": os.path.dirname(s.file("ctl")),
        **(env_extra or {}),
    })
    args = [PROGRAM, *extra, str(seed), str(mib), str(iters)] + ([str(hold)] if hold else [])
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def session(salusd, mib):
    s = Session(salusd)
    s.cmd(f"need persistent=8M ephemeral={mib}M gpu=0\n")
    return s


MALLOC = {"lane": "alloc", "extra": ["--malloc"]}  # SALUS_SHARED_LANE=alloc, cuMemAlloc
SEGMENTS = {"lane": "segments", "extra": ["--segments"]}  # PyTorch's expandable segments


def finish(p, timeout=20):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


class LogWatcher:
    """A session's log, read every 20 ms while its program runs: the session,
    and its log, end with the program. `text` is the last read (the log only
    grows), taken after the program exited."""

    def __init__(self, s, p):
        self.text = ""
        self.thread = threading.Thread(target=self._run, args=(s, p), daemon=True)
        self.thread.start()

    def _run(self, s, p):
        while True:
            done = p.poll() is not None
            try:
                self.text = s.read("log")
            except OSError:
                pass
            if done:
                return
            time.sleep(0.02)

    def wait(self):
        self.thread.join(timeout=10)
        return self.text


def stop_all(procs, sessions):
    """Kills the programs still running (None: never started) and closes the
    sessions: every test's cleanup, also when it failed."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
    for s in sessions:
        s.close()


def run_two(salusd, opts, iters=6):
    """Two programs of `opts` with 16M each per iteration on 8M budgets, to the
    end: both exit 0 having verified every iteration. Their outputs and logs."""
    a, b = session(salusd, 16), session(salusd, 16)
    pa = start(salusd, a, 1, 16, iters, **opts)
    pb = start(salusd, b, 2, 16, iters, **opts)
    wa, wb = LogWatcher(a, pa), LogWatcher(b, pb)
    try:
        ra, oa, ea = finish(pa)
        rb, ob, eb = finish(pb)
        la, lb = wa.wait(), wb.wait()
        assert ra == 0, (oa, ea, la)
        assert rb == 0, (ob, eb, lb)
        for out in (oa, ob):
            for k in range(1, iters + 1):
                assert f"verified {k}" in out
        return oa, ob, la, lb
    finally:
        stop_all((pa, pb), (a, b))


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
        stop_all((pa, pb), (a, b))


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


@pytest.mark.parametrize("how", ["salus_lane_alloc", "cuMemAlloc", "cuMemCreate"])
def test_sigkill_of_the_holder_mid_iteration_hands_the_lane_on(salusd, tmp_path, how):
    a, b = session(salusd, 16), session(salusd, 16)
    fds = fd_count(salusd.proc.pid)
    opts = {"cuMemAlloc": MALLOC, "cuMemCreate": SEGMENTS}.get(how, {})
    pa = start(salusd, a, 1, 16, 3, hold=tmp_path / "never", **opts)
    pb = None
    try:
        assert pa.stdout.readline().startswith("first 1")
        assert pa.stdout.readline().strip() == "holding"
        pb = start(salusd, b, 2, 16, 2, **opts)
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
        stop_all((pa, pb), (a, b))


def test_cuda_malloc_freed_within_iterations_takes_the_lane_uncharged(salusd):
    """SALUS_SHARED_LANE=alloc: cuMemAlloc of 16M inside each iteration, freed
    before the boundary, comes from the one lane memory the two programs hold in
    turn. Charged, it would be refused: the budget is the 8M persistent need."""
    oa, ob, la, lb = run_two(salusd, MALLOC)
    assert "0x62" in oa and "0xb1" in ob, (oa, ob)  # one memory, as with salus_lane_alloc
    assert la and "promote" not in la + lb, (la, lb)  # the logs were read


def test_cumemcreate_is_charged_and_its_refusal_says_the_lane_does_not_serve_it(salusd):
    """SALUS_SHARED_LANE=alloc: the program's own cuMemCreate (PyTorch's
    expandable segments) is not served by the lane, so 16M on the 8M budget is
    refused, and the log says why, not only that the budget ran out. The
    program prints the log's line: its session ends with it."""
    s = session(salusd, 16)
    p = start(salusd, s, 1, 16, 1, lane="alloc", extra=["--create"])
    try:
        r, out, err = finish(p)
        assert r == 3, (out, err)
        assert "cuMemCreate: 2\n" in out, out  # CUDA_ERROR_OUT_OF_MEMORY
        assert ("out of memory: budget 8388608, charged 0, request 16777216 (cuMemCreate, which "
                "SALUS_SHARED_LANE=alloc does not serve (=segments does): PyTorch's "
                "expandable_segments memory is charged as persistent)") in out, out
    finally:
        stop_all((p,), (s,))


@pytest.mark.parametrize("how", ["--async", "--pitch"])
def test_async_and_pitched_allocations_also_take_the_lane_uncharged(salusd, how):
    """cuMemAllocAsync (freed with cuMemFreeAsync on its stream, which the
    lane reuses once the stream has got there) and cuMemAllocPitch come from
    the lane too: 16M per iteration on an 8M budget, in turn from one memory."""
    a, b = session(salusd, 16), session(salusd, 16)
    pa = start(salusd, a, 1, 16, 6, lane="alloc", extra=[how])
    pb = start(salusd, b, 2, 16, 6, lane="alloc", extra=[how])
    try:
        ra, oa, ea = finish(pa)
        rb, ob, eb = finish(pb)
        assert ra == 0, (oa, ea)
        assert rb == 0, (ob, eb)
        for out in (oa, ob):
            for k in range(1, 7):
                assert f"verified {k}" in out
        assert "0x62" in oa and "0xb1" in ob, (oa, ob)  # one memory, handed over
    finally:
        stop_all((pa, pb), (a, b))


def frees(out):
    """The budget left that lane_program --keep printed after each boundary."""
    return [int(line.split()[2]) for line in out.splitlines()
            if line.startswith("free ") and line.split()[1] != "end"]


def start_keeping(salusd, a, b, tmp_path, keep, mib, iters, env_extra=None, how=None):
    """a keeps a `keep` MiB block from iteration 1; b starts and waits for the
    lane while a still holds it in iteration 1. Both use `how` (MALLOC by
    default). Returns both processes and a LogWatcher of a."""
    how = how or MALLOC
    hold = tmp_path / "go"
    pa = start(salusd, a, 1, mib, iters, hold=hold, lane=how["lane"],
               extra=[*how["extra"], "--keep", str(keep)], env_extra=env_extra)
    watcher = LogWatcher(a, pa)
    kept = pa.stdout.readline()
    assert kept.startswith("kept at ") and kept.strip().endswith("in lane"), kept
    assert pa.stdout.readline().startswith("first 1")
    assert pa.stdout.readline().strip() == "holding"
    pb = start(salusd, b, 2, mib, iters, **how)
    assert wait_until(lambda: b.status().get("gate") == "attached")
    hold.write_text("")
    return pa, pb, watcher


@pytest.mark.parametrize("how", ["cuMemAlloc", "cuMemCreate"])
def test_a_block_kept_across_boundaries_is_promoted_at_its_address(salusd, tmp_path, how):
    """A 4M block made in iteration 1 from the lane and kept for 20
    iterations, while another program takes the lane in between: promoted at the
    first boundary to memory of its own at the same address (charged: the 8M
    budget has 4M left), every byte checked in every iteration; freeing it
    gives the charge back. Without promotion the other program's pattern would
    overwrite it. cuMemAlloc: a block in the lane memory, copied to granules of
    its own (SALUS_SHARED_LANE=alloc); cuMemCreate: a segment made in the
    lane's room, whose charge moves and whose bytes do not (=segments)."""
    a, b = session(salusd, 24), session(salusd, 24)
    pa = pb = None
    try:
        pa, pb, watcher = start_keeping(salusd, a, b, tmp_path, 4, 16, 20,
                                        how=SEGMENTS if how == "cuMemCreate" else MALLOC)
        ra, oa, ea = finish(pa, timeout=60)
        rb, ob, eb = finish(pb, timeout=60)
        log = watcher.wait()
        assert ra == 0, (oa, ea, log)
        assert rb == 0, (ob, eb)
        assert "verified 20" in oa and "verified 20" in ob
        assert frees(oa) == [4 << 20] * 20, oa  # 4M promoted and charged, once
        assert f"free end {8 << 20}" in oa, oa  # and given back by cuMemFree
        if how == "cuMemAlloc":  # one lane memory went back and forth
            assert "0x62" in oa and "0xb1" in ob, (oa, ob)
        assert "abandoned" not in log and "cannot promote" not in log, log
        assert "out of memory" not in log, log
    finally:
        stop_all((pa, pb), (a, b))


@pytest.mark.parametrize("why", ["budget", "driver"])
def test_a_failed_promotion_keeps_the_bytes_and_says_so(salusd, tmp_path, why):
    """budget: a 12M block kept across the boundary cannot be promoted within
    an 8M budget; the log says so with the budget and the bytes. driver: a 4M
    one fails at the copy (the mock's cuMemcpyDtoD, on request), and what was
    done is undone. Either way the program keeps the lane memory mapped (it
    never yields it), salusd abandons it to the program after 2 s and gives
    the other program fresh memory; the block's bytes stay exact throughout
    and nothing is charged."""
    a, b = session(salusd, 24), session(salusd, 24)
    pa = pb = None
    keep, env = (12, None) if why == "budget" else (4, {"SALUS_MOCK_FAIL_DTOD": "1"})
    try:
        pa, pb, watcher = start_keeping(salusd, a, b, tmp_path, keep, 8, 6, env)
        ra, oa, ea = finish(pa, timeout=60)
        rb, ob, eb = finish(pb, timeout=60)
        log = watcher.wait()
        assert ra == 0, (oa, ea, log)
        assert rb == 0, (ob, eb)
        if why == "budget":
            assert "cannot promote 1 live cuMemAlloc allocation(s)" in log, log
            assert f"({12 << 20} bytes of granules): budget {8 << 20}, charged 0" in log, log
        else:
            assert f"promoting {4 << 20} bytes failed at cuMemcpyDtoD (CUresult 999)" in log, log
        assert "the lane memory is abandoned to this program" in log, log
        assert "stay in lane memory" in log, log  # the kept memory, after the abandonment
        assert frees(oa) == [8 << 20] * 6 and f"free end {8 << 20}" in oa, oa
    finally:
        stop_all((pa, pb), (a, b))


def test_expandable_segments_take_the_lanes_room_uncharged(salusd):
    """SALUS_SHARED_LANE=segments: each iteration makes a 16M segment as
    expandable segments do (cuMemCreate, cuMemMap, cuMemSetAccess) and frees
    it (cuMemUnmap, cuMemRelease) before its boundary. Charged, it would be
    refused on the 8M budget; the lane's room serves it, to the two programs in
    turn, and salusd holds no lane memory of its own meanwhile."""
    oa, ob, la, lb = run_two(salusd, SEGMENTS)
    assert "as room for its cuMemCreate" in la, la
    assert "out of memory" not in la + lb and "segment" not in la + lb, (la, lb)


def test_a_segment_goes_back_to_the_driver_only_cleared(salusd, tmp_path):
    """The program exports its iteration-1 segment's handle before freeing it
    and looks at that memory after every boundary through the fd: while the
    shim keeps it for the program's next cuMemCreate it holds the program's
    pattern; once the lane was asked for (the other program waits), the shim
    zeroes it before releasing it to the driver."""
    a, b = session(salusd, 16), session(salusd, 16)
    hold = tmp_path / "go"
    pa = start(salusd, a, 1, 16, 6, hold=hold, lane="segments", extra=["--segments", "--spy"])
    pb = None
    try:
        assert pa.stdout.readline().startswith("first 1")
        assert pa.stdout.readline().strip() == "holding"
        pb = start(salusd, b, 2, 16, 6, **SEGMENTS)
        assert wait_until(lambda: b.status().get("gate") == "attached")
        hold.write_text("")
        ra, oa, ea = finish(pa)
        rb, ob, eb = finish(pb)
        assert ra == 0 and rb == 0, (oa, ea, ob, eb)
        spied = [line.split()[2] for line in oa.splitlines() if line.startswith("spy ")]
        assert len(spied) == 6, oa
        assert set(spied) <= {"0xb1", "0"}, spied  # the program's own bytes, or zeros
        assert "0" in spied, oa  # given up once at least, and cleared
    finally:
        stop_all((pa, pb), (a, b))


def test_a_room_the_card_is_still_freeing_is_waited_for(salusd, tmp_path):
    """The room was promised by admission, but the card may still be freeing
    what salusd gave back: the mock's cuMemCreate says out of memory until the
    test removes a file, 200 ms in; the program's first segment is made once it
    may be (the shim tries again for up to a second) and the log says how long
    it waited."""
    s = session(salusd, 16)
    full = tmp_path / "full"
    full.write_text("")
    p = start(salusd, s, 1, 16, 2, env_extra={"SALUS_MOCK_NO_MEMORY_FILE": str(full)},
              **SEGMENTS)
    watcher = LogWatcher(s, p)
    try:
        time.sleep(0.2)
        full.unlink()
        r, out, err = finish(p)
        log = watcher.wait()
        assert r == 0 and "verified 2" in out, (out, err, log)
        assert ("cuMemCreate in the shared lane's room of 16777216 bytes: the driver had no "
                "memory for it within the budget; it had after") in log, log
    finally:
        stop_all((p,), (s,))


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
    d = start_on_mock_cuda(["--gpu-isolation", isolation, "--cuda-memory-fraction", "0.1"],
                           [MOCK_DIR])
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
        stop_all((pa, pb), (a, b))
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
