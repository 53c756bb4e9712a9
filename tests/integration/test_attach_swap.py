"""Movable memory of attached programs (issue 15), end to end: a real salusd
(sim backend), swap_program (a CUDA program) with libsalus-shim.so preloaded,
SALUS_SWAP=1 and the mock libcuda (tests/vgpu/cuda/mock_libcuda.cpp), whose
VMM is real memory. A second attached session, played by the test through
client/salus_gate.py, holds the lane under the priority policy so that the
program waits at its boundary; `swap out SESSION` on /salus/ctl (the manual
trigger) moves its memory to the host there; its next grant brings it back.

Needs the shim, the mock and swap_program (meson sets SALUS_TEST_SHIM,
SALUS_TEST_CUDA_MOCK_DIR and SALUS_TEST_SWAP_PROGRAM); skips without them.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SALUSD, Session, gpu_memory, start_on_mock_cuda, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client"))
import salus_gate  # noqa: E402

SHIM = os.environ.get("SALUS_TEST_SHIM", "")
MOCK_DIR = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
PROGRAM = os.environ.get("SALUS_TEST_SWAP_PROGRAM", "")

pytestmark = pytest.mark.skipif(
    not (os.path.exists(SHIM) and os.path.isdir(MOCK_DIR) and os.path.exists(PROGRAM)),
    reason="needs libsalus-shim.so, the mock libcuda and swap_program (built where cuda.h is)")

MIB = 1 << 20


def admin(salusd, line):
    with open(salusd.path("ctl"), "w") as f:
        f.write(line + "\n")


def start_program(salusd, s, mib, iters, go, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SALUS_")}
    env.update({
        "LD_PRELOAD": SHIM,
        "LD_LIBRARY_PATH": MOCK_DIR,
        "SALUS_SHIM_LIBCUDA": os.path.join(MOCK_DIR, "libcuda.so.1"),
        "SALUS_MOCK_LEGACY_STREAM": "1",
        "SALUS_SWAP": "1",
        "SALUS_MOUNT": salusd.mnt,
        "SALUS_SESSION": os.path.dirname(s.file("ctl")),
    })
    env.update(extra_env or {})
    return subprocess.Popen([PROGRAM, str(mib), str(iters), str(go)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Holder:
    """An attached session that takes the lane and keeps it (its iteration 1
    never completes until release())."""

    def __init__(self, salusd, persistent="16M"):
        self.s = Session(salusd)
        self.s.cmd(f"need persistent={persistent} ephemeral=0 priority=10 gpu=0\n")
        self.gate = salus_gate.Gate()
        self.gate.g.marking = salus_gate.MARK_EXPLICIT
        fd = os.open(self.s.file("ctl"), os.O_WRONLY)
        try:
            os.write(fd, self.gate.attach_line().encode())
        finally:
            os.close(fd)

    def ask(self):
        self.gate.g.requested = 1
        self.gate.ring()

    def granted(self):
        return self.gate.g.granted >= 1

    def release(self):
        self.gate.g.gpu_ns_total = 1000000
        self.gate.g.completed = 1
        self.gate.ring()

    def close(self):
        self.gate.close()
        self.s.close()


def setup_pair(salusd, tmp_path, mib, iters, extra_env=None):
    """The program runs iteration 1 with its memory filled; the holder then
    takes the lane at the program's boundary 1. Returns (session, program, holder)."""
    with open(salusd.path("policy"), "w") as f:
        f.write("priority\n")
    s = Session(salusd)
    s.cmd(f"need persistent={2 * mib}M ephemeral=0 gpu=0\n")
    go = tmp_path / "go"
    p = start_program(salusd, s, mib, iters, go, extra_env)
    line = p.stdout.readline()
    assert line.startswith("ready"), (line, p.stderr.read() if p.poll() is not None else "")
    wait_until(lambda: s.status().get("gate") == "attached")
    h = Holder(salusd)
    h.ask()
    time.sleep(0.05)
    assert not h.granted(), "the program's iteration 1 holds the lane"
    go.write_text("")  # the program comes to boundary 1; priority gives the lane to the holder
    assert wait_until(h.granted, timeout=5)
    assert wait_until(lambda: s.status()["iterations_requested"] == "2")
    return s, p, h


def test_swap_out_at_the_boundary_and_back_in_at_the_grant(salusd, tmp_path):
    s, p, h = setup_pair(salusd, tmp_path, 8, 3)
    try:
        st = s.status()
        assert st["residency"] == "resident"
        charged = int(st["memory_charged"])
        assert charged == 8 * MIB
        admin(salusd, f"swap out {os.path.basename(os.path.dirname(s.file('ctl')))}")
        assert wait_until(lambda: s.status()["residency"] == "swapped"
                          and s.status()["swap_error"] == "-", timeout=5), s.status()
        st = s.status()
        assert st["memory_swapped"] == str(8 * MIB)
        assert st["memory_resident"] == "0"
        assert st["memory_charged"] == str(charged), "the charge stays with the session"
        assert st["swaps_out"] == "1" and st["swap_error"] == "-"
        assert "swap-out done" in s.read("log")
        metrics = open(salusd.path("metrics")).read()
        assert "salus_session_memory_swapped_bytes{" in metrics
        # A second request for the same state is refused at once.
        with pytest.raises(OSError) as e:
            admin(salusd, f"swap out {os.path.basename(os.path.dirname(s.file('ctl')))}")
        assert e.value.errno in (114, 16)  # EALREADY, or EBUSY while the report is read
        h.release()  # the holder leaves the lane: the grant brings the memory back
        for k in (1, 2, 3):
            assert p.stdout.readline().strip() == f"verified {k}"
        assert p.wait(timeout=10) == 0
        st = s.status() if os.path.exists(s.file("status")) else None
        if st is not None:
            assert st["swaps_in"] == "1"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        h.close()
        s.close()


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_sigkill_during_a_swap_leaks_nothing_in_salusd(salusd, tmp_path):
    # Copies crawl (0.5 s per MiB): the program is killed in the middle of one.
    s, p, h = setup_pair(salusd, tmp_path, 8, 3, {"SALUS_MOCK_COPY_US_PER_MIB": "500000"})
    name = os.path.basename(os.path.dirname(s.file("ctl")))
    try:
        fds = fd_count(salusd.proc.pid)
        admin(salusd, f"swap out {name}")
        assert wait_until(lambda: s.status()["residency"] == "swapping-out", timeout=5)
        p.send_signal(signal.SIGKILL)
        p.wait()
        # The session ends with its program, mid-swap or not.
        assert wait_until(lambda: not os.path.exists(s.file("status")), timeout=3)
        # salusd kept nothing of the program's: its gate mapping and fds are gone.
        assert wait_until(lambda: fd_count(salusd.proc.pid) <= fds - 3, timeout=3), \
            (fd_count(salusd.proc.pid), fds)
        h.release()
        st = open(salusd.path("stats")).read()
        assert "uptime_s" in st  # still serving
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        h.close()
        s.close()


def test_no_host_memory_is_a_clear_error_and_the_program_runs_on(salusd, tmp_path):
    s, p, h = setup_pair(salusd, tmp_path, 8, 2, {"SALUS_MOCK_HOST_LIMIT": str(4 * MIB)})
    name = os.path.basename(os.path.dirname(s.file("ctl")))
    try:
        admin(salusd, f"swap out {name}")
        assert wait_until(lambda: s.status()["swap_error"] == "ENOMEM", timeout=5), s.status()
        st = s.status()
        assert st["residency"] == "resident" and st["memory_swapped"] == "0"
        log = s.read("log")
        assert "swap-out failed: ENOMEM" in log
        assert "swap out failed" in log and "everything stays on the GPU" in log
        h.release()
        for k in (1, 2):
            assert p.stdout.readline().strip() == f"verified {k}"
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        h.close()
        s.close()


def test_a_program_without_movable_memory_says_so(salusd, tmp_path):
    s, p, h = setup_pair(salusd, tmp_path, 4, 1, {"SALUS_SWAP": "0"})
    name = os.path.basename(os.path.dirname(s.file("ctl")))
    try:
        admin(salusd, f"swap out {name}")
        assert wait_until(lambda: s.status()["swap_error"] == "EOPNOTSUPP", timeout=5), \
            (s.status(), s.read("log"))
        assert "not movable" in s.read("log")
        assert s.status()["memory_unswappable"] == str(4 * MIB)
        h.release()
        assert p.stdout.readline().strip() == "verified 1"
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        h.close()
        s.close()


@pytest.mark.parametrize("spill,segments", [(False, 0), (True, 0), (False, 4)])
def test_swap_eval_runs_against_the_mock(tmp_path, spill, segments):
    """tools/swap_eval.py end to end (its own salusd), with the mock driver:
    its figures mean nothing here; this keeps the device script working (also
    with the program's own expandable-segment-style handles)."""
    tool = os.path.join(HERE, "..", "..", "tools", "swap_eval.py")
    args = [sys.executable, tool, "--salusd", os.environ["SALUSD"], "--shim", SHIM,
            "--program", PROGRAM, "--mib", "16", "--rounds", "2",
            "--libcuda", os.path.join(MOCK_DIR, "libcuda.so.1")]
    if spill:
        args += ["--host-limit", "0", "--spill-dir", str(tmp_path)]
    if segments:
        args += ["--segments", str(segments)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "baseline pinned cuMemcpyDtoH" in r.stdout
    assert "swap-out " in r.stdout and "x baseline DtoH" in r.stdout
    assert "swap-in " in r.stdout
    assert "contents after the swaps: identical" in r.stdout
    assert os.listdir(tmp_path) == [], "the spill file is never visible"
    if segments:
        assert "16 MiB of the program's own 4 MiB handles" in r.stdout, r.stdout


def test_a_session_is_not_granted_while_its_swap_out_runs(salusd, tmp_path):
    # Copies crawl (0.1 s per MiB, 0.8 s for the swap-out): the lane frees up in
    # the middle of it, and the program must not be granted before it answered.
    s, p, h = setup_pair(salusd, tmp_path, 8, 2, {"SALUS_MOCK_COPY_US_PER_MIB": "100000"})
    name = os.path.basename(os.path.dirname(s.file("ctl")))
    try:
        admin(salusd, f"swap out {name}")
        assert wait_until(lambda: s.status()["residency"] == "swapping-out", timeout=5)
        h.release()
        time.sleep(0.2)
        st = s.status()
        assert st["residency"] == "swapping-out", st
        assert st["iterations_granted"] == "1", "granted into its own swap-out"
        for k in (1, 2):
            assert p.stdout.readline().strip() == f"verified {k}"
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        h.close()
        s.close()


def start_two(d, tmp_path, mib, iters, procs, sessions, extra_env=None):
    """Two sessions of `need persistent=40M` on gpu 0, each with a swap_program of
    MIB MiB and ITERS iterations, both let go at once. Appended to `procs` and
    `sessions` as they start, so that the caller's cleanup sees every one."""
    go = tmp_path / "go"
    go.write_text("")
    for _ in range(2):
        s = Session(d)
        s.cmd("need persistent=40M ephemeral=0 gpu=0\n")
        sessions.append(s)
        procs.append(start_program(d, s, mib, iters, go, extra_env))


def stop_all(procs, sessions, d):
    """A test's cleanup: kills its programs still running, closes its sessions
    and stops salusd."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for s in sessions:
        s.close()
    d.stop()


def watch(procs, sessions, seen):
    """Until every program has exited: the largest swaps_out/swaps_in each session
    showed, the last log read (both go with the session when its program exits),
    and, from its first iteration on (a charge comes before the memory is mapped
    and made movable), its largest memory_swapped and memory_unswappable."""
    while any(p.poll() is None for p in procs):
        for k, s in enumerate(sessions):
            try:
                st = s.status()
                seen[k]["out"] = max(seen[k]["out"], int(st.get("swaps_out", 0)))
                seen[k]["in"] = max(seen[k]["in"], int(st.get("swaps_in", 0)))
                seen[k]["swap_error"] = st.get("swap_error", seen[k]["swap_error"])
                seen[k]["swappable"] = st.get("swappable", "")
                seen[k]["log"] = s.read("log")
                if st.get("gate") == "attached" and int(st["iterations_completed"]) >= 1:
                    for key in ("swapped", "unswappable"):
                        seen[k][key] = max(seen[k][key], int(st["memory_" + key]))
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.005)


def all_verified(procs, iters):
    """Waits for each program and asserts it checked every byte at every one of
    its ITERS iterations."""
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, (out, err)
        assert out.count("verified") == iters, out


def fresh_seen(n):
    return [{"out": 0, "in": 0, "swap_error": "-", "swappable": "", "log": "", "swapped": 0,
             "unswappable": 0} for _ in range(n)]


def test_residency_swaps_attached_programs_that_do_not_fit_together(tmp_path):
    """Wiring to residency (design.md): two SALUS_SWAP=1 programs of 40M each on a
    64M card at --oversubscribe 2 are both admitted and run to completion, taking
    turns: each is swapped out by the planner at least once and checks every byte
    of its memory after every grant."""
    from conftest import Salusd
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair"], sim_memory="64M",
               gpus=1).start()
    procs = []
    sessions = []
    try:
        # Copies crawl (2 ms per MiB in the mock), so that they, not the machine's
        # load, set both the swap time (one 40 MiB copy: 80 ms) and the iteration
        # (two such copies, 160 ms). A quantum is 20 swap times (design.md), about
        # 10 iterations: 60 iterations are several quanta of each program however
        # loaded the machine, so each is swapped out and in at least once.
        ITERS = 60
        go = tmp_path / "go"
        go.write_text("")  # no holding back at the start: both iterate at once
        for i in range(2):
            s = Session(d)
            s.cmd("need persistent=40M ephemeral=0 gpu=0\n")
            sessions.append(s)
            procs.append(start_program(d, s, 40, ITERS, go,
                                       {"SALUS_MOCK_COPY_US_PER_MIB": "2000"}))
        seen = fresh_seen(len(sessions))
        watch(procs, sessions, seen)
        all_verified(procs, ITERS)
        for k in range(2):
            assert seen[k]["out"] >= 1 and seen[k]["in"] >= 1, (k, seen[k])
            assert "swap-out done" in seen[k]["log"], seen[k]["log"]
        # The programs' sessions ended with them; the GPU's counters remain.
        with open(d.path("metrics")) as f:
            metrics = f.read()
        outs = [ln for ln in metrics.splitlines()
                if ln.startswith('salus_swaps_total{gpu="0",direction="out"}')]
        assert outs and int(outs[0].split()[-1]) >= 2, metrics
        assert 'salus_gpu_memory_bytes{gpu="0",class="swapped"} 0' in metrics
    finally:
        stop_all(procs, sessions, d)


def test_what_a_swapped_program_leaves_on_the_card_stays_counted(tmp_path):
    """A swapped-out program still has its CUDA context on the card, and what its
    shim cannot move: two programs of 32M movable + 8M of their own cuMemCreate
    (need 40M each, counted 44M with a context reserve of 4M) on a 64M card at
    --oversubscribe 2. While one is out, the resident set (gpus/0/memory
    resident_reserved) holds the other's 44M and, of the one out, its 4M reserve
    before its first swap-out and 4M + the 8M its shim reported after one."""
    from conftest import Salusd
    M = 1 << 20
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair",
                           "--attach-context-reserve", "4M"], sim_memory="64M", gpus=1).start()
    procs = []
    sessions = []
    try:
        start_two(d, tmp_path, 32, 40, procs, sessions,
                  {"SALUS_MOCK_COPY_US_PER_MIB": "2000", "SWAP_PROGRAM_UNMOVABLE_MIB": "8"})

        def both_running():
            try:
                return all(s.status().get("gate") == "attached" and
                           int(s.status().get("iterations_completed", 0)) >= 1 for s in sessions)
            except (OSError, ValueError):
                return False
        assert wait_until(both_running, timeout=30)
        assert sessions[0].status()["memory_unswappable"] == str(8 * M)
        samples = []
        while all(p.poll() is None for p in procs):
            value = int(gpu_memory(d)["resident_reserved"])
            if all(p.poll() is None for p in procs):
                samples.append(value)
            time.sleep(0.01)
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, (out, err)
        # One resident (44M) beside one out (4M or 4M + 8M), or both out.
        allowed = {44 * M + 4 * M, 44 * M + 12 * M, 8 * M, 16 * M, 24 * M}
        assert samples and set(samples) <= allowed, sorted(set(samples))
        assert 56 * M in samples, sorted(set(samples))
    finally:
        stop_all(procs, sessions, d)


def test_a_programs_own_segments_move_with_it(tmp_path):
    """The program's own cuMemCreate memory, made as PyTorch's expandable
    segments make it (2 MiB handles of the POSIX-fd type mapped into one
    reservation), moves with the rest: two programs of 24M cuMemAlloc + 16M of
    segments (need 40M each) on a 64M card at --oversubscribe 2 are swapped out
    by the planner and back, each checks every byte of both after every grant,
    none of their memory is unswappable, and one swapped out has all 40M off
    the card."""
    from conftest import Salusd
    M = 1 << 20
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair"], sim_memory="64M",
               gpus=1).start()
    procs = []
    sessions = []
    try:
        ITERS = 60  # several quanta of each (see the test above)
        start_two(d, tmp_path, 24, ITERS, procs, sessions,
                  {"SALUS_MOCK_COPY_US_PER_MIB": "2000", "SWAP_PROGRAM_SEGMENT_MIB": "16"})
        seen = fresh_seen(len(sessions))
        watch(procs, sessions, seen)
        all_verified(procs, ITERS)
        for k in range(2):
            assert seen[k]["out"] >= 1 and seen[k]["in"] >= 1, (k, seen[k])
            assert seen[k]["unswappable"] == 0, (k, seen[k])
        assert max(x["swapped"] for x in seen) == 40 * M, seen
    finally:
        stop_all(procs, sessions, d)


def test_residency_asks_a_program_without_salus_swap_once(tmp_path):
    """A program started without SALUS_SWAP=1 answers the planner's swap-out with
    ENOTSUP: it is marked unswappable and never asked again (no retry storm while
    the session that wants its room waits), and the other one runs after it."""
    from conftest import Salusd
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair"], sim_memory="64M",
               gpus=1).start()
    procs = []
    sessions = []
    try:
        # A program's iteration 1 starts when it attaches, so A holds a grant until
        # its first salus_step(), i.e. until go_a is there.
        go_a = tmp_path / "go_a"
        go_b = tmp_path / "go_b"
        go_b.write_text("")
        a = Session(d)
        a.cmd("need persistent=40M ephemeral=0 gpu=0\n")
        b = Session(d)
        b.cmd("need persistent=40M ephemeral=0 gpu=0\n")
        sessions += [a, b]
        pa = start_program(d, a, 40, 20, go_a, {"SALUS_SWAP": "0"})
        procs.append(pa)
        assert pa.stdout.readline().startswith("ready")
        assert wait_until(lambda: a.status().get("gate") == "attached")
        pb = start_program(d, b, 40, 5, go_b)
        procs.append(pb)
        assert wait_until(lambda: b.status().get("iterations_requested") == "1")
        time.sleep(0.2)  # past A's residency quantum: B, wanting A's room, makes A a victim
        assert a.status()["swap_error"] == "-"  # not asked inside its iteration
        go_a.write_text("")  # A's boundary 1: asked there, it answers ENOTSUP and runs on
        seen = fresh_seen(len(sessions))
        watch(procs, sessions, seen)
        out, err = pa.communicate(timeout=30)
        assert pa.returncode == 0 and out.count("verified") == 20, (out, err)
        out, err = pb.communicate(timeout=30)
        assert pb.returncode == 0 and out.count("verified") == 5, (out, err)
        assert seen[0]["swap_error"] == "EOPNOTSUPP" and seen[0]["swappable"] == "no", seen[0]
        log = seen[0]["log"]
        assert log.count("swap-out failed: EOPNOTSUPP") == 1, log
        assert log.count("not movable: counted resident") == 1, log
    finally:
        stop_all(procs, sessions, d)


def test_stop_with_a_swapped_program_gives_its_memory_back(tmp_path):
    """salusd stops while the planner has an attached program swapped out: the gate
    says detached, the shim brings the memory back and the program runs on
    ungated to the end, every byte checked."""
    from conftest import Salusd
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair"], sim_memory="64M",
               gpus=1).start()
    procs = []
    sessions = []
    stopped = False
    try:
        start_two(d, tmp_path, 40, 100, procs, sessions)

        def one_swapped():
            try:
                return any(s.status().get("residency") == "swapped" for s in sessions)
            except OSError:
                return False
        assert wait_until(one_swapped, timeout=20)
        d.stop()  # the sessions are still open: the stop ends them
        stopped = True
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, (out, err)
            assert out.count("verified") == 100, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in sessions:
            try:
                s.close()
            except OSError:  # ECONNABORTED once salusd has stopped
                pass
        if not stopped:
            d.stop()


def attach_python_gate(s):
    """Attaches a gate made by this test (client/salus_gate.py) to session s."""
    gate = salus_gate.Gate()
    fd = os.open(s.file("ctl"), os.O_WRONLY)
    try:
        os.write(fd, gate.attach_line().encode())
    finally:
        os.close(fd)
    return gate


@pytest.mark.parametrize("arena,fraction,warns", [("up-front", "0.9", True),
                                                  ("up-front", "0.5", False),
                                                  ("on-demand", "0.9", False)])
def test_attach_on_cuda_warns_when_budgets_exceed_the_card_outside_the_arena(arena, fraction,
                                                                            warns):
    """With the arena allocated up front, attached programs allocate beside it:
    two budgets of 40M fit beside an arena of half the card, but not beside one
    of 90% (about 51 MiB left), and the second attach says so and names the
    flag. Backed on demand (the default), the arena takes only what salusd
    holds, so nothing needs saying."""
    d = start_on_mock_cuda(["--cuda-memory-fraction", fraction, "--cuda-arena", arena], [MOCK_DIR])
    sessions, gates = [], []
    try:
        for _ in range(2):
            s = Session(d)
            s.cmd("need persistent=40M ephemeral=0 gpu=0\n")
            sessions.append(s)
            gates.append(attach_python_gate(s))
        first, second = (s.read("log") for s in sessions)
        assert "attached gate=" in first and "attached gate=" in second, (first, second)
        assert "warning" not in first, first
        if warns:
            assert "context reserves of 80.0M in all, but only" in second, second
            assert "--cuda-memory-fraction" in second, second
        else:
            assert "warning" not in second, second
    finally:
        for g in gates:
            g.close()
        for s in sessions:
            s.close()
        d.stop()


def start_with_this_process_at(reserve, used, others=()):
    """salusd on the mock driver with `--attach-context-reserve reserve` and the
    mock NVML listing this test process (the attached program: its gate is
    made here) at `used` bytes on the mock's one GPU, and (pid, bytes) `others`
    beside it. Skips without the mock NVML."""
    nvml = os.environ.get("SALUS_TEST_NVML_MOCK_DIR", "")
    if not nvml:
        pytest.skip("built without the mock NVML")
    uuid = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"  # the mock driver's one GPU
    listed = ",".join(f"{uuid}:{pid}:{n}" for pid, n in [(os.getpid(), used), *others])
    return start_on_mock_cuda(["--attach-context-reserve", reserve], [MOCK_DIR, nvml],
                              {"MOCK_NVML_DEVICES": uuid, "MOCK_NVML_PROCESSES": listed})


def test_the_drivers_figure_for_an_attached_program_is_held_against_its_reserve():
    """The cuda backend with the mock driver and the mock NVML, which lists this
    test process (the attached program: its gate is made here) at 300M: status
    and metrics show the figure and, less the charge, the context; past the
    256M reserve, the session log says so once."""
    M = 1 << 20
    d = start_with_this_process_at("256M", 300 * M)
    s = Session(d)
    gate = None
    try:
        s.cmd("need persistent=100M ephemeral=0 gpu=0\n")
        gate = attach_python_gate(s)
        assert wait_until(lambda: s.status()["memory_gpu"] == str(300 * M), timeout=10), s.status()
        st = s.status()
        assert st["memory_context"] == str(300 * M), st  # nothing charged: all of it
        assert st["memory_context_reserve"] == str(256 * M), st
        with open(d.path("metrics")) as f:
            metrics = f.read()
        assert (f'salus_session_memory_gpu_bytes{{session="{s.id}",uid="0",'
                f'pid="{os.getpid()}"}} {300 * M}\n') in metrics, metrics
        assert wait_until(lambda: "warning: the driver counts 300.0M" in s.read("log"), timeout=10)
        assert gpu_memory(d)["context_measured"] == str(300 * M)
        time.sleep(1.2)
        assert s.read("log").count("warning: the driver counts") == 1, s.read("log")
    finally:
        if gate:
            gate.close()
        s.close()
        d.stop()


def test_an_auto_context_reserve_learns_the_largest_context_measured():
    """`--attach-context-reserve auto` (512M on cuda): a program whose driver
    figure passes its charge by 700M at two checks in a row raises the GPU's
    reserve for new attached needs to 700M; its own session keeps what it was
    counted (512M cut to what its 100M need leaves of the mock GPU's arena)."""
    M = 1 << 20
    d = start_with_this_process_at("auto", 700 * M)
    s = Session(d)
    gate = None
    try:
        assert gpu_memory(d)["context_reserve"] == str(512 * M)
        s.cmd("need persistent=100M ephemeral=0 gpu=0\n")
        gate = attach_python_gate(s)
        counted = int(s.status()["memory_context_reserve"])
        assert 0 < counted < 512 * M, s.status()
        assert wait_until(lambda: gpu_memory(d)["context_reserve"] == str(700 * M),
                          timeout=10), gpu_memory(d)
        assert s.status()["memory_context_reserve"] == str(counted), s.status()
    finally:
        if gate:
            gate.close()
        s.close()
        d.stop()


def test_gpu_processes_sorts_what_nvml_lists_and_salusctl_shows_it():
    """The mock NVML lists this process (attached: the program) and pid 1 (no
    session's): gpus/0/processes says which is which, gpus/0/memory counts pid 1
    outside sessions, and salusctl status shows both."""
    M = 1 << 20
    d = start_with_this_process_at("0", 300 * M, others=[(1, 20 * M)])
    s = Session(d)
    gate = None
    try:
        s.cmd("need persistent=100M ephemeral=0 gpu=0\n")
        gate = attach_python_gate(s)
        want = (f"# pid bytes role session\n{os.getpid()} {300 * M} program {s.id}\n"
                f"1 {20 * M} outside -\n")
        assert wait_until(lambda: open(d.path("gpus", "0", "processes")).read() == want,
                          timeout=10), open(d.path("gpus", "0", "processes")).read()
        assert gpu_memory(d)["outside_sessions"] == str(20 * M)
        assert gpu_memory(d)["outside_processes"] == "1"
        assert s.status()["memory_ungated"] == "0"
        salusctl = os.path.join(os.path.dirname(os.path.abspath(SALUSD)), "salusctl")
        out = subprocess.run([salusctl, "--mount", d.mnt, "status"], check=True,
                             capture_output=True, text=True).stdout
        table = out.split("\nPROCESSES\n")[1].splitlines()
        assert table[0].split() == ["GPU", "PID", "GPU_MEM", "ROLE", "SESSION"], out
        assert table[1].split() == ["0", str(os.getpid()), "300M", "program", s.id], out
        assert table[2].split() == ["0", "1", "20M", "outside", "-"], out
        header, row = out.split("\nGPUS\n")[1].splitlines()[:2]
        at = header.index("OUTSIDE")  # the name has spaces: read the column where it stands
        assert row[at:at + len("OUTSIDE")].strip() == "20M", out
    finally:
        if gate:
            gate.close()
        s.close()
        d.stop()


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_the_cuda_arena_is_backed_only_where_salusd_holds_memory(isolation):
    """Backed on demand, the arena's card memory follows what salusd holds: a
    buffer is backed (its bytes kept, fresh bytes zero), attached sessions'
    needs are not, and memory that is freed goes back to the card."""
    d = start_on_mock_cuda(["--cuda-memory-fraction", "0.9", "--gpu-isolation", isolation],
                           [MOCK_DIR])
    s = hosted = gate = None
    try:
        assert gpu_memory(d)["backing"] == "on-demand"
        assert gpu_memory(d)["backed"] == "0"
        s = Session(d)
        s.cmd("need persistent=200M ephemeral=0 gpu=0\n")
        gate = attach_python_gate(s)
        assert gpu_memory(d)["backed"] == "0", "an attached need holds no arena memory"
        hosted = Session(d)
        hosted.cmd("need persistent=40M ephemeral=0 gpu=0\n")
        hosted.cmd("alloc w 3M\n")
        with open(hosted.file("mem/w"), "r+b") as f:
            assert f.read(3 << 20) == bytes(3 << 20), "fresh memory reads as zero"
            f.seek(0)
            f.write(b"\x5a" * 4096)
        with open(hosted.file("mem/w"), "rb") as f:
            assert f.read(4096) == b"\x5a" * 4096
        assert gpu_memory(d)["backed"] == str(4 << 20), "3M in two 2 MiB chunks"
        assert gpu_memory(d)["backing_wait"] == "-"
        hosted.cmd("free w\n")
        wait_until(lambda: gpu_memory(d)["backed"] == "0", timeout=10)
        hosted.cmd("alloc v 1M\n")
        assert gpu_memory(d)["backed"] == str(2 << 20)
    finally:
        if gate:
            gate.close()
        for x in (s, hosted):
            if x:
                x.close()
        d.stop()


@pytest.mark.parametrize("honest,overrun", [(True, "warn"), (False, "warn"), (False, "kill")])
def test_a_swapped_program_is_held_to_the_drivers_figure(tmp_path, honest, overrun):
    """Swapped out, a program's driver figure (NVML) is held against what it said
    stays on the card. The mock NVML lists the program (250M charged) at 254M
    while it runs, its 4M context within the reserve. Once the planner has
    swapped it out for a holder of 300M, an honest program shows its context
    alone and nothing is said; one that still holds everything (its shim reported
    nothing unmovable) gets, after two checks past what was counted, what the
    driver shows counted on the card as far as the card has room, and its log
    says so. The program finishes either way, every byte checked; under
    --attach-overrun kill the lying one is killed instead."""
    nvml = os.environ.get("SALUS_TEST_NVML_MOCK_DIR", "")
    if not nvml:
        pytest.skip("built without the mock NVML")
    M = 1 << 20
    uuid = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"  # the mock driver's one GPU
    listing = tmp_path / "nvml"

    def show(pid, nbytes):  # atomically: the mock rereads it at every query
        tmp = tmp_path / "nvml.tmp"
        tmp.write_text(f"{uuid}:{pid}:{nbytes}\n")
        os.rename(tmp, listing)
    d = start_on_mock_cuda(["--oversubscribe", "2", "--policy", "priority",
                            "--attach-context-reserve", "4M", "--attach-overrun", overrun],
                           [MOCK_DIR, nvml],
                           {"MOCK_NVML_DEVICES": uuid, "MOCK_NVML_PROCESSES_FILE": str(listing)})
    s = Session(d)
    go = tmp_path / "go"
    p = h = None
    try:
        s.cmd("need persistent=300M ephemeral=0 gpu=0 kind=attached\n")
        p = start_program(d, s, 250, 2, go)
        show(p.pid, 254 * M)
        line = p.stdout.readline()
        assert line.startswith("ready"), (line, p.stderr.read() if p.poll() is not None else "")
        assert wait_until(lambda: s.status().get("gate") == "attached")
        h = Holder(d, "300M")
        h.ask()
        go.write_text("")  # boundary 1: the holder's priority takes the card
        assert wait_until(h.granted, timeout=20), s.read("log")
        assert wait_until(lambda: s.status()["residency"] == "swapped", timeout=10)
        assert s.status()["memory_counted_on_card"] == str(4 * M), "its context reserve"
        before = int(gpu_memory(d)["resident_reserved"])
        if honest:
            show(p.pid, 4 * M)
            time.sleep(4.5)  # four checks
            assert "swapped out, pid" not in s.read("log"), s.read("log")
            assert s.status()["memory_counted_on_card"] == str(4 * M)
            assert int(gpu_memory(d)["resident_reserved"]) == before
        elif overrun == "kill":
            assert p.wait(timeout=15) == -signal.SIGKILL
            assert f"killed pid {p.pid} (--attach-overrun kill): the driver counts 254.0M" \
                in d.daemon_log(), d.daemon_log()
            assert "warning: swapped out" not in d.daemon_log()
            return
        else:
            assert wait_until(lambda: "warning: swapped out, pid" in s.read("log"), timeout=10)
            log = s.read("log")
            assert f"still holds 254.0M on gpu 0 by the driver's count" in log, log
            counted = int(s.status()["memory_counted_on_card"])
            usable = int(gpu_memory(d)["capacity"])  # 2 MiB-aligned here
            assert counted == min(254 * M, usable - (before - 4 * M)), (counted, usable, before)
            assert int(gpu_memory(d)["resident_reserved"]) == before - 4 * M + counted
            if counted < 254 * M:
                assert "more is past its need or the card's room" in log, log
        h.close()  # released, it would be asked to swap out for the program: it cannot
        h = None
        for k in (1, 2):
            assert p.stdout.readline().strip() == f"verified {k}"
        assert p.wait(timeout=20) == 0
    finally:
        if p and p.poll() is None:
            p.kill()
            p.wait()
        if h:
            h.close()
        s.close()
        d.stop()


# A program that attaches its own gate to the session named by argv[1] and waits.
GATE_PROGRAM = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
import salus_gate
g = salus_gate.Gate()
g.g.peak_bytes = int(sys.argv[3])  # as if it had once held that much through the shim
fd = os.open(sys.argv[1], os.O_WRONLY)
os.write(fd, g.attach_line().encode())
os.close(fd)
print("attached", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("overrun,peak_mib", [("warn", 0), ("kill", 0), ("kill", 250)])
def test_a_program_past_what_admission_counts_is_warned_about_or_killed(tmp_path, overrun,
                                                                        peak_mib):
    """--attach-overrun: a program (its own process) whose driver figure (the mock
    NVML: 300M) stays past its charge (0) and context reserve (64M) is warned
    about by default, and under `kill` SIGKILLed through its pidfd, its session
    ending as at any exit, with the reason in salusd's log. Not killed when its
    highest charge ever (250M) could explain the figure (NVML's sample may fall
    between an allocation and its free): warned about only."""
    nvml = os.environ.get("SALUS_TEST_NVML_MOCK_DIR", "")
    if not nvml:
        pytest.skip("built without the mock NVML")
    M = 1 << 20
    uuid = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"
    listing = tmp_path / "nvml"
    d = start_on_mock_cuda(["--attach-context-reserve", "64M", "--attach-overrun", overrun],
                           [MOCK_DIR, nvml],
                           {"MOCK_NVML_DEVICES": uuid, "MOCK_NVML_PROCESSES_FILE": str(listing)})
    s = Session(d)
    prog = None
    try:
        s.cmd("need persistent=100M ephemeral=0 gpu=0\n")
        client = os.path.join(HERE, "..", "..", "client")
        prog = subprocess.Popen([sys.executable, "-c", GATE_PROGRAM, s.file("ctl"), client,
                                 str(peak_mib * M)], stdout=subprocess.PIPE, text=True)
        assert prog.stdout.readline().strip() == "attached"
        tmp = tmp_path / "nvml.tmp"
        tmp.write_text(f"{uuid}:{prog.pid}:{300 * M}\n")
        os.rename(tmp, listing)
        if overrun == "kill" and peak_mib == 0:
            assert prog.wait(timeout=15) == -signal.SIGKILL
            assert wait_until(lambda: "(--attach-overrun kill): the driver counts 300.0M on gpu 0"
                              in d.daemon_log(), timeout=5), d.daemon_log()
            assert f"killed pid {prog.pid}" in d.daemon_log()
            assert wait_until(lambda: not os.path.exists(s.file("status")), timeout=5)
        else:
            assert wait_until(lambda: "warning: the driver counts 300.0M" in s.read("log"),
                              timeout=10)
            assert prog.poll() is None, "warn never kills"
            assert "attach-overrun kill" not in d.daemon_log()
    finally:
        if prog and prog.poll() is None:
            prog.kill()
            prog.wait()
        try:
            s.close()
        except OSError:
            pass
        d.stop()


def test_a_victim_that_never_comes_to_its_boundary_does_not_stop_every_swap():
    """A victim swaps out at its iteration boundary. An attached program that never
    comes to one (a notebook gone idle after a cell, a hung job) held up the residency
    planner for ever: no swapped session came back. Past --attach-hold-limit the
    planner goes on around it and the stuck session's log says so. 64M card at
    --oversubscribe 2: the holder (30M, granted, its iteration never done) is the
    least recently run, so the first victim; a hosted session Y (30M) runs on; W
    (30M) is admitted swapped and must get its 20 iterations, Y making the room."""
    from conftest import Salusd
    d = Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair",
                           "--attach-hold-limit", "1"], sim_memory="64M", gpus=1).start()
    h = None
    sessions = []
    try:
        h = Holder(d, persistent="30M")
        h.ask()
        assert wait_until(h.granted, timeout=5)
        y = Session(d)
        sessions.append(y)
        y.cmd("need persistent=30M ephemeral=0 gpu=0\n")
        y.cmd("begin\nspin 2000\nend x100000\n")
        assert wait_until(lambda: int(y.status().get("iterations_done", 0)) >= 5)
        w = Session(d)
        sessions.append(w)
        w.cmd("need persistent=30M ephemeral=0 gpu=0\n")
        w.cmd("begin\nspin 1000\nend x20\n")
        ok = wait_until(lambda: w.status().get("iterations_done") == "20", timeout=20)
        assert ok, (w.read("status"), h.s.read("log"))
        assert "still waiting for its iteration boundary" in h.s.read("log")
        assert int(y.status().get("swaps_out", 0)) >= 1, y.status()
    finally:
        for s in sessions:
            s.close()
        if h:
            h.close()
        d.stop()
