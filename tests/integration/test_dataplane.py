"""The data plane through a real mount: upload/download through shared memory and
files, checkpoints, a 256 MiB checksum through each of mem/, shm and io_uring
file I/O, every bad length, offset and path with its errno and log line, a
failure while a transfer runs, and a client killed mid-transfer.

Runs on the sim backend; with SALUS_TEST_BACKEND=cuda the same tests run against
`salusd --backend cuda` (they skip, saying why, where no GPU answers)."""
import errno
import hashlib
import itertools
import os
import signal
import subprocess
import sys

import pytest

from conftest import Session, start_on_backend, wait_until

BACKEND = os.environ.get("SALUS_TEST_BACKEND", "sim")
MiB = 1 << 20
_names = itertools.count()


@pytest.fixture(scope="module")
def daemon():
    d = start_on_backend(BACKEND, gpus=1, sim_memory="1G")
    yield d
    d.stop()


@pytest.fixture
def session(daemon):
    s = Session(daemon)
    yield s
    s.close()


class Segment:
    """A POSIX shared-memory segment as a client makes one: /dev/shm/NAME."""

    def __init__(self, data=b"", size=None):
        self.name = f"salus-test-{os.getpid()}-{next(_names)}"
        self.path = "/dev/shm/" + self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            if size is not None:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def read(self):
        with open(self.path, "rb") as f:
            return f.read()

    def close(self):
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture
def segments():
    made = []

    def make(*args, **kw):
        made.append(Segment(*args, **kw))
        return made[-1]

    yield make
    for seg in made:
        seg.close()


def fails(s, text):
    with pytest.raises(OSError) as e:
        s.cmd(text)
    return e.value.errno


def last_log(s):
    return s.read("log").splitlines()[-1]


def stats(d):
    with open(d.path("stats")) as f:
        return {k: v for k, _, v in (line.partition(" ") for line in f.read().splitlines())}


def mem_read(s, name, length, offset=0):
    fd = os.open(s.file("mem/" + name), os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < length:
            chunk = os.pread(fd, min(length - len(out), 64 * MiB), offset + len(out))
            assert chunk, "short mem/ read"
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def mem_write(s, name, data, offset=0):
    fd = os.open(s.file("mem/" + name), os.O_WRONLY)
    try:
        mv = memoryview(data)
        done = 0
        while done < len(mv):
            done += os.pwrite(fd, mv[done:done + 64 * MiB], offset + done)
    finally:
        os.close(fd)


def pattern(n, seed=0):
    """n bytes that differ at every offset (cheaper than os.urandom for big n)."""
    block = hashlib.sha256(str(seed).encode()).digest() * 4096   # 128 KiB
    reps = -(-n // len(block))
    data = bytearray(block * reps)[:n]
    # Stamp each 4 KiB page with its index so that misplaced pages show.
    for page in range(0, n, 4096):
        data[page:page + 8] = (page // 4096).to_bytes(8, "little")
    return bytes(data)


# ---------------------------------------------------------------- round trips

def test_shm_round_trip_with_offsets(session, segments):
    s = session
    s.cmd("need persistent=8M ephemeral=1M\nalloc w 1M\n")
    data = pattern(300_000, 1)
    src = segments(b"\0" * 100 + data)
    s.cmd(f"upload w+4096 shm:{src.name}+100 {len(data)}\nsync\n")
    assert mem_read(s, "w", len(data), 4096) == data
    assert mem_read(s, "w", 4096) == bytes(4096)            # nothing before it
    dst = segments(size=400_000)
    s.cmd(f"download w+4096 shm:{dst.name}+7 {len(data)}\n")
    assert s.wait() == "done 0\n"
    got = dst.read()
    assert len(got) == 400_000                               # never grown
    assert got[7:7 + len(data)] == data and got[:7] == bytes(7)
    assert f"upload w+4096 shm:{src.name}+100 {len(data)}: done" in s.read("log")
    assert s.status()["transfers"] == "0"


def test_shm_transfers_are_direct_and_the_segment_stays_mapped_for_the_session(daemon, segments):
    s = Session(daemon)
    s.cmd("need persistent=8M ephemeral=1M\nalloc w 4M\n")
    before = int(stats(daemon)["transfers_direct"])
    data = pattern(4 * MiB, 11)
    seg = segments(data)
    for _ in range(3):
        s.cmd(f"upload w shm:{seg.name} 4M\nsync\n")
    assert mem_read(s, "w", 4 * MiB) == data
    st = stats(daemon)
    assert int(st["transfers_direct"]) == before + 3, st
    assert int(st["shm_segments_mapped"]) >= 1 and int(st["shm_segment_bytes"]) >= 4 * MiB, st
    s.close()
    # Its mappings (on cuda: pinned pages) go with the session.
    assert wait_until(lambda: stats(daemon)["shm_segments_mapped"] == "0", 10), stats(daemon)


def test_a_segment_that_shrinks_under_a_transfer_fails_it_and_the_daemon_lives(session, segments):
    s = session
    s.cmd("need persistent=8M ephemeral=1M\nalloc w 4M\n")
    seg = segments(pattern(4 * MiB, 12))
    s.cmd(f"spin 200000\nupload w shm:{seg.name} 4M\n")   # accepted: it is 4M now
    os.truncate(seg.path, 1000)    # the copy then touches pages that are gone
    with pytest.raises(OSError) as e:
        s.wait()
    assert e.value.errno == errno.EIO
    assert "shrank" in s.status()["error"], s.status()
    s.cmd("reset\nfill w 1\n")
    assert s.wait() == "done 0\n"


def test_file_round_trip_and_a_new_files_mode(session, tmp_path):
    s = session
    s.cmd("need persistent=8M ephemeral=1M\nalloc w 2M\n")
    data = pattern(MiB + 5, 2)
    src = tmp_path / "in.bin"
    src.write_bytes(b"header" + data)
    s.cmd(f"upload w+3 file:{src}+6 {len(data)}\nsync\n")
    assert mem_read(s, "w", len(data), 3) == data
    out = tmp_path / "out.bin"
    old = os.umask(0o027)
    try:
        s.cmd(f"download w+3 file:{out}+10 {len(data)}\nsync\n")
    finally:
        os.umask(old)
    got = out.read_bytes()
    assert got[10:] == data and got[:10] == bytes(10)
    st = out.stat()
    assert st.st_uid == os.getuid() and (st.st_mode & 0o777) == 0o640   # 0666 & ~umask
    # Downloads never truncate: a shorter one leaves the rest of the file alone.
    s.cmd(f"download w file:{out} 4\nsync\n")
    assert out.stat().st_size == len(got)


def test_checkpoint_saved_and_loaded_back_by_another_session(daemon, tmp_path):
    weights = pattern(4 * MiB, 3)
    ckpt = tmp_path / "ckpt.bin"
    a = Session(daemon)
    a.cmd("need persistent=8M ephemeral=1M\nalloc w 4M\n")
    mem_write(a, "w", weights)
    a.cmd("fill w 7 dtype=u8 len=4\n")          # the checkpoint sees earlier work
    a.cmd(f"download w file:{ckpt} 4M\n")
    assert a.wait() == "done 0\n"
    a.close()
    b = Session(daemon)
    b.cmd(f"need persistent=8M ephemeral=1M\nalloc w2 4M\nupload w2 file:{ckpt} 4M\nsync\n")
    assert mem_read(b, "w2", 4 * MiB) == b"\x07" * 4 + weights[4:]
    b.close()


def test_256_mib_checksum_through_each_path(session, segments, tmp_path):
    s = session
    n = 256 * MiB
    s.cmd("need persistent=600M ephemeral=1M\nalloc a 256M\nalloc b 256M\n")
    data = pattern(n, 4)
    want = hashlib.sha256(data).hexdigest()
    # mem/ files: pwrite in, pread out.
    mem_write(s, "a", data)
    assert hashlib.sha256(mem_read(s, "a", n)).hexdigest() == want
    # Shared memory: upload into b, download into a fresh segment.
    src = segments(data)
    s.cmd("fill b 0 dtype=u8\n")
    s.cmd(f"upload b shm:{src.name} 256M\nsync\n")
    dst = segments(size=n)
    s.cmd(f"download b shm:{dst.name} 256M\nsync\n")
    assert hashlib.sha256(dst.read()).hexdigest() == want
    # Files with io_uring: upload into a, download into a new file.
    f_in = tmp_path / "in.bin"
    f_in.write_bytes(data)
    del data
    s.cmd("fill a 0 dtype=u8\n")
    s.cmd(f"upload a file:{f_in} 256M\nsync\n")
    f_out = tmp_path / "out.bin"
    s.cmd(f"download a file:{f_out} 256M\nsync\n")
    h = hashlib.sha256()
    with open(f_out, "rb") as f:
        for chunk in iter(lambda: f.read(16 * MiB), b""):
            h.update(chunk)
    assert h.hexdigest() == want
    assert "256.0M in" in s.read("log")


# ---------------------------------------------------------------- errors

def bad_cases(tmp, seg):
    """(name, command, errno, text in the last log line)."""
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    other_dir = os.path.join(tmp, "sticky")
    os.mkdir(other_dir)
    os.chmod(other_dir, 0o1777)
    with open(os.path.join(tmp, "target"), "wb") as f:
        f.write(b"x" * 64)
    planted = os.path.join(other_dir, "planted")
    os.symlink(os.path.join(tmp, "target"), planted)
    os.lchown(planted, 4242, 4242)                # someone else's link in a sticky dir
    mine = os.path.join(tmp, "mine")
    os.symlink(os.path.join(tmp, "target"), mine)
    return [
        ("buffer offset past the end", f"upload w+2M shm:{seg} 1", errno.ERANGE,
         "is outside buffer w"),
        ("length past the buffer", f"download w+1M shm:{seg} 1", errno.ERANGE,
         "is outside buffer w"),
        ("segment smaller than asked", f"upload w shm:{seg} 4097", errno.ERANGE,
         "the segment holds 4096"),
        ("segment offset past its end", f"download w shm:{seg}+4096 1", errno.ERANGE,
         "the segment holds 4096"),
        ("missing segment", "upload w shm:salus-test-none 1", errno.ENOENT, "no such segment"),
        ("segment name with a slash", "upload w shm:a/b 1", errno.EINVAL,
         "bad character in name"),
        ("segment name ..", "upload w shm:.. 1", errno.EINVAL, "must not start with '.'"),
        ("unknown buffer", f"upload nope shm:{seg} 1", errno.ENOENT, "unknown buffer 'nope'"),
        ("missing file", f"upload w file:{tmp}/missing 1", errno.ENOENT,
         "No such file or directory"),
        ("file shorter than asked", f"upload w file:{tmp}/target 65", errno.ERANGE,
         "the file holds 64"),
        ("a directory", f"upload w file:{tmp} 1", errno.EISDIR, "a directory"),
        ("download to a directory", f"download w file:{tmp} 1", errno.EISDIR, "a directory"),
        ("a FIFO", f"upload w file:{fifo} 1", errno.EINVAL, "a FIFO"),
        ("download to a FIFO", f"download w file:{fifo} 1", errno.EINVAL, "a FIFO"),
        ("a device node", "upload w file:/dev/zero 1", errno.EINVAL, "a character device"),
        ("through someone else's symlink", f"upload w file:{planted} 1", errno.EACCES,
         "refusing to follow symlink 'planted' owned by uid 4242"),
        ("download through a symlink", f"download w file:{mine} 1", errno.ELOOP,
         "never writes through"),
        ("download into a missing directory", f"download w file:{tmp}/no/x 1", errno.ENOENT,
         "No such file or directory"),
        ("relative path", "upload w file:rel/x 1", errno.EINVAL, "path must be absolute"),
        ("inside an iteration", f"begin\nupload w shm:{seg} 1", errno.EINVAL,
         "not allowed inside begin/end"),
    ]


def test_every_bad_transfer_fails_its_write_with_errno_and_log(session, segments, tmp_path):
    s = session
    s.cmd("need persistent=8M ephemeral=1M\nalloc w 1M\n")
    seg = segments(size=4096)
    cases = bad_cases(str(tmp_path), seg.name)
    for name, text, err, logged in cases:
        got = fails(s, text + "\n")
        assert got == err, f"{name}: {errno.errorcode.get(got)}, expected {errno.errorcode[err]}"
        assert logged in last_log(s), f"{name}: {last_log(s)}"
        if s.status()["recording"] == "yes":
            s.cmd("end\n")
    # None of them queued anything or hurt the session.
    assert s.status()["state"] == "admitted" and s.wait() == "done 0\n"
    s.cmd(f"upload w shm:{seg.name} 4096\nsync\n")


def test_a_source_that_shrinks_while_queued_fails_the_session(session, tmp_path):
    s = session
    src = tmp_path / "src.bin"
    src.write_bytes(pattern(MiB, 5))
    s.cmd("need persistent=8M ephemeral=1M\nalloc w 1M\n")
    s.cmd(f"spin 200000\nupload w file:{src} 1M\n")      # accepted: it is 1M now
    os.truncate(src, 1000)
    with pytest.raises(OSError) as e:
        s.wait()
    assert e.value.errno == errno.EIO
    st = s.status()
    assert st["state"] == "failed" and "shrank after the command was accepted" in st["error"]
    assert "ended at byte 1000" in s.read("log")
    assert fails(s, "fill w 1\n") == errno.EIO          # the failure latch, as for any work
    s.cmd("reset\nfill w 1\n")
    assert s.wait() == "done 0\n"


def test_a_client_killed_mid_transfer_frees_it_all_and_spares_others(daemon, segments, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(256 * MiB)                   # reads as zeros, from the page cache
    other = Session(daemon)
    other.cmd("need persistent=64M ephemeral=1M\nalloc keep 32M\n")
    keep = pattern(32 * MiB, 6)
    mem_write(other, "keep", keep)
    with open(daemon.path("gpus", "0", "memory")) as f:
        used_before = f.read().split("persistent_used: ")[1].split()[0]
    before = int(stats(daemon)["transfers_cancelled"])
    code = f"""
import os, time
fd = os.open({daemon.path('clone')!r}, os.O_RDWR)
sid = os.read(fd, 64).decode().strip()
os.write(fd, b"need persistent=300M ephemeral=1M\\nalloc w 256M\\n")
os.write(fd, b"upload w file:{big} 256M\\n" * 4)
print(sid, flush=True)
time.sleep(60)
"""
    cancelled = False
    for _ in range(3):   # the kill may, rarely, land between two transfers
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            sid = p.stdout.readline().strip()
            assert sid, "the victim did not start"
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
        assert wait_until(lambda: sid not in os.listdir(daemon.path("sessions")), 10)
        # The directory goes at once; the session itself once its transfer has
        # stopped and handed its staging back.
        assert wait_until(lambda: stats(daemon)["sessions"] == "1", 10), stats(daemon)
        if int(stats(daemon)["transfers_cancelled"]) > before:
            cancelled = True
            break
    assert cancelled, stats(daemon)
    st = stats(daemon)
    assert st["staging_bytes_in_use"] == "0" and st["transfers_active"] == "0", st
    with open(daemon.path("gpus", "0", "memory")) as f:
        assert f.read().split("persistent_used: ")[1].split()[0] == used_before
    # The other session lost nothing and moves data as before.
    assert hashlib.sha256(mem_read(other, "keep", 32 * MiB)).digest() == \
        hashlib.sha256(keep).digest()
    dst = segments(size=32 * MiB)
    other.cmd(f"download keep shm:{dst.name} 32M\nsync\n")
    assert dst.read() == keep
    other.close()
