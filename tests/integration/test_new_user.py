"""What a new user ran into (issue 18): a restart right after salusd was killed
must name the dead mount and its cure."""
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
