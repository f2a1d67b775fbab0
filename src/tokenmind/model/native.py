"""The native decode kernels (`native_kernels.c`): compiled once per machine with the system C compiler, loaded with ctypes.

Why C and not a PyTorch extension: the file includes no PyTorch header, so it compiles in about a
second (a `torch.utils.cpp_extension` build takes ~90 s on 2 cores), and the kernels take raw
pointers. `ccompile` builds and caches it. It is linked against OpenMP, which
resolves to the `libgomp.so.1` PyTorch has already loaded, so both share one thread pool.

`available()` is false where the CPU lacks AVX2/FMA, no compiler works, or `TOKENMIND_NATIVE=0` is
set (a failed build warns once). The quantized linears take them where `preferred()`: where PyTorch
itself runs its AVX2 kernels (no AVX-512), whose int4/int8 paths are the slow ones there; on AVX-512
CPUs PyTorch's own kernels stay unless `TOKENMIND_NATIVE=1` asks for these.
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
import platform
import warnings
from pathlib import Path

import torch

from .ccompile import build, find_compiler
from .cpu import cpu_flags

SOURCE = Path(__file__).with_name("native_kernels.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")


def usable_cpu() -> bool:
    """Linux on an x86-64 CPU with AVX2 and FMA: what the kernels are written for."""
    return platform.system() == "Linux" and platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_flags()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (reason in the one warning, if any)."""
    if os.environ.get("TOKENMIND_NATIVE", "1") == "0" or not usable_cpu():
        return None
    compiler = find_compiler()
    if compiler is None:
        warnings.warn("no C compiler (cc/gcc) found: int4/int8 decode runs on PyTorch's slower kernels. "
                      "Install one (e.g. `apt install gcc`) or set TOKENMIND_NATIVE=0 to silence this.", stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(build(SOURCE, compiler, CFLAGS)))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"the native kernels could not be built, so int4/int8 decode runs on PyTorch's kernels: {err}",
                      stacklevel=2)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tm_int4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.tm_int8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.tm_int4_matmul.restype = lib.tm_int8_matmul.restype = ctypes.c_int
    lib.tm_f32_matmul.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.tm_f32_matmul.restype = ctypes.c_int
    lib.tm_int4_dequantize.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.tm_int4_dequantize.restype = None
    lib.tm_rms_norm.argtypes = [ptr, ptr, ctypes.c_float, i64, i64, ptr]
    lib.tm_decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64,
                                        ctypes.c_float, ptr, ctypes.c_int]
    lib.tm_decode_attention.restype = ctypes.c_int
    lib.tm_rotary.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64]
    lib.tm_silu_mul.argtypes = [ptr, i64, i64, ptr]
    lib.tm_rms_norm.restype = lib.tm_rotary.restype = lib.tm_silu_mul.restype = None
    lib.tm_decode_layers.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_float, i64, ptr, ptr, ptr, ptr, i64,
                                     ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.tm_decode_layers.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


@functools.cache
def preferred() -> bool:
    """Whether the quantized linears should run these kernels rather than PyTorch's (see the module docstring)."""
    forced = os.environ.get("TOKENMIND_NATIVE") == "1"
    return available() and (forced or torch.backends.cpu.get_cpu_capability() == "AVX2")


def takes(x: torch.Tensor, *others: torch.Tensor, contiguous: bool = True) -> bool:
    """Whether an inference op on these tensors can run natively: the kernels are preferred here, x is a
    float32 CPU tensor (contiguous, unless the caller checked its strides), and no autograd graph is
    being recorded through any of them (the native ops have no backward, so training keeps PyTorch's)."""
    if torch.compiler.is_compiling():  # traced code keeps PyTorch's ops (and the trace needs no graph break here)
        return False
    if not (preferred() and x.dtype == torch.float32 and x.device.type == "cpu" and (x.is_contiguous() or not contiguous)):
        return False
    if not torch.is_grad_enabled():  # inference: the common case, decided without looking further
        return True
    return not (x.requires_grad or any(t.requires_grad for t in others))


def _threads(weights: int) -> int:
    # A small matrix is done before a second thread would start on it.
    return torch.get_num_threads() if weights >= 1 << 18 else 1


def _checked(status: int) -> None:
    if status:
        raise MemoryError("the native kernel could not allocate its activation buffers")


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, block_rows: int,
                group_size: int) -> torch.Tensor:
    """x (..., K) float32, contiguous, @ the int4pack weight (N, K/2) with bf16 (K/group, N, 2) scales →
    (..., N) float32. Needs N % the packing's block rows == 0 and K % 32 == 0 (`Int4Linear._native_layout_ok`)."""
    k = x.shape[-1]
    m, n = x.numel() // k, packed.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    _checked(library().tm_int4_matmul(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), n,
                                      block_rows, group_size, y.data_ptr(), _threads(n * k)))
    return y


def int4_dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, block_rows: int,
                    group_size: int) -> torch.Tensor:
    """The int4pack weight (N, K/2) with bf16 (K/group, N, 2) scales and zeros as an (N, K) float32 matrix,
    (q − 8)·s + z rounded once (what `Int4Linear.dequantize` computes in float64). Layout as `int4_matmul`."""
    n, k = packed.shape[0], packed.shape[1] * 2
    w = torch.empty(n, k, dtype=torch.float32)
    library().tm_int4_dequantize(packed.data_ptr(), scales_and_zeros.data_ptr(), n, k, block_rows, group_size,
                                 w.data_ptr(), _threads(n * k))
    return w


# Rows up to which f32_matmul beats MKL's sgemm over SmolLM2's linears (AVX2 EPYC, 2 threads): 2.0x at
# 1 row, 1.6x at 16-32, 1.15x at 64, even at 128.
F32_MAX_ROWS = 64


def f32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., K) float32, contiguous, @ a contiguous float32 (N, K) weight.T → (..., N); K % 8 == 0.
    For the few rows of a decode step (`F32_MAX_ROWS`), where MKL's sgemm reads the weights slowly."""
    k = x.shape[-1]
    m, n = x.numel() // k, weight.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    library().tm_f32_matmul(x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr(), _threads(n * k))
    return y


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) float32, contiguous, @ (weight (N, K) int8 · bf16 scales (N,)).T → (..., N) float32; K % 32 == 0."""
    k = x.shape[-1]
    m, n = x.numel() // k, weight.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    _checked(library().tm_int8_matmul(x.data_ptr(), m, k, weight.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
                                      _threads(n * k)))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a contiguous float32 (..., D) tensor with D % 8 == 0 and a float32 (D,) weight."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    library().tm_rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // d, d, y.data_ptr())
    return y


MAX_QUERY_GROUP = 64  # query heads per key head the attention kernel holds on its stack


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     lens: torch.Tensor, first_key: int, window: int | None, scale: float) -> torch.Tensor:
    """One query per sequence over its keys in the paged pool, read where they lie (no gather, no padding).

    q (N, H, D) float32; k_pool/v_pool one layer's (blocks, block_size, H_kv, D | D_v) float32, contiguous;
    block_tables (N, ≥ blocks used) int64 (row stride free); lens (N,) int64 context lengths. Sequence n
    attends to keys [max(first_key, lens[n] − window), lens[n]). Returns (N, H, D_v) float32."""
    n, h, d = q.shape
    _, bs, hkv, dv = v_pool.shape
    out = torch.empty(n, h, dv)
    _checked(library().tm_decode_attention(q.data_ptr(), h * d, k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(),
                                           block_tables.stride(0), lens.data_ptr(), first_key, window or 0, n, h, hkv,
                                           d, dv, bs, scale, out.data_ptr(), torch.get_num_threads()))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rope.apply_rotary` for a float32 x (B, T, H, D) whose heads are contiguous within each of its B·T rows
    (rows may be further apart: q and k sliced out of a fused qkv), and contiguous (B, T, 1, D) cos / signed
    sin; D % 16 == 0. Returns a contiguous (B, T, H, D) tensor."""
    y = x.new_empty(x.shape)
    library().tm_rotary(x.data_ptr(), x.stride(1), cos.data_ptr(), signed_sin.data_ptr(), x.shape[0] * x.shape[1],
                        x.shape[2], x.shape[3], y.data_ptr(), x.shape[2] * x.shape[3])
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for a contiguous float32 (..., 2F) tensor [gate | up] → (..., F); F % 8 == 0."""
    f = gate_up.shape[-1] // 2
    y = gate_up.new_empty(*gate_up.shape[:-1], f)
    library().tm_silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * f), f, y.data_ptr())
    return y


ROUTE_TOPK_SOFTMAX, ROUTE_SOFTMAX_TOPK = 0, 1  # native_kernels.c's ROUTE_*: how a mixture's router weighs its top k


def decode_layers(x: torch.Tensor, layers: list, eps: float, block_rows: int, cos: torch.Tensor,
                  signed_sin: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor, slots: torch.Tensor,
                  block_tables: torch.Tensor, lens: torch.Tensor, first_key: int, window: int | None,
                  heads: tuple[int, int, int], scale: float, routed_scaling: float = 1.0) -> None:
    """One all-decode step of a stack of plain pre-norm blocks in one call (`tm_decode_layers`), x (1, N, d)
    updated in place. layers: per block ((input norm weight, post-attention norm weight), [the linears qkv,
    o, gate_up, down: each an Int4Linear (PyTorch's packing, bf16 scales and zeros), an Int8Linear or a
    float32 nn.Linear, qkv's bias float32 if any; in a mixture of experts gate_up and down are its shared
    expert's, or None], its index in the pools, and None for a dense MLP or a mixture of experts as
    (router weight (E, d), experts' gate_up (E, 2 Fe, d) and down (E, d, Fe), the shared expert's gate
    weight (1, d) or None, top k, ROUTE_*), all float32 and contiguous); k_pools / v_pools: every layer's
    (layers, blocks, block_size, H_kv, D) float32, contiguous; heads: (H, H_kv, head_dim); routed_scaling:
    the factor on the experts' weights; the rest as in `decode_attention` and `rotary`."""
    n, d = x.shape[1], x.shape[2]
    k_base, v_base = k_pools.data_ptr(), v_pools.data_ptr()
    k_layer, v_layer = k_pools.stride(0) * 4, v_pools.stride(0) * 4  # bytes per layer of float32
    ptrs, info = [], []
    for (ln1, ln2), linears, index, mixture in layers:  # in the order of native_kernels.c's P_* and I_* rows
        ptrs += [ln1.data_ptr(), ln2.data_ptr()]
        for lin in linears:
            scales = getattr(lin, "_scales_name", None)
            if lin is None:  # a mixture of experts without a shared expert
                ptrs += [0, 0]
                info.append(-1)
            elif scales is None:  # a float32 nn.Linear
                ptrs += [lin._parameters["weight"].data_ptr(), 0]
                info.append(-1)
            else:
                buffers = lin._buffers
                ptrs += [buffers["weight"].data_ptr(), buffers[scales].data_ptr()]
                info.append(getattr(lin, "group_size", 0))  # 0: int8
        qkv = linears[0]
        bias = qkv._parameters["bias"] if type(qkv) is torch.nn.Linear else qkv._buffers["bias"]
        ptrs += [k_base + index * k_layer, v_base + index * v_layer, 0 if bias is None else bias.data_ptr()]
        info.append(0 if linears[3] is None else linears[3].in_features)
        if mixture is None:
            ptrs += [0, 0, 0, 0]
            info += [0, 0, 0, 0]
        else:
            router, experts_gu, experts_dn, shared_gate, top_k, routing = mixture
            ptrs += [router.data_ptr(), experts_gu.data_ptr(), experts_dn.data_ptr(),
                     0 if shared_gate is None else shared_gate.data_ptr()]
            info += [router.shape[0], top_k, experts_dn.shape[2], routing]
    h, hkv, hd = heads
    ptrs, info = array.array("q", ptrs), array.array("q", info)  # int64 C arrays, ~15x faster to fill than ctypes'
    _checked(library().tm_decode_layers(
        x.data_ptr(), n, d, len(layers), ptrs.buffer_info()[0], info.buffer_info()[0],
        eps, block_rows, cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), first_key, window or 0, h, hkv, hd,
        k_pools.shape[2], scale, routed_scaling, torch.get_num_threads()))
