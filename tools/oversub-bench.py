#!/usr/bin/env python3
"""Two hosted jobs whose persistent memory together exceeds the GPU, on a live
salusd: run back to back (--oversubscribe 1: the second waits for admission) and
oversubscribed (both admitted, swapped at iteration boundaries). Prints the total
completion time of each and their ratio, nvshare's Table 2 comparison.

  tools/oversub-bench.py --salusd build/tools/salusd [--memory 256M] [--share 0.75]
                         [--iters 200] [--spin-us 20000] [--ratio 2] [--policy fair]

Runs on the sim backend (salusd's real host memory); salusd is started and stopped
here, on a mount point of its own under a temporary directory."""
import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time


def mounted(path):
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


def run(args, ratio):
    tmp = tempfile.mkdtemp(prefix="salus-oversub-bench-")
    mnt = os.path.join(tmp, "mnt")
    os.mkdir(mnt)
    log = open(os.path.join(tmp, "salusd.log"), "w")
    proc = subprocess.Popen([args.salusd, "--backend", "sim", "--sim-gpus", "1", "--sim-memory",
                             args.memory, "--mount", mnt, "--state-dir", "", "--policy",
                             args.policy, "--oversubscribe", str(ratio)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 20
        while not (mounted(mnt) and os.path.exists(os.path.join(mnt, "version"))):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("salusd did not start")
            time.sleep(0.02)
        size = int(parse_size(args.memory) * args.share) // (1 << 20)
        done = {}

        def job(name):
            fd = os.open(os.path.join(mnt, "clone"), os.O_RDWR)
            sid = os.read(fd, 64).decode().strip()
            t0 = time.time()
            os.write(fd, f"need persistent={size}M ephemeral=1M gpu=0 iters={args.iters}\n".encode())
            os.write(fd, f"alloc w {size}M\nfill w 7 dtype=u8\n".encode())
            os.write(fd, f"begin\nalloc t 256K\ncopy t w 256K\nspin {args.spin_us}\nend x{args.iters}\n"
                     .encode())
            with open(os.path.join(mnt, "sessions", sid, "wait")) as f:
                f.read()
            done[name] = time.time() - t0
            with open(os.path.join(mnt, "sessions", sid, "status")) as f:
                st = dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)
            done[name + "_swaps"] = int(st.get("swaps_out", "0"))
            os.close(fd)

        t0 = time.time()
        threads = [threading.Thread(target=job, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        total = time.time() - t0
        return total, done
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--salusd", default="build/tools/salusd")
    p.add_argument("--memory", default="256M")
    p.add_argument("--share", type=float, default=0.75)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--spin-us", type=int, default=20000)
    p.add_argument("--ratio", type=float, default=2.0)
    p.add_argument("--policy", default="fair")
    args = p.parse_args()
    base, bd = run(args, 1)
    over, od = run(args, args.ratio)
    print(f"back_to_back_s {base:.3f} (jobs {bd['a']:.3f} {bd['b']:.3f})")
    print(f"oversubscribed_s {over:.3f} (jobs {od['a']:.3f} {od['b']:.3f}, swaps out "
          f"{od['a_swaps'] + od['b_swaps']})")
    print(f"speedup {base / over:.3f}")


if __name__ == "__main__":
    main()
