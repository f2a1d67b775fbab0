"""GPTQ (Frantar et al., 2022): int4 weights that minimise each linear's output error on calibration data.

Round-to-nearest (RTN, `Int4Linear.from_float`) rounds every weight on its own. GPTQ rounds the
columns of W (out × in) one at a time and, after rounding column j, moves the rounding error onto
the columns not yet rounded so that the layer's output XWᵀ on the calibration inputs X changes as
little as possible. With H = 2XᵀX (the Hessian of ‖XWᵀ − XŴᵀ‖², the same for every row), the
optimal update after rounding w_j to q_j is

    W[:, j+1:] −= (w_j − q_j) / [H⁻¹]_jj · [H⁻¹]_j,j+1:

and the rows of the upper Cholesky factor of H⁻¹ give these coefficients for every step at once.
Details, as in the paper: H is dampened by `percdamp` × mean(diag H) so it is safely invertible;
updates inside a block of `block_size` columns are applied column by column and to the rest of
the matrix once per block ("lazy batch"); act_order rounds columns in order of decreasing diag H
(the inputs with the most energy first).

The output is the RTN layout exactly: group-wise asymmetric int4, one (s, z) per group of
`group_size` input columns, w = (q − 8)·s + z, so `Int4Linear` runs it unchanged. A group's grid
is the min/max grid of its columns as they are when GPTQ reaches the group (the errors of earlier
columns already added), or, with act_order, the grid of the original weights (the columns of a
group are then not rounded together). With H = I no error moves and GPTQ is RTN.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .calibrate import LinearStats, sequential_calibration
from .quant import Int4Linear, _check_compute_dtype, _check_group_size, _replace, int4_minmax_grid, int4_round
from .transformer import Transformer


@torch.no_grad()
def gptq_quantize_weight(weight: torch.Tensor, xtx: torch.Tensor, group_size: int = 32, *, percdamp: float = 0.01,
                         block_size: int = 128, act_order: bool = False,
                         compute_dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (out, in) weight with its inputs' XᵀX (in, in) → (codes (out, padded_in) uint8, scales and
    zeros (out, padded_in / group_size) in the compute dtype), `Int4Linear.from_codes`' arguments.
    in_features not divisible by group_size are zero-padded, as RTN pads them."""
    _check_group_size(group_size)
    if not 0 <= percdamp:
        raise ValueError(f"percdamp must be >= 0 (the paper uses 0.01), got {percdamp}")
    out_f, in_f = weight.shape
    padded = -(-in_f // group_size) * group_size
    w = F.pad(weight.detach().float(), (0, padded - in_f))
    h = F.pad(xtx.detach().float(), (0, padded - in_f, 0, padded - in_f))
    dead = h.diagonal() == 0  # inputs that were always zero (and the padding): their weights never matter
    h[dead, dead] = 1
    w[:, dead] = 0
    groups = padded // group_size
    scales = torch.empty(out_f, groups, dtype=compute_dtype)
    zeros = torch.empty(out_f, groups, dtype=compute_dtype)
    order = torch.arange(padded)
    if act_order:  # static groups: every grid from the original weights, before any column moves
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        scales[:], zeros[:] = int4_minmax_grid(w.view(out_f, groups, group_size), compute_dtype)
        w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(percdamp * h.diagonal().mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.empty(out_f, padded, dtype=torch.uint8)
    # a group never straddles two blocks, so its grid is taken from fully updated columns
    block_size = -(-max(block_size, group_size) // group_size) * group_size
    for b0 in range(0, padded, block_size):
        b1 = min(b0 + block_size, padded)
        wb, hb = w[:, b0:b1].clone(), hinv[b0:b1, b0:b1]
        err = torch.empty_like(wb)
        for i in range(b1 - b0):
            col = int(order[b0 + i])
            g = col // group_size
            if not act_order and col % group_size == 0:
                scales[:, g], zeros[:, g] = int4_minmax_grid(wb[:, i:i + group_size], compute_dtype)
            s, z = scales[:, g].float(), zeros[:, g].float()
            q = int4_round(wb[:, i], s, z)
            codes[:, col] = q
            err[:, i] = (wb[:, i] - ((q.float() - 8) * s + z)) / hb[i, i]
            wb[:, i + 1:].addr_(err[:, i], hb[i, i + 1:], alpha=-1)
        w[:, b1:].addmm_(err, hinv[b0:b1, b1:], alpha=-1)
    return codes, scales, zeros


def quantize_gptq(model: Transformer, calibration_ids: torch.Tensor, *, group_size: int = 32, percdamp: float = 0.01,
                  block_size: int = 128, act_order: bool = False, quantize_lm_head: bool = True,
                  compute_dtype: torch.dtype = torch.bfloat16, batch_size: int = 8) -> Transformer:
    """Replace the linears of `model` in place with GPTQ-rounded `Int4Linear`s; returns `model`.

    calibration_ids: (N, T) token ids (`calibrate.calibration_ids`); blocks are quantized in order,
    each on the inputs the already-quantized blocks produce (`calibrate.sequential_calibration`).
    Layers whose out_features is not a multiple of 16 (an int4 kernel requirement) stay float, as
    `quantize_model` keeps them; a mixture of experts' routers stay float.
    """
    _check_group_size(group_size)
    _check_compute_dtype(compute_dtype)
    kept: list[str] = []

    def step(scope: nn.Module, stats: dict[str, LinearStats]) -> None:
        for name, st in stats.items():
            linear = scope.get_submodule(name)
            if linear.out_features % 16:
                kept.append(name)
                continue
            codes, s, z = gptq_quantize_weight(linear.weight, st.mean_xtx, group_size, percdamp=percdamp,
                                               block_size=block_size, act_order=act_order,
                                               compute_dtype=compute_dtype)
            bias = None if linear.bias is None else linear.bias.detach()
            q = Int4Linear.from_codes(codes, s, z, group_size, bias, in_features=linear.in_features)
            q.source = "gptq"
            _replace(scope, name, q)

    sequential_calibration(model, calibration_ids, step, batch_size=batch_size, quantize_lm_head=quantize_lm_head)
    if kept:
        warnings.warn(f"int4 needs out_features divisible by 16; kept in float: {', '.join(sorted(set(kept)))}",
                      stacklevel=2)
    return model
