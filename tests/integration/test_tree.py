"""The /salus tree: every documented file exists, has its mode, and tells the truth."""
import errno
import os
import stat

import pytest

from conftest import Session


def test_top_level_files_and_modes(salusd):
    names = set(os.listdir(salusd.mnt))
    assert names == {"README", "version", "clone", "policy", "ctl", "stats", "metrics", "gpus", "sessions"}
    modes = {n: stat.S_IMODE(os.stat(salusd.path(n)).st_mode) for n in names}
    assert modes["README"] == 0o444
    assert modes["version"] == 0o444
    assert modes["clone"] == 0o666
    assert modes["policy"] == 0o644
    assert modes["ctl"] == 0o600
    assert modes["stats"] == 0o444
    assert modes["metrics"] == 0o444
    assert modes["sessions"] == 0o1777


def test_version_and_readme(salusd):
    with open(salusd.path("version")) as f:
        words = f.read().split()
    assert words[0] == "salusd" and words[2] == "api"
    with open(salusd.path("README")) as f:
        assert "need persistent=" in f.read()


def test_gpu_files(salusd):
    assert sorted(os.listdir(salusd.path("gpus"))) == ["0", "1"]
    assert sorted(os.listdir(salusd.path("gpus", "0"))) == ["info", "lanes", "memory",
                                                            "processes", "queue"]
    with open(salusd.path("gpus", "1", "info")) as f:
        info = dict(line.split(": ", 1) for line in f.read().splitlines())
    assert info["backend"] == "sim"
    assert info["index"] == "1"
    assert int(info["capacity"]) == 1 << 30
    with open(salusd.path("gpus", "0", "memory")) as f:
        mem = dict(line.split(": ", 1) for line in f.read().splitlines())
    assert int(mem["capacity"]) == 1 << 30
    assert int(mem["free"]) == 1 << 30
    assert mem["lanes"] == "0"
    with pytest.raises(FileNotFoundError):
        os.stat(salusd.path("gpus", "2"))


def test_lanes_and_memory_follow_sessions(salusd):
    s = Session(salusd)
    s.cmd("need persistent=64M ephemeral=128M\n")
    with open(salusd.path("gpus", "0", "lanes")) as f:
        rows = [l.split() for l in f.read().splitlines() if not l.startswith("#")]
    gpu = s.status()["gpu"]
    with open(salusd.path("gpus", gpu, "lanes")) as f:
        rows = [l.split() for l in f.read().splitlines() if not l.startswith("#")]
    assert len(rows) == 1
    lane_id, offset, size, used, members, running = rows[0]
    assert int(size) == 128 << 20 and members == s.id
    with open(salusd.path("gpus", gpu, "memory")) as f:
        mem = dict(line.split(": ", 1) for line in f.read().splitlines())
    assert int(mem["ephemeral"]) == 128 << 20
    assert int(mem["persistent_reserved"]) == 64 << 20
    assert int(mem["free"]) == (1 << 30) - (192 << 20)
    s.close()


def test_stats_are_key_value_lines(salusd):
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M\nbegin\nend x5\n")
    assert s.wait() == "done 5\n"
    with open(salusd.path("stats")) as f:
        stats = dict(line.split(" ", 1) for line in f.read().splitlines())
    assert int(stats["iterations"]) >= 5
    assert int(stats["sessions"]) >= 1
    s.close()


def test_metrics_exposition(salusd):
    with open(salusd.path("metrics")) as f:
        text = f.read()
    assert "# TYPE salus_gpu_memory_bytes gauge" in text
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith("# HELP ") or line.startswith("# TYPE ")
            continue
        name_labels, value = line.rsplit(" ", 1)
        float(value)
        assert name_labels.startswith("salus_")


def test_policy_switch_and_rejection(salusd):
    with open(salusd.path("policy")) as f:
        assert f.readline() == "policy: fair\n"
    with open(salusd.path("policy"), "w") as f:
        f.write("srtf\n")
    with open(salusd.path("policy")) as f:
        assert f.readline() == "policy: srtf\n"
    fd = os.open(salusd.path("policy"), os.O_WRONLY)
    with pytest.raises(OSError) as e:
        os.write(fd, b"lottery\n")
    os.close(fd)
    assert e.value.errno == errno.EINVAL


def test_admin_ctl_drain(salusd):
    fd = os.open(salusd.path("ctl"), os.O_RDWR)
    os.write(fd, b"drain 1\n")
    assert os.read(fd, 100) == b"gpu 1 draining\n"
    with pytest.raises(OSError) as e:
        os.write(fd, b"drain 7\n")
    assert e.value.errno == errno.ENODEV
    with pytest.raises(OSError) as e:
        os.write(fd, b"frobnicate\n")
    assert e.value.errno == errno.EINVAL
    os.close(fd)
    with open(salusd.path("gpus", "1", "info")) as f:
        assert "draining: yes" in f.read()
    # gpu=any avoids the draining GPU; an explicit request for it is refused.
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M gpu=any\n")
    assert s.status()["gpu"] == "0"
    t = Session(salusd)
    with pytest.raises(OSError) as e:
        t.cmd("need persistent=1M ephemeral=1M gpu=1\n")
    assert e.value.errno == errno.EBUSY
    s.close()
    t.close()


def test_busy_fraction_windows(salusd):
    import time
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M gpu=0\nbegin\nspin 100000\nend x15\n")
    time.sleep(1.3)
    with open(salusd.path("gpus", "0", "info")) as f:
        info = dict(line.split(": ", 1) for line in f.read().splitlines())
    with open(salusd.path("gpus", "1", "info")) as f:
        idle = dict(line.split(": ", 1) for line in f.read().splitlines())
    assert float(info["busy_1s"]) > 0.8, info
    assert float(idle["busy_1s"]) == 0.0
    with open(salusd.path("metrics")) as f:
        assert 'salus_gpu_busy_ratio{gpu="0",window="10s"}' in f.read()
    s.close()
