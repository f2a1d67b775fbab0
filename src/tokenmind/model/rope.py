"""Rotary position embeddings (RoPE) and the context-extension scalings models ship with.

Each scaling only changes the per-pair rotation frequencies (`inv_freq`) and, for YaRN, a
magnitude factor on cos/sin; the rotation itself is the same "rotate half" form HF Llama uses,
so checkpoints load without permuting q/k.
"""

from __future__ import annotations

import math

import torch

from . import native
from .config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _yarn(cfg: ModelConfig, s: dict, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, blend with a linear ramp."""
    factor = s.get("factor") or cfg.max_position_embeddings / s["original_max_position_embeddings"]
    orig = s["original_max_position_embeddings"]
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = cfg.rope_theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolate = 1 - ramp  # 1 → keep the original frequency, 0 → interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _llama3(cfg: ModelConfig, s: dict, dim: int) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by `factor`, keep short ones, smooth in between."""
    inv_freq = _base_inv_freq(cfg.rope_theta, dim)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Computes (cos, sin) for given positions. Dynamic-NTK recomputes its base from the positions seen.

    local: the RoPE of Gemma 3's sliding (local) layers, base `cfg.rope_local_theta` and never
    scaled; the global layers' is the default one (rope_theta, rope_scaling).

    The frequencies are computed on the CPU even inside a `torch.device("meta")` block (the loader's
    skeleton): arithmetic on meta tensors imports torch._dynamo first, 0.8 s of every start-up."""

    def __init__(self, cfg: ModelConfig, local: bool = False):
        super().__init__()
        self.cfg = cfg
        self.dim = cfg.head_dim
        theta = cfg.rope_local_theta if local else cfg.rope_theta
        s = {} if local else cfg.rope_scaling or {}
        self.rope_type = s.get("rope_type", "default")
        self.attention_scaling = 1.0
        if self.rope_type == "linear":
            inv_freq = _base_inv_freq(theta, self.dim) / s["factor"]
        elif self.rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn(cfg, s, self.dim)
        elif self.rope_type == "llama3":
            inv_freq = _llama3(cfg, s, self.dim)
        else:  # default and dynamic (dynamic equals default inside the trained context)
            inv_freq = _base_inv_freq(theta, self.dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """Dynamic NTK: grow the base once the sequence passes the trained context length."""
        max_pos = self.cfg.max_position_embeddings
        if seq_len <= max_pos:
            return self.inv_freq
        factor = self.cfg.rope_scaling["factor"]
        base = self.cfg.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (self.dim / (self.dim - 2))
        return _base_inv_freq(base, self.dim).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int → cos, signed sin (B, T, 1, head_dim), ready for `apply_rotary`.

        The sin's first half is negated so the rotation needs a `roll`, not a slice-negate-concat.
        """
        inv_freq = self.inv_freq
        if self.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(int(positions.max()) + 1)
        freqs = positions.float()[..., None] * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        sin, cos = emb.sin(), emb.cos()
        if self.attention_scaling != 1.0:  # × 1.0 is exact: skipped, like the no-op casts below (fewer ops a step)
            sin, cos = sin * self.attention_scaling, cos * self.attention_scaling
        sin[..., : self.dim // 2].neg_()
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by the position's angle (HF's "rotate half" layout).

    x (B, T, H, D). (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), written as x·cos + roll(x)·signed_sin.
    At inference on CPUs that take the native kernels, one call does the four operators.
    """
    if (x.dim() == 4 and x.shape[-1] % 16 == 0 and x.stride(3) == 1 and x.stride(2) == x.shape[3]
            and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))
            and cos.shape == signed_sin.shape == (*x.shape[:2], 1, x.shape[3]) and cos.is_contiguous()
            and signed_sin.is_contiguous() and cos.dtype == signed_sin.dtype == torch.float32
            and native.takes(x, cos, signed_sin, contiguous=False)):
        return native.rotary(x, cos, signed_sin)  # one call for the four operators below
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
