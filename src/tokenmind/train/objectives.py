"""Training objectives: what one batch's loss is, apart from how the `Trainer` steps on it.

An objective is called as `objective(model, batch, precision) -> LossTerms` and returns the
loss *summed* over the batch's units (trained target tokens for next-token prediction; pairs
for a preference loss; rollout tokens for RL), how many units that sum covers, and optional
extra metrics, also summed over those units. The trainer adds the terms of every micro-batch
on every rank and divides by the global unit count, so each unit weighs the same however the
units spread over micro-batches and ranks, and it logs each metric's per-unit mean next to
the loss. An objective returning a mean instead would weigh a unit in a sparse micro-batch
more than one in a full micro-batch.

The trainer only moves a batch to its device (`batch.to(device)`) and hands it over, so an
objective brings its own batch type (`TokenBatch` here; chosen/rejected pairs or rollouts with
advantages for later ones) and the loaders that yield it. Objectives hold no training state:
a resumed run rebuilds them from code.

Each objective keeps its math in a pure function of tensors (`token_loss` here), testable
alone, and `compiled()` returns the objective with that function under `torch.compile`, which
the trainer uses for training steps when `train.compile` is set: the model call and the loss in
one graph, so the fp32 upcast, log-softmax and target gather over the vocabulary fuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmind.data.loader import IGNORE_INDEX, TokenBatch
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.transformer import MTPLayer, Transformer, mtp_chain_valid, router_aux_loss

from .losses import linear_cross_entropy


@dataclass
class LossTerms:
    """One batch's contribution to a step.

    loss: scalar tensor, the loss summed over the batch's units (the trainer backpropagates it).
    count: how many units `loss` sums over (a tensor or an int).
    metrics: extra scalars by name, each summed over the same units; logged as per-unit means.
    """

    loss: torch.Tensor
    count: torch.Tensor | int
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def detach(self) -> LossTerms:
        """The same numbers, cut from the autograd graph (for accumulating what is logged)."""
        return LossTerms(self.loss.detach(), self.count, {k: v.detach() for k, v in self.metrics.items()})

    def __add__(self, other: LossTerms) -> LossTerms:
        """The terms of both batches together: every sum adds."""
        return LossTerms(self.loss + other.loss, self.count + other.count,
                         {k: v + other.metrics[k] for k, v in self.metrics.items()})


class Objective(Protocol):
    """What the `Trainer` minimizes; see the module docstring."""

    def __call__(self, model: nn.Module, batch: Any, precision: str) -> LossTerms:
        """The summed loss of `batch` (already on the model's device) under `precision`."""
        ...

    def compiled(self) -> Objective:
        """This objective with its tensor function under `torch.compile` (for train.compile)."""
        ...


def autocast(device: torch.device, precision: str):
    """Autocast for matmuls (weights stay fp32): bf16, fp16, or bf16 around fp8's FP8 projections
    (`model/fp8.py`); a no-op for fp32."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")


def fuses_output_layer(model: nn.Module) -> bool:
    """Whether `token_loss` computes the loss through the output layer chunk by chunk
    (`losses.linear_cross_entropy`): for a plain `Transformer` with a plain `nn.Linear` head. A
    wrapped model (DDP, FSDP, a pipeline stage) or a replaced head (FP8) must run its own forward."""
    return type(model) is Transformer and type(model.lm_head) is nn.Linear and model.lm_head.bias is None


def token_loss(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor | None,
               positions: torch.Tensor, precision: str, mtp: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-entropy of `targets` given `input_ids`, summed over the targets that are not
    IGNORE_INDEX, attention kept within each packed document; all (B, T). The logits are upcast
    so the softmax and loss are computed in fp32; a plain `Transformer`'s are never held whole
    (`fuses_output_layer`), and none at ignored positions. With `mtp`, also the model's multi-token
    prediction loss (`mtp_loss`, summed too); else None."""
    attn, depths = DenseAttentionMetadata(document_ids=document_ids), None
    with autocast(input_ids.device, precision):
        if not mtp and fuses_output_layer(model):
            hidden = model.hidden_states(input_ids, positions, attn)
            return linear_cross_entropy(hidden, model.lm_head.weight, targets, IGNORE_INDEX,
                                        model.cfg.final_logit_softcapping), None
        if mtp:
            logits, depths = model(input_ids, positions, attn, mtp=True)
        else:
            logits = model(input_ids, positions, attn)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, None if depths is None else mtp_loss(depths, targets, document_ids)


def mtp_loss(depth_logits: list[torch.Tensor], targets: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's multi-token prediction loss before its weight λ, summed like the main loss:
    (1/D) Σ_k of depth k's cross-entropy summed over the positions it is trained at. Divided by
    the number of trained tokens (the trainer divides every sum by it) this is the paper's
    (1/D) Σ_k CE_k with CE_k = (1/T) Σ_i −log P_k, and it weighs every token the same however the
    tokens spread over micro-batches and ranks.

    Depth k's logits at position p (`Transformer.forward(mtp=True)`) predict the same target as the
    main model there, token p + 1, from the main model's state at p - k. A position is trained when
    that chain stays in the row and document (`mtp_chain_valid`), its target is not IGNORE_INDEX,
    and the row does not show the target starting another document (the last position's next
    token lies outside the row, where the main loss trains it as well)."""
    same_doc_next = F.pad(document_ids[:, 1:] == document_ids[:, :-1], (0, 1), value=True)
    total = targets.new_zeros((), dtype=torch.float32)
    for k, logits in enumerate(depth_logits, 1):
        keep = mtp_chain_valid(document_ids, targets.shape, k) & same_doc_next & (targets != IGNORE_INDEX)
        total = total + F.cross_entropy(logits.float().flatten(0, 1), targets.masked_fill(~keep, IGNORE_INDEX)
                                        .flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / len(depth_logits)


class NextTokenObjective:
    """Next-token prediction on `TokenBatch`es, for pre-training and SFT alike: the units are
    the targets that are not IGNORE_INDEX (every token of a packed pre-training row; only the
    assistant's tokens of a chat).

    In training two more terms join the loss, each logged as a metric: a mixture of experts'
    router loss ("router_aux", a per-token mean weighed by the unit count) and, for a model with
    multi-token prediction depths, their summed loss (`mtp_loss`) times cfg.mtp_loss_weight
    ("mtp", logged unweighted and in evaluation too, where the loss is the main model's alone)."""

    def __init__(self, loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = token_loss) -> None:
        self.loss_fn = loss_fn  # token_loss, or it compiled

    def __call__(self, model: nn.Module, batch: TokenBatch, precision: str) -> LossTerms:
        mtp_layers = [m for m in model.modules() if isinstance(m, MTPLayer)]
        docs = batch.document_ids
        if not mtp_layers and bool((docs == docs[:, :1]).all()):  # decided here, outside a compiled loss_fn,
            docs = None  # so one document per row runs SDPA's causal kernel instead of a (T, T) mask
        loss, mtp = self.loss_fn(model, batch.input_ids, batch.targets, docs, batch.positions, precision,
                                 bool(mtp_layers))
        count = (batch.targets != IGNORE_INDEX).sum()
        metrics = {}
        if mtp is not None:
            if mtp_layers[0].training:
                loss = loss + mtp_layers[0].loss_weight * mtp
            metrics["mtp"] = mtp.detach()
        aux = router_aux_loss(model)  # a mixture of experts' load balancing, a per-token mean: weighed by count
        if aux is not None:
            loss = loss + aux * count
            metrics["router_aux"] = aux.detach() * count
        return LossTerms(loss, count, metrics)

    def compiled(self) -> NextTokenObjective:
        return NextTokenObjective(torch.compile(token_loss))
