"""salusd --metrics-listen: GET /metrics over HTTP, loopback by default, and a
server that bad or slow clients cannot stop or crash."""
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import SALUSD, is_mounted, wait_until


def endpoint(d):
    """host:port from salusd's log line 'metrics: serving http://HOST:PORT/metrics'."""
    m = re.search(r"metrics: serving http://([^/\s]+)/metrics", d.daemon_log())
    assert m, d.daemon_log()
    return m.group(1)


def get(d, path, method="GET", timeout=10):
    req = urllib.request.Request(f"http://{endpoint(d)}{path}", method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.headers, r.read().decode()


def parse_exposition(text):
    """Checks the text as test_tree.py does; returns the families by # TYPE line."""
    families = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith("# HELP ") or line.startswith("# TYPE "), line
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                families[name] = kind
            continue
        name_labels, value = line.rsplit(" ", 1)
        float(value)
        assert name_labels.startswith("salus_"), line
    return families


def raw(d, payload, read=True):
    host, port = endpoint(d).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        if payload:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return s.recv(65536) if read else b""


@pytest.fixture
def served(salusd_factory):
    return salusd_factory(extra_args=["--metrics-listen", "127.0.0.1:0"]).start()


def test_get_metrics_is_the_metrics_file(served):
    status, headers, body = get(served, "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert int(headers["Content-Length"]) == len(body.encode())
    families = parse_exposition(body)
    with open(served.path("metrics")) as f:
        assert families == parse_exposition(f.read())
    assert families["salus_gpu_memory_bytes"] == "gauge"
    # The sim backend has no NVML, so no NVML family is made up.
    assert "salus_gpu_power_watts" not in families
    # A query string is the same resource.
    assert get(served, "/metrics?x=1")[0] == 200


def test_other_paths_and_methods(served):
    for path in ["/", "/metric", "/metrics/x", "/salus/metrics"]:
        with pytest.raises(urllib.error.HTTPError) as e:
            get(served, path)
        assert e.value.code == 404, path
    with pytest.raises(urllib.error.HTTPError) as e:
        get(served, "/metrics", method="POST")
    assert e.value.code == 405
    status, headers, body = get(served, "/metrics", method="HEAD")
    assert status == 200 and body == "" and int(headers["Content-Length"]) > 0


def test_garbage_and_slow_clients_do_not_stop_it(served):
    assert raw(served, b"\x00\xff\xfe garbage \x01\n\n").startswith(b"HTTP/1.1 400 ")
    assert raw(served, b"GET /metrics SPDY/9\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(served, b"GET\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(served, b"A" * 20000).startswith(b"HTTP/1.1 431 ")
    raw(served, b"", read=False)           # connects and says nothing
    raw(served, b"GET /metr", read=False)  # hangs up mid-request
    # A client that opens a connection and then stalls holds the single thread
    # only until its read timeout (2 s); the next scrape is answered after it.
    host, port = endpoint(served).rsplit(":", 1)
    stalled = socket.create_connection((host, int(port)), timeout=10)
    stalled.sendall(b"GET /metrics HTTP/1.1\r\n")
    try:
        assert get(served, "/metrics", timeout=15)[0] == 200
    finally:
        stalled.close()
    assert served.proc.poll() is None, served.daemon_log()
    with open(served.path("version")) as f:
        assert f.read().startswith("salusd ")


def test_port_only_binds_loopback(salusd_factory):
    d = salusd_factory(extra_args=["--metrics-listen", "0"]).start()
    assert endpoint(d).startswith("127.0.0.1:")
    assert get(d, "/metrics")[0] == 200


def test_config_key_and_clean_stop(salusd_factory, tmp_path):
    cfg = tmp_path / "salusd.toml"
    cfg.write_text('metrics_listen = ":0"\n')
    d = salusd_factory(extra_args=["--config", str(cfg)]).start()
    assert endpoint(d).startswith("127.0.0.1:")
    host, port = endpoint(d).rsplit(":", 1)
    # A client holding a connection open does not delay SIGTERM.
    held = socket.create_connection((host, int(port)), timeout=10)
    d.proc.send_signal(signal.SIGTERM)
    try:
        assert d.proc.wait(10) == 0, d.daemon_log()
    finally:
        held.close()
    assert not is_mounted(d.mnt)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_bad_or_busy_address_is_refused(tmp_path):
    for value in ["nonsense", "1.2.3.4:99999", "::1:9400", "[::1]"]:
        out = subprocess.run([SALUSD, "--backend", "sim", "--sim-memory", "64M",
                              "--mount", str(tmp_path), "--metrics-listen", value],
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 1, (value, out.stderr)
        assert "metrics_listen" in out.stderr, out.stderr
        assert not is_mounted(str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([SALUSD, "--backend", "sim", "--sim-memory", "64M",
                              "--mount", str(tmp_path), "--metrics-listen", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=20)
    assert out.returncode == 1
    assert "cannot listen on 127.0.0.1:" in out.stderr, out.stderr
    assert not is_mounted(str(tmp_path))
