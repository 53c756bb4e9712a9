"""/salus from a container, without a container engine: in a new mount namespace
(`unshare --mount --propagation private`) the test's salusd mount is bind-mounted
into a private root directory at <root>/salus, as `docker -v /salus:/salus` does,
and a non-root uid uses it from there. Sessions, ownership and EACCES must behave
exactly as they do on the host, and nothing may leak back to the host's mounts."""
import os
import shlex
import shutil
import subprocess
import tempfile

import pytest

from conftest import SALUSD, Session, is_mounted, wait_until

NOBODY = 65534
CLIENT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "client"))


@pytest.fixture(autouse=True)
def need_tools():
    if os.geteuid() != 0:
        pytest.skip("mount namespaces and uid switching need root")
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (util-linux) is not installed")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {r.stderr.strip()}")


@pytest.fixture
def container_root():
    """A private root directory: <root>/salus is the mount point, <root>/lib holds the
    Python client as an image would. Removed afterwards, and it must never show up
    in the host's mount table."""
    root = tempfile.mkdtemp(prefix="salus-ctr-")
    os.chmod(root, 0o755)
    os.mkdir(os.path.join(root, "salus"))
    os.mkdir(os.path.join(root, "lib"))
    shutil.copy(os.path.join(CLIENT, "salus.py"), os.path.join(root, "lib", "salus.py"))
    try:
        yield root
    finally:
        leaked = is_mounted(os.path.join(root, "salus"))
        if leaked:
            subprocess.run(["umount", "-l", os.path.join(root, "salus")], check=False)
        shutil.rmtree(root, ignore_errors=True)
        assert not leaked, "the container's bind mount propagated to the host"


def run_as(uid, script, mount, root=None, extra_env=None):
    """Runs `script` with sh as `uid` with SALUS_MOUNT set. With `root`, first bind-
    mounts `mount` at <root>/salus in a new private mount namespace (as root), then
    drops to `uid` there and uses <root>/salus."""
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    if root is None:
        env = dict(os.environ, SALUS_MOUNT=mount, PYTHONPATH=CLIENT)
        argv = [*drop, "/bin/sh", "-c", script]
    else:
        inner = os.path.join(root, "salus")
        env = dict(os.environ, SALUS_MOUNT=inner, PYTHONPATH=os.path.join(root, "lib"))
        outer = (f"set -e; mount --bind {shlex.quote(mount)} {shlex.quote(inner)}; "
                 f"exec {shlex.join(drop)} /bin/sh -c {shlex.quote(script)}")
        argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", outer]
    env.update(extra_env or {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


SESSION_SCRIPT = r"""
set -e
cd "$SALUS_MOUNT"
exec 3<>clone
read -r id <&3
echo "need persistent=1M ephemeral=4M" >&3
printf 'alloc w 4K\nbegin\nalloc tmp 64K\nfill tmp 1.5\ncopy w tmp 4K\nend x5\n' >&3
cat sessions/$id/wait
stat -c 'session %u %g %a' sessions/$id
stat -c 'mem %u %a' sessions/$id/mem/w
grep -E '^(state|uid):' sessions/$id/status
mkdir sessions/named-$$
stat -c 'named %u %a' sessions/named-$$
rmdir sessions/named-$$
exec 3>&-
"""


def test_session_from_inside_a_container_as_nobody(salusd, container_root):
    inside = run_as(NOBODY, SESSION_SCRIPT, salusd.mnt, container_root)
    assert inside.returncode == 0, inside.stderr
    outside = run_as(NOBODY, SESSION_SCRIPT, salusd.mnt)
    assert outside.returncode == 0, outside.stderr
    assert inside.stdout == outside.stdout
    assert inside.stdout.splitlines() == [
        "done 5", f"session {NOBODY} {NOBODY} 700", f"mem {NOBODY} 600", "uid: 65534",
        "state: admitted", f"named {NOBODY} 700"]
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])


DENIED_SCRIPT = r"""
d="$SALUS_MOUNT/sessions/$VICTIM"
for f in status log wait mem/w; do
  cat "$d/$f" >/dev/null 2>/tmp/err.$$ && echo "read $f" || echo "$f: $(sed 's/.*: //' /tmp/err.$$)"
done
echo 'spin 1' 2>/dev/null > "$d/ctl" && echo "wrote ctl" || echo "ctl: denied"
ls "$d" >/dev/null 2>&1 && echo "listed" || echo "ls: denied"
rmdir "$d" 2>/dev/null && echo "removed" || echo "rmdir: denied"
echo "kill $VICTIM" 2>/dev/null > "$SALUS_MOUNT/ctl" && echo "killed" || echo "admin ctl: denied"
echo pack 2>/dev/null > "$SALUS_MOUNT/policy" && echo "switched" || echo "policy: denied"
python3 - <<'EOF'
import errno, os, salus
try:
    salus.Session.attach(os.path.join(os.environ["SALUS_MOUNT"], "sessions", os.environ["VICTIM"]))
except PermissionError as e:
    print("attach:", errno.errorcode[e.errno])
EOF
rm -f /tmp/err.$$
"""


def test_eacces_is_the_same_inside_and_outside(salusd, container_root):
    # A session of root's, made on the host.
    os.mkdir(salusd.path("sessions", "rootjob"))
    with open(salusd.path("sessions", "rootjob", "ctl"), "w") as f:
        f.write("need persistent=1M ephemeral=1M\nalloc w 4K\n")
    victim = {"VICTIM": "rootjob"}
    inside = run_as(NOBODY, DENIED_SCRIPT, salusd.mnt, container_root, victim)
    outside = run_as(NOBODY, DENIED_SCRIPT, salusd.mnt, extra_env=victim)
    assert inside.returncode == 0 and outside.returncode == 0, inside.stderr + outside.stderr
    assert inside.stdout == outside.stdout, (inside.stdout, outside.stdout)
    assert inside.stdout.splitlines() == [
        "status: Permission denied", "log: Permission denied", "wait: Permission denied",
        "mem/w: Permission denied", "ctl: denied", "ls: denied", "rmdir: denied",
        "admin ctl: denied", "policy: denied", "attach: EACCES"]
    with open(salusd.path("sessions", "rootjob", "status")) as f:
        assert "state: admitted" in f.read()            # untouched


def test_python_client_inside_a_container(salusd, container_root):
    script = r"""
python3 - <<'EOF'
import os, salus
with salus.Session() as s:
    s.need("1M", "1M", iters=3)
    s.alloc("w", 16)
    s.write_buffer("w", b"0123456789abcdef")
    with s.iteration(repeat=3):
        s.spin(10)
    print(s.wait(), os.stat(s.dir).st_uid, s.read_buffer("w").decode(), s.dir)
EOF
"""
    r = run_as(NOBODY, script, salusd.mnt, container_root)
    assert r.returncode == 0, r.stderr
    done, uid, data, path = r.stdout.split()
    assert (done, uid, data) == ("3", str(NOBODY), "0123456789abcdef")
    assert path.startswith(os.path.join(container_root, "salus", "sessions") + "/")
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])


def test_root_session_seen_from_the_container(salusd, container_root):
    # The container sees the host's sessions (same daemon), owned as on the host.
    s = Session(salusd)
    s.cmd("need persistent=1M ephemeral=1M\n")
    env_script = f'stat -c "%u %a" "$SALUS_MOUNT/sessions/{s.id}"; ls "$SALUS_MOUNT/sessions"'
    r = run_as(NOBODY, env_script, salusd.mnt, container_root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "700", s.id]
    s.close()


RESTART_SCRIPT = r"""
set -eu
SALUSD=$1; T=$2
trap 'kill $(cat $T/pid1 $T/pid2 2>/dev/null) 2>/dev/null || true' EXIT
start() {
  "$SALUSD" --backend sim --sim-gpus 1 --sim-memory 64M --mount $T/run/fs --state-dir $T/state > $T/log$1 2>&1 &
  echo $! > $T/pid$1
  for i in $(seq 200); do [ -e $T/run/fs/version ] && return 0; sleep 0.05; done
  echo "salusd did not start: $(cat $T/log$1)"; exit 1
}
# The host side: salusd mounts at run/fs inside a directory (run) that is a shared
# mount, as / is on a systemd host.
mount -t tmpfs -o size=1M,mode=0755 salus-run $T/run
mount --make-shared $T/run
mkdir $T/run/fs
start 1
# Two containers: one binds the parent directory, one binds the mount itself,
# both with slave propagation (docker :rslave, Kubernetes HostToContainer).
mount --rbind $T/run $T/ctr-parent && mount --make-rslave $T/ctr-parent
mount --rbind $T/run/fs $T/ctr-direct && mount --make-rslave $T/ctr-direct
echo "before: $(cat $T/ctr-parent/fs/version) / $(cat $T/ctr-direct/version)"
# salusd restarts (systemd: ExecStopPost detaches the old mount, then a new start).
kill -TERM $(cat $T/pid1); wait $(cat $T/pid1) || true
fusermount3 -u -z $T/run/fs 2>/dev/null || true
start 2
echo "parent: $(cat $T/ctr-parent/fs/version 2>&1 | sed 's/.*: //')"
echo "direct: $(cat $T/ctr-direct/version 2>&1 | sed 's/.*: //')"
kill -TERM $(cat $T/pid2); wait $(cat $T/pid2) || true
"""


def test_parent_directory_bind_follows_a_salusd_restart():
    # Why docs/containers.md binds the directory above the mount with rslave: a
    # bind of the FUSE mount itself keeps the dead mount after salusd restarts.
    # Everything happens in a private mount namespace that dies with the script.
    t = tempfile.mkdtemp(prefix="salus-restart-")
    try:
        for d in ("run", "ctr-parent", "ctr-direct"):
            os.mkdir(os.path.join(t, d))
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                            RESTART_SCRIPT, "restart", os.path.abspath(SALUSD), t],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("before: salusd ") and lines[0].count("salusd ") == 2
        assert lines[1].startswith("parent: salusd ")
        assert lines[2] == "direct: Transport endpoint is not connected"
    finally:
        assert not is_mounted(os.path.join(t, "run", "fs"))
        shutil.rmtree(t, ignore_errors=True)


TRANSFER_SCRIPT = r"""
import os
os.umask(0o022)
m = os.environ["SALUS_MOUNT"]
seg = "/dev/shm/salus-ctr-seg"
fd = os.open(seg, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b"only inside the container " * 100)
os.close(fd)
c = os.open(m + "/clone", os.O_RDWR)
sid = os.read(c, 64).decode().strip()
os.write(c, b"need persistent=1M ephemeral=1M\nalloc w 4K\n")
os.write(c, b"upload w shm:salus-ctr-seg 2600\ndownload w file:/dev/shm/out.bin 2600\nsync\n")
with open("/dev/shm/out.bin", "rb") as f:
    assert f.read() == b"only inside the container " * 100
st = os.stat("/dev/shm/out.bin")
print("ok", st.st_uid, oct(st.st_mode & 0o777))
"""


def test_transfers_resolve_in_the_containers_mount_namespace(salusd, container_root):
    # The "container" gets a /dev/shm of its own (as Docker gives each one): the
    # segment and the downloaded file exist only there, so salusd must resolve
    # them through the caller's root, not its own.
    inner = os.path.join(container_root, "salus")
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    outer = (f"set -e; mount --bind {shlex.quote(salusd.mnt)} {shlex.quote(inner)}; "
             f"mount -t tmpfs -o mode=1777 salus-ctr-shm /dev/shm; "
             f"exec {shlex.join(drop)} /usr/bin/python3 -c {shlex.quote(TRANSFER_SCRIPT)}")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", outer],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, SALUS_MOUNT=inner))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["ok", str(NOBODY), "0o644"], r.stdout
    assert not os.path.exists("/dev/shm/salus-ctr-seg")      # never on the host
    assert not os.path.exists("/dev/shm/out.bin")
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])
