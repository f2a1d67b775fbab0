"""A small convolutional VAE (Kingma & Welling) whose latents a DiT learns to denoise: latent
diffusion (Rombach et al.) on a 16x smaller grid than the pixels (1×28×28 → 4×7×7).

The encoder maps an image to the mean and log-variance of a diagonal Gaussian over latents; a
latent is drawn as z = mean + exp(logvar/2)·ε with ε ~ N(0, I) (the reparameterisation trick: the
randomness is an input, so gradients flow through mean and logvar); the decoder maps z back to an
image. The loss per image is

    reconstruction: Σ over pixels of (decoded − x)²  (squared error on images in [−1, 1], i.e. a
                    Gaussian decoder of fixed variance)
    KL:             KL(N(mean, σ²) ‖ N(0, I)) = ½ Σ over latent entries of (mean² + σ² − 1 − log σ²)
    loss = reconstruction + kl_weight · KL

and both terms are reported apart. A kl_weight below 1 (a β-VAE) keeps the reconstructions
sharp — what latent diffusion needs, since the decoder bounds the quality of every sample — while
the KL term still keeps the latents near a unit Gaussian and smooth. Their overall scale still
drifts, so the latent diffusion model sees latents × `scaling_factor`, 1 / (the standard deviation
of encoded training latents), computed once after training as the latent diffusion paper does:
the diffusion schedules assume data of roughly unit variance.

The encoder and decoder are built from the U-Net's `ResBlock` (no conditioning vector), with
strided convolutions down and nearest-neighbour upsampling + convolution up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmind.train.objectives import LossTerms, autocast

from .unet import ResBlock
from .weights import read_weights_dir, save_weights_dir

CLASS_NAME = "TokenmindVAE"


@dataclass
class VAEConfig:
    """A VAE's shape. sample_size, in_channels: the images. latent_channels: channels of the
    latent grid, whose side is sample_size / 2^(len(channel_mults) - 1). base_channels ×
    channel_mults[i]: the width at level i. groups: GroupNorm groups. scaling_factor: what latents
    are multiplied by for the diffusion model (`calibrate_scaling_factor`; 1 until calibrated)."""

    sample_size: int = 28
    in_channels: int = 1
    latent_channels: int = 4
    base_channels: int = 32
    channel_mults: tuple[int, ...] = (1, 2, 2)
    groups: int = 8
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        self.channel_mults = tuple(self.channel_mults)
        factor = 2 ** (len(self.channel_mults) - 1)
        if self.sample_size % factor:
            raise ValueError(f"sample_size {self.sample_size} does not halve {len(self.channel_mults) - 1} times; "
                             "use fewer channel_mults levels")
        if self.scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be > 0, got {self.scaling_factor}")

    @property
    def latent_size(self) -> int:
        return self.sample_size // 2 ** (len(self.channel_mults) - 1)


@dataclass
class DiagonalGaussian:
    """The encoder's posterior q(z | x): mean and log-variance, both (B, latent_channels, h, w)."""

    mean: torch.Tensor
    logvar: torch.Tensor

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """mean + σ·ε, ε ~ N(0, I) drawn with `generator` (the reparameterisation trick)."""
        noise = torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.mean + torch.exp(0.5 * self.logvar) * noise

    def kl(self) -> torch.Tensor:
        """KL(q ‖ N(0, I)) per image, (B,), summed over the latent entries, in fp32."""
        mean, logvar = self.mean.float(), self.logvar.float()
        return 0.5 * (mean.square() + logvar.exp() - 1 - logvar).flatten(1).sum(dim=1)


class VAE(nn.Module):
    """encode(x) → DiagonalGaussian; decode(z) → x̂; to_latents / from_latents for the diffusion
    model's scaled latent space."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        widths, g = [cfg.base_channels * m for m in cfg.channel_mults], cfg.groups
        self.encoder_in = nn.Conv2d(cfg.in_channels, widths[0], 3, padding=1)
        encoder, width = [], widths[0]
        for level, out in enumerate(widths):
            encoder.append(ResBlock(width, out, g))
            width = out
            if level < len(widths) - 1:
                encoder.append(nn.Conv2d(width, width, 3, stride=2, padding=1))
        self.encoder = nn.Sequential(*encoder, ResBlock(width, width, g), nn.GroupNorm(g, width), nn.SiLU(),
                                     nn.Conv2d(width, 2 * cfg.latent_channels, 3, padding=1))
        decoder = [nn.Conv2d(cfg.latent_channels, width, 3, padding=1), ResBlock(width, width, g)]
        for level, out in reversed(list(enumerate(widths))):
            decoder.append(ResBlock(width, out, g))
            width = out
            if level > 0:
                decoder += [nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(width, width, 3, padding=1)]
        self.decoder = nn.Sequential(*decoder, nn.GroupNorm(g, width), nn.SiLU(),
                                     nn.Conv2d(width, cfg.in_channels, 3, padding=1))

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        cfg = self.cfg
        if x.shape[1:] != (cfg.in_channels, cfg.sample_size, cfg.sample_size):
            raise ValueError(f"the VAE encodes (B, {cfg.in_channels}, {cfg.sample_size}, {cfg.sample_size}) images, "
                             f"got {tuple(x.shape)}; check VAEConfig.sample_size (pad 28 → 32?)")
        mean, logvar = self.encoder(self.encoder_in(x)).chunk(2, dim=1)
        return DiagonalGaussian(mean, logvar.clamp(-30.0, 20.0))  # keeps exp(logvar) finite early in training

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor,
                                                                                            DiagonalGaussian]:
        """(reconstruction of x from a sampled latent, the posterior)."""
        posterior = self.encode(x)
        return self.decode(posterior.sample(generator)), posterior

    @torch.no_grad()
    def to_latents(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The diffusion model's data: a latent sampled with `generator` (its mean without one),
        times scaling_factor."""
        posterior = self.encode(x)
        z = posterior.sample(generator) if generator is not None else posterior.mean
        return z * self.cfg.scaling_factor

    @torch.no_grad()
    def from_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Images from the diffusion model's (scaled) latents."""
        return self.decode(z / self.cfg.scaling_factor)


def vae_loss(model: VAE, images: torch.Tensor, generator: torch.Generator | None,
             precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """(reconstruction, KL), each summed over the batch's images (see the module docstring), fp32."""
    with autocast(images.device, precision):
        decoded, posterior = model(images, generator)
    reconstruction = (decoded.float() - images.float()).square().sum()
    return reconstruction, posterior.kl().sum()


class VAEObjective:
    """The VAE's loss on the trainer's `Objective` seam, over image batches (`images` in [−1, 1],
    (B, C, H, W); `noise_seed` seeds the latent draw, so a batch's loss depends on the batch alone).
    The units are images; "reconstruction" and "kl" are logged apart, per image."""

    def __init__(self, kl_weight: float = 1e-3, loss_fn=vae_loss) -> None:
        if kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {kl_weight}")
        self.kl_weight, self.loss_fn = kl_weight, loss_fn

    def __call__(self, model: nn.Module, batch: Any, precision: str) -> LossTerms:
        generator = torch.Generator(batch.images.device).manual_seed(batch.noise_seed)
        reconstruction, kl = self.loss_fn(model, batch.images, generator, precision)
        return LossTerms(reconstruction + self.kl_weight * kl, len(batch.images),
                         {"reconstruction": reconstruction.detach(), "kl": kl.detach()})

    def compiled(self) -> VAEObjective:
        return VAEObjective(self.kl_weight, torch.compile(vae_loss))


@torch.no_grad()
def calibrate_scaling_factor(model: VAE, images: torch.Tensor, generator: torch.Generator | None = None,
                             batch_size: int = 256) -> float:
    """Set (and return) model.cfg.scaling_factor = 1 / std of sampled latents of `images`, so the
    diffusion model sees latents of unit variance."""
    latents = torch.cat([model.encode(images[i:i + batch_size]).sample(generator)
                         for i in range(0, len(images), batch_size)])
    model.cfg = dataclasses.replace(model.cfg, scaling_factor=1.0 / latents.float().std().item())
    return model.cfg.scaling_factor


def save_vae(model: VAE, path: str | Path) -> Path:
    """config.json (the `VAEConfig`, scaling factor included) + weights, atomically."""
    return save_weights_dir(path, CLASS_NAME, asdict(model.cfg), model.state_dict())


def load_vae(path: str | Path) -> VAE:
    config, state = read_weights_dir(path, CLASS_NAME)
    model = VAE(VAEConfig(**config))
    model.load_state_dict(state)
    return model.eval()
