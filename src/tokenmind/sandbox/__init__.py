"""One sandbox for untrusted code: HumanEval completions, RL rewards, agent tools.

    result = run_python("print(sum(range(10)))")   # SandboxResult(returncode=0, stdout='45\\n', ...)

A model-written program may loop, fork-bomb, eat memory, detach a daemon, write anywhere it can
and call the network. A subprocess with a timeout contains only the first: `killpg` misses a
grandchild that called `setsid`, and root ignores RLIMIT_NPROC. So each program runs inside
Linux namespaces (`bwrap`, else util-linux `unshare`):

* a PID namespace whose init is our helper (`helper.py`, run as a script): when the
  program exits or we kill the helper at the timeout, the kernel kills everything left in the
  namespace, however detached;
* a network namespace with only loopback: no host server, no internet;
* every mount read-only, a private size-capped tmpfs on /tmp (the working directory), nothing
  else writable except an optional caller-given `workdir`;
* rlimits on CPU time, address space, file size, processes and open files. As root the helper
  first switches to a fresh unprivileged uid (RLIMIT_NPROC is not enforced for uid 0, and a
  fresh uid per run gives each run its own process budget); directories under a root-only
  ancestor (e.g. a pyenv interpreter in /root) are re-exposed read-only so that uid can run them.

Isolation is detected once per process by running a probe program (`_probe`). Where neither
tool isolates, `run` raises `SandboxUnavailable` naming the fix, unless the caller opts in with
`allow_unsandboxed=True` (or TOKENMIND_ALLOW_UNSANDBOXED=1): then only the timeout, the rlimits
and a process-group kill apply.

Not contained even here: reads of world-readable files (a secret readable by everyone is
readable by the program), CPU contention (a program may use its cores for the whole timeout),
and memory beyond per-process limits: `memory_bytes` caps each process's address space, so the
worst case is `max_processes` × `memory_bytes` (+ `tmp_bytes`).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ALLOW_ENV = "TOKENMIND_ALLOW_UNSANDBOXED"
MECHANISMS = ("bwrap", "unshare")
UID_BASE = 1 << 30  # fresh uids for root's runs come from [UID_BASE, UID_BASE + 2**24): no real user there
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper.py")
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


class SandboxUnavailable(RuntimeError):
    """No isolation mechanism works here, and the caller did not opt in to running unsandboxed."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one run. Defaults fit a test-running Python program, not a training job."""

    timeout_s: float = 10.0  # wall clock, then everything in the sandbox is killed
    cpu_s: int | None = None  # CPU seconds per process (RLIMIT_CPU); None: the timeout, rounded up
    memory_bytes: int = 1 << 30  # address space per process (RLIMIT_AS)
    file_size_bytes: int = 16 << 20  # largest file a process may write (RLIMIT_FSIZE)
    max_processes: int = 32  # processes and threads of the sandbox's uid (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmp_bytes: int = 64 << 20  # size of the private /tmp tmpfs (memory the host lends the program)
    output_bytes: int = 64 << 10  # stdout and stderr kept, each: the head and the tail
    mechanism: str | None = None  # "bwrap" or "unshare"; None: the first of them that isolates here
    allow_unsandboxed: bool = False  # run without isolation where none works (see the module docstring)

    def __post_init__(self):
        if self.mechanism is not None and self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS} or None (pick the best), got {self.mechanism!r}")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"SandboxConfig.cpu_s must be positive or None (the timeout), got {self.cpu_s}")
        for name in ("timeout_s", "memory_bytes", "file_size_bytes", "max_processes", "max_open_files",
                     "tmp_bytes", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """What a run did; `reason` says in a word why it ended, for logs and reward functions."""

    returncode: int | None  # exit status; -N when killed by signal N; None when killed at the timeout
    stdout: str  # at most `output_bytes` of it: head, a "[... N bytes cut ...]" line, tail
    stderr: str
    timed_out: bool
    reason: str  # "ok", "exit N", "timeout", "memory", "cpu time", "file size", "killed by signal N"
    duration_s: float
    truncated: bool  # stdout or stderr was cut
    mechanism: str  # "bwrap", "unshare" or "none"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_python(source: str, config: SandboxConfig = SandboxConfig(), *, args: list[str] | None = None,
               stdin: str | bytes | None = None, workdir: str | None = None) -> SandboxResult:
    """Run Python `source` as `program.py` with this interpreter in isolated mode (-I)."""
    return run([sys.executable, "-I", "program.py", *(args or [])], config, files={"program.py": source},
               stdin=stdin, workdir=workdir)


def run(argv: list[str], config: SandboxConfig = SandboxConfig(), *, files: dict[str, str | bytes] | None = None,
        stdin: str | bytes | None = None, workdir: str | None = None) -> SandboxResult:
    """Run `argv` in the sandbox. `files` (name → content) are written into the working directory
    first; `stdin` feeds the program; `workdir`, a host directory, becomes the working directory
    and the one writable host place (as root it is chowned to the run's uid), else the working
    directory is the private /tmp and vanishes with the run."""
    mechanism = require_isolation(config)
    for name in files or {}:
        if os.path.isabs(name) or ".." in name.split("/"):
            raise ValueError(f"file names must be relative paths inside the working directory, got {name!r}")
    workdir = os.path.realpath(workdir) if workdir is not None else None
    if mechanism == "none" and workdir is None:
        with tempfile.TemporaryDirectory(prefix="tokenmind-sandbox-") as scratch:
            return _launch(mechanism, argv, config, files or {}, stdin, scratch, None)
    return _launch(mechanism, argv, config, files or {}, stdin, workdir or "/tmp", workdir)


def require_isolation(config: SandboxConfig = SandboxConfig()) -> str:
    """The mechanism `run` will use ("bwrap", "unshare" or "none"), or SandboxUnavailable naming the
    fix. Call it before expensive work whose results need the sandbox (e.g. generating completions)."""
    why = {}
    for m in [config.mechanism] if config.mechanism else MECHANISMS:
        why[m] = _probe(m)
        if why[m] is None:
            return m
    if config.allow_unsandboxed or os.environ.get(ALLOW_ENV) == "1":
        return "none"
    details = "; ".join(f"{m}: {w}" for m, w in why.items())
    raise SandboxUnavailable(
        f"cannot isolate untrusted code here ({details}). Install bubblewrap (`apt-get install bubblewrap`) "
        f"and allow user namespaces, or opt in to running it UNSANDBOXED with allow_unsandboxed=True (or "
        f"{ALLOW_ENV}=1): then only the timeout and per-process rlimits apply; the network, writes outside "
        f"its directory, detached processes and (as root) fork bombs are not contained.")


@functools.cache
def _probe(mechanism: str) -> str | None:
    """None when `mechanism` really isolates here, else why not: runs a program that checks it sees
    no network, a read-only root and its own PID namespace. Cached: the answer cannot change
    within a process."""
    if shutil.which(mechanism) is None:
        return f"{mechanism} is not installed"
    check = ("import os, socket\n"
             "assert [n for _, n in socket.if_nameindex()] == ['lo'], 'network interfaces visible'\n"
             "assert not os.access('/usr', os.W_OK), 'root filesystem writable'\n"
             "assert os.getpid() < 10, 'host PID namespace'\n"
             "open('probe', 'w').write('ok')\n")
    config = SandboxConfig(timeout_s=20.0, mechanism=mechanism)
    try:
        result = _launch(mechanism, [sys.executable, "-I", "probe.py"], config, {"probe.py": check}, None, "/tmp",
                         None)
    except OSError as e:
        return f"could not start it: {e}"
    if not result.ok:
        return f"probe failed ({result.reason}): {result.stderr.strip()[-400:]}"
    return None


def _launch(mechanism: str, argv: list[str], config: SandboxConfig, files: dict[str, str | bytes],
            stdin: str | bytes | None, cwd: str, workdir: str | None) -> SandboxResult:
    """Start the helper under `mechanism`, hand it the spec, collect output until exit or timeout."""
    uid = UID_BASE + secrets.randbelow(1 << 24) if os.geteuid() == 0 and mechanism != "none" else None
    if uid is not None and workdir is not None:
        _chown_tree(workdir, uid)
    barriers, binds = _mount_plan(argv[0], workdir, switch_uid=uid is not None)
    cpu = config.cpu_s or int(config.timeout_s) + 1
    spec = {"argv": argv, "cwd": cwd, "uid": uid,
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd, "LANG": "C.UTF-8"},
            "files": {name: base64.b64encode(_bytes(data)).decode() for name, data in files.items()},
            "stdin": base64.b64encode(_bytes(stdin)).decode() if stdin is not None else None,
            "limits": {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_AS": config.memory_bytes,
                       "RLIMIT_FSIZE": config.file_size_bytes, "RLIMIT_NPROC": config.max_processes,
                       "RLIMIT_NOFILE": config.max_open_files},
            "private_fs": ({"tmp_bytes": config.tmp_bytes, "barriers": barriers, "binds": binds}
                           if mechanism == "unshare" else None)}
    status_r, status_w = os.pipe()
    spec["status_fd"], spec["nonce"] = status_w, secrets.token_hex(16)  # a status without it is forged
    helper = [sys.executable, "-I", "-S", HELPER]
    if mechanism == "bwrap":
        command = _bwrap_command(config, barriers, binds, cwd) + helper
    elif mechanism == "unshare":
        command = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                   "--mount-proc", *(["--map-root-user"] if os.geteuid() != 0 else []), "--", *helper]
    else:
        command = helper
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), start_new_session=True, cwd="/",
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    finally:
        os.close(status_w)
    try:
        try:
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except BrokenPipeError:  # the helper died at startup; its stderr says why
            pass
        out, err = _Capture(config.output_bytes), _Capture(config.output_bytes)
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        finished = _drain(streams, start + config.timeout_s)
        try:
            proc.wait(timeout=max(0.0, start + config.timeout_s - time.monotonic()) if finished else 0)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        if timed_out:
            _kill(proc, sandboxed=mechanism != "none")
        _drain(streams, time.monotonic() + 1.0)
        os.set_blocking(status_r, False)
        try:
            nonce, _, status = os.read(status_r, 1 << 16).decode(errors="replace").partition(":")
        except BlockingIOError:
            nonce, status = "", ""
    finally:
        os.close(status_r)
        proc.stdout.close()
        proc.stderr.close()
    duration = time.monotonic() - start
    if timed_out:
        returncode = None
    elif nonce == spec["nonce"] and status.isdigit():
        returncode = os.waitstatus_to_exitcode(int(status))
    else:  # the helper failed before starting the program (its stderr says why), or a forgery
        returncode = proc.returncode or 127
    return SandboxResult(returncode, out.text(), err.text(), timed_out, _reason(returncode, timed_out, err.tail()),
                         duration, out.cut > 0 or err.cut > 0, mechanism)


def _bwrap_command(config: SandboxConfig, barriers: list[str], binds: list, cwd: str) -> list[str]:
    """bwrap's arguments: new namespaces, read-only root, private /tmp, the helper as PID 1. As root,
    bwrap runs privileged (no user namespace) and keeps only the capabilities the helper needs to
    switch uid; otherwise a user namespace maps the caller's uid."""
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--as-pid-1", "--unshare-pid", "--unshare-net",
           "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() == 0:
        cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user"]
    cmd += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--size", str(1 << 20), "--tmpfs", "/dev/shm",
            "--perms", "1777", "--size", str(config.tmp_bytes), "--tmpfs", "/tmp"]
    if os.path.isdir("/var/tmp"):
        cmd += ["--size", str(1 << 20), "--tmpfs", "/var/tmp"]
    for barrier in barriers:
        cmd += ["--perms", "0755", "--tmpfs", barrier]
    for path, writable in binds:
        parents = [path[:i] for i in range(1, len(path)) if path[i] == "/"]  # bwrap would create them 0700
        cmd += [arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)]
        cmd += ["--bind" if writable else "--ro-bind", path, path]
    return cmd + ["--chdir", cwd, "--"]


MASKED = ("/tmp", "/var/tmp", "/dev/shm")  # hidden under private tmpfs mounts inside the sandbox


def _mount_plan(program: str, workdir: str | None, switch_uid: bool) -> tuple[list[str], list[tuple[str, bool]]]:
    """The host directories bound over the read-only root: (barriers, [(path, writable)]).
    `workdir` is bound writable. The directories the run needs (this Python's prefixes, the helper's
    and the program's own directory) are bound back read-only when a private tmpfs hides them (a
    checkout or virtual environment under /tmp) or, when the program runs under a fresh uid, when
    an ancestor others cannot enter (mode without o+x, like /root) lies above them: that barrier is
    hidden under a tmpfs."""
    binds = [(workdir, True)] if workdir else []
    needed = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(HELPER)}
    found = shutil.which(program)
    if found:
        needed.add(os.path.dirname(os.path.realpath(found)))
    barriers, kept = set(), []
    for path in sorted(os.path.realpath(p) for p in needed):  # a parent sorts before its children
        if any(path.startswith(k + "/") for k in kept):
            continue
        kept.append(path)
        masked = any(path == m or path.startswith(m + "/") for m in MASKED)
        barrier = _barrier(path) if switch_uid else None
        if barrier:
            barriers.add(barrier)
        if masked or barrier:
            binds.insert(0, (path, False))
    if switch_uid and workdir and (barrier := _barrier(workdir)):
        barriers.add(barrier)
    return sorted(barriers), binds


def _barrier(path: str) -> str | None:
    """The first ancestor of `path` that others cannot enter, if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _chown_tree(path: str, uid: int) -> None:
    for root, dirs, names in os.walk(path):
        for name in [*dirs, *names]:
            os.lchown(os.path.join(root, name), uid, uid)
    os.chown(path, uid, uid)


def _bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else data


class _Capture:
    """Bounded capture of one stream: the first and last `cap // 2` bytes, so a program printing
    forever costs a fixed amount of memory and a traceback at the end survives."""

    def __init__(self, cap: int):
        self.half, self.head, self.tail_buf, self.cut = cap // 2, bytearray(), bytearray(), 0

    def feed(self, chunk: bytes) -> None:
        take = chunk[: self.half - len(self.head)]
        self.head += take
        self.tail_buf += chunk[len(take):]
        if len(self.tail_buf) > self.half:
            self.cut += len(self.tail_buf) - self.half
            del self.tail_buf[: len(self.tail_buf) - self.half]

    def tail(self) -> str:
        return (self.head + self.tail_buf)[-4096:].decode(errors="replace")

    def text(self) -> str:
        middle = f"\n[... {self.cut} bytes cut ...]\n".encode() if self.cut else b""
        return (self.head + middle + self.tail_buf).decode(errors="replace")


def _drain(streams: dict[int, _Capture], deadline: float) -> bool:
    """Read the pipes into their captures until both close (True) or `deadline` passes (False)."""
    with selectors.DefaultSelector() as sel:
        for fd in streams:  # a pipe already at its end reports it again at once
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    streams[key.fd].feed(chunk)
                else:
                    sel.unregister(key.fd)
    return True


def _kill(proc: subprocess.Popen, sandboxed: bool) -> None:
    """Kill a run at its timeout. Sandboxed: SIGKILL the PID namespace's init (our helper); the kernel
    kills everything else in the namespace, and bwrap/unshare exit only once it is empty, so when
    this returns nothing of the program is left. Unsandboxed: the process group, which misses
    processes that left it. `proc` is not reaped yet, so its pid cannot name another group."""
    targets = []
    if sandboxed:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
                targets = [int(pid) for pid in fh.read().split()]
        except OSError:
            pass
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not targets:
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # the init was not started yet: the launcher's death takes it down
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _reason(returncode: int | None, timed_out: bool, stderr_tail: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if any(marker in stderr_tail for marker in MEMORY_MARKERS):
        return "memory"
    if returncode == -signal.SIGXCPU:
        return "cpu time"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr_tail:
        return "file size"
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit {returncode}"
