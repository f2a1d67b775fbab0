"""The conditioning every denoiser here shares: a diffusion timestep and a class label become one
vector, and image patches get 2-D positions.

The timestep is a float (DDPM: 0..T-1; flow matching: t·1000), embedded with sinusoids over
geometrically spaced frequencies and then an MLP, as in DDPM / DiT; the class is a row of a table
with one extra row, index num_classes, for "no class": the null label classifier-free guidance
trains with and samples against. Label dropout is the objective's job, not the model's: the model
embeds exactly the labels it is given (diffusers' `LabelEmbedding` drops labels itself in train
mode; ours never does, so training and evaluation see the same function).

The formulas follow diffusers' `get_timestep_embedding` (cos first, frequency exponent divided by
half - 1) and `get_2d_sincos_pos_embed` (column coordinate in the first half of the channels, sines
before cosines, computed in float64), so weights trained there give identical outputs here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TIMESTEP_CHANNELS = 256  # the sinusoid width fed to the timestep MLP (DiT's frequency_embedding_size)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(B,) float timesteps → (B, dim) [cos | sin] features; frequencies 1 … 1/max_period."""
    if t.ndim != 1:
        raise ValueError(f"timesteps must be a 1-D (B,) tensor, got shape {tuple(t.shape)}; pass one float per image")
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1)
    angles = t.float()[:, None] * torch.exp(exponent)[None]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def sincos_2d_positions(dim: int, grid: int) -> torch.Tensor:
    """Fixed positions of a grid × grid patch layout, row-major: (grid², dim) float32. Half the
    channels encode the column, half the row, each as [sin | cos] over dim/4 frequencies."""
    if dim % 4:
        raise ValueError(f"sin-cos 2-D positions need a width divisible by 4, got {dim}; change hidden_size "
                         "or use learned positions")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    coords = torch.arange(grid, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()


class TimestepClassEmbedding(nn.Module):
    """(t, class_labels) → (B, dim): MLP(sinusoids(t)) + table[class]. class_labels None means
    unconditional: every image gets the null row (index num_classes)."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.num_classes = num_classes
        self.linear_1 = nn.Linear(TIMESTEP_CHANNELS, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.class_embedder = nn.Embedding(num_classes + 1, dim)

    def forward(self, t: torch.Tensor, class_labels: torch.Tensor | None) -> torch.Tensor:
        if class_labels is None:
            class_labels = torch.full_like(t, self.num_classes, dtype=torch.long)
        elif class_labels.shape != t.shape:
            raise ValueError(f"class_labels has shape {tuple(class_labels.shape)} but timesteps {tuple(t.shape)}; "
                             "pass one label per image (num_classes for 'no class')")
        freq = timestep_embedding(t, TIMESTEP_CHANNELS).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(freq))) + self.class_embedder(class_labels)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """DiT's recipe: normal(0, 0.02) for the MLP's matrices and the class table, zero biases."""
        for p in (self.linear_1.weight, self.linear_2.weight, self.class_embedder.weight):
            nn.init.normal_(p, 0.0, 0.02, generator=generator)
        nn.init.zeros_(self.linear_1.bias)
        nn.init.zeros_(self.linear_2.bias)
