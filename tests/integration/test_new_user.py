"""What a new user ran into (issue 18): a restart right after salusd was killed
must name the dead mount and its cure, and a mistyped `end` must say that the
recording is still open instead of silently recording what follows."""
import errno
import os
import re
import signal
import subprocess

import pytest

from conftest import Session, is_mounted, wait_until


def test_a_start_right_after_a_sigkill_names_the_dead_mount_and_the_cure(salusd_factory):
    d = salusd_factory().start()
    # What any user's `ls` leaves behind: the root's attributes cached by the
    # kernel, so that stat keeps succeeding on the dead mount for a while.
    os.listdir(d.mnt)
    os.stat(d.mnt)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert is_mounted(d.mnt)
    mnt = os.path.realpath(d.mnt)
    r = subprocess.run(d.args, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stderr
    assert (f"salusd: mountpoint {mnt} is busy: a dead FUSE mount is there; "
            f"run `fusermount3 -u {mnt}`") in r.stderr, r.stderr
    # The cure it names works, and salusd then starts on the same mount.
    subprocess.run(["fusermount3", "-u", mnt], check=True, timeout=30)
    d.start()
    assert os.path.exists(d.path("version"))


def test_a_live_salusd_on_the_mount_is_still_called_another_salusd(salusd):
    r = subprocess.run(salusd.args, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "something is already mounted there (another salusd?)" in r.stderr, r.stderr


def last_log_line(s):
    return s.read("log").strip().splitlines()[-1]


def test_a_mistyped_end_says_the_recording_is_still_open(salusd):
    s = Session(salusd)
    try:
        # One printf per line, as a shell script sends them: four writes.
        s.cmd("need persistent=8M ephemeral=8M\n")
        s.cmd("begin\n")
        s.cmd("spin 10\n")
        assert s.status()["recording_begun"] == "line 1 of write 2"
        with pytest.raises(OSError) as e:
            s.cmd("edn x10\n")
        assert e.value.errno == errno.EINVAL
        line = last_log_line(s)
        assert line.endswith("; a recording is still open (begin on line 1 of write 2): the lines "
                             "that follow are recorded into it, not run, until `end`"), line
        assert s.status()["recording"] == "yes"
        s.cmd("end x2\n")
        assert s.status()["recording"] == "no" and s.status()["recording_begun"] == "-"
        # A failing write whose own `begin` opened the recording still discards it.
        with pytest.raises(OSError):
            s.cmd("begin\nspin 10\nedn\n")
        assert last_log_line(s).endswith("; the iteration begun by this write is discarded")
        assert s.status()["recording_begun"] == "-"
    finally:
        s.close()


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def man_section(page, title):
    with open(os.path.join(ROOT, "docs", page)) as f:
        text = f.read()
    return re.split(r"^## ", text.split(f"\n## {title}\n", 1)[1], flags=re.M)[0]


def test_help_shows_the_defaults_that_salusd_8_lists():
    from conftest import SALUSD
    env = {k: v for k, v in os.environ.items() if k != "SALUS_MOUNT"}
    out = subprocess.run([SALUSD, "--help"], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    # "  --sim-memory TEXT=16G   ..." and "  --mount TEXT=/salus (Env:SALUS_MOUNT)"
    shown = {}
    for line in out.stdout.splitlines():
        head = re.split(r"\s{2,}", line.strip())[0]
        if head.startswith("-h,"):
            head = head[3:]
        if head.startswith("--"):
            default = re.search(r"=(\S+)(?: \(Env:[A-Z_]+\))?$", head)
            shown[head.split()[0]] = default.group(1) if default else None
    table = {}
    for row in re.finditer(r"^\| `(--[a-z-]+)[^|]*\|\s*([^|]*?)\s*\|",
                           man_section("salusd.8.md", "OPTIONS"), re.M):
        value = row.group(2).strip("`")
        table[row.group(1)] = None if value in ("none", "off", "") else value
    assert set(table) == set(shown), (set(table) ^ set(shown))
    synopsis = man_section("salusd.8.md", "SYNOPSIS")
    assert {o for o in shown if not re.search(re.escape(o) + r"(?![\w-])", synopsis)} == set()
    for opt, default in table.items():
        assert shown[opt] == default, f"{opt}: --help shows {shown[opt]!r}, salusd(8) {default!r}"


def test_the_startup_lines_are_those_salusd_8_shows(salusd_factory):
    # The LOGGING example: the start of `salusd --backend sim --sim-memory 1G`.
    example = re.search(r"```text\n(.*?)```", man_section("salusd.8.md", "LOGGING"), re.S).group(1)
    expected = [line.split(" ", 1)[1] for line in example.splitlines()]
    d = salusd_factory(sim_memory="1G", gpus=2).start()
    logged = [line.split(" ", 1)[1] for line in d.daemon_log().splitlines()
              if " info salusd " in line or " info gpu " in line]
    assert logged[:len(expected)] == [e.replace("/salus", d.mnt) for e in expected], logged


def ignore_sigint_and_block_stop_signals():
    # What `salusd &` in a script without job control gets (SIGINT ignored),
    # plus a mask a careless parent might leave.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_stop_signal_stops_salusd_whatever_its_parent_left_ignored_or_blocked(salusd_factory, sig):
    d = salusd_factory()
    d.log = open(d.log_path, "w")
    d.proc = subprocess.Popen(d.args, stdout=d.log, stderr=subprocess.STDOUT,
                              preexec_fn=ignore_sigint_and_block_stop_signals)
    assert wait_until(lambda: os.path.exists(d.path("version")), timeout=10), d.daemon_log()
    d.proc.send_signal(sig)
    try:
        rc = d.proc.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"salusd ignored {sig.name}: " + d.daemon_log())
    assert rc == 0, d.daemon_log()
    assert not is_mounted(d.mnt)
    assert "stopped; " in d.daemon_log()


NO_GPU_YET = "no GPU yet: declare needs first with `need persistent=SIZE ephemeral=SIZE`"


def test_every_command_before_need_says_no_gpu_yet_in_the_same_words(salusd):
    s = Session(salusd)
    try:
        for text in ("alloc w 1M\n", "begin\nspin 10\nend x2\n"):
            with pytest.raises(OSError) as e:
                s.cmd(text)
            assert e.value.errno == errno.ENXIO
            assert last_log_line(s).split("] ", 1)[1].split(": ", 1)[1] == NO_GPU_YET, last_log_line(s)
        with pytest.raises(OSError) as e:
            open(s.file("mem/x"), "w").close()
        assert e.value.errno == errno.ENXIO
        assert last_log_line(s).split("] ", 1)[1] == "mem/x: " + NO_GPU_YET
    finally:
        s.close()


def test_a_write_only_clone_is_refused_and_creates_no_session(salusd):
    # `echo 'need ...' > clone`: the session would end at the close right after,
    # with its command's work, and its id would never be seen.
    script = f"echo 'need persistent=1M ephemeral=1M' > {salusd.path('clone')}"
    r = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "Invalid argument" in r.stderr, r.stderr
    with pytest.raises(OSError) as e:
        os.open(salusd.path("clone"), os.O_WRONLY | os.O_APPEND)
    assert e.value.errno == errno.EINVAL
    assert os.listdir(salusd.path("sessions")) == []
    with open(salusd.path("stats")) as f:
        assert "sessions_created 0\n" in f.read()
    assert "clone: refused a write-only open" in salusd.daemon_log()
    # Read-write, as documented, still works.
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M\n")
    s.close()


def test_a_mountpoint_whose_parent_is_missing_says_so(tmp_path):
    from conftest import SALUSD
    mnt = str(tmp_path / "no" / "such" / "mnt")
    r = subprocess.run([SALUSD, "--backend", "sim", "--mount", mnt, "--state-dir", ""],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert r.stderr == (f"salusd: mountpoint {mnt}: cannot create it: No such file or directory "
                        "(salusd creates the mountpoint, not its parents)\n"), r.stderr
