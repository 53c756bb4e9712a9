"""Another uid cannot touch a session it does not own; admin files are root's."""
import os
import shutil
import subprocess

import pytest

from conftest import Session

NOBODY = 65534


def as_nobody(script):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/bin/sh", "-c", script],
        capture_output=True, text=True, timeout=30)


@pytest.fixture(autouse=True)
def need_root():
    if os.geteuid() != 0:
        pytest.skip("permission tests switch uid and need root")


def test_other_uid_gets_eacces_on_roots_session(salusd):
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M\nalloc w 4K\n")
    d = salusd.path("sessions", s.id)
    out = as_nobody(f"""
for f in {d}/status {d}/log {d}/wait {d}/mem/w; do
  if cat $f >/dev/null 2>&1; then echo "read $f"; fi
done
if echo 'spin 1' > {d}/ctl 2>/dev/null; then echo 'wrote ctl'; fi
ls {d} 2>&1 | grep -q 'Permission denied' && echo denied
rmdir {d} 2>/dev/null && echo removed
true
""")
    assert out.stdout.split() == ["denied"], out.stdout + out.stderr
    assert s.id in os.listdir(salusd.path("sessions"))
    s.close()


def test_other_uid_cannot_use_admin_files(salusd):
    out = as_nobody(f"""
echo 'kill 1' > {salusd.mnt}/ctl 2>/dev/null && echo ctl
echo 'pack' > {salusd.mnt}/policy 2>/dev/null && echo policy
cat {salusd.mnt}/policy > /dev/null && echo readable
true
""")
    assert out.stdout.split() == ["readable"], out.stdout + out.stderr


def test_nobody_owns_the_sessions_it_makes(salusd):
    out = as_nobody(f"""
set -e
mkdir {salusd.mnt}/sessions/mine
echo 'need persistent=1M ephemeral=1M' > {salusd.mnt}/sessions/mine/ctl
exec 3<>{salusd.mnt}/clone
read -r id <&3
echo $id
stat -c '%u %a' {salusd.mnt}/sessions/mine {salusd.mnt}/sessions/$id
""")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == f"{NOBODY} 700" and lines[2] == f"{NOBODY} 700"
    # Root (admin) can still see and remove it.
    with open(salusd.path("sessions", "mine", "status")) as f:
        assert f"uid: {NOBODY}" in f.read()
    os.rmdir(salusd.path("sessions", "mine"))
