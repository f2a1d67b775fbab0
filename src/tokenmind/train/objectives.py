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
from tokenmind.model.transformer import router_aux_loss


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
    """bf16 autocast for matmuls (weights stay fp32) or a no-op for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def token_loss(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor,
               positions: torch.Tensor, precision: str) -> torch.Tensor:
    """Cross-entropy of `targets` given `input_ids`, summed over the targets that are not
    IGNORE_INDEX, attention kept within each packed document; all (B, T). The logits are upcast
    so the softmax and loss are computed in fp32."""
    with autocast(input_ids.device, precision):
        logits = model(input_ids, positions, DenseAttentionMetadata(document_ids=document_ids))
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class NextTokenObjective:
    """Next-token prediction on `TokenBatch`es, for pre-training and SFT alike: the units are
    the targets that are not IGNORE_INDEX (every token of a packed pre-training row; only the
    assistant's tokens of a chat)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor] = token_loss) -> None:
        self.loss_fn = loss_fn  # token_loss, or it compiled

    def __call__(self, model: nn.Module, batch: TokenBatch, precision: str) -> LossTerms:
        loss = self.loss_fn(model, batch.input_ids, batch.targets, batch.document_ids, batch.positions, precision)
        count = (batch.targets != IGNORE_INDEX).sum()
        aux = router_aux_loss(model)  # a mixture of experts' load balancing, a per-token mean: weighed by count
        if aux is None:
            return LossTerms(loss, count)
        return LossTerms(loss + aux * count, count, {"router_aux": aux.detach() * count})

    def compiled(self) -> NextTokenObjective:
        return NextTokenObjective(torch.compile(token_loss))
