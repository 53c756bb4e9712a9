#!/usr/bin/env python3
"""train_toy.py: a toy "training" loop run through Salus, to show the shape of a job.

The model is one D x D weight matrix W in a persistent buffer: it lives as long as
the session and stays on the GPU between iterations. Each iteration allocates its
activations as ephemeral buffers (freed when the iteration ends, so salusd can
switch to another job at no cost) and does:

    x  = fill(1/B)          a synthetic input batch            (B x D, ephemeral)
    h  = x @ W              the forward pass                   (B x D, ephemeral)
    M  = fill(decay / D)    the "update" operator              (D x D, ephemeral)
    W' = M @ W              the step                           (D x D, ephemeral)
    W  = W'                 commit it into the persistent buffer

One iteration is recorded once (begin ... end) and submitted N times. Because every
entry of M is decay/D, each step replaces every column of W by `decay` times its
mean, so after N steps sum(W) = decay**N * sum(W0): the checksum printed at the end
can be checked exactly.

Run it against a running salusd:
    SALUS_MOUNT=/salus python3 client/examples/train_toy.py --iters 50
or inside a session made by salusctl (it then joins $SALUS_SESSION):
    salusctl run --persistent 1M --ephemeral 4M -- python3 client/examples/train_toy.py
"""
import argparse
import os
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import salus  # noqa: E402  (the client next to this directory)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20, help="training iterations (default 20)")
    ap.add_argument("--dim", type=int, default=64, help="D: weights are D x D (default 64)")
    ap.add_argument("--batch", type=int, default=32, help="B: rows per batch (default 32)")
    ap.add_argument("--decay", type=float, default=0.9, help="per-step factor (default 0.9)")
    ap.add_argument("--mount", default=None, help="salusd mount (default $SALUS_MOUNT or /salus)")
    args = ap.parse_args()
    d, b, n = args.dim, args.batch, args.iters
    f32 = 4
    weights_bytes = d * d * f32
    # Per iteration: x and h (B x D), M and W' (D x D), plus alignment slack.
    ephemeral = 2 * b * d * f32 + 2 * d * d * f32 + 4 * 4096

    if os.environ.get("SALUS_SESSION") and args.mount is None:
        session = salus.Session.attach()  # e.g. under `salusctl run`
    else:
        session = salus.Session(args.mount)
    with session as s:
        s.need(persistent=weights_bytes, ephemeral=ephemeral, iters=n)
        s.alloc("w", weights_bytes)
        w0 = [((i * 7 + 3) % 11) * 0.125 for i in range(d * d)]
        s.write_buffer("w", struct.pack(f"<{d * d}f", *w0))

        started = time.monotonic()
        with s.iteration(repeat=n):
            s.alloc("x", b * d * f32)
            s.alloc("h", b * d * f32)
            s.alloc("m", d * d * f32)
            s.alloc("w_next", d * d * f32)
            s.fill("x", 1.0 / b)
            s.gemm(b, d, d, "x", "w", "h")
            s.fill("m", args.decay / d)
            s.gemm(d, d, d, "m", "w", "w_next")
            s.copy("w", "w_next", weights_bytes)
        done = s.wait()
        elapsed = time.monotonic() - started

        w = struct.unpack(f"<{d * d}f", s.read_buffer("w", weights_bytes))
        st = s.status()
        checksum = sum(w)
        expected = sum(w0) * args.decay ** n
        print(f"session {s.id}: {done} iterations in {elapsed:.3f}s on gpu {st.get('gpu')} "
              f"(mean {st.get('mean_iteration_ms')} ms per iteration)")
        print(f"checksum {checksum:.6f} expected {expected:.6f}")
        ok = abs(checksum - expected) <= 1e-4 * max(1.0, abs(expected))
        if not ok:
            print("train_toy: checksum mismatch", file=sys.stderr)
        return 0 if ok and done >= n else 1


if __name__ == "__main__":
    sys.exit(main())
