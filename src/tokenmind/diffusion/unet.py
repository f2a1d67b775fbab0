"""A small class-conditional U-Net, the convolutional baseline next to the DiT (DDPM's denoiser).

Residual blocks with GroupNorm at each resolution; the down path halves the resolution with a
strided convolution, the up path doubles it (nearest neighbour + convolution) and concatenates
the down path's activations of the same resolution (skip connections), so fine detail does not
have to squeeze through the bottleneck. The timestep + class vector (`TimestepClassEmbedding`,
the DiT's too) is projected and added inside every residual block; self-attention (through the
LLM's `attend`, bidirectional) runs at the resolutions `UNetConfig.attention_levels` marks, usually
the lowest, where H·W tokens are few. The last convolution of each residual branch and the output
layer start at zero, so the network starts as identity-ish blocks with a zero prediction, like the
DiT's adaLN-Zero. Same interface as `DiT`: model(x, t, class_labels) → (B, C_out, H, W).

`ResBlock` without a conditioning vector is also the VAE's building block (`vae.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmind.model.attention import DenseMask, attend

from .embeddings import TimestepClassEmbedding
from .weights import read_weights_dir, save_weights_dir

CLASS_NAME = "TokenmindUNet"


@dataclass
class UNetConfig:
    """A U-Net's shape.

    sample_size: height = width of the input; must halve cleanly len(channel_mults) - 1 times.
    in_channels / out_channels (0: same as in). base_channels × channel_mults[i]: the width at
    level i (level 0 is full resolution). num_res_blocks: residual blocks per level on the way down
    (one more on the way up, which also consumes the level's downsampled skip).
    attention_levels: levels with self-attention after each residual block (and always in the middle).
    num_classes: labels 0..num_classes-1, num_classes = the null label. groups: GroupNorm groups.
    """

    sample_size: int = 28
    in_channels: int = 1
    out_channels: int = 0
    base_channels: int = 32
    channel_mults: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 1
    attention_levels: tuple[int, ...] = field(default_factory=lambda: (2,))
    num_heads: int = 4
    num_classes: int = 10
    groups: int = 8

    def __post_init__(self) -> None:
        self.channel_mults, self.attention_levels = tuple(self.channel_mults), tuple(self.attention_levels)
        factor = 2 ** (len(self.channel_mults) - 1)
        if self.sample_size % factor:
            raise ValueError(f"sample_size {self.sample_size} does not halve {len(self.channel_mults) - 1} times; "
                             "use fewer channel_mults levels or pad the images")
        for mult in self.channel_mults:
            if (self.base_channels * mult) % self.groups:
                raise ValueError(f"width {self.base_channels * mult} is not divisible by groups={self.groups}")
        if any(not 0 <= level < len(self.channel_mults) for level in self.attention_levels):
            raise ValueError(f"attention_levels {self.attention_levels} must be level indices < "
                             f"{len(self.channel_mults)}")
        if self.out_channels == 0:
            self.out_channels = self.in_channels

    @property
    def embed_dim(self) -> int:
        return 4 * self.base_channels


class ResBlock(nn.Module):
    """GroupNorm → SiLU → conv, (+ projected conditioning), GroupNorm → SiLU → conv (zero init),
    added to the input (through a 1×1 convolution when the width changes)."""

    def __init__(self, channels: int, out_channels: int, groups: int, embed_dim: int | None = None):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, out_channels, 3, padding=1)
        self.emb_proj = nn.Linear(embed_dim, out_channels) if embed_dim else None
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(channels, out_channels, 1) if channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        if self.emb_proj is not None:
            h = h + self.emb_proj(F.silu(emb))[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class SelfAttention2d(nn.Module):
    """Every pixel attends to every pixel of its image: GroupNorm, 1×1 q/k/v, `attend`, 1×1 out
    (zero init), residual."""

    def __init__(self, channels: int, groups: int, num_heads: int):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"attention width {channels} is not divisible by num_heads={num_heads}")
        self.n_heads = num_heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        qkv = self.qkv(self.norm(x)).flatten(2).transpose(1, 2)  # (B, H·W, 3C)
        q, k, v = qkv.view(B, H * W, 3, self.n_heads, C // self.n_heads).unbind(2)
        out = attend(q, k, v, DenseMask(None, causal=False), None, 0, scale=(C // self.n_heads) ** -0.5,
                     softcap=None, window=None)
        return x + self.proj(out.reshape(B, H * W, C).transpose(1, 2).reshape(B, C, H, W))


class UNet(nn.Module):
    """model(x (B, C, H, W), t (B,) float, class_labels (B,) long or None) → (B, C_out, H, W)."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        widths = [cfg.base_channels * m for m in cfg.channel_mults]
        g, E = cfg.groups, cfg.embed_dim
        self.conditioning = TimestepClassEmbedding(E, cfg.num_classes)
        self.conv_in = nn.Conv2d(cfg.in_channels, widths[0], 3, padding=1)

        def attention(level: int, width: int) -> nn.Module:
            return SelfAttention2d(width, g, cfg.num_heads) if level in cfg.attention_levels else nn.Identity()

        self.down, skip_widths, width = nn.ModuleList(), [widths[0]], widths[0]
        for level, out in enumerate(widths):
            stage = nn.ModuleList()
            for _ in range(cfg.num_res_blocks):
                stage.append(nn.ModuleList([ResBlock(width, out, g, E), attention(level, out)]))
                width = out
                skip_widths.append(width)
            if level < len(widths) - 1:
                stage.append(nn.Conv2d(width, width, 3, stride=2, padding=1))
                skip_widths.append(width)
            self.down.append(stage)
        self.mid = nn.ModuleList([ResBlock(width, width, g, E), SelfAttention2d(width, g, cfg.num_heads),
                                  ResBlock(width, width, g, E)])
        self.up = nn.ModuleList()
        for level, out in reversed(list(enumerate(widths))):
            stage = nn.ModuleList()
            for _ in range(cfg.num_res_blocks + 1):
                stage.append(nn.ModuleList([ResBlock(width + skip_widths.pop(), out, g, E), attention(level, out)]))
                width = out
            if level > 0:
                stage.append(nn.Conv2d(width, width, 3, padding=1))  # after a nearest-neighbour 2x upsample
            self.up.append(stage)
        self.norm_out = nn.GroupNorm(g, width)
        self.conv_out = nn.Conv2d(width, cfg.out_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        if x.shape[1:] != (cfg.in_channels, cfg.sample_size, cfg.sample_size):
            raise ValueError(f"UNet expects (B, {cfg.in_channels}, {cfg.sample_size}, {cfg.sample_size}) inputs, "
                             f"got {tuple(x.shape)}; check UNetConfig.in_channels/sample_size")
        emb = self.conditioning(t, class_labels)
        h = self.conv_in(x)
        skips = [h]
        for stage in self.down:
            for layer in stage:
                if isinstance(layer, nn.Conv2d):  # the downsampling convolution
                    h = layer(h)
                else:
                    res, attn = layer
                    h = attn(res(h, emb))
                skips.append(h)
        h = self.mid[2](self.mid[1](self.mid[0](h, emb)), emb)
        for stage in self.up:
            for layer in stage:
                if isinstance(layer, nn.Conv2d):
                    h = layer(F.interpolate(h, scale_factor=2.0, mode="nearest"))
                else:
                    res, attn = layer
                    h = attn(res(torch.cat([h, skips.pop()], dim=1), emb))
        return self.conv_out(F.silu(self.norm_out(h)))


def save_unet(model: UNet, path: str | Path) -> Path:
    """config.json (the `UNetConfig`) + weights, atomically (`weights.save_weights_dir`)."""
    return save_weights_dir(path, CLASS_NAME, asdict(model.cfg), model.state_dict())


def load_unet(path: str | Path) -> UNet:
    config, state = read_weights_dir(path, CLASS_NAME)
    model = UNet(UNetConfig(**config))
    model.load_state_dict(state)
    return model.eval()
