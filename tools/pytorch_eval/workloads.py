#!/usr/bin/env python3
"""Real PyTorch workloads for tools/pytorch-eval.sh (issue 14's GPU evaluation):
a ResNet-50-style CNN and a GPT-2-small-style transformer, trained or served,
natively or under salus-run (the script does not know which: it has nothing of
Salus in it, except that it reads its own session's status at the end when
$SALUS_SESSION is set, for the report).

    workloads.py train --model resnet|gpt [--mode eager|compile|graphs] [--amp]
                 [--steps N | --duration S] [--deterministic] [--tiny] [--device D]
                 [--state-mib N] [--managed-alloc LIB]
    workloads.py infer --model resnet|gpt [--iters N] [--batch B] [--tiny] [--device D]

Prints one JSON object: losses (float.hex, so bit-identity is a string
comparison), throughput over the steps after warm-up, latencies (infer), and
the session's figures when attached. --tiny with --device cpu is the dry run
that CI executes.

--state-mib N gives the job N MiB more training state on the device, read and
written at every step like an optimizer's moment buffers (issue 15: a job that
needs most of the GPU's memory, all of it live). --managed-alloc LIB serves
every PyTorch allocation from unified memory through LIB (um_alloc.c, a
CUDAPluggableAllocator: torch >= 2.0): demand paging with no gate, nvshare's
"scheduler off" row.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- models

class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.c1 = nn.Conv2d(cin, width, 1, bias=False)
        self.b1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.b2 = nn.BatchNorm2d(width)
        self.c3 = nn.Conv2d(width, cout, 1, bias=False)
        self.b3 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNet(nn.Module):
    """ResNet-50's shape ([3, 4, 6, 3] bottlenecks, 64..512 wide, 1000 classes)."""

    def __init__(self, blocks=(3, 4, 6, 3), base=64, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], base
        for i, n in enumerate(blocks):
            width = base * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        # The global average pool as a mean: adaptive_avg_pool2d has no
        # deterministic CUDA backward, and --deterministic (compat's bit-identity
        # against native) makes PyTorch raise on it.
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0: SDPA (flash / mem-eff)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # 1.13 (the CPU dry run): the same maths by hand
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 small's shape (12 layers, 768 wide, 12 heads, 1024 tokens, 50257 words)."""

    def __init__(self, layers=12, d=768, heads=12, seq=1024, vocab=50257):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def build(args):
    if args.model == "resnet":
        model = ResNet((1, 1, 1, 1), 8, 10) if args.tiny else ResNet()
        shape = (args.batch or (4 if args.tiny else 64), 3, 32 if args.tiny else 224,
                 32 if args.tiny else 224)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(*shape, generator=g)
        y = torch.randint(0, 10 if args.tiny else 1000, (shape[0],), generator=g)
        loss_fn = F.cross_entropy
    else:
        cfg = dict(layers=2, d=64, heads=4, seq=32, vocab=512) if args.tiny else {}
        model = GPT(**cfg)
        seq, vocab = cfg.get("seq", 1024), cfg.get("vocab", 50257)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, vocab, (args.batch or (2 if args.tiny else 8), seq), generator=g)
        y = torch.roll(x, -1, 1)

        def loss_fn(logits, target):
            return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))
    return model.to(args.device), x.to(args.device), y.to(args.device), loss_fn


# ---------------------------------------------------------------- helpers

def sync(args):
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def session_report():
    path = os.environ.get("SALUS_SESSION")
    if not path:
        return None
    try:
        with open(os.path.join(path, "status")) as f:
            st = dict(l.split(": ", 1) for l in f.read().splitlines() if ": " in l)
    except OSError as e:
        return {"error": str(e)}
    keys = ("id", "gpu", "kind", "marking", "iterations_completed", "gpu_time_ms",
            "memory_peak", "memory_budget", "gate_waits", "gate_wait_ms", "oom_refusals",
            "name", "swaps_out", "swaps_in", "swap_ms", "memory_charged", "memory_gpu",
            "memory_context", "memory_context_reserve", "memory_unswappable", "pid")
    return {**{k: st.get(k) for k in keys}, "self_pid": str(os.getpid())}


def setup(args):
    torch.manual_seed(0)
    if args.device.startswith("cuda"):
        torch.cuda.manual_seed_all(0)
        torch.backends.cudnn.benchmark = not args.deterministic
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------- train

def use_managed_memory(lib):
    """Every allocation from here on is unified memory (cuMemAllocManaged)."""
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "salus_um_alloc", "salus_um_free")
    torch.cuda.memory.change_current_allocator(alloc)


def train(args):
    if args.managed_alloc:
        if not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
            return {"skipped": f"--managed-alloc needs torch >= 2.0 (this is {torch.__version__})"}
        if not args.device.startswith("cuda"):
            return {"skipped": "--managed-alloc needs a GPU"}
        use_managed_memory(args.managed_alloc)
    setup(args)
    model, x, y, loss_fn = build(args)
    # Extra live state (--state-mib): touched at every step, so it must be on the
    # GPU whenever the job runs.
    state = torch.zeros(args.state_mib << 18, device=args.device) if args.state_mib else None
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    amp = args.amp and args.device.startswith("cuda")
    scaler = torch.cuda.amp.GradScaler(enabled=amp) if amp else None

    graphs = args.mode == "graphs"

    def autocast():  # CUDA graphs replay cached casts wrongly: no autocast cache then
        return torch.autocast("cuda", dtype=torch.float16, enabled=amp, cache_enabled=not graphs)

    def forward_loss():
        with autocast():
            return loss_fn(fwd(x), y)

    fwd = model
    if args.mode == "compile":
        if not hasattr(torch, "compile"):
            return {"skipped": f"torch.compile needs torch >= 2.0 (this is {torch.__version__})"}
        fwd = torch.compile(model)
    elif graphs:
        if not args.device.startswith("cuda"):
            return {"skipped": "CUDA graphs need a GPU"}
        with autocast():
            fwd = torch.cuda.make_graphed_callables(model, (x,))
    losses, times = [], []
    step, start = 0, time.perf_counter()
    while (args.steps and step < args.steps) or (
            args.duration and time.perf_counter() - start < args.duration):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward_loss()
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if state is not None:
            state.mul_(0.5).add_(1.0)
        losses.append(loss.detach())
        if args.sync_every_step:
            sync(args)
        times.append(time.perf_counter() - t0)
        step += 1
    sync(args)
    total = time.perf_counter() - start
    warm = min(args.warmup, max(len(times) - 1, 0))
    # Without a sync per step the host runs ahead; the rate is then over the wall
    # time from the end of warm-up to the final sync.
    measured = total - sum(times[:warm])
    rate = (len(times) - warm) * x.shape[0] / measured if measured > 0 else 0.0
    return {"steps": step, "wall_s": total, "samples_per_s": rate,
            "losses": [float(l).hex() for l in losses]}


# ---------------------------------------------------------------- infer

def infer(args):
    setup(args)
    model, x, _, _ = build(args)
    model.eval()
    lat = []
    with torch.inference_mode():
        for i in range(args.iters + args.warmup):
            t0 = time.perf_counter()
            model(x)
            sync(args)
            if i >= args.warmup:
                lat.append((time.perf_counter() - t0) * 1e3)
    lat.sort()
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None
    return {"iters": len(lat), "p50_ms": pick(0.5), "p95_ms": pick(0.95),
            "mean_ms": sum(lat) / len(lat) if lat else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["train", "infer"])
    ap.add_argument("--model", choices=["resnet", "gpt"], required=True)
    ap.add_argument("--mode", choices=["eager", "compile", "graphs"], default="eager")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--duration", type=float, default=0)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--sync-every-step", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tag", default="")
    ap.add_argument("--state-mib", type=int, default=0)
    ap.add_argument("--managed-alloc", default="")
    args = ap.parse_args()
    if args.what == "train" and not args.steps and not args.duration:
        args.steps = 100
    out = train(args) if args.what == "train" else infer(args)
    out.update({"what": args.what, "model": args.model, "mode": args.mode, "amp": args.amp,
                "tag": args.tag, "device": args.device, "torch": torch.__version__,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "session": session_report()})
    if args.device.startswith("cuda"):
        out["gpu_name"] = torch.cuda.get_device_name()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
