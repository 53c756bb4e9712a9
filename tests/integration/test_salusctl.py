"""salusctl against a real salusd: the tables of status/sessions/show, the admin
commands (kill, policy, drain, undrain), top --once and the live view, run, the
--explain output (which must do the same thing when fed to sh), and exit codes and
messages on errors."""
import errno
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import time

import pytest

from conftest import SALUSD, Session, wait_until

SALUSCTL = os.environ.get("SALUSCTL") or os.path.join(os.path.dirname(os.path.abspath(SALUSD)),
                                                      "salusctl")
NOBODY = 65534


@pytest.fixture(autouse=True, scope="module")
def need_salusctl():
    if not os.access(SALUSCTL, os.X_OK):
        pytest.fail(f"salusctl not built at {SALUSCTL} (ninja -C build tools/salusctl)")


def ctl(d, *args, env=None, timeout=60, mount=True):
    argv = [SALUSCTL, *(["--mount", d.mnt] if mount else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def as_nobody(argv, **kw):
    if os.geteuid() != 0:
        pytest.skip("switching to uid 65534 needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *argv], capture_output=True, text=True, timeout=60, **kw)


def named(d, name, need="need persistent=8M ephemeral=16M\n"):
    os.mkdir(d.path("sessions", name))
    if need:
        with open(d.path("sessions", name, "ctl"), "w") as f:
            f.write(need)
    return d.path("sessions", name)


def row(text, first, second=None):
    """The whitespace-split table row whose first (and second) cells match."""
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] == first and (second is None or (len(cells) > 1 and cells[1] == second)):
            return cells
    raise AssertionError(f"no row {first} {second or ''} in:\n{text}")


# ---------------------------------------------------------------- read-only views

def test_status_tables(salusd):
    named(salusd, "train1", "need persistent=8M ephemeral=16M iters=100 gpu=1\n")
    s = Session(salusd)
    s.cmd("need persistent=4M ephemeral=32M gpu=0\nalloc w 1M\n")
    r = ctl(salusd, "status")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("salusd ") and "policy fair" in out
    for title in ("GPUS", "LANES", "SESSIONS"):
        assert f"\n{title}\n" in out
    gpus = out.split("\nGPUS\n")[1].split("\n\n")[0]
    assert gpus.splitlines()[0].split()[:3] == ["GPU", "NAME", "BACKEND"]
    assert "Salus simulated GPU" in gpus and len(gpus.splitlines()) == 3
    g0 = gpus.splitlines()[1]
    assert g0.split()[0] == "0" and g0.split()[-2:] == ["no", "-"]   # not draining, not idle
    assert " 1G " in g0                                                 # capacity, human
    lanes = out.split("\nLANES\n")[1].split("\n\n")[0]
    assert row(lanes, "0")[3] == "32M" and row(lanes, "1")[3] == "16M"
    sessions = out.split("\nSESSIONS\n")[1]
    t = row(sessions, "1", "train1")
    assert t[3] == "admitted" and t[4] == "1" and t[10] == "100"        # state, gpu, iters
    c = row(sessions, s.id, s.id)
    assert c[3] == "admitted" and c[4] == "0" and c[7] == "4M"
    # --bytes prints exact sizes
    r = ctl(salusd, "--bytes", "sessions")
    assert row(r.stdout, s.id)[7] == str(4 << 20)
    s.close()


def test_status_shows_attached_programs(salusd):
    """The ATTACHED table: an attached program's pid, budget and charge beside the
    driver's figure (none on sim) and the context reserve; absent with no program."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client"))
    import salus_gate
    s = Session(salusd)
    s.cmd("need persistent=8M ephemeral=0 gpu=0\n")
    assert "\nATTACHED\n" not in ctl(salusd, "status").stdout
    with salus_gate.Gate() as g:
        s.cmd(g.attach_line())
        g.g.charged_bytes = 3 << 20
        g.g.peak_bytes = 5 << 20
        out = ctl(salusd, "status").stdout
        attached = out.split("\nATTACHED\n")[1]
        assert attached.splitlines()[0].split()[:4] == ["ID", "PID", "GPU", "BUDGET"], attached
        assert row(attached, s.id)[1:12] == [str(os.getpid()), "0", "8M", "3M", "5M", "-", "-",
                                             "0", "-", "resident", "8M"], attached
        assert row(attached, s.id)[14:] == ["0.000", "-"], attached  # no lane held yet
        # One iteration that holds the lane 200 ms and reports 50 ms of device time:
        # HELD_MS is salusd's measure, BUSY% the report over it.
        g.g.requested = 1
        g.ring()
        assert wait_until(lambda: g.g.granted >= 1, 5)
        time.sleep(0.2)
        g.g.gpu_ns_total = 50_000_000
        g.g.completed = 1
        g.ring()
        assert wait_until(lambda: s.status()["iterations_done"] == "1", 5)
        cells = row(ctl(salusd, "status").stdout.split("\nATTACHED\n")[1], s.id)
        assert 200.0 <= float(cells[14]) < 2000.0, cells
        assert 2 <= int(cells[15]) <= 25, cells
    s.close()


def test_sessions_columns_line_up(salusd):
    named(salusd, "a-rather-long-session-name")
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M\n")
    r = ctl(salusd, "sessions")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[0] == "ID" and len(lines) == 3
    # Every column starts at the same offset in each line (aligned table).
    state_col = lines[0].index("STATE")
    for line in lines[1:]:
        assert line[state_col:].startswith("admitted"), r.stdout
    s.close()
    assert wait_until(lambda: s.id not in ctl(salusd, "sessions").stdout.split())


def test_show_prints_status_and_log(salusd):
    named(salusd, "job")
    r = ctl(salusd, "show", "job")
    assert r.returncode == 0, r.stderr
    assert "name: job\n" in r.stdout and "state: admitted\n" in r.stdout
    assert f"log ({salusd.path('sessions', 'job', 'log')}):" in r.stdout
    assert "session job created by uid 0" in r.stdout


def test_show_missing_session_names_the_session(salusd):
    # Not "sessions/nosuch/status: No such file or directory", which reads as a
    # broken tree.
    r = ctl(salusd, "show", "nosuch")
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr == "salusctl: show nosuch: no session nosuch (salusctl sessions lists them)\n"


def test_other_users_sessions_show_as_denied(salusd):
    named(salusd, "roots")
    r = as_nobody([SALUSCTL, "--mount", salusd.mnt, "sessions"])
    assert r.returncode == 0, r.stderr
    cells = row(r.stdout, "-", "roots")
    assert cells[2:4] == ["0", "no-access"]       # uid from metrics, state unreadable
    r = as_nobody([SALUSCTL, "--mount", salusd.mnt, "show", "roots"])
    assert r.returncode == 1 and "Permission denied" in r.stderr
    assert salusd.path("sessions", "roots", "status") in r.stderr


# ---------------------------------------------------------------- admin

def test_kill_ends_a_session(salusd):
    named(salusd, "victim")
    r = ctl(salusd, "kill", "victim")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "killed victim\n"
    assert "victim" not in os.listdir(salusd.path("sessions"))
    # It must not read as if ctl itself were missing.
    r = ctl(salusd, "kill", "victim")
    assert r.returncode == 1
    assert r.stderr == "salusctl: kill victim: no session victim (ENOENT)\n", r.stderr
    r = ctl(salusd, "kill", "99")
    assert r.returncode == 1
    assert r.stderr == "salusctl: kill 99: no session 99 (ENOENT)\n", r.stderr


def test_a_refused_ctl_line_answers_with_its_reason(salusd):
    # The reply and the daemon log both carry the reason, with the valid words.
    cases = [("kill 99", "ENOENT", "no session 99"),
             ("kill", "EINVAL", "kill takes one session id or name: kill S"),
             ("drain 7", "ENODEV", "no GPU 7 (salusd has 2, from 0)"),
             ("drain zero", "EINVAL", "drain zero: not a GPU index"),
             ("queue fast", "EINVAL", "queue takes one word: queue strict or queue bypass"),
             ("placement far", "EINVAL", "placement takes one of magm, lug, rr or exclusive"),
             ("frobnicate", "EINVAL", "unknown command 'frobnicate'; expected kill S, drain N, "
                                      "undrain N, queue strict|bypass, placement P or swap out|in S")]
    for line, name, why in cases:
        fd = os.open(salusd.path("ctl"), os.O_RDWR)
        try:
            with pytest.raises(OSError) as e:
                os.write(fd, (line + "\n").encode())
            assert errno_name(e.value.errno) == name, line
            assert os.read(fd, 4096).decode() == f"error {name}: {why}\n"
        finally:
            os.close(fd)
        assert f"ctl: '{line}' failed: {why} ({name})" in salusd.daemon_log()


def errno_name(err):
    return errno.errorcode[err]


def test_a_rejected_policy_lists_the_valid_words(salusd):
    cases = [("sjf", "unknown policy 'sjf'; expected fifo, pack, srtf, fair or priority"),
             ("fair placement=far", "placement 'far': expected magm, lug, rr or exclusive"),
             ("fair queue=fast", "queue 'fast': expected strict or bypass"),
             ("fair quantum_ms=0", "quantum_ms '0': expected 1 to 3600000"),
             ("fair colour=red", "unknown key 'colour'; expected placement=, queue=, quantum_ms=, oversubscribe= or fair_share="),
             ("fair pack", "'pack' after the policy name is not key=value (placement=, queue=, "
                           "quantum_ms=, oversubscribe= or fair_share=); write one setting per write")]
    for text, why in cases:
        with pytest.raises(OSError) as e:
            with open(salusd.path("policy"), "w") as f:
                f.write(text + "\n")
        assert errno_name(e.value.errno) == "EINVAL", text
        assert f"policy: rejected '{text}': {why}" in salusd.daemon_log(), salusd.daemon_log()
    r = ctl(salusd, "policy", "sjf")
    assert r.returncode == 1 and "fifo, pack, srtf, fair or priority" in r.stderr


def test_kill_a_clone_session(salusd):
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M\n")
    assert ctl(salusd, "kill", s.id).returncode == 0
    assert wait_until(lambda: s.id not in os.listdir(salusd.path("sessions")))
    with pytest.raises(OSError):
        s.cmd("spin 1\n")
    s.close()


def test_admin_commands_denied_to_other_users(salusd):
    named(salusd, "keep")
    for args in (["kill", "keep"], ["drain", "0"], ["policy", "pack"]):
        r = as_nobody([SALUSCTL, "--mount", salusd.mnt, *args])
        assert r.returncode == 1, args
        assert "Permission denied" in r.stderr, r.stderr
        assert "only root and members of salusd's --admin-group may do this" in r.stderr
        path = salusd.path("policy" if args[0] == "policy" else "ctl")
        assert path in r.stderr
    assert "keep" in os.listdir(salusd.path("sessions"))
    r = as_nobody([SALUSCTL, "--mount", salusd.mnt, "policy"])  # reading is for everyone
    assert r.returncode == 0 and "policy: fair" in r.stdout


def test_policy_read_and_switch(salusd):
    r = ctl(salusd, "policy")
    assert r.returncode == 0 and r.stdout.startswith("policy: fair\n")
    r = ctl(salusd, "policy", "pack", "placement=lug")
    assert r.returncode == 0, r.stderr
    assert "policy: pack\n" in r.stdout and "placement: lug\n" in r.stdout
    # key=value alone keeps the policy's name
    r = ctl(salusd, "policy", "queue=strict")
    assert r.returncode == 0, r.stderr
    assert "policy: pack\n" in r.stdout and "queue: strict\n" in r.stdout
    with open(salusd.path("policy")) as f:
        assert f.read() == r.stdout
    assert "fair_share: user\n" in r.stdout  # salusd's default
    r = ctl(salusd, "policy", "fair", "fair_share=session")
    assert r.returncode == 0 and "fair_share: session\n" in r.stdout, r.stderr
    r = ctl(salusd, "policy", "pack")
    assert "fair_share: session\n" in r.stdout  # kept until written again
    r = ctl(salusd, "policy", "fair_share=user-across-lanes")
    assert r.returncode == 0 and "fair_share: user-across-lanes\n" in r.stdout, r.stderr
    for bad in (["nonsense"], ["fifo", "bogus=1"], ["fifo", "placement=nowhere"],
                ["fifo", "fair_share=everyone"]):
        r = ctl(salusd, "policy", *bad)
        assert r.returncode == 1, bad
        assert salusd.path("policy") in r.stderr and "Invalid argument" in r.stderr
    assert ctl(salusd, "policy").stdout.startswith("policy: pack\n")


def test_drain_and_undrain(salusd):
    r = ctl(salusd, "drain", "0")
    assert r.returncode == 0 and r.stdout == "gpu 0 draining\n", r.stderr
    with open(salusd.path("gpus", "0", "info")) as f:
        assert "draining: yes" in f.read()
    assert row(ctl(salusd, "status").stdout.split("\nGPUS\n")[1], "0")[-2] == "yes"
    # New sessions go elsewhere.
    for _ in range(3):
        s = Session(salusd)
        s.cmd("need persistent=1M ephemeral=1M\n")
        assert s.status()["gpu"] == "1"
        s.close()
    r = ctl(salusd, "undrain", "0")
    assert r.returncode == 0 and r.stdout == "gpu 0 in service\n"
    with open(salusd.path("gpus", "0", "info")) as f:
        assert "draining: no" in f.read()
    r = ctl(salusd, "drain", "7")
    assert r.returncode == 1 and r.stderr == "salusctl: drain 7: no GPU 7 (salusd has 2, from 0) (ENODEV)\n"
    r = ctl(salusd, "drain", "zero")
    assert r.returncode == 2 and r.stderr


# ---------------------------------------------------------------- top

def busy_session(d, gpu, usec=2000, n=5000):
    s = Session(d)
    s.cmd(f"need persistent=1M ephemeral=4M gpu={gpu}\n")
    s.cmd(f"begin\nspin {usec}\nend x{n}\n")
    return s


def test_top_once_shows_rates(salusd):
    s = busy_session(salusd, 1)
    r = ctl(salusd, "top", "--once", "--interval", "0.5")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    head = r.stdout.splitlines()
    assert head[0].startswith("salus top at ") and "policy fair" in head[0]
    g = [l for l in head if l.split()[:1] == ["GPU"] and "BUSY%" in l][0]
    cols = g.split()
    gpus = {}
    for line in head[head.index(g) + 1:]:
        if not line.strip():
            break
        gpus[line.split()[0]] = line
    busy_col = cols.index("BUSY%")
    # Name "Salus simulated GPU" is three words: shift by two.
    busy1 = float(gpus["1"].split()[busy_col + 2])
    busy0 = float(gpus["0"].split()[busy_col + 2])
    assert busy1 > 50 and busy0 < 5, r.stdout
    header = [l for l in head if l.startswith("ID ")][0]
    sess = header.split()
    cells = row("\n".join(head[head.index(header):]), s.id, s.id)
    rate = float(cells[sess.index("ITER/S")])
    assert 50 < rate < 1000, r.stdout           # 2 ms spins: about 500/s
    assert float(cells[sess.index("SHARE%")]) == 100.0
    assert 50 < float(cells[sess.index("GPU%")]) <= 105
    s.close()


def test_top_live_refreshes_in_place(salusd):
    s = busy_session(salusd, 0, usec=1000)
    master, slave = pty.openpty()
    p = subprocess.Popen([SALUSCTL, "--mount", salusd.mnt, "top", "--interval", "0.1"],
                         stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    try:
        deadline = time.time() + 1.5
        while time.time() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                out += os.read(master, 65536)
        p.send_signal(signal.SIGINT)
        assert p.wait(10) == 0
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
        s.close()
    text = out.decode(errors="replace")
    assert text.startswith("\x1b[?25l\x1b[H\x1b[2J")       # hide cursor, clear once
    assert text.count("\x1b[H") >= 4                       # then redraw in place
    assert text.count("\x1b[2J") == 1
    assert "BUSY%" in text and "ITER/S" in text
    assert text.rstrip().endswith("\x1b[?25h")             # cursor back on exit


# ---------------------------------------------------------------- run

def test_run_creates_a_named_session_and_returns_the_status(salusd):
    r = ctl(salusd, "run", "--persistent", "1M", "--ephemeral", "4M", "--iters", "5",
            "--priority", "3", "--", "sh", "-c",
            'cat "$SALUS_SESSION/status"; echo "mount=$SALUS_MOUNT"; echo "need=$SALUS_NEED";'
            'printf "begin\\nspin 100\\nend x5\\n" > "$SALUS_SESSION/ctl"; exit 7')
    assert r.returncode == 7, r.stderr
    assert "need=persistent=1M ephemeral=4M iters=5 priority=3\n" in r.stdout, r.stdout
    st = dict(l.split(": ", 1) for l in r.stdout.splitlines() if ": " in l)
    assert re.fullmatch(r"run-\d+", st["name"])
    assert st["persistent"] == str(1 << 20) and st["ephemeral"] == str(4 << 20)
    assert st["iters"] == "5" and st["priority"] == "3"
    assert f"mount={salusd.mnt}" in r.stdout
    assert os.listdir(salusd.path("sessions")) == []
    r = ctl(salusd, "run", "-v", "--persistent", "1M", "--ephemeral", "4M", "--", "sh", "-c",
            'printf "begin\\nspin 100\\nend x5\\n" > "$SALUS_SESSION/ctl"')
    assert r.returncode == 0
    assert "done 5" in r.stderr
    assert os.listdir(salusd.path("sessions")) == []


def test_run_without_need_lets_the_command_declare(salusd):
    r = ctl(salusd, "run", "--name", "mine", "--", "sh", "-c",
            'grep state "$SALUS_SESSION/status"; echo "need persistent=0 ephemeral=1M" > '
            '"$SALUS_SESSION/ctl" && grep state "$SALUS_SESSION/status"; '
            'echo "need=${SALUS_NEED-unset}"')
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["state:", "idle", "state:", "admitted", "need=unset"]
    assert "mine" not in os.listdir(salusd.path("sessions"))


def test_run_errors(salusd):
    r = ctl(salusd, "run", "--", "/nonexistent/program")
    assert r.returncode == 127 and "/nonexistent/program: No such file or directory" in r.stderr
    r = ctl(salusd, "run", "--persistent", "100G", "--ephemeral", "1M", "--", "true")
    assert r.returncode == 1
    assert "/ctl: Cannot allocate memory" in r.stderr and "need persistent=100G" in r.stderr
    assert "fits no GPU" in r.stderr      # salusd's reason, from the session log
    named(salusd, "taken", None)
    r = ctl(salusd, "run", "--name", "taken", "--", "true")
    assert r.returncode == 1 and "File exists" in r.stderr
    assert os.listdir(salusd.path("sessions")) == ["taken"]
    r = ctl(salusd, "run")
    assert r.returncode == 2


def test_a_user_cannot_raise_a_priority_past_the_most_but_root_can(salusd):
    # salusd's default --user-priority-max is 0: under the priority policy a user
    # could otherwise put their jobs ahead of everyone's.
    need = ["run", "--persistent", "1M", "--ephemeral", "1M"]
    r = as_nobody([SALUSCTL, "--mount", salusd.mnt, *need, "--priority", "3", "--", "true"])
    assert r.returncode == 1, r.stderr
    assert "/ctl: Permission denied" in r.stderr
    assert "priority 3: a user may set at most 0 (salusd --user-priority-max 0" in r.stderr
    r = as_nobody([SALUSCTL, "--mount", salusd.mnt, *need, "--priority", "-2", "--", "sh", "-c",
                   'grep "^priority" "$SALUS_SESSION/status"'])
    assert r.returncode == 0 and r.stdout == "priority: -2\n", r.stdout + r.stderr
    r = ctl(salusd, *need, "--priority", "3", "--", "sh", "-c",
            'grep "^priority" "$SALUS_SESSION/status"')
    assert r.returncode == 0 and r.stdout == "priority: 3\n", r.stdout + r.stderr
    assert os.listdir(salusd.path("sessions")) == []


def test_run_cleans_up_on_sigterm(salusd):
    p = subprocess.Popen([SALUSCTL, "--mount", salusd.mnt, "run", "--persistent", "1M",
                          "--ephemeral", "1M", "--", "sleep", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [f"run-{p.pid}"], 5)
        p.send_signal(signal.SIGTERM)   # passed on to the command
        assert p.wait(10) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert os.listdir(salusd.path("sessions")) == []


def test_run_interrupted_while_waiting_removes_the_session(salusd):
    p = subprocess.Popen([SALUSCTL, "--mount", salusd.mnt, "run", "--persistent", "1M",
                          "--ephemeral", "1M", "--", "sh", "-c",
                          'printf "begin\\nspin 50000\\nend x1000\\n" > "$SALUS_SESSION/ctl"'],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        name = f"run-{p.pid}"
        assert wait_until(lambda: os.path.exists(salusd.path("sessions", name, "status")) and
                          int(open(salusd.path("sessions", name, "status")).read()
                              .split("iterations_done: ")[1].split()[0]) > 0, 10)
        p.send_signal(signal.SIGINT)    # salusctl is in `cat wait` now
        assert p.wait(10) == 128 + signal.SIGINT
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [], 5)


# ---------------------------------------------------------------- --explain

def sh(script, **kw):
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60,
                          **kw)


def test_explain_prints_commands_that_do_the_same(salusd):
    named(salusd, "victim")
    r = ctl(salusd, "--explain", "kill", "victim")
    assert r.returncode == 0
    assert r.stdout == f"echo 'kill victim' > {salusd.path('ctl')}\n"
    assert "victim" in os.listdir(salusd.path("sessions"))     # nothing ran
    assert sh(r.stdout).returncode == 0
    assert "victim" not in os.listdir(salusd.path("sessions"))

    r = ctl(salusd, "--explain", "drain", "1")
    assert sh(r.stdout).returncode == 0
    with open(salusd.path("gpus", "1", "info")) as f:
        assert "draining: yes" in f.read()
    assert sh(ctl(salusd, "undrain", "1", "--explain").stdout).returncode == 0
    with open(salusd.path("gpus", "1", "info")) as f:
        assert "draining: no" in f.read()

    r = ctl(salusd, "--explain", "policy", "srtf", "placement=rr")
    assert "echo 'srtf placement=rr' > " in r.stdout
    out = sh(r.stdout)
    assert out.returncode == 0 and out.stdout.startswith("policy: srtf\n")
    out = sh(ctl(salusd, "--explain", "policy", "queue=strict").stdout)
    assert out.returncode == 0 and "policy: srtf\n" in out.stdout and "queue: strict" in out.stdout

    named(salusd, "shown")
    out = sh(ctl(salusd, "--explain", "show", "shown").stdout)
    assert "name: shown" in out.stdout and "created by uid 0" in out.stdout
    out = sh(ctl(salusd, "--explain", "status").stdout)
    assert out.returncode == 0 and "capacity: " in out.stdout and "name: shown" in out.stdout
    out = sh(ctl(salusd, "--explain", "sessions").stdout)
    assert "name: shown" in out.stdout
    r = ctl(salusd, "--explain", "top")
    assert r.returncode == 0 and "metrics" in r.stdout and "sleep 1" in r.stdout


def test_explain_run_is_a_working_script(salusd):
    r = ctl(salusd, "--explain", "run", "--persistent", "1M", "--ephemeral", "2M", "--", "sh",
            "-c", 'grep -E "^(name|ephemeral):" "$SALUS_SESSION/status"; exit 3')
    assert r.returncode == 0
    assert os.listdir(salusd.path("sessions")) == []          # nothing ran
    out = sh(r.stdout)
    assert out.returncode == 3, out.stderr
    assert re.search(r"^name: run-\d+$", out.stdout, re.M)
    assert f"ephemeral: {2 << 20}" in out.stdout
    assert os.listdir(salusd.path("sessions")) == []


def table_names(text, title):
    """The NAME column of the table under `title` (or of the only table)."""
    if title:
        text = text.split(f"\n{title}\n")[1].split("\n\n")[0]
    lines = text.strip().splitlines()
    header = lines[0].split()
    if "NAME" not in header:
        return set()
    return {l.split()[header.index("NAME")] for l in lines[1:] if l.strip() and "(none)" not in l}


def file_names(text):
    """Session names in cat'ed status files: the `name:` right after an `id:`
    (a GPU's info has a `name:` too)."""
    lines = text.splitlines()
    return {l.split(": ", 1)[1] for prev, l in zip([""] + lines, lines)
            if prev.startswith("id: ") and l.startswith("name: ")}


def run_both(d, *args, timeout=20):
    """The command's own result and its --explain script's result run by sh."""
    own = ctl(d, *args)
    script = ctl(d, "--explain", *args).stdout
    try:
        by_sh = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"--explain {' '.join(args)} never ends:\n{script}")
    assert by_sh.returncode == own.returncode, (args, script, by_sh.stderr)
    assert by_sh.stderr == "", (args, script, by_sh.stderr)
    return own, by_sh


def test_every_explain_script_runs_and_shows_what_the_command_shows(salusd):
    # With no session at all (a glob that matches nothing) ...
    own, by_sh = run_both(salusd, "status")
    assert own.returncode == 0
    assert table_names(own.stdout, "SESSIONS") == file_names(by_sh.stdout) == set()
    gpus = len(os.listdir(salusd.path("gpus")))
    assert by_sh.stdout.splitlines().count("name: Salus simulated GPU") == gpus
    assert own.stdout.split("\nGPUS\n")[1].split("\n\n")[0].count("Salus simulated GPU") == gpus
    own, by_sh = run_both(salusd, "sessions")
    assert own.returncode == 0 and by_sh.stdout == ""
    own, by_sh = run_both(salusd, "top", "--once", "--interval", "0.2")
    assert own.returncode == 0 and "salus_gpu_busy_seconds_total" in by_sh.stdout
    # ... and with two.
    named(salusd, "alpha")
    named(salusd, "beta", "need persistent=4M ephemeral=8M gpu=1\n")
    own, by_sh = run_both(salusd, "status")
    assert table_names(own.stdout, "SESSIONS") == file_names(by_sh.stdout) == {"alpha", "beta"}
    own, by_sh = run_both(salusd, "sessions")
    assert table_names(own.stdout, None) == file_names(by_sh.stdout) == {"alpha", "beta"}
    own, by_sh = run_both(salusd, "show", "beta")
    assert "name: beta" in own.stdout and "name: beta" in by_sh.stdout
    own, by_sh = run_both(salusd, "top", "--once", "--interval", "0.2")
    for name in ("alpha", "beta"):
        assert name in own.stdout and f"sessions/{name}" in by_sh.stdout
    own, by_sh = run_both(salusd, "policy")
    assert own.stdout == by_sh.stdout
    # Commands that change something are run both ways in
    # test_explain_prints_commands_that_do_the_same and test_explain_run_is_a_working_script.


# ---------------------------------------------------------------- usage and environment

def test_usage_errors_exit_2(salusd):
    for args in ([], ["bogus"], ["status", "--nope"], ["show"], ["top", "--interval", "0"],
                 ["kill"], ["run", "--iters", "x", "--", "true"]):
        r = ctl(salusd, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr
    r = ctl(salusd, "--help")
    assert r.returncode == 0 and "status" in r.stdout and "--explain" in r.stdout
    r = ctl(salusd, "--version", mount=False)
    assert r.returncode == 0 and r.stdout.startswith("salusctl ")


def test_no_daemon_at_the_mount(tmp_path):
    r = subprocess.run([SALUSCTL, "--mount", str(tmp_path), "status"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1
    assert f"{tmp_path}/version: No such file or directory" in r.stderr
    assert "no salusd is mounted" in r.stderr


def test_mount_from_environment(salusd):
    env = dict(os.environ, SALUS_MOUNT=salusd.mnt)
    named(salusd, "envjob")
    r = ctl(salusd, "sessions", env=env, mount=False)
    assert r.returncode == 0 and row(r.stdout, "1", "envjob")


def test_run_killed_at_any_moment_leaves_no_session(salusd):
    """A SIGTERM that lands anywhere in `salusctl run` (before the session exists,
    while `need` is written, around the fork) never leaves the session behind:
    salusctl takes signals from before its mkdir and passes them on."""
    for k in range(40):
        p = subprocess.Popen([SALUSCTL, "--mount", salusd.mnt, "run", "--persistent", "1M",
                              "--ephemeral", "1M", "--", "sleep", "30"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep((k % 20) * 0.0005)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [], 2), \
            (k, os.listdir(salusd.path("sessions")))
