"""The generated systemd unit: `systemd-analyze verify` accepts it without a single
warning, it keeps /salus visible on the host (no option that puts salusd in a
private mount namespace), and the example configuration is one salusd accepts."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import SALUSD

BUILD = os.path.dirname(os.path.dirname(os.path.abspath(SALUSD)))
UNIT = os.path.join(BUILD, "systemd", "salusd.service")
EXAMPLE = os.path.join(BUILD, "systemd", "salusd.toml.example")

# Each of these makes systemd run the service in its own mount namespace, whose
# mounts never propagate back to the host: /salus would be invisible outside.
NAMESPACING = ["ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
               "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
               "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "ProtectKernelTunables",
               "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
               "ProtectHostname", "ProtectProc", "ProcSubset", "RootDirectory", "RootImage",
               "MountAPIVFS", "PrivateNetwork", "PrivateIPC", "NetworkNamespacePath",
               "MountFlags", "DynamicUser", "PrivateUsers"]


def unit_settings():
    settings = {}
    with open(UNIT) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(("#", ";", "[")):
                continue
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@pytest.fixture(scope="module", autouse=True)
def generated():
    if not os.path.exists(UNIT):
        pytest.fail(f"{UNIT} was not generated (meson setup/ninja in {BUILD})")


def test_unit_shape():
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["Restart"] == ["on-failure"]
    exec_start = s["ExecStart"][0].split()
    assert exec_start[0].endswith("/salusd") and exec_start[1] == "--config"
    assert exec_start[2].endswith("/salus/salusd.toml")
    stop_post = s["ExecStopPost"][0].split()
    assert stop_post[0].startswith("-") and stop_post[0].endswith("/fusermount3")
    assert stop_post[1:] == ["-u", "-z", "/salus"]
    assert "/dev/fuse rw" in s["DeviceAllow"]
    assert any(re.fullmatch(r"(char-nvidia\*|/dev/nvidia\S*) rw", v) for v in s["DeviceAllow"])
    assert s["NoNewPrivileges"] == ["yes"]
    assert not re.search(r"@[A-Z0-9_]+@", open(UNIT).read()), "unsubstituted @VAR@"


def test_unit_keeps_the_mount_visible_on_the_host():
    s = unit_settings()
    bad = [k for k in NAMESPACING if k in s]
    assert not bad, f"{bad} would hide the FUSE mount at /salus from the host"


def test_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    # verify checks that ExecStart= exists: point it at the salusd just built.
    with open(UNIT) as f:
        text = f.read()
    exec_start = re.search(r"^ExecStart=(\S+)", text, re.M).group(1)
    unit = tmp_path / "salusd.service"
    unit.write_text(text.replace(exec_start, os.path.abspath(SALUSD)))
    r = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                       timeout=120)
    # verify exits 0 even for unknown keys and bad values; it only warns. Any
    # line about our unit is a finding.
    findings = [l for l in (r.stdout + r.stderr).splitlines() if "salusd.service" in l]
    assert r.returncode == 0 and not findings, r.stdout + r.stderr


def test_systemd_analyze_verify_catches_mistakes(tmp_path):
    # The check above would notice a broken unit (guards against a verify that
    # says nothing at all in this environment).
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    unit = tmp_path / "salusd.service"
    unit.write_text(open(UNIT).read().replace("DeviceAllow=/dev/fuse rw",
                                              "DeviceAllow=/dev/fuse rwq\nBogusSetting=1"))
    r = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                       timeout=120)
    assert "BogusSetting" in r.stdout + r.stderr


def test_example_config_is_accepted(salusd_factory, tmp_path):
    # Flags win over the file: the test's mount and sim backend replace the example's.
    d = salusd_factory(extra_args=["--config", EXAMPLE]).start()
    with open(d.path("policy")) as f:
        text = f.read()
    assert "policy: fair\n" in text and "placement: magm\n" in text
    # Its keys are where salusd reads them (top level, not under [sim]): edit two.
    conf = tmp_path / "salusd.toml"
    text = open(EXAMPLE).read()
    assert 'policy = "fair"' in text and 'placement = "magm"' in text
    conf.write_text(text.replace('policy = "fair"', 'policy = "srtf"')
                    .replace('placement = "magm"', 'placement = "rr"'))
    d = salusd_factory(extra_args=["--config", str(conf)]).start()
    with open(d.path("policy")) as f:
        text = f.read()
    assert "policy: srtf\n" in text and "placement: rr\n" in text


DROPIN = os.path.join(BUILD, "systemd", "salusd-metrics.conf")


def dropin_settings():
    settings = {}
    for line in open(DROPIN):
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_metrics_dropin_opens_exactly_what_metrics_listen_needs():
    """The unit denies IP sockets; its drop-in adds AF_INET/AF_INET6 and loopback
    (an allow entry wins over IPAddressDeny=any), and nothing else."""
    unit, dropin = unit_settings(), dropin_settings()
    assert unit["RestrictAddressFamilies"] == ["AF_UNIX AF_NETLINK"]
    assert unit["IPAddressDeny"] == ["any"]
    assert "IPAddressAllow" not in unit
    assert set(dropin) == {"RestrictAddressFamilies", "IPAddressAllow"}, dropin
    families = " ".join(unit["RestrictAddressFamilies"] + dropin["RestrictAddressFamilies"]).split()
    assert set(families) == {"AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6"}
    assert dropin["IPAddressAllow"] == ["localhost"]
    # The unit and the drop-in name the path it is installed at.
    assert "/salus/salusd-metrics.conf" in open(UNIT).read()
    assert not re.search(r"@[A-Z0-9_]+@", open(DROPIN).read()), "unsubstituted @VAR@"


def verify_with_dropin(tmp_path, dropin_text):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    text = open(UNIT).read()
    exec_start = re.search(r"^ExecStart=(\S+)", text, re.M).group(1)
    (tmp_path / "salusd.service").write_text(text.replace(exec_start, os.path.abspath(SALUSD)))
    (tmp_path / "salusd.service.d").mkdir()
    (tmp_path / "salusd.service.d" / "metrics.conf").write_text(dropin_text)
    r = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "salusd.service")],
                       capture_output=True, text=True, timeout=120)
    return r, [l for l in (r.stdout + r.stderr).splitlines() if "salusd.service" in l or "metrics.conf" in l]


def test_systemd_analyze_verify_with_the_metrics_dropin(tmp_path):
    r, findings = verify_with_dropin(tmp_path, open(DROPIN).read())
    assert r.returncode == 0 and not findings, r.stdout + r.stderr


def test_systemd_analyze_reads_the_dropin(tmp_path):
    # verify loads salusd.service.d/ next to the unit: a mistake there is reported,
    # so the clean run above did check the drop-in.
    r, findings = verify_with_dropin(tmp_path, open(DROPIN).read() + "BogusDropinSetting=1\n")
    assert any("BogusDropinSetting" in l for l in findings), r.stdout + r.stderr
