"""salus-run against a real salusd (sim backend) with libsalus-shim.so and
Debian's CPU torch: the automark's boundaries as salusd counts them, FAIR
interleaving of two jobs, exit status, signals, --measure, --retry-on-oom, and
the command line's errors.

The tests that run a program need the shim (built where cuda.h is) and, for
PyTorch, python3-torch; they skip with the reason otherwise."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SALUSD, children, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TOOLS = os.path.dirname(os.path.abspath(SALUSD))
SALUS_RUN = os.path.join(TOOLS, "salus-run")
SHIM = os.path.join(os.path.dirname(TOOLS), "client", "shim", "libsalus-shim.so")
JOB = os.path.join(HERE, "torch_job.py")
LAUNCHER = os.path.join(HERE, "torch_launcher.py")
NOTEBOOK = os.path.join(HERE, "notebook_driver.py")
MOCK_DIR = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
PY = sys.executable


def have_torch():
    return subprocess.run([PY, "-c", "import torch"], capture_output=True).returncode == 0


needs_shim = pytest.mark.skipif(not os.path.exists(SHIM),
                                reason=f"libsalus-shim.so not built at {SHIM} (needs cuda.h)")
needs_torch = pytest.mark.skipif(not have_torch(), reason="python3-torch is not installed")
needs_jupyter = pytest.mark.skipif(
    subprocess.run([PY, "-c", "import jupyter_client, ipykernel"], capture_output=True).returncode,
    reason="python3-jupyter-client and python3-ipykernel are not installed")
needs_mock = pytest.mark.skipif(not os.path.isdir(MOCK_DIR),
                                reason="SALUS_TEST_CUDA_MOCK_DIR (the mock libcuda) is not set")


def mock_driver_env():
    """The shim's driver is the mock libcuda; the shim's boundary events go to
    the legacy stream, which the mock emulates only when asked."""
    return {"SALUS_SHIM_LIBCUDA": os.path.join(MOCK_DIR, "libcuda.so.1"),
            "SALUS_MOCK_LEGACY_STREAM": "1"}


def env():
    e = {k: v for k, v in os.environ.items()
         if k not in ("LD_PRELOAD", "SALUS_AUTOMARK", "SALUS_SESSION", "SALUS_SHIM")}
    return e


def salus_run(d, *args, timeout=120, extra_env=None, **kw):
    return subprocess.run([SALUS_RUN, "--mount", d.mnt, *args], capture_output=True, text=True,
                          timeout=timeout, env={**env(), **(extra_env or {})}, **kw)


def report(stdout):
    return dict(l.split(": ", 1) for l in stdout.splitlines() if ": " in l)


def sessions(d):
    return [s for s in os.listdir(d.path("sessions"))]


def status(d, sid):
    try:
        with open(d.path("sessions", sid, "status")) as f:
            return dict(l.split(": ", 1) for l in f.read().splitlines() if ": " in l)
    except OSError:
        return None


def stop(p):
    """Ends a salus-run we started and its program (SIGTERM is forwarded)."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            for c in children(p.pid):
                os.kill(c, signal.SIGKILL)
            p.kill()
            p.wait()


# ---------------------------------------------------------------- the command line

@pytest.mark.parametrize("args, message", [
    ([], "no program to run"),
    (["--measure", "--persistent", "1M", "--", "true"], "exclude each other"),
    (["--persistent", "12X", "--", "true"], "bad size '12X' for --persistent"),
    (["--ephemeral", "-1", "--", "true"], "bad size '-1' for --ephemeral"),
    (["--gpu", "first", "--", "true"], "bad --gpu 'first'"),
    (["--gpu", "1024", "--", "true"], "bad --gpu '1024'"),
    (["--iters", "0", "--", "true"], "bad --iters 0"),
    (["--policy-hint", "fast", "--", "true"], "bad --policy-hint 'fast'"),
    (["--policy-hint", "gpu=1", "--", "true"], "use --gpu for gpu="),
    (["--frobnicate", "--", "true"], "unknown option '--frobnicate'"),
    (["--priority", "high", "--", "true"], "--priority"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    r = subprocess.run([SALUS_RUN, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r
    assert r.stderr.startswith("salus-run: ") and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_no_salusd_is_a_clear_error(tmp_path):
    r = subprocess.run([SALUS_RUN, "--mount", str(tmp_path), "--persistent", "1M", "--", "true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "no salusd is mounted at" in r.stderr, r.stderr


def test_help_and_version():
    assert "PROGRAM" in subprocess.run([SALUS_RUN, "--help"], capture_output=True,
                                       text=True).stdout
    r = subprocess.run([SALUS_RUN, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("salus-run ")


# ---------------------------------------------------------------- running programs

@needs_shim
def test_environment_and_exit_status(salusd):
    r = salus_run(salusd, "--persistent", "1M", "--ephemeral", "2M", "--", "sh", "-c",
                  'echo "S=$SALUS_SESSION M=$SALUS_MOUNT V=$CUDA_VISIBLE_DEVICES '
                  'A=$SALUS_AUTOMARK"; echo "P=$LD_PRELOAD"; echo "Y=$PYTHONPATH"; '
                  'grep -E "^(state|persistent|ephemeral):" "$SALUS_SESSION/status"; exit 7')
    assert r.returncode == 7, r.stderr
    out = r.stdout
    assert f"M={salusd.mnt} " in out and f"S={salusd.mnt}/sessions/" in out
    assert "V=GPU-" in out  # the GPU's UUID from gpus/N/info
    assert "A=1" in out
    assert f"P={os.path.realpath(SHIM)}" in out
    assert os.path.join("client", "automark") in out
    assert "state: admitted" in out and "persistent: 1048576" in out
    assert "ephemeral: 2097152" in out
    assert sessions(salusd) == []  # ended with the program
    r = salus_run(salusd, "--no-automark", "--persistent", "1M", "--ephemeral", "1M", "--",
                  "sh", "-c", 'echo "A=$SALUS_AUTOMARK"; kill -TERM $$')
    assert r.returncode == 128 + signal.SIGTERM, r
    assert "A=\n" in r.stdout
    r = salus_run(salusd, "--shared-lane", "--persistent", "1M", "--ephemeral", "1M", "--",
                  "sh", "-c", 'echo "L=$SALUS_SHARED_LANE"')
    assert r.returncode == 0 and "L=1\n" in r.stdout, r
    r = salus_run(salusd, "--shared-lane=alloc", "--persistent", "1M", "--ephemeral", "1M", "--",
                  "sh", "-c", 'echo "L=$SALUS_SHARED_LANE"')
    assert r.returncode == 0 and "L=alloc\n" in r.stdout, r
    assert "expandable" not in r.stderr, r
    # Expandable segments allocate with cuMemCreate: the lane serves them as room.
    conf = dict(env(), PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64,expandable_segments:True")
    r = subprocess.run([SALUS_RUN, "--mount", salusd.mnt, "--shared-lane=alloc", "-v",
                        "--persistent", "1M", "--ephemeral", "1M", "--", "sh", "-c",
                        'echo "L=$SALUS_SHARED_LANE"'], capture_output=True,
                       text=True, timeout=120, env=conf)
    assert r.returncode == 0 and "L=segments\n" in r.stdout, r
    assert ("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64,expandable_segments:True: expandable "
            "segments allocate with cuMemCreate, so the shared lane serves them as room") \
        in r.stderr, r
    r = salus_run(salusd, "--persistent", "1M", "--ephemeral", "1M", "--", "/nonexistent/prog")
    assert r.returncode == 127 and "/nonexistent/prog" in r.stderr


@needs_shim
def test_sigterm_to_salus_run_is_forwarded_and_sigkill_of_the_program_ends_the_session(salusd):
    p = subprocess.Popen([SALUS_RUN, "--mount", salusd.mnt, "--persistent", "1M",
                          "--ephemeral", "1M", "--", "sleep", "60"], env=env(),
                         stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: len(sessions(salusd)) == 1 and children(p.pid), timeout=10)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 128 + signal.SIGTERM
        assert wait_until(lambda: sessions(salusd) == [], timeout=1)
    finally:
        stop(p)
    p = subprocess.Popen([SALUS_RUN, "--mount", salusd.mnt, "--persistent", "1M",
                          "--ephemeral", "1M", "--", "sleep", "60"], env=env())
    try:
        assert wait_until(lambda: len(sessions(salusd)) == 1 and children(p.pid), timeout=10)
        (prog,) = children(p.pid)
        t0 = time.monotonic()
        os.kill(prog, signal.SIGKILL)
        assert wait_until(lambda: sessions(salusd) == [], timeout=1), sessions(salusd)
        assert time.monotonic() - t0 < 1.0
        assert p.wait(timeout=10) == 128 + signal.SIGKILL
    finally:
        stop(p)


@needs_shim
def test_queued_for_admission_then_interrupted(salusd):
    with open(salusd.path("gpus", "0", "memory")) as f:
        cap = dict(l.split(": ", 1) for l in f.read().splitlines())["capacity"]
    hold = subprocess.Popen([SALUS_RUN, "--mount", salusd.mnt, "--gpu", "0", "--persistent", cap,
                             "--", "sleep", "60"], env=env())
    p = None
    try:
        assert wait_until(lambda: len(sessions(salusd)) == 1 and children(hold.pid), timeout=10)
        p = subprocess.Popen([SALUS_RUN, "--mount", salusd.mnt, "--gpu", "0", "--persistent",
                              "1M", "--", "echo", "ran"], env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert wait_until(lambda: len(sessions(salusd)) == 2, timeout=10)
        time.sleep(1.5)  # past the one-second notice
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        assert p.returncode == 128 + signal.SIGINT, err
        assert "is queued for admission on gpu 0" in err and out == ""
        assert wait_until(lambda: len(sessions(salusd)) == 1, timeout=1)
    finally:
        stop(hold)
        if p:
            stop(p)


@needs_shim
@needs_torch
def test_training_loop_reports_its_optimizer_steps(salusd):
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, JOB, "train", "12")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)
    assert rep["kind"] == "attached", r.stdout + r.stderr
    assert rep["marking"] == "explicit"
    assert rep["iterations_completed"] == "12", r.stdout
    assert "salus automark" not in r.stderr  # no warning: the shim was there


@needs_shim
@needs_torch
def test_inference_loop_reports_its_forward_calls(salusd):
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, JOB, "infer", "9")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)
    assert rep["kind"] == "attached" and rep["iterations_completed"] == "9", r.stdout


@needs_shim
@needs_torch
def test_no_automark_marks_nothing(salusd):
    r = salus_run(salusd, "--no-automark", "--persistent", "1M", "--ephemeral", "1M", "--", PY,
                  JOB, "train", "5", "--wait-key", "iterations_completed=0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert report(r.stdout)["iterations_completed"] in ("0", "-"), r.stdout


@needs_shim
@needs_torch
@needs_mock
@pytest.mark.parametrize("how", ["subprocess", "cuinit", "spawn"])
def test_a_launcher_hands_the_session_to_the_worker_that_uses_the_gpu(salusd, how):
    """torchrun or mp.spawn under salus-run: the launcher imports torch (the
    automark attaches it; `cuinit`: it also initialises CUDA, as
    torch.cuda.is_available() does), its worker allocates GPU memory (the mock
    driver) and trains. The worker takes the session over: its 12 optimizer
    steps are the session's iterations, and nobody prints a shim warning."""
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, LAUNCHER, how,
                  "train", "12", "--gpu-alloc",
                  extra_env=mock_driver_env())
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)
    assert rep["kind"] == "attached" and rep["marking"] == "explicit", r.stdout + r.stderr
    assert rep["pid"] == rep["self_pid"], r.stdout + r.stderr
    assert rep["iterations_completed"] == "12", r.stdout + r.stderr
    assert "salus-shim" not in r.stderr, r.stderr


# Debian 12's torchrun (PyTorch 1.13 on Python 3.11) fails before it starts a
# worker with its default --redirects 0 --tee 0 (a Python 3.11 change to
# iterating IntFlag members); any other value avoids the bug, and 2 with 2
# keeps the worker's stderr on the console as the default does.
TORCHRUN_PY311 = ["--redirects", "2", "--tee", "2"]


@needs_shim
@needs_torch
@needs_mock
def test_real_torchrun_hands_the_session_to_its_worker(salusd, tmp_path):
    """Debian's own torchrun (torch.distributed.run: an elastic agent with a
    c10d rendezvous, and a worker it starts as a new program) under salus-run:
    the worker, which allocates GPU memory, takes the session over from the
    agent and its 12 optimizer steps are the session's iterations."""
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, "-m",
                  "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                  *TORCHRUN_PY311, "--log_dir", str(tmp_path / "torchrun"),
                  JOB, "train", "12", "--gpu-alloc", extra_env=mock_driver_env())
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)  # the worker's
    assert rep["kind"] == "attached" and rep["pid"] == rep["self_pid"], r.stdout + r.stderr
    assert rep["iterations_completed"] == "12", r.stdout + r.stderr
    assert "salus-shim" not in r.stderr, r.stderr


@needs_shim
@needs_torch
@needs_mock
def test_a_launcher_that_uses_the_gpu_keeps_the_session_and_its_child_is_told(salusd):
    """The launcher allocates GPU memory itself, then starts a job that does
    too: the session stays the launcher's, and the child says who holds it."""
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, LAUNCHER, "gpu",
                  "train", "3", "--gpu-alloc", "--wait-key", "iterations_completed=0",
                  extra_env=mock_driver_env())
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)  # the child's view
    assert rep["pid"] != rep["self_pid"], r.stdout + r.stderr
    assert (f"pid {rep['pid']} holds the session (one process of a job is gated); this process "
            "runs ungated") in r.stderr, r.stderr
    assert r.stderr.count("salus-shim") == 1, r.stderr


@needs_shim
@needs_torch
@needs_mock
def test_a_launchers_second_worker_attaches_after_the_first_exits(salusd):
    """A launcher that runs two workers one after the other (a second stage, or
    an elastic restart): the first one's exit leaves the session, and the
    second attaches and adds its 12 steps."""
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, LAUNCHER,
                  "twice", "train", "12", "--gpu-alloc",
                  extra_env=mock_driver_env())
    assert r.returncode == 0, r.stdout + r.stderr
    firsts = [l for l in r.stdout.splitlines() if l.startswith("self_pid: ")]
    assert len(firsts) == 2 and firsts[0] != firsts[1], r.stdout
    rep = report(r.stdout)  # the second worker's
    assert rep["pid"] == rep["self_pid"], r.stdout + r.stderr
    assert rep["iterations_completed"] == "12", r.stdout + r.stderr  # its own gate's
    assert rep["iterations_done"] == "24", r.stdout + r.stderr  # the session's
    assert "salus-shim" not in r.stderr, r.stderr


@needs_shim
@needs_torch
def test_the_jobs_next_program_attaches_after_the_first_exits(salusd):
    """A shell runs two PyTorch programs one after the other (a script's stages,
    a notebook's restarted kernel): salus-run's session outlives the first, and
    the second attaches and adds its 12 steps."""
    second = f"{PY} {JOB} train 12 --wait-key iterations_done=24"
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", "sh", "-c",
                  f"{PY} {JOB} train 12 && {second}")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)  # the second program's
    assert rep["pid"] == rep["self_pid"], r.stdout + r.stderr
    assert rep["iterations_done"] == "24", r.stdout + r.stderr
    assert "salus-shim" not in r.stderr, r.stderr


@needs_shim
@needs_torch
@needs_jupyter
def test_a_notebook_kernel_and_the_kernel_after_its_restart_share_the_session(salusd):
    """A real IPython kernel, started as Jupyter starts one (jupyter_client;
    the server itself imports no torch), runs 12 training steps in a cell;
    the kernel is restarted and the cell runs again. The first kernel's
    import of torch attaches it; its exit leaves the session, and the new
    kernel attaches and adds its 12 steps."""
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, NOTEBOOK,
                  "train", "12")
    assert r.returncode == 0, r.stdout + r.stderr
    kernels = [l for l in r.stdout.splitlines() if l.startswith("self_pid: ")]
    assert len(kernels) == 2 and kernels[0] != kernels[1], r.stdout
    rep = report(r.stdout)  # the second kernel's
    assert rep["kind"] == "attached" and rep["pid"] == rep["self_pid"], r.stdout + r.stderr
    assert rep["iterations_completed"] == "12", r.stdout + r.stderr  # its own gate's
    assert rep["iterations_done"] == "24", r.stdout + r.stderr  # the session's
    assert "salus-shim" not in r.stderr, r.stderr


@needs_shim
@needs_torch
def test_spawned_dataloader_workers_leave_the_session_to_the_main_process(salusd):
    """Two DataLoader workers started with spawn import torch and run module
    forwards (their automark marks too): the shim refuses them the session
    quietly, and only the main process's optimizer steps count."""
    r = salus_run(salusd, "--persistent", "16M", "--ephemeral", "16M", "--", PY, JOB, "train",
                  "12", "--loader-workers", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(r.stdout)
    assert rep["pid"] == rep["self_pid"], r.stdout + r.stderr
    assert rep["iterations_completed"] == "12", r.stdout + r.stderr
    assert "salus-shim" not in r.stderr, r.stderr


def pair_progress(d, policy, tmp_path):
    """Two training jobs on GPU 0 under `policy` that step until told to stop; the
    second starts once the first has run 5 iterations (so arrival order is
    known). Once the second is in (under FAIR: has imported torch, which attaches
    it; under FIFO: a second after it started), the iterations salusd counts for
    each over 2 s. Returns (progress0, progress1, how many had imported torch)."""
    with open(d.path("policy"), "w") as f:
        f.write(policy)
    log, halt = tmp_path / f"{policy}.log", tmp_path / f"{policy}.stop"
    procs, ids = [], {}

    def start(i):
        procs.append(subprocess.Popen(
            [SALUS_RUN, "--mount", d.mnt, "--gpu", "0", "--persistent", "1M", "--ephemeral", "1M",
             "--policy-hint", f"name=job{i}", "--", PY, JOB, "train", "0", "--sleep-ms", "10",
             "--log", str(log), "--stop", str(halt)],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        assert wait_until(lambda: len(sessions(d)) == i + 1, 30)
        ids.update({status(d, sid)["name"]: sid for sid in sessions(d)})

    def done(i):
        return int((status(d, ids[f"job{i}"]) or {}).get("iterations_completed", "0"))

    try:
        start(0)
        assert wait_until(lambda: done(0) >= 5, 60)
        start(1)
        if policy == "fifo":
            time.sleep(1)
        else:
            assert wait_until(lambda: log.read_text().count("imported") == 2, 60)
        imported = log.read_text().count("imported")
        a = [done(0), done(1)]
        time.sleep(2)
        b = [done(0), done(1)]
        halt.touch()
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, out + err
        return b[0] - a[0], b[1] - a[1], imported
    finally:
        for p in procs:
            stop(p)


@needs_shim
@needs_torch
def test_two_jobs_alternate_under_fair_and_not_under_fifo(salusd, tmp_path):
    # FAIR: once both run, each gets about half of the iterations.
    p0, p1, imported = pair_progress(salusd, "fair", tmp_path)
    assert p0 + p1 >= 10 and min(p0, p1) >= 0.3 * (p0 + p1), (p0, p1)
    # FIFO runs the earlier job alone while it has work: the same measure fails,
    # and the later one is held in its first grant (inside import torch).
    p0, p1, imported = pair_progress(salusd, "fifo", tmp_path)
    assert p0 >= 10 and p1 == 0 and imported == 1, (p0, p1, imported)


@needs_shim
@needs_torch
def reserve_args(reserve):
    """salusd's flags for an attached program's context reserve (None: the default,
    0 on sim)."""
    return [] if reserve is None else ["--attach-context-reserve", str(reserve)]


# With a context reserve, --measure's provisional need and --retry-on-oom's
# whole GPU leave room for it (admission counts it beside the need).
@pytest.mark.parametrize("reserve", [None, 64 << 20])
def test_measure_sets_need_from_the_first_iterations(salusd_factory, reserve):
    salusd = salusd_factory(reserve_args(reserve)).start()
    r = salus_run(salusd, "--measure", "--measure-iters", "2", "--", PY, JOB, "train", "8",
                  "--wait-key", "ephemeral=1048576")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "provisional need of persistent=0 ephemeral=" in r.stderr
    assert "--measure: peak 0 after " in r.stderr, r.stderr
    # CPU torch charges no device memory: the rule's floor (1 MiB margin) remains.
    assert report(r.stdout)["ephemeral"] == "1048576", r.stdout


@needs_shim
@needs_torch
@pytest.mark.parametrize("reserve", [None, 64 << 20])
def test_retry_on_oom_runs_once_more_alone(salusd_factory, tmp_path, reserve):
    d = salusd_factory(reserve_args(reserve), gpus=2, sim_memory="1G").start()
    # another job holds GPU 0, so the retry must go to the empty GPU 1
    hold = subprocess.Popen([SALUS_RUN, "--mount", d.mnt, "--gpu", "0", "--persistent", "1M",
                             "--ephemeral", "1M", "--", "sleep", "60"], env=env())
    try:
        assert wait_until(lambda: len(sessions(d)) == 1, timeout=10)
        flag = tmp_path / "failed-once"
        r = salus_run(d, "--retry-on-oom", "--gpu", "0", "--persistent", "1M", "--ephemeral",
                      "1M", "--", PY, JOB, "train", "3", "--fail-first-oom", str(flag))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "after running out of GPU memory (CUDA out of memory)" in r.stderr, r.stderr
        assert "gpu=1" in r.stderr
        rep = report(r.stdout)
        assert rep["name"] == "oom-retry" and rep["gpu"] == "1", r.stdout
        with open(d.path("gpus", "1", "memory")) as f:
            cap = dict(l.split(": ", 1) for l in f.read().splitlines())["capacity"]
        assert int(rep["persistent"]) + int(rep["ephemeral"]) + (reserve or 0) == int(cap), \
            r.stdout
        # without the flag a failing program is not run again
        flag.unlink()
        r = salus_run(d, "--gpu", "0", "--persistent", "1M", "--ephemeral", "1M", "--", PY, JOB,
                      "train", "3", "--fail-first-oom", str(flag))
        assert r.returncode == 1 and "running it once more" not in r.stderr
    finally:
        stop(hold)


STEPS = """
import ctypes, sys, time
step = ctypes.CDLL(None).salus_step
gated = 0
for i in range(int(sys.argv[1])):
    gated += step() == 0
    time.sleep(0.02)
print("done", gated, flush=True)
"""


@needs_shim
def test_salusd_killed_mid_run_the_program_finishes_and_reattaches_after_restart(
        salusd_factory, tmp_path):
    d = salusd_factory(gpus=2).start()
    prog = tmp_path / "steps.py"
    prog.write_text(STEPS)
    p = subprocess.Popen([SALUS_RUN, "--mount", d.mnt, "--no-automark", "--gpu", "1",
                          "--persistent", "3M", "--ephemeral", "5M", "--iters", "400", "--",
                          PY, str(prog), "400"], env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        def attached_on_salusd(min_iters):
            for sid in sessions(d):
                st = status(d, sid) or {}
                if st.get("kind") == "attached" and int(st.get("iterations_done", "0")) >= min_iters:
                    return sid, st
            return None

        assert wait_until(lambda: attached_on_salusd(3), timeout=10), d.daemon_log()
        pid = attached_on_salusd(3)[1]["pid"]
        d.proc.kill()  # SIGKILL: no goodbye to the program
        d.proc.wait()
        time.sleep(2.5)  # past the shim's 2 s heartbeat limit: it runs on ungated
        assert p.poll() is None, p.communicate()
        subprocess.run(["fusermount3", "-u", "-z", d.mnt], check=True)
        d.log.close()
        d._start(10)
        # The shim makes its session again (a clone session of its own: salus-run's
        # was one), with salus-run's need pinned to the GPU its context is on,
        # and is gated again.
        assert wait_until(lambda: attached_on_salusd(2), timeout=10), d.daemon_log()
        sid2, st2 = attached_on_salusd(2)
        assert (st2["pid"], st2["gpu"]) == (pid, "1")
        assert (st2["persistent"], st2["ephemeral"]) == (str(3 << 20), str(5 << 20))
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert "running ungated" in err
        assert f"session is made again as {d.mnt}/sessions/{sid2}" in err, err
        gated = int(out.split()[-1])
        assert 5 <= gated < 400, out  # gated before the kill and after the restart only
        # The made-again session ends with the program, as salus-run's own did.
        assert wait_until(lambda: sessions(d) == [], timeout=3), sessions(d)
    finally:
        stop(p)
