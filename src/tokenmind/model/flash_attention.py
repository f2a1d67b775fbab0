"""FlashAttention as a PyTorch tiling: exact attention in memory linear in the sequence length.

Plain attention materialises the (T, S) score matrix softmax(q·kᵀ)·v per head — memory that
grows with T·S. FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023) never does: it
walks over (block_q, block_k) tiles of the scores and keeps, per query row, a running max m,
a running sum l of exp(score − m) and an unnormalised output accumulator. When a new key tile
raises the max to m', the old sum and accumulator are rescaled by exp(m − m') (the *online
softmax*, Milakov & Gimelshein 2018), so after the last tile acc / l is the exact softmax·v.
Only one tile of scores lives at a time, and only m + log l (the log-sum-exp, one number per
row) is kept for the backward.

The backward recomputes each tile's probabilities from the saved log-sum-exp instead of storing
them (FlashAttention-2's algorithm): with D = rowsum(dO ∘ O), dP = dO·vᵀ and dS = P ∘ (dP − D),
dv += Pᵀ·dO, dq += dS·k·scale, dk += dSᵀ·q·scale, tile by tile. So the backward is memory-linear
too, at the price of computing the scores twice — no autograd graph is kept through the loop.

Causal attention skips the tiles wholly above the diagonal (about half of them) and masks only
the tiles that cross it. GQA needs no copies of k and v: the H query heads are viewed as
(H_kv, H / H_kv) and each key/value head broadcasts over its group. The tile loop is Python; its
per-tile work (`_forward_tile`, `_backward_tile`) is what `compile=True` hands to torch.compile,
which fuses the masking, exponentials and rescaling of a tile into few kernels (tiles of the same
shape reuse one compiled graph).

On a CPU this is slower than `F.scaled_dot_product_attention`, whose own fused flash kernel is
written in C++ with the same idea; see docs/architecture.md for the measured numbers. It is the
algorithm, tested against SDPA, with its memory shown linear by `benchmarks/bench_flash_attention.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch



def _tiles(T: int, S: int, block_q: int, block_k: int, causal: bool) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """For each query block, the key blocks it sees. Causal: queries are the last T of S positions
    (query i sits at S − T + i), so a key block starting past the block's last query is skipped."""
    out = []
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        k_end = min(S, q1 + S - T) if causal else S
        out.append((q0, q1, [(k0, min(k0 + block_k, k_end)) for k0 in range(0, k_end, block_k)]))
    return out


def _causal_bias(q0: int, q1: int, k0: int, k1: int, offset: int, device: torch.device) -> torch.Tensor | None:
    """0 where query (at offset + row) may see the key, −inf where not; None for a tile wholly below the diagonal."""
    if k1 - 1 <= q0 + offset:
        return None
    rows = torch.arange(q0, q1, device=device)[:, None] + offset
    cols = torch.arange(k0, k1, device=device)[None, :]
    return torch.zeros(q1 - q0, k1 - k0, device=device).masked_fill(cols > rows, float("-inf"))


def _forward_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, m: torch.Tensor,
                  total: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax update. q (…, bq, D) already scaled, k/v (…, bk, D); the running max m and
    sum `total` (…, bq); acc (…, bq, D)."""
    s = q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new[..., None])
    rescale = torch.exp(m - m_new)
    return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + p @ v


def _backward_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
                   d_out: torch.Tensor, delta: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's (dq, dk, dv) contributions from the recomputed probabilities; q unscaled, shapes as
    `_forward_tile`, with the query group axis (…, G, bq, D) summed out of dk and dv."""
    s = (q * scale) @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    p = torch.exp(s - lse[..., None])
    dv = (p.transpose(-1, -2) @ d_out).sum(-3, keepdim=True)
    ds = p * (d_out @ v.transpose(-1, -2) - delta[..., None])
    dq = (ds @ k) * scale
    dk = (ds.transpose(-1, -2) @ q).sum(-3, keepdim=True) * scale
    return dq, dk, dv


_COMPILED: dict[str, Callable] = {}


def _tile_fns(compile: bool) -> tuple[Callable, Callable]:
    if not compile:
        return _forward_tile, _backward_tile
    if not _COMPILED:  # one compiled graph per tile shape, shared by every call
        _COMPILED["forward"] = torch.compile(_forward_tile, dynamic=False)
        _COMPILED["backward"] = torch.compile(_backward_tile, dynamic=False)
    return _COMPILED["forward"], _COMPILED["backward"]


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                block_q: int, block_k: int, compile: bool) -> torch.Tensor:
        B, H, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        forward_tile, _ = _tile_fns(compile)
        qg = q.view(B, H_kv, H // H_kv, T, D).float()  # (B, H_kv, G, T, D)
        kg, vg = k[:, :, None].float(), v[:, :, None].float()  # (B, H_kv, 1, S, D): broadcast over the group
        out = torch.empty(B, H_kv, H // H_kv, T, v.shape[-1], device=q.device)
        lse = torch.empty(B, H_kv, H // H_kv, T, device=q.device)
        for q0, q1, keys in _tiles(T, S, block_q, block_k, causal):
            qt = qg[..., q0:q1, :] * scale
            m = torch.full(qt.shape[:-1], float("-inf"), device=q.device)
            total = torch.zeros_like(m)
            acc = torch.zeros(*qt.shape[:-1], v.shape[-1], device=q.device)
            for k0, k1 in keys:
                bias = _causal_bias(q0, q1, k0, k1, S - T, q.device) if causal else None
                m, total, acc = forward_tile(qt, kg[..., k0:k1, :], vg[..., k0:k1, :], bias, m, total, acc)
            out[..., q0:q1, :] = acc / total[..., None]
            lse[..., q0:q1] = m + torch.log(total)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.block_q, ctx.block_k, ctx.compile = causal, scale, block_q, block_k, compile
        return out.view(B, H, T, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        _, backward_tile = _tile_fns(ctx.compile)
        qg = q.view(B, H_kv, H // H_kv, T, D).float()
        kg, vg = k[:, :, None].float(), v[:, :, None].float()
        d_out = grad.reshape(out.shape).float()
        delta = (d_out * out).sum(-1)  # D = rowsum(dO ∘ O) = Σ_j P_ij dP_ij
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
        for q0, q1, keys in _tiles(T, S, ctx.block_q, ctx.block_k, ctx.causal):
            rows = slice(q0, q1)
            for k0, k1 in keys:
                bias = _causal_bias(q0, q1, k0, k1, S - T, q.device) if ctx.causal else None
                dq_t, dk_t, dv_t = backward_tile(qg[..., rows, :], kg[..., k0:k1, :], vg[..., k0:k1, :], bias,
                                                 lse[..., rows], d_out[..., rows, :], delta[..., rows], ctx.scale)
                dq[..., rows, :] += dq_t
                dk[..., k0:k1, :] += dk_t
                dv[..., k0:k1, :] += dv_t
        return (dq.view(q.shape).to(q.dtype), dk[:, :, 0].to(k.dtype), dv[:, :, 0].to(v.dtype),
                None, None, None, None, None)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
                    block_q: int = 64, block_k: int = 64, compile: bool = False) -> torch.Tensor:
    """softmax(q·kᵀ·scale [causal]) · v for q (B, H, T, D) over k/v (B, H_kv, S, D), H a multiple of
    H_kv (GQA), in (block_q, block_k) tiles; → (B, H, T, D_v) in q's dtype, computed in fp32.
    With `causal` the queries are the last T of the S positions (T == S: plain causal attention)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    if causal and k.shape[2] < q.shape[2]:
        raise ValueError(f"causal attention of {q.shape[2]} queries needs at least as many keys, got {k.shape[2]}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"tile sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _FlashAttention.apply(q, k, v, causal, scale, block_q, block_k, compile)
