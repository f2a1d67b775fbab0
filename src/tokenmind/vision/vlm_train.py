"""Visual instruction tuning of the VLM on the one `Trainer`, in LLaVA's two stages.

Stage 1 (feature alignment): a trained ViT and the language model, both frozen; only the
projector trains, so the image tokens land where the LM can read them. Stage 2 (instruction
tuning): starts from a stage-1 VLM and adds LoRA adapters on the LM (`model/lora.py`), trained
together with the projector; the ViT stays frozen. Both train next-token loss on the assistant's
tokens of the Fashion-MNIST conversations (`vlm_data.py`), through `VLMObjective`.

`VLMTrainer` is the `Trainer` with the VLM's export: `save_vlm` (adapters merged into the saved
language model), so `run/final` is one directory that `load_vlm`, `eval-vlm` and the server
read. Checkpoints hold only what trains (the projector, plus the adapters in stage 2) — the
Trainer's frozen-base path — and a resumed run retraces the uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmind.config import Overrides, load_config
from tokenmind.data.loader import IGNORE_INDEX
from tokenmind.diffusion.config import DiffusionTrainSection
from tokenmind.diffusion.data import DATASETS, load_split
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.load import load_model
from tokenmind.model.lora import add_lora
from tokenmind.posttrain.data import pack
from tokenmind.posttrain.sft import LoRASection, add_stop_ids, val_loader_config
from tokenmind.train.config import OptimSection, ScheduleSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import Trainer, TrainResult, loader_config

from .vit import load_vit
from .vlm import VisionLanguageModel, build_vlm, load_vlm, save_vlm
from .vlm_data import VLMBatch, VLMLoader, vlm_examples

STAGES = (1, 2)


@dataclass
class VLMSection:
    """What is trained.

    stage: 1 trains the projector alone (ViT and LM frozen); 2 adds LoRA on the LM (`lora`).
    language_model: stage 1's LM (an HF directory, a .gguf, a run folder or an alias: `smollm2`).
    vision: stage 1's trained ViT (a `save_vit` directory or a run folder holding `final/`).
    init_from: stage 2's starting VLM (a stage-1 run folder or its `final/`).
    pool_grid: the ViT's patch grid is average-pooled to pool_grid × pool_grid image tokens (plus
        its class token); 0 keeps every patch. image_token: the placeholder's special token
        (empty: `choose_image_token`).
    eval_images: held-out images answered by greedy generation at every validation and before
        the first step (`vlm_eval.evaluate_vlm`), logged as eval_*; 0 = none.
    """

    stage: int = 1
    language_model: str = "smollm2"
    vision: str = "runs/vision/vit"
    init_from: str = ""
    pool_grid: int = 2
    image_token: str = ""
    eval_images: int = 0

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"vlm.stage must be 1 (projector only) or 2 (projector + LoRA), got {self.stage}")
        if self.stage == 2 and not self.init_from:
            raise ValueError("stage 2 starts from a stage-1 VLM: pass --vlm.init_from=RUN (a stage-1 run folder)")
        if self.pool_grid < 0 or self.eval_images < 0:
            raise ValueError(f"vlm.pool_grid ({self.pool_grid}) and vlm.eval_images ({self.eval_images}) must be >= 0")


@dataclass
class VLMDataSection:
    """The conversations: about the first train_images images of the train split (val: the first
    val_images of the test split, never trained on), each of 1..max_turns question/answer turns,
    packed into batch_size rows of seq_len tokens. dataset: fashion-mnist (the questions name its
    classes; `digits` stands in for it in tests)."""

    dataset: str = "fashion-mnist"
    train_images: int = 5000
    val_images: int = 200
    max_turns: int = 3
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"data.dataset={self.dataset!r} is not one of {', '.join(DATASETS)}")
        if min(self.train_images, self.max_turns, self.batch_size) < 1 or self.val_images < 0 or self.seq_len < 2:
            raise ValueError("data.train_images, max_turns and batch_size must be >= 1, val_images >= 0, seq_len >= 2")


@dataclass
class VLMLoRASection(LoRASection):
    """Stage 2's adapters on the LM: rank 8 on every projection, no dropout."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0


@dataclass
class VLMOptimSection(OptimSection):
    """AdamW for a fresh projector and adapters: a larger lr, no weight decay."""

    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class VLMTrainSection(DiffusionTrainSection):
    """The image runs' train section (precision `auto`: bf16 where the device computes it natively,
    CUDA and AMX CPUs, fp32 elsewhere) writing to runs/vision/vlm."""

    out_dir: str = "runs/vision/vlm"


@dataclass
class VLMTrainConfig:
    """A whole VLM run: `vlm` (stage and parts), `data`, `lora` (stage 2), then the trainer's sections."""

    vlm: VLMSection = field(default_factory=VLMSection)
    data: VLMDataSection = field(default_factory=VLMDataSection)
    lora: VLMLoRASection = field(default_factory=VLMLoRASection)
    optim: VLMOptimSection = field(default_factory=VLMOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: VLMTrainSection = field(default_factory=VLMTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)
        if self.vlm.stage == 2 and not self.lora.rank:
            raise ValueError("stage 2 trains LoRA adapters: set --lora.rank > 0")


def load_vlm_train_config(path: str | Path | None = None, overrides: Overrides = ()) -> VLMTrainConfig:
    """Defaults ← YAML file ← `--section.key=value` overrides."""
    return load_config(VLMTrainConfig, path, overrides)


def vlm_loss(model: VisionLanguageModel, input_ids: torch.Tensor, pixel_values: torch.Tensor, targets: torch.Tensor,
             document_ids: torch.Tensor, positions: torch.Tensor, precision: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the trained targets, how many, how many the argmax gets right).
    Logits are computed at the trained positions only (the LM head is a fifth of SmolLM2's
    compute), upcast to fp32; attention stays within each packed conversation."""
    at = (targets.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    with autocast(input_ids.device, precision):
        logits = model(input_ids, pixel_values, positions, DenseAttentionMetadata(document_ids=document_ids),
                       logits_at=at)
    wanted = targets.flatten()[at]
    loss = F.cross_entropy(logits.float(), wanted, reduction="sum")
    return loss, at.new_tensor(at.numel()), (logits.argmax(-1) == wanted).sum()


class VLMObjective:
    """Next-token loss on the assistant's tokens of `VLMBatch`es; logs `token_accuracy`."""

    def __init__(self, loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = vlm_loss) -> None:
        self.loss_fn = loss_fn

    def __call__(self, model: VisionLanguageModel, batch: VLMBatch, precision: str) -> LossTerms:
        loss, count, correct = self.loss_fn(model, batch.input_ids, batch.pixel_values, batch.targets,
                                            batch.document_ids, batch.positions, precision)
        return LossTerms(loss, count, {"token_accuracy": correct.float()})

    def compiled(self) -> VLMObjective:
        return VLMObjective(torch.compile(vlm_loss))


class VLMTrainer(Trainer):
    """The one `Trainer`, exporting the VLM with `save_vlm` (no MFU: the image tower's FLOPs are
    not counted by the LM's formula)."""

    def units_per_step(self) -> tuple[int, float | None]:
        d, t = self.cfg.data, self.cfg.train
        return d.batch_size * d.seq_len * t.grad_accum * self.ctx.data_world_size, None

    def export(self) -> Path:
        path = self.out_dir / "final"
        if self.ctx.is_main:
            save_vlm(self.model, self.tokenizer, path)
        return path


def run_final(ref: str) -> Path:
    """A run folder stands for its `final/` export."""
    path = Path(ref).expanduser()
    return path / "final" if (path / "final" / "config.json").is_file() else path


def build_model(cfg: VLMTrainConfig) -> tuple[VisionLanguageModel, object]:
    """(the VLM with only what this stage trains left trainable, its tokenizer)."""
    v = cfg.vlm
    if v.stage == 1:
        start = load_model(v.language_model, dtype=torch.float32)
        model = build_vlm(load_vit(run_final(v.vision)), start.model, start.tokenizer, v.image_token, v.pool_grid,
                          seed=cfg.train.seed)
        tokenizer = start.tokenizer
    else:
        model, tokenizer = load_vlm(v.init_from)
    model.train()
    for p in [*model.vision.parameters(), *model.language_model.parameters()]:
        p.requires_grad_(False)
    if v.stage == 2:
        add_lora(model.language_model, cfg.lora.adapter_config(), seed=cfg.train.seed)  # adapters alone train
    for p in model.projector.parameters():
        p.requires_grad_(True)
    add_stop_ids(model.language_model, tokenizer.eos_token_ids)
    return model, tokenizer


def vlm_loaders(cfg: VLMTrainConfig, model: VisionLanguageModel, tokenizer, ctx: DistContext
                ) -> tuple[VLMLoader, VLMLoader | None, dict]:
    """Train loader over the train split's conversations, val loader over the test split's, and statistics."""
    d = cfg.data
    images, labels = load_split(d.dataset, "train")
    train = vlm_examples(tokenizer, model, labels, d.train_images, d.seq_len, d.seed, d.max_turns)
    loader = VLMLoader(train, images, loader_config(d, ctx, d.seed, d.shuffle), model.image_size, model.image_channels)
    stats = {"train_conversations": len(train), "train_tokens": int(sum(len(e.inputs) for e in train)),
             "train_trained_tokens": int(sum((e.targets != IGNORE_INDEX).sum() for e in train)),
             "train_rows": len(loader.rows), "tokens_per_image": model.tokens_per_image}
    stats["packing_efficiency"] = stats["train_tokens"] / (len(loader.rows) * d.seq_len)
    if not d.val_images:
        return loader, None, stats
    test_images, test_labels = load_split(d.dataset, "test")
    val = vlm_examples(tokenizer, model, test_labels, d.val_images, d.seq_len, d.seed + 1, d.max_turns)
    rows = len(pack([len(e.inputs) for e in val], d.seq_len))
    val_loader = VLMLoader(val, test_images, val_loader_config(d, ctx, rows), model.image_size, model.image_channels)
    return loader, val_loader, {**stats, "val_conversations": len(val)}


def build_vlm_trainer(cfg: VLMTrainConfig, ctx: DistContext) -> VLMTrainer:
    """The `Trainer` of a VLM stage; writes the data's statistics to out_dir/vlm_data.json."""
    model, tokenizer = build_model(cfg)
    loader, val_loader, stats = vlm_loaders(cfg, model, tokenizer, ctx)
    out_dir = Path(cfg.train.out_dir)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "vlm_data.json").write_text(json.dumps(stats, indent=2) + "\n")
    evaluator = None
    if cfg.vlm.eval_images:
        from .vlm_eval import evaluate_vlm

        def evaluator() -> dict[str, float]:
            return evaluate_vlm(model, tokenizer, cfg.data.dataset, cfg.vlm.eval_images)["metrics"]

    return VLMTrainer(cfg, ctx, model, loader, val_loader, objective=VLMObjective(), tokenizer=tokenizer,
                      evaluator=evaluator)


def train_vlm(cfg: VLMTrainConfig) -> TrainResult:
    """Train (or resume) the VLM stage `cfg` describes; behind `tokenmind vision train-vlm`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_vlm_trainer(cfg, ctx).train()
