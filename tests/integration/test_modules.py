"""module and launch through the mount on the sim backend: a host .so kernel with
typed arguments, checked against its signature; only admins may load host code."""
import errno
import os
import shutil
import struct
import subprocess

import pytest

from conftest import Session

MODULE = os.environ.get("SALUS_TEST_SIM_MODULE", "")


@pytest.fixture(autouse=True)
def need_module():
    if not MODULE or not os.path.exists(MODULE):
        pytest.skip("the sim test kernel module was not built (SALUS_TEST_SIM_MODULE)")


def test_launch_saxpy_and_check_the_signature(session):
    s = session
    s.cmd("need persistent=1M ephemeral=1M\nalloc y 16\nalloc x 16\nfill y 1\nfill x 2\n")
    s.cmd(f"module k {MODULE}\n")
    s.cmd("launch k.saxpy grid=1 block=4 y x f32:3 u32:4\n")
    with open(s.file("mem/y"), "rb") as f:
        assert struct.unpack("<4f", f.read(16)) == (7.0, 7.0, 7.0, 7.0)
    with pytest.raises(OSError) as e:
        s.cmd("launch k.saxpy grid=1 block=4 y x f32:3\n")
    assert e.value.errno == errno.EINVAL
    assert "takes 4 parameters" in s.read("log")
    with pytest.raises(OSError) as e:
        s.cmd("launch k.saxpy grid=1 block=4 y x f64:3 u32:4\n")
    assert e.value.errno == errno.EINVAL
    assert "parameter 2 is 4 bytes" in s.read("log")
    with pytest.raises(OSError) as e:
        s.cmd("launch k.nosuch grid=1 block=1\n")
    assert e.value.errno == errno.ENOENT


def test_only_admins_load_host_code_on_sim(salusd):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another uid")
    import tempfile
    d = tempfile.mkdtemp(prefix="salus-mod-")  # readable by nobody, unlike pytest's tmp
    os.chmod(d, 0o755)
    copy = os.path.join(d, "k.so")
    shutil.copy(MODULE, copy)
    os.chmod(copy, 0o644)
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/bin/sh", "-c",
         f"""exec 3<>{salusd.mnt}/clone; read -r id <&3
echo 'need persistent=1M ephemeral=1M' >&3
if echo 'module k {copy}' >&3 2>/dev/null; then echo loaded; fi
grep -c 'only root or the admin group' {salusd.mnt}/sessions/$id/log"""],
        capture_output=True, text=True, timeout=30)
    shutil.rmtree(d, ignore_errors=True)
    assert out.stdout.split() == ["1"], out.stdout + out.stderr
