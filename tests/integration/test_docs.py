"""Every ```sh example in README.md and docs/salus.5.md runs against a live
salusd, so the documentation cannot drift from the code. The blocks of one
document run in order in one shell (they share variables and open fds)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def sh_blocks(path):
    with open(path) as f:
        text = f.read()
    return re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)


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


@pytest.mark.parametrize("page", ["salus.5", "salusd.8", "salusctl.1", "libsalus-shim.3"])
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
