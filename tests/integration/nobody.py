"""Runs a salusd client as uid 65534 (setpriv), for the tests of what salusd
opens on a caller's behalf (test_deputy.py, test_dataplane_security.py): each
command goes in its own write, and the errno of that write comes back with the
session's log, so a test checks both what failed and why."""
import json
import os
import shutil
import subprocess

import pytest

NOBODY = 65534

# Opens a session, then writes each command (followed by sync) on its own;
# prints, per command, the errno (0 for success) and the session's whole log.
CLIENT = r"""
import json, os, sys
mnt, commands, umask = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3], 8)
os.umask(umask)
fd = os.open(mnt + "/clone", os.O_RDWR)
sid = os.read(fd, 64).decode().strip()
os.write(fd, b"need persistent=8M ephemeral=1M\nalloc w 1M\n")
out = []
for c in commands:
    try:
        os.write(fd, (c + "\nsync\n").encode())
        err = 0
    except OSError as e:
        err = e.errno
    with open(f"{mnt}/sessions/{sid}/log") as f:
        out.append([err, f.read()])
print(json.dumps(out))
"""


def skip_unless_root_with_setpriv():
    """These tests switch to uid 65534: they need root and util-linux's setpriv."""
    if os.geteuid() != 0:
        pytest.skip("these tests switch to uid 65534 and need root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")


def as_nobody(mnt, *commands, umask=0o022):
    """[(errno, session log)] for each command, run by nobody in one session on `mnt`."""
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "/usr/bin/python3", "-c", CLIENT, mnt, json.dumps(commands),
                        format(umask, "o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [(err, log) for err, log in json.loads(r.stdout)]


def last_line(log):
    return log.splitlines()[-1]
