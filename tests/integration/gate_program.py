"""A stand-in for an attached program, without a GPU: it makes a gate
(client/salus_gate.py), attaches itself to a session through the session's ctl
and runs N iterations of a fixed "device time", marking each boundary as
libsalus-shim.so does. Each grant it receives is appended to an order file. After its last
iteration it prints "done" and waits for its stdin to close before exiting.

usage: gate_program.py CTL NAME ITERS ITER_MS ORDER_FILE [GO_FILE]
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client"))
import salus_gate  # noqa: E402


def wait_granted(g, k, limit=20.0):
    end = time.monotonic() + limit
    while g.granted < k:
        if g.state == salus_gate.DETACHED:
            return False
        if time.monotonic() > end:
            raise SystemExit(f"no grant {k} within {limit} s")
        time.sleep(0.0002)
    return True


def main():
    ctl, name, iters, iter_ms, order = sys.argv[1:6]
    go = sys.argv[6] if len(sys.argv) > 6 else None
    iters, iter_ms = int(iters), float(iter_ms)
    gate = salus_gate.Gate()
    g = gate.g
    fd = os.open(ctl, os.O_WRONLY)
    os.write(fd, gate.attach_line().encode())
    print("attached", flush=True)
    while go and not os.path.exists(go):
        time.sleep(0.001)
    g.marking = salus_gate.MARK_EXPLICIT
    g.requested = 1
    gate.ring()
    for k in range(1, iters + 1):
        if not wait_granted(g, k):
            break
        with open(order, "a") as f:
            f.write(f"{name}{k}\n")
        time.sleep(iter_ms / 1000)  # the iteration's work
        # Boundary k: its work is done (completed, device time), the next is asked for.
        g.gpu_ns_total += int(iter_ms * 1e6)
        g.completed = k
        if k < iters:
            g.requested = k + 1
        gate.ring()
    print("done", flush=True)
    # Exiting ends the session (salusd watches the process): stay until told.
    sys.stdin.read()
    os.close(fd)
    gate.close()


if __name__ == "__main__":
    main()
