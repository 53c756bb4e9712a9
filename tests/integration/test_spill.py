"""The hosted swap's spill file (salusd(8) --swap-dir, design.md "Oversubscription"):
past --swap-host-limit a swapped-out session's bytes go to an unnamed file in the
swap dir, come back bit for bit across many swaps, and leave nothing on disk; a
full disk fails the swap-out with ENOSPC in status and log, and the session stays
resident with its bytes intact."""
import hashlib
import os
import subprocess

import pytest

from conftest import Salusd, Session, gpu_memory, wait_until

M = 1 << 20


def write_pattern(s, name, size, seed):
    data = hashlib.shake_256(f"{seed}".encode()).digest(size)
    with open(s.file(os.path.join("mem", name)), "r+b", buffering=0) as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def read_hash(s, name):
    with open(s.file(os.path.join("mem", name)), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def spill_salusd(swap_dir):
    # A 1M host limit: every 36M swap-out goes through the spill file.
    return Salusd(extra_args=["--oversubscribe", "2", "--policy", "fair", "--swap-host-limit",
                              "1M", "--swap-dir", str(swap_dir)], sim_memory="64M",
                  gpus=1).start()


def test_many_swaps_through_the_spill_file_keep_every_byte(tmp_path):
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    d = spill_salusd(swap_dir)
    try:
        a, b = Session(d), Session(d)
        for s in (a, b):
            s.cmd("need persistent=36M ephemeral=2M gpu=0\n")
        a.cmd("alloc w 36M\n")
        b.cmd("alloc w 36M\n")  # waits until a is spilled
        ha = write_pattern(a, "w", 36 * M, "spill-a")
        hb = write_pattern(b, "w", 36 * M, "spill-b")
        assert int(gpu_memory(d)["spilled"]) == 36 * M  # a's bytes: in the file, not in host memory
        assert gpu_memory(d)["host_swapped"] == "0"
        for rnd in range(4):
            for s in (a, b):
                s.cmd("begin\nalloc t 1M\ncopy t w 1M\nspin 2000\nend x5\n")
            a.wait()
            b.wait()
            assert read_hash(a, "w") == ha, f"round {rnd}: a's buffer changed"
            assert read_hash(b, "w") == hb, f"round {rnd}: b's buffer changed"
            # Only one of them fits: the other one's bytes are in the file.
            assert int(gpu_memory(d)["spilled"]) in (0, 36 * M)
        sa, sb = a.status(), b.status()
        assert int(sa["swaps_out"]) + int(sb["swaps_out"]) >= 4
        assert sa["swap_error"] == "-" and sb["swap_error"] == "-"
        assert sa["error"] == "-" and sb["error"] == "-"
        assert gpu_memory(d)["host_swapped"] == "0"  # nothing held past the 1M limit
        assert os.listdir(swap_dir) == []  # O_TMPFILE: never a name on disk
        a.close()
        b.close()
        assert wait_until(lambda: gpu_memory(d)["persistent_used"] == "0"
                          and gpu_memory(d)["spilled"] == "0", timeout=10)
    finally:
        d.stop()
    assert os.listdir(swap_dir) == []


def test_a_missing_swap_dir_refuses_the_swap_and_keeps_the_session(tmp_path):
    d = spill_salusd(tmp_path / "none")
    try:
        assert "no spill file" in d.daemon_log()
        a = Session(d)
        a.cmd("need persistent=36M ephemeral=2M gpu=0\nalloc w 36M\n")
        ha = write_pattern(a, "w", 36 * M, "nodir")
        b = Session(d)
        b.cmd("need persistent=36M ephemeral=2M gpu=0\nbegin\nspin 100\nend\n")
        assert wait_until(lambda: "no spill file" in a.read("log"), timeout=10)
        assert a.status()["residency"] == "resident"
        assert read_hash(a, "w") == ha
        a.close()
        b.wait()
        b.close()
    finally:
        d.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_spill_disk_fails_the_swap_out_and_loses_nothing(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        d = spill_salusd(small)
        try:
            a = Session(d)
            a.cmd("need persistent=36M ephemeral=2M gpu=0\nalloc w 36M\n")
            ha = write_pattern(a, "w", 36 * M, "full")
            b = Session(d)
            # b's work wants a's room; a's 36M cannot go to an 8M disk.
            b.cmd("need persistent=36M ephemeral=2M gpu=0\nbegin\nspin 100\nend\n")
            assert wait_until(lambda: a.status()["swap_error"] == "ENOSPC", timeout=10)
            assert "ENOSPC" in a.read("log") and str(small) in a.read("log")
            st = a.status()
            assert st["residency"] == "resident" and st["error"] == "-"
            assert read_hash(a, "w") == ha
            # Retried at most once a second, never in a storm.
            logged = a.read("log").count("ENOSPC")
            assert logged <= 3, a.read("log")
            # The failed extent's blocks went back: the disk is empty again.
            assert wait_until(lambda: os.statvfs(small).f_bfree == os.statvfs(small).f_blocks,
                              timeout=5)
            a.close()
            b.wait()  # a gone: b runs
            assert b.status()["error"] == "-"
            b.close()
        finally:
            d.stop()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_stop_with_a_spilled_named_session_saves_it_and_restart_restores_it(tmp_path):
    state, swap_dir = tmp_path / "state", tmp_path / "swap"
    swap_dir.mkdir()
    args = ["--oversubscribe", "2", "--state-dir", str(state), "--swap-host-limit", "1M",
            "--swap-dir", str(swap_dir)]
    hashes = {}
    d = Salusd(extra_args=args, sim_memory="64M", gpus=1).start()
    try:
        for name in ("sa", "sb"):
            os.mkdir(d.path("sessions", name))
            with open(d.path("sessions", name, "ctl"), "w") as f:
                f.write("need persistent=36M ephemeral=2M gpu=0\nalloc w 36M\n")
            data = hashlib.shake_256(name.encode()).digest(36 * M)
            with open(d.path("sessions", name, "mem", "w"), "r+b", buffering=0) as f:
                f.write(data)
            hashes[name] = hashlib.sha256(data).hexdigest()
        assert int(gpu_memory(d)["spilled"]) == 36 * M  # one of them is in the file at the stop
    finally:
        d.stop(timeout=30)
    assert os.listdir(swap_dir) == []
    d = Salusd(extra_args=args, sim_memory="64M", gpus=1).start(timeout=60)
    try:
        for name, h in hashes.items():
            with open(d.path("sessions", name, "mem", "w"), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == h, name
    finally:
        d.stop(timeout=30)
