"""salus_gate: a ctypes mirror of client/salus_gate.h, the shared-memory gate
of an attached session, plus the calls to make one from Python.

The C header is the contract; this file copies its layout field by field (a
test compares sizeof and offsets against the compiled header). It is used by
the integration tests, which play the program's part without a GPU, and by
the Python client.
"""

import ctypes
import fcntl
import mmap
import os

MAGIC = 0x5441474553554C53  # "SLUSGATE" little-endian
VERSION = 3
DEAD_MS = 2000
NOTE_BYTES = 512

# state (salusd)
ATTACHING, ATTACHED, DETACHED, HANDED_OVER = 0, 1, 2, 3
# swap_request (salusd), swap_state (program)
SWAP_REQ_NONE, SWAP_REQ_OUT, SWAP_REQ_IN = 0, 1, 2
SWAP_RESIDENT, SWAP_OUT_BUSY, SWAP_SWAPPED, SWAP_IN_BUSY = 0, 1, 2, 3
# marking (program)
MARK_NONE, MARK_EXPLICIT, MARK_SLICE = 0, 1, 2

# fcntl seals (Linux); Python's fcntl module has them from 3.8, spelled out here
# so older interpreters work too.
F_ADD_SEALS = 1033
F_GET_SEALS = 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 1, 2, 4, 8

_u32, _u64, _i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32


class SalusGate(ctypes.Structure):
    """struct salus_gate, field for field."""

    _fields_ = [
        # header: the program's, before attach
        ("magic", _u64),
        ("version", _u32),
        ("size", _u32),
        ("pid", _i32),
        ("uses_gpu", _u32),  # the program's at any time: 1 once it allocated device memory
        # salusd's
        ("state", _u32),
        ("grant_word", _u32),
        ("granted", _u64),
        ("heartbeat", _u64),
        ("budget_bytes", _u64),
        ("yield_requested", _u32),
        ("gpu", _u32),
        ("quantum_ns", _u64),
        ("swap_request", _u32),
        ("swap_seq", _u32),
        ("lane_bytes", _u64),
        ("lane_grant", _u32),
        ("reserved2", _u32),
        ("reserved1", _u64),
        # the program's
        ("requested", _u64),
        ("completed", _u64),
        ("gpu_ns_total", _u64),
        ("charged_bytes", _u64),
        ("peak_bytes", _u64),
        ("launches", _u64),
        ("gate_waits", _u64),
        ("gate_wait_ns", _u64),
        ("oom_refusals", _u64),
        ("marking", _u32),
        ("note_seq", _u32),
        ("note", ctypes.c_char * NOTE_BYTES),
        ("swap_done_seq", _u32),
        ("swap_state", _u32),
        ("swap_result", _i32),
        ("lane_held", _u32),
        ("resident_bytes", _u64),
        ("swapped_bytes", _u64),
        ("swaps_out", _u64),
        ("swaps_in", _u64),
        ("swap_ns", _u64),
        ("unswappable_bytes", _u64),
    ]


SIZE = ctypes.sizeof(SalusGate)


class Gate:
    """A program's side of a gate: the sealed memfd (mapped), the doorbell
    eventfd, and the struct over the mapping. Python's aligned 8-byte loads and
    stores are single instructions on x86-64 and arm64, which is what the
    header's atomics need; the futex wait is left to the shim.

    seals: the seals to add (default: the ones salusd requires plus F_SEAL_SEAL);
    size: the memfd's size (default sizeof); header=False leaves it zeroed."""

    def __init__(self, seals=F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, size=SIZE, header=True):
        self.fd = os.memfd_create("salus-gate", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
            if seals:
                fcntl.fcntl(self.fd, F_ADD_SEALS, seals)
            self.bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            os.close(self.fd)
            raise
        self.g = SalusGate.from_buffer(self.map) if size >= SIZE else None
        if header and self.g is not None:
            self.g.magic = MAGIC
            self.g.version = VERSION
            self.g.size = SIZE
            self.g.pid = os.getpid()

    def attach_line(self):
        return f"attach gate={self.fd} bell={self.bell}\n"

    def ring(self):
        try:
            os.eventfd_write(self.bell, 1)
        except BlockingIOError:
            pass  # the counter is full: salusd has a ring pending anyway

    def note(self, text):
        raw = text.encode()[: NOTE_BYTES - 1]
        ctypes.memset(ctypes.addressof(self.g) + SalusGate.note.offset, 0, NOTE_BYTES)
        ctypes.memmove(ctypes.addressof(self.g) + SalusGate.note.offset, raw, len(raw))
        self.g.note_seq += 1
        self.ring()

    def close(self):
        self.g = None
        try:
            self.map.close()
        except BufferError:
            pass  # a ctypes view is still alive; the mapping goes with the process
        for fd in (self.fd, self.bell):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
