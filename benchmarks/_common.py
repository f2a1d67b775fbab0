"""What every benchmark here shares: timing, the machine description, JSON output, and the peer venv.

Peers (llama.cpp) live in their own virtual environment, `benchmarks/.venv-peers`, made by
`benchmarks/setup_peers.sh`; benchmarks run them as subprocesses so that no peer becomes a
dependency of tokenmind.
"""

from __future__ import annotations

import tokenmind  # noqa: F401  (before torch: on AMD CPUs this is what picks MKL's fast kernels, model/cpu.py)

import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import torch

from tokenmind.model.cpu import cpu_flags, cpuinfo_field, mkl_intel_kernels_taken

HERE = Path(__file__).resolve().parent
PEER_VENV = HERE / ".venv-peers"
PEER_PYTHON = PEER_VENV / "bin" / "python"
PEER_SETUP = "bash benchmarks/setup_peers.sh"
SETUP_LLAMA_SERVER = "bash benchmarks/setup_llama_server.sh"


def timed(fn) -> float:
    """Seconds one call of `fn()` takes."""
    return timed_call(fn)[0]


def timed_call(fn):
    """(seconds, result) of one call of `fn()`."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def aten_calls(fn) -> int:
    """How many ATen operators one call of `fn()` dispatches (counted with a dispatch mode; the calls
    an operator makes inside itself, e.g. the ~20 of `F.rms_norm`, are not counted). Independent of
    the machine's load: per-op dispatch is what a small model's batch-1 decode step mostly costs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def machine_info(**extra) -> dict:
    """The facts a reader needs to judge a number: CPU model and the ISA that matters, cores, threads, load."""
    info = {"cpu": cpu_model(), "isa": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                                                    "amx_tile") if f in cpu_flags()],
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "mkl_intel_kernels": mkl_intel_kernels_taken(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    info.update(extra)
    return info


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or "unknown"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(cmd: list[str], port: int, health: str, **popen) -> tuple[subprocess.Popen, str]:
    """Start a server process and wait until `health` answers 200; `popen` goes to `subprocess.Popen`."""
    import httpx

    popen.setdefault("stdout", subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with status {proc.returncode} while starting")
        try:
            if httpx.get(url + health, timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"{' '.join(cmd[:3])} did not become healthy within 300 s")


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON and, if asked, write it to `out` (temp file + rename)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)


def child_env(peer: bool, **extra: str) -> dict[str, str]:
    """The environment of a side's child process. A peer's keeps MKL's stock kernel choice, as that library's
    users run it (`import tokenmind` in the harness would otherwise give it tokenmind's AMD choice too)."""
    return dict(os.environ, **extra, **({"TOKENMIND_MKL_INTEL_PATH": "0"} if peer else {}))


def side_or_run(args, side, run) -> dict | None:
    """The two roles of a peer benchmark's script: a child measuring one side in its own process
    (`--side NAME` set: print `side(args)` as one JSON line for the parent), or the parent running
    the comparison (`run(args)`, emitted with `emit`)."""
    if args.side:
        print(json.dumps(side(args)))
        return None
    result = run(args)
    emit(result, args.out)
    return result


def peer_python() -> Path | None:
    """The peer venv's interpreter, or None until `benchmarks/setup_peers.sh` has finished."""
    return PEER_PYTHON if (PEER_VENV / ".ready").exists() else None


def run_llamacpp(job: dict) -> dict:
    """Run one `peer_llamacpp.py` job in the peer venv and return its JSON answer."""
    if peer_python() is None:
        raise RuntimeError(f"the llama.cpp peer venv is missing; run `{PEER_SETUP}` once")
    out = subprocess.run([str(PEER_PYTHON), str(HERE / "peer_llamacpp.py"), json.dumps(job)], capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"llama.cpp peer failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_server_binary(explicit: str | None = None) -> Path:
    """The llama-server that setup_llama_server.sh built for this CPU (or the `explicit` path)."""
    if explicit:
        return Path(explicit)
    found = subprocess.run(["bash", str(HERE / "setup_llama_server.sh"), "--print-path"], check=False,
                           capture_output=True, text=True)
    binary = Path(found.stdout.strip().splitlines()[-1] if found.stdout.strip() else "") / "llama-server"
    if found.returncode or not binary.is_file():
        raise SystemExit(f"the llama.cpp peer needs llama.cpp's C++ server `llama-server`, not built for this CPU yet: "
                         f"run `{SETUP_LLAMA_SERVER}` once (about 15 minutes on 2 cores; the binaries are cached "
                         f"in ~/.cache/tokenmind/llama.cpp/), or pass --llama-server PATH")
    return binary


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 5)
