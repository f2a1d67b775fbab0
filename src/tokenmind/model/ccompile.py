"""Compile one of tokenmind's C files once per machine with the system C compiler, cached for ctypes to load.

Torch-free on purpose: the MKL dispatch shim (`cpu.take_mkl_intel_kernels`) must be built and loaded before
PyTorch is. A library goes to `~/.cache/tokenmind/native/` (or `$TOKENMIND_CACHE/native/`) under a name that
hashes the source, the compiler's file identity and the flags; it is written to a temporary name and renamed,
so two processes building at once never load a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMIND_CACHE", Path.home() / ".cache" / "tokenmind")) / "native"


def find_compiler() -> str | None:
    """`$CC`, else `cc`, else `gcc` on PATH; None where there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def library_path(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    # The compiler's file identity stands for its version: no subprocess on every start (cold start counts).
    real = os.path.realpath(compiler)
    st = os.stat(real)
    key = hashlib.sha256(source.read_bytes() + repr((real, st.st_size, st.st_mtime_ns, flags)).encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    """The shared library of `source` (compiled now unless this source, compiler and flags were built before)."""
    target = library_path(source, compiler, flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
