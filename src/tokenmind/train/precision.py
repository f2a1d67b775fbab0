"""Dynamic loss scaling for fp16 training.

fp16 keeps 10 mantissa bits but only 5 exponent bits: values below ~6e-8 flush to zero, above
65504 overflow to inf. Activation gradients of a language model sit largely below that floor,
so fp16 autocast alone loses them. Loss scaling (Micikevicius et al. 2018, "Mixed Precision
Training") multiplies the loss by S before backward — every gradient is then S times larger
and lands in fp16's range — and divides the fp32 parameter gradients by S before clipping and
the optimizer step. S is chosen dynamically: as large as possible without overflow.

* A step whose gradients hold inf/NaN overflowed: the optimizer step is skipped (the weights
  and optimizer state stay as they were) and S halves.
* After `growth_interval` clean steps in a row S doubles, probing for a larger scale again.

`torch.amp.GradScaler("cpu")` implements the same policy and runs on CPU in torch 2.13, but it
decides overflow from the gradients each rank holds; under FSDP (and expert parallelism) ranks
hold different shards, could disagree and step differently. The trainer already reduces one
global gradient norm across ranks for clipping; `LossScaler` decides from that number, so every
rank skips or steps together, and the unscaling folds into the trainer's one division of the
gradients by the batch's unit count. Its state is three numbers, saved in checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class LossScaler:
    """S, and the count of clean steps since S last changed. init_scale: S at the first step;
    growth_interval: clean steps before S doubles."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"loss scale must be a finite number > 0, got {init_scale}")
        if growth_interval < 1:
            raise ValueError(f"loss-scale growth interval must be >= 1, got {growth_interval}")
        self.scale, self.growth_interval = float(init_scale), growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: every gradient comes out S times larger."""
        return loss * self.scale

    def update(self, grad_norm: float) -> bool:
        """After the unscaled gradients' global norm is known: True if the step must be skipped
        (inf/NaN norm: S halves), else False (S doubles after growth_interval clean steps)."""
        if not math.isfinite(grad_norm):
            self.scale /= 2
            self.clean_steps = 0
            self.skipped_steps += 1
            return True
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean_steps, self.skipped_steps = state["scale"], state["clean_steps"], state["skipped_steps"]
