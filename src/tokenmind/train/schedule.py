"""Learning-rate schedules as multipliers of each parameter group's base lr.

`lr_multiplier(cfg, total_steps, step)` is a pure function of the step, so the schedule needs no
state of its own beyond the step counter, and the same function serves training, tests and
plots. The convention: the multiplier for step s (0-based) is the value after s + 1 steps of
progress, so warmup's first step already trains (1/W, not 0), the last warmup step is exactly
1, and the last training step (s = total_steps - 1) lands exactly on min_lr_ratio.

`build_scheduler` wraps it in `torch.optim.lr_scheduler.LambdaLR` because that is the object the
PyTorch ecosystem checkpoints; we pass a plain function, so LambdaLR saves only its counters
(`last_epoch`, `base_lrs`), never the schedule parameters — those come from the config.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from .config import ScheduleSection


def warmup_multiplier(step: int, warmup_steps: int) -> float:
    """Linear ramp (step + 1) / warmup_steps, then 1."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def cosine_multiplier(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Warmup, then half a cosine from 1 down to min_lr_ratio at the last step."""
    if step < warmup_steps:
        return warmup_multiplier(step, warmup_steps)
    span = total_steps - warmup_steps
    progress = min(1.0, (step + 1 - warmup_steps) / span) if span > 0 else 1.0
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_multiplier(step: int, total_steps: int, warmup_steps: int, decay_fraction: float,
                   min_lr_ratio: float) -> float:
    """Warmup, a stable plateau at 1, then a linear decay to min_lr_ratio over the last
    round(decay_fraction × total_steps) steps (Hu et al. 2024, MiniCPM; Hägele et al. 2024)."""
    decay_steps = max(1, round(decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < warmup_steps:
        return warmup_multiplier(step, warmup_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step + 1 - decay_start) / decay_steps)
    return 1.0 - (1.0 - min_lr_ratio) * progress


def lr_multiplier(cfg: ScheduleSection, total_steps: int, step: int) -> float:
    """The configured schedule's multiplier for optimizer step `step` (0-based)."""
    if cfg.name == "cosine":
        return cosine_multiplier(step, total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    if cfg.name == "wsd":
        return wsd_multiplier(step, total_steps, cfg.warmup_steps, cfg.decay_fraction, cfg.min_lr_ratio)
    return warmup_multiplier(step, cfg.warmup_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleSection, total_steps: int) -> LambdaLR:
    """A LambdaLR that sets every group's lr to base lr × `lr_multiplier` (call `.step()` after
    each optimizer step)."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(cfg, total_steps, step))
