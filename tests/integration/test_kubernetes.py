"""salus-device-plugin against a kubelet stand-in. No kubelet can run here, so
the test plays the kubelet's side of the device plugin API v1beta1 (k8s/
deviceplugin.proto, compiled here with protoc for Python's grpcio): it serves
Registration on kubelet.sock in a temp plugin directory, then, as the kubelet
does, connects back to the plugin's socket for ListAndWatch and Allocate.

Checks: registration (version, endpoint, resource), the advertised shares of
each salusd GPU, a GPU drained by salusd's admin ctl going Unhealthy and back,
salusd gone making every share Unhealthy, Allocate in cdi and mounts modes and
its refusal of unknown ids, and a kubelet restart (every socket in the
directory removed, kubelet.sock made again) answered by a new registration.
"""
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import pytest

from conftest import SALUSD, wait_until

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.dirname(os.path.dirname(os.path.abspath(SALUSD)))
PLUGIN = os.path.join(BUILD, "k8s", "salus-device-plugin")
PROTO = os.path.join(ROOT, "k8s", "deviceplugin.proto")

grpc = pytest.importorskip("grpc", reason="python3-grpcio is not installed (Debian package)")


@pytest.fixture(scope="module")
def api():
    """deviceplugin_pb2, generated from the repo's proto."""
    if not os.path.exists(PLUGIN):
        pytest.skip(f"{PLUGIN} was not built (libgrpc++-dev protobuf-compiler-grpc missing)")
    if shutil.which("protoc") is None:
        pytest.skip("protoc is not installed (Debian package protobuf-compiler)")
    out = tempfile.mkdtemp(prefix="salus-k8s-pb-")
    try:
        subprocess.run(["protoc", f"--proto_path={os.path.dirname(PROTO)}", f"--python_out={out}",
                        PROTO], check=True, timeout=60)
        sys.path.insert(0, out)
        import deviceplugin_pb2
        yield deviceplugin_pb2
    finally:
        if out in sys.path:
            sys.path.remove(out)
        sys.modules.pop("deviceplugin_pb2", None)
        shutil.rmtree(out, ignore_errors=True)


class Kubelet:
    """The kubelet's side: Registration on DIR/kubelet.sock, and a client of the
    plugin's DevicePlugin service."""

    def __init__(self, pb, directory):
        self.pb = pb
        self.dir = directory
        self.registrations = queue.Queue()
        self.server = None
        self.start()

    def start(self):
        pb = self.pb

        def register(req, ctx):
            self.registrations.put(req)
            return pb.Empty()

        handler = grpc.method_handlers_generic_handler("v1beta1.Registration", {
            "Register": grpc.unary_unary_rpc_method_handler(
                register, request_deserializer=pb.RegisterRequest.FromString,
                response_serializer=pb.Empty.SerializeToString)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port("unix:" + os.path.join(self.dir, "kubelet.sock"))
        self.server.start()

    def restart(self):
        """What a restarting kubelet does: stop, remove every socket in its
        device-plugins directory, serve a new kubelet.sock."""
        self.server.stop(0).wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        self.start()

    def stop(self):
        if self.server:
            self.server.stop(0).wait()

    def next_registration(self, timeout=20):
        return self.registrations.get(timeout=timeout)

    def plugin(self, endpoint):
        return PluginClient(self.pb, os.path.join(self.dir, endpoint))


class PluginClient:
    def __init__(self, pb, path):
        self.pb = pb
        self.channel = grpc.insecure_channel("unix:" + path)
        call = lambda name, req, resp: self.channel.unary_unary(
            f"/v1beta1.DevicePlugin/{name}", request_serializer=req.SerializeToString,
            response_deserializer=resp.FromString)
        self.options = call("GetDevicePluginOptions", pb.Empty, pb.DevicePluginOptions)
        self.allocate_call = call("Allocate", pb.AllocateRequest, pb.AllocateResponse)
        self.lists = queue.Queue()
        stream = self.channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch", request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.ListAndWatchResponse.FromString)
        self.watch = stream(pb.Empty())
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        try:
            for resp in self.watch:
                self.lists.put({d.ID: d.health for d in resp.devices})
        except grpc.RpcError:
            self.lists.put(None)

    def wait_list(self, pred, timeout=20):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                last = self.lists.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if last is not None and pred(last):
                return last
        raise AssertionError(f"no ListAndWatch update matched; last: {last}")

    def allocate(self, *containers):
        req = self.pb.AllocateRequest(container_requests=[
            self.pb.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers])
        return self.allocate_call(req, timeout=10)

    def close(self):
        self.watch.cancel()
        self.channel.close()


class Plugin:
    def __init__(self, directory, mount, *args):
        self.log_path = os.path.join(os.path.dirname(directory), "plugin.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PLUGIN, "--plugin-dir", directory, "--mount", mount, "--poll-ms", "100", *args],
            stdout=self.log, stderr=subprocess.STDOUT)

    def logs(self):
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def cluster(api, salusd_factory):
    """salusd with 2 GPUs, a plugin directory with the stand-in kubelet, the plugin."""
    d = salusd_factory(gpus=2).start()
    top = tempfile.mkdtemp(prefix="salus-k8s-")
    directory = os.path.join(top, "device-plugins")
    os.mkdir(directory)
    kubelet = Kubelet(api, directory)
    plugins = []

    def start_plugin(*args):
        p = Plugin(directory, d.mnt, *args)
        plugins.append(p)
        return p

    try:
        yield d, kubelet, start_plugin
    finally:
        for p in plugins:
            p.stop()
        kubelet.stop()
        shutil.rmtree(top, ignore_errors=True)


SHARES = {f"gpu{g}-{k}" for g in (0, 1) for k in range(4)}


def test_registers_and_lists_shares_with_health(cluster):
    d, kubelet, start_plugin = cluster
    plugin = start_plugin()
    reg = kubelet.next_registration()
    assert (reg.version, reg.endpoint, reg.resource_name) == ("v1beta1", "salus.sock", "salus.io/gpu")
    client = kubelet.plugin(reg.endpoint)
    try:
        assert not client.options(kubelet.pb.Empty(), timeout=10).pre_start_required
        first = client.wait_list(lambda l: True)
        assert set(first) == SHARES and set(first.values()) == {"Healthy"}, first
        # salusd drains GPU 1 (admin ctl): its shares go Unhealthy, GPU 0's stay.
        with open(d.path("ctl"), "w") as f:
            f.write("drain 1\n")
        drained = client.wait_list(lambda l: l.get("gpu1-0") == "Unhealthy")
        assert {k for k, v in drained.items() if v == "Unhealthy"} == {f"gpu1-{k}" for k in range(4)}
        with open(d.path("ctl"), "w") as f:
            f.write("undrain 1\n")
        client.wait_list(lambda l: set(l.values()) == {"Healthy"})
        # salusd gone: every share Unhealthy (not dropped), and the reason logged.
        d.stop()
        gone = client.wait_list(lambda l: set(l.values()) == {"Unhealthy"})
        assert set(gone) == SHARES
        assert wait_until(lambda: "salusd not reachable" in plugin.logs(), 5), plugin.logs()
    finally:
        client.close()


def test_allocate_cdi_and_unknown_ids(cluster):
    d, kubelet, start_plugin = cluster
    start_plugin()
    client = kubelet.plugin(kubelet.next_registration().endpoint)
    try:
        resp = client.allocate(["gpu1-0", "gpu1-3"], ["gpu0-1", "gpu1-1"])
        one, two = resp.container_responses
        assert [c.name for c in one.cdi_devices] == ["salus.io/gpu=1"]
        assert dict(one.annotations) == {"cdi.k8s.io/salus-device-plugin": "salus.io/gpu=1"}
        assert [c.name for c in two.cdi_devices] == ["salus.io/gpu=any"]  # shares on two GPUs
        with pytest.raises(grpc.RpcError) as e:
            client.allocate(["nvidia0"])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown device id 'nvidia0'" in e.value.details()
    finally:
        client.close()


def test_allocate_mounts_mode(cluster):
    d, kubelet, start_plugin = cluster
    start_plugin("--allocate", "mounts", "--resource", "example.com/salus", "--shares", "2")
    reg = kubelet.next_registration()
    assert reg.resource_name == "example.com/salus"
    client = kubelet.plugin(reg.endpoint)
    try:
        assert set(client.wait_list(lambda l: True)) == {"gpu0-0", "gpu0-1", "gpu1-0", "gpu1-1"}
        c = client.allocate(["gpu0-1"]).container_responses[0]
        assert dict(c.envs) == {"SALUS_MOUNT": d.mnt, "SALUS_GPU": "0"}
        parent = os.path.dirname(d.mnt)
        assert [(m.host_path, m.container_path, m.read_only) for m in c.mounts] == [
            (parent, parent, False)]
        assert not c.cdi_devices
    finally:
        client.close()


def test_registers_again_after_a_kubelet_restart(cluster):
    d, kubelet, start_plugin = cluster
    plugin = start_plugin()
    reg = kubelet.next_registration()
    # The plugin retries a registration it saw fail: wait until it counts itself
    # registered and forget any repeat, so the next one comes after the restart.
    assert wait_until(lambda: "registered salus.io/gpu" in plugin.logs(), 10), plugin.logs()
    while not kubelet.registrations.empty():
        kubelet.registrations.get()
    old = kubelet.plugin(reg.endpoint)
    try:
        old.wait_list(lambda l: True)
    finally:
        old.close()
    t = time.time()
    kubelet.restart()  # removes salus.sock too
    reg = kubelet.next_registration(timeout=20)
    assert reg.endpoint == "salus.sock" and time.time() - t < 10
    assert os.path.exists(os.path.join(kubelet.dir, "salus.sock")), plugin.logs()
    client = kubelet.plugin(reg.endpoint)
    try:
        assert set(client.wait_list(lambda l: True)) == SHARES
        assert client.allocate(["gpu0-0"]).container_responses[0].cdi_devices[0].name == \
            "salus.io/gpu=0"
    finally:
        client.close()
    assert "registering again" in plugin.logs(), plugin.logs()
    # SIGTERM: a clean exit that removes its socket.
    assert plugin.stop() == 0
    assert not os.path.exists(os.path.join(kubelet.dir, "salus.sock"))


MANIFEST = os.path.join(ROOT, "deploy", "kubernetes", "salus-device-plugin.yaml")


def test_daemonset_manifest_matches_the_plugin(cluster):
    """The manifest parses, mounts what its command names, and its command line is
    one the plugin accepts: run here with the paths redirected to the test's."""
    yaml = pytest.importorskip("yaml", reason="python3-yaml is not installed")
    with open(MANIFEST) as f:
        docs = list(yaml.safe_load_all(f))
    kinds = {doc["kind"]: doc for doc in docs}
    assert set(kinds) == {"Namespace", "ServiceAccount", "DaemonSet"}
    spec = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    (container,) = spec["containers"]
    args = dict(a[2:].split("=", 1) for a in container["command"][1:])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert mounts["device-plugins"]["mountPath"] == args["plugin-dir"] == hostpaths["device-plugins"]
    assert os.path.dirname(args["mount"]) == mounts["salus"]["mountPath"] == hostpaths["salus"]
    assert mounts["salus"]["mountPropagation"] == "HostToContainer"
    d, kubelet, start_plugin = cluster
    # Plugin() gives --plugin-dir and --mount (the test's); the rest as written.
    rest = {k: v for k, v in args.items() if k not in ("plugin-dir", "mount")}
    plugin = start_plugin(*[f"--{k}={v}" for k, v in rest.items()])
    assert wait_until(lambda: kubelet.registrations.qsize() > 0 or plugin.proc.poll() is not None,
                      20), plugin.logs()
    assert plugin.proc.poll() is None, plugin.logs()
    reg = kubelet.next_registration()
    assert reg.resource_name == args["resource"]
