"""What this CPU computes natively, from the ISA flags Linux lists: the fast paths the loaders pick."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path

from . import ccompile

MKL_INTEL_PATH_SOURCE = Path(__file__).with_name("mkl_intel_path.c")


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The value of the first `name : value` line of /proc/cpuinfo ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(name)), "").partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ISA flags /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The vendor_id /proc/cpuinfo names ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    return cpuinfo_field("vendor_id")


_mkl_intel_kernels = False


def take_mkl_intel_kernels() -> bool:
    """On AMD CPUs, have MKL run its Intel AVX2 / AVX-512 kernels for fp32 matmuls; whether they are taken.

    Why: MKL picks kernels by vendor, and its AMD path is the slow one. On an AMD EPYC (Zen 3, 2 cores)
    the Intel path ran six training / prefill matmul shapes 1.20x faster on one thread (e.g. 58 -> 78
    GFLOP/s; the FMA peak is ~90) and 1.17x on two (benchmarks/bench_mkl_path.py): every fp32 training
    step and prefill pays the difference.
    It works by loading `mkl_intel_path.c` before PyTorch (so `import tokenmind` calls it, before
    torch is imported); once torch is loaded it is too late and this returns False.
    `TOKENMIND_MKL_INTEL_PATH=0` keeps MKL's own choice.
    """
    global _mkl_intel_kernels
    if _mkl_intel_kernels:
        return True
    if (os.environ.get("TOKENMIND_MKL_INTEL_PATH", "1") == "0" or "torch" in sys.modules
            or platform.system() != "Linux" or platform.machine() != "x86_64" or cpu_vendor() != "AuthenticAMD"):
        return False
    compiler = ccompile.find_compiler()
    if compiler is None:
        return False
    try:
        shim = ccompile.build(MKL_INTEL_PATH_SOURCE, compiler, ("-O2", "-shared", "-fPIC"))
        ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError):
        return False  # MKL keeps its own choice: slower on AMD, never wrong
    _mkl_intel_kernels = True
    return True


def mkl_intel_kernels_taken() -> bool:
    """Whether this process loaded the shim of `take_mkl_intel_kernels` (benchmarks record it)."""
    return _mkl_intel_kernels


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512_BF16 or AMX): only then is bf16 faster than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_avx512_vnni() -> bool:
    """Whether fbgemm's int8 matmul can sum u8·s8 products straight into int32 (AVX512-VNNI). Without it
    pairs of products are added in int16, which saturates unless activations keep to 7 bits."""
    return "avx512_vnni" in cpu_flags()


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 matmuls. AVX512_BF16 alone converts and dots bf16
    pairs in vector registers, no faster than fp32 FMAs, so autocast's casts make small models
    slower there (a 2.7M-parameter DiT sampled 1.7 images/s in bf16 vs 2.1-2.4 in fp32)."""
    return "amx_bf16" in cpu_flags()


def fastest_autocast(device_type: str) -> str:
    """The autocast precision that runs faster on `device_type` ("cuda" or "cpu"): bf16 on CUDA and
    on AMX CPUs, fp32 on other CPUs. What `precision="auto"` resolves to."""
    return "bf16" if device_type == "cuda" or cpu_has_amx_bf16() else "fp32"
