"""upload/download cannot reach what the caller could not: a session of nobody
cannot use root's shared memory, read /etc/shadow, write into a root-owned
directory, or follow a symlink planted in /tmp, and what it may do, it does as
nobody. Each case runs a client as uid 65534 (setpriv) and checks the errno of
its write and the reason in its session log."""
import errno
import os
import shutil
import stat
import tempfile

import pytest

import nobody
from conftest import start_on_backend
from nobody import NOBODY, last_line, skip_unless_root_with_setpriv

BACKEND = os.environ.get("SALUS_TEST_BACKEND", "sim")


@pytest.fixture(autouse=True)
def need_root():
    skip_unless_root_with_setpriv()


@pytest.fixture(scope="module")
def daemon():
    d = start_on_backend(BACKEND, gpus=1, sim_memory="256M")
    yield d
    d.stop()


@pytest.fixture
def scratch():
    """A world-writable sticky directory, like /tmp, removed afterwards."""
    d = tempfile.mkdtemp(prefix="salus-sec-")
    os.chmod(d, 0o1777)
    made = []
    yield d, made
    for p in made:
        if os.path.lexists(p):
            os.unlink(p)
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(daemon, *commands):
    """[(errno, last log line)] per command; files nobody creates get umask 027."""
    return [(err, last_line(log)) for err, log in nobody.as_nobody(daemon.mnt, *commands, umask=0o027)]


def shm_segment(made, mode, owner=0, size=4096):
    name = f"salus-sec-{os.getpid()}-{len(made)}"
    path = "/dev/shm/" + name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, size)
    os.close(fd)
    os.chmod(path, mode)              # whatever the umask
    os.chown(path, owner, owner)
    made.append(path)
    return name


def test_nobody_cannot_use_roots_shared_memory(daemon, scratch):
    _, made = scratch
    seg = shm_segment(made, 0o666)    # world-readable and -writable, but root's
    (up, up_log), (down, down_log) = as_nobody(daemon, f"upload w shm:{seg} 4096",
                                               f"download w shm:{seg} 4096")
    assert up == errno.EACCES and down == errno.EACCES
    assert f"shm:{seg}: the segment belongs to uid 0" in up_log, up_log
    assert "belongs to uid 0" in down_log
    with open("/dev/shm/" + seg, "rb") as f:
        assert f.read() == bytes(4096)                # untouched
    # Its own segment works, both ways.
    mine = shm_segment(made, 0o600, owner=NOBODY)
    with open("/dev/shm/" + mine, "r+b") as f:
        f.write(b"nobody's bytes")
    (up, _), (down, _) = as_nobody(daemon, f"upload w+100 shm:{mine} 14",
                                   f"download w+100 shm:{mine}+1000 14")
    assert (up, down) == (0, 0)
    with open("/dev/shm/" + mine, "rb") as f:
        assert f.read()[1000:1014] == b"nobody's bytes"


def test_nobody_cannot_load_etc_shadow(daemon):
    assert os.path.exists("/etc/shadow")
    assert stat.S_IMODE(os.stat("/etc/shadow").st_mode) & 0o004 == 0
    [(err, log)] = as_nobody(daemon, "upload w file:/etc/shadow 1")
    assert err == errno.EACCES, log
    assert "file:/etc/shadow: Permission denied" in log


def test_nobody_cannot_write_into_a_root_owned_directory(daemon, scratch):
    d, made = scratch
    closed = os.path.join(d, "root-dir")
    os.mkdir(closed, 0o755)
    victim = os.path.join(d, "root-file")
    with open(victim, "wb") as f:
        f.write(b"root's")
    os.chmod(victim, 0o644)
    (new, new_log), (over, over_log) = as_nobody(daemon, f"download w file:{closed}/x 16",
                                                 f"download w file:{victim} 16")
    assert new == errno.EACCES and "cannot create it: Permission denied" in new_log
    assert over == errno.EACCES and "Permission denied" in over_log
    assert os.listdir(closed) == []
    with open(victim, "rb") as f:
        assert f.read() == b"root's"
    # Where nobody may write, the file is nobody's, with nobody's umask (027).
    [(ok, _)] = as_nobody(daemon, f"download w file:{d}/ckpt.bin 16")
    assert ok == 0
    st = os.stat(os.path.join(d, "ckpt.bin"))
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o640)


def test_nobody_cannot_follow_a_symlink_planted_in_tmp(daemon, scratch):
    d, made = scratch
    # To a root-only file: refused by the file's own permissions...
    to_shadow = os.path.join(d, "shadow-link")
    os.symlink("/etc/shadow", to_shadow)
    # ...and to a file nobody could read, planted by a third uid in a sticky
    # directory: refused by the symlink rule before the file is even looked at.
    readable = os.path.join(d, "readable")
    with open(readable, "wb") as f:
        f.write(b"r" * 64)
    os.chmod(readable, 0o644)
    planted = os.path.join(d, "planted")
    os.symlink(readable, planted)
    os.lchown(planted, 4242, 4242)
    # A link nobody made itself is followed.
    own = os.path.join(d, "own")
    os.symlink(readable, own)
    os.lchown(own, NOBODY, NOBODY)
    results = as_nobody(daemon, f"upload w file:{to_shadow} 1", f"upload w file:{planted} 1",
                        f"upload w file:{own} 64")
    (shadow, shadow_log), (plant, plant_log), (mine, _) = results
    assert shadow == errno.EACCES, shadow_log
    assert plant == errno.EACCES
    assert "refusing to follow symlink 'planted' owned by uid 4242" in plant_log, plant_log
    assert mine == 0
    # Writing through a planted link is refused whoever owns it.
    [(w, w_log)] = as_nobody(daemon, f"download w file:{own} 1")
    assert w == errno.ELOOP and "never writes through" in w_log
