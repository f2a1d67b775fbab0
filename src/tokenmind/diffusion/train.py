"""Training a diffusion model on the project's one `Trainer`, and the trained model's files.

`train_diffusion(cfg)` builds the network (`model.kind`, or any `model_factory`), the image loaders
and the objective, and hands them to `DiffusionTrainer`: the LLM `Trainer` with images as its unit
of throughput and its own export, so checkpoints, exact resume, gradient accumulation, bf16,
clipping, metrics, the loss plot and distributed training are the same code as pre-training.

The export `run_dir/final/` holds `model.safetensors` and `config.json` (the resolved
`DiffusionConfig`), written atomically; `load_diffusion_model` rebuilds the model from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.config import config_dict
from tokenmind.model.checkpoint import atomic_directory
from tokenmind.train.distributed import DistContext, init_distributed, model_state
from tokenmind.train.objectives import Objective
from tokenmind.train.trainer import Trainer, TrainResult

from .config import DiffusionConfig, ImageDataSection, load_config
from .data import ImageLoader, class_names, load_split
from .latent import data_shape, find_vae, latent_split
from .objectives import DenoisingObjective, FlowMatchingObjective
from .schedules import NoiseSchedule

ModelFactory = Callable[[DiffusionConfig], nn.Module]


def build_model(cfg: DiffusionConfig) -> nn.Module:
    """The network `cfg.model.kind` names (`DiT` or `UNet`), its config made of cfg.model.options plus
    what the data decide: sample_size, in_channels, num_classes. Called as model(x (B, C, H, W),
    t (B,), labels (B,) or None) → (B, C, H, W), the label num_classes meaning "no class"."""
    channels, size, _ = data_shape(cfg.data.dataset, cfg.data.pad_to, cfg.diffusion.latent_vae)
    decided = {"sample_size": size, "in_channels": channels, "num_classes": len(class_names(cfg.data.dataset))}
    clash = sorted(set(decided) & set(cfg.model.options))
    if clash:
        raise ValueError(f"model.options sets {', '.join(clash)}, which the data decide "
                         f"({', '.join(f'{k}={decided[k]}' for k in clash)}); drop them, or change data.dataset/pad_to")
    if cfg.model.options.get("learn_sigma"):
        raise ValueError("model.options.learn_sigma is not supported: the samplers use fixed variances")
    if cfg.model.kind == "dit":
        from tokenmind.diffusion.dit import DiT, DiTConfig
        return DiT(DiTConfig(**cfg.model.options, **decided))
    from tokenmind.diffusion.unet import UNet, UNetConfig
    return UNet(UNetConfig(**cfg.model.options, **decided))


def noise_schedule(cfg: DiffusionConfig) -> NoiseSchedule:
    d = cfg.diffusion
    return NoiseSchedule(d.beta_schedule, d.num_train_timesteps, d.beta_start, d.beta_end)


def build_objective(cfg: DiffusionConfig) -> DenoisingObjective | FlowMatchingObjective:
    """cfg.diffusion's training objective for the data set's classes."""
    d, num_classes = cfg.diffusion, len(class_names(cfg.data.dataset))
    if d.objective == "ddpm":
        return DenoisingObjective(noise_schedule(cfg), d.prediction_type, num_classes=num_classes,
                                  cfg_dropout=d.cfg_dropout)
    return FlowMatchingObjective(num_classes=num_classes, cfg_dropout=d.cfg_dropout, t_sampling=d.t_sampling,
                                 logit_mean=d.logit_mean, logit_std=d.logit_std, time_scale=d.num_train_timesteps)


class DiffusionTrainer(Trainer):
    """The one `Trainer`, counting images (MFU is not reported: no FLOP count for an arbitrary
    network) and exporting with `save_diffusion_model`."""

    unit = "images"

    def units_per_step(self) -> tuple[int, float | None]:
        t = self.cfg.train
        return self.cfg.data.batch_size * t.grad_accum * self.ctx.world_size, None

    def export(self) -> Path:
        path = self.out_dir / "final"
        state = model_state(self.model, self.ctx)  # collective under fsdp
        if self.ctx.is_main:
            save_diffusion_model(state, self.cfg, path)
        return path


def image_loaders(data: ImageDataSection, ctx: DistContext, vae: str = "") -> tuple[ImageLoader, ImageLoader]:
    """Loaders over the train and test splits of `data`: the images, or their cached latents under
    the VAE at `vae` (encoded from the padded images, so not padded again)."""
    pad_to = 0 if vae else data.pad_to
    loaders = []
    for split, seed, shuffle in (("train", data.seed, data.shuffle), ("test", data.seed + 1, False)):
        images, labels = latent_split(vae, data.dataset, split, data.pad_to) if vae else load_split(data.dataset, split)
        loaders.append(ImageLoader(images, labels, data.batch_size, seed=seed, shuffle=shuffle, pad_to=pad_to,
                                   rank=ctx.rank, world_size=ctx.world_size))
    return loaders[0], loaders[1]


def build_diffusion_trainer(cfg: DiffusionConfig, ctx: DistContext, model_factory: ModelFactory | None = None,
                            objective: Objective | None = None) -> DiffusionTrainer:
    """Loaders over the data set's train and test splits, the model (initialized from train.seed)
    and the objective (cfg's, or another such as distillation's), wired into the trainer."""
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    model = (model_factory or build_model)(cfg)  # first: it checks that a latent_vae fits the data
    loader, val_loader = image_loaders(cfg.data, ctx, cfg.diffusion.latent_vae)
    return DiffusionTrainer(cfg, ctx, model, loader, val_loader, objective=objective or build_objective(cfg))


def train_diffusion(cfg: DiffusionConfig, model_factory: ModelFactory | None = None,
                    objective: Objective | None = None) -> TrainResult:
    """Train (or resume) the run `cfg` describes; behind `tokenmind diffusion train`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_diffusion_trainer(cfg, ctx, model_factory, objective).train()


def save_diffusion_model(state: dict[str, torch.Tensor], cfg: DiffusionConfig, path: str | Path) -> Path:
    """Write a model's weights and its run config as `path/{model.safetensors,config.json}`, atomically;
    a latent model's VAE is copied to `path/vae/`, so the folder samples on its own."""
    with atomic_directory(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_dict(cfg), indent=2) + "\n", encoding="utf-8")
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        if cfg.diffusion.latent_vae:
            shutil.copytree(find_vae(cfg.diffusion.latent_vae), tmp / "vae", ignore=shutil.ignore_patterns("latents"))
    return Path(path)


def diffusion_model_dir(path: str | Path) -> Path | None:
    """The folder holding a trained diffusion model (a run folder's `final/`, or `path` itself), or
    None when `path` holds none; its config.json has a `diffusion` section, which an HF model's lacks."""
    for folder in (Path(path), Path(path) / "final"):
        config = folder / "config.json"
        if config.is_file() and (folder / "model.safetensors").is_file():
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                saved = json.loads(config.read_text(encoding="utf-8"))
                if isinstance(saved, dict) and isinstance(saved.get("diffusion"), dict):
                    return folder
    return None


def load_diffusion_model(path: str | Path, model_factory: ModelFactory | None = None,
                         device: str | torch.device = "cpu") -> tuple[nn.Module, DiffusionConfig]:
    """(model in eval mode, its run config) from a run folder or its `final/` export."""
    found = diffusion_model_dir(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no trained diffusion model (model.safetensors + config.json); "
                                "pass the run folder of `tokenmind diffusion train` or its final/ folder")
    cfg = load_config(found / "config.json")  # JSON is YAML
    if (found / "vae").is_dir():  # a latent model decodes with the copy of its VAE
        cfg = dataclasses.replace(cfg, diffusion=dataclasses.replace(cfg.diffusion, latent_vae=str(found / "vae")))
    model = (model_factory or build_model)(cfg)
    model.load_state_dict(load_file(str(found / "model.safetensors")))
    return model.to(device).eval(), cfg
