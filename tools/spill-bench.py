#!/usr/bin/env python3
"""Throughput of the hosted swap's spill file (salusd(8) --swap-dir) against a
plain write of the same bytes to the same directory, in the same run.

For each round, on a live salusd (sim backend, --oversubscribe 2, one GPU of
1.5 x SIZE): session A allocates SIZE and fills it, session B then allocates
SIZE, which only fits once the residency planner has swapped A out. A's
`swap_ms` after that one swap-out is its whole swap-out: the device copy into
staging blocks and, past --swap-host-limit, the io_uring write of the spill
file. The same is run against a salusd whose host limit holds A (no spill
file; salusd's debug log gives the spill thread's own time for that write), and
the baseline writes SIZE bytes with write(2) in 8 MiB chunks to an
O_TMPFILE file in the same directory just before each swap (like the spill
file: no fsync, so both go to the page cache and meet the same writeback).
The two writes of a round come back to back, after a warm-up write of the same
size: on this machine (a VM) a write into page-cache pages that the kernel
freed seconds earlier runs 5 to 10 times slower than one right after another
write (host memory given back and faulted in again), which would otherwise
decide the comparison. Prints, for each salusd, the median swap-out and plain-write GiB/s and the
median over rounds of plain-write time / swap-out time; then the same for the
spill file's write alone.

  tools/spill-bench.py --salusd build/tools/salusd [--size 512M] [--rounds 5]
                       [--dir /var/tmp] [--verbose]

salusd is started and stopped here, on a mount point of its own under a
temporary directory."""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def mounted(path):
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


def status(mnt, sid):
    with open(os.path.join(mnt, "sessions", sid, "status")) as f:
        return dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)


def memory(mnt):
    with open(os.path.join(mnt, "gpus", "0", "memory")) as f:
        return dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)


def wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def swap_outs(args, host_limit):
    """A's swap-out time (s) in each round, on a salusd with this host limit, each
    paired with a plain write of the same bytes just before it (s): the page
    cache's state (dirty pages being written back) changes from round to round,
    and a pair sees the same."""
    size = parse_size(args.size)
    mib = size >> 20
    tmp = tempfile.mkdtemp(prefix="salus-spill-bench-")
    mnt = os.path.join(tmp, "mnt")
    os.mkdir(mnt)
    log = open(os.path.join(tmp, "salusd.log"), "w")
    proc = subprocess.Popen(
        [args.salusd, "--backend", "sim", "--sim-gpus", "1", "--sim-memory",
         f"{mib * 3 // 2 + 8}M", "--mount", mnt, "--state-dir", "", "--policy", "fair",
         "--oversubscribe", "2", "--swap-host-limit", host_limit, "--swap-dir", args.dir,
         "--log-level", "debug"],
        stdout=log, stderr=subprocess.STDOUT)
    times = []
    try:
        wait_for(lambda: mounted(mnt) and os.path.exists(os.path.join(mnt, "version")), 20,
                 "salusd to start")
        for _ in range(args.rounds):
            fds = []
            try:
                sids = []
                for _ in range(2):
                    fd = os.open(os.path.join(mnt, "clone"), os.O_RDWR)
                    fds.append(fd)
                    sids.append(os.read(fd, 64).decode().strip())
                a, b = sids
                os.write(fds[0], f"need persistent={mib}M ephemeral=1M gpu=0\n".encode())
                os.write(fds[0], f"alloc w {mib}M\nfill w 7 dtype=u8\n".encode())
                os.write(fds[1], f"need persistent={mib}M ephemeral=1M gpu=0\n".encode())
                # Past A's residency quantum, so that A's swap-out starts at B's alloc,
                # right after the plain write (see above).
                time.sleep(float(status(mnt, a)["resident_quantum_ms"]) / 1e3 + 0.1)
                plain_write(args.dir, size)  # warm-up
                plain = plain_write(args.dir, size)
                os.write(fds[1], f"alloc w {mib}M\n".encode())  # waits for A's room
                wait_for(lambda: status(mnt, a).get("residency") == "swapped", 60,
                         "A to be swapped out")
                st = status(mnt, a)
                if st["swaps_out"] != "1" or st["swaps_in"] != "0" or st["swap_error"] != "-":
                    raise RuntimeError(f"unexpected swap state of A: {st}")
                spilled = int(st["memory_spilled"])
                if (spilled == size) != (host_limit == "1M"):
                    raise RuntimeError(f"A's spill is {spilled} bytes with host limit {host_limit}")
                times.append((float(st["swap_ms"]) / 1e3, plain, file_write(log.name, spilled)))
            finally:
                for fd in fds:
                    os.close(fd)
            wait_for(lambda: memory(mnt).get("persistent_used") == "0"
                     and memory(mnt).get("spilled") == "0", 30, "the sessions to end")
        return times
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def file_write(log_path, spilled):
    """The spill thread's time for the last write of the spill file (s), from
    salusd's debug log; None when nothing was spilled."""
    if not spilled:
        return None
    deadline = time.time() + 5
    while time.time() < deadline:
        with open(log_path) as f:
            lines = [ln for ln in f if f"spill: wrote {spilled} bytes in " in ln]
        if lines:
            return float(lines[-1].split(" bytes in ")[1].split(" ms")[0]) / 1e3
        time.sleep(0.05)
    raise RuntimeError("no spill write in salusd's log")


def plain_write(where, size):
    """write(2) of `size` bytes in 8 MiB chunks to an O_TMPFILE file in `where` (s)."""
    # The same bytes as the swap's: SIZE of fresh memory, like its staging blocks
    # (an 8 MiB buffer written again and again would stay in the CPU's cache).
    data = memoryview(bytes([7]) * size)
    fd = os.open(where, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < size:
            done += os.write(fd, data[done:done + min(8 << 20, size - done)])
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--salusd", default="build/tools/salusd")
    p.add_argument("--size", default="512M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--verbose", action="store_true", help="every round's times too")
    args = p.parse_args()
    gib = parse_size(args.size) / (1 << 30)
    med = statistics.median
    host = swap_outs(args, "64G")
    spill = swap_outs(args, "1M")
    print(f"size {args.size} rounds {args.rounds} dir {args.dir} (medians; GiB/s)")
    for name, rounds in (("host", host), ("spill", spill)):
        swap = med(t for t, _, _ in rounds)
        plain = med(p for _, p, _ in rounds)
        print(f"swap_out_{name} {gib / swap:.3f} plain_write {gib / plain:.3f} "
              f"ratio {med(p / t for t, p, _ in rounds):.3f}")
    if args.verbose:
        for name, rounds in (("host", host), ("spill", spill)):
            for t, p, w in rounds:
                print(f"  {name}: swap_out_s {t:.3f} plain_write_s {p:.3f}"
                      + (f" file_write_s {w:.3f}" if w is not None else ""))
    write = med(w for _, _, w in spill)
    print(f"spill_file_write {gib / write:.3f} plain_write {gib / med(p for _, p, _ in spill):.3f} "
          f"ratio {med(p / w for _, p, w in spill):.3f}")


if __name__ == "__main__":
    main()
