"""Behaviour cloning of the VLA (`vla.py`) on recorded demonstrations, on the project's one `Trainer`.

The data, the trainer and the EMA are the diffusion policy's (`policy_train`: `ChunkLoader` windows
of one observation and the T_p actions from it on, `PolicyTrainer`); what differs is the model and,
per head, the objective: the flow head trains with `ChunkDenoisingObjective` (rectified flow on the
normalised chunk, the LM prefix's hidden states as the condition), the tokens head with
`ActionTokenObjective` (cross-entropy on the action tokens only, units = action tokens). The
export `out_dir/final/` is `save_vla`'s directory, loadable by `policy.load_policy`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tokenmind.config import Overrides
from tokenmind.config import load_config as load_schema
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer import Tokenizer
from tokenmind.train.config import OptimSection, ScheduleSection
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import TrainResult

from .policy_train import (
    EMA,
    ChunkBatch,
    ChunkDenoisingObjective,
    ChunkLoader,
    DemoDataSection,
    PolicyTrainConfig,
    PolicyTrainer,
    PolicyTrainSection,
    exported_state,
    split_rows,
)
from .vla import VLA, VLAConfig, build_vla, save_vla


@dataclass
class VLATrainSection(PolicyTrainSection):
    """The policy trainer's section with the VLA's output folder and no EMA by default (a few
    minutes of CPU training is too short for a 0.9999 average to catch up)."""

    out_dir: str = "runs/embodied/vla"
    ema_decay: float = 0.0


@dataclass
class VLATrainConfig(PolicyTrainConfig):
    """A VLA behaviour-cloning run: the diffusion policy's run with the VLA in place of the policy,
    and the optimizer and warm-up a LoRA'd language model trains well with."""

    policy: VLAConfig = field(default_factory=VLAConfig)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=3e-4, betas=(0.9, 0.95), weight_decay=1e-4))
    schedule: ScheduleSection = field(default_factory=lambda: ScheduleSection(warmup_steps=50))
    train: VLATrainSection = field(default_factory=VLATrainSection)


def load_vla_config(path: str | Path | None = None, overrides: Overrides = ()) -> VLATrainConfig:
    """defaults ← YAML file (if given) ← `section.key=value` overrides, validated."""
    return load_schema(VLATrainConfig, path, overrides)


class ActionTokenObjective:
    """RT-2/OpenVLA's loss: next-token cross-entropy on the action tokens of the chunk (teacher
    forced after the prefix), summed; the units are action tokens. Crops are drawn from the batch's
    noise_seed, so a resumed run sees the same ones."""

    def __call__(self, model: VLA, batch: ChunkBatch, precision: str) -> LossTerms:
        generator = torch.Generator(batch.action.device).manual_seed(batch.noise_seed)
        with autocast(batch.action.device, precision):
            logits, bins = model.action_token_logits(batch.pixels, batch.agent_pos, batch.action, generator)
        loss = F.cross_entropy(logits.float().flatten(0, 1), bins.flatten(), reduction="sum")
        accuracy = (logits.argmax(-1) == bins).float().sum()
        return LossTerms(loss, bins.numel(), {"token_accuracy": accuracy})

    def compiled(self) -> ActionTokenObjective:
        return self


class VLATrainer(PolicyTrainer):
    """`PolicyTrainer` (samples counted, EMA updated) exporting with `save_vla`."""

    def export(self) -> Path:
        path = self.out_dir / "final"
        if self.ctx.is_main:
            save_vla(self.model, path, exported_state(self.model),
                     {"steps": self.step, "ema": getattr(self.model, "ema", None) is not None})
        return path


def build_vla_trainer(cfg: VLATrainConfig, ctx: DistContext, demos: Any, language_model: Transformer | None = None,
                      tokenizer: Tokenizer | None = None) -> VLATrainer:
    """The trainer for `demos` (pixels, agent_pos, action, episode_index arrays): the VLA around
    `language_model`/`tokenizer` (default: `load_model(cfg.policy.lm)`), its new parts initialized
    from train.seed, its normaliser fitted to the demonstrations (the tokens head's bins too)."""
    if ctx.world_size > 1:
        raise ValueError("VLA training runs in one process; set train.distributed=none")
    p = cfg.policy
    if demos.pixels.shape[1:] != (p.image_size, p.image_size, 3):
        raise ValueError(f"the demonstrations' frames are {tuple(demos.pixels.shape[1:])}, the VLA expects "
                         f"({p.image_size}, {p.image_size}, 3); set policy.image_size={demos.pixels.shape[1]}")
    if language_model is None or tokenizer is None:
        from tokenmind.model.load import load_model

        pretrained = load_model(p.lm, dtype=torch.float32)
        language_model, tokenizer = pretrained.model, pretrained.tokenizer
    model = build_vla(p, language_model, tokenizer, seed=cfg.train.seed)
    model.normalizer.fit(demos.agent_pos, demos.action)
    if cfg.train.ema_decay > 0:
        model.ema = EMA([q for q in model.parameters() if q.requires_grad], cfg.train.ema_decay, cfg.train.ema_power)
    train_rows, val_rows = split_rows(np.asarray(demos.episode_index), cfg.data.val_episodes)

    def loader(rows: np.ndarray, seed: int, shuffle: bool) -> ChunkLoader:
        return ChunkLoader(demos.pixels, demos.agent_pos, demos.action, demos.episode_index, rows, p.n_obs_steps,
                           p.horizon, cfg.data.batch_size, seed=seed, shuffle=shuffle)

    val = loader(val_rows, cfg.data.seed + 1, False) if len(val_rows) else None
    objective = ChunkDenoisingObjective(p) if p.head == "flow" else ActionTokenObjective()
    return VLATrainer(cfg, ctx, model, loader(train_rows, cfg.data.seed, cfg.data.shuffle), val, objective=objective)


def train_vla(cfg: VLATrainConfig, demos: Any = None, language_model: Transformer | None = None,
              tokenizer: Tokenizer | None = None) -> TrainResult:
    """Train (or resume) the VLA run `cfg` describes on `demos` (default: the recorded folder
    data.demos); behind `tokenmind embodied train-vla`."""
    if demos is None:
        from .demos import Demonstrations

        demos = Demonstrations.load(cfg.data.demos)
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_vla_trainer(cfg, ctx, demos, language_model, tokenizer).train()
