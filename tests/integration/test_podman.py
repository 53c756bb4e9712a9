"""`salusctl cdi` and real podman: a busybox image made here from Debian's
busybox-static (no registry), the CDI device `--device KIND=N`, a session from
inside as root and as another uid, and a salusd restarted while the container
runs (the spec binds the directory above the mount with rslave, so the new
mount reaches the running container).

podman runs with its own storage under a temp dir, runc (crun needs
CAP_SYS_RESOURCE and pure cgroup v2 setups this kind of machine lacks), explicit
ulimits, no network and a private IPC namespace (no host-side /dev/shm mount).
The CDI spec goes to /run/cdi under a kind of its own and is removed afterwards.
"""
import json
import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import Salusd, Session, is_mounted

SALUSCTL = os.path.join(os.path.dirname(os.path.abspath(
    os.environ.get("SALUSD", "build/tools/salusd"))), "salusctl")
BUSYBOX = "/bin/busybox"
CDI_DIR = "/run/cdi"
KIND = f"test{os.getpid()}.salus.io/gpu"
USER = 1000


def salusctl(*args, **kw):
    return subprocess.run([SALUSCTL, *args], capture_output=True, text=True, timeout=30, **kw)


# ---------------------------------------------------------------- the spec alone

def test_cdi_spec_shape(salusd, tmp_path):
    shim = tmp_path / "libsalus-shim.so"
    shim.write_bytes(b"\x7fELF not really")
    r = salusctl("-m", salusd.mnt, "cdi", "--shim", str(shim))
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    assert spec["kind"] == "salus.io/gpu" and spec["cdiVersion"] == "0.5.0"
    assert [d["name"] for d in spec["devices"]] == ["0", "1", "any"]
    assert spec["devices"][1]["containerEdits"]["env"] == ["SALUS_GPU=1"]
    edits = spec["containerEdits"]
    assert f"SALUS_MOUNT={salusd.mnt}" in edits["env"]
    assert "LD_PRELOAD=/opt/salus/lib/libsalus-shim.so" in edits["env"]
    parent = os.path.dirname(salusd.mnt)
    assert {"hostPath": parent, "containerPath": parent, "options": ["rbind", "rslave", "rw"]} \
        in edits["mounts"]
    assert {"hostPath": str(shim), "containerPath": "/opt/salus/lib/libsalus-shim.so",
            "options": ["bind", "ro"]} in edits["mounts"]
    assert r.stderr == ""


def test_cdi_spec_without_shim_and_to_a_file(salusd, tmp_path):
    out = tmp_path / "salus.json"
    r = salusctl("-m", salusd.mnt, "cdi", "--kind", "example.com/salus", "--shim",
                 str(tmp_path / "missing.so"), "-o", str(out))
    assert r.returncode == 0 and "no libsalus-shim.so" in r.stderr, r.stderr
    spec = json.loads(out.read_text())
    assert spec["kind"] == "example.com/salus"
    assert not any(e.startswith("LD_PRELOAD=") for e in spec["containerEdits"]["env"])
    assert len(spec["containerEdits"]["mounts"]) == 1
    assert oct(out.stat().st_mode & 0o777) == "0o644" and not os.path.exists(str(out) + ".tmp")


def test_cdi_bad_kind_and_missing_salusd(salusd, tmp_path):
    r = salusctl("-m", salusd.mnt, "cdi", "--kind", "no-slash")
    assert r.returncode == 1 and "--kind no-slash: expected VENDOR/CLASS" in r.stderr, r.stderr
    r = salusctl("-m", str(tmp_path / "nothing"), "cdi")
    assert r.returncode == 1 and r.stdout == "" and "salusctl:" in r.stderr, r.stderr


# ---------------------------------------------------------------- podman

def podman_base(store):
    return ["podman", "--root", os.path.join(store, "root"), "--runroot", os.path.join(store, "run"),
            "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--events-backend", "none"]


RUN_FLAGS = ["--runtime", "runc", "--network", "none", "--ipc", "private",
             "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


@pytest.fixture(scope="module")
def podman():
    if os.geteuid() != 0:
        pytest.skip("podman with runc and bind-mount propagation needs root")
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian packages podman runc)")
    if not os.access(BUSYBOX, os.X_OK):
        pytest.skip("busybox is not installed (Debian package busybox-static)")
    store = tempfile.mkdtemp(prefix="salus-podman-")
    base = podman_base(store)
    try:
        rootfs = os.path.join(store, "rootfs")
        for d in ("bin", "tmp", "etc"):
            os.makedirs(os.path.join(rootfs, d))
        shutil.copy(BUSYBOX, os.path.join(rootfs, "bin", "busybox"))
        applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True,
                                 check=True).stdout.split()
        for a in applets:
            if a != "busybox":
                os.symlink("busybox", os.path.join(rootfs, "bin", a))
        with open(os.path.join(rootfs, "etc", "passwd"), "w") as f:
            f.write(f"root:x:0:0:root:/:/bin/sh\nuser:x:{USER}:{USER}::/tmp:/bin/sh\n")
        tar = os.path.join(store, "image.tar")
        subprocess.run(["tar", "-C", rootfs, "-cf", tar, "."], check=True)
        r = subprocess.run([*base, "import", tar, "localhost/salus-busybox:test"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        yield base
    finally:
        subprocess.run([*base, "rm", "-af", "-t", "0"], capture_output=True, timeout=120)
        subprocess.run([*base, "rmi", "-af"], capture_output=True, timeout=120)
        with open("/proc/mounts") as f:
            left = [l.split()[1] for l in f if l.split()[1].startswith(store)]
        for m in reversed(left):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(store, ignore_errors=True)


class SharedSalus:
    """salusd mounted at D/run/fs, where D/run is a shared mount (a systemd host's
    root is shared; this machine's is not), as docs/containers.md's restart-proof
    layout has it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="salus-cdi-")
        os.chmod(self.dir, 0o755)
        self.run = os.path.join(self.dir, "run")
        os.mkdir(self.run)
        subprocess.run(["mount", "--bind", self.run, self.run], check=True)
        subprocess.run(["mount", "--make-shared", self.run], check=True)
        self.mnt = os.path.join(self.run, "fs")
        self.d = None

    def start(self):
        d = Salusd()
        d.args[d.args.index("--mount") + 1] = self.mnt
        d.mnt = self.mnt
        self.d = d.start()
        return self

    def stop(self):
        if self.d:
            self.d.stop()
            self.d = None

    def close(self):
        self.stop()
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)
        subprocess.run(["umount", "-l", self.run], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def shared_salus():
    s = SharedSalus()
    try:
        yield s.start()
    finally:
        s.close()


@pytest.fixture
def cdi_spec(shared_salus, tmp_path):
    shim = tmp_path / "libsalus-shim.so"
    shim.write_text("stands in for the shim: busybox is static and ignores LD_PRELOAD\n")
    os.makedirs(CDI_DIR, exist_ok=True)
    path = os.path.join(CDI_DIR, f"salus-test-{os.getpid()}.json")
    try:
        r = salusctl("-m", shared_salus.mnt, "cdi", "--kind", KIND, "--shim", str(shim), "-o", path)
        assert r.returncode == 0, r.stderr
        yield path
    finally:
        if os.path.exists(path):
            os.unlink(path)


SESSION = r"""
exec 3<>"$SALUS_MOUNT/clone"; read -r id <&3
echo "need persistent=1M ephemeral=1M gpu=$SALUS_GPU" >&3
cat "$SALUS_MOUNT/sessions/$id/status" | grep -E '^(uid|gpu|state):'
stat -c 'owner %u %a' "$SALUS_MOUNT/sessions/$id"
echo "preload $LD_PRELOAD"; head -c 14 /opt/salus/lib/libsalus-shim.so; echo
"""


def podman_run(base, *args, timeout=60):
    return subprocess.run([*base, "run", "--rm", *RUN_FLAGS, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_session_from_a_container_as_root_and_as_a_user(podman, shared_salus, cdi_spec):
    r = podman_run(podman, "--device", f"{KIND}=1", "localhost/salus-busybox:test",
                   "sh", "-c", SESSION)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["uid: 0", "state: admitted", "gpu: 1", "owner 0 700",
                                     "preload /opt/salus/lib/libsalus-shim.so", "stands in for "]
    r = podman_run(podman, "--user", f"{USER}:{USER}", "--device", f"{KIND}=any",
                   "localhost/salus-busybox:test", "sh", "-c", SESSION)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"uid: {USER}" and lines[1] == "state: admitted", lines
    assert lines[3] == f"owner {USER} 700", lines
    # The sessions ended with the containers' clone fds.
    assert os.listdir(os.path.join(shared_salus.mnt, "sessions")) == []


def test_a_user_in_a_container_cannot_touch_a_host_session(podman, shared_salus, cdi_spec):
    s = Session(shared_salus.d)
    try:
        r = podman_run(podman, "--user", f"{USER}:{USER}", "--device", f"{KIND}=0",
                       "localhost/salus-busybox:test", "sh", "-c",
                       f'cat "$SALUS_MOUNT/sessions/{s.id}/status"; echo "rc=$?"')
        assert "Permission denied" in r.stderr and "rc=1" in r.stdout, r.stdout + r.stderr
    finally:
        s.close()


RESTART = r"""
cat "$SALUS_MOUNT/version"
i=0; while cat "$SALUS_MOUNT/version" >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 600 ] || exit 3; sleep 0.05; done
echo "salusd gone"
i=0; until cat "$SALUS_MOUNT/version" >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 600 ] || exit 4; sleep 0.05; done
echo "salusd back"
""" + SESSION


def test_a_running_container_survives_a_salusd_restart(podman, shared_salus, cdi_spec):
    # The container's one process watches $SALUS_MOUNT go and come back while
    # salusd restarts, then makes a session through the new mount. (podman exec
    # would not do: podman 4.3 does not apply CDI env edits to exec'd processes.)
    proc = subprocess.Popen([*podman, "run", "--rm", *RUN_FLAGS, "--device", f"{KIND}=0",
                             "localhost/salus-busybox:test", "sh", "-c", RESTART],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("salusd "), first + proc.stderr.read()
        shared_salus.stop()
        gone = proc.stdout.readline()  # the unmount reached the container
        assert gone == "salusd gone\n", gone + proc.stderr.read()
        shared_salus.start()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        lines = out.splitlines()
        assert lines[:4] == ["salusd back", "uid: 0", "state: admitted", "gpu: 0"], out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
