"""Quantized linears on PyTorch's CPU kernels: weight-only int8 and int4 for decoding, W8A8 for encoders.

Two weight-only drop-in replacements for `nn.Linear` (same `forward(x)` on any (..., in_features) input):

- `Int8Linear`: symmetric per-output-channel int8, w = q · s[n], q in [-127, 127]. Runs
  `torch._weight_int8pack_mm`.
- `Int4Linear`: asymmetric group-wise int4 (groups of 32/64/128/256 along in_features), the
  "tinygemm" convention w = (q − 8) · s + z with q in [0, 15] and one (s, z) per group. Runs
  `torch._convert_weight_to_int4pack_for_cpu` + `torch._weight_int4pack_mm_for_cpu`.

Both kernels take activations and scales of one dtype, the *compute dtype* (the dtype of the
`scales` buffer; bf16 by default). Measured on the 2-core AVX-512/AMX CPU these kernels are fast
in bf16 and very slow in fp32 (int8: ~4x slower, int4: ~20x), so activations are cast to the
compute dtype around the kernel and back to the caller's dtype after it. They are matrix-vector
kernels: above `kernel_max_rows` rows (prefill) the layer instead dequantizes its weight to the
compute dtype and calls `F.linear`, which runs on AMX in bf16. compute_dtype=float32 is the exact
mode (slow): the effective weight is then reproduced bit for bit, which is what the GGUF tests use.

On CPUs where PyTorch runs its AVX2 kernels (no AVX-512), whose int4/int8 paths reach only 2.7-3.5 G
weights/s, a bf16-compute layer's kernel calls go to tokenmind's own (`native.py`, `native_kernels.c`):
the same packed weights and bf16 scales, float32 activations quantized to int16 per 32 columns, no
casts around the call.

`DynamicInt8Linear` quantizes the activations too, per call (fbgemm's dynamic linear): the int8
arithmetic pays off when the matmul is compute-bound (many rows), as in a sentence encoder's batches.

GGUF Q4_0 and Q4_1 blocks (32 weights, fp16 scale d, Q4_1 also an fp16 min m) are group-32 int4
already: Q4_0 is w = d·(q − 8) → (s, z) = (d, 0); Q4_1 is w = d·q + m → (s, z) = (d, m + 8d).
Q4_K super-blocks (256 weights: fp16 d and dmin, then a 6-bit scale sc and min m per 32-weight
sub-block) are group-32 int4 too: w = d·sc·q − dmin·m → (s, z) = (d·sc, 8·d·sc − dmin·m).
`quantize_from_gguf` copies the 4-bit codes as they are. Q8_0, Q5_0/Q5_1, Q5_K and Q6_K have
more than 4 bits, so they go to the per-channel int8 kernel (which has no per-block scales),
requantized from their dequantized values (one extra rounding, error ≤ half a per-channel step).

Layout of `_convert_weight_to_int4pack_for_cpu` (probed; `_unpack_int4` inverts it and the tests
check it against the kernel): (N, K/2) uint8; rows go in blocks of B (64 where PyTorch runs its
AVX-512 kernels, 32 on AVX2: `int4_block_rows` probes it once), and block b viewed as (K, B/2)
bytes holds row Bb+j in the low and row Bb+B/2+j in the high nibble of byte [k, j]; a last
partial block of R rows viewed as (K, R/2) holds rows 2j and 2j+1 in byte [k, j].
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .cpu import cpu_has_avx512_vnni, cpu_has_native_bf16

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit codes copied into Int4Linear as they are
GGUF_INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")  # dequantized, requantized per channel


COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernels' activation dtypes


def _check_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size!r}")


def _check_compute_dtype(dtype: torch.dtype) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {', '.join(map(str, COMPUTE_DTYPES))}, got {dtype} "
                         "(bfloat16 is the fast one; float32 the exact one)")


class QuantizedLinear(nn.Module):
    """Shared shell: reshape (..., in) → (M, in), pad, cast to the compute dtype, matmul, bias, cast back.

    Subclasses own the weight format: `_kernel(x)` for few rows and `dequantize(dtype)` (the
    effective (out, in) weight, also used for many rows). Inputs are zero-padded on the right when
    the kernel needs in_features rounded up (`padded_in`); the padded weight columns never matter.
    """

    # Rows up to which the fused kernel beats dequantize + F.linear: the kernel's time grows linearly
    # with rows, the other's barely. Measured on SmolLM2's weights (bench_quant.py --crossover): with
    # PyTorch's kernels int8 crosses over between 32 and 64 rows, int4 between 128 and 256; with the
    # native ones (AVX2 EPYC) int8 above 256 (SmolLM2's int8 LM head at 64 rows: 50 ms against 173) and
    # int4 between 128 and 256. Setting `kernel_max_rows` on a layer overrides both.
    torch_kernel_max_rows = 32
    native_kernel_max_rows = 256
    _scales_name = ""  # the buffer of scales, whose dtype is the compute dtype (set by each subclass)

    def __init__(self, in_features: int, out_features: int, padded_in: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features, self.padded_in = in_features, out_features, padded_in
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.source = ""  # where the weights came from, e.g. "Q4_1" for a GGUF load

    @property
    def compute_dtype(self) -> torch.dtype:
        """The kernel's activation dtype: that of the stored scales (so `.to(dtype)` moves both together)."""
        return self._buffers[self._scales_name].dtype

    @property
    def kernel_max_rows(self) -> int:
        """Rows up to which calls take the fused kernel (more: dequantize + F.linear)."""
        rows = self.__dict__.get("_kernel_max_rows")
        if rows is None:
            native_kernel = self.compute_dtype == torch.bfloat16 and self._native_ready()
            rows = self.native_kernel_max_rows if native_kernel else self.torch_kernel_max_rows
        return rows

    @kernel_max_rows.setter
    def kernel_max_rows(self, rows: int) -> None:
        self.__dict__["_kernel_max_rows"] = rows

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _native_layout_ok(self) -> bool:
        return False

    def _native_ready(self) -> bool:
        """Whether `native_kernels.c` takes the kernel's calls (bf16 compute dtype only: float32 stays the exact
        mode). It beats PyTorch's kernels at every row count they take on AVX2 (bench_quant.py --native), and
        its activations keep ~15 bits against bf16's 8. Decided once: the layout does not change."""
        ready = self.__dict__.get("_native_ok")
        if ready is None:
            ready = self.__dict__["_native_ok"] = native.preferred() and self._native_layout_ok()
        return ready and self._buffers["weight"].device.type == "cpu"

    def _native_kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A batch-1 decode step calls this ~120 times. Its common case (float32 activations on the native
        # kernel, no padding or bias) goes straight in and out in the caller's shape; otherwise the kernel
        # path does only what it must: one view in and out, a cast each way only where the dtypes differ.
        if (x.dtype == torch.float32 and self.padded_in == self.in_features and self._buffers["bias"] is None
                and 0 < x.numel() <= self.kernel_max_rows * self.in_features and self.compute_dtype == torch.bfloat16
                and native.takes(x) and self._native_ready()):
            return self._native_kernel(x)
        rows = x.reshape(-1, self.in_features)
        buffers, dtype = self._buffers, self.compute_dtype
        # the fused kernels have no backward: a QLoRA step needing the input's gradient takes the dequantized path
        if 0 < rows.shape[0] <= self.kernel_max_rows and not (x.requires_grad and torch.is_grad_enabled()):
            use_native = dtype == torch.bfloat16 and self._native_ready()
            if use_native:  # float32 activations in, float32 out: no casts around the kernel
                dtype = torch.float32
            x2 = rows if rows.dtype == dtype else rows.to(dtype)
            if self.padded_in != self.in_features:
                x2 = F.pad(x2, (0, self.padded_in - self.in_features))
            y = self._native_kernel(x2.contiguous()) if use_native else self._kernel(x2.contiguous())
        else:
            dtype = self._matmul_dtype(x)
            y = F.linear(rows.to(dtype), self.dequantize(dtype))
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        bias = buffers["bias"]
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _matmul_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dequantized path's dtype: the compute dtype, except on a CPU that only emulates bf16, where
        float32 runs several times faster (SmolLM2 int4 prefill on an AVX2 EPYC: 59 → 230 tok/s; a QLoRA
        step 5-8x). The kernels are not bf16 there either: the native ones take float32 activations."""
        if self.compute_dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_has_native_bf16():
            return torch.float32
        return self.compute_dtype

    def extra_repr(self) -> str:
        src = f", source={self.source}" if self.source else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}{src}")


class Int8Linear(QuantizedLinear):
    """Symmetric per-output-channel int8: weight (out, padded_in) int8, scales (out,) in the compute dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None):
        # The bf16 kernel reads in_features in chunks of 16: other widths give wrong results or crash
        # (torch 2.13), so from_float zero-pads the columns to a multiple of 16.
        if qweight.dtype != torch.int8 or qweight.shape[1] % 16 or scales.shape != (qweight.shape[0],):
            raise ValueError(f"Int8Linear needs an int8 (out, in) weight with in % 16 == 0 and (out,) scales; got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)} (use from_float)")
        super().__init__(in_features, qweight.shape[0], qweight.shape[1], bias)
        self.register_buffer("weight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   compute_dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        """Quantize an (out, in) float weight: s = max|w| / 127 per row (rounded to the compute dtype
        first, so the stored scale is the one the codes were made with), q = round(w / s)."""
        w = weight.detach().float()
        out_f, in_f = w.shape
        lo, hi = torch.aminmax(w, dim=1)
        scales = (torch.maximum(-lo, hi) / 127).to(compute_dtype)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero rows
        q = (w / scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # one full-size temporary
        padded = -(-in_f // 16) * 16
        q = F.pad(q, (0, padded - in_f))
        return cls(q, scales, in_f, bias)

    _scales_name = "scales"

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return torch._weight_int8pack_mm(x, buffers["weight"], buffers["scales"])

    def _native_layout_ok(self) -> bool:
        return self.padded_in % 32 == 0

    def _native_kernel(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return native.int8_matmul(x, buffers["weight"], buffers["scales"])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight[:, :self.in_features]
        return w.to(dtype) * self.scales.to(dtype)[:, None]


class Int4Linear(QuantizedLinear):
    """Asymmetric group-wise int4 on the int4pack kernel.

    weight: (out, padded_in / 2) uint8, packed by `_convert_weight_to_int4pack_for_cpu`.
    scales_and_zeros: (padded_in / group_size, out, 2) in the compute dtype, [..., 0] = s, [..., 1] = z,
    meaning w = (q − 8) · s + z for the codes q in [0, 15] of that group.
    """

    torch_kernel_max_rows = native_kernel_max_rows = 128

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int,
                 bias: torch.Tensor | None = None):
        out_f, padded = packed.shape[0], packed.shape[1] * 2
        super().__init__(in_features, out_f, padded, bias)
        _check_group_size(group_size)
        if scales_and_zeros.shape != (padded // group_size, out_f, 2):
            raise ValueError(f"scales_and_zeros must be {(padded // group_size, out_f, 2)}, "
                             f"got {tuple(scales_and_zeros.shape)} (use from_float or from_codes)")
        self.group_size = group_size
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None = None, *, in_features: int | None = None) -> Int4Linear:
        """codes (out, in) in [0, 15]; scales/zeros (out, in / group_size), already in the compute dtype,
        with w = (q − 8) · s + z. `in_features` < codes.shape[1] marks trailing padding columns."""
        out_f, k = codes.shape
        _check_group_size(group_size)
        if out_f % 16:
            raise ValueError(f"the int4 kernel needs out_features divisible by 16, got {out_f}; "
                             "keep this layer in float or use scheme='int8'")
        if k % group_size:
            raise ValueError(f"in_features {k} is not divisible by group_size {group_size}")
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scales.t(), zeros.t()], dim=-1)  # (groups, out, 2)
        return cls(packed, sz, group_size, k if in_features is None else in_features, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32,
                   compute_dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
        """Min/max quantization per group: s = (max − min) / 15, z = min + 8s (both rounded to the compute
        dtype before the codes are made), q = clamp(round((w − z) / s) + 8, 0, 15).

        in_features not divisible by group_size: the weight is zero-padded to the next multiple (the
        last group then also spans some zero columns) and inputs are zero-padded per call.
        """
        _check_group_size(group_size)
        w = weight.detach().float()
        out_f, in_f = w.shape
        padded = -(-in_f // group_size) * group_size
        w = F.pad(w, (0, padded - in_f)).view(out_f, padded // group_size, group_size)
        scales, zeros = int4_minmax_grid(w, compute_dtype)
        codes = int4_round(w, scales[..., None], zeros[..., None]).view(out_f, padded)
        return cls.from_codes(codes, scales, zeros, group_size, bias, in_features=in_f)

    _scales_name = "scales_and_zeros"

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return torch._weight_int4pack_mm_for_cpu(x, buffers["weight"], self.group_size, buffers["scales_and_zeros"])

    def _native_layout_ok(self) -> bool:
        return self.out_features % int4_block_rows() == 0  # whole blocks of the packing; padded_in % 32 == 0

    def _native_kernel(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return native.int4_matmul(x, buffers["weight"], buffers["scales_and_zeros"], int4_block_rows(),
                                  self.group_size)

    def codes(self) -> torch.Tensor:
        """The (out, padded_in) uint8 codes in [0, 15]."""
        return _unpack_int4(self.weight, self.out_features, self.padded_in)

    def portable(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, scales, zeros) as checkpoints store them (`checkpoint.save_hf_dir`), independent of
        the kernel's packing: qweight (out, in / 2) uint8 holds input columns 2j and 2j + 1 in its low
        and high nibble; scales and zeros are (out, padded_in / group_size) in the compute dtype."""
        if self.in_features % 2:
            raise ValueError(f"an int4 checkpoint stores two codes per byte; in_features={self.in_features} is odd")
        codes = self.codes()[:, :self.in_features]
        sz = self.scales_and_zeros.transpose(0, 1)
        return codes[:, 0::2] | (codes[:, 1::2] << 4), sz[..., 0].contiguous(), sz[..., 1].contiguous()

    @classmethod
    def from_portable(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      bias: torch.Tensor | None = None) -> Int4Linear:
        """Inverse of `portable`; the padding columns (in_features up to the groups' width) get code 8."""
        out_f, in_f = qweight.shape[0], 2 * qweight.shape[1]
        codes = torch.full((out_f, scales.shape[1] * group_size), 8, dtype=torch.uint8)
        if codes.shape[1] < in_f or codes.shape[1] - in_f >= group_size:
            raise ValueError(f"{scales.shape[1]} groups of {group_size} do not cover in_features={in_f}: the "
                             "checkpoint's scales and group_size disagree")
        codes[:, 0:in_f:2], codes[:, 1:in_f:2] = qweight & 15, qweight >> 4
        return cls.from_codes(codes, scales, zeros, group_size, bias, in_features=in_f)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: int = 256) -> torch.Tensor:
        n, k, g = self.out_features, self.padded_in, self.group_size
        if dtype == torch.float32 and self.compute_dtype == torch.bfloat16 and self._native_ready():
            # the same values from native_kernels.c, ~10x faster: a long prefill's dequantized path runs this per step
            w = native.int4_dequantize(self.weight, self.scales_and_zeros, int4_block_rows(), g)
            return w if k == self.in_features else w[:, :self.in_features].contiguous()
        # float64 makes (q − 8)·s + z one rounding, like the kernel's fused multiply-add in fp32.
        work = torch.float64 if dtype == torch.float32 else torch.float32
        out = torch.empty(n, self.in_features, dtype=dtype, device=self.weight.device)
        for r0 in range(0, n, rows):  # row chunks (a multiple of 64) keep the float temporaries in cache
            r1 = min(n, r0 + rows)
            s, z = (self.scales_and_zeros[:, r0:r1, i].t().to(work).contiguous()[..., None] for i in (0, 1))
            q = _unpack_int4(self.weight[r0:r1], r1 - r0, k).view(torch.int8).sub_(8)
            w = q.view(r1 - r0, k // g, g).to(work).mul_(s).add_(z)
            out[r0:r1] = w.view(r1 - r0, k)[:, :self.in_features]
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


def int4_minmax_grid(groups: torch.Tensor, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The round-to-nearest grid of float groups (..., group_size): s = (max − min) / 15 and z = min + 8s,
    each rounded to the compute dtype (so the stored values are the ones the codes are made with)."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).to(compute_dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # constant groups
    zeros = (lo + 8 * scales.float()).to(compute_dtype)
    return scales, zeros


def int4_round(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Codes q = clamp(round((w − z) / s) + 8, 0, 15) as uint8, for scales/zeros broadcast against w."""
    q = torch.round((w - zeros.float()) / scales.float()) + 8
    return q.clamp_(0, 15).to(torch.uint8)


@functools.cache
def int4_block_rows() -> int:
    """Rows per block of the int4 packing on this CPU: where row B/2 lands tells B (64 or 32)."""
    probe = torch.zeros(64, 32, dtype=torch.int32)
    probe[32, 0] = 1
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    return 64 if packed[0, 0] == 0x10 else 32


def _unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Invert `_convert_weight_to_int4pack_for_cpu` (layout in the module docstring) → (n, k) uint8 codes."""
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    b = int4_block_rows()
    full = n // b * b
    if full:  # transpose the bytes first, then each nibble plane is b/2 whole rows
        p = packed[:full].view(full // b, k, b // 2).transpose(1, 2)
        rows = out[:full].view(full // b, 2, b // 2, k)
        torch.bitwise_and(p, 15, out=rows[:, 0])
        torch.bitwise_right_shift(p, 4, out=rows[:, 1])
    if n > full:
        p = packed[full:].reshape(k, (n - full) // 2)
        out[full:] = torch.stack([p & 15, p >> 4], dim=2).reshape(k, n - full).t()
    return out


# A mixture of experts' routers stay in float, as llama.cpp keeps them: they are tiny, and a rounding
# that flips a token's top-k choice swaps whole experts.
_ROUTERS = ("gate", "shared_expert_gate")


def _linears(model: nn.Module, quantize_lm_head: bool) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in _ROUTERS
            and (quantize_lm_head or name.rsplit(".", 1)[-1] != "lm_head")]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str = "int8", group_size: int = 32, *,
                   quantize_lm_head: bool = True, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every `nn.Linear` of `model` in place with an `Int8Linear` or `Int4Linear`; returns `model`.
    A mixture of experts' routers stay float (`_ROUTERS`) and its 3-D expert slabs are not linears.

    scheme: "int8" (per-channel symmetric) or "int4" (group-wise asymmetric, `group_size` in
    32/64/128/256; in_features not divisible by it are zero-padded, see `Int4Linear.from_float`).
    The default group of 32 costs 1/8 byte per weight more than 128 and runs about as fast; on
    SmolLM2 (whose weights come from a Q4_1 file) its perplexity stayed within 0.1% of fp32 while
    group 128 added ~60% (LM head kept in float; with it in int4 too, +6% and +116%).
    quantize_lm_head=False keeps the LM head in float. A tied LM head gets its own quantized copy;
    the embedding stays as it is. int4 layers whose out_features is not a multiple of 16 (a kernel
    requirement) stay `nn.Linear`, with a warning naming them.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "int4":
        _check_group_size(group_size)
    _check_compute_dtype(compute_dtype)
    kept = []
    for name, linear in _linears(model, quantize_lm_head):
        bias = None if linear.bias is None else linear.bias.detach()
        if scheme == "int8":
            q = Int8Linear.from_float(linear.weight, bias, compute_dtype=compute_dtype)
        elif linear.out_features % 16:
            kept.append(name)
            continue
        else:
            q = Int4Linear.from_float(linear.weight, bias, group_size=group_size, compute_dtype=compute_dtype)
        _replace(model, name, q.to(linear.weight.device))
    if kept:
        warnings.warn(f"int4 needs out_features divisible by 16; kept in float: {', '.join(kept)}", stacklevel=3)
    return model


class DynamicInt8Linear(nn.Module):
    """W8A8 dynamic quantization for compute-bound matmuls over many rows (an encoder's batches).

    The weight is int8 per output channel, packed once for fbgemm; every call quantizes its input
    to uint8 with one scale and zero point from the input's own min/max, multiplies in int32 and
    returns float with the bias added (`quantized::linear_dynamic`, one fused op). Where the
    weight-only kernels above save memory traffic at a few rows, this one halves the arithmetic's
    width: all-MiniLM-L6-v2 embeds ~1.6x faster than fp32 on a 2-core AVX512-VNNI Xeon, its
    vectors at cosine 0.994 (mean) to the fp32 ones. Inference only: there is no backward. One
    scale serves all rows of a call, so a row's result moves a little with the rows beside it.

    Without AVX512-VNNI fbgemm adds pairs of u8·s8 products in int16, so inputs are then quantized
    to 7 bits (`reduce_range`) to keep the sums from saturating; with it they use all 8 (measured:
    cosine 0.980 -> 0.994 on the encoder).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).double()
        with warnings.catch_warnings():  # torch 2.13 (pinned) marks quantized tensor dtypes deprecated; fbgemm's
            warnings.filterwarnings("ignore", message=".*quantized tensor creation")  # packing still needs one
            q = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        self.has_bias = bias is not None
        self.packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())
        self.reduce_range = not cpu_has_avx512_vnni()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features).float(), self.packed,
                                               self.reduce_range)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"reduce_range={self.reduce_range}")


@torch.no_grad()
def quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `model` in place with a `DynamicInt8Linear`; returns `model`."""
    for name, linear in _linears(model, quantize_lm_head=True):
        _replace(model, name, DynamicInt8Linear(linear.weight, linear.bias))
    return model


# ---- GGUF blocks → kernels -------------------------------------------------------------------

_GGUF_SOURCES = {  # our fused module suffix → the HF tensors stacked in it, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj",),
}


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """(..., 2) bytes holding little-endian fp16 → (...) float32 (exact)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes per super-block (..., 12) → the 8 sub-blocks' 6-bit scales and mins (..., 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 (scale: low nibble, min: high nibble) and their top 2 bits from
    the spare top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    b = torch.from_numpy(np.ascontiguousarray(packed))
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    scales = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales, mins


def gguf_int4_codes(data: np.ndarray, qtype_name: str, shape: tuple[int, int]):
    """Q4_0 / Q4_1 / Q4_K raw blocks of an (out, in) tensor → (codes (out, in) uint8, s (out, in/32) fp32,
    z (out, in/32) fp32) with w = (q − 8)·s + z per group of 32:

    Q4_0: (s, z) = (d, 0); Q4_1: (d, m + 8d); Q4_K: (d·sc, 8·d·sc − dmin·m).

    s is exact in fp32 for all three (fp16 d times a 6-bit sc). z is exact too, and the kernel's
    weight then `gguf.quants.dequantize`'s bit for bit, unless its two terms need more than fp32's
    24 significant bits together: Q4_1 when m and 8d are > 2^13 apart in magnitude; Q4_K (17-bit
    terms) when dmin/d is outside [2^-3, 2^10] — never in the Qwen2.5-Coder files (all 44M groups
    exact). Otherwise z is off by at most half an fp32 ulp.
    """
    out_f, in_f = shape
    if qtype_name == "Q4_K":
        blocks = np.ascontiguousarray(data).reshape(out_f, in_f // 256, 144)  # d, dmin, 12 scale bytes, 128 qs
        d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
        sc, m = _q4_k_scales_mins(blocks[..., 4:16])
        # 32 bytes per pair of sub-blocks: the low nibbles are sub-block 2j, the high ones 2j + 1
        qs = torch.from_numpy(blocks[..., 16:].copy()).view(out_f, in_f // 256, 4, 1, 32)
        codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(out_f, in_f)
        s = d[..., None] * sc.float()
        zero = 8 * s - dmin[..., None] * m.float()
        return codes, s.reshape(out_f, in_f // 32), zero.reshape(out_f, in_f // 32)
    header = {"Q4_0": 2, "Q4_1": 4}[qtype_name]
    blocks = np.ascontiguousarray(data).reshape(out_f, in_f // 32, header + 16)
    d = _fp16(blocks[..., 0:2])
    qs = torch.from_numpy(blocks[..., header:].copy())  # byte i: element i (low nibble), element 16+i (high)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(out_f, in_f)
    zero = torch.zeros_like(d) if qtype_name == "Q4_0" else _fp16(blocks[..., 2:4]) + 8 * d
    return codes, d, zero


def gguf_linear(ckpt, hf_names: list[str], bias: torch.Tensor | None = None,
                compute_dtype: torch.dtype = torch.bfloat16, weight: torch.Tensor | None = None
                ) -> QuantizedLinear | None:
    """One quantized linear from the raw blocks of `hf_names` (rows stacked in that order), or None when
    their GGUF types have no kernel mapping here (see `quantize_from_gguf`). `weight`: these tensors
    already dequantized to float32 and stacked (the loaded model's), which spares dequantizing again."""
    from gguf.quants import dequantize

    raws = [ckpt.raw_tensor(n) for n in hf_names]
    types = {qtype.name for _, qtype, _ in raws}
    if types <= set(GGUF_INT4_TYPES) and sum(shape[0] for *_, shape in raws) % 16 == 0:
        parts = [gguf_int4_codes(data, qtype.name, shape) for data, qtype, shape in raws]
        codes, s, zero = (torch.cat(xs) for xs in zip(*parts))
        module = Int4Linear.from_codes(codes, s.to(compute_dtype), zero.to(compute_dtype), 32, bias)
    elif types <= set(GGUF_INT4_TYPES + GGUF_INT8_TYPES):  # more than 4 bits somewhere: int8 keeps them
        if weight is None or weight.dtype != torch.float32:
            weight = torch.cat([torch.from_numpy(dequantize(data, qtype).reshape(shape))
                                for data, qtype, shape in raws])
        module = Int8Linear.from_float(weight, bias, compute_dtype=compute_dtype)
    else:
        return None
    module.source = "+".join(sorted(types))
    return module


@torch.no_grad()
def quantize_from_gguf(model: nn.Module, ckpt, *, compute_dtype: torch.dtype = torch.bfloat16,
                       quantize_lm_head: bool = True) -> nn.Module:
    """Replace `model`'s linears with quantized ones built from the GGUF checkpoint's raw blocks; returns `model`.

    `model` is the `Transformer` loaded from `ckpt` (its float weights are discarded for the layers
    replaced, after serving as the dequantized values when they are float32; biases are kept). Per
    layer, by the GGUF types of its tensors (q/k/v and gate/up fused in the order that
    `checkpoint.from_hf_state_dict` uses, so one layer may mix types):
      all Q4_0 / Q4_1 / Q4_K (mixable) → `Int4Linear`, group 32, the 4-bit codes copied as they are
        (`gguf_int4_codes`; a Q4_K super-block of 256 is 8 groups of 32);
      any Q8_0 / Q5_0 / Q5_1 / Q5_K / Q6_K, alone or with the 4-bit types → `Int8Linear`,
        dequantized then requantized per channel (the kernel has no per-block scales; the extra
        bits of these types would be lost in int4);
      anything else (F32, F16, BF16, other K-quants) → left as the dequantized `nn.Linear`.
    A mixture of experts' shared expert maps like a dense MLP and its routers stay float; the
    routed experts are 3-D slabs (`transformer.Experts`), not linears: this leaves them as the
    loader dequantized them, float, whatever their GGUF type.
    Qwen2.5-Coder Q4_K_M files, for example: the 1.5B's Q4_K layers go to int4 and its Q6_K
    layers (and q/k/v fused with a Q6_K v) to int8; the 0.5B is mostly Q5_0, so mostly int8.
    With compute_dtype=float32 the Int4Linear's effective weight equals `gguf.quants.dequantize`
    bit for bit (up to the zero-point rounding `gguf_int4_codes` describes); with bf16 the block
    scales and zeros are rounded to bf16 (8 bits).
    """
    _check_compute_dtype(compute_dtype)
    names = set(ckpt.tensor_names)
    for name, linear in _linears(model, quantize_lm_head):
        if name == "lm_head":
            sources = ["lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"]
        else:
            parts = name.split(".")  # layers.{i}.self_attn.qkv_proj
            prefix, key = ".".join(parts[:2]), ".".join(parts[2:])
            if key not in _GGUF_SOURCES:
                continue
            sources = [f"model.{prefix}.{part}.weight" for part in _GGUF_SOURCES[key]]
        if not all(s in names for s in sources):
            continue
        bias = None if linear.bias is None else linear.bias.detach()
        weight = None if linear.weight.is_meta else linear.weight.detach()  # meta: left in blocks by the loader
        module = gguf_linear(ckpt, sources, bias, compute_dtype, weight=weight)
        if module is not None:
            _replace(model, name, module)
    return model


def gguf_block_tensors(ckpt, quantize_lm_head: bool = True) -> frozenset[str]:
    """The HF names of the tensors `quantize_from_gguf` builds kernels from (every tensor of a fused
    group whose GGUF types all map to Int4Linear or Int8Linear), which the loader need not dequantize."""
    mapped = set(GGUF_INT4_TYPES + GGUF_INT8_TYPES)
    names = set(ckpt.tensor_names)
    groups = [[f"model.layers.{i}.{part}.weight" for part in parts]
              for i in range(ckpt.config["num_hidden_layers"]) for parts in _GGUF_SOURCES.values()]
    if quantize_lm_head and "lm_head.weight" in names:  # a tied head is the embedding, which stays dequantized
        groups.append(["lm_head.weight"])
    return frozenset(n for group in groups if all(n in names for n in group)
                     and all(ckpt.raw_tensor(n)[1].name in mapped for n in group) for n in group)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the model's parameters and buffers (shared tensors counted once), split into the
    linear layers (quantized or not) and everything else (embeddings, norms, RoPE tables)."""
    seen, linear, other = set(), 0, 0
    for module in model.modules():
        is_linear = isinstance(module, (nn.Linear, QuantizedLinear))
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            n = t.numel() * t.element_size()
            linear, other = (linear + n, other) if is_linear else (linear, other + n)
    return {"linear": linear, "other": other, "total": linear + other}
