"""Swap bandwidth of an attached program's movable memory (issue 15).

Starts its own salusd (sim backend: salusd never touches an attached program's
GPU; the program uses the real one) on a temporary mount, runs swap_program
(tests/integration/swap_program.cpp) with libsalus-shim.so preloaded and
SALUS_SWAP=1, holds the program at its iteration boundary with a second
attached session (client/salus_gate.py, priority policy), and then, ROUNDS
times: `swap out` (salusd's /salus/ctl) and `swap in`, each timed by the shim
(the session's swap_ms). With a spill dir, each swap-out comes right after a
plain write(2) of the same bytes to that directory, its own baseline. Before that the program times a plain pinned
cuMemcpyDtoH/HtoD of the same size in the same run: the baseline. Finally it
lets the program run on and check every byte at the same pointer.

With --segments N the program also builds as much memory again of its own
as PyTorch's expandable segments do (cuMemCreate handles of N MiB mapped into
one reservation: PyTorch's large pool takes 20 MiB), which the shim swaps
through its handle translation: the figures are then for both together.

Prints one line per figure (GiB/s and the ratio to the baseline) and exits 0,
or prints why and exits 1. Everything it starts is stopped, and its mount
removed, also on failure.

usage: swap_eval.py --salusd PATH --shim PATH --program PATH [--mib N] [--rounds R]
                    [--libcuda PATH] [--host-limit BYTES --spill-dir DIR] [--segments MIB]
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client"))
import salus_gate  # noqa: E402

GIB = float(1 << 30)


def wait_until(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.002)
    raise RuntimeError(f"timed out waiting for {what}")


class Daemon:
    def __init__(self, salusd, mib):
        self.tmp = tempfile.mkdtemp(prefix="salus-swap-eval-")
        os.chmod(self.tmp, 0o755)
        self.mnt = os.path.join(self.tmp, "mnt")
        os.mkdir(self.mnt)
        self.log = open(os.path.join(self.tmp, "salusd.log"), "w")
        mem = f"{max(2, (4 * mib) // 1024 + 2)}G"
        self.proc = subprocess.Popen(
            [salusd, "--backend", "sim", "--sim-gpus", "1", "--sim-memory", mem, "--mount",
             self.mnt, "--state-dir", os.path.join(self.tmp, "state")],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: os.path.exists(self.path("version")) or self.proc.poll() is not None,
                   20, "salusd to mount")
        if self.proc.poll() is not None:
            raise RuntimeError("salusd exited: " + open(self.log.name).read()[-2000:])

    def path(self, *p):
        return os.path.join(self.mnt, *p)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with open("/proc/mounts") as f:
            if any(line.split()[1] == self.mnt for line in f):
                subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Session:
    def __init__(self, d, need):
        self.d = d
        self.fd = os.open(d.path("clone"), os.O_RDWR)
        self.id = os.read(self.fd, 64).decode().strip()
        os.write(self.fd, (need + "\n").encode())

    def file(self, name):
        return self.d.path("sessions", self.id, name)

    def status(self):
        with open(self.file("status")) as f:
            return dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)

    def close(self):
        os.close(self.fd)


def admin(d, line):
    with open(d.path("ctl"), "w") as f:
        f.write(line + "\n")


def plain_write(where, size):
    """write(2) of `size` fresh bytes in 8 MiB chunks (the shim's spill unit) to an
    O_TMPFILE file in `where`, after a warm-up write of the same size: seconds-old
    freed page-cache pages are slow to reuse on a VM (docs/benchmarks.md). Seconds."""
    data = memoryview(bytes([7]) * size)
    t = 0.0
    for _ in range(2):
        fd = os.open(where, os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            t0 = time.perf_counter()
            done = 0
            while done < size:
                done += os.write(fd, data[done:done + min(8 << 20, size - done)])
            t = time.perf_counter() - t0
        finally:
            os.close(fd)
    return t


def swap(d, s, direction, want):
    before = float(s.status()["swap_ms"])
    admin(d, f"swap {direction} {s.id}")
    wait_until(lambda: (lambda st: st["residency"] == want and st["swap_error"] == "-")(s.status()),
               600, f"swap-{direction}")
    return (float(s.status()["swap_ms"]) - before) / 1e3


def run(a, d, out):
    with open(d.path("policy"), "w") as f:
        f.write("priority\n")
    # As much again in whole handles (e.g. 4080 MiB of 20 MiB handles beside 4096).
    seg_mib = a.mib // a.segments * a.segments if a.segments else 0
    total = a.mib + seg_mib
    s = Session(d, f"need persistent={total * 2}M ephemeral=0 gpu=0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SALUS_")}
    env.update({"LD_PRELOAD": a.shim, "SALUS_SWAP": "1", "SALUS_MOUNT": d.mnt,
                "SALUS_SESSION": os.path.dirname(s.file("ctl")), "SWAP_PROGRAM_BASELINE": "1"})
    if a.libcuda:  # the mock, for CI's smoke run
        env.update({"SALUS_SHIM_LIBCUDA": a.libcuda, "LD_LIBRARY_PATH": os.path.dirname(a.libcuda),
                    "SALUS_MOCK_LEGACY_STREAM": "1"})
    if a.segments:
        env.update({"SWAP_PROGRAM_SEGMENT_MIB": str(seg_mib),
                    "SWAP_PROGRAM_SEGMENT_PIECE_MIB": str(a.segments)})
    if a.spill_dir:
        env.update({"SALUS_SWAP_DIR": a.spill_dir, "SALUS_SWAP_HOST_LIMIT": str(a.host_limit)})
    go = os.path.join(d.tmp, "go")
    p = subprocess.Popen([a.program, str(a.mib), "1", go], env=env, stdout=subprocess.PIPE,
                         text=True)
    holder = salus_gate.Gate()
    hs = Session(d, "need persistent=16M ephemeral=0 priority=10 gpu=0")
    try:
        line = p.stdout.readline().split()
        base = dict(kv.split("=") for kv in line[1:]) if line[:1] == ["baseline"] else None
        if base is None or p.stdout.readline().split()[:1] != ["ready"]:
            raise RuntimeError(f"swap_program did not start (exit {p.poll()})")
        fd = os.open(hs.file("ctl"), os.O_WRONLY)
        os.write(fd, holder.attach_line().encode())
        os.close(fd)
        holder.g.marking = salus_gate.MARK_EXPLICIT
        holder.g.requested = 1
        holder.ring()
        open(go, "w").close()
        wait_until(lambda: holder.g.granted >= 1, 30, "the holder's grant")
        wait_until(lambda: s.status()["iterations_requested"] == "2", 30, "the program's boundary")
        outs, ins, plains = [], [], []
        for _ in range(a.rounds):
            if a.spill_dir:  # right before the swap-out that writes the same bytes
                plains.append(plain_write(a.spill_dir, total << 20))
            outs.append(swap(d, s, "out", "swapped"))
            ins.append(swap(d, s, "in", "resident"))
        holder.g.gpu_ns_total = 1
        holder.g.completed = 1
        holder.ring()
        verified = p.stdout.readline().strip() == "verified 1" and p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        holder.close()
        hs.close()
        s.close()
    size = total * (1 << 20)  # the baseline copies a.mib; GiB/s compare across sizes
    gibs_base = lambda t: a.mib * (1 << 20) / GIB / t if t > 0 else float("inf")  # noqa: E731
    gibs = lambda t: size / GIB / t if t > 0 else float("inf")  # noqa: E731
    b_out, b_in = gibs_base(float(base["dtoh_s"])), gibs_base(float(base["htod_s"]))
    m_out, m_in = gibs(statistics.median(outs)), gibs(statistics.median(ins))
    first = gibs(outs[0])
    if plains:
        p = gibs(statistics.median(plains))
        out(f"plain write(2) of the same bytes to {a.spill_dir} {p:.2f} GiB/s; swap-out "
            f"through the spill file {m_out:.2f} GiB/s = {m_out / p:.3f} x plain write")
    what = (f"{a.mib} MiB in one allocation + {seg_mib} MiB of the program's own {a.segments} MiB "
            "handles (expandable segments)" if a.segments else f"{a.mib} MiB in one allocation")
    out(f"size {what}, {a.rounds} rounds (median)"
        + (f", spill past {a.host_limit} bytes to {a.spill_dir}" if a.spill_dir else ""))
    out(f"baseline pinned cuMemcpyDtoH {b_out:.2f} GiB/s, cuMemcpyHtoD {b_in:.2f} GiB/s")
    out(f"swap-out {m_out:.2f} GiB/s = {m_out / b_out:.3f} x baseline DtoH")
    out(f"swap-in  {m_in:.2f} GiB/s = {m_in / b_in:.3f} x baseline HtoD")
    out(f"first swap-out {first:.2f} GiB/s = {first / b_out:.3f} x baseline DtoH "
        "(it pins its host buffers; later ones reuse them)")
    out("contents after the swaps: " + ("identical" if verified else "DIFFERENT OR PROGRAM FAILED"))
    return verified


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--salusd", required=True)
    ap.add_argument("--shim", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--mib", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--libcuda", default="")
    ap.add_argument("--host-limit", type=int, default=0)
    ap.add_argument("--spill-dir", default="")
    ap.add_argument("--segments", type=int, default=0,
                    help="also MIB of expandable-segment-style handles of this size in MiB")
    a = ap.parse_args()
    d = Daemon(a.salusd, a.mib)
    try:
        ok = run(a, d, lambda line: print(line, flush=True))
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        print(f"swap_eval: {e}", file=sys.stderr)
        ok = False
    finally:
        d.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
