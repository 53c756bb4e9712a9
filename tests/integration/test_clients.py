"""The client libraries against a real salusd: client/salus.hpp compiled here with
g++ and run, client/salus.py imported from client/, and the toy training example
run to completion (directly and under `salusctl run`)."""
import errno
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from conftest import SALUSD, wait_until

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLIENT = os.path.join(REPO, "client")
SALUSCTL = os.environ.get("SALUSCTL") or os.path.join(os.path.dirname(os.path.abspath(SALUSD)),
                                                      "salusctl")
sys.path.insert(0, CLIENT)
import salus  # noqa: E402


# ---------------------------------------------------------------- C++

CPP_TEST = r"""
#include "salus.hpp"

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#define CHECK(c) do { if (!(c)) { std::fprintf(stderr, "line %d: CHECK(%s)\n", __LINE__, #c); return 1; } } while (0)

int main() {
  salus::Session s;                        // $SALUS_MOUNT/clone
  CHECK(!s.id().empty());
  s.need(salus::MiB(4), salus::MiB(16), {20, 2, 1});
  auto st = s.status();
  CHECK(st["state"] == "admitted" && st["gpu"] == "1" && st["iters"] == "20");
  CHECK(st["priority"] == "2");

  s.alloc("w", 32 * 32 * 4);
  std::vector<float> w(32 * 32, 0.5f);
  s.write_buffer("w", w);
  CHECK(s.read_buffer<float>("w", w.size()) == w);
  s.fill("w", 2.0, salus::Dtype::f32, 4, 8);   // floats 1 and 2
  auto back = s.read_buffer<float>("w", 4);
  CHECK(back[0] == 0.5f && back[1] == 2.0f && back[2] == 2.0f && back[3] == 0.5f);
  s.fill("w", 0.5);

  // w <- w @ w, 3 times through an ephemeral buffer: 0.5 -> 8 -> 2048 -> 2048^2 * 32
  s.iterate([&] {
    s.alloc("tmp", 32 * 32 * 4);
    s.gemm(32, 32, 32, "w", "w", "tmp");
    s.copy("w", "tmp", 32 * 32 * 4);
  }, 3);
  CHECK(s.wait() == 3);
  back = s.read_buffer<float>("w", 2);
  CHECK(back[0] == 2048.0f * 2048.0f * 32.0f);

  {
    auto it = s.iteration(2);              // RAII: end x2 at scope exit
    s.spin(100);
  }
  s.run(5);
  CHECK(s.wait() == 10);
  CHECK(s.status()["iterations_done"] == "10");

  // An exception inside an iteration sends nothing; the session goes on.
  try {
    auto it = s.iteration(50);
    s.spin(10);
    throw std::runtime_error("user code failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(s.status()["recording"] == "no");
  s.iterate([&] { s.spin(10); }, 2);
  CHECK(s.wait() == 12);

  // Errors carry errno and the log's explanation.
  try {
    s.fill("nope", 1.0);
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::no_such_file_or_directory);
    CHECK(std::string(e.what()).find("unknown buffer 'nope'") != std::string::npos);
    std::cout << "error: " << e.what() << "\n";
  }
  CHECK(s.last_log_line().find("unknown buffer 'nope'") != std::string::npos);
  try {
    s.command("alloc huge 100G");
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == ENOMEM);
  }
  try {
    (void)s.read_buffer<float>("w", 4096);
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == ERANGE);
  }
  try {
    salus::Session other("/nonexistent-mount");
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == ENOENT);
  }
  CHECK(!s.log().empty() && s.log(2).size() == 2);

  // A failing line inside an iteration: end() throws naming it; nothing runs.
  try {
    s.iterate([&] {
      s.spin(10);
      s.fill("missing", 1.0);
    }, 50);
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::no_such_file_or_directory);
    CHECK(std::string(e.what()).find("line 3: fill: unknown buffer 'missing'") != std::string::npos);
  }
  CHECK(s.status()["iterations_queued"] == "0" && s.wait() == 12);

  // Named sessions live until the object goes; attach joins without removing.
  std::string dir;
  {
    auto n = salus::Session::named("cpp-named");
    dir = n.dir();
    CHECK(n.id() == "cpp-named");
    auto again = salus::Session::attach(dir);
    again.need(0, salus::MiB(1));
    CHECK(n.status()["state"] == "admitted");
    salus::Session moved = std::move(n);
    CHECK(moved.status()["name"] == "cpp-named");
  }
  struct stat sb;
  CHECK(::stat(dir.c_str(), &sb) != 0 && errno == ENOENT);
  try {
    auto dup = salus::Session::named("dup");
    auto dup2 = salus::Session::named("dup");
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == EEXIST);
  }
  std::cout << "session " << s.id() << " ok\n";
  return 0;
}
"""


@pytest.fixture(scope="module")
def cpp_program(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    d = tmp_path_factory.mktemp("cpp-client")
    src = d / "client_test.cpp"
    src.write_text(CPP_TEST)
    exe = d / "client_test"
    r = subprocess.run([gxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Wpedantic", "-Werror",
                        "-I", CLIENT, str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return exe


def test_cpp_client(salusd, cpp_program):
    env = dict(os.environ, SALUS_MOUNT=salusd.mnt)
    r = subprocess.run([str(cpp_program)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " ok\n" in r.stdout
    assert "No such file or directory" in r.stdout       # what() ends with strerror
    # (a clone session ends when salusd handles the release, just after close)
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])


def test_cpp_client_header_builds_as_cxx20(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    src = tmp_path / "t.cpp"
    src.write_text(CPP_TEST)
    r = subprocess.run([gxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I",
                        CLIENT, str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- Python

def test_python_session_lifecycle(salusd):
    with salus.Session(salusd.mnt) as s:
        assert s.id.isdigit() and s.id in os.listdir(salusd.path("sessions"))
        s.need(persistent="4M", ephemeral=16 << 20, iters=5, priority=1, gpu=0)
        st = s.status()
        assert st["state"] == "admitted" and st["gpu"] == "0" and st["iters"] == "5"
        s.alloc("b", 4096)
        s.write_buffer("b", b"x" * 4096)
        assert s.read_buffer("b") == b"x" * 4096
        s.fill("b", 7, dtype="u8", offset=10, length=5)
        assert s.read_buffer("b", 20) == b"x" * 10 + b"\x07" * 5 + b"x" * 5
        s.write_buffer("b", struct.pack("<2f", 1.5, 2.5), offset=8)
        assert struct.unpack("<2f", s.read_buffer("b", 8, offset=8)) == (1.5, 2.5)
        with s.iteration(repeat=3):
            s.alloc("tmp", 1 << 20)
            s.fill("tmp", 1.0)
            s.spin(100, util=0.5)
        s.run(2)
        assert s.wait() == 5
        assert s.status()["iterations_done"] == "5"
        s.free("b")
        assert "b" not in os.listdir(s.path("mem"))
        assert any("created by uid" in line for line in s.log())
        assert not s.log(1)[0].startswith("[")       # timestamps stripped
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])


def test_python_errors_carry_errno_and_log(salusd):
    with salus.Session(salusd.mnt) as s:
        s.need("1M", "1M")
        with pytest.raises(FileNotFoundError) as e:
            s.fill("nope", 1)
        assert e.value.errno == errno.ENOENT
        assert "unknown buffer 'nope'" in str(e.value)
        with pytest.raises(OSError) as e:
            s.alloc("huge", "100G")
        assert e.value.errno == errno.ENOMEM and "salusd log:" in str(e.value)
        with pytest.raises(OSError) as e:
            s.command("bogus")
        assert e.value.errno == errno.EINVAL and "unknown command 'bogus'" in str(e.value)
        # An exception in the block sends nothing, and the session goes on.
        with pytest.raises(KeyError):
            with s.iteration(repeat=100):
                s.spin(10)
                raise KeyError("user code")
        assert s.status()["recording"] == "no"
        with s.iteration(repeat=2):
            s.spin(10)
        assert s.wait() == 2
        with pytest.raises(RuntimeError):
            with s.iteration():
                with s.iteration():
                    pass
        # A failing line: the error names it (from the log), and nothing runs.
        with pytest.raises(FileNotFoundError) as e:
            with s.iteration(repeat=100):
                s.spin(10)
                s.fill("missing", 1)
        assert "line 3: fill: unknown buffer 'missing'" in str(e.value)
        assert s.status()["iterations_queued"] == "0" and s.wait() == 2
        with pytest.raises(ValueError):
            s.alloc("two words", 10)
    with pytest.raises(FileNotFoundError):
        salus.Session("/nonexistent-mount")


def test_python_named_and_attach(salusd):
    with salus.Session(salusd.mnt, name="pyjob") as s:
        assert os.stat(s.dir).st_mode & 0o777 == 0o700
        a = salus.Session.attach(s.dir)
        assert a.mount == salusd.mnt and a.id == "pyjob"
        a.need("1M", "1M")
        a.close()
        assert os.path.isdir(s.dir)              # attach never removes
        assert s.status()["state"] == "admitted"
        with pytest.raises(FileExistsError):
            salus.Session(salusd.mnt, name="pyjob")
    assert not os.path.exists(salusd.path("sessions", "pyjob"))


def test_python_attach_under_salusctl_run(salusd):
    code = textwrap.dedent("""
        import salus
        s = salus.Session.attach()          # $SALUS_SESSION
        print(s.id, s.status()["persistent"])
        with s.iteration(repeat=4):
            s.spin(10)
        print(s.wait())
    """)
    env = dict(os.environ, PYTHONPATH=CLIENT)
    r = subprocess.run([SALUSCTL, "--mount", salusd.mnt, "run", "--persistent", "2M",
                        "--ephemeral", "1M", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    name, persistent, done = r.stdout.split()
    assert name.startswith("run-") and persistent == str(2 << 20) and done == "4"
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])


def shm_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("salus-")}


def test_python_shm_upload_download(salusd, monkeypatch):
    before = shm_segments()
    sent = []
    with salus.Session(salusd.mnt) as s:
        real = s.command
        monkeypatch.setattr(s, "command", lambda text: (sent.append(text), real(text))[1])
        s.need("1M", "1M")
        s.alloc("buf", 4096)
        data = bytes(range(256)) * 4
        s.upload("buf", data, offset=16)
        assert s.read_buffer("buf", len(data), offset=16) == data
        up = [t for t in sent if t.startswith("upload")][0]
        words = up.split("\n")[0].split()
        assert words[0] == "upload" and words[1] == "buf+16" and words[3] == str(len(data))
        assert words[2].startswith("shm:salus-") and "/" not in words[2]   # no leading slash
        assert up.split("\n")[1] == "sync"
        got = s.download("buf", 64)
        assert got[16:] == data[:48] and got[:16] == bytes(16)
    assert shm_segments() == before                     # segments always removed


def test_toy_example_runs_to_completion(salusd):
    example = os.path.join(CLIENT, "examples", "train_toy.py")
    env = dict(os.environ, SALUS_MOUNT=salusd.mnt)
    env.pop("SALUS_SESSION", None)
    r = subprocess.run([sys.executable, example, "--iters", "15"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "15 iterations" in r.stdout
    checksum = [l for l in r.stdout.splitlines() if l.startswith("checksum ")][0].split()
    assert abs(float(checksum[1]) - float(checksum[3])) < 1e-3
    # The same under salusctl run, joining its session.
    r = subprocess.run([SALUSCTL, "--mount", salusd.mnt, "run", "--", sys.executable, example,
                        "--iters", "5", "--dim", "32"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "session run-" in r.stdout and "5 iterations" in r.stdout
    assert wait_until(lambda: os.listdir(salusd.path("sessions")) == [])


def test_python_file_transfers_and_kept_segments(salusd, tmp_path):
    before = shm_segments()
    with salus.Session(salusd.mnt) as s:
        s.need("16M", "1M")
        s.alloc("w", 1 << 20)
        data = os.urandom(1 << 20)
        with salus.Segment(2 << 20) as seg:
            assert os.stat(seg.path).st_mode & 0o777 == 0o600
            seg.buf[4096:4096 + len(data)] = data
            s.upload_segment("w", seg, len(data), seg_offset=4096)
            s.download_segment("w", seg, 100, offset=10)          # into its start
            assert bytes(seg.buf[:100]) == data[10:110]
        ckpt = tmp_path / "w.ckpt"
        s.download_file("w", ckpt)                                # the whole buffer
        assert ckpt.read_bytes() == data
        s.fill("w", 0, dtype="u8")
        s.upload_file("w", str(ckpt), 1000, offset=24, file_offset=24)
        assert s.read_buffer("w", 1024) == bytes(24) + data[24:1024]
        with pytest.raises(FileNotFoundError) as e:
            s.upload_file("w", tmp_path / "missing", 16)
        assert "No such file" in str(e.value)                       # salusd's reason
        with pytest.raises(ValueError):
            s.upload_file("w", "/tmp/has space", 16)
    assert shm_segments() == before


CPP_SHM_TEST = r"""
#include "salus_shm.hpp"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <vector>

#define CHECK(c) do { if (!(c)) { std::fprintf(stderr, "line %d: CHECK(%s)\n", __LINE__, #c); return 1; } } while (0)

int main(int argc, char** argv) {
  CHECK(argc == 2);
  const std::string dir = argv[1];
  salus::Session s;
  s.need(salus::MiB(16), salus::MiB(1));
  s.alloc("w", salus::MiB(2));
  std::vector<char> data(salus::MiB(2));
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 + 7);
  salus::upload(s, "w", data.data(), data.size());
  std::vector<char> back(data.size());
  salus::download(s, "w", back.data(), back.size());
  CHECK(back == data);
  {
    salus::SharedSegment seg(4096);
    struct stat st;
    CHECK(::stat(("/dev/shm/" + seg.name()).c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    std::memcpy(seg.data(), "salus!", 6);
    s.upload_shm("w", seg.name(), 6, 100);
    s.download_shm("w", seg.name(), 16, 94, 1000);
    CHECK(std::memcmp(static_cast<char*>(seg.data()) + 1006, "salus!", 6) == 0);
    std::printf("segment %s\n", seg.name().c_str());
  }
  s.download_file("w", dir + "/w.bin", data.size());
  std::ifstream in(dir + "/w.bin", std::ios::binary);
  std::vector<char> file((std::istreambuf_iterator<char>(in)), {});
  CHECK(file.size() == data.size() && std::memcmp(file.data() + 106, data.data() + 106, 1000) == 0);
  s.fill("w", 0, salus::Dtype::u8);
  s.upload_file("w", dir + "/w.bin", 4096, 0, 0);
  CHECK(s.read_buffer<char>("w", 4096) == std::vector<char>(file.begin(), file.begin() + 4096));
  try {
    s.upload_shm("w", "salus-no-such-segment", 16);
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == ENOENT);
    CHECK(std::string(e.what()).find("no such segment") != std::string::npos);
  }
  std::printf("ok\n");
  return 0;
}
"""


def test_cpp_shared_memory_and_file_transfers(salusd, tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    if not os.path.exists("/usr/include/boost/interprocess/shared_memory_object.hpp"):
        pytest.skip("Boost.Interprocess (libboost-dev) is not installed")
    src = tmp_path / "shm_test.cpp"
    src.write_text(CPP_SHM_TEST)
    exe = tmp_path / "shm_test"
    for std in ("c++17", "c++20"):
        r = subprocess.run([gxx, f"-std={std}", "-O1", "-Wall", "-Wextra", "-Wpedantic", "-Werror",
                            "-I", CLIENT, str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    before = shm_segments()
    env = dict(os.environ, SALUS_MOUNT=salusd.mnt)
    r = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.endswith("ok\n")
    assert r.stdout.split()[1].startswith("salus-")
    assert shm_segments() == before                      # every segment removed
