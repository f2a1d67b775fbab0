"""CLIP-style contrastive learning (Radford et al. 2021) of a ViT against caption embeddings.

Image side: the ViT's pooled feature through a linear projection; text side: a caption's sentence
embedding (all-MiniLM-L6-v2, `model/encoder.py`, computed once per caption and cached — the encoder
stays frozen) through a linear projection; both scaled to unit length in a shared `embed_dim`
space. For a batch of B (image, caption) pairs the logits are s·cos(image_i, caption_j), with the
scale s = 1/τ learned (stored as log s, CLIP's `logit_scale`, capped at 100), and the loss is the
symmetric InfoNCE: cross-entropy over each row (which caption is image i's?) and each column (which
image is caption j's?), averaged.

Fashion-MNIST has ten classes, so a batch of 128 holds ~13 images of each, and the caption drawn
for another sneaker describes this sneaker just as well: plain CLIP pushes such pairs apart as
negatives. Each image draws its own caption, and with `mask_same_class` (the default) the other
same-class pairs are left out of both softmaxes, so every negative is of another class.

Zero-shot classification embeds one prompt per class ("a photo of a sneaker.") and labels an image
with the class whose prompt is closest; no class head is trained.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.diffusion.data import ImageBatch
from tokenmind.model.checkpoint import atomic_directory
from tokenmind.train.objectives import LossTerms, autocast

from .vit import ViT, load_vit, write_vit

HEAD_CONFIG = "clip.json"
HEAD_WEIGHTS = "clip.safetensors"


@dataclass
class ClipHeadConfig:
    """text_dim: the sentence encoder's width; embed_dim: the shared space; init_temperature: τ at
    the start; max_logit_scale: the cap on 1/τ; encoder: which sentence encoder the text features
    come from (what embeds new prompts at inference)."""

    text_dim: int
    embed_dim: int = 128
    init_temperature: float = 0.07
    max_logit_scale: float = 100.0
    encoder: str = "minilm"


class CLIP(nn.Module):
    """A ViT and two projections into one space: `forward(pixel_values, text_features)` → the
    (B_images, N_texts) logits s·cos."""

    def __init__(self, vision: ViT, cfg: ClipHeadConfig):
        super().__init__()
        self.cfg, self.vision = cfg, vision
        self.visual_projection = nn.Linear(vision.cfg.hidden_size, cfg.embed_dim, bias=False)
        self.text_projection = nn.Linear(cfg.text_dim, cfg.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / cfg.init_temperature)))
        for proj in (self.visual_projection, self.text_projection):
            nn.init.normal_(proj.weight, std=proj.in_features ** -0.5)

    def image_embeds(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) → unit vectors (B, embed_dim)."""
        return F.normalize(self.visual_projection(self.vision.pooled(pixel_values)).float(), dim=-1)

    def text_embeds(self, text_features: torch.Tensor) -> torch.Tensor:
        """Sentence embeddings (N, text_dim) → unit vectors (N, embed_dim)."""
        return F.normalize(self.text_projection(text_features).float(), dim=-1)

    def scale(self) -> torch.Tensor:
        """s = 1/τ, capped (CLIP clips log s at log 100 so training cannot sharpen without bound)."""
        return self.logit_scale.exp().clamp(max=self.cfg.max_logit_scale)

    def forward(self, pixel_values: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        return self.scale() * self.image_embeds(pixel_values) @ self.text_embeds(text_features).T


def clip_loss(logits: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over the B pairs of ½·(row cross-entropy + column cross-entropy), how many images' best
    caption is of their own class) for logits (B, B) whose diagonal holds the true pairs.

    labels (B,): leave the other pairs of the same class out of every softmax (false negatives);
    None: plain CLIP, every other pair a negative."""
    B = logits.shape[0]
    target = torch.arange(B, device=logits.device)
    predicted = logits.argmax(dim=1)
    correct = (predicted == target) if labels is None else (labels[predicted] == labels)
    if labels is not None:
        same_class_negative = (labels[:, None] == labels[None, :]) & ~torch.eye(B, dtype=torch.bool,
                                                                                device=logits.device)
        logits = logits.masked_fill(same_class_negative, float("-inf"))
    loss = 0.5 * (F.cross_entropy(logits, target, reduction="sum") + F.cross_entropy(logits.T, target, reduction="sum"))
    return loss, correct.sum()


def contrastive_loss(model: CLIP, pixel_values: torch.Tensor, text_features: torch.Tensor, labels: torch.Tensor | None,
                     precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`clip_loss` of the model's logits for paired images and caption features, in fp32."""
    with autocast(pixel_values.device, precision):
        logits = model(pixel_values, text_features)
    return clip_loss(logits.float(), labels)


class ClipObjective:
    """Symmetric InfoNCE on `ImageBatch`es: each image draws one of its class's captions (seeded by
    the batch's noise_seed, so a resumed run draws the same), whose cached sentence embedding is its
    text. Units are images; metrics: `accuracy` (the image's best in-batch caption is of its class)
    and `temperature` τ."""

    def __init__(self, caption_features: torch.Tensor, caption_labels: torch.Tensor, mask_same_class: bool = True,
                 loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = contrastive_loss) -> None:
        if caption_features.shape[0] != caption_labels.shape[0]:
            raise ValueError(f"{caption_features.shape[0]} caption embeddings for {caption_labels.shape[0]} labels")
        self.caption_features, self.caption_labels = caption_features, caption_labels
        self.mask_same_class, self.loss_fn = mask_same_class, loss_fn
        counts = torch.bincount(caption_labels)
        if (counts == 0).any():
            raise ValueError(f"classes {torch.nonzero(counts == 0).flatten().tolist()} have no captions")
        # by_class[c, k]: the k-th caption of class c (classes have equal counts from caption_bank; if not,
        # the shorter rows repeat their captions)
        width = int(counts.max())
        self.by_class = torch.stack([torch.nonzero(caption_labels == c).flatten().repeat(width)[:width]
                                     for c in range(len(counts))])
        self.per_class = counts

    def __call__(self, model: nn.Module, batch: ImageBatch, precision: str) -> LossTerms:
        device = batch.images.device
        generator = torch.Generator().manual_seed(batch.noise_seed)
        pick = (torch.rand(len(batch.labels), generator=generator) * self.per_class[batch.labels.cpu()]).long()
        rows = self.by_class[batch.labels.cpu(), pick]
        text = self.caption_features[rows].to(device, non_blocking=True)
        labels = batch.labels if self.mask_same_class else None
        loss, correct = self.loss_fn(model, batch.images, text, labels, precision)
        clip = model.module if hasattr(model, "module") else model  # under DDP
        B = len(batch.labels)
        return LossTerms(loss, B, {"accuracy": correct.float(), "temperature": B / clip.scale().detach()})

    def compiled(self) -> ClipObjective:
        return ClipObjective(self.caption_features, self.caption_labels, self.mask_same_class,
                             torch.compile(contrastive_loss))


@torch.no_grad()
def zero_shot_predict(model: CLIP, pixel_values: torch.Tensor, prompt_features: torch.Tensor,
                      batch_size: int = 500, progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """The class of each image (N,): the index of the prompt (C, text_dim) it is most similar to."""
    prompts = model.text_embeds(prompt_features.to(pixel_values.device))
    predictions = []
    for start in range(0, len(pixel_values), batch_size):
        chunk = pixel_values[start:start + batch_size]
        predictions.append((model.image_embeds(chunk) @ prompts.T).argmax(dim=1))
        if progress is not None:
            progress(len(chunk))
    return torch.cat(predictions)


def save_clip(model: CLIP, path: str | Path, class_names: list[str] | None = None,
              prompts: list[str] | None = None, prompt_features: torch.Tensor | None = None) -> Path:
    """Write `path/`: the ViT as `save_vit` does (config.json + model.safetensors, so `load_vit` reads
    the vision tower alone), and clip.json + clip.safetensors: the projections, the scale, and
    optionally the zero-shot prompts of the training data's classes with their sentence embeddings.
    Atomic."""
    with atomic_directory(path) as tmp:
        write_vit(model.vision, tmp)
        head = {"visual_projection.weight": model.visual_projection.weight, "logit_scale": model.logit_scale,
                "text_projection.weight": model.text_projection.weight}
        if prompt_features is not None:
            head["prompt_features"] = prompt_features
        save_file({k: v.detach().float().contiguous() for k, v in head.items()}, str(tmp / HEAD_WEIGHTS))
        config = {**asdict(model.cfg), "class_names": class_names, "prompts": prompts}
        (tmp / HEAD_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Path(path)


def load_clip(path: str | Path, device: str | torch.device = "cpu") -> tuple[CLIP, dict]:
    """(the CLIP model in eval mode, extras: class_names, prompts and prompt_features when saved)."""
    path = Path(path)
    if not (path / HEAD_CONFIG).is_file():
        raise FileNotFoundError(f"{path} has no {HEAD_CONFIG}; pass the final/ folder of a `tokenmind vision "
                                "train-clip` run (a classifier ViT loads with load_vit)")
    config = json.loads((path / HEAD_CONFIG).read_text(encoding="utf-8"))
    extras = {"class_names": config.pop("class_names", None), "prompts": config.pop("prompts", None)}
    model = CLIP(load_vit(path), ClipHeadConfig(**config))
    head = load_file(str(path / HEAD_WEIGHTS))
    extras["prompt_features"] = head.pop("prompt_features", None)
    with torch.no_grad():
        model.visual_projection.weight.copy_(head["visual_projection.weight"])
        model.text_projection.weight.copy_(head["text_projection.weight"])
        model.logit_scale.copy_(head["logit_scale"])
    return model.to(device).eval(), extras
