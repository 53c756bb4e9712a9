"""Every ```sh example in README.md and docs/salus.5.md runs against a live
salusd, so the documentation cannot drift from the code. The blocks of one
document run in order in one shell (they share variables and open fds)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# README's PyTorch section needs libsalus-shim.so (built where cuda.h is) and
# python3-torch, so it runs in a test of its own that can skip.
PYTORCH_SECTION = "## Run your PyTorch job under Salus"


def sh_blocks(path, section=None):
    """The ```sh blocks of a document; with `section`, only that `## ` section's,
    else all but the PyTorch section's."""
    with open(path) as f:
        text = f.read()
    parts = re.split(r"^(?=## )", text, flags=re.M)
    if section:
        parts = [p for p in parts if p.startswith(section)]
    else:
        parts = [p for p in parts if not p.startswith(PYTORCH_SECTION)]
    return re.findall(r"^```sh\n(.*?)^```", "".join(parts), flags=re.S | re.M)


@pytest.mark.parametrize("doc", ["README.md", "docs/salus.5.md"])
def test_shell_examples_run(salusd, doc):
    blocks = sh_blocks(os.path.join(ROOT, doc))
    if not blocks:
        pytest.skip(f"{doc} has no ```sh examples")
    # Only the mount path itself: "/salus" not preceded by a path character.
    mount = re.compile(r"(?<![\w./-])/salus(?![\w.-])")
    script = "set -e\n" + "\n".join(mount.sub(salusd.mnt, b) for b in blocks)
    out = subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, f"{doc}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def test_pytorch_example_runs(salusd, tmp_path):
    import sys
    from conftest import SALUSD
    tools = os.path.dirname(os.path.abspath(SALUSD))
    shim = os.path.join(os.path.dirname(tools), "client", "shim", "libsalus-shim.so")
    if not os.path.exists(shim):
        pytest.skip(f"libsalus-shim.so not built at {shim} (needs cuda.h)")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode:
        pytest.skip("python3-torch is not installed")
    blocks = sh_blocks(os.path.join(ROOT, "README.md"), PYTORCH_SECTION)
    assert blocks, "README.md lost its PyTorch example"
    bindir = tmp_path / "bin"  # salus-run from the build, python3 = the one with torch
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bindir}:{tools}:{os.environ['PATH']}",
           "SALUS_MOUNT": salusd.mnt}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run(["/bin/bash", "-c", "set -e\n" + "\n".join(blocks)], capture_output=True,
                         text=True, timeout=180, cwd=ROOT, env=env)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "20 steps on" in out.stdout and "admitted on gpu" in out.stderr, out.stderr


@pytest.mark.parametrize("page", ["salus.5", "salusd.8", "salusctl.1", "salus-run.1",
                                  "libsalus-shim.3", "salus-trace-import.1"])
def test_man_pages_render(page):
    from conftest import SALUSD
    built = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(SALUSD))), "docs", page)
    if not os.path.exists(built):
        pytest.skip(f"{page} was not built (pandoc missing at build time)")
    if subprocess.run(["sh", "-c", "command -v man"], capture_output=True).returncode != 0:
        pytest.skip("man (man-db) is not installed")
    out = subprocess.run(["man", "-l", built], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "MANPAGER": "cat", "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    assert "NAME" in out.stdout and "SYNOPSIS" in out.stdout or "DESCRIPTION" in out.stdout
    assert page.split(".")[0].upper() in out.stdout.splitlines()[0]


@pytest.mark.parametrize("page", ["salus.5", "salusd.8", "salusctl.1", "salus-run.1",
                                  "libsalus-shim.3"])
def test_man_pages_fit_80_columns_without_warnings(page):
    """groff warned about tables wider than the line (docs/man_fit_tables.awk)."""
    from conftest import SALUSD
    built = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(SALUSD))), "docs", page)
    if not os.path.exists(built):
        pytest.skip(f"{page} was not built (pandoc missing at build time)")
    if subprocess.run(["sh", "-c", "command -v man"], capture_output=True).returncode != 0:
        pytest.skip("man (man-db) is not installed")
    out = subprocess.run(["man", "--warnings", "-l", built], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MANPAGER": "cat", "MANWIDTH": "80"})
    # "table text block will not fit on one page" depends only on where man's page breaks
    # fall (any edit above a table moves them), not on the width this test is about; a
    # terminal reader never sees pages.
    warnings = [w for w in out.stderr.splitlines()
                if w and "table text block will not fit on one page" not in w]
    assert out.returncode == 0 and not warnings, out.stderr
