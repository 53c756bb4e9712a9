"""Generated files read in full by tools that copy with sendfile() or splice().

busybox cat and cp (and so Alpine and other busybox images) and Python's
shutil.copyfile copy with sendfile(), which reads through the page cache up to
the size the inode reports. Generated files used to report size 0, so these
tools saw them empty. Each lookup of a changing file now returns a snapshot whose
size is its content's (fusefs/inode.hpp, Kind::snapshot_file).
"""
import os
import shutil
import subprocess

import pytest

from conftest import Session

BUSYBOX = shutil.which("busybox") or "/bin/busybox"

FILES = ["version", "README", "policy", "stats", "metrics",
         "gpus/0/info", "gpus/0/memory", "gpus/0/lanes", "gpus/0/queue"]


def busybox_static():
    """Debian's busybox-static (tools/dev.sh installs it): skip only without it."""
    if not os.access(BUSYBOX, os.X_OK):
        pytest.skip("busybox not installed (Debian package busybox-static)")
    return BUSYBOX


def pipe_all(path, move):
    """All of `path` as it arrives through a pipe, `move(src_fd, pipe_w)` at a time
    (sendfile or splice), until it moves 0 bytes."""
    with open(path, "rb") as src:
        r, w = os.pipe()
        try:
            out = b""
            while True:
                n = move(src.fileno(), w)
                if n == 0:
                    return out
                out += os.read(r, n)
        finally:
            os.close(r)
            os.close(w)


def sendfile_all(path):
    return pipe_all(path, lambda src, w: os.sendfile(w, src, None, 1 << 16))


def splice_all(path):
    return pipe_all(path, lambda src, w: os.splice(src, w, 1 << 16))


def names(text):
    """The metric names (or `key:` fields) of a generated file: stable while values change."""
    return [line.split()[0].split("{")[0] for line in text.splitlines() if line and line[0] != "#"]


def test_sizes_match_the_content(salusd):
    for name in ["version", "README"]:
        with open(salusd.path(name), "rb") as f:
            data = f.read()
        assert os.stat(salusd.path(name)).st_size == len(data) > 0, name
    for name in FILES:
        with open(salusd.path(name), "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
        # The open file is the snapshot its lookup made: its size is exactly what it reads.
        assert st.st_size == len(data) > 0, name


@pytest.mark.parametrize("copy", [sendfile_all, splice_all])
def test_sendfile_and_splice_read_everything(salusd, copy):
    s = Session(salusd)
    try:
        s.cmd("need persistent=1M ephemeral=1M\nalloc a 4K\n")
        files = FILES + [f"sessions/{s.id}/status", f"sessions/{s.id}/log"]
        for name in files:
            with open(salusd.path(name), "rb") as f:
                want = f.read().decode()
            got = copy(salusd.path(name)).decode()
            assert got, f"{name}: {copy.__name__} read nothing"
            assert got.endswith("\n") and "\0" not in got, name
            assert names(got) == names(want), name
        assert copy(salusd.path("version")) == open(salusd.path("version"), "rb").read()
    finally:
        s.close()


def test_busybox_cat_and_cp(salusd, tmp_path):
    bb = busybox_static()
    for name in FILES:
        with open(salusd.path(name)) as f:
            want = f.read()
        out = subprocess.run([bb, "cat", salusd.path(name)], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        assert out and names(out) == names(want), f"busybox cat {name}: {out!r}"
        dst = tmp_path / name.replace("/", "_")
        subprocess.run([bb, "cp", salusd.path(name), str(dst)], timeout=10, check=True)
        assert names(dst.read_text()) == names(want), f"busybox cp {name}"
    out = subprocess.run([bb, "cat", salusd.path("version")], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    assert out.startswith("salusd ") and out == open(salusd.path("version")).read()


def test_busybox_reads_a_session_status_as_its_owner(salusd):
    bb = busybox_static()
    s = Session(salusd)
    try:
        out = subprocess.run([bb, "cat", s.file("status")], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        assert f"id: {s.id}\n" in out or s.id in out, out
        # Another uid still gets EACCES through the snapshot.
        r = subprocess.run([bb, "cat", s.file("status")], capture_output=True, text=True,
                           timeout=10, user=65534)
        assert r.returncode != 0 and "denied" in r.stderr, r
    finally:
        s.close()


def test_shutil_copyfile(salusd, tmp_path):
    for name in ["version", "metrics", "stats", "gpus/1/info"]:
        dst = tmp_path / "copy"
        shutil.copyfile(salusd.path(name), dst)
        with open(salusd.path(name)) as f:
            want = f.read()
        assert names(dst.read_text()) == names(want) and dst.stat().st_size > 0, name


def test_snapshots_of_a_gone_session_are_gone(salusd):
    """Many reads, each through its own snapshot; once the session ends its
    status is gone, not served from an old snapshot."""
    s = Session(salusd)
    path = s.file("status")
    for _ in range(200):
        with open(salusd.path("metrics"), "rb") as f:
            assert f.read()
        with open(path, "rb") as f:
            assert f.read()
    s.close()
    from conftest import wait_until
    assert wait_until(lambda: not os.path.exists(path))
    with pytest.raises(FileNotFoundError):
        open(path)


def test_policy_written_and_read_with_busybox(salusd):
    """policy is a snapshot too, and admins still write it through one."""
    bb = busybox_static()
    r = subprocess.run([bb, "sh", "-c", f'echo srtf > {salusd.path("policy")} && cat {salusd.path("policy")}'],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 0 and "policy: srtf\n" in r.stdout, r
    r = subprocess.run([bb, "sh", "-c", f'echo fair > {salusd.path("policy")}'], capture_output=True,
                       text=True, timeout=10, user=65534)
    assert r.returncode != 0 and "denied" in r.stderr, r
    with open(salusd.path("policy")) as f:
        assert "policy: srtf\n" in f.read()
