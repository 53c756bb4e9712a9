"""salus: a dependency-free Python client for salusd.

salusd's whole API is the /salus filesystem. This module wraps one session's files
(ctl, status, log, wait, mem/NAME) in a small class so that Python jobs need not
format commands by hand. It uses only the standard library (Python 3.11+).

    import salus

    with salus.Session() as s:                  # opens /salus/clone
        s.need(persistent="64M", ephemeral="256M", iters=100)
        s.alloc("w", 4 << 20)
        s.write_buffer("w", initial_weights)    # bytes-like, through mem/w
        with s.iteration(repeat=100):           # begin ... end x100
            s.alloc("tmp", 8 << 20)
            s.gemm(256, 256, 256, "w", "w", "tmp")
        print(s.wait())                         # blocks: 100
        weights = s.read_buffer("w")

Bulk data moves faster with upload/download than through mem/ files; salusd
copies it in chunks through pinned staging, ordered with the session's work:

    s.upload("w", weights)                      # through a shared-memory segment
    s.download_file("w", "/ckpt/w.bin")         # a checkpoint: salusd writes the
    s.upload_file("w", "/ckpt/w.bin")           # file as you, and reads it back
    with salus.Segment(64 << 20) as seg:        # a segment kept for many batches
        seg.buf[:n] = batch
        s.upload_segment("x", seg, n)

Failures raise OSError with the errno salusd returned (so FileNotFoundError,
PermissionError ... can be caught) and a message that ends with the last line of
the session's log, where salusd explains what went wrong.

The mount point is $SALUS_MOUNT, else /salus. Session.attach() joins an existing
session directory, by default $SALUS_SESSION (set by `salusctl run`).

A program run by `salus-run` (an attached session: it keeps its own CUDA context)
marks its iteration boundaries with step(), or a block per iteration:

    for batch in data:
        with salus.iteration():                 # or: ...; salus.step()
            train_step(batch)

Both call salus_step() of libsalus-shim.so, which salus-run preloads; without
it they warn once and do nothing. salus-run marks PyTorch optimizer steps by
itself (see salus-run(1)), so most scripts need neither.
"""

import contextlib
import ctypes
import errno as _errno
import os
import secrets
import sys
import threading

__all__ = ["Session", "Segment", "default_mount", "step", "iteration", "attached", "iterations",
           "lane_release"]


def default_mount():
    """$SALUS_MOUNT, else /salus."""
    return os.environ.get("SALUS_MOUNT") or "/salus"


_shim_lock = threading.Lock()
_shim = None  # (salus_step, salus_attached, salus_iterations), or False once found missing


def _shim_functions():
    """The shim's entry points in this process, looked up once; None without it."""
    global _shim
    with _shim_lock:
        if _shim is None:
            try:
                lib = ctypes.CDLL(None)
                fns = (lib.salus_step, lib.salus_attached, lib.salus_iterations)
            except (AttributeError, OSError):
                _shim = False
                print("salus: libsalus-shim.so is not loaded in this process (run it under "
                      "salus-run); salus.step() does nothing", file=sys.stderr)
            else:
                fns[0].restype, fns[1].restype = ctypes.c_int, ctypes.c_int
                fns[2].restype = ctypes.c_uint64
                for f in fns:
                    f.argtypes = []
                _shim = fns
        return _shim or None


def lane_release():
    """With SALUS_SHARED_LANE=alloc or segments: PyTorch's cached GPU memory goes
    back to the shared lane before the boundary (synchronize, then empty_cache), so that only
    segments holding live tensors are promoted to the program's own memory.
    Nothing without torch imported or before CUDA is initialised. step() and
    salus-run's automatic marks call it before every boundary."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if os.environ.get("SALUS_SHARED_LANE") not in ("alloc", "segments"):
        return
    if cuda is None or not cuda.is_initialized():
        return
    try:  # never synchronize inside CUDA graph capture: it would invalidate it
        if cuda.is_current_stream_capturing():
            return
    except (AttributeError, RuntimeError):  # an older or CPU-only torch
        pass
    cuda.synchronize()
    cuda.empty_cache()


def step():
    """An iteration boundary: ends the running iteration and returns once salusd
    grants the next one. Returns 0, or -errno when the program is not attached
    (it then runs ungated). Without the shim: a warning the first time, then 0.
    With SALUS_SHARED_LANE=alloc or segments, PyTorch's cached GPU memory is released first
    (torch.cuda.synchronize() and torch.cuda.empty_cache())."""
    fns = _shim_functions()
    if fns:
        lane_release()
    return fns[0]() if fns else 0


@contextlib.contextmanager
def iteration():
    """`with salus.iteration():` makes the block one iteration: a boundary when it
    ends, also when it raises."""
    try:
        yield
    finally:
        step()


def attached():
    """True while salusd serves this process's gate."""
    fns = _shim_functions()
    return bool(fns and fns[1]())


def iterations():
    """Iteration boundaries passed so far in this process (0 without the shim)."""
    fns = _shim_functions()
    return int(fns[2]()) if fns else 0


def _size(value):
    """A size for a command: an int (bytes) or a string with a K/M/G suffix."""
    if isinstance(value, bool):
        raise TypeError("a size must be an int or a string like '64M'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"negative size {value}")
        return str(value)
    value = str(value)
    if not value or any(c.isspace() or c == "#" for c in value):
        raise ValueError(f"bad size {value!r}")
    return value


def _word(value, what):
    value = str(value)
    if not value or any(c.isspace() or c == "#" for c in value):
        raise ValueError(f"bad {what} {value!r}")
    return value


def _ref(buf, offset):
    return f"{_word(buf, 'buffer name')}+{offset}" if offset else _word(buf, "buffer name")


def _strip_timestamp(line):
    if line.startswith("["):
        close = line.find("] ")
        if close >= 0:
            return line[close + 2:]
    return line


class _Closing:
    """close() at the end of a `with` block and when garbage-collected."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class Session(_Closing):
    """One salusd session.

    Session()            a new session through <mount>/clone; closing it ends the
                         session and frees everything it holds.
    Session(name="x")    a named session (mkdir sessions/x); close() removes it.
    Session.attach(dir)  an existing session directory (default $SALUS_SESSION);
                         close() leaves it in place.
    """

    def __init__(self, mount=None, *, name=None):
        self.mount = (mount or default_mount()).rstrip("/") or "/"
        self._fd = None
        self._remove_dir = False
        self._batch = None
        if name is None:
            clone = os.path.join(self.mount, "clone")
            try:
                self._fd = os.open(clone, os.O_RDWR | os.O_CLOEXEC)
                self.id = os.read(self._fd, 64).decode().strip()
            except OSError as e:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                raise OSError(e.errno, f"{clone}: cannot open a session: {os.strerror(e.errno)}"
                              " (is salusd mounted there? set $SALUS_MOUNT)") from None
            self.dir = os.path.join(self.mount, "sessions", self.id)
        else:
            self.id = _word(name, "session name")
            self.dir = os.path.join(self.mount, "sessions", self.id)
            try:
                os.mkdir(self.dir, 0o700)
            except OSError as e:
                raise OSError(e.errno, f"{self.dir}: mkdir: {os.strerror(e.errno)}") from None
            self._remove_dir = True
            self._open_ctl()

    @classmethod
    def attach(cls, path=None):
        """Joins an existing session directory (default $SALUS_SESSION)."""
        path = path or os.environ.get("SALUS_SESSION")
        if not path:
            raise OSError(_errno.ENOENT, "attach: no session directory given and $SALUS_SESSION "
                          "is not set")
        path = path.rstrip("/")
        self = cls.__new__(cls)
        self._fd = None
        self._remove_dir = False
        self._batch = None
        self.dir = path
        self.id = os.path.basename(path)
        parent = os.path.dirname(path)
        self.mount = os.path.dirname(parent) if os.path.basename(parent) == "sessions" \
            else default_mount()
        self._open_ctl()
        return self

    def _open_ctl(self):
        ctl = self.path("ctl")
        try:
            self._fd = os.open(ctl, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            if self._remove_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(self.dir)
                self._remove_dir = False
            raise OSError(e.errno, f"{ctl}: {os.strerror(e.errno)}") from None

    def __repr__(self):
        return f"<salus.Session {self.id} at {self.dir}>"

    # ------------------------------------------------------------ lifetime

    def close(self):
        """Ends the session: closes the clone fd, or removes a named session."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._remove_dir:
            self._remove_dir = False
            try:
                os.rmdir(self.dir)
            except FileNotFoundError:
                pass

    def path(self, name):
        return os.path.join(self.dir, name)

    # ------------------------------------------------------------ errors

    def _error(self, err, what, with_log=True):
        msg = f"session {self.id}: {what}: {os.strerror(err)}"
        if with_log:
            last = self.last_log_line()
            if last:
                msg += f" [salusd log: {last}]"
        return OSError(err, msg)

    # ------------------------------------------------------------ commands

    def command(self, text):
        """Sends command text in one write(); raises OSError if salusd rejects it.
        Inside `with iteration():` the text is kept and sent with the iteration."""
        if not text.endswith("\n"):
            text += "\n"
        if self._batch is not None:
            self._batch.append(text)
            return
        self._send(text)

    def _send(self, text):
        if self._fd is None:
            raise OSError(_errno.EBADF, f"session {self.id}: closed")
        try:
            os.write(self._fd, text.encode())
        except OSError as e:
            shown = "; ".join(text.rstrip("\n").splitlines())
            if len(shown) > 80:
                shown = shown[:77] + "..."
            raise self._error(e.errno, repr(shown)) from None

    def need(self, persistent, ephemeral, *, iters=None, priority=None, gpu=None):
        """Declares the session's memory; admission follows (state queued until then).
        gpu defaults to $SALUS_GPU (set by a `salusctl cdi` device), if set."""
        if gpu is None and os.environ.get("SALUS_GPU"):
            gpu = os.environ["SALUS_GPU"]
        line = f"need persistent={_size(persistent)} ephemeral={_size(ephemeral)}"
        if iters is not None:
            line += f" iters={int(iters)}"
        if priority is not None:
            line += f" priority={int(priority)}"
        if gpu is not None:
            line += f" gpu={_word(gpu, 'gpu')}"
        self.command(line)

    def alloc(self, name, size):
        """Outside an iteration: persistent; inside one: ephemeral, freed at its end."""
        self.command(f"alloc {_word(name, 'buffer name')} {_size(size)}")

    def free(self, name):
        self.command(f"free {_word(name, 'buffer name')}")

    def fill(self, buf, value, *, dtype="f32", offset=None, length=None):
        """Sets every element of buf (or off=offset len=length bytes of it) to value."""
        if dtype not in ("f32", "i32", "u8"):
            raise ValueError(f"dtype must be f32, i32 or u8, not {dtype!r}")
        v = repr(float(value)) if dtype == "f32" else str(int(value))
        line = f"fill {_ref(buf, 0)} {v} dtype={dtype}"
        if offset is not None:
            line += f" off={_size(offset)}"
        if length is not None:
            line += f" len={_size(length)}"
        self.command(line)

    def copy(self, dst, src, length, *, dst_offset=0, src_offset=0):
        self.command(f"copy {_ref(dst, dst_offset)} {_ref(src, src_offset)} {_size(length)}")

    def gemm(self, m, n, k, a, b, c):
        """C[m x n] = A[m x k] @ B[k x n] in f32."""
        self.command(f"gemm {int(m)} {int(n)} {int(k)} {_word(a, 'A')} {_word(b, 'B')} "
                     f"{_word(c, 'C')}")

    def spin(self, usec, *, util=None):
        self.command(f"spin {int(usec)}" + (f" util={float(util)!r}" if util is not None else ""))

    def priority(self, p):
        self.command(f"priority {int(p)}")

    def run(self, n):
        """Submits the last recorded iteration n more times."""
        self.command(f"run {int(n)}")

    def sync(self):
        """Returns when all earlier work has finished."""
        self.command("sync")

    @contextlib.contextmanager
    def iteration(self, repeat=1):
        """Records the commands issued inside the block as one iteration and submits
        it `repeat` times.

        The commands are sent at the end of the block in one write, "begin ... end
        xREPEAT". If the block raises, nothing is sent. If a line fails, nothing is
        submitted and the OSError names the line (from the log); salusd then still
        holds the lines before it as an open recording (it has no command to abort
        one): send "end" to submit them anyway, or close the session."""
        if self._batch is not None:
            raise RuntimeError("iteration() inside iteration()")
        repeat = int(repeat)
        if repeat < 1:
            raise ValueError("repeat must be at least 1")
        self._batch = []
        try:
            yield self
            text = "begin\n" + "".join(self._batch) + f"end x{repeat}\n"
        finally:
            self._batch = None
        self._send(text)

    # ------------------------------------------------------------ results

    def wait(self):
        """Blocks until all submitted work is done; returns the iterations done."""
        try:
            with open(self.path("wait"), "rb", buffering=0) as f:
                text = f.read().decode()
        except OSError as e:
            raise self._error(e.errno, "wait") from None
        parts = text.split()
        return int(parts[1]) if len(parts) >= 2 and parts[0] == "done" else 0

    def status(self):
        """The status file as a dict: state, gpu, lane, iterations_done, ..."""
        try:
            with open(self.path("status"), "rb", buffering=0) as f:
                text = f.read().decode()
        except OSError as e:
            raise self._error(e.errno, "status", with_log=False) from None
        out = {}
        for line in text.splitlines():
            key, sep, value = line.partition(": ")
            if sep:
                out[key] = value
        return out

    def log(self, n=None):
        """The session's log lines (oldest first) without timestamps; the last n."""
        try:
            with open(self.path("log"), "rb", buffering=0) as f:
                lines = [_strip_timestamp(l) for l in f.read().decode().splitlines()]
        except OSError as e:
            raise self._error(e.errno, "log", with_log=False) from None
        return lines[-n:] if n else lines

    def last_log_line(self):
        try:
            lines = self.log(1)
        except OSError:
            return ""
        return lines[-1] if lines else ""

    # ------------------------------------------------------------ buffer contents

    def write_buffer(self, name, data, offset=0):
        """Copies bytes-like `data` into buffer `name` at `offset` (through mem/NAME)."""
        p = self.path("mem/" + _word(name, "buffer name"))
        mv = memoryview(data).cast("B")
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self._error(e.errno, p) from None
        try:
            done = 0
            while done < mv.nbytes:
                done += os.pwrite(fd, mv[done:], offset + done)
        except OSError as e:
            raise self._error(e.errno, p + ": write") from None
        finally:
            os.close(fd)
            mv.release()

    def read_buffer(self, name, length=None, offset=0):
        """Reads `length` bytes (default: to the end) of buffer `name` from `offset`."""
        p = self.path("mem/" + _word(name, "buffer name"))
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self._error(e.errno, p) from None
        try:
            if length is None:
                length = max(0, os.fstat(fd).st_size - offset)
            out = bytearray()
            while len(out) < length:
                chunk = os.pread(fd, length - len(out), offset + len(out))
                if not chunk:
                    raise self._error(_errno.ERANGE, f"{p}: read past the end of the buffer",
                                      with_log=False)
                out += chunk
            return bytes(out)
        except OSError as e:
            if e.errno == _errno.ERANGE:
                raise
            raise self._error(e.errno, p + ": read") from None
        finally:
            os.close(fd)

    # ------------------------------------------------------------ transfers

    def _transfer(self, verb, buf, offset, endpoint, length, sync):
        line = f"{verb} {_ref(buf, offset)} {endpoint} {_size(length)}"
        self.command(line + ("\nsync" if sync else ""))

    def upload(self, buf, data, offset=0):
        """Copies bytes-like `data` into buffer `buf` at `offset` through a
        temporary POSIX shared-memory segment: `upload BUF[+OFF] shm:SEG LEN`, then
        `sync`. The segment is removed afterwards, whatever happens."""
        mv = memoryview(data).cast("B")
        try:
            with Segment(mv.nbytes) as seg:
                seg.buf[:mv.nbytes] = mv
                self.upload_segment(buf, seg, mv.nbytes, offset=offset)
        finally:
            mv.release()

    def download(self, buf, length, offset=0):
        """Returns `length` bytes of buffer `buf` from `offset`, copied out
        through a temporary shared-memory segment."""
        length = int(length)
        with Segment(length) as seg:
            self.download_segment(buf, seg, length, offset=offset)
            return bytes(seg.buf[:length])

    def upload_segment(self, buf, seg, length=None, *, offset=0, seg_offset=0, sync=True):
        """`upload` from a Segment you keep (no copy on this side): bytes
        [seg_offset, seg_offset+length) of `seg` into `buf` at `offset`. With
        sync=False the call returns once salusd has queued the transfer: do not
        touch those bytes of the segment before wait()/sync()."""
        if length is None:
            length = seg.size - seg_offset
        self._transfer("upload", buf, offset, f"shm:{_segref(seg, seg_offset)}", length, sync)

    def download_segment(self, buf, seg, length=None, *, offset=0, seg_offset=0, sync=True):
        """`download` into a Segment you keep; see upload_segment."""
        if length is None:
            length = seg.size - seg_offset
        self._transfer("download", buf, offset, f"shm:{_segref(seg, seg_offset)}", length, sync)

    def upload_file(self, buf, path, length=None, *, offset=0, file_offset=0, sync=True):
        """Loads `length` bytes (default: the rest of the file) of the file at
        `path` from `file_offset` into buffer `buf` at `offset`. salusd reads the
        file itself, as you, with io_uring: nothing passes through this process.
        This is how a checkpoint is loaded back."""
        path = _abspath(path)
        if length is None:
            length = os.stat(path).st_size - int(file_offset)
        self._transfer("upload", buf, offset, f"file:{_fileref(path, file_offset)}", length, sync)

    def download_file(self, buf, path, length=None, *, offset=0, file_offset=0, sync=True):
        """Saves `length` bytes (default: the rest of the buffer) of buffer `buf`
        from `offset` into the file at `path`, at `file_offset`. salusd creates the
        file as you (mode 0666 & ~umask) if it does not exist and never truncates
        it: to replace a file, remove it first. This is how a checkpoint is saved."""
        path = _abspath(path)
        if length is None:
            length = os.stat(self.path("mem/" + _word(buf, "buffer name"))).st_size - int(offset)
        self._transfer("download", buf, offset, f"file:{_fileref(path, file_offset)}", length,
                       sync)


def _abspath(path):
    path = os.path.abspath(os.fspath(path))
    if any(c.isspace() or c == "#" for c in path):
        raise ValueError(f"salusd commands cannot name a path with spaces or '#': {path!r}")
    return path


def _fileref(path, file_offset):
    return f"{path}+{int(file_offset)}" if file_offset else path


def _segref(seg, seg_offset):
    return f"{seg.name}+{int(seg_offset)}" if seg_offset else seg.name


class Segment(_Closing):
    """A POSIX shared-memory segment of `size` bytes for upload/download: the
    file /dev/shm/NAME, created here with mode 0600, mapped, and removed by
    close(). salusd accepts only segments owned by the writing uid.

        with salus.Segment(64 << 20) as seg:
            seg.buf[:n] = batch                       # a writable memoryview
            s.upload_segment("x", seg, n)
    """

    def __init__(self, size, *, name=None, directory="/dev/shm"):
        import mmap
        self.size = int(size)
        if self.size < 0:
            raise ValueError(f"negative segment size {size}")
        self.name = name or f"salus-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(directory, self.name)
        self._map = None
        self.buf = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size)
            if self.size:
                self._map = mmap.mmap(fd, self.size)
                self.buf = memoryview(self._map)
            else:
                self.buf = memoryview(b"")
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)

    def close(self):
        """Unmaps and removes the segment; idempotent."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None
