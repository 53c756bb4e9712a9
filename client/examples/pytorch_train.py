#!/usr/bin/env python3
"""pytorch_train.py: an ordinary PyTorch training loop with nothing of Salus in it.

Run it under salus-run and salusd schedules it one optimizer step at a time:

    salus-run --persistent 64M --ephemeral 256M -- python3 client/examples/pytorch_train.py

salus-run preloads libsalus-shim.so and turns on the automatic iteration marks,
so every optimizer.step() is an iteration boundary. It uses the GPU when torch
sees one, else the CPU.
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(args.batch, 64, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    print(f"{args.steps} steps on {dev}, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
