"""Bad input: every malformed or disallowed command fails its write() with a
fitting errno, logs the reason with its line number, and loses nothing."""
import errno
import os
import struct

import pytest

from conftest import Session

SETUP = "need persistent=64M ephemeral=64M gpu=0\nalloc w 1M\n"

# (name, write, errno, text expected in the log)
CASES = [
    ("unknown command", "frobnicate\n", errno.EINVAL, "line 1: unknown command 'frobnicate'"),
    ("bad size", "alloc x 12Q\n", errno.EINVAL, "line 1:"),
    ("size junk", "alloc x abc\n", errno.EINVAL, "'abc'"),
    ("negative size", "alloc x -5M\n", errno.EINVAL, "negative"),
    ("negative run", "run -1\n", errno.EINVAL, "negative"),
    ("overflowing number", "run 99999999999999999999\n", errno.ERANGE, "line 1:"),
    ("overflowing size", "alloc x 20000000T\n", errno.ERANGE, "line 1:"),
    ("zero run", "run 0\n", errno.ERANGE, "line 1:"),
    ("unknown buffer", "fill nope 1\n", errno.ENOENT, "unknown buffer 'nope'"),
    ("unknown copy source", "copy w nope 16\n", errno.ENOENT, "unknown buffer 'nope'"),
    ("offset out of range", "fill w 1 off=2M\n", errno.ERANGE, "outside buffer w"),
    ("copy past end", "copy w+1048000 w 4096\n", errno.ERANGE, "outside buffer w"),
    ("gemm too big", "gemm 1024 1024 1024 w w w\n", errno.ERANGE, "gemm A"),
    ("ephemeral buffer after end", "begin\nalloc t 1M\nend\nfill t 1\n", errno.ENOENT, "line 4: fill: unknown buffer 't'"),
    ("end without begin", "end\n", errno.EINVAL, "line 1: end without begin"),
    ("begin inside begin", "begin\nbegin\n", errno.EINVAL, "line 2: begin inside begin"),
    ("run before record", "run 3\n", errno.EINVAL, "no iteration recorded"),
    ("ephemeral beyond lane", "begin\nalloc t 65M\n", errno.ENOMEM, "lane holds"),
    ("duplicate buffer", "alloc w 1M\n", errno.EEXIST, "already exists"),
    ("free unknown", "free ghost\n", errno.ENOENT, "no such buffer"),
    ("persistent beyond safety", "alloc big 1000M\n", errno.ENOMEM, "persistent memory exhausted"),
    ("need exceeding capacity", "need persistent=2G ephemeral=1M\n", errno.ENOMEM, "exceeds gpu"),
    ("need on missing gpu", "need persistent=1M ephemeral=1M gpu=9\n", errno.EBUSY, "cannot move"),
    ("missing key", "need persistent=1M\n", errno.EINVAL, "ephemeral"),
    ("unknown key", "fill w 1 color=red\n", errno.EINVAL, "color"),
    ("duplicate key", "fill w 1 len=4 len=8\n", errno.EINVAL, "len"),
    ("bad dtype", "fill w 1 dtype=f16\n", errno.EINVAL, "f16"),
    ("u8 out of range", "fill w 256 dtype=u8\n", errno.ERANGE, "256"),
    ("fill length not element multiple", "fill w 1 len=6\n", errno.EINVAL, "multiple"),
    ("util zero", "spin 10 util=0\n", errno.ERANGE, "util"),
    ("util above one", "spin 10 util=1.5\n", errno.ERANGE, "util"),
    ("trailing junk", "sync now\n", errno.EINVAL, "line 1:"),
    ("bad name", "alloc ../etc 1M\n", errno.EINVAL, "../etc"),
    ("name too long", "alloc " + "n" * 65 + " 1M\n", errno.EINVAL, "line 1:"),
    ("end x0", "begin\nend x0\n", errno.ERANGE, "line 2:"),
    ("end beyond the queued-iterations quota", "begin\nend x99999999999\n", errno.ERANGE,
     "line 2: 99999999999 iterations in one submission; at most 10000000"),
    ("run beyond the queued-iterations quota", "begin\nend\nrun 10000001\n", errno.ERANGE,
     "line 3: 10000001 iterations in one submission; at most 10000000"),
    ("non-UTF-8", b"fill w 1 \xff\xfe\n", errno.EINVAL, "invalid UTF-8"),
    ("overlong UTF-8", b"alloc \xc0\xaf 1M\n", errno.EINVAL, "invalid UTF-8"),
    ("embedded NUL", b"alloc x\x00y 1M\n", errno.EINVAL, "embedded NUL"),
    ("over-long line", "alloc " + "x" * 5000 + "\n", errno.EINVAL, "line 1:"),
    ("relative module path", "module m lib.so\n", errno.EINVAL, "line 1:"),
    ("module file missing", "module m /nonexistent/x.so\n", errno.ENOENT, "/nonexistent/x.so"),
    ("launch of unknown module", "launch nomod.k grid=1 block=1\n", errno.ENOENT, "no module 'nomod'"),
    ("upload from a missing segment", "upload w shm:salus-no-such-seg 16\n", errno.ENOENT,
     "no such segment"),
    ("upload past the buffer", "upload w+1048570 file:/etc/hostname 16\n", errno.ERANGE,
     "outside buffer w"),
    ("upload from a directory", "upload w file:/etc 16\n", errno.EISDIR, "a directory"),
    ("download to a device", "download w file:/dev/null 16\n", errno.EINVAL,
     "a character device"),
    ("download inside begin", "begin\ndownload w file:/tmp/x 16\n", errno.EINVAL,
     "not allowed inside begin/end"),
]


@pytest.fixture(scope="module")
def daemon():
    from conftest import Salusd
    d = Salusd().start()
    yield d
    d.stop()


@pytest.mark.parametrize("name,text,err,logged", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_write_and_logs(daemon, name, text, err, logged):
    s = Session(daemon)
    try:
        s.cmd(SETUP)
        with pytest.raises(OSError) as e:
            s.cmd(text)
        assert e.value.errno == err, f"{name}: got {errno.errorcode.get(e.value.errno)}"
        log = s.read("log")
        assert logged in log, log
        # The session still works after the error (an iteration left open by the
        # bad write is still open: close it first).
        if s.status()["recording"] == "yes":
            s.cmd("end\n")
        s.cmd("fill w 4 dtype=i32 len=4\n")
        with open(s.file("mem/w"), "rb") as f:
            assert struct.unpack("<i", f.read(4)) == (4,)
    finally:
        s.close()


def test_at_least_thirty_bad_inputs():
    assert len(CASES) >= 30


def test_command_before_a_bad_line_is_not_lost(daemon):
    s = Session(daemon)
    s.cmd(SETUP)
    with pytest.raises(OSError) as e:
        s.cmd("fill w 9 dtype=i32 len=4\nbegin\nend x3\nbogus\nfill w 1 dtype=i32 len=4\n")
    assert e.value.errno == errno.EINVAL
    assert s.wait() == "done 3\n"
    with open(s.file("mem/w"), "rb") as f:
        assert struct.unpack("<i", f.read(4)) == (9,)   # line 1 ran, line 5 did not
    assert "line 4: unknown command 'bogus'" in s.read("log")
    s.close()


def test_write_larger_than_quota(salusd_factory):
    d = salusd_factory(extra_args=["--quota-write-bytes", "1024"]).start()
    s = Session(d)
    s.cmd("need persistent=1M ephemeral=1M\n")
    with pytest.raises(OSError) as e:
        s.cmd("sync\n" * 400)
    assert e.value.errno == errno.EMSGSIZE
    assert "per-write quota" in s.read("log")
    s.close()


def test_commands_before_need_are_rejected(daemon):
    s = Session(daemon)
    with pytest.raises(OSError) as e:
        s.cmd("alloc w 1M\n")
    assert e.value.errno == errno.ENXIO
    assert "need persistent=SIZE" in s.read("log")
    s.close()


def test_session_and_buffer_quotas(salusd_factory):
    d = salusd_factory(extra_args=["--quota-sessions", "2", "--quota-buffers", "2",
                                   "--quota-queued", "100"]).start()
    a, b = Session(d), Session(d)
    with pytest.raises(OSError) as e:
        Session(d)
    assert e.value.errno == errno.EDQUOT
    a.cmd("need persistent=4M ephemeral=1M\nalloc x 1K\nalloc y 1K\n")
    with pytest.raises(OSError) as e:
        a.cmd("alloc z 1K\n")
    assert e.value.errno == errno.EDQUOT
    # More than the quota in one submission can never be queued: a range error.
    with pytest.raises(OSError) as e:
        a.cmd("begin\nspin 1\nend x101\n")
    assert e.value.errno == errno.ERANGE
    assert a.read("log").splitlines()[-1].endswith(
        "line 3: 101 iterations in one submission; at most 100 (the queued-iterations quota) "
        "can be queued at once")
    # A count that fits, on a queue that is already full, meets the quota.
    a.cmd("begin\nspin 100000\nend x60\n")
    with pytest.raises(OSError) as e:
        a.cmd("run 60\n")
    assert e.value.errno == errno.EDQUOT
    assert "the quota is 100" in a.read("log")
    a.close()
    b.close()


def test_failed_write_discards_the_iteration_it_began(daemon):
    s = Session(daemon)
    s.cmd(SETUP)
    with pytest.raises(OSError) as e:
        s.cmd("begin\nspin 10\nfill nope 1\nend x5\n")
    assert e.value.errno == errno.ENOENT
    assert s.status()["recording"] == "no"
    assert "discarded" in s.read("log")
    s.cmd("begin\nspin 10\nend x2\n")      # a fresh begin works
    assert s.wait() == "done 2\n"
    s.close()
