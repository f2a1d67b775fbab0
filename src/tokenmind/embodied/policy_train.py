"""Behaviour cloning of a diffusion policy on recorded demonstrations, on the project's one `Trainer`.

Behaviour cloning is supervised learning on an expert's (observation, action) pairs. A diffusion
policy learns it as conditional generation: each training sample is a window of T_o observations
and the T_p actions the expert took from the oldest of them on (`ChunkLoader`; windows at an
episode's edges repeat its first frame / last action, as in the paper), and the loss is the image
diffusion objective with the action chunk in the image's place (`ChunkDenoisingObjective`).

`PolicyTrainer` is the `Trainer` counting samples and keeping an exponential moving average of the
weights (`EMA`, buffers of the model, so checkpoints hold it and a resumed run continues it
exactly); the export `out_dir/final/` is the EMA weights, the normalisation statistics and
config.json, written atomically (`diffusion_policy.save_policy`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmind.config import Overrides
from tokenmind.config import load_config as load_schema
from tokenmind.diffusion.config import DiffusionTrainSection
from tokenmind.diffusion.data import ImageBatch
from tokenmind.diffusion.objectives import DenoisingObjective, FlowMatchingObjective, regression_loss
from tokenmind.diffusion.schedules import NoiseSchedule
from tokenmind.train.config import OptimSection, ScheduleSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import Trainer, TrainResult

from .diffusion_policy import DiffusionPolicy, DiffusionPolicyConfig, save_policy


@dataclass
class DemoDataSection:
    """demos: a folder of recorded demonstrations (`tokenmind embodied record`). batch_size: samples
    per micro-batch. val_episodes: the last this many episodes are held out for the validation loss
    (0 = none). seed/shuffle: the loader's seeded order."""

    demos: str = "runs/embodied/demos"
    batch_size: int = 64
    val_episodes: int = 0
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.val_episodes < 0:
            raise ValueError(f"data.val_episodes must be >= 0, got {self.val_episodes}")


@dataclass
class PolicyTrainSection(DiffusionTrainSection):
    """The trainer's section (precision `auto` as for image diffusion), plus the EMA: ema_decay is
    the largest decay (0 = no EMA; the export is then the trained weights); the decay at update n
    is min(ema_decay, 1 − (1 + n)^−ema_power), the paper's warm-up."""

    out_dir: str = "runs/embodied/policy"
    ema_decay: float = 0.9999
    ema_power: float = 0.75

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay must be in [0, 1) (0 = no EMA), got {self.ema_decay}")
        if self.ema_power <= 0:
            raise ValueError(f"train.ema_power must be > 0, got {self.ema_power}")


@dataclass
class PolicyTrainConfig:
    """A behaviour-cloning run: the policy, its data, and the trainer's optim/schedule/train sections."""

    policy: DiffusionPolicyConfig = field(default_factory=DiffusionPolicyConfig)
    data: DemoDataSection = field(default_factory=DemoDataSection)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6))
    schedule: ScheduleSection = field(default_factory=lambda: ScheduleSection(warmup_steps=100))
    train: PolicyTrainSection = field(default_factory=PolicyTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_policy_config(path: str | Path | None = None, overrides: Overrides = ()) -> PolicyTrainConfig:
    """defaults ← YAML file (if given) ← `section.key=value` overrides, validated."""
    return load_schema(PolicyTrainConfig, path, overrides)


# ---- data ----------------------------------------------------------------------------------------


@dataclass
class ChunkBatch:
    """pixels: uint8 (B, T_o, H, W, 3); agent_pos: (B, T_o, state_dim), action: (B, T_p, action_dim) and
    block_pose: (B, T_o, 3) in env units; noise_seed: seeds the objective's crops, timesteps and noise
    for this batch. pixels / block_pose are None when the loader was built without them."""

    pixels: torch.Tensor | None
    agent_pos: torch.Tensor
    action: torch.Tensor
    noise_seed: int
    block_pose: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ChunkBatch:
        def move(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device)

        return ChunkBatch(move(self.pixels), self.agent_pos.to(device), self.action.to(device), self.noise_seed,
                          move(self.block_pose))


def episode_bounds(episode_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) row of each row's episode; an episode's rows must be contiguous and in order."""
    episode_index = np.asarray(episode_index)
    change = np.flatnonzero(episode_index[1:] != episode_index[:-1]) + 1
    starts, ends = np.concatenate([[0], change]), np.concatenate([change, [len(episode_index)]]) - 1
    if len(np.unique(episode_index)) != len(starts):
        raise ValueError("the demonstrations' frames of one episode are not contiguous; record them episode by "
                         "episode (or sort by episode_index, frame_index)")
    run = np.repeat(np.arange(len(starts)), ends - starts + 1)
    return starts[run], ends[run]


class ChunkLoader:
    """Endless batches of (T_o observations, T_p actions) windows ending their observations at each
    of `rows`, in a seeded order per epoch; the last partial batch of an epoch is dropped. Its state
    is (epoch, position), so a resumed run continues with the very same batches. pixels=None (a
    state policy) leaves the frames out of the batches; block_pose adds the block's pose windows."""

    def __init__(self, pixels: np.ndarray | None, agent_pos: np.ndarray, action: np.ndarray,
                 episode_index: np.ndarray, rows: np.ndarray, n_obs_steps: int, horizon: int, batch_size: int, *,
                 seed: int = 0, shuffle: bool = True, block_pose: np.ndarray | None = None) -> None:
        self.pixels = None if pixels is None else torch.as_tensor(np.asarray(pixels))
        self.block_pose = None if block_pose is None else torch.as_tensor(np.asarray(block_pose, dtype=np.float32))
        self.agent_pos = torch.as_tensor(np.asarray(agent_pos, dtype=np.float32))
        self.action = torch.as_tensor(np.asarray(action, dtype=np.float32))
        first, last = episode_bounds(episode_index)
        self.first, self.last = torch.as_tensor(first), torch.as_tensor(last)
        self.rows = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        self.obs_offsets = torch.arange(-n_obs_steps + 1, 1)
        self.action_offsets = torch.arange(-n_obs_steps + 1, horizon - n_obs_steps + 1)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.batches_per_epoch = len(self.rows) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(self.rows)} frames make no batch of {batch_size}; record more episodes or lower "
                             "data.batch_size")
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> torch.Tensor:
        if not self.shuffle:
            return self.rows
        return self.rows[torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(
            self.seed * 100_003 + self.epoch))]

    def window(self, rows: torch.Tensor) -> ChunkBatch:
        """The batch of windows around `rows` (noise_seed 0)."""
        first, last = self.first[rows, None], self.last[rows, None]
        obs = torch.minimum(torch.maximum(rows[:, None] + self.obs_offsets, first), last)
        act = torch.minimum(torch.maximum(rows[:, None] + self.action_offsets, first), last)
        return ChunkBatch(None if self.pixels is None else self.pixels[obs], self.agent_pos[obs], self.action[act], 0,
                          None if self.block_pose is None else self.block_pose[obs])

    def __iter__(self) -> ChunkLoader:
        return self

    def __next__(self) -> ChunkBatch:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        rows = self._order[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        batch = self.window(rows)
        batch.noise_seed = int(np.random.SeedSequence([self.seed, self.epoch, self.position]).generate_state(1)[0])
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()


# ---- objective -----------------------------------------------------------------------------------


class ChunkDenoisingObjective:
    """The image diffusion objectives (`DenoisingObjective` or `FlowMatchingObjective`: their draws of
    time and noise and their regression loss) applied to normalised action chunks (B, T_p, A), the
    observation features in the class label's place. Each sample's chunk is noised noise_draws
    times (the encoder runs once); the units are samples, each the mean over its draws."""

    def __init__(self, cfg: DiffusionPolicyConfig, loss_fn=regression_loss) -> None:
        self.cfg = cfg
        if cfg.objective == "ddpm":
            self.draws = DenoisingObjective(NoiseSchedule(cfg.beta_schedule, cfg.num_train_timesteps),
                                            cfg.prediction_type, num_classes=0, cfg_dropout=0.0, loss_fn=loss_fn)
        else:
            self.draws = FlowMatchingObjective(num_classes=0, cfg_dropout=0.0, t_sampling=cfg.t_sampling,
                                               time_scale=cfg.num_train_timesteps, loss_fn=loss_fn)

    def __call__(self, model: DiffusionPolicy, batch: ChunkBatch, precision: str) -> LossTerms:
        generator = torch.Generator(batch.action.device).manual_seed(batch.noise_seed)
        block = {} if batch.block_pose is None else {"block_pose": batch.block_pose}  # state policies only
        with autocast(batch.action.device, precision):
            cond = model.encode_obs(batch.pixels, batch.agent_pos, generator, **block)
        k = self.cfg.noise_draws
        x0 = model.normalizer.normalize("action", batch.action).repeat_interleave(k, 0)
        x_t, t, target = self.draws.inputs(ImageBatch(x0, cond, batch.noise_seed), generator)
        loss = self.draws.loss_fn(model, x_t, t, cond.repeat_interleave(k, 0), target, precision)
        return LossTerms(loss / k, len(batch.action))

    def compiled(self) -> ChunkDenoisingObjective:
        return ChunkDenoisingObjective(self.cfg, torch.compile(regression_loss))


# ---- EMA and the trainer -------------------------------------------------------------------------


class EMA(nn.Module):
    """An exponential moving average of `params` as buffers (`shadow_i`, and the update count), so a
    module holding it checkpoints and restores it with its weights. Diffusion policies evaluate
    much better with the averaged weights (Chi et al. 2023)."""

    def __init__(self, params: list[nn.Parameter], max_decay: float, power: float):
        super().__init__()
        self.max_decay, self.power = max_decay, power
        for i, p in enumerate(params):
            self.register_buffer(f"shadow_{i}", p.detach().clone())
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def shadows(self) -> list[torch.Tensor]:
        return [b for name, b in self.named_buffers() if name.startswith("shadow_")]

    @torch.no_grad()
    def update(self, params: list[nn.Parameter]) -> float:
        """shadow ← decay·shadow + (1 − decay)·param; returns the decay used."""
        self.updates += 1
        decay = min(self.max_decay, 1 - (1 + int(self.updates)) ** -self.power)
        for shadow, p in zip(self.shadows(), params, strict=True):
            shadow.lerp_(p.detach(), 1 - decay)
        return decay


class PolicyTrainer(Trainer):
    """The one `Trainer`, counting samples (no MFU), updating the model's EMA after each optimizer
    step and exporting with `save_policy`."""

    unit = "samples"

    def units_per_step(self) -> tuple[int, float | None]:
        return self.cfg.data.batch_size * self.cfg.train.grad_accum * self.ctx.world_size, None

    def train_step(self) -> dict[str, float]:
        stats = super().train_step()
        ema = getattr(self.model, "ema", None)
        if ema is not None:
            stats["ema_decay"] = ema.update(self.params)
        return stats

    def export(self) -> Path:
        path = self.out_dir / "final"
        if self.ctx.is_main:
            save_policy(exported_state(self.model), self.cfg.policy, path,
                        {"steps": self.step, "ema": getattr(self.model, "ema", None) is not None})
        return path


def exported_state(policy: DiffusionPolicy) -> dict[str, torch.Tensor]:
    """The policy's state dict with its EMA weights in place of the trained ones (when it has an EMA)
    and without the EMA's own buffers: what `load_diffusion_policy` reads."""
    state = {k: v for k, v in policy.state_dict().items() if not k.startswith("ema.")}
    ema = getattr(policy, "ema", None)
    if ema is not None:
        names = [name for name, p in policy.named_parameters() if p.requires_grad]
        state.update(zip(names, ema.shadows(), strict=True))
    return state


def split_rows(episode_index: np.ndarray, val_episodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, validation rows): the last val_episodes episodes (by index) are validation."""
    episodes = np.unique(episode_index)
    if val_episodes >= len(episodes):
        raise ValueError(f"data.val_episodes={val_episodes} leaves no training episode of the {len(episodes)} "
                         "recorded; lower it or record more")
    held_out = np.isin(episode_index, episodes[len(episodes) - val_episodes:])
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def build_policy_trainer(cfg: PolicyTrainConfig, ctx: DistContext, demos: Any) -> PolicyTrainer:
    """The trainer for `demos` (anything with pixels, agent_pos, action and episode_index arrays, and
    block_pose for state policies): the policy initialized from train.seed, its normaliser fitted to
    the demonstrations, the EMA attached when train.ema_decay > 0, and loaders over the train /
    held-out episodes."""
    if ctx.world_size > 1:
        raise ValueError("policy training runs in one process; set train.distributed=none")
    p = cfg.policy
    image_size = demos.pixels.shape[1]
    if p.uses_pixels and demos.pixels.shape[1:] != (p.image_size, p.image_size, 3):
        raise ValueError(f"the demonstrations' frames are {tuple(demos.pixels.shape[1:])}, the policy expects "
                         f"({p.image_size}, {p.image_size}, 3); set policy.image_size={image_size}")
    block_pose = getattr(demos, "block_pose", None) if p.uses_block_pose else None
    if p.uses_block_pose and block_pose is None:
        raise ValueError(f"policy.obs_mode={p.obs_mode} conditions on the block pose, but the demonstrations "
                         f"({cfg.data.demos}) have no block_pose column (recorded before it existed); re-record them "
                         f"with `tokenmind embodied record --out DIR` and set data.demos=DIR")
    torch.manual_seed(cfg.train.seed)
    model = DiffusionPolicy(p)
    model.normalizer.fit(demos.agent_pos, demos.action, None if block_pose is None else np.asarray(block_pose)[:, :2])
    if cfg.train.ema_decay > 0:
        model.ema = EMA([q for q in model.parameters() if q.requires_grad], cfg.train.ema_decay, cfg.train.ema_power)
    train_rows, val_rows = split_rows(np.asarray(demos.episode_index), cfg.data.val_episodes)

    def loader(rows: np.ndarray, seed: int, shuffle: bool) -> ChunkLoader:
        return ChunkLoader(demos.pixels if p.uses_pixels else None, demos.agent_pos, demos.action,
                           demos.episode_index, rows, p.n_obs_steps, p.horizon, cfg.data.batch_size, seed=seed,
                           shuffle=shuffle, block_pose=block_pose)

    val = loader(val_rows, cfg.data.seed + 1, False) if len(val_rows) else None
    return PolicyTrainer(cfg, ctx, model, loader(train_rows, cfg.data.seed, cfg.data.shuffle), val,
                         objective=ChunkDenoisingObjective(p))


def train_policy(cfg: PolicyTrainConfig, demos: Any = None) -> TrainResult:
    """Train (or resume) the run `cfg` describes on `demos` (default: the recorded folder data.demos);
    behind `tokenmind embodied train`."""
    if demos is None:
        from .demos import Demonstrations

        demos = Demonstrations.load(cfg.data.demos)
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_policy_trainer(cfg, ctx, demos).train()
