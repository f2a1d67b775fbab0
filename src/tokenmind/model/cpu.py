"""What this CPU computes natively, from the ISA flags Linux lists: the fast paths the loaders pick."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ISA flags /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line for line in lines if line.startswith("flags")), "").partition(":")[2].split())


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
