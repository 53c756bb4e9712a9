"""Attached sessions against a real salusd (sim backend): programs made of a
sealed memfd and an eventfd (client/salus_gate.py) attach through their
session's ctl and are granted iterations by salusd's policies."""
import ctypes
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import Session

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client"))
import salus_gate  # noqa: E402

PROGRAM = os.path.join(HERE, "gate_program.py")


def test_python_mirror_matches_the_header(tmp_path):
    src = tmp_path / "sizes.c"
    fields = ["granted", "quantum_ns", "swap_request", "swap_seq", "requested", "note",
              "swap_done_seq", "swap_state", "swap_result", "resident_bytes", "swapped_bytes",
              "swaps_out", "swaps_in", "swap_ns", "unswappable_bytes"]
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "client/salus_gate.h"\n'
                   'int main(void){printf("%zu\\n", sizeof(struct salus_gate));'
                   + "".join(f'printf("%zu\\n", offsetof(struct salus_gate, {f}));' for f in fields)
                   + 'return 0;}\n')
    exe = tmp_path / "sizes"
    cc = subprocess.run(["cc", "-I", os.path.join(HERE, "..", ".."), str(src), "-o", str(exe)],
                        capture_output=True, text=True)
    if cc.returncode != 0:
        pytest.skip("no C compiler: " + cc.stderr[-200:])
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    S = salus_gate.SalusGate
    assert [int(x) for x in got] == [salus_gate.SIZE] + [getattr(S, f).offset for f in fields]


def log_tail(s):
    return s.read("log").strip().splitlines()[-1]


def attach_error(s, line):
    with pytest.raises(OSError) as e:
        s.cmd(line)
    return e.value.errno, log_tail(s)


def test_bad_attach_inputs_get_clear_errors(salusd):
    s = Session(salusd)
    # Before need: no GPU yet.
    with salus_gate.Gate() as g:
        assert attach_error(s, g.attach_line())[0] == errno.ENXIO
        s.cmd("need persistent=1M ephemeral=1M\n")
    cases = [
        (dict(seals=0), errno.EINVAL, "F_SEAL_SHRINK|F_SEAL_GROW"),
        (dict(size=64, seals=salus_gate.F_SEAL_SHRINK | salus_gate.F_SEAL_GROW), errno.EINVAL,
         "exactly sizeof"),
        (dict(header=False), errno.EINVAL, "magic"),
    ]
    for kw, err, words in cases:
        with salus_gate.Gate(**kw) as g:
            got, line = attach_error(s, g.attach_line())
            assert got == err and words in line, (kw, line)
    assert attach_error(s, "attach gate=999 bell=998\n")[0] == errno.EBADF
    r, w = os.pipe()
    with salus_gate.Gate() as g:
        got, line = attach_error(s, f"attach gate={g.fd} bell={r}\n")
        assert got == errno.EINVAL and "not an eventfd" in line
        got, line = attach_error(s, f"attach gate={r} bell={g.bell}\n")
        assert got == errno.EINVAL and "not a memfd" in line
        with pytest.raises(OSError) as e:
            s.cmd("attach gate=1\n")
        assert e.value.errno == errno.EINVAL
        # The good one attaches; a second attach is EBUSY.
        s.cmd(g.attach_line())
        assert g.g.state == salus_gate.ATTACHED
        st = s.status()
        assert st["kind"] == "attached" and st["pid"] == str(os.getpid())
        assert st["memory_budget"] == str(2 << 20)
        # salusctl shows the kind (and the policy file the fallback slice).
        from conftest import SALUSD
        salusctl = os.path.join(os.path.dirname(os.path.abspath(SALUSD)), "salusctl")
        if os.access(salusctl, os.X_OK):
            out = subprocess.run([salusctl, "--mount", salusd.mnt, "sessions"], check=True,
                                 capture_output=True, text=True).stdout
            header, row = out.splitlines()[0].split(), [
                l.split() for l in out.splitlines()[1:] if l.split()[:1] == [s.id]][0]
            assert row[header.index("KIND")] == "attached"
        with open(salusd.path("policy")) as f:
            assert "quantum_ms: 50\n" in f.read()
        got, line = attach_error(s, g.attach_line())
        assert got == errno.EBUSY and "already attached" in line
        got, line = attach_error(s, "begin\nspin 10\nend\n")
        assert got == errno.EINVAL and "attached" in line
        os.close(s.fd)  # the session ends: the program is let go
        deadline = time.time() + 2
        while g.g.state != salus_gate.DETACHED and time.time() < deadline:
            time.sleep(0.01)
        assert g.g.state == salus_gate.DETACHED
    os.close(r)
    os.close(w)


def test_admission_counts_each_attached_programs_context_reserve(salusd_factory, tmp_path):
    """The card memory a program's own CUDA context takes is counted with its
    need ([attach] context_reserve); its budget is still the need."""
    cfg = tmp_path / "salusd.toml"
    cfg.write_text('[attach]\ncontext_reserve = "64M"\n')
    d = salusd_factory(extra_args=["--config", str(cfg)], sim_memory="256M", gpus=1).start()
    a, b = Session(d), Session(d)
    with salus_gate.Gate() as ga, salus_gate.Gate() as gb:
        # 100M + 64M and 64M + 64M do not fit 256M together; 100M and 64M would.
        a.cmd("need persistent=100M ephemeral=0 gpu=0\n")
        a.cmd(ga.attach_line())
        b.cmd("need persistent=64M ephemeral=0 gpu=0\n")
        b.cmd(gb.attach_line())
        st = a.status()
        assert st["state"] == "admitted" and b.status()["state"] == "queued"
        assert st["memory_budget"] == str(100 << 20)
        assert st["memory_context_reserve"] == str(64 << 20)
        assert st["memory_context"] == "-", "the sim backend has no driver figure"
        assert "64.0M for the program's CUDA context" in a.read("log")
        os.close(a.fd)
        deadline = time.time() + 5
        while b.status()["state"] != "admitted" and time.time() < deadline:
            time.sleep(0.02)
        assert b.status()["state"] == "admitted"


def run_pair(salusd, policy, a_need, b_need, iters, iter_ms, tmp_path):
    with open(salusd.path("policy"), "w") as f:
        f.write(policy + "\n")
    order = tmp_path / f"order-{policy}"
    order.write_text("")
    sessions, progs = [], []
    try:
        for name, need, n in (("A", a_need, iters[0]), ("B", b_need, iters[1])):
            s = Session(salusd)
            s.cmd(need + "\n")
            go = tmp_path / f"go-{policy}-{name}"
            p = subprocess.Popen([sys.executable, PROGRAM, s.file("ctl"), name, str(n),
                                  str(iter_ms), str(order), str(go)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "attached"
            sessions.append(s)
            progs.append((p, go))
        # A starts; B asks once A holds the GPU, so the policy decides every switch.
        progs[0][1].write_text("")
        deadline = time.time() + 5
        while "A1" not in order.read_text():
            assert time.time() < deadline, "A was never granted"
            time.sleep(0.001)
        progs[1][1].write_text("")
        for p, _ in progs:
            assert p.stdout.readline().strip() == "done"
        for s, n in zip(sessions, iters):
            deadline = time.time() + 5
            while s.status()["iterations_done"] != str(n):
                assert time.time() < deadline, s.status()
                time.sleep(0.01)
            assert s.status()["kind"] == "attached"
        got = order.read_text().split()
        for p, _ in progs:
            p.stdin.close()
            assert p.wait(10) == 0
        return got
    finally:
        for p, _ in progs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in sessions:
            os.close(s.fd)


def test_two_programs_interleave_under_fifo_fair_and_srtf(salusd, tmp_path):
    need = "need persistent=16M ephemeral=16M gpu=0"
    got = run_pair(salusd, "fifo", need, need, (4, 4), 20, tmp_path)
    assert got == ["A1", "A2", "A3", "A4", "B1", "B2", "B3", "B4"]
    got = run_pair(salusd, "fair", need, need, (4, 4), 20, tmp_path)
    assert got == ["A1", "B1", "A2", "B2", "A3", "B3", "A4", "B4"]
    got = run_pair(salusd, "srtf", need + " iters=6", need + " iters=2", (6, 2), 10, tmp_path)
    assert got == ["A1", "B1", "B2", "A2", "A3", "A4", "A5", "A6"]


def test_sigkill_of_a_program_ends_its_session_within_a_second(salusd, tmp_path):
    with open(salusd.path("gpus", "0", "memory")) as f:
        before = f.read()
    s = Session(salusd)
    s.cmd("need persistent=300M ephemeral=100M gpu=0\n")
    order = tmp_path / "order"
    order.write_text("")
    p = subprocess.Popen([sys.executable, PROGRAM, s.file("ctl"), "K", "100000", "5", str(order)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "attached"
        deadline = time.time() + 5
        while "K3" not in order.read_text():
            assert time.time() < deadline
            time.sleep(0.005)
        assert s.status()["pid"] == str(p.pid)
        with open(salusd.path("gpus", "0", "memory")) as f:
            assert f.read() != before  # its 400M are counted
        p.send_signal(signal.SIGKILL)
        p.wait()
        t0 = time.time()
        while os.path.exists(s.file("status")) and time.time() - t0 < 3:
            time.sleep(0.01)
        assert time.time() - t0 < 1.0
        assert not os.path.exists(s.file("status"))
        with open(salusd.path("gpus", "0", "memory")) as f:
            assert f.read() == before  # nothing of it is left
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(s.fd)


def test_an_iteration_past_the_hold_limit_lets_the_lane_go_on(salusd_factory):
    """`salusd --attach-hold-limit`: a program granted an iteration that never
    comes to its boundary holds its lane only that long while another waits."""
    d = salusd_factory(extra_args=["--attach-hold-limit", "0.5"], sim_memory="256M",
                       gpus=1).start()
    a, b = Session(d), Session(d)
    with salus_gate.Gate() as ga, salus_gate.Gate() as gb:
        for s, g in ((a, ga), (b, gb)):
            s.cmd("need persistent=8M ephemeral=0 gpu=0\n")
            s.cmd(g.attach_line())
            g.g.marking = 1  # explicit boundaries: no slice asks it to yield
        ga.g.requested = 1
        ga.ring()
        deadline = time.time() + 5
        while ga.g.granted < 1:
            assert time.time() < deadline, "a was never granted"
            time.sleep(0.005)
        asked = time.time()
        gb.g.requested = 1
        gb.ring()
        while gb.g.granted < 1:
            assert time.time() < asked + 5, "b still waits behind a's iteration"
            time.sleep(0.005)
        assert time.time() - asked >= 0.3, "b was granted before a's hold limit"
        st = a.status()
        assert st["hold_limit_releases"] == "1" and st["in_flight"] == "1", st
        assert "has held the lane for 0 s (salusd --attach-hold-limit)" in a.read("log")
        assert f"session {a.id} (pid {os.getpid()}): iteration 1 has held" in d.daemon_log()
        assert b.status()["hold_limit_releases"] == "0"
