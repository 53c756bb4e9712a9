"""Fleet monitoring with real tools: `promtool check metrics` on salusd's
exposition, and a real Prometheus (Debian's prometheus) scraping two salusd on
loopback, queried through its HTTP API. The Grafana dashboard in
deploy/grafana/ names only metric families that salusd exports, and each of its
expressions evaluates without error in that Prometheus."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

from conftest import Session, wait_until

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "salus-dashboard.json")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def families(text):
    return {l.split()[2]: l.split()[3] for l in text.splitlines() if l.startswith("# TYPE ")}


def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return path


def test_promtool_check_metrics(salusd):
    s = Session(salusd)
    try:
        s.cmd("need persistent=1M ephemeral=1M\nalloc a 4K\n")
        with open(salusd.path("metrics")) as f:
            text = f.read()
        r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
        assert "salus_gpu_lanes" in families(text) and "salus_lane_count" not in text
    finally:
        s.close()


def test_promtool_catches_a_bad_name():
    # The check above can fail: promtool flags the old name.
    bad = '# HELP salus_lane_count Lanes.\n# TYPE salus_lane_count gauge\nsalus_lane_count{gpu="0"} 1\n'
    r = subprocess.run([promtool(), "check", "metrics"], input=bad, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and "_count" in r.stdout + r.stderr


class Prometheus:
    def __init__(self, targets):
        self.dir = tempfile.mkdtemp(prefix="salus-prom-")
        self.port = free_port()
        conf = os.path.join(self.dir, "prometheus.yml")
        with open(conf, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: salus\n    static_configs:\n"
                    f"      - targets: {json.dumps(targets)}\n")
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr):
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def try_query(self, expr):
        try:
            return self.query(expr)
        except OSError:
            return []

    def logs(self):
        with open(os.path.join(self.dir, "prometheus.log")) as f:
            return f.read()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fleet(salusd_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (Debian package prometheus)")
    ports = [free_port(), free_port()]
    nodes = [salusd_factory(extra_args=["--metrics-listen", f"127.0.0.1:{p}"], gpus=g).start()
             for p, g in zip(ports, (1, 2))]
    prom = Prometheus([f"127.0.0.1:{p}" for p in ports])
    try:
        ok = wait_until(lambda: len([r for r in prom.try_query('up{job="salus"}')
                                     if r["value"][1] == "1"]) == 2, 60, 0.2)
        assert ok, prom.logs()
        yield nodes, ports, prom
    finally:
        prom.stop()


def test_prometheus_scrapes_two_salusd(fleet):
    nodes, ports, prom = fleet
    s = Session(nodes[1])  # one session on the second node only
    try:
        def sessions():
            return {r["metric"]["instance"]: r["value"][1] for r in prom.try_query("salus_sessions")}
        want = {f"127.0.0.1:{ports[0]}": "0", f"127.0.0.1:{ports[1]}": "1"}
        assert wait_until(lambda: sessions() == want, 30, 0.2), (sessions(), prom.logs())
        # Per-GPU families carry both nodes' GPUs: 1 + 2.
        gpus = prom.query('salus_gpu_memory_bytes{class="capacity"}')
        assert sorted((r["metric"]["instance"], r["metric"]["gpu"]) for r in gpus) == sorted([
            (f"127.0.0.1:{ports[0]}", "0"), (f"127.0.0.1:{ports[1]}", "0"),
            (f"127.0.0.1:{ports[1]}", "1")])
    finally:
        s.close()


def dashboard_exprs():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            exprs.append(v["definition"])
    assert exprs
    return exprs


def test_dashboard_names_only_metrics_that_exist(salusd):
    with open(salusd.path("metrics")) as f:
        exported = set(families(f.read()))
    # The families that appear only with NVML (real GPUs) or after a transfer are
    # documented in salus(5); the dashboard uses none that sim never exports.
    named = set()
    for e in dashboard_exprs():
        named |= set(re.findall(r"\bsalus_[a-z_]+\b", e))
    assert named and named <= exported, sorted(named - exported)


def test_dashboard_expressions_evaluate_in_prometheus(fleet):
    nodes, ports, prom = fleet
    for e in dashboard_exprs():
        if e.startswith("label_values("):
            metric = re.match(r"label_values\((\w+),", e).group(1)
            assert prom.query(metric), e
            continue
        q = e.replace("$__rate_interval", "1m").replace("$instance", ".*")
        prom.query(q)  # status success, or the assertion in query() fails
    # Direct families (not rates) have data for both nodes at once.
    assert len({r["metric"]["instance"] for r in prom.query("salus_gpu_lanes")}) == 2
