"""AWQ (Lin et al., 2023): activation-aware scaling of input channels before round-to-nearest int4.

A few input channels of a linear carry much larger activations than the rest, and the weights
that multiply them matter most for the output. Scaling input channel c of W up by s_c (and its
input down by the same s_c) leaves the float layer unchanged, XWᵀ = (X/s)(W·s)ᵀ, but shrinks the
relative rounding error of those weights once W·s is rounded. AWQ picks

    s = m^α / sqrt(max(m^α) · min(m^α)),   m_c = mean |x_c| over the calibration tokens,

with α on a grid in [0, 1) that minimises the layer's output error ‖X Wᵀ − (X/s) Q(W·s)ᵀ‖²
(computed from XᵀX, `calibrate.LinearStats`); α = 0 is s = 1, plain RTN, so the search never ends
worse than RTN on the calibration data. 1/s is then folded into the op that produces X, so no
extra op runs at inference:

    qkv_proj     ← input_layernorm (its weight / s; the fused q, k and v share one s, as they share X)
    gate_up_proj ← post_attention_layernorm (pre_feedforward_layernorm in a Gemma sandwich block)
    o_proj       ← the v rows of qkv_proj (attention mixes v over positions, linearly); with grouped
                   query heads one kv channel feeds the same channel of every head in its group, so
                   those share one s (their mean |x| is averaged)
    down_proj    ← the up rows of gate_up_proj (act(gate) · up is linear in up)
    lm_head      ← the final norm (a tied head gets its own scaled copy; the embedding is untouched)

o_proj and down_proj are searched first, because their folds change the rows of qkv_proj and
gate_up_proj, which are searched (and all four rounded, with RTN) after. Linears with no rule
(latent attention, a mixture of experts' shared experts) are rounded with plain RTN.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .calibrate import LinearStats, sequential_calibration
from .quant import Int4Linear, _check_compute_dtype, _check_group_size, _replace, int4_minmax_grid, int4_round
from .transformer import MLP, Attention, RMSNorm, SandwichBlock, Transformer


def fake_quantize_int4(w: torch.Tensor, group_size: int, compute_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight RTN int4 (`Int4Linear.from_float`) would run, as float32: quantize and dequantize."""
    out_f, in_f = w.shape
    padded = -(-in_f // group_size) * group_size
    groups = F.pad(w.float(), (0, padded - in_f)).view(out_f, padded // group_size, group_size)
    s, z = int4_minmax_grid(groups, compute_dtype)
    s, z = s.float()[..., None], z.float()[..., None]
    return ((int4_round(groups, s, z).float() - 8) * s + z).view(out_f, padded)[:, :in_f]


def output_error(weight: torch.Tensor, effective: torch.Tensor, xtx: torch.Tensor) -> float:
    """Mean squared output error per token, tr(ΔW · XᵀX/n · ΔWᵀ), of running `effective` instead of `weight`."""
    d = weight.float() - effective
    return float(((d @ xtx) * d).sum())


@torch.no_grad()
def awq_search_scales(weight: torch.Tensor, stats: LinearStats, group_size: int = 32, *, grid: int = 20,
                      compute_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, float]:
    """The per-input-channel scales s (in,) with the smallest output error after RTN of W·s, and their α
    (tried: 0, 1/grid, ..., (grid − 1)/grid)."""
    if grid < 1:
        raise ValueError(f"grid must be >= 1 (the number of α values tried in [0, 1)), got {grid}")
    xtx, m = stats.mean_xtx, stats.mean_abs.clamp(min=1e-8)
    best = (float("inf"), torch.ones_like(m), 0.0)
    for k in range(grid):
        alpha = k / grid
        s = m.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(weight, fake_quantize_int4(weight.float() * s, group_size, compute_dtype) / s, xtx)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _fold_into_norm(norm: RMSNorm, s: torch.Tensor) -> None:
    """The norm's output / s: its weight / s (or, for a norm that scales by 1 + w, (1 + w) / s − 1)."""
    w = norm.weight.data
    w.copy_((1 + w.float()) / s - 1 if norm.unit_offset else w.float() / s)


def _fold_into_rows(linear: nn.Linear, rows: slice, s: torch.Tensor) -> None:
    """Output channels `rows` of `linear` / s."""
    linear.weight.data[rows] /= s[:, None].to(linear.weight.dtype)
    if linear.bias is not None:
        linear.bias.data[rows] /= s.to(linear.bias.dtype)


def _scale_columns(scope: nn.Module, name: str, s: torch.Tensor) -> None:
    """Input channels of the linear `name` × s; a weight shared with another module (a tied LM head)
    is copied first so the other keeps its values."""
    linear = scope.get_submodule(name)
    shared = any(p is linear.weight for m in scope.modules() if m is not linear for p in m.parameters(recurse=False))
    if shared:
        linear.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
    linear.weight.data *= s.to(linear.weight.dtype)


def fold_scales(scope: nn.Module, name: str, s: torch.Tensor) -> None:
    """Apply AWQ scales s to linear `name` of `scope` (a decoder block, or the model for "lm_head"):
    its input channels × s and the op producing its input / s, so the float model is unchanged."""
    if name == "lm_head":
        _fold_into_norm(scope.norm, s)
    elif name == "self_attn.qkv_proj":
        _fold_into_norm(scope.input_layernorm, s)
    elif name == "mlp.gate_up_proj":
        _fold_into_norm(scope.pre_feedforward_layernorm if isinstance(scope, SandwichBlock)
                        else scope.post_attention_layernorm, s)
    elif name == "self_attn.o_proj":
        attn = scope.self_attn
        q, kv, d = attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim, attn.head_dim
        s_kv = s.view(attn.n_kv, attn.n_heads // attn.n_kv, d)[:, 0].reshape(kv)
        if not torch.equal(s, s_kv.view(attn.n_kv, 1, d).expand(-1, attn.n_heads // attn.n_kv, -1).reshape(q)):
            raise ValueError("o_proj scales must be equal across the query heads that share a kv head")
        _fold_into_rows(attn.qkv_proj, slice(q + kv, q + 2 * kv), s_kv)
    elif name == "mlp.down_proj":
        f = scope.mlp.down_proj.in_features
        _fold_into_rows(scope.mlp.gate_up_proj, slice(f, 2 * f), s)
    else:
        raise ValueError(f"AWQ has no op to fold the scales of {name!r} into")
    _scale_columns(scope, name, s)


def _gqa_shared(stats: LinearStats, attn: Attention) -> LinearStats:
    """o_proj's stats with mean |x| averaged over the query heads of each kv group (one scale per kv channel)."""
    n_rep, d = attn.n_heads // attn.n_kv, attn.head_dim
    m = stats.abs_sum.view(attn.n_kv, n_rep, d).mean(dim=1, keepdim=True).expand(-1, n_rep, -1).reshape(-1)
    return LinearStats(stats.xtx, m.contiguous(), stats.rows)


def _rules(scope: nn.Module) -> list[str]:
    """The linears of `scope` that AWQ scales, in search order (see the module docstring)."""
    if isinstance(scope, Transformer):
        return ["lm_head"]
    names = []
    attn = getattr(scope, "self_attn", None)
    if isinstance(attn, Attention):  # clipped q/k/v (OLMo's clip_qkv) are not linear in v: o_proj keeps s = 1
        names = ["self_attn.qkv_proj"] if attn.clip_qkv is not None else ["self_attn.o_proj", "self_attn.qkv_proj"]
    if isinstance(getattr(scope, "mlp", None), MLP):
        names = ["mlp.down_proj"] + names + ["mlp.gate_up_proj"]
    return names


def quantize_awq(model: Transformer, calibration_ids: torch.Tensor, *, group_size: int = 32, grid: int = 20,
                 quantize_lm_head: bool = True, compute_dtype: torch.dtype = torch.bfloat16,
                 batch_size: int = 8) -> Transformer:
    """Scale (AWQ) then round to nearest the linears of `model`, in place, as `Int4Linear`s; returns `model`.

    calibration_ids: (N, T) token ids (`calibrate.calibration_ids`); blocks go in order, each on
    the inputs of the already-quantized blocks (`calibrate.sequential_calibration`). The float
    norms and v/up rows change (they carry 1/s). Layers whose out_features is not a multiple of 16
    stay float (unscaled), as `quantize_model` keeps them; a mixture of experts' routers stay float.
    """
    _check_group_size(group_size)
    _check_compute_dtype(compute_dtype)
    kept: list[str] = []

    def step(scope: nn.Module, stats: dict[str, LinearStats]) -> None:
        for name in _rules(scope):
            linear = scope.get_submodule(name)
            if name not in stats or linear.out_features % 16:
                continue
            st = _gqa_shared(stats[name], scope.self_attn) if name == "self_attn.o_proj" else stats[name]
            s, _alpha = awq_search_scales(linear.weight, st, group_size, grid=grid, compute_dtype=compute_dtype)
            fold_scales(scope, name, s)
        for name in stats:
            linear = scope.get_submodule(name)
            if linear.out_features % 16:
                kept.append(name)
                continue
            bias = None if linear.bias is None else linear.bias.detach()
            q = Int4Linear.from_float(linear.weight, bias, group_size=group_size, compute_dtype=compute_dtype)
            q.source = "awq"
            _replace(scope, name, q)

    sequential_calibration(model, calibration_ids, step, batch_size=batch_size, quantize_lm_head=quantize_lm_head)
    if kept:
        warnings.warn(f"int4 needs out_features divisible by 16; kept in float: {', '.join(sorted(set(kept)))}",
                      stacklevel=2)
    return model
