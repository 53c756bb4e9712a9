"""A small PyTorch job for test_salus_run.py: an unmodified training or inference
loop, then (test-only) a report of what salusd shows for its own session, read
before it exits (an attached session ends with its program).

    torch_job.py train|infer N [--wait-key KEY=VALUE] [--sleep-ms MS] [--log FILE] [--gpu-alloc]
                 [--loader-workers N]
"""
import argparse
import ctypes
import os
import sys
import time


def status():
    with open(os.path.join(os.environ["SALUS_SESSION"], "status")) as f:
        return dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)


def wait_for(key, value, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        st = status()
        if st.get(key) == value or time.monotonic() > end:
            return st
        time.sleep(0.02)


class Batches:
    """A map-style dataset for DataLoader whose items come out of a module's
    forward, as transforms that are modules make them: with spawned workers,
    each worker imports torch and runs forwards of its own."""

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        import torch
        with torch.no_grad():
            return torch.nn.Linear(16, 16)(torch.randn(16))


def gpu_alloc():
    """A GPU job's first CUDA calls, through the shim (preloaded): cuInit, the
    primary context (found with cuGetProcAddress, as cudart finds it) and a
    1 MiB cuMemAlloc."""
    cuda, ctx, dptr = ctypes.CDLL(None), ctypes.c_void_p(), ctypes.c_uint64()

    def fn(name, *argtypes):
        p = ctypes.c_void_p()
        assert cuda.cuGetProcAddress(name.encode(), ctypes.byref(p), 12000, ctypes.c_uint64(0)) == 0
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(p.value)

    assert cuda.cuInit(0) == 0
    assert fn("cuDevicePrimaryCtxRetain", ctypes.c_void_p, ctypes.c_int)(ctypes.byref(ctx), 0) == 0
    assert fn("cuCtxSetCurrent", ctypes.c_void_p)(ctx) == 0
    assert cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(1 << 20)) == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "infer"])
    ap.add_argument("n", type=int)
    ap.add_argument("--sleep-ms", type=float, default=0)
    ap.add_argument("--wait-key", default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("--go", default=None, help="wait for this file before import torch")
    ap.add_argument("--stop", default=None, help="with N = 0: train until this file exists")
    ap.add_argument("--loader-workers", type=int, default=0,
                    help="train on batches from a DataLoader with this many spawned workers")
    ap.add_argument("--gpu-alloc", action="store_true",
                    help="after import torch, cuInit and a 1 MiB cuMemAlloc, as a GPU job's "
                         "first CUDA calls (the shim's; SALUS_SHIM_LIBCUDA names the mock driver)")
    ap.add_argument("--fail-first-oom", default=None,
                    help="raise a CUDA OOM unless this file exists (and create it)")
    args = ap.parse_args()
    if args.fail_first_oom and not os.path.exists(args.fail_first_oom):
        open(args.fail_first_oom, "w").close()
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (test)")
    if args.go:  # before import torch, which attaches the process to its session
        print(f"ready {os.getpid()}", file=open(args.log, "a"), flush=True)
        while not os.path.exists(args.go):
            time.sleep(0.01)
    import torch
    if args.gpu_alloc:
        gpu_alloc()
    if args.log:
        print(f"imported {os.getpid()}", file=open(args.log, "a"), flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    log = open(args.log, "a") if args.log else None
    if args.mode == "train":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = iter(torch.utils.data.DataLoader(
            Batches(), batch_size=8, num_workers=args.loader_workers,
            multiprocessing_context="spawn")) if args.loader_workers else None
        i = 0
        while i < args.n or (args.n == 0 and not os.path.exists(args.stop)):
            i += 1
            opt.zero_grad()
            x = next(batches) if batches else torch.randn(8, 16)
            model(x).pow(2).mean().backward()
            opt.step()
            if log:
                print(f"{os.getpid()} {i}", file=log, flush=True)
            time.sleep(args.sleep_ms / 1000)
    else:
        with torch.inference_mode():
            for i in range(args.n):
                model(torch.randn(8, 16))
                time.sleep(args.sleep_ms / 1000)
    key, value = (args.wait_key or f"iterations_completed={args.n or i}").split("=", 1)
    st = wait_for(key, value)
    for k in ("kind", "marking", "iterations_completed", "iterations_done", "iterations_requested",
              "ephemeral", "persistent", "name", "gpu", "pid"):
        print(f"{k}: {st.get(k, '-')}")
    print(f"self_pid: {os.getpid()}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
