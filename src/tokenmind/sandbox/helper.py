"""The sandbox's init: run as `python -I -S helper.py`, PID 1 of the sandbox's PID namespace.

It reads the run's spec from stdin, finishes the sandbox (the mounts for `unshare`, which bwrap
makes itself; the switch to an unprivileged uid), starts the program with its rlimits, waits
for it and reports its wait status, signed with the run's nonce, on a pipe to the host. When it
exits the kernel kills everything left in the namespace. It imports nothing from tokenmind:
`-S -I` keeps the host's site-packages and environment out.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sys



def main() -> None:
    """Read the spec from stdin, finish the sandbox (mounts for `unshare`, the uid switch), write the
    files, start the program with its rlimits, wait for it and report its wait status. When this
    process (PID 1) exits, the kernel kills whatever the program left behind."""
    spec = json.loads(sys.stdin.buffer.read())
    os.umask(0o022)  # directories we create must be enterable by the program's uid
    try:
        os.setsid()
    except OSError:  # already a session leader (bwrap --new-session)
        pass
    if spec["private_fs"] is not None:
        _private_filesystem(**spec["private_fs"])
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])  # clears all capabilities
    elif spec["private_fs"] is not None:  # `unshare --map-root-user`: drop the namespace's root powers
        _drop_capability_bounding_set()
    _prctl(38, 1)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot raise privileges again
    _prctl(4, 0)  # PR_SET_DUMPABLE 0: the program (same uid) cannot ptrace us or open /proc/1/fd/*
    os.chdir(spec["cwd"])
    for name, data in spec["files"].items():
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        with open(name, "wb") as fh:
            fh.write(base64.b64decode(data))
    stdin = os.memfd_create("stdin") if spec["stdin"] is not None else os.open(os.devnull, os.O_RDONLY)
    if spec["stdin"] is not None:
        os.write(stdin, base64.b64decode(spec["stdin"]))
        os.lseek(stdin, 0, os.SEEK_SET)
    status_fd = spec["status_fd"]
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(stdin, 0)
            os.close(status_fd)
            import resource
            for name, value in spec["limits"].items():
                limit, (soft, hard) = getattr(resource, name), value if isinstance(value, list) else (value, value)
                ceiling = resource.getrlimit(limit)[1]  # a non-root user may not raise its hard limit
                if ceiling != resource.RLIM_INFINITY:
                    soft, hard = min(soft, ceiling), min(hard, ceiling)
                resource.setrlimit(limit, (soft, hard))
            os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
        except (OSError, ValueError) as e:
            os.write(2, f"sandbox: cannot start {spec['argv'][0]!r}: {e}\n".encode())
        os._exit(127)
    status = _wait(pid, status_fd)
    if status is not None:
        os.write(status_fd, f"{spec['nonce']}:{status}".encode())
    os.killpg(0, signal.SIGKILL)  # unsandboxed, this is all that ends the program's leftovers (and us)


def _wait(pid: int, status_fd: int) -> int | None:
    """The program's wait status, or None if the host died first (the kernel's parent-death signal
    does not reach a PID namespace's init, so we watch the status pipe: it errors once the host's
    end is closed). As PID 1 we also reap orphans, so their zombies do not eat the process budget."""
    import select
    poller = select.poll()
    poller.register(os.pidfd_open(pid), select.POLLIN)
    poller.register(status_fd, 0)  # POLLERR: nobody will read the status any more
    while True:
        while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
            if reaped[0] == pid:
                return reaped[1]
        for fd, event in poller.poll(100):
            if fd == status_fd:
                return None


def _private_filesystem(tmp_bytes: int, barriers: list[str], binds: list) -> None:
    """What bwrap's mount arguments do, for `unshare`: every mount read-only, a private tmpfs on
    /tmp (and /var/tmp, /dev/shm), the barriers hidden and the planned paths bound back (see
    `_mount_plan`). Fails (so the probe fails) if any mount cannot be made read-only."""
    keep = {path: os.open(path, os.O_PATH) for path, _ in binds}  # before tmpfs mounts hide them
    with open("/proc/self/mountinfo") as fh:
        points = [_unescape(line.split()[4]) for line in fh]
    for point in dict.fromkeys(points):
        if os.path.isdir(point) or os.path.isfile(point):
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _mount_flags(point))
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmp_bytes},mode=1777")
    for small in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(small):
            _mount("tmpfs", small, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    for barrier in barriers:
        os.makedirs(barrier, exist_ok=True)
        _mount("tmpfs", barrier, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    for path, writable in binds:
        _bind(keep[path], path, writable)


def _bind(fd: int, path: str, writable: bool) -> None:
    os.makedirs(path, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
    flags = _mount_flags(path) & ~_MS_RDONLY
    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | flags | (0 if writable else _MS_RDONLY))


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384


def _mount_flags(path: str) -> int:
    """The flags a remount must repeat (a user namespace may not clear locked ones): statvfs's
    ST_* bits equal the MS_* ones except relatime."""
    f = os.statvfs(path).f_flag
    return (f & (1 | 2 | 4 | 8 | 1024 | 2048)) | ((1 << 21) if f & 4096 else 0)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _drop_capability_bounding_set() -> None:
    """Empty the bounding set: the program, exec'd as the namespace's uid 0, then gets no capabilities."""
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        _prctl(24, cap)  # PR_CAPBSET_DROP


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as \\ooo octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


if __name__ == "__main__":
    main()
