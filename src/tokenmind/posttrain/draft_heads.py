"""Training Medusa heads and an EAGLE head on a frozen model's own text (`tokenmind posttrain medusa|eagle`).

A draft head is only worth as much as its agreement with what the model will say, so it learns
from the model itself (Medusa's self-distillation, EAGLE's fixed-dataset recipe on its outputs):

1. The frozen model answers seeded prompts through the engine (`LLM.generate`, greedy by
   default, so every generated token is the one verification would accept).
2. The model's final-normed hidden states of those sequences are computed once, under
   inference mode, and cached on disk with the tokens (`build_features`); Medusa and EAGLE runs
   with the same generation settings share the cache.
3. The one `Trainer` minimizes an objective over the cached rows; the model stays frozen inside
   `HeadOnModel`, so optimizer state and checkpoints hold only the head, and the export is the
   head directory (`model/draft_heads.py:save_draft_head`), loadable by `--speculative medusa:PATH`.

Losses (pure functions of tensors, on the positions whose next token the model generated):
* Medusa-1: Σ_k λ_k CE(head k at t, token t + k + 1), λ_k = medusa_decay^(k-1) (the paper's 0.8^k).
* EAGLE: smooth-L1(predicted feature at p, the model's feature at p) + token_weight · CE(LM head of
  the prediction, token p + 1), teacher-forced on the model's features (EAGLE-1's 1 + 0.1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import Overrides, load_config
from ..engine.llm import LLM
from ..engine.sampling import SamplingParams
from ..model.attention import DenseAttentionMetadata
from ..model.checkpoint import atomic_directory
from ..model.draft_heads import DRAFT_HEAD_METHODS, DraftHead, MedusaHeads, build_draft_head, save_draft_head
from ..model.load import Pretrained, load_model
from ..model.transformer import Transformer
from ..progress import Bars
from ..train.config import OptimSection, ScheduleSection, TrainSection, check_schedule_fits
from ..train.distributed import DistContext, init_distributed
from ..train.objectives import LossTerms, autocast
from ..train.trainer import Trainer, TrainResult
from .prompts import build_prompts


@dataclass
class DraftHeadSection:
    """What head, on which model, from how much of the model's own text.

    method: medusa or eagle. base: the frozen model (run, HF dir, .gguf or alias). num_heads:
    Medusa's K. prompt_kinds/num_prompts/prompt_seed: the seeded prompt sets of `prompts.py`,
    taken in turn. max_new_tokens/temperature: how the model answers (0 = greedy). cache_dir:
    where generated sequences and their hidden states are kept (shared by runs with the same
    generation settings). medusa_decay: λ_k = decay^(k-1). token_weight: EAGLE's CE weight
    next to the feature regression."""

    method: str = "medusa"
    base: str = "smollm2"
    num_heads: int = 4
    prompt_kinds: list[str] = field(default_factory=lambda: ["stories", "explanations", "answers"])
    num_prompts: int = 300
    prompt_seed: int = 0
    max_new_tokens: int = 128
    temperature: float = 0.0
    generation_batch: int = 32
    cache_dir: str = "runs/draft_head_data"
    medusa_decay: float = 0.8
    token_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in DRAFT_HEAD_METHODS:
            raise ValueError(f"draft.method={self.method!r}: choose one of {', '.join(DRAFT_HEAD_METHODS)}")
        if self.num_heads < 1 or self.num_prompts < 1 or self.max_new_tokens < 2:
            raise ValueError(f"need draft.num_heads >= 1, draft.num_prompts >= 1 and draft.max_new_tokens >= 2, got "
                             f"{self.num_heads}, {self.num_prompts}, {self.max_new_tokens}")


@dataclass
class FeatureDataSection:
    """batch_size: sequences per micro-batch (padded to the longest). val_fraction: sequences held out."""

    batch_size: int = 2
    val_fraction: float = 0.05
    seed: int = 0
    seq_len: int = 0  # filled in: the longest cached sequence (for the trainer's token count)


@dataclass
class DraftOptimSection(OptimSection):
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class DraftTrainSection(TrainSection):
    steps: int = 300
    precision: str = "fp32"
    log_every: int = 10
    out_dir: str = "runs/medusa"


@dataclass
class DraftHeadConfig:
    """A draft-head run: `draft` (method, base, data, loss), `data` (batches), then the trainer's sections."""

    draft: DraftHeadSection = field(default_factory=DraftHeadSection)
    data: FeatureDataSection = field(default_factory=FeatureDataSection)
    optim: DraftOptimSection = field(default_factory=DraftOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: DraftTrainSection = field(default_factory=DraftTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_draft_head_config(path: str | Path | None = None, overrides: Overrides = (),
                           defaults: dict | None = None) -> DraftHeadConfig:
    return load_config(DraftHeadConfig, path, overrides, defaults)


# ---- the model's own text and its features ------------------------------------------------------------


@dataclass
class Features:
    """Sequences back to back: tokens (N,), the model's final-normed hidden states (N, hidden) and,
    per sequence, its length and how many of its first tokens were prompt."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    lengths: list[int]
    prompt_lens: list[int]

    def __post_init__(self) -> None:
        self.starts = [0, *itertools.accumulate(self.lengths)]

    def rows(self, index: list[int]) -> FeatureBatch:
        """Sequences `index` as one right-padded batch."""
        starts = self.starts
        T = max(self.lengths[i] for i in index)
        ids = torch.zeros(len(index), T, dtype=torch.long)
        hidden = torch.zeros(len(index), T, self.hidden.shape[1], dtype=self.hidden.dtype)
        for row, i in enumerate(index):
            a, n = starts[i], self.lengths[i]
            ids[row, :n], hidden[row, :n] = self.input_ids[a:a + n], self.hidden[a:a + n]
        return FeatureBatch(ids, hidden, torch.tensor([self.lengths[i] for i in index]),
                            torch.tensor([self.prompt_lens[i] for i in index]))


@dataclass
class FeatureBatch:
    """input_ids (B, T) right-padded, hidden (B, T, hidden), lengths (B,), prompt_lens (B,)."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor

    def to(self, device: torch.device | str) -> FeatureBatch:
        return FeatureBatch(*(t.to(device) for t in dataclasses.astuple(self)))

    def positions(self, last_from_end: int) -> torch.Tensor:
        """(B, T) bool: the slots t whose next token the model generated (t >= prompt_len - 1), up to
        `last_from_end` before the end (t <= length - 1 - last_from_end)."""
        t = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return (t >= (self.prompt_lens - 1)[:, None]) & (t <= (self.lengths - 1 - last_from_end)[:, None])


def features_key(d: DraftHeadSection) -> str:
    """The cache folder's name: the generation settings it was made with."""
    settings = [d.base, sorted(d.prompt_kinds), d.num_prompts, d.prompt_seed, d.max_new_tokens, d.temperature]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


def build_features(base: Pretrained, d: DraftHeadSection, progress: bool = False) -> Features:
    """The model's answers to the prompts and their hidden states, from the cache or made there first."""
    folder = Path(d.cache_dir) / features_key(d)
    if not (folder / "features.safetensors").is_file():
        per_kind = [build_prompts(kind, -(-d.num_prompts // len(d.prompt_kinds)), d.prompt_seed)
                    for kind in d.prompt_kinds]
        prompts = [item["prompt"] for row in zip(*per_kind) for item in row][:d.num_prompts]  # the kinds in turn
        tok = base.tokenizer
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
        llm = LLM(base, max_num_seqs=d.generation_batch)
        params = SamplingParams(max_tokens=d.max_new_tokens, temperature=d.temperature, seed=d.prompt_seed)
        outs = llm.generate(ids, params, progress=progress)
        seqs = [(p, p + list(o.outputs[0].token_ids)) for p, o in zip(ids, outs)]
        hidden = []
        with torch.inference_mode(), Bars(progress) as bars:
            advance = bars.add("hidden states", len(seqs))
            for _, seq in seqs:
                hidden.append(base.model.hidden_states(torch.tensor([seq]))[0].float())
                if advance is not None:
                    advance()
        with atomic_directory(folder) as tmp:
            save_file({"input_ids": torch.tensor([t for _, s in seqs for t in s]), "hidden": torch.cat(hidden)},
                      str(tmp / "features.safetensors"))
            (tmp / "sequences.json").write_text(json.dumps({
                "base": d.base, "prompts": prompts, "lengths": [len(s) for _, s in seqs],
                "prompt_lens": [len(p) for p, _ in seqs], "generated_tokens": sum(len(s) - len(p) for p, s in seqs),
                "max_new_tokens": d.max_new_tokens, "temperature": d.temperature}) + "\n")
    tensors = load_file(str(folder / "features.safetensors"))
    meta = json.loads((folder / "sequences.json").read_text())
    return Features(tensors["input_ids"], tensors["hidden"], meta["lengths"], meta["prompt_lens"])


class FeatureLoader:
    """Endless batches of whole cached sequences in a seeded order per epoch; resumes by position."""

    def __init__(self, features: Features, index: list[int], batch_size: int, seed: int, shuffle: bool = True):
        self.features, self.index, self.batch_size, self.seed, self.shuffle = features, index, batch_size, seed, shuffle
        self.epoch = self.position = 0
        self.batches_per_epoch = max(1, len(index) // batch_size)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return self.index
        perm = torch.randperm(len(self.index), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return [self.index[i] for i in perm.tolist()]

    def __iter__(self) -> FeatureLoader:
        return self

    def __next__(self) -> FeatureBatch:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        at = self.position * self.batch_size
        self.position += 1
        return self.features.rows(self._order()[at:at + self.batch_size])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


# ---- the objectives -------------------------------------------------------------------------------------


class HeadOnModel(nn.Module):
    """The frozen model and the head that trains on it, as the one module the `Trainer` holds."""

    def __init__(self, base: Transformer, head: DraftHead):
        super().__init__()
        self.base, self.head = base.requires_grad_(False).eval(), head
        self.cfg = base.cfg
        self.gradient_checkpointing = False


def medusa_loss(model: HeadOnModel, batch: FeatureBatch, decay: float) -> LossTerms:
    """Σ_k λ_k CE(head k at t, token t + k + 1) over the generated slots with all K targets; the
    metrics are each head's CE and top-1 accuracy (how often its draft would be right alone)."""
    K = model.head.num_heads
    rows, t = batch.positions(K + 1).nonzero(as_tuple=True)
    heads = model.head(batch.hidden[rows, t])  # (K, M, hidden)
    loss, metrics = heads.new_zeros(()), {}
    for k in range(K):
        logits = model.base.logits(heads[k]).float()
        target = batch.input_ids[rows, t + k + 2]
        ce = F.cross_entropy(logits, target, reduction="sum")
        loss = loss + decay ** k * ce
        metrics[f"ce_{k + 1}"] = ce.detach()
        metrics[f"acc_{k + 1}"] = (logits.argmax(-1) == target).sum().float()
    return LossTerms(loss, len(t), metrics)


def eagle_loss(model: HeadOnModel, batch: FeatureBatch, token_weight: float) -> LossTerms:
    """Slot p reads (the model's feature at p - 1, token p) and predicts the feature at p (smooth L1,
    mean over the hidden size) and, through the LM head, token p + 1 (CE), over the generated slots."""
    ids, hidden = batch.input_ids, batch.hidden
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(B, T)
    real = positions < batch.lengths[:, None]
    meta = DenseAttentionMetadata(key_padding=real & (positions >= 1))  # slot 0 has no previous feature
    pred = model.base.draft_step(model.head, ids, F.pad(hidden[:, :-1], (0, 0, 1, 0)), positions, meta)
    mask = batch.positions(1) & (positions >= 1)
    rows, p = mask.nonzero(as_tuple=True)
    feature = F.smooth_l1_loss(pred[rows, p].float(), hidden[rows, p], reduction="none").mean(-1).sum()
    logits = model.base.logits(pred[rows, p]).float()
    target = ids[rows, p + 1]
    ce = F.cross_entropy(logits, target, reduction="sum")
    return LossTerms(feature + token_weight * ce, len(p), {
        "feature_loss": feature.detach(), "ce": ce.detach(), "acc": (logits.argmax(-1) == target).sum().float()})


class DraftHeadObjective:
    """The trainer's objective for a `HeadOnModel`: `medusa_loss` or `eagle_loss` as the head is."""

    def __init__(self, d: DraftHeadSection):
        self.d = d

    def __call__(self, model: nn.Module, batch: FeatureBatch, precision: str) -> LossTerms:
        with autocast(batch.hidden.device, precision):
            if isinstance(model.head, MedusaHeads):
                return medusa_loss(model, batch, self.d.medusa_decay)
            return eagle_loss(model, batch, self.d.token_weight)

    def compiled(self) -> DraftHeadObjective:
        return self  # small heads: nothing worth a compile


class DraftHeadTrainer(Trainer):
    """The one `Trainer`; its export is the head directory next to (not inside) the model, with
    `info` (how it was trained) in its head.json."""

    def __init__(self, *args, info: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.info = info

    def export(self) -> Path:
        path = self.out_dir / "head"
        if self.ctx.is_main:
            save_draft_head(self.model.head, self.model.cfg, path, self.info)
        return path


def build_draft_head_trainer(cfg: DraftHeadConfig, ctx: DistContext, progress: bool = False) -> DraftHeadTrainer:
    d = cfg.draft
    base = load_model(d.base)
    features = build_features(base, d, progress)
    n = len(features.lengths)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.data.seed)).tolist()
    held = math.ceil(n * cfg.data.val_fraction) if cfg.data.val_fraction else 0
    cfg.data.seq_len = max(features.lengths)
    loader = FeatureLoader(features, order[held:], cfg.data.batch_size, cfg.data.seed)
    val = FeatureLoader(features, order[:held], cfg.data.batch_size, cfg.data.seed, shuffle=False) if held else None
    torch.manual_seed(cfg.train.seed)
    model = HeadOnModel(base.model, build_draft_head(d.method, base.model.cfg, d.num_heads))
    info = {"base": d.base, "sequences": n - held, "generated_tokens": sum(
        features.lengths[i] - features.prompt_lens[i] for i in order[held:]), "steps": cfg.train.steps,
        "max_new_tokens": d.max_new_tokens, "temperature": d.temperature}
    return DraftHeadTrainer(cfg, ctx, model, loader, val, objective=DraftHeadObjective(d), info=info)


def draft_head_train(cfg: DraftHeadConfig, progress: bool | None = None) -> TrainResult:
    """Train (or resume) the head `cfg` describes; behind `tokenmind posttrain medusa|eagle`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        if ctx.world_size > 1:
            raise ValueError("draft heads train in one process (train.distributed=none): the model answers through "
                             "one engine and the head is small")
        return build_draft_head_trainer(cfg, ctx, bool(progress)).train()
