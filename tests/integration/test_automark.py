"""The PyTorch automark (client/automark) with a fake marker, on Debian's CPU
torch: no salusd and no shim needed. What salus-run adds on top (the shim's
salus_step as the marker, the counts salusd shows) is in test_salus_run.py.

Each scenario runs in a fresh interpreter: the import hook must see torch's
first import."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
AUTOMARK = os.path.join(ROOT, "client", "automark")


def have_torch():
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


needs_torch = pytest.mark.skipif(not have_torch(), reason="python3-torch is not installed")

PRELUDE = """
import sys
import salus_automark
marks = []
salus_automark.enable(mark=lambda: marks.append(1))
assert "torch" not in sys.modules
"""


def run_py(body, env_extra=None, path=(AUTOMARK,)):
    env = {k: v for k, v in os.environ.items() if k not in ("SALUS_AUTOMARK", "LD_PRELOAD")}
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=240, env=env)


def check(r):
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@needs_torch
def test_training_counts_optimizer_steps_once_each():
    out = check(run_py(PRELUDE + """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(7):
    opt.zero_grad()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
print("training", len(marks))
# a second optimizer class, and a subclass whose step calls super().step()
class MyAdam(torch.optim.Adam):
    def step(self, closure=None):
        return super().step(closure)
plain = torch.optim.Adam(model.parameters())   # Adam.step wrapped too
opt2 = MyAdam(model.parameters())
before = len(marks)
for i in range(5):
    opt2.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt2.step()
print("subclass", len(marks) - before)
# evaluation after training is not counted again
before = len(marks)
with torch.no_grad():
    for i in range(3):
        model(torch.randn(4, 8))
print("eval", len(marks) - before)
print("how", salus_automark.marker.how)
"""))
    assert "training 7\n" in out
    assert "subclass 5\n" in out
    assert "eval 0\n" in out


@needs_torch
def test_inference_counts_outermost_forwards():
    out = check(run_py(PRELUDE + """
import torch
inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
model = torch.nn.Sequential(inner, torch.nn.Linear(8, 2))   # nested modules: one boundary
with torch.inference_mode():
    for i in range(9):
        model(torch.randn(2, 8))
print("inference_mode", len(marks))
before = len(marks)
with torch.no_grad():
    for i in range(4):
        model(torch.randn(2, 8))
print("no_grad", len(marks) - before)
# autograd on, no optimizer: each boundary is taken when the next forward starts
before = len(marks)
for i in range(5):
    model(torch.randn(2, 8))
print("grad", len(marks) - before)
"""))
    assert "inference_mode 9\n" in out
    assert "no_grad 4\n" in out
    assert "grad 4\n" in out  # the fifth forward's boundary would need a sixth forward


@needs_torch
def test_forward_hooks_step_aside_while_torch_compile_traces():
    """Inside torch.compile's tracing the global forward hooks return at once
    (their thread-local count would break the graph at every module); eager
    forwards around it count as before. torch.compiler.is_compiling stands in
    for Dynamo here (the CPU torch 1.13 has no torch.compile)."""
    out = check(run_py("""
import types, torch, salus_automark
tracing = [False]
torch.compiler = types.SimpleNamespace(is_compiling=lambda: tracing[0])
marks = []
salus_automark.install(torch, lambda: marks.append(1))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
with torch.no_grad():
    model(torch.randn(2, 8))
    tracing[0] = True
    model(torch.randn(2, 8))
    tracing[0] = False
    model(torch.randn(2, 8))
print("marks", len(marks))
"""))
    assert "marks 2\n" in out, out


@needs_torch
def test_forward_that_raises_does_not_stop_marking():
    out = check(run_py(PRELUDE + """
import torch
class Bad(torch.nn.Module):
    def forward(self, x):
        raise ValueError("bad batch")
good, bad = torch.nn.Linear(4, 4), Bad()
with torch.no_grad():
    good(torch.randn(1, 4))
    try:
        bad(torch.randn(1, 4))
    except ValueError:
        pass
    good(torch.randn(1, 4))
print("marks", len(marks), torch.__version__)
"""))
    # torch >= 2.1 runs the post hook on a raise (always_call); 1.13 cannot, and
    # the failed call leaves the depth raised, so marking stops: documented.
    n, version = int(out.split()[1]), out.split()[2]
    major, minor = (int(x) for x in version.split(".")[:2])
    assert n == (2 if (major, minor) >= (2, 1) else 1), out


def test_no_torch_costs_nothing_and_chains_site_sitecustomize(tmp_path):
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    r = run_py("""
import os, sys
print("chained", os.environ.get("CHAINED"))
print("torch", "torch" in sys.modules, "automark", "salus_automark" in sys.modules)
import json  # other imports go through untouched
""", env_extra={"SALUS_AUTOMARK": "1"}, path=(AUTOMARK, str(other)))
    out = check(r)
    assert "chained yes" in out
    assert "torch False automark True" in out
    # no shim in this process: one clear warning, never a crash
    assert r.stderr.count("libsalus-shim.so is not loaded") == 1, r.stderr


def test_off_without_salus_automark(tmp_path):
    out = check(run_py("import sys; print('automark' in ' '.join(sys.modules))"))
    assert out.strip() == "False"


def test_salus_step_without_shim_warns_once():
    r = run_py("""
import salus
print(salus.step(), salus.step(), salus.attached(), salus.iterations())
with salus.iteration():
    pass
""", path=(os.path.join(ROOT, "client"),))
    out = check(r)
    assert out.strip() == "0 0 False 0"
    assert r.stderr.count("libsalus-shim.so is not loaded") == 1, r.stderr


@needs_torch
@pytest.mark.parametrize("lane", ["alloc", "1"])
def test_alloc_lane_empties_the_torch_cache_before_each_boundary(lane):
    """SALUS_SHARED_LANE=alloc: synchronize and empty_cache before each mark,
    once CUDA is initialised; nothing on a CPU torch, nothing with =1."""
    out = check(run_py(PRELUDE + """
import torch
calls = []
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def train_step():
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
train_step()  # CUDA not initialised (CPU torch): nothing to release
print("cpu", len(marks), calls)
torch.cuda.is_initialized = lambda: True
torch.cuda.synchronize = lambda: calls.append(("synchronize", len(marks)))
torch.cuda.empty_cache = lambda: calls.append(("empty_cache", len(marks)))
train_step()
print("cuda", len(marks), calls)
# Inside CUDA graph capture: a synchronize would invalidate the capture.
torch.cuda.is_current_stream_capturing = lambda: True
train_step()
print("capturing", len(marks), calls)
""", env_extra={"SALUS_SHARED_LANE": lane}, path=(AUTOMARK, os.path.join(ROOT, "client"))))
    assert "cpu 1 []" in out, out
    if lane == "alloc":  # both before the second mark, in that order
        assert "cuda 2 [('synchronize', 1), ('empty_cache', 1)]" in out, out
        assert "capturing 3 [('synchronize', 1), ('empty_cache', 1)]" in out, out
    else:
        assert "cuda 2 []" in out, out


@pytest.mark.parametrize("lane", ["alloc", None])
def test_salus_step_empties_the_torch_cache_with_the_alloc_lane(lane):
    r = run_py("""
import sys, types, salus
calls = []
cuda = types.SimpleNamespace(is_initialized=lambda: True,
                             synchronize=lambda: calls.append("synchronize"),
                             empty_cache=lambda: calls.append("empty_cache"))
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)
salus._shim = (lambda: calls.append("salus_step") or 0, lambda: 1, lambda: 0)
salus.step()
print(calls)
calls.clear()
cuda.is_current_stream_capturing = lambda: True  # inside graph capture: no synchronize
salus.step()
print(calls)
""", env_extra={"SALUS_SHARED_LANE": lane} if lane else None,
               path=(os.path.join(ROOT, "client"),))
    out = check(r).splitlines()
    want = ["synchronize", "empty_cache", "salus_step"] if lane else ["salus_step"]
    assert out[0].strip() == str(want), out
    assert out[1].strip() == str(["salus_step"]), out


@needs_torch
def test_oom_report_reaches_the_fd():
    rfd, wfd = os.pipe()
    try:
        r = subprocess.run(
            [sys.executable, "-c", PRELUDE + "\nraise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')"],
            capture_output=True, text=True, timeout=120, pass_fds=(wfd,),
            env={**os.environ, "PYTHONPATH": AUTOMARK, "SALUS_RUN_OOM_FD": str(wfd)})
        os.close(wfd)
        wfd = -1
        assert r.returncode == 1
        assert "CUDA out of memory" in r.stderr
        assert os.read(rfd, 64) == b"oom\n"
    finally:
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
