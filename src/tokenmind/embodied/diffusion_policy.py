"""A diffusion policy (Chi et al. 2023, "Diffusion Policy"): the network that denoises a chunk of
future actions, conditioned on the last few observations.

The policy sees T_o observations and predicts T_p actions at once; the caller executes the first
T_a of them and then re-plans (action chunking, receding-horizon control). The chunk starts at the oldest observation, so chunk row
T_o − 1 is the action for the current frame. An observation is (`obs_mode`):

* `pixels`: a camera frame and the agent's position (the paper's image variant);
* `state`: the agent's position and the block's pose (x, y, sin θ, cos θ) — the paper's low-dim
  variant: no CNN, so the network only has to learn the pushing, not where the T is in the image;
* `pixels+state`: both.

* `Normalizer`: agent positions, block positions and actions are mapped to [−1, 1] by the
  demonstrations' min/max per dimension (θ enters as sin/cos, already in range); buffers, so the
  statistics travel inside model.safetensors with the weights.
* `ImageEncoder`: a small ResNet-style CNN with GroupNorm (BatchNorm's running statistics fight
  with an exponential moving average of the weights, the paper's reason) ending in a spatial
  softmax: each of K feature maps becomes the expected (x, y) of its activation, K keypoints.
  Trained end to end with the denoiser; random crops in training, the centre crop in evaluation.
* `ConditionalUnet1D`: the paper's CNN denoiser: a 1-D U-Net over the time axis of the chunk
  whose residual blocks are FiLM-modulated (per-channel scale and bias) by [timestep embedding,
  observation features].

`DiffusionPolicy(x_t (B, T_p, A), t (B,), cond (B, D))` has the signature of the project's image
denoisers with the observation features in the class label's place, so the one sampling loop
(`tokenmind.diffusion.sampling.sample`) and the DDPM/DDIM/flow-Euler schedulers drive it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.config import build_config, config_dict
from tokenmind.diffusion.embeddings import timestep_embedding
from tokenmind.diffusion.objectives import T_SAMPLINGS
from tokenmind.diffusion.sampling import sample
from tokenmind.diffusion.schedules import (
    BETA_SCHEDULES,
    PREDICTION_TYPES,
    DDIMScheduler,
    DDPMScheduler,
    FlowMatchEulerScheduler,
    NoiseSchedule,
)
from tokenmind.model.checkpoint import atomic_directory

OBJECTIVES = ("ddpm", "flow")
OBS_MODES = ("pixels", "state", "pixels+state")
BLOCK_FEATURES = 4  # block x, y (normalised), sin θ, cos θ
SAMPLERS = {"ddpm": ("ddim", "ddpm"), "flow": ("euler",)}
KIND = "diffusion-policy"  # config.json's "kind": what `load_policy` builds


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class DiffusionPolicyConfig:
    """The policy's windows, networks and diffusion process.

    obs_mode: what one observation is: pixels (frame + agent position), state (agent position +
    block pose, no image encoder) or pixels+state. n_obs_steps (T_o) observations in, horizon (T_p)
    actions out, n_action_steps (T_a) executed before re-planning. image_size: the square frames' side; crop_size: the random (training) or
    centre (acting) crop the encoder sees. vision_channels: the CNN's width per stage (the stem
    convolution divides the resolution by stem_stride, each later stage halves it); num_keypoints:
    spatial-softmax keypoints; obs_feature_dim: one frame's image features. down_dims/kernel_size/groups/time_embed_dim: the 1-D U-Net. objective: ddpm
    (prediction_type, beta_schedule, num_train_timesteps) or flow (t_sampling); sampler and
    num_inference_steps: how actions are drawn when acting (ddim/ddpm for ddpm, euler for flow).
    noise_draws: noisy copies of each chunk per observation in training (the encoder runs once).
    """

    n_obs_steps: int = 2
    obs_mode: str = "pixels"
    horizon: int = 16
    n_action_steps: int = 8
    action_dim: int = 2
    state_dim: int = 2
    image_size: int = 96
    crop_size: int = 84
    vision_channels: list[int] = field(default_factory=lambda: [32, 64, 128])
    stem_stride: int = 2
    num_keypoints: int = 32
    obs_feature_dim: int = 64
    down_dims: list[int] = field(default_factory=lambda: [64, 128, 256])
    kernel_size: int = 5
    groups: int = 8
    time_embed_dim: int = 128
    objective: str = "ddpm"
    prediction_type: str = "epsilon"
    beta_schedule: str = "squaredcos_cap_v2"
    num_train_timesteps: int = 100
    t_sampling: str = "uniform"
    sampler: str = "ddim"
    num_inference_steps: int = 10
    noise_draws: int = 1

    def __post_init__(self) -> None:
        self.vision_channels, self.down_dims = list(self.vision_channels), list(self.down_dims)
        _check(self.obs_mode in OBS_MODES, f"policy.obs_mode={self.obs_mode!r} is not one of {', '.join(OBS_MODES)}")
        _check(self.n_obs_steps >= 1, f"policy.n_obs_steps must be >= 1, got {self.n_obs_steps}")
        _check(1 <= self.n_action_steps <= self.horizon - self.n_obs_steps + 1,
               f"policy.n_action_steps={self.n_action_steps} must be in [1, horizon - n_obs_steps + 1] = "
               f"[1, {self.horizon - self.n_obs_steps + 1}]: the executed actions start at the current frame")
        _check(self.horizon % 2 ** (len(self.down_dims) - 1) == 0,
               f"policy.horizon={self.horizon} must halve {len(self.down_dims) - 1} times (one per U-Net level "
               "below the top); use a multiple of that power of two or fewer down_dims")
        _check(0 < self.crop_size <= self.image_size,
               f"policy.crop_size={self.crop_size} must be in (0, image_size={self.image_size}]")
        for name, widths in (("vision_channels", self.vision_channels), ("down_dims", self.down_dims)):
            _check(len(widths) >= 1 and all(w % self.groups == 0 for w in widths),
                   f"policy.{name}={widths} must be non-empty and divisible by groups={self.groups}")
        _check(self.stem_stride >= 1, f"policy.stem_stride must be >= 1, got {self.stem_stride}")
        _check(self.kernel_size % 2 == 1, f"policy.kernel_size must be odd, got {self.kernel_size}")
        _check(self.objective in OBJECTIVES, f"policy.objective={self.objective!r} is not one of ddpm, flow")
        _check(self.prediction_type in PREDICTION_TYPES,
               f"policy.prediction_type={self.prediction_type!r} is not one of {', '.join(PREDICTION_TYPES)}")
        _check(self.beta_schedule in BETA_SCHEDULES,
               f"policy.beta_schedule={self.beta_schedule!r} is not one of {', '.join(BETA_SCHEDULES)}")
        _check(self.t_sampling in T_SAMPLINGS, f"policy.t_sampling={self.t_sampling!r} is not one of "
               f"{', '.join(T_SAMPLINGS)}")
        _check(self.sampler in SAMPLERS[self.objective], f"policy.sampler={self.sampler!r} does not sample a "
               f"{self.objective} model; use {' or '.join(SAMPLERS[self.objective])}")
        _check(1 <= self.num_inference_steps <= self.num_train_timesteps,
               f"policy.num_inference_steps must be in [1, num_train_timesteps={self.num_train_timesteps}]")
        _check(self.noise_draws >= 1, f"policy.noise_draws must be >= 1, got {self.noise_draws}")

    @property
    def uses_pixels(self) -> bool:
        return self.obs_mode in ("pixels", "pixels+state")

    @property
    def uses_block_pose(self) -> bool:
        return self.obs_mode in ("state", "pixels+state")


class Normalizer(nn.Module):
    """Per-dimension min/max scaling to [−1, 1] for agent positions ("state"), actions and, with
    block_dim > 0, the block's position ("block"). A dimension that never varies maps to −1 and back
    to its value."""

    def __init__(self, state_dim: int, action_dim: int, block_dim: int = 0):
        super().__init__()
        self.names = ("state", "action", "block") if block_dim else ("state", "action")
        for name, dim in zip(self.names, (state_dim, action_dim, block_dim)):
            self.register_buffer(f"{name}_min", torch.zeros(dim))
            self.register_buffer(f"{name}_max", torch.ones(dim))

    def fit(self, state: torch.Tensor | np.ndarray, action: torch.Tensor | np.ndarray,
            block: torch.Tensor | np.ndarray | None = None) -> Normalizer:
        """Set the statistics from (N, state_dim) positions, (N, action_dim) actions and, when the
        normaliser has a block entry, (N, block_dim) block positions."""
        if ("block" in self.names) != (block is not None):
            raise ValueError(f"Normalizer.fit: block positions {'missing' if block is None else 'given'}, "
                             f"but the normaliser has {'a' if 'block' in self.names else 'no'} block entry")
        for name, values in zip(self.names, (state, action, block)):
            values = torch.as_tensor(np.asarray(values), dtype=torch.float32)
            getattr(self, f"{name}_min").copy_(values.min(0).values)
            getattr(self, f"{name}_max").copy_(values.max(0).values)
        return self

    def _range(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = getattr(self, f"{name}_min"), getattr(self, f"{name}_max")
        span = high - low
        return low, torch.where(span > 1e-6, span, torch.ones_like(span))

    def normalize(self, name: str, x: torch.Tensor) -> torch.Tensor:
        low, span = self._range(name)
        return (x.float() - low) / span * 2 - 1

    def unnormalize(self, name: str, x: torch.Tensor) -> torch.Tensor:
        low, span = self._range(name)
        return (x.float() + 1) / 2 * span + low


def crop(pixels: torch.Tensor, size: int, generator: torch.Generator | None) -> torch.Tensor:
    """(N, C, H, W) → (N, C, size, size): a random window per image drawn with `generator`, or the
    centre window when generator is None."""
    n, _, h, w = pixels.shape
    if size == h == w:
        return pixels
    if generator is None:
        top, left = (h - size) // 2, (w - size) // 2
        return pixels[:, :, top:top + size, left:left + size]
    tops = torch.randint(0, h - size + 1, (n,), generator=generator, device=generator.device).tolist()
    lefts = torch.randint(0, w - size + 1, (n,), generator=generator, device=generator.device).tolist()
    return torch.stack([p[:, y:y + size, x:x + size] for p, y, x in zip(pixels, tops, lefts)])


class SpatialSoftmax(nn.Module):
    """(B, C, H, W) → (B, 2K): a 1×1 convolution to K maps, a softmax over each map's positions,
    and the expected (x, y) in [−1, 1] under it (Levine et al. 2016's keypoints)."""

    def __init__(self, channels: int, num_keypoints: int):
        super().__init__()
        self.proj = nn.Conv2d(channels, num_keypoints, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maps = self.proj(x)
        b, k, h, w = maps.shape
        probs = maps.flatten(2).softmax(-1).view(b, k, h, w)
        ys = torch.linspace(-1, 1, h, device=x.device, dtype=probs.dtype)
        xs = torch.linspace(-1, 1, w, device=x.device, dtype=probs.dtype)
        return torch.cat([(probs.sum(2) * xs).sum(-1), (probs.sum(3) * ys).sum(-1)], dim=1)


class ConvBlock2d(nn.Module):
    """Two 3×3 convolutions with GroupNorm and ReLU, the first strided by 2, plus a strided 1×1
    shortcut: one ResNet stage at half the resolution."""

    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.skip = nn.Conv2d(cin, cout, 1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.skip(x) + self.norm2(self.conv2(h)))


class ImageEncoder(nn.Module):
    """uint8 frames (N, H, W, 3) → (N, obs_feature_dim): stem convolution, ResNet stages, keypoints."""

    def __init__(self, cfg: DiffusionPolicyConfig):
        super().__init__()
        self.crop_size = cfg.crop_size
        widths = cfg.vision_channels
        s = cfg.stem_stride
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 2 * s + 1, stride=s, padding=s),
                                  nn.GroupNorm(cfg.groups, widths[0]), nn.ReLU())
        self.stages = nn.Sequential(*[ConvBlock2d(a, b, cfg.groups) for a, b in pairwise(widths)])
        self.keypoints = SpatialSoftmax(widths[-1], cfg.num_keypoints)
        self.out = nn.Linear(2 * cfg.num_keypoints, cfg.obs_feature_dim)

    def forward(self, frames: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        x = frames.permute(0, 3, 1, 2).float() / 127.5 - 1  # (N, 3, H, W) in [−1, 1]
        x = crop(x, self.crop_size, generator)
        return self.out(self.keypoints(self.stages(self.stem(x))))


class ConvBlock1d(nn.Module):
    """Conv1d → GroupNorm → Mish."""

    def __init__(self, cin: int, cout: int, kernel_size: int, groups: int):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, padding=kernel_size // 2)
        self.norm = nn.GroupNorm(groups, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mish(self.norm(self.conv(x)))


class FiLMResBlock1d(nn.Module):
    """Two `ConvBlock1d`s; between them the conditioning vector sets a per-channel scale and bias
    (FiLM, Perez et al. 2018); a 1×1 convolution carries the input around when the width changes."""

    def __init__(self, cin: int, cout: int, cond_dim: int, kernel_size: int, groups: int):
        super().__init__()
        self.block1 = ConvBlock1d(cin, cout, kernel_size, groups)
        self.block2 = ConvBlock1d(cout, cout, kernel_size, groups)
        self.film = nn.Linear(cond_dim, 2 * cout)
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, bias = self.film(F.mish(cond)).unsqueeze(-1).chunk(2, dim=1)
        return self.block2(scale * self.block1(x) + bias) + self.skip(x)


class ConditionalUnet1D(nn.Module):
    """(x (B, T, A), t (B,), cond (B, D)) → (B, T, A): a U-Net over the chunk's time axis, two FiLM
    blocks per level, strided convolutions down and transposed ones up, skips concatenated."""

    def __init__(self, cfg: DiffusionPolicyConfig, cond_dim: int):
        super().__init__()
        k, g, e = cfg.kernel_size, cfg.groups, cfg.time_embed_dim
        self.time_embed_dim = e
        self.time_mlp = nn.Sequential(nn.Linear(e, 4 * e), nn.Mish(), nn.Linear(4 * e, e))
        c = e + cond_dim
        dims = (cfg.action_dim, *cfg.down_dims)
        levels = list(pairwise(dims))
        self.down = nn.ModuleList()
        for i, (a, b) in enumerate(levels):
            last = i == len(levels) - 1
            self.down.append(nn.ModuleList([FiLMResBlock1d(a, b, c, k, g), FiLMResBlock1d(b, b, c, k, g),
                                            nn.Identity() if last else nn.Conv1d(b, b, 3, stride=2, padding=1)]))
        mid = cfg.down_dims[-1]
        self.mid = nn.ModuleList([FiLMResBlock1d(mid, mid, c, k, g), FiLMResBlock1d(mid, mid, c, k, g)])
        self.up = nn.ModuleList()
        for i, (a, b) in enumerate(reversed(levels[1:])):
            self.up.append(nn.ModuleList([FiLMResBlock1d(2 * b, a, c, k, g), FiLMResBlock1d(a, a, c, k, g),
                                          nn.ConvTranspose1d(a, a, 4, stride=2, padding=1)]))
        first = cfg.down_dims[0]
        self.final = nn.Sequential(ConvBlock1d(first, first, k, g), nn.Conv1d(first, cfg.action_dim, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        emb = self.time_mlp(timestep_embedding(t, self.time_embed_dim).to(cond.dtype))
        c = torch.cat([emb, cond], dim=-1)
        h, skips = x.transpose(1, 2), []  # (B, A, T): channels are the action dimensions
        for block1, block2, down in self.down:
            h = block2(block1(h, c), c)
            skips.append(h)
            h = down(h)
        for block in self.mid:
            h = block(h, c)
        for (block1, block2, up), skip in zip(self.up, reversed(skips)):  # the top level's skip goes unused, as in
            h = up(block2(block1(torch.cat([h, skip], dim=1), c), c))     # the paper's network
        return self.final(h).transpose(1, 2)


class DiffusionPolicy(nn.Module):
    """Normalizer + image encoder (pixel modes) + denoiser. forward(x_t, t, cond) denoises normalised
    action chunks given `encode_obs`'s features; `predict_action_chunk` samples chunks in env units."""

    def __init__(self, cfg: DiffusionPolicyConfig):
        super().__init__()
        self.cfg = cfg
        self.normalizer = Normalizer(cfg.state_dim, cfg.action_dim, 2 if cfg.uses_block_pose else 0)
        self.encoder = ImageEncoder(cfg) if cfg.uses_pixels else None
        per_step = cfg.state_dim + (cfg.obs_feature_dim if cfg.uses_pixels else 0) + (
            BLOCK_FEATURES if cfg.uses_block_pose else 0)
        self.cond_dim = cfg.n_obs_steps * per_step
        self.denoiser = ConditionalUnet1D(cfg, self.cond_dim)

    def encode_obs(self, pixels: torch.Tensor | None, agent_pos: torch.Tensor,
                   generator: torch.Generator | None = None, block_pose: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 pixels (B, T_o, H, W, 3), agent_pos (B, T_o, state_dim) and block_pose (B, T_o, 3: x, y, θ)
        in env units → (B, cond_dim): per observation step its image features (pixel modes), normalised
        position and block features (state modes: normalised x, y, sin θ, cos θ), the T_o steps
        concatenated. Inputs the obs_mode does not use may be None. generator: random crops
        (training); None: centre crops."""
        cfg = self.cfg
        b, t = agent_pos.shape[:2]
        if t != cfg.n_obs_steps:
            raise ValueError(f"got {t} observation steps, the policy was built for n_obs_steps={cfg.n_obs_steps}")
        parts = [self.normalizer.normalize("state", agent_pos)]
        if cfg.uses_pixels:
            if pixels is None:
                raise ValueError(f"this policy (obs_mode={cfg.obs_mode}) conditions on pixels, but none were given")
            parts.insert(0, self.encoder(pixels.flatten(0, 1), generator).view(b, t, -1))
        if cfg.uses_block_pose:
            if block_pose is None:
                raise ValueError(f"this policy (obs_mode={cfg.obs_mode}) conditions on the block pose, but none was "
                                 "given; pass the observation's block_pose")
            theta = block_pose[..., 2:3].float()
            parts += [self.normalizer.normalize("block", block_pose[..., :2]), theta.sin(), theta.cos()]
        return torch.cat(parts, dim=-1).flatten(1)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.denoiser(x_t, t, cond)

    def scheduler(self) -> DDPMScheduler | DDIMScheduler | FlowMatchEulerScheduler:
        """The sampler cfg names, over the noise schedule the policy was trained with."""
        cfg = self.cfg
        if cfg.objective == "flow":
            return FlowMatchEulerScheduler(cfg.num_train_timesteps)
        schedule = NoiseSchedule(cfg.beta_schedule, cfg.num_train_timesteps)
        kind = DDIMScheduler if cfg.sampler == "ddim" else DDPMScheduler
        return kind(schedule, cfg.prediction_type, clip_sample=True, timestep_spacing="trailing")

    @torch.no_grad()
    def predict_action_chunk(self, pixels: torch.Tensor | None, agent_pos: torch.Tensor,
                             generator: torch.Generator | None = None, steps: int | None = None,
                             block_pose: torch.Tensor | None = None) -> torch.Tensor:
        """(B, horizon, action_dim) actions in env units for a batch of observation windows (as
        `encode_obs` takes them), sampled from N(0, I) noise drawn with `generator`."""
        cond = self.encode_obs(pixels, agent_pos, block_pose=block_pose)
        shape = (len(cond), self.cfg.horizon, self.cfg.action_dim)
        chunk = sample(self, self.scheduler(), shape, cond, steps or self.cfg.num_inference_steps,
                       generator=generator, precision="fp32")
        return self.normalizer.unnormalize("action", chunk.clamp(-1, 1))


def save_policy(state: dict[str, torch.Tensor], cfg: DiffusionPolicyConfig, path: str | Path,
                extra: dict | None = None) -> Path:
    """`path/config.json` ({"kind", "policy": cfg, **extra}) and `path/model.safetensors` (weights and
    normalisation statistics), written atomically."""
    return write_policy_dir(path, {"kind": KIND, "policy": config_dict(cfg), **(extra or {})}, state)


def write_policy_dir(path: str | Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """Any trained policy's folder: `config.json` (naming its "kind") + `model.safetensors`, written atomically."""
    with atomic_directory(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    return Path(path)


def read_policy_config(path: str | Path, kind: str) -> dict:
    """The config.json of a policy folder written by `write_policy_dir`, checked to be a `kind`."""
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    if config.get("kind") != kind:
        raise ValueError(f"{path}/config.json is a {config.get('kind')!r}, not a {kind}")
    return config


def load_diffusion_policy(path: str | Path, device: str | torch.device = "cpu") -> DiffusionPolicy:
    """The policy saved at `path` (a folder with config.json + model.safetensors), in eval mode."""
    path = Path(path)
    config = read_policy_config(path, KIND)
    policy = DiffusionPolicy(build_config(DiffusionPolicyConfig, config["policy"]))
    policy.load_state_dict(load_file(str(path / "model.safetensors")))
    return policy.to(device).eval()

