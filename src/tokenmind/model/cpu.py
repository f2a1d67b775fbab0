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
