#!/usr/bin/env python3
"""A stand-in for nvidia-cuda-mps-control, put first on PATH by test_mps.py.

It is NOT MPS: it only lets the tests exercise salusd's management of the
control daemon (start with the right environment, readiness, bounded stop,
a crashed daemon) on machines without a GPU. Like the real program:
  `nvidia-cuda-mps-control -d` daemonises and serves a `control` FIFO in
  $CUDA_MPS_PIPE_DIRECTORY, with its pid in nvidia-cuda-mps-control.pid;
  without -d it reads commands on stdin: `get_server_list` (answers when the
  daemon is up) and `quit` (the daemon removes its pipe and exits).
Each call appends its argv and environment to $CUDA_MPS_LOG_DIRECTORY/calls.jsonl.
MPS_STANDIN_MODE: fail (-d exits 1), never_ready (no FIFO), ignore_quit.
"""
import json
import os
import sys
import time

pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
log_dir = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
mode = os.environ.get("MPS_STANDIN_MODE", "")
control = os.path.join(pipe_dir, "control")
pid_file = os.path.join(pipe_dir, "nvidia-cuda-mps-control.pid")

with open(os.path.join(log_dir, "calls.jsonl"), "a") as f:
    env = {k: v for k, v in os.environ.items() if k.startswith("CUDA_")}
    f.write(json.dumps({"argv": sys.argv[1:], "env": env, "pid": os.getpid()}) + "\n")


def daemon():
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()}\n")
    if mode == "never_ready":
        while True:
            time.sleep(1)
    os.mkfifo(control, 0o666)
    while True:
        with open(control) as pipe:  # blocks until a client writes
            for line in pipe:
                if line.strip() == "quit" and mode != "ignore_quit":
                    os.unlink(control)
                    os.unlink(pid_file)
                    with open(os.path.join(log_dir, "control.log"), "a") as f:
                        f.write("quit\n")
                    return


if sys.argv[1:] == ["-d"]:
    if mode == "fail":
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    if os.fork() > 0:
        sys.exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    daemon()
    os._exit(0)

for command in sys.stdin.read().split("\n"):
    command = command.strip()
    if not command:
        continue
    try:
        fd = os.open(control, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no daemon reads
    except OSError as e:
        print(f"Cannot find MPS control daemon process ({e})")
        sys.exit(1)
    if command == "quit":
        os.write(fd, b"quit\n")
    os.close(fd)
    if command == "get_server_list":
        print("")  # no MPS server started yet: an empty list
