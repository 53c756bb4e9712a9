"""salusd start-up refusals and clean shutdown."""
import os
import signal
import subprocess
import time

import pytest

from conftest import Salusd, Session, is_mounted, wait_until, SALUSD


@pytest.fixture(autouse=True)
def unmount_tmp_path(tmp_path):
    """A refusal test whose salusd unexpectedly mounted must not leave the mount."""
    yield
    for root, dirs, _ in os.walk(tmp_path):
        for d in [root] + [os.path.join(root, x) for x in dirs]:
            if is_mounted(d):
                subprocess.run(["fusermount3", "-u", "-z", d], check=False)


def test_sigterm_drains_unmounts_and_exits_zero(salusd_factory):
    d = salusd_factory().start()
    s = Session(d)
    s.cmd("need persistent=1M ephemeral=1M\nbegin\nspin 50000\nend x1000\n")
    time.sleep(0.1)
    d.proc.send_signal(signal.SIGTERM)
    rc = d.proc.wait(10)
    assert rc == 0, d.daemon_log()
    assert not is_mounted(d.mnt)
    assert "unmounted" in d.daemon_log()
    try:
        s.close()
    except OSError:
        pass


def test_refuses_busy_mountpoint(salusd_factory):
    first = salusd_factory().start()
    out = subprocess.run([SALUSD, "--backend", "sim", "--sim-memory", "64M", "--mount", first.mnt,
                          "--state-dir", ""],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "busy" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    # The running daemon is unaffected.
    assert os.path.exists(first.path("version"))


def test_refuses_cuda_backend_without_cuda(tmp_path):
    out = subprocess.run([SALUSD, "--backend", "cuda", "--mount", str(tmp_path)],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode != 0 and "cuda" in out.stderr


def test_bad_flag_values_are_rejected(tmp_path):
    out = subprocess.run([SALUSD, "--sim-memory", "lots", "--mount", str(tmp_path)],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode != 0 and "--sim-memory" in out.stderr


def test_config_file_is_read(salusd_factory, tmp_path):
    cfg = tmp_path / "salusd.toml"
    cfg.write_text('policy = "srtf"\n[sim]\ngpus = 3\nmemory = "256M"\n')
    d = salusd_factory(extra_args=["--config", str(cfg)]).start()
    # The fixture passes --sim-gpus 2 on the command line: flags win over the file.
    assert sorted(os.listdir(d.path("gpus"))) == ["0", "1"]
    with open(d.path("policy")) as f:
        assert f.readline() == "policy: srtf\n"


def test_refuses_without_dev_fuse(tmp_path):
    import shutil
    if shutil.which("unshare") is None:
        import pytest
        pytest.skip("unshare (util-linux) is not installed")
    # A private mount namespace whose /dev has no fuse node.
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs none /dev && exec {SALUSD} --backend sim --sim-memory 64M "
                          f"--mount {tmp_path} --state-dir ''"], capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "/dev/fuse" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_bad_config_values_are_refused(tmp_path):
    for text, word in [('policy = "lottery"\n', "lottery"), ('[sim]\ngpus = 0\n', "gpus"),
                       ('placement = "random"\n', "random"), ('log_level = "loud"\n', "loud"),
                       ('policy = \n', "config"),
                       ('[attach]\ncontext_reserve = "lots"\n', "attach_context_reserve 'lots'"),
                       ('[attach]\noverrun = "shout"\n',
                        "attach_overrun 'shout': expected warn or kill"),
                       ('idle_warn_s = -1\n', "idle_warn_s -1: expected 0 (never) to 86400")]:
        cfg = tmp_path / "bad.toml"
        cfg.write_text(text)
        out = subprocess.run([SALUSD, "--config", str(cfg), "--mount", str(tmp_path)],
                             capture_output=True, text=True, timeout=10)
        assert out.returncode != 0 and word in out.stderr, (text, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1


def test_help_lists_every_flag():
    out = subprocess.run([SALUSD, "--help"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    for flag in ["--mount", "--backend", "--sim-gpus", "--sim-memory", "--policy", "--admin-group",
                 "--log-level", "--config"]:
        assert flag in out.stdout


def test_a_gpu_idle_while_a_session_waits_is_reported(salusd_factory):
    """--idle-warn: one session holds most of the card and runs nothing, the
    next waits for admission. Past the limit the waiter's log and salusd's say
    so once, with what holds the memory, and gpus/0/info counts the episode."""
    d = salusd_factory(extra_args=["--idle-warn", "0.5"], sim_memory="100M", gpus=1).start()
    holder, waiter = Session(d), Session(d)
    try:
        holder.cmd("need persistent=60M ephemeral=10M gpu=0\n")
        waiter.cmd("need persistent=60M ephemeral=10M gpu=0\n")  # queued: the card is held
        assert wait_until(lambda: "has been idle" in waiter.read("log"), timeout=5)
        log = waiter.read("log")
        assert "while this session waits for admission: needs 60.0M + 10.0M" in log, log
        assert f"admitted and running nothing: session {holder.id}" in log, log
        with open(d.path("gpus/0/info")) as f:
            info = f.read()
        assert "idle_waiting_reports: 1\n" in info, info
        # salusctl's GPU table shows the episode (seconds, last column).
        salusctl = os.path.join(os.path.dirname(os.path.abspath(SALUSD)), "salusctl")
        out = subprocess.run([salusctl, "--mount", d.mnt, "status"], capture_output=True,
                             text=True, timeout=30).stdout
        gpus = out.split("\nGPUS\n")[1].split("\n\n")[0].splitlines()
        assert gpus[0].split()[-1] == "IDLE_WAIT" and gpus[1].split()[-1].endswith("s"), out
    finally:
        waiter.close()
        holder.close()
