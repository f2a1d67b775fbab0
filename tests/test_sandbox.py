"""The sandbox contains hostile programs, and each test checks the containment itself, not just
that `run` returned: no process of the program is left (found by a marker in its command line),
no file appeared outside, the host's server saw no connection.

Containment tests run once per mechanism that isolates on this machine (bwrap, unshare). The
fork bomb first proves with a bounded bomb that forks are refused before it unleashes an
unbounded one, so a broken process limit cannot take the machine down."""

import json
import os
import secrets
import socket
import time
from pathlib import Path

import pytest

from tokenmind import sandbox
from tokenmind.eval.code import evaluate_humaneval, run_program
from tokenmind.sandbox import ALLOW_ENV, MECHANISMS, SandboxConfig, SandboxUnavailable, run_python


@pytest.fixture(params=MECHANISMS)
def mechanism(request):
    why = sandbox._probe(request.param)
    if why is not None:
        pytest.skip(f"{request.param} cannot isolate here: {why}")
    return request.param


@pytest.fixture
def isolated():
    """Skip where nothing isolates (the refusal itself is tested with a simulated absence)."""
    try:
        return sandbox.require_isolation()
    except SandboxUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def marker():
    return "tokenmind-test-" + secrets.token_hex(6)


def alive(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (the program gets it as an argument)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                pids.append(int(name))
        except OSError:  # exited while we looked
            pass
    return pids


BOUNDED_BOMB = """
import os, time
forked = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        forked += 1
    except OSError:
        pass
print(forked)
"""

FORK_BOMB = """
import os
said = False
while True:
    try:
        os.fork()
    except OSError:
        if not said:
            print("fork refused", flush=True)
            said = True
"""


def test_fork_bomb_is_contained_and_leaves_nothing(mechanism, marker):
    config = SandboxConfig(mechanism=mechanism, timeout_s=2.0, max_processes=16)
    bounded = run_python(BOUNDED_BOMB, config, args=[marker])
    assert bounded.ok and int(bounded.stdout) < 16, "the process limit does not hold; not unleashing a real bomb"
    assert bounded.duration_s < 2.0 and alive(marker) == []  # its sleeping children died with it

    result = run_python(FORK_BOMB, config, args=[marker])
    assert result.timed_out and result.reason == "timeout" and result.returncode is None
    assert "fork refused" in result.stdout
    assert result.duration_s < 4.0
    assert alive(marker) == []


DETACHED_GRANDCHILD = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # double fork: the grandchild is orphaned, in its own session
        open("started", "w").write(str(os.getpid()))
        time.sleep(1.0)
        open("escaped", "w").write("the grandchild outlived the sandbox")
        os._exit(0)
    os._exit(0)
os.wait()
while not os.path.exists("started"):
    time.sleep(0.01)
print("parent exits")
"""


def test_detached_grandchild_dies_with_the_sandbox(mechanism, marker, tmp_path):
    box = tmp_path / "box"  # writable and visible to us, so an escape would show
    box.mkdir()
    result = run_python(DETACHED_GRANDCHILD, SandboxConfig(mechanism=mechanism, timeout_s=5.0), args=[marker],
                        workdir=str(box))
    assert result.ok and result.stdout == "parent exits\n"
    assert (box / "started").exists()  # the grandchild really ran
    assert result.duration_s < 1.0  # returned when the program did, not at the timeout
    assert alive(marker) == []
    time.sleep(1.3)  # past the grandchild's sleep
    assert not (box / "escaped").exists()


WRITER = """
import json, sys
done = {}
for path in sys.argv[1:]:
    try:
        with open(path, "w") as fh:
            fh.write("x")
        done[path] = "written"
    except OSError as e:
        done[path] = type(e).__name__
print(json.dumps(done))
"""


def test_writes_outside_the_private_directory_fail(mechanism, marker, tmp_path):
    outside = [str(tmp_path / "outside.txt"), str(Path.home() / f"{marker}.txt"), f"/usr/{marker}.txt",
               f"/dev/shm/{marker}.txt"]
    private = f"/tmp/{marker}.txt"  # the sandbox's own /tmp: writable inside, invisible outside
    result = run_python(WRITER, SandboxConfig(mechanism=mechanism), args=[*outside, private])
    assert result.ok, result.stderr
    done = json.loads(result.stdout)
    assert all(done[p] != "written" for p in outside), done  # read-only, hidden or not enterable
    assert done[private] == "written"
    assert not any(os.path.exists(p) for p in [*outside, private])


CONNECT = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1.0)
    print("connected")
except OSError as e:
    print("refused:", e)
"""


def test_network_is_unreachable(mechanism):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        result = run_python(CONNECT, SandboxConfig(mechanism=mechanism), args=[str(server.getsockname()[1])])
        assert result.ok and result.stdout.startswith("refused:"), result.stdout
        with pytest.raises(BlockingIOError):  # nothing queued: the server never saw a connection
            server.accept()


FORGER = """
import os
for fd in os.listdir("/proc/1/fd"):  # the helper's status pipe: claim a clean exit, then fail
    try:
        os.write(os.open(f"/proc/1/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK), b"0" * 64)
    except OSError:
        pass
raise SystemExit(1)
"""


def test_program_cannot_forge_its_exit_status(mechanism):
    result = run_python(FORGER, SandboxConfig(mechanism=mechanism))
    assert result.returncode == 1 and not result.ok


def test_memory_hog_fails_fast_with_a_memory_error(mechanism):
    config = SandboxConfig(mechanism=mechanism)
    at_once = run_python("block = bytearray(4 << 30)\n", config)
    assert at_once.reason == "memory" and at_once.returncode == 1 and at_once.duration_s < 2.0
    touching = SandboxConfig(mechanism=mechanism, memory_bytes=256 << 20)  # real pages, so keep the host's cost small
    gradual = run_python("hog = []\nwhile True:\n    hog.append(b'x' * (16 << 20))\n", touching)
    assert gradual.reason == "memory" and "MemoryError" in gradual.stderr and gradual.duration_s < 3.0


def test_infinite_loop_is_killed_at_the_timeout(mechanism, marker):
    result = run_python("while True:\n    pass\n", SandboxConfig(mechanism=mechanism, timeout_s=1.0), args=[marker])
    assert result.timed_out and result.reason == "timeout" and result.returncode is None
    assert 1.0 <= result.duration_s < 2.5
    assert alive(marker) == []


def test_cpu_time_and_file_size_limits(isolated):
    # the wall timeout far above the CPU limit: on a loaded machine one CPU second can take several wall seconds
    busy = run_python("while True:\n    pass\n", SandboxConfig(timeout_s=30.0, cpu_s=1))
    assert busy.reason == "cpu time" and not busy.timed_out and busy.returncode != 0
    big = run_python("open('big', 'wb').write(bytes(4 << 20))\n", SandboxConfig(file_size_bytes=1 << 20))
    assert big.reason == "file size" and big.returncode == 1


def test_normal_program_gets_its_stdin_and_returns_its_output(isolated):
    result = run_python("import sys\nprint('hello', sys.stdin.read())\n", stdin="world")
    assert result.ok and result.stdout == "hello world\n" and result.stderr == "" and result.reason == "ok"
    assert result.mechanism == isolated and not result.truncated
    failed = run_python("import sys\nprint('oops', file=sys.stderr)\nraise SystemExit(3)\n")
    assert failed.returncode == 3 and failed.reason == "exit 3" and failed.stderr == "oops\n" and not failed.ok


def test_huge_output_is_truncated_keeping_head_and_tail(isolated):
    source = "import sys\nprint('START')\nfor _ in range(1000):\n    print('x' * 10_000)\nprint('END')\n"
    result = run_python(source, SandboxConfig(output_bytes=1000))
    assert result.ok and result.truncated
    assert result.stdout.startswith("START") and result.stdout.endswith("END\n") and "bytes cut" in result.stdout
    assert len(result.stdout) < 1100


def test_run_program_passes_only_clean_exits(isolated):
    assert run_program("assert sum([1, 2]) == 3\n")
    assert not run_program("raise SystemExit(1)\n")
    assert not run_program("while True:\n    pass\n", timeout=1.0)


def test_refuses_to_run_without_isolation_unless_told(monkeypatch):
    monkeypatch.setattr(sandbox, "_probe", lambda mechanism: f"{mechanism} is not installed (simulated)")
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match=r"apt-get install bubblewrap.*allow_unsandboxed=True"):
        run_python("print(1)\n")
    with pytest.raises(SandboxUnavailable):
        run_program("print(1)\n")
    with pytest.raises(SandboxUnavailable):  # before generating anything: the model is never touched
        evaluate_humaneval(None, None, [{"task_id": "t", "prompt": "", "test": "", "entry_point": "f"}])

    result = run_python("print(1)\n", SandboxConfig(allow_unsandboxed=True))
    assert result.ok and result.stdout == "1\n" and result.mechanism == "none"
    assert run_python("block = bytearray(4 << 30)\n", SandboxConfig(allow_unsandboxed=True)).reason == "memory"
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert run_program("print(1)\n")


def test_an_interpreter_under_tmp_is_bound_back_over_the_private_tmp(monkeypatch):
    """A checkout (and its virtual environment) under /tmp would vanish under the sandbox's private
    /tmp and the interpreter could not start: the plan binds it back read-only."""
    import tokenmind.sandbox as sandbox

    monkeypatch.setattr(sandbox.sys, "prefix", "/tmp/checkout/.venv")
    _, binds = sandbox._mount_plan("python3", "/tmp/work", switch_uid=False)
    assert ("/tmp/checkout/.venv", False) in binds and ("/tmp/work", True) in binds
