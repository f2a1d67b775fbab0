"""A diffusion run's configuration: the trainer's optim/schedule/train sections next to three of
its own (model, diffusion, data), loaded by the project's one config loader (YAML, then
`section.key=value` overrides). The resolved config is saved with the trained model, so
`tokenmind diffusion sample` rebuilds the model and its sampler from the run folder alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmind.config import Overrides
from tokenmind.config import load_config as load_schema
from tokenmind.model.cpu import fastest_autocast
from tokenmind.train.distributed import resolve_device
from tokenmind.train.config import OptimSection, ScheduleSection, TrainSection, check_schedule_fits

from .data import DATASETS
from .objectives import T_SAMPLINGS
from .schedules import BETA_SCHEDULES, PREDICTION_TYPES, TIMESTEP_SPACINGS

MODEL_KINDS = ("dit", "unet")
OBJECTIVES = ("ddpm", "flow")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{section}.{name}={value!r} is not one of {', '.join(choices)}")


@dataclass
class DiffusionModelSection:
    """The denoising network. kind: `dit` (tokenmind.diffusion.dit) or `unet` (.unet); options: that
    model's own settings (width, depth, patch size, ...), handed to its builder together with what
    the data decide (image channels and size, number of classes)."""

    kind: str = "dit"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("model", "kind", self.kind, MODEL_KINDS)


@dataclass
class DiffusionSection:
    """What the model learns and how it is sampled.

    objective: `ddpm` (denoising over T discrete steps; sampled with DDPM or DDIM) or `flow`
        (rectified flow; sampled with Euler). prediction_type: ddpm's target, epsilon, sample (x₀)
        or v_prediction. beta_schedule/num_train_timesteps/beta_start/beta_end: ddpm's noise schedule.
    cfg_dropout: share of labels replaced by the null class in training (classifier-free guidance).
    t_sampling/logit_mean/logit_std: flow's training times, uniform or logit-normal.
    clip_sample/timestep_spacing: DDPM/DDIM sampling (x̂₀ clipped to [−1, 1]; which of the T steps
        n sampling steps visit, trailing starts at pure noise). shift: the Euler grid's timestep shift.
    latent_vae: a trained VAE (`tokenmind diffusion train-vae` run) whose scaled latents the model
        learns instead of pixels (latent diffusion, `latent.py`); empty for pixel diffusion.
    """

    objective: str = "ddpm"
    prediction_type: str = "epsilon"
    beta_schedule: str = "linear"
    num_train_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    cfg_dropout: float = 0.1
    t_sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    clip_sample: bool = True
    timestep_spacing: str = "trailing"
    shift: float = 1.0
    latent_vae: str = ""

    def __post_init__(self) -> None:
        _choice("diffusion", "objective", self.objective, OBJECTIVES)
        _choice("diffusion", "prediction_type", self.prediction_type, PREDICTION_TYPES)
        _choice("diffusion", "beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        _choice("diffusion", "t_sampling", self.t_sampling, T_SAMPLINGS)
        _choice("diffusion", "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        _check(self.num_train_timesteps >= 1,
               f"diffusion.num_train_timesteps must be >= 1, got {self.num_train_timesteps}")
        _check(0 < self.beta_start < self.beta_end < 1, "diffusion.beta_start/beta_end must satisfy "
               f"0 < start < end < 1, got {self.beta_start}, {self.beta_end}")
        _check(0 <= self.cfg_dropout < 1, f"diffusion.cfg_dropout must be in [0, 1), got {self.cfg_dropout}")
        _check(self.logit_std > 0, f"diffusion.logit_std must be > 0, got {self.logit_std}")
        _check(self.shift > 0, f"diffusion.shift must be > 0 (1 = no shift), got {self.shift}")
        _check(not (self.latent_vae and self.objective == "ddpm" and self.clip_sample),
               "diffusion.clip_sample clips x̂₀ to the pixel range [-1, 1], which cuts off latents of unit variance; "
               "set diffusion.clip_sample=false with diffusion.latent_vae")


@dataclass
class ImageDataSection:
    """dataset: `fashion-mnist` (60k train, the 10k test split for validation) or `digits`
    (scikit-learn's 8×8; 1,600 train, 197 validation). batch_size: images per micro-batch on each
    rank. pad_to: pad images with background to this square size (0 = as they are)."""

    dataset: str = "fashion-mnist"
    batch_size: int = 64
    pad_to: int = 0
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        _choice("data", "dataset", self.dataset, DATASETS)
        _check(self.batch_size >= 1, f"data.batch_size must be >= 1, got {self.batch_size}")
        _check(self.pad_to >= 0, f"data.pad_to must be >= 0 (0 = no padding), got {self.pad_to}")


@dataclass
class DiffusionTrainSection(TrainSection):
    """The trainer's section; precision may also be `auto` (the default): the autocast precision
    that is faster on the run's device (`fastest_autocast`: bf16 on CUDA and AMX CPUs, fp32 on
    other CPUs, where bf16 casts cost more than they save), resolved here and saved resolved."""

    out_dir: str = "runs/diffusion"
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.precision == "auto":
            self.precision = fastest_autocast(resolve_device(self.device).type)
        super().__post_init__()


@dataclass
class DiffusionConfig:
    """A whole diffusion run; see the module docstring."""

    model: DiffusionModelSection = field(default_factory=DiffusionModelSection)
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    data: ImageDataSection = field(default_factory=ImageDataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: DiffusionTrainSection = field(default_factory=DiffusionTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_config(path: str | Path | None = None, overrides: Overrides = ()) -> DiffusionConfig:
    """defaults ← YAML file (if given) ← `section.key=value` overrides, validated."""
    return load_schema(DiffusionConfig, path, overrides)
