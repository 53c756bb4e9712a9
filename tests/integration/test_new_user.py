"""What a new user ran into (issue 18): a restart right after salusd was killed
must name the dead mount and its cure, and a mistyped `end` must say that the
recording is still open instead of silently recording what follows."""
import errno
import os
import signal
import subprocess

import pytest

from conftest import Session, is_mounted


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
