"""ViT classification and CLIP-style contrastive training on the project's one `Trainer`.

Both runs hand a model, the image loaders of the diffusion runs (`diffusion.train.image_loaders`:
seeded epochs, exact resume by position) and an objective to a `Trainer` subclass that counts
images (`DiffusionTrainer`'s unit) and exports its own kind of model, so checkpoints, resume,
accumulation, clipping, bf16, validation, the metrics file and the loss plot are the pre-training
loop's. After training, the whole test split is scored and the run folder gets `report.json` and
`report.md`:

- `train_vit`: cross-entropy on the labels (`ClassificationObjective`, accuracy as its metric);
  the report holds the test accuracy, overall and per class. Export: `final/` by `save_vit`.
- `train_clip`: symmetric InfoNCE between images and generated captions (`clip.ClipObjective`);
  the captions' sentence embeddings are computed once into `out_dir/captions/` and reused on
  resume. Zero-shot accuracy on `clip.eval_images` test images is logged at every validation
  (`eval_zero_shot_accuracy`), and the report holds it over the whole test split. Export: `final/`
  by `save_clip` (the ViT readable by `load_vit` alone, plus the projections and class prompts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.diffusion.data import ImageBatch, class_names, load_split, to_model_range
from tokenmind.diffusion.train import DiffusionTrainer, image_loaders
from tokenmind.jsonl import atomic_open, write_json
from tokenmind.model.checkpoint import atomic_directory
from tokenmind.model.encoder import SentenceEncoder, load_encoder
from tokenmind.progress import Bars
from tokenmind.train.distributed import DistContext, init_distributed, model_state
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import TrainResult

from .captions import caption_bank, zero_shot_prompts
from .clip import CLIP, ClipHeadConfig, ClipObjective, save_clip, zero_shot_predict
from .config import ClipRunConfig, ViTRunConfig, vit_config
from .vit import ViT, save_vit


def classification_loss(model: nn.Module, pixel_values: torch.Tensor, labels: torch.Tensor,
                        precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the images, how many the model labels right), in fp32."""
    with autocast(pixel_values.device, precision):
        logits = model(pixel_values)
    logits = logits.float()
    return F.cross_entropy(logits, labels, reduction="sum"), (logits.argmax(dim=1) == labels).sum()


class ClassificationObjective:
    """Supervised classification on `ImageBatch`es: units are images, metric `accuracy`."""

    def __init__(self, loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = classification_loss) -> None:
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: ImageBatch, precision: str) -> LossTerms:
        loss, correct = self.loss_fn(model, batch.images, batch.labels, precision)
        return LossTerms(loss, len(batch.labels), {"accuracy": correct.float()})

    def compiled(self) -> ClassificationObjective:
        return ClassificationObjective(torch.compile(classification_loss))


@dataclass
class VisionRun:
    """A finished vision run: the trainer's result and the test-split report written next to it."""

    train: TrainResult
    report: dict[str, Any]
    report_path: Path


class ViTTrainer(DiffusionTrainer):
    """The image-counting trainer whose export is the classifier ViT (`save_vit`)."""

    def export(self) -> Path:
        path = self.out_dir / "final"
        state = model_state(self.model, self.ctx)  # collective under fsdp
        if self.ctx.is_main:
            model = ViT(self.model.cfg)
            model.load_state_dict(state)
            save_vit(model, path)
        return path


class ClipTrainer(DiffusionTrainer):
    """The image-counting trainer whose export is the CLIP model with its class prompts (`save_clip`)."""

    prompts: list[str]
    prompt_features: torch.Tensor

    def export(self) -> Path:
        path = self.out_dir / "final"
        state = model_state(self.model, self.ctx)
        if self.ctx.is_main:
            model = CLIP(ViT(self.model.vision.cfg), self.model.cfg)
            model.load_state_dict(state)
            save_clip(model, path, class_names(self.cfg.data.dataset), self.prompts, self.prompt_features)
        return path


# ---- evaluation and reports ---------------------------------------------------------------------


def test_pixels(dataset: str, pad_to: int, limit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel values in [-1, 1], labels) of the test split, the first `limit` images (0 = all)."""
    images, labels = load_split(dataset, "test")
    if limit:
        images, labels = images[:limit], labels[:limit]
    return to_model_range(images, pad_to), labels


@torch.no_grad()
def predict(model: ViT, pixel_values: torch.Tensor, batch_size: int = 500,
            progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """The classifier's label (N,) for each image."""
    out = []
    for start in range(0, len(pixel_values), batch_size):
        chunk = pixel_values[start:start + batch_size]
        out.append(model(chunk).argmax(dim=1))
        if progress is not None:
            progress(len(chunk))
    return torch.cat(out)


def accuracy_report(predictions: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict[str, Any]:
    """Overall and per-class accuracy of `predictions` against `labels`."""
    right = predictions.cpu() == labels
    per_class = {name: round(float(right[labels == c].float().mean()), 4) for c, name in enumerate(names)
                 if (labels == c).any()}
    return {"images": len(labels), "accuracy": round(float(right.float().mean()), 4), "per_class": per_class}


def cpu_name() -> str:
    """The CPU model /proc/cpuinfo names (for the record next to timings)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def write_report(out_dir: Path, title: str, report: dict[str, Any]) -> Path:
    """`report.json` (everything) and `report.md` (the headline numbers) in the run folder."""
    write_json(out_dir / "report.json", report)
    lines = [f"# {title}", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in report.items() if not isinstance(v, (dict, list))]
    for key in ("test", "zero_shot"):
        if key in report:
            lines += ["", f"## {key}: accuracy per class", "", "| class | accuracy |", "| --- | --- |"]
            lines += [f"| {name} | {acc} |" for name, acc in report[key]["per_class"].items()]
    with atomic_open(out_dir / "report.md") as fh:
        fh.write("\n".join(lines) + "\n")
    return out_dir / "report.json"


def run_facts(result: TrainResult, cfg: Any, seconds: float) -> dict[str, Any]:
    return {"dataset": cfg.data.dataset, "steps": result.steps, "train_images": result.tokens_seen,
            "train_images_per_s": round(result.tokens_per_s, 1), "final_train_loss": result.final_loss,
            "final_val_loss": result.final_val_loss, "wall_s": round(seconds, 1), "cpu": cpu_name(),
            "torch_threads": torch.get_num_threads(), "precision": cfg.train.precision,
            "model": str(result.final_model_path)}


# ---- ViT classifier -----------------------------------------------------------------------------


def build_vit_trainer(cfg: ViTRunConfig, ctx: DistContext) -> ViTTrainer:
    loader, val_loader = image_loaders(cfg.data, ctx)
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    model = ViT(vit_config(cfg.model, cfg.data, len(class_names(cfg.data.dataset))))
    model.init_weights(cfg.train.init_std, torch.Generator().manual_seed(cfg.train.seed))
    return ViTTrainer(cfg, ctx, model, loader, val_loader, objective=ClassificationObjective())


def train_vit(cfg: ViTRunConfig, progress: bool = True) -> VisionRun:
    """Train (or resume) a ViT classifier, then score the whole test split; behind `tokenmind vision
    train-vit`."""
    started = time.perf_counter()
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        trainer = build_vit_trainer(cfg, ctx)
        result = trainer.train()
        if not ctx.is_main:
            return VisionRun(result, {}, result.out_dir / "report.json")
        model = trainer.model.eval()
        pixels, labels = test_pixels(cfg.data.dataset, cfg.data.pad_to)
        with Bars(progress) as bars:
            predictions = predict(model, pixels.to(ctx.device), progress=bars.add("test accuracy", len(labels)))
    test = accuracy_report(predictions, labels, class_names(cfg.data.dataset))
    report = {**run_facts(result, cfg, time.perf_counter() - started), "test_accuracy": test["accuracy"], "test": test}
    return VisionRun(result, report, write_report(result.out_dir, "ViT classifier", report))


# ---- CLIP ---------------------------------------------------------------------------------------


def caption_features(cfg: ClipRunConfig, encoder: Callable[[], SentenceEncoder],
                     progress: bool = True) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(captions, their labels, their sentence embeddings) for the run: generated from the data set's
    labels (`caption_bank`), embedded once by clip.encoder and cached in `out_dir/captions/`; a cache
    made for other captions or another encoder is rebuilt."""
    captions, labels = caption_bank(cfg.data.dataset, cfg.clip.captions_per_class, cfg.data.seed)
    folder = Path(cfg.train.out_dir) / "captions"
    meta = {"encoder": cfg.clip.encoder, "captions": captions, "labels": labels}
    if (folder / "captions.json").is_file() and (folder / "features.safetensors").is_file():
        if json.loads((folder / "captions.json").read_text(encoding="utf-8")) == meta:
            return captions, torch.tensor(labels), load_file(str(folder / "features.safetensors"))["features"]
    with Bars(progress) as bars:
        features = encoder().embed(captions, progress=bars.add("embed captions", len(captions)))
    with atomic_directory(folder) as tmp:
        (tmp / "captions.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        save_file({"features": features.contiguous()}, str(tmp / "features.safetensors"))
    return captions, torch.tensor(labels), features


def prompt_features(cfg: ClipRunConfig, encoder: SentenceEncoder) -> tuple[list[str], torch.Tensor]:
    """(one zero-shot prompt per class, their sentence embeddings)."""
    prompts = zero_shot_prompts(cfg.data.dataset, cfg.clip.zero_shot_template)
    return prompts, encoder.embed(prompts)


def build_clip_trainer(cfg: ClipRunConfig, ctx: DistContext, progress: bool = True) -> ClipTrainer:
    encoder = functools.cache(lambda: load_encoder(cfg.clip.encoder))  # loaded once, and only when needed
    _, labels, features = caption_features(cfg, encoder, progress and ctx.is_main)
    prompts, prompt_vectors = prompt_features(cfg, encoder())
    loader, val_loader = image_loaders(cfg.data, ctx)
    torch.manual_seed(cfg.train.seed)
    vision = ViT(vit_config(cfg.model, cfg.data, num_classes=0))
    vision.init_weights(cfg.train.init_std, torch.Generator().manual_seed(cfg.train.seed))
    c = cfg.clip
    model = CLIP(vision, ClipHeadConfig(text_dim=features.shape[1], embed_dim=c.embed_dim,
                                        init_temperature=c.init_temperature, max_logit_scale=c.max_logit_scale,
                                        encoder=c.encoder))
    evaluator = None
    if c.eval_images:
        pixels, eval_labels = test_pixels(cfg.data.dataset, cfg.data.pad_to, c.eval_images)

        def evaluator() -> dict[str, float]:
            model.eval()
            predictions = zero_shot_predict(model, pixels.to(ctx.device), prompt_vectors)
            model.train()
            return {"zero_shot_accuracy": float((predictions.cpu() == eval_labels).float().mean())}

    trainer = ClipTrainer(cfg, ctx, model, loader, val_loader, evaluator=evaluator,
                          objective=ClipObjective(features, labels, c.mask_same_class))
    trainer.prompts, trainer.prompt_features = prompts, prompt_vectors
    return trainer


def train_clip(cfg: ClipRunConfig, progress: bool = True) -> VisionRun:
    """Train (or resume) a CLIP-style ViT against generated captions, then zero-shot classify the whole
    test split; behind `tokenmind vision train-clip`."""
    started = time.perf_counter()
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        trainer = build_clip_trainer(cfg, ctx, progress)
        result = trainer.train()
        if not ctx.is_main:
            return VisionRun(result, {}, result.out_dir / "report.json")
        model = trainer.model.eval()
        pixels, labels = test_pixels(cfg.data.dataset, cfg.data.pad_to)
        with Bars(progress) as bars:
            predictions = zero_shot_predict(model, pixels.to(ctx.device), trainer.prompt_features,
                                            progress=bars.add("zero-shot", len(labels)))
    zero_shot = accuracy_report(predictions, labels, class_names(cfg.data.dataset))
    report = {**run_facts(result, cfg, time.perf_counter() - started), "zero_shot_accuracy": zero_shot["accuracy"],
              "temperature": round(float(1 / model.scale().detach()), 4), "mask_same_class": cfg.clip.mask_same_class,
              "captions_per_class": cfg.clip.captions_per_class, "encoder": cfg.clip.encoder,
              "prompts": trainer.prompts, "zero_shot": zero_shot}
    return VisionRun(result, report, write_report(result.out_dir, "CLIP-style contrastive ViT", report))
