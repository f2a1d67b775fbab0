"""Sampling: the one loop that drives every scheduler, with classifier-free guidance, and the
grid of images `tokenmind diffusion sample` writes.

Classifier-free guidance (Ho & Salimans 2022) extrapolates from the unconditional prediction
towards the conditional one, out = uncond + w·(cond − uncond): w = 1 is the plain conditional
model, w > 1 trades diversity for samples that look more like their class. Both predictions come
from ONE forward pass over 2B rows (the images twice, with the class labels and then the null
class), which costs less than two passes of B rows on every device.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tokenmind.model.cpu import fastest_autocast
from tokenmind.progress import Bars
from tokenmind.train.objectives import autocast

from .config import DiffusionConfig
from .data import class_names
from .latent import data_shape, decoder
from .schedules import DDIMScheduler, DDPMScheduler, FlowMatchEulerScheduler, gaussian_like
from .train import ModelFactory, load_diffusion_model, noise_schedule

SAMPLERS = {"ddpm": ("ddpm", "ddim"), "flow": ("euler",)}  # by training objective
Scheduler = DDPMScheduler | DDIMScheduler | FlowMatchEulerScheduler


def make_scheduler(cfg: DiffusionConfig, sampler: str, eta: float = 0.0) -> Scheduler:
    """The scheduler `sampler` names, set up as the run was trained (schedule, prediction type)."""
    d = cfg.diffusion
    if sampler not in SAMPLERS[d.objective]:
        raise ValueError(f"a model trained with diffusion.objective={d.objective} samples with "
                         f"{' or '.join(SAMPLERS[d.objective])}, not {sampler!r}")
    if sampler == "euler":
        return FlowMatchEulerScheduler(d.num_train_timesteps, d.shift)
    if sampler == "ddim":
        return DDIMScheduler(noise_schedule(cfg), d.prediction_type, d.clip_sample, timestep_spacing=d.timestep_spacing,
                             eta=eta)
    return DDPMScheduler(noise_schedule(cfg), d.prediction_type, d.clip_sample, timestep_spacing=d.timestep_spacing)


def guided_output(model: nn.Module, x: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None,
                  guidance_scale: float, num_classes: int | None) -> torch.Tensor:
    """The model output at (x, t), with classifier-free guidance when guidance_scale ≠ 1 (one
    batched forward of the conditional and the null-class rows)."""
    if class_labels is None or guidance_scale == 1.0:
        return model(x, t, class_labels)
    if num_classes is None:
        raise ValueError("classifier-free guidance needs num_classes (the null class label)")
    null = torch.full_like(class_labels, num_classes)
    cond, uncond = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([class_labels, null])).chunk(2)
    return uncond + guidance_scale * (cond - uncond)


class _FrozenCompiled(nn.Module):
    """`model` (its parameters still visible) whose calls run a `torch.compile`d forward with
    inductor's freezing on. Freezing is switched on around each call rather than passed as
    `torch.compile(options=...)`: with the option, torch 2.13 runs the freezing pass but not its
    CPU weight packing, which reads the global config (measured: every linear stayed an addmm)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._forward = torch.compile(model.forward)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        from torch._inductor import config as inductor_config  # imported on use: a slow import

        with inductor_config.patch(freezing=True):
            return self._forward(*args)


def compile_for_sampling(model: nn.Module) -> nn.Module:
    """`model` under `torch.compile` for sampling: inductor fuses each block's norm, modulation,
    GELU and residual ops into a few loops, and with the weights frozen into the graph it
    pre-packs them for the CPU's matmul kernels (MKL's packed sgemm: about a quarter less time
    in the matmuls on an AVX2 EPYC; measured in docs/diffusion.md). Frozen means the weights are
    read once: compile again after changing them. The first call compiles (about half a minute
    on a CPU)."""
    return _FrozenCompiled(model)


@torch.no_grad()
def sample(model: nn.Module, scheduler: Scheduler, shape: tuple[int, ...], class_labels: torch.Tensor | None = None,
           steps: int = 50, guidance_scale: float = 1.0, generator: torch.Generator | None = None, *,
           num_classes: int | None = None, precision: str = "auto", progress: bool = False) -> torch.Tensor:
    """Images (B, C, H, W) = `shape` generated in `steps` scheduler steps from N(0, I) noise drawn
    with `generator` (as are DDPM's and η > 0 DDIM's step noises: one seed, one result).

    class_labels: (B,) labels, or None for an unconditional model. guidance_scale: classifier-free
    guidance weight (needs num_classes, the model's null label). precision: fp32 or bf16 autocast, or
    auto: the faster of the two on the model's device (`fastest_autocast`). `model` may be a
    `torch.compile`d module (its first call compiles; then each step runs the compiled forward)."""
    if class_labels is not None and len(class_labels) != shape[0]:
        raise ValueError(f"{len(class_labels)} class labels for a batch of {shape[0]} images")
    device = next(model.parameters()).device
    precision = fastest_autocast(device.type) if precision == "auto" else precision
    x = gaussian_like(torch.empty(shape, device=device), generator)
    labels = class_labels.to(device) if class_labels is not None else None
    points = scheduler.timesteps(steps)
    with Bars(progress) as bars:
        advance = bars.add("sampling", steps)
        for t, t_next in zip(points[:-1], points[1:]):
            model_t = torch.full((shape[0],), scheduler.model_time(t), device=device)
            with autocast(x.device, precision):
                out = guided_output(model, x, model_t, labels, guidance_scale, num_classes)
            x = scheduler.step(out.float(), t, t_next, x, generator=generator)
            if advance is not None:
                advance()
    return x


def to_pixels(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [−1, 1] → uint8 (B, H, W, C)."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def image_grid(images: torch.Tensor, nrow: int | None = None) -> np.ndarray:
    """(B, C, H, W) in [−1, 1] → one uint8 (rows·H + gaps, cols·W + gaps[, 3]) picture, 2-pixel gaps."""
    b, c, h, w = images.shape
    nrow = nrow or math.ceil(math.sqrt(b))
    ncol = math.ceil(b / nrow)
    pixels = to_pixels(images)
    grid = np.zeros((ncol * (h + 2) + 2, nrow * (w + 2) + 2, c), dtype=np.uint8)
    for i, img in enumerate(pixels):
        r, col = divmod(i, nrow)
        grid[2 + r * (h + 2):2 + r * (h + 2) + h, 2 + col * (w + 2):2 + col * (w + 2) + w] = img
    return grid[..., 0] if c == 1 else grid


def save_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None, scale: int = 1) -> Path:
    """Write `image_grid(images)` as a PNG, each pixel `scale`× larger, atomically."""
    from PIL import Image  # pillow comes with matplotlib

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = Image.fromarray(image_grid(images, nrow))
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    tmp = path.with_name(f".{path.name}.tmp")
    picture.save(tmp, format="PNG")
    tmp.replace(path)
    return path


def encode_png(images: torch.Tensor) -> list[bytes]:
    """Each image of (B, C, H, W) in [−1, 1] as the bytes of its own H×W PNG file (grey or RGB)."""
    from PIL import Image

    pictures = []
    for pixels in to_pixels(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buffer, format="PNG")
        pictures.append(buffer.getvalue())
    return pictures


def class_label(cfg: DiffusionConfig, name: str) -> int:
    """The label of a class name (or its index as text) in the run's data set. Names match
    case-insensitively, with spaces or underscores for hyphens ("Ankle boot" is ankle-boot)."""
    names = class_names(cfg.data.dataset)
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    if key in names:
        return names.index(key)
    if name.isdigit() and int(name) < len(names):
        return int(name)
    raise ValueError(f"unknown class {name!r} for {cfg.data.dataset}; choose one of {', '.join(names)}")


def generate(model_dir: str | Path, out: str | Path, class_name: str | None = None, n: int = 16, steps: int = 50,
             sampler: str = "ddpm", guidance_scale: float = 3.0, eta: float = 0.0, seed: int = 0,
             device: str = "cpu", model_factory: ModelFactory | None = None, progress: bool = True) -> Path:
    """Sample n images from a trained run and write them as a PNG grid; behind `tokenmind diffusion
    sample`. class_name: one class for every image, or None for n images cycling over all classes."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    model, cfg = load_diffusion_model(model_dir, model_factory, device)
    num_classes = len(class_names(cfg.data.dataset))
    labels = torch.full((n,), class_label(cfg, class_name)) if class_name else torch.arange(n) % num_classes
    scheduler = make_scheduler(cfg, sampler, eta)
    generator = torch.Generator().manual_seed(seed)
    shape = data_shape(cfg.data.dataset, cfg.data.pad_to, cfg.diffusion.latent_vae)  # pixels or latents
    samples = sample(model, scheduler, (n, *shape), labels, steps, guidance_scale, generator,
                     num_classes=num_classes, progress=progress)
    return save_grid(decoder(cfg.diffusion.latent_vae, device)(samples), out, scale=4)
