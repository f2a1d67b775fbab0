"""The configs of the vision runs: a ViT classifier (`ViTRunConfig`) and CLIP-style contrastive
training (`ClipRunConfig`), each the trainer's optim/schedule/train sections next to its own,
loaded by the project's one config loader (YAML, then `section.key=value` overrides). The data
section is the diffusion runs' (`ImageDataSection`: data set, batch size, padding), and the image
size, channels and class count come from the data, not from the model section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenmind.config import Overrides
from tokenmind.config import load_config as load_schema
from tokenmind.diffusion.config import DiffusionTrainSection, ImageDataSection
from tokenmind.diffusion.data import image_shape
from tokenmind.train.config import OptimSection, ScheduleSection, check_schedule_fits

from .vit import POOLS, ViTConfig


@dataclass
class ViTSection:
    """The ViT's shape (`ViTConfig` less what the data decide: image size, channels, classes)."""

    patch_size: int = 4
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    pool: str = "cls"

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"model.pool={self.pool!r} is not one of {', '.join(POOLS)}")


def vit_config(model: ViTSection, data: ImageDataSection, num_classes: int) -> ViTConfig:
    """The `ViTConfig` of a run: the model section's shape for the data set's (padded) images."""
    channels, size, _ = image_shape(data.dataset, data.pad_to)
    if size % model.patch_size:
        raise ValueError(f"model.patch_size={model.patch_size} does not divide the {size}x{size} images of "
                         f"{data.dataset}; pick a divisor or pad with data.pad_to")
    return ViTConfig(image_size=size, in_channels=channels, num_classes=num_classes, patch_size=model.patch_size,
                     hidden_size=model.hidden_size, num_layers=model.num_layers, num_heads=model.num_heads,
                     intermediate_size=model.intermediate_size, pool=model.pool)


@dataclass
class ViTTrainSection(DiffusionTrainSection):
    out_dir: str = "runs/vision/vit"


@dataclass
class ViTRunConfig:
    """A ViT classifier run: the ViT, the labelled images, and the trainer's sections."""

    model: ViTSection = field(default_factory=ViTSection)
    data: ImageDataSection = field(default_factory=ImageDataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: ViTTrainSection = field(default_factory=ViTTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


@dataclass
class ClipSection:
    """The contrastive objective and its text side.

    encoder: the sentence encoder that embeds the captions once (`model.encoder.load_encoder`;
        `minilm` is all-MiniLM-L6-v2 from PyPI). captions_per_class: distinct generated captions
        per class (`captions.caption_bank`), each image drawing one per step. embed_dim: the
        shared space the image and text projections map into. init_temperature: the softmax
        temperature τ at the start (CLIP: 0.07); 1/τ is learned, capped at max_logit_scale.
    mask_same_class: leave other images of the same class out of each softmax (they are not
        negatives: their captions describe this image too); false is plain CLIP.
    zero_shot_template: the prompt per class zero-shot classification matches images against.
    eval_images: test images zero-shot classified at every validation (0 = only at the end,
        where the whole test split is).
    """

    encoder: str = "minilm"
    captions_per_class: int = 64
    embed_dim: int = 128
    init_temperature: float = 0.07
    max_logit_scale: float = 100.0
    mask_same_class: bool = True
    zero_shot_template: str = "a photo of {a} {noun}."
    eval_images: int = 1000

    def __post_init__(self) -> None:
        if self.captions_per_class < 1 or self.embed_dim < 1 or self.eval_images < 0:
            raise ValueError("clip.captions_per_class and clip.embed_dim must be >= 1, clip.eval_images >= 0")
        if not 0 < self.init_temperature < 1 or self.max_logit_scale < 1 / self.init_temperature:
            raise ValueError(f"clip.init_temperature must be in (0, 1) and clip.max_logit_scale >= 1/temperature, "
                             f"got {self.init_temperature} and {self.max_logit_scale}")


@dataclass
class ClipTrainSection(DiffusionTrainSection):
    out_dir: str = "runs/vision/clip"


@dataclass
class ClipRunConfig:
    """A CLIP-style run: the ViT (no classification head), the contrastive objective, the images."""

    model: ViTSection = field(default_factory=ViTSection)
    clip: ClipSection = field(default_factory=ClipSection)
    data: ImageDataSection = field(default_factory=ImageDataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: ClipTrainSection = field(default_factory=ClipTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_vit_run_config(path: str | Path | None = None, overrides: Overrides = ()) -> ViTRunConfig:
    """defaults ← YAML file (if given) ← `section.key=value` overrides, validated."""
    return load_schema(ViTRunConfig, path, overrides)


def load_clip_run_config(path: str | Path | None = None, overrides: Overrides = ()) -> ClipRunConfig:
    """defaults ← YAML file (if given) ← `section.key=value` overrides, validated."""
    return load_schema(ClipRunConfig, path, overrides)
