"""tools/bundle.sh and tools/gpu-session.sh, the kit a session with a short
GPU lease runs, kept working without a GPU: the bundle made from this build
holds what every step needs and finds its libraries itself (never the mock
driver), and the session's --dry-run runs its steps from the bundle (the mock
libcuda for the driver steps, CPU torch and a sim salusd for the PyTorch ones),
writes only the two files a lease brings back, and stops a step at the budget
leaving no daemon, mount or temporary folder behind."""
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import SALUSD

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.dirname(os.path.dirname(os.path.abspath(SALUSD)))
MOCK_DIR = os.environ.get("SALUS_TEST_CUDA_MOCK_DIR", "")
SESSION = os.path.join(ROOT, "tools", "gpu-session.sh")


def have_torch():
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    if not MOCK_DIR:
        pytest.skip("no mock libcuda in this build (no cuda.h): the bundle needs the cuda programs")
    b = tmp_path_factory.mktemp("bundle") / "b"
    r = subprocess.run(["sh", os.path.join(ROOT, "tools", "bundle.sh"), BUILD, str(b)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return b


def session(bundle, out, *args, timeout=280):
    env = {**os.environ, "PYTHON": sys.executable, "SALUS_TEST_CUDA_MOCK_DIR": MOCK_DIR}
    env.pop("LD_PRELOAD", None)
    env.pop("LD_LIBRARY_PATH", None)
    return subprocess.run([SESSION, "--dry-run", str(bundle), str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd="/", env=env)


def test_the_bundle_holds_every_step_and_finds_its_own_libraries(bundle):
    for f in ("tools/salusd", "tools/salus-run", "tools/salus-bench", "tools/salus-sim",
              "client/shim/libsalus-shim.so", "tests/integration/swap_program",
              "tests/vgpu/cuda/bench_lane_handover", "tests/vgpu/cuda/bench_shim_launch",
              "share/salus/automark/sitecustomize.py", "share/salus/python/salus.py"):
        assert (bundle / f).exists(), f
    names = {p.name for p in bundle.rglob("*")}
    assert not any(n.startswith(("libcuda.so", "libnvidia-ml.so")) for n in names), \
        "the mock driver must never travel to a GPU box"
    system = ("linux-vdso", "libc.so", "libm.so", "libstdc++", "libgcc_s", "libdl", "libpthread",
              "librt.so", "ld-linux")
    own = os.path.realpath(bundle / "lib")
    for f in ("tools/salusd", "tools/salus-run", "tests/vgpu/cuda/bench_lane_handover"):
        ldd = subprocess.run(["ldd", str(bundle / f)], capture_output=True, text=True).stdout
        for line in ldd.splitlines():
            assert "not found" not in line, f"{f}: {line}"
            lib = line.split()[0]
            if "=>" not in line or lib.startswith(system):
                continue
            path = os.path.realpath(line.split("=>")[1].split()[0])
            assert path.startswith(own + "/"), f"{f} loads {lib} from outside the bundle: {line}"


def test_the_dry_run_runs_each_step_from_the_bundle(bundle, tmp_path):
    steps = ["env", "gate", "swap", "backing", "handover"] + (["compat"] if have_torch() else [])
    out = tmp_path / "out"
    r = session(bundle, out, "--budget", "270", *steps)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(out)) == ["details.tar.gz", "summary.txt"], "a lease brings back 8 files at most"
    s = (out / "summary.txt").read_text()
    for step in steps:
        assert f"######## {step}: done in" in s, s
    assert "salusd 0." in s  # env: the bundle's salusd runs
    assert "gate through salusd, pipelined" in s and "hook cost:" in s
    assert s.count("contents after the swaps: identical") == 2, s
    assert "arena on-demand" in s and "backed +64 MiB" in s, s
    assert "skipped in a dry run: needs a GPU" in s
    if have_torch():
        assert s.count("losses bit-identical") == 2, s
    with tarfile.open(out / "details.tar.gz") as t:
        names = t.getnames()
    assert "details/gate.log" in names and "details/backing.log" in names, names


def test_a_step_past_the_budget_is_stopped_and_leaves_nothing(bundle, tmp_path):
    if not have_torch():
        pytest.skip("python3-torch is not installed: the long step is a PyTorch one")
    before_tmp = set(os.listdir("/tmp"))
    out = tmp_path / "out"
    r = session(bundle, out, "--budget", "4", "compat", "gate")
    assert r.returncode == 0, r.stdout + r.stderr
    s = (out / "summary.txt").read_text()
    assert "######## compat: STOPPED at the budget" in s, s
    assert "skipped: 0 s of the budget left" in s or "skipped: 1 s of the budget left" in s, s
    with open("/proc/mounts") as f:
        assert "salus-pytorch-eval" not in f.read()
    left = {n for n in set(os.listdir("/tmp")) - before_tmp if n.startswith("salus-")}
    assert not left, f"left behind in /tmp: {left}"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(bundle / "tools" / "salusd") not in ps, "the step's salusd outlived it"


def test_an_unknown_step_is_refused(bundle, tmp_path):
    r = session(bundle, tmp_path / "out", "compat", "warp-drive")
    assert r.returncode == 2
    assert "unknown step 'warp-drive'" in r.stderr
