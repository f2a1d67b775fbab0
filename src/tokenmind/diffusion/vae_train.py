"""Training the latent-diffusion VAE on the project's one `Trainer`.

`train_vae(cfg)` hands a `VAE`, the image loaders of `DiffusionTrainer` and `VAEObjective` to
`VAETrainer`, so checkpoints, exact resume, bf16, clipping, validation and the metrics file
(`reconstruction` and `kl` per image next to the loss) are the pre-training loop's own. The one
thing a VAE adds is its export: after the last step the scaling factor is calibrated on training
images (1 / std of their latents) and `run/final/` is written with `save_vae`, so
`diffusion.latent_vae: run/final` is all a latent diffusion run needs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmind.config import Overrides
from tokenmind.config import load_config as load_schema
from tokenmind.train.config import OptimSection, ScheduleSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed, model_state
from tokenmind.train.trainer import TrainResult

from .config import DiffusionTrainSection, ImageDataSection
from .data import image_shape, load_split, to_model_range
from .train import DiffusionTrainer, image_loaders
from .vae import VAE, VAEConfig, VAEObjective, calibrate_scaling_factor, save_vae


@dataclass
class VAESection:
    """The VAE's shape (`VAEConfig`; image size and channels come from the data) and its loss.
    kl_weight: the KL term's weight (β < 1 keeps reconstructions sharp). calibration_images: how
    many training images set the scaling factor after training."""

    latent_channels: int = 4
    base_channels: int = 32
    channel_mults: list[int] = field(default_factory=lambda: [1, 2, 2])
    groups: int = 8
    kl_weight: float = 1e-3
    calibration_images: int = 2048

    def __post_init__(self) -> None:
        if self.kl_weight < 0:
            raise ValueError(f"vae.kl_weight must be >= 0, got {self.kl_weight}")
        if self.calibration_images < 2:
            raise ValueError(f"vae.calibration_images must be >= 2 (a std needs two), got {self.calibration_images}")


@dataclass
class VAETrainSection(DiffusionTrainSection):
    out_dir: str = "runs/vae"


@dataclass
class VAERunConfig:
    """A VAE training run: the VAE, the images, and the trainer's optim/schedule/train sections."""

    vae: VAESection = field(default_factory=VAESection)
    data: ImageDataSection = field(default_factory=ImageDataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: VAETrainSection = field(default_factory=VAETrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_vae_config(path: str | Path | None = None, overrides: Overrides = ()) -> VAERunConfig:
    """defaults ← YAML file (if given) ← `section.key=value` overrides, validated."""
    return load_schema(VAERunConfig, path, overrides)


def vae_config(cfg: VAERunConfig) -> VAEConfig:
    """The `VAEConfig` of a run: cfg.vae's shape for the data set's (padded) images."""
    channels, size, _ = image_shape(cfg.data.dataset, cfg.data.pad_to)
    v = cfg.vae
    return VAEConfig(sample_size=size, in_channels=channels, latent_channels=v.latent_channels,
                     base_channels=v.base_channels, channel_mults=tuple(v.channel_mults), groups=v.groups)


class VAETrainer(DiffusionTrainer):
    """The diffusion trainer (images as the unit) whose export calibrates the scaling factor and
    writes the VAE with `save_vae`."""

    def export(self) -> Path:
        path = self.out_dir / "final"
        state = model_state(self.model, self.ctx)  # collective under fsdp
        if self.ctx.is_main:
            cfg = self.cfg
            vae = VAE(vae_config(cfg))
            vae.load_state_dict(state)
            images = load_split(cfg.data.dataset, "train")[0][:cfg.vae.calibration_images]
            calibrate_scaling_factor(vae.to(self.ctx.device).eval(),
                                     to_model_range(images, cfg.data.pad_to).to(self.ctx.device),
                                     torch.Generator(self.ctx.device).manual_seed(cfg.train.seed))
            save_vae(vae, path)
        return path


def build_vae_trainer(cfg: VAERunConfig, ctx: DistContext) -> VAETrainer:
    loader, val_loader = image_loaders(cfg.data, ctx)
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    return VAETrainer(cfg, ctx, VAE(vae_config(cfg)), loader, val_loader, objective=VAEObjective(cfg.vae.kl_weight))


def train_vae(cfg: VAERunConfig) -> TrainResult:
    """Train (or resume) the VAE run `cfg` describes; behind `tokenmind diffusion train-vae`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_vae_trainer(cfg, ctx).train()
