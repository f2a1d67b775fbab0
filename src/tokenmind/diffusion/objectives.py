"""Diffusion training objectives on the trainer's `Objective` seam (`tokenmind.train.objectives`).

Both regress the model output on a target with a mean squared error per image; the units the
trainer averages over are images, so the logged loss is the usual MSE.

* `DenoisingObjective` (DDPM, Ho et al. 2020): t uniform over the T training steps,
  x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε, target ε, x₀ or v by `prediction_type` (`NoiseSchedule.target`).
* `FlowMatchingObjective` (rectified flow, Liu et al. 2022; Lipman et al. 2022):
  x_t = (1−t)·x₀ + t·ε, target v = ε − x₀, with t uniform in [0, 1] or logit-normal
  (σ(N(m, s²)), Esser et al. 2024, which trains the middle times, the hard ones, more); the model is
  told t·T like the DDPM models, so both share one time embedding.

Classifier-free guidance (Ho & Salimans 2022) needs one model that is both conditional and not:
each label is replaced by the null class (`num_classes`) with probability cfg_dropout.

Timesteps, noise and dropout are drawn from a generator seeded with the batch's `noise_seed`, so
a batch's loss depends on nothing but the batch (exact resume; the same validation noise at each
evaluation). The model call and the loss are `regression_loss`, a pure function of tensors that
`compiled()` puts under `torch.compile`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmind.train.objectives import LossTerms, autocast

from .data import ImageBatch
from .schedules import PREDICTION_TYPES, NoiseSchedule, flow_interpolate, flow_velocity

T_SAMPLINGS = ("uniform", "logit_normal")


def regression_loss(model: nn.Module, x_t: torch.Tensor, t: torch.Tensor, labels: torch.Tensor,
                    target: torch.Tensor, precision: str) -> torch.Tensor:
    """Σ over images of the mean squared error between model(x_t, t, labels) and target (B, C, H, W),
    computed in fp32 whatever the forward's precision."""
    with autocast(x_t.device, precision):
        out = model(x_t, t, labels)
    return (out.float() - target.float()).square().flatten(1).mean(dim=1).sum()


def drop_labels(labels: torch.Tensor, num_classes: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """`labels` with each replaced by the null class `num_classes` with probability p."""
    if p == 0:
        return labels
    drop = torch.rand(labels.shape, generator=generator, device=labels.device) < p
    return labels.masked_fill(drop, num_classes)


class _ImageObjective:
    """What both objectives share: the batch's generator, label dropout and the loss call."""

    def __init__(self, num_classes: int, cfg_dropout: float, loss_fn: Callable[..., torch.Tensor]) -> None:
        if not 0 <= cfg_dropout < 1:
            raise ValueError(f"cfg_dropout must be in [0, 1) (the share of labels dropped to the null class), "
                             f"got {cfg_dropout}")
        self.num_classes, self.cfg_dropout, self.loss_fn = num_classes, cfg_dropout, loss_fn

    def inputs(self, batch: ImageBatch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_t, model time (B,), target) for the batch; drawn with `generator`."""
        raise NotImplementedError

    def __call__(self, model: nn.Module, batch: ImageBatch, precision: str) -> LossTerms:
        generator = torch.Generator(batch.images.device).manual_seed(batch.noise_seed)
        x_t, t, target = self.inputs(batch, generator)
        labels = drop_labels(batch.labels, self.num_classes, self.cfg_dropout, generator)
        return LossTerms(self.loss_fn(model, x_t, t, labels, target, precision), len(batch.labels))


class DenoisingObjective(_ImageObjective):
    """DDPM training (see the module docstring)."""

    def __init__(self, schedule: NoiseSchedule, prediction_type: str = "epsilon", *, num_classes: int,
                 cfg_dropout: float = 0.1, loss_fn: Callable[..., torch.Tensor] = regression_loss) -> None:
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type={prediction_type!r} is not one of {', '.join(PREDICTION_TYPES)}")
        super().__init__(num_classes, cfg_dropout, loss_fn)
        self.schedule, self.prediction_type = schedule, prediction_type

    def inputs(self, batch: ImageBatch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x0 = batch.images
        t = torch.randint(0, self.schedule.num_train_timesteps, (len(x0),), generator=generator, device=x0.device)
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        target = self.schedule.target(self.prediction_type, x0, noise, t)
        return self.schedule.add_noise(x0, noise, t), t.float(), target

    def compiled(self) -> DenoisingObjective:
        return DenoisingObjective(self.schedule, self.prediction_type, num_classes=self.num_classes,
                                  cfg_dropout=self.cfg_dropout, loss_fn=torch.compile(regression_loss))


class FlowMatchingObjective(_ImageObjective):
    """Rectified-flow training (see the module docstring); time_scale is what t ∈ [0, 1] is
    multiplied by for the model (the samplers use the same)."""

    def __init__(self, *, num_classes: int, cfg_dropout: float = 0.1, t_sampling: str = "uniform",
                 logit_mean: float = 0.0, logit_std: float = 1.0, time_scale: float = 1000.0,
                 loss_fn: Callable[..., torch.Tensor] = regression_loss) -> None:
        if t_sampling not in T_SAMPLINGS:
            raise ValueError(f"t_sampling={t_sampling!r} is not one of {', '.join(T_SAMPLINGS)}")
        if logit_std <= 0:
            raise ValueError(f"logit_std must be > 0, got {logit_std}")
        super().__init__(num_classes, cfg_dropout, loss_fn)
        self.t_sampling, self.logit_mean, self.logit_std = t_sampling, logit_mean, logit_std
        self.time_scale = time_scale

    def sample_t(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """n times in [0, 1]: uniform, or σ(m + s·z) with z ~ N(0, 1)."""
        if self.t_sampling == "uniform":
            return torch.rand(n, generator=generator, device=device)
        z = torch.randn(n, generator=generator, device=device)
        return torch.sigmoid(self.logit_mean + self.logit_std * z)

    def inputs(self, batch: ImageBatch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x0 = batch.images
        t = self.sample_t(len(x0), generator, x0.device)
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        return flow_interpolate(x0, noise, t), t * self.time_scale, flow_velocity(x0, noise)

    def compiled(self) -> FlowMatchingObjective:
        return FlowMatchingObjective(num_classes=self.num_classes, cfg_dropout=self.cfg_dropout,
                                     t_sampling=self.t_sampling, logit_mean=self.logit_mean,
                                     logit_std=self.logit_std, time_scale=self.time_scale,
                                     loss_fn=torch.compile(regression_loss))
