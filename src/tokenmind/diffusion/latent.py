"""Latent diffusion (Rombach et al. 2022): the denoiser learns the scaled latents of a trained VAE
instead of pixels, and samples are decoded back to images.

A run with `diffusion.latent_vae: PATH` (a `tokenmind diffusion train-vae` run or its `final/`)
sees each image as its posterior mean × scaling_factor: 1×28×28 pixels become 4×7×7 latents of
about unit variance, which a DiT with patch_size 1 reads as 49 tokens. The mean, not a sample, is
encoded: it is a fixed function of the image, so each split is encoded once and cached as
`<vae>/latents/<dataset>-<split>.safetensors` (saving a VAE replaces its whole folder, so a cache
never outlives its weights). Sampling runs the same schedulers on the latents;
`decoder(cfg)` maps the result to pixels.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .data import image_shape, load_split, to_model_range
from .vae import VAE, load_vae


def find_vae(path: str | Path) -> Path:
    """The VAE folder of a `train-vae` run folder (its final/) or the folder itself."""
    for folder in (Path(path), Path(path) / "final"):
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(f"diffusion.latent_vae={str(path)!r} holds no VAE; pass the run folder of "
                            "`tokenmind diffusion train-vae` or its final/ folder")


@torch.no_grad()
def encode_images(vae: VAE, images: torch.Tensor, pad_to: int = 0, batch_size: int = 500) -> torch.Tensor:
    """uint8 images (N, H, W) → the diffusion model's data: posterior means × scaling_factor,
    float (N, latent_channels, h, w)."""
    vae.eval()
    return torch.cat([vae.to_latents(to_model_range(images[i:i + batch_size], pad_to))
                      for i in range(0, len(images), batch_size)])


def latent_split(vae_path: str | Path, dataset: str, split: str, pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, labels) of a data set's split under the VAE at vae_path, encoded on first use and
    cached in the VAE's folder."""
    folder = find_vae(vae_path)
    cached = folder / "latents" / f"{dataset}-pad{pad_to}-{split}.safetensors"
    images, labels = load_split(dataset, split)
    if cached.is_file():
        latents = load_file(str(cached))["latents"]
        if len(latents) == len(labels):
            return latents, labels
    latents = encode_images(load_vae(folder), images, pad_to)
    cached.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({"latents": latents.contiguous()}, tmp)
        os.replace(tmp, cached)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return latents, labels


def check_vae_fits(vae: VAE, dataset: str, pad_to: int) -> None:
    c, h, _ = image_shape(dataset, pad_to)
    if (vae.cfg.in_channels, vae.cfg.sample_size) != (c, h):
        raise ValueError(f"the VAE encodes {vae.cfg.in_channels}×{vae.cfg.sample_size}² images but {dataset} "
                         f"(pad_to={pad_to}) has {c}×{h}²; train the VAE on the same data.dataset and data.pad_to")


def data_shape(dataset: str, pad_to: int, latent_vae: str) -> tuple[int, int, int]:
    """(C, H, W) of what the denoiser sees: the images, or their latents under latent_vae."""
    if not latent_vae:
        return image_shape(dataset, pad_to)
    vae = load_vae(find_vae(latent_vae))
    check_vae_fits(vae, dataset, pad_to)
    return vae.cfg.latent_channels, vae.cfg.latent_size, vae.cfg.latent_size


def decoder(latent_vae: str, device: str | torch.device = "cpu") -> Callable[[torch.Tensor], torch.Tensor]:
    """What turns the denoiser's samples into images in [−1, 1]: the identity for a pixel model,
    the VAE's decoder (of the unscaled latents) for a latent one."""
    if not latent_vae:
        return lambda x: x
    return load_vae(find_vae(latent_vae)).to(device).from_latents
