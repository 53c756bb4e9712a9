"""Sessions through real files: clone and named sessions, commands, mem/ files,
wait, admission queueing, and the same through /bin/sh with cat, echo, truncate."""
import errno
import hashlib
import os
import struct
import subprocess
import threading
import time

import pytest

from conftest import Session, wait_until


def test_clone_session_lives_with_its_fd(salusd):
    s = Session(salusd)
    assert s.id.isdigit()
    assert s.id in os.listdir(salusd.path("sessions"))
    assert sorted(os.listdir(salusd.path("sessions", s.id))) == ["ctl", "log", "mem", "status", "wait"]
    st = os.stat(salusd.path("sessions", s.id))
    assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o700
    s.close()
    assert wait_until(lambda: s.id not in os.listdir(salusd.path("sessions")), 1.0)


def test_iterations_run_and_wait_reports(session):
    s = session
    s.cmd("need persistent=16M ephemeral=32M iters=20\n")
    assert s.status()["state"] == "admitted"
    s.cmd("alloc w 1M\nfill w 2.5\n")
    s.cmd("begin\nalloc tmp 8M\nfill tmp 1 dtype=i32\ncopy w tmp 4096\nspin 100\nend x10\n")
    s.cmd("run 10\n")
    assert s.wait() == "done 20\n"
    st = s.status()
    assert st["iterations_done"] == "20"
    assert st["iterations_queued"] == "0"
    assert float(st["gpu_time_ms"]) > 0
    with open(s.file("mem/w"), "rb") as f:
        head = f.read(8)
        f.seek(8192)
        tail = f.read(4)
    assert struct.unpack("<2i", head) == (1, 1)        # copied from tmp
    assert struct.unpack("<f", tail) == (2.5,)          # untouched fill


def test_ctl_file_replies_and_sync(session):
    s = session
    fd = os.open(s.file("ctl"), os.O_RDWR)
    os.write(fd, b"need persistent=1M ephemeral=1M\n")
    assert os.read(fd, 100) == b"ok\n"
    t0 = time.time()
    os.write(fd, b"spin 200000\nsync\n")  # the write returns when the spin is done
    assert time.time() - t0 >= 0.19
    os.close(fd)


def test_gemm_result(session):
    s = session
    s.cmd("need persistent=1M ephemeral=1M\nalloc a 64\nalloc b 64\nalloc c 64\n")
    s.cmd("fill a 2\nfill b 3\ngemm 4 4 4 a b c\n")
    with open(s.file("mem/c"), "rb") as f:
        values = struct.unpack("<16f", f.read())
    assert values == (24.0,) * 16


def test_mem_files_truncate_write_read_rm(session):
    s = session
    s.cmd("need persistent=64M ephemeral=1M\n")
    path = s.file("mem/data")
    subprocess.run(["truncate", "-s", "8M", path], check=True)
    assert os.path.getsize(path) == 8 << 20
    payload = os.urandom(8 << 20)
    with open(path, "r+b") as f:
        f.write(payload)
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(payload).digest()
    # Growing keeps the contents and zero-fills the rest; shrinking keeps the prefix.
    os.truncate(path, 12 << 20)
    with open(path, "rb") as f:
        data = f.read()
    assert data[: 8 << 20] == payload and data[8 << 20 :] == bytes(4 << 20)
    os.truncate(path, 1 << 20)
    with open(path, "rb") as f:
        assert f.read() == payload[: 1 << 20]
    fd = os.open(path, os.O_RDWR)
    with pytest.raises(OSError) as e:
        os.pwrite(fd, b"1234", (1 << 20) - 2)   # a buffer does not grow by writing
    os.close(fd)
    assert e.value.errno == errno.EFBIG
    assert "data" in os.listdir(s.file("mem"))
    os.unlink(path)
    assert "data" not in os.listdir(s.file("mem"))
    assert s.status()["persistent_used"] == "0"


def test_named_session_mkdir_rmdir(salusd):
    d = salusd.path("sessions", "trainer")
    os.mkdir(d)
    with pytest.raises(FileExistsError):
        os.mkdir(d)
    with open(os.path.join(d, "ctl"), "w") as f:
        f.write("need persistent=1M ephemeral=1M\nbegin\nend x3\n")
    with open(os.path.join(d, "wait")) as f:
        assert f.read() == "done 3\n"
    os.rmdir(d)
    assert "trainer" not in os.listdir(salusd.path("sessions"))
    with pytest.raises(OSError) as e:
        os.mkdir(salusd.path("sessions", "12345"))
    assert e.value.errno == errno.EINVAL


def test_rmdir_of_clone_session_is_ebusy(session, salusd):
    with pytest.raises(OSError) as e:
        os.rmdir(salusd.path("sessions", session.id))
    assert e.value.errno == errno.EBUSY
    assert session.read("log").splitlines()[-1].endswith(
        "rmdir refused (EBUSY): a clone session ends when the last descriptor of its clone file "
        "is closed (or by `kill ID` on /salus/ctl)")


def test_shell_tools_drive_a_session(salusd):
    script = f"""
set -e
M={salusd.mnt}
exec 3<>$M/clone
read -r id <&3
echo 'need persistent=16M ephemeral=16M' >&3
truncate -s 4M $M/sessions/$id/mem/w
printf 'begin\\nalloc t 1M\\nfill t 7 dtype=u8\\ncopy w t 1M\\nend x4\\n' >&3
cat $M/sessions/$id/wait
head -c 3 $M/sessions/$id/mem/w | od -An -tu1 | tr -s ' '
grep '^state: admitted' $M/sessions/$id/status
if echo 'frobnicate' >&3 2>/dev/null; then echo 'bad command accepted'; exit 1; fi
grep -q "unknown command 'frobnicate'" $M/sessions/$id/log
exec 3>&-
"""
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "done 4"
    assert lines[1].strip() == "7 7 7"


def test_second_session_queues_until_memory_frees(salusd):
    a = Session(salusd)
    a.cmd("need persistent=700M ephemeral=100M gpu=0\n")
    b = Session(salusd)
    b.cmd("need persistent=400M ephemeral=100M gpu=0\n")  # does not fit beside a
    assert b.status()["state"] == "queued"
    with open(salusd.path("gpus", "0", "queue")) as f:
        rows = [l.split() for l in f.read().splitlines() if not l.startswith("#")]
    assert rows[0][1] == b.id
    # Commands that need the GPU wait (deferred, no thread held) until admission.
    done = []
    t = threading.Thread(target=lambda: done.append(b.cmd("alloc w 1M\n")))
    t.start()
    time.sleep(0.2)
    assert not done
    a.close()
    t.join(5)
    assert done and b.status()["state"] == "admitted"
    assert "admitted on gpu 0" in b.read("log")
    b.close()


def test_hundred_waiters_hold_no_daemon_threads(session, salusd):
    s = session
    s.cmd("need persistent=1M ephemeral=1M\nspin 3000000\n")
    results = []

    def waiter():
        with open(s.file("wait")) as f:
            results.append(f.read())

    threads = [threading.Thread(target=waiter) for _ in range(100)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    # salusd serves with at most 16 FUSE threads; if waiters held them, these
    # reads could only finish after the spin, when the waiters are answered.
    for _ in range(20):
        with open(salusd.path("version")) as f:
            f.read()
        s.status()
    assert not results
    for t in threads:
        t.join(10)
    assert results == ["done 0\n"] * 100


def test_sigkill_client_frees_everything(salusd):
    other = Session(salusd)
    other.cmd("need persistent=8M ephemeral=8M gpu=0\nalloc keep 4M\nfill keep 3\n")
    code = f"""
import os, time
fd = os.open({salusd.path('clone')!r}, os.O_RDWR)
sid = os.read(fd, 64).decode().strip()
os.write(fd, b"need persistent=300M ephemeral=64M gpu=0\\nalloc w 200M\\nbegin\\nspin 20000\\nend x100000\\n")
print(sid, flush=True)
time.sleep(60)
"""
    p = subprocess.Popen(["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE, text=True)
    sid = p.stdout.readline().strip()
    assert sid in os.listdir(salusd.path("sessions"))
    with open(salusd.path("gpus", "0", "memory")) as f:
        assert "persistent_used: 0\n" not in f.read()
    p.kill()
    p.wait()
    t0 = time.time()

    def memory():
        with open(salusd.path("gpus", "0", "memory")) as f:
            return dict(l.split(": ", 1) for l in f.read().splitlines())

    # In-flight iterations (at most the pipeline depth) finish, then all is freed.
    assert wait_until(lambda: sid not in os.listdir(salusd.path("sessions"))
                      and int(memory()["persistent_used"]) == 4 << 20, 1.0), memory()
    assert time.time() - t0 < 1.0
    mem = memory()
    assert int(mem["lanes"]) == 1                       # only `other`'s lane remains
    assert int(mem["persistent_reserved"]) == 8 << 20
    with open(salusd.path("stats")) as f:
        assert "sessions 1\n" in f.read()
    # The other session is untouched.
    other.cmd("begin\nend x2\n")
    assert other.wait() == "done 2\n"
    with open(other.file("mem/keep"), "rb") as f:
        assert struct.unpack("<f", f.read(4)) == (3.0,)
    other.close()


def test_poll_on_status_wakes_when_work_finishes(session):
    import select
    s = session
    s.cmd("need persistent=1M ephemeral=1M\n")
    fd = os.open(s.file("status"), os.O_RDONLY)
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(100) == []           # nothing changed since open
    t0 = time.time()
    s.cmd("spin 200000\n")
    events = p.poll(5000)
    assert events and events[0][1] & select.POLLIN
    assert time.time() - t0 >= 0.15    # woke when the spin finished, not before
    os.close(fd)


def test_a_waiting_clone_write_does_not_block_other_clone_sessions(salusd):
    a, b = Session(salusd), Session(salusd)
    a.cmd("need persistent=1M ephemeral=1M\n")
    b.cmd("need persistent=1M ephemeral=1M\n")
    t = threading.Thread(target=lambda: a.cmd("spin 3000000\nsync\n"))
    t.start()
    time.sleep(0.2)                      # a's write is now waiting in `sync`
    b.cmd("spin 10\n")
    assert t.is_alive()                  # b's write returned while a's still waits
    t.join(10)
    a.close()
    b.close()
