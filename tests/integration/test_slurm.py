"""The SPANK plugin (slurm/salus_spank.c) in a real one-node Slurm: munged,
slurmctld and slurmd started here (Debian's slurm-wlm 22.05), all under a temp
dir, on ports of their own on 127.0.0.1, with select/cons_tres,
proctrack/linuxproc, task/none and no cgroups, and stopped by PID at the end
even when a test fails.

Checks: a step through `srun --salus=...` runs in a session its user owns and
the session is gone afterwards; a cancelled job's session is removed too; two
jobs from two uids each own theirs; a node with no salusd fails the step at once
with a clear error; a bad --salus is refused by srun; a count-only GRES
(docs/slurm.md's recipe) packs jobs by salusd shares.
"""
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import SALUSD, Salusd, alive, is_mounted, wait_until

BUILD = os.path.dirname(os.path.dirname(os.path.abspath(SALUSD)))
PLUGIN = os.path.join(BUILD, "slurm", "salus_spank.so")
NOBODY = 65534
NODE = "salusnode"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=salustest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmdDebug=debug
PlugStackConfig={dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=2
GresTypes=salus
NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=1000 Gres=salus:4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    def __init__(self, mount):
        self.dir = tempfile.mkdtemp(prefix="salus-slurm-")
        os.chmod(self.dir, 0o755)  # slurmd's job steps run as other users under it
        for d in ("state", "spool", "work"):
            os.mkdir(os.path.join(self.dir, d))
        os.chmod(os.path.join(self.dir, "work"), 0o1777)
        self.mount = mount
        # Stands in for libsalus-shim.so: a real library every task can preload.
        self.shim = next(iter(sorted(glob.glob("/lib/*/libm.so.6") + glob.glob("/lib64/libm.so.6"))))
        self.procs = []
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.env.pop("SALUS_MOUNT", None)

    def write_config(self):
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(node=NODE, host=socket.gethostname().split(".")[0], dir=self.dir,
                                      ctld_port=free_port(), slurmd_port=free_port()))
        with open(os.path.join(self.dir, "gres.conf"), "w") as f:
            f.write(f"NodeName={NODE} Name=salus Count=4\n")
        with open(os.path.join(self.dir, "plugstack.conf"), "w") as f:
            f.write(f"required {PLUGIN} mount={self.mount} shim={self.shim}\n")
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)

    def spawn(self, name, argv):
        log = open(os.path.join(self.dir, name + ".out"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self.procs.append((name, p))
        return p

    def start(self):
        self.write_config()
        d = self.dir
        self.spawn("munged", ["munged", "--foreground", "--force", f"--socket={d}/munge.sock",
                              f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                              f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed"])
        assert wait_until(lambda: os.path.exists(f"{d}/munge.sock"), 10), self.logs()
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self.spawn("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", NODE])
        ok = wait_until(lambda: self.node_state() in ("idle", "mixed", "allocated"), 30, 0.2)
        assert ok, f"node never came up ({self.node_state()!r}):\n{self.logs()}"
        return self

    def node_state(self):
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True,
                           env=self.env, timeout=10)
        return r.stdout.strip().rstrip("*~#")

    def run(self, argv, uid=None, timeout=60, **kw):
        pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid else []
        return subprocess.run([*pre, *argv], capture_output=True, text=True, env=self.env,
                              timeout=timeout, cwd=os.path.join(self.dir, "work"), **kw)

    def logs(self):
        out = []
        for name in ("munged.out", "munged.log", "slurmctld.log", "slurmd.log"):
            try:
                with open(os.path.join(self.dir, name)) as f:
                    out.append(f"--- {name}\n" + f.read()[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    def stop(self):
        # slurmd first (it ends its job steps), then slurmctld, then munged.
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        # slurmstepd processes are slurmd's grandchildren: gone with their steps;
        # any still alive after the TERM belongs to this cluster's spool dir.
        for pid in stepds(self.dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def stepds(tree):
    """PIDs of slurmstepd processes whose command line names this cluster's files."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("slurmstepd") and tree in env:
            pids.append(int(pid))
    return pids


def need_slurm():
    if os.geteuid() != 0:
        pytest.skip("slurmd and munged run as root here")
    for tool in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian packages slurm-wlm munge)")
    if not os.path.exists(PLUGIN):
        pytest.skip(f"{PLUGIN} was not built (slurm/spank.h missing: Debian package libslurm-dev)")


@pytest.fixture(scope="module")
def node():
    """salusd and a one-node Slurm whose plugstack.conf loads the plugin with its mount."""
    need_slurm()
    # A context reserve (0 on sim unless named) shows which steps say kind=attached.
    d = Salusd(["--attach-context-reserve", "64M"], sim_memory="1G", gpus=2)
    cluster = SlurmCluster(d.mnt)
    try:
        d.start()
        os.chmod(d.tmp, 0o755)
        cluster.start()
        yield d, cluster
    finally:
        cluster.stop()
        d.stop()


STEP = 'echo "$SALUS_SESSION $SALUS_MOUNT"; stat -c "%u" "$SALUS_SESSION"; grep -E "^(uid|state|persistent):" "$SALUS_SESSION/status"'


def test_srun_step_runs_in_its_own_session(node):
    d, c = node
    r = c.run(["srun", "-N1", "-n1", "--salus=persistent=4M,ephemeral=8M,iters=10,gpu=any",
               "sh", "-c", STEP])
    assert r.returncode == 0, r.stdout + r.stderr + c.logs()
    lines = r.stdout.splitlines()
    session, mount = lines[0].split()
    assert mount == d.mnt and os.path.dirname(session) == d.path("sessions")
    assert os.path.basename(session).startswith("slurm-")
    assert lines[1:] == ["0", "uid: 0", "state: admitted", "persistent: 4194304"], lines
    assert wait_until(lambda: not os.path.exists(session), 10), "session left after the step"


def test_tasks_preload_the_shim_when_it_is_installed(node):
    d, c = node
    r = c.run(["srun", "-N1", "-n1", "--salus=persistent=1M,ephemeral=1M", "sh", "-c",
               'echo "$LD_PRELOAD"'])
    assert r.returncode == 0 and r.stdout.split() == [c.shim], r.stdout + r.stderr
    # Steps without --salus are left alone.
    r = c.run(["srun", "-N1", "-n1", "sh", "-c", 'echo "[$LD_PRELOAD][$SALUS_SESSION]"'])
    assert r.returncode == 0 and r.stdout.strip() == "[][]", r.stdout + r.stderr


@pytest.mark.parametrize("kind,reserved", [("", 69), (",kind=attached", 69), (",kind=hosted", 4)])
def test_a_step_with_the_shim_is_placed_as_attached(node, kind, reserved):
    """With the shim preloaded, the step's need says kind=attached, so placement
    counts the program's context reserve (64M here) from the start, and its
    ephemeral memory as its own (an attached program's is not shared in a lane);
    --salus kind=hosted leaves both out."""
    d, c = node
    r = c.run(["srun", "-N1", "-n1", f"--salus=persistent=4M,ephemeral=1M,gpu=1{kind}", "sh",
               "-c", 'grep "^persistent_reserved:" "$SALUS_MOUNT/gpus/1/memory"'])
    assert r.returncode == 0, r.stdout + r.stderr + c.logs()
    assert r.stdout.split() == ["persistent_reserved:", str(reserved << 20)], r.stdout
    assert wait_until(lambda: os.listdir(d.path("sessions")) == [], 10)


def test_two_jobs_from_two_uids(node):
    d, c = node
    procs = []
    for uid in (None, NOBODY):
        pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid else []
        procs.append(subprocess.Popen(
            [*pre, "srun", "-N1", "-n1", "--salus=persistent=1M,ephemeral=1M",
             "sh", "-c", STEP + "; sleep 1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c.env,
            cwd=os.path.join(c.dir, "work")))
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err + c.logs()
    assert outs[0][0].splitlines()[1:3] == ["0", "uid: 0"]
    assert outs[1][0].splitlines()[1:3] == [str(NOBODY), f"uid: {NOBODY}"]
    assert outs[0][0].split()[0] != outs[1][0].split()[0]
    assert wait_until(lambda: os.listdir(d.path("sessions")) == [], 10)


def test_cancelled_job_loses_its_session(node):
    d, c = node
    r = c.run(["sbatch", "--parsable", "--salus=persistent=1M,ephemeral=1M",
               "--wrap", "srun --salus=persistent=2M,ephemeral=1M sleep 300"], uid=NOBODY)
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.strip().split(";")[0]
    # The batch step's session and the srun step's, both the job user's.
    names = [f"slurm-{job}.batch", f"slurm-{job}.0"]
    ok = wait_until(lambda: all(os.path.exists(d.path("sessions", n)) for n in names), 30, 0.1)
    assert ok, os.listdir(d.path("sessions")) + [c.logs()]
    assert os.stat(d.path("sessions", names[1])).st_uid == NOBODY
    r = c.run(["scancel", job])
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: os.listdir(d.path("sessions")) == [], 30, 0.1), \
        os.listdir(d.path("sessions"))


def test_bad_option_is_refused_by_srun(node):
    d, c = node
    r = c.run(["srun", "-N1", "-n1", "--salus=persistent=4M", "true"], timeout=30)
    assert r.returncode != 0 and "persistent= and ephemeral= are required" in r.stderr, r.stderr
    r = c.run(["srun", "-N1", "-n1", "--salus=persistent=4M,ephemeral=1M,colour=red", "true"],
              timeout=30)
    assert r.returncode != 0 and "unknown key 'colour'" in r.stderr, r.stderr
    r = c.run(["srun", "-N1", "-n1", "--salus=persistent=4M,ephemeral=1M,kind=both", "true"],
              timeout=30)
    assert r.returncode != 0 and "kind=both: attached or hosted" in r.stderr, r.stderr


def test_need_that_fits_no_gpu_fails_the_step(node):
    d, c = node
    r = c.run(["srun", "-N1", "-n1", "--salus=persistent=100G,ephemeral=1M", "true"], timeout=30)
    assert r.returncode != 0 and "need persistent=100G" in r.stderr + c.logs(), r.stderr
    assert wait_until(lambda: os.listdir(d.path("sessions")) == [], 10)


def test_gres_shares_pack_jobs(node):
    d, c = node
    # gres.conf gives the node 4 salus shares: of 5 jobs asking for 1 share each,
    # 4 run at once and the 5th waits (Resources); 5 shares fit the node never.
    jobs = []
    for _ in range(5):
        r = c.run(["sbatch", "--parsable", "--gres=salus:1", "--salus=persistent=1M,ephemeral=1M",
                   "--wrap", "sleep 30"])
        assert r.returncode == 0, r.stderr
        jobs.append(r.stdout.strip().split(";")[0])
    try:
        def states():
            r = c.run(["squeue", "-h", "-o", "%i %T %r"])
            return sorted(l.split()[1] for l in r.stdout.splitlines())
        ok = wait_until(lambda: states() == ["PENDING"] + ["RUNNING"] * 4, 30, 0.2)
        assert ok, states()
        assert wait_until(lambda: len(os.listdir(d.path("sessions"))) == 4, 10), \
            os.listdir(d.path("sessions"))
    finally:
        c.run(["scancel", *jobs])
    assert wait_until(lambda: os.listdir(d.path("sessions")) == [], 30, 0.1)
    r = c.run(["srun", "-N1", "-n1", "--gres=salus:5", "true"], timeout=30)
    assert r.returncode != 0 and "Requested node configuration is not available" in r.stderr, \
        r.stderr


def test_node_without_salusd_fails_the_step_at_once(tmp_path):
    """A node whose salusd is not running: the step fails in seconds with the
    plugin's message, it does not hang."""
    need_slurm()
    empty = tmp_path / "no-salusd"
    empty.mkdir()
    os.chmod(tmp_path, 0o755)
    c = SlurmCluster(str(empty))
    try:
        c.start()
        t = time.time()
        r = c.run(["srun", "-N1", "-n1", "--salus=persistent=1M,ephemeral=1M", "true"], timeout=60)
        assert r.returncode != 0, r.stdout + r.stderr
        assert "salus: no salusd on this node" in r.stderr + c.logs(), r.stderr + c.logs()
        assert time.time() - t < 30
    finally:
        c.stop()
