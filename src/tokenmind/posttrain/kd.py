"""Knowledge distillation: train a small student to match a teacher's next-token distributions.

Token-level KD, as objectives of the one trainer. (`distill.py` is the other kind: the teacher
writes text that a model then trains on with plain next-token loss, sequence-level KD.)

* Offline KD (`mode: offline`): the student learns the teacher's distribution at every trained
  target of the chat data, the hard label's one-hot replaced by what the teacher would have said
  (Hinton et al. 2015). The teacher's top-k log-probs are computed once and cached on disk
  (`kd_data.py`), so training never runs the teacher. The loss is the forward KL(teacher ||
  student) over k + 1 outcomes: the teacher's k best tokens, and a tail bucket holding all the
  rest (the teacher's tail mass is 1 − its top-k mass, the student's is its own mass outside
  those k ids). That is the exact KL of the two distributions seen at that resolution: never
  above the full KL, equal to it when the teacher's tail is empty (or k = vocabulary). Keeping
  the bucket rather than renormalizing the teacher over its top k means the student is neither
  taught an inflated confidence nor free to park mass outside the teacher's choices.
* On-policy GKD (`mode: gkd`, Agarwal et al. 2024): the student writes the answers it learns on
  (each conversation's final turn with probability lmbda, else the data's), sampled from its
  live weights through the engine, and the teacher scores every one of their tokens. The loss is
  the generalized Jensen-Shannon divergence JSD(β) = β KL(T || M) + (1 − β) KL(S || M), M =
  β T + (1 − β) S, over the full vocabulary; as in TRL, β = 0 means forward KL(T || S) (mass
  covering) and β = 1 reverse KL(S || T) (mode seeking), the limits of JSD(β)/β and /(1 − β).
  Training on its own samples fixes the train/inference mismatch of offline KD: the student is
  corrected in the states it actually reaches. The coin is tossed per conversation (TRL tosses
  one per batch; the expected share is the same, the batches vary less). Start GKD from a
  student that already roughly agrees with the teacher (SFT or offline KD first, as the paper
  does): JSD(β) is bounded by ln 2 and flat where the two distributions barely overlap, so a
  freshly cut SmolLM2 student (JSD 0.67) gets almost no signal and its own garbage samples
  (measured: six steps doubled its KL).

Both soften teacher and student with one temperature τ and scale the divergence by τ² (Hinton),
so its gradients keep their size whatever τ; offline KD can add the hard-label cross-entropy with
weight alpha. The units are trained target tokens; the logged metrics, per token, are the forward
KL (top-k + tail for offline, full for GKD) and the hard-label cross-entropy `ce`; validation
runs on the data's own answers only, so its numbers compare across steps and modes.

The student shares the teacher's tokenizer and vocabulary: a model (`distill.student`) or, by
default, the teacher with a subset of its layers (`student_from_layers`: every other one, as
DistilBERT did), embeddings, final norm and head copied, so it starts close to the teacher.

Resume is exact in both modes: the cache is reread, and GKD's samples are seeded per (seed,
epoch, conversation) and drawn from the restored weights by a fresh engine whose block pool is
reset before every batch to the state of a new one (`BlockManager.reset_prefix_cache`). GKD
needs the whole student in each process, so it runs without FSDP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmind.config import Overrides, load_config
from tokenmind.data.loader import IGNORE_INDEX, TokenBatch
from tokenmind.engine.sampling import SamplingParams
from tokenmind.jsonl import atomic_open
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.load import Pretrained, load_model
from tokenmind.model.transformer import Transformer
from tokenmind.train.config import ScheduleSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import Trainer, TrainResult, loader_config

from .data import ChatData
from .kd_data import KDBatch, OnPolicyLoader, TopKChatLoader, final_turns, teacher_topk
from .sft import ChatDataSection, SFTOptimSection, SFTTrainSection, add_stop_ids, chat_data, chat_loaders, \
    val_loader_config

MODES = ("offline", "gkd")


# ---- the divergences: pure functions of logits ----------------------------------------------------


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def topk_kl(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(teacher || student) per position over the teacher's top k and a tail bucket.

    student_logits (N, V); teacher_ids (N, k) and teacher_logprobs (N, k): the teacher's k best
    tokens and their log-probs, already at `temperature`. Returns (N,) in fp32.
    """
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    ids, log_t = teacher_ids.long(), teacher_logprobs.float()
    top = (log_t.exp() * (log_t - log_s.gather(-1, ids))).sum(-1)
    tail_t = (1 - log_t.exp().sum(-1)).clamp_min(0)
    # The student's log-mass outside the k ids, no lower than fp32's smallest normal number: with
    # k = V it is empty, while rounding leaves the teacher's tail a few ulps above 0 (the finite fill
    # keeps the gradient finite there too).
    log_tail_s = log_s.scatter(-1, ids, -1e30).logsumexp(-1).clamp_min(math.log(torch.finfo(torch.float32).tiny))
    return top + torch.xlogy(tail_t, tail_t) - tail_t * log_tail_s


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Generalized JSD(β) per position between teacher and student at `temperature` (see the
    module docstring; β = 0 forward KL, β = 1 reverse KL). Logits (N, V); returns (N,) in fp32."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        return _kl(log_t, log_s)
    if beta == 1:
        return _kl(log_s, log_t)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))
    return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)


# ---- the objectives -------------------------------------------------------------------------------


def trained_logits(model: nn.Module, batch: TokenBatch, precision: str) -> torch.Tensor:
    """The model's logits (N, V) at the batch's trained targets, in row-major order. Through the
    model's own forward, so a DDP-wrapped student synchronizes its gradients."""
    with autocast(batch.input_ids.device, precision):
        logits = model(batch.input_ids, batch.positions, DenseAttentionMetadata(document_ids=batch.document_ids))
    return logits[batch.targets != IGNORE_INDEX].float()


def offline_kd_loss(model: nn.Module, batch: KDBatch, precision: str, temperature: float,
                    alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, top-k KL, hard-label CE) summed over the trained targets:
    loss = (1 − alpha) τ² KL + alpha CE."""
    logits = trained_logits(model, batch, precision)
    kl = topk_kl(logits, batch.teacher_ids, batch.teacher_logprobs, temperature).sum()
    ce = F.cross_entropy(logits, batch.targets[batch.targets != IGNORE_INDEX], reduction="sum")
    return (1 - alpha) * temperature**2 * kl + alpha * ce, kl, ce


def gkd_loss(model: nn.Module, teacher: Transformer, batch: TokenBatch, precision: str, beta: float,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(τ² JSD(β), forward KL, hard-label CE) summed over the trained targets; the teacher scores
    the same tokens (its LM head only where they are trained)."""
    trained = batch.targets != IGNORE_INDEX
    with torch.no_grad(), autocast(batch.input_ids.device, precision):
        hidden = teacher.hidden_states(batch.input_ids, batch.positions,
                                       DenseAttentionMetadata(document_ids=batch.document_ids))
        teacher_logits = teacher.logits(hidden[trained]).float()
    logits = trained_logits(model, batch, precision)
    jsd = generalized_jsd(logits, teacher_logits, beta, temperature).sum()
    with torch.no_grad():
        kl = generalized_jsd(logits, teacher_logits, 0.0, temperature).sum()
        ce = F.cross_entropy(logits, batch.targets[trained], reduction="sum")
    return temperature**2 * jsd, kl, ce


class OfflineKDObjective:
    """Offline KD on `KDBatch`es (`offline_kd_loss`); units: trained target tokens."""

    def __init__(self, temperature: float = 1.0, alpha: float = 0.0,
                 loss_fn: Callable[..., tuple[torch.Tensor, ...]] = offline_kd_loss) -> None:
        self.temperature, self.alpha, self.loss_fn = temperature, alpha, loss_fn

    def __call__(self, model: nn.Module, batch: KDBatch, precision: str) -> LossTerms:
        loss, kl, ce = self.loss_fn(model, batch, precision, self.temperature, self.alpha)
        return LossTerms(loss, (batch.targets != IGNORE_INDEX).sum(), {"kl": kl, "ce": ce})

    def compiled(self) -> OfflineKDObjective:
        return OfflineKDObjective(self.temperature, self.alpha, torch.compile(offline_kd_loss))


class GKDObjective:
    """On-policy GKD on `TokenBatch`es (`gkd_loss`) against a frozen `teacher` on the batch's device."""

    def __init__(self, teacher: Transformer, beta: float = 0.5, temperature: float = 1.0,
                 loss_fn: Callable[..., tuple[torch.Tensor, ...]] = gkd_loss) -> None:
        self.teacher, self.beta, self.temperature, self.loss_fn = teacher, beta, temperature, loss_fn

    def __call__(self, model: nn.Module, batch: TokenBatch, precision: str) -> LossTerms:
        loss, kl, ce = self.loss_fn(model, self.teacher, batch, precision, self.beta, self.temperature)
        return LossTerms(loss, (batch.targets != IGNORE_INDEX).sum(), {"kl": kl, "ce": ce})

    def compiled(self) -> GKDObjective:
        return GKDObjective(self.teacher, self.beta, self.temperature, torch.compile(gkd_loss))


# ---- a student made from the teacher --------------------------------------------------------------


def student_from_layers(teacher: Transformer, layers: Sequence[int]) -> Transformer:
    """A copy of `teacher` (in fp32, for training) with only the blocks `layers` (increasing teacher
    indices), renumbered from 0; embeddings, final norm and head are copied. Config lists with one
    entry per layer (Gemma's `layer_types`, HF's others in `extra`) keep the kept layers' entries."""
    cfg = teacher.cfg
    n = cfg.num_hidden_layers
    layers = list(layers)
    if not layers or any(not 0 <= i < n for i in layers) or layers != sorted(set(layers)):
        raise ValueError(f"student layers {layers} must be increasing teacher layer indices in [0, {n}), at least "
                         f"one; e.g. every other layer: {list(range(0, n, 2))}")
    extra = {key: [value[i] for i in layers] if isinstance(value, list) and len(value) == n else value
             for key, value in cfg.extra.items()}
    layer_types = None if cfg.layer_types is None else [cfg.layer_types[i] for i in layers]
    student = Transformer(dataclasses.replace(cfg, num_hidden_layers=len(layers), extra=extra, layer_types=layer_types))
    renumber = {f"layers.{old}.": f"layers.{new}." for new, old in enumerate(layers)}
    state = {}
    for name, tensor in teacher.state_dict().items():
        if name.startswith("layers."):
            prefix = ".".join(name.split(".")[:2]) + "."
            if prefix not in renumber:
                continue
            name = renumber[prefix] + name[len(prefix):]
        state[name] = tensor.detach().float().clone()
    student.load_state_dict(state)
    return student


# ---- configuration --------------------------------------------------------------------------------


@dataclass
class DistillSection:
    """Teacher, student and the distillation loss.

    mode: offline (teacher top-k cached once, KL to it) or gkd (on-policy, generalized JSD).
    teacher: the teacher model (run folder, HF directory, .gguf or alias); its tokenizer renders
        the chats. It runs in bf16 when train.precision is bf16.
    student: a model to start the student from (same tokenizer and vocabulary); empty: the
        teacher's `layers`. layers: teacher layer indices the student keeps (empty: every other
        one, 0, 2, 4, ...).
    top_k: teacher log-probs kept per position (offline). temperature: τ for both distributions.
    alpha: weight of the hard-label cross-entropy next to the KL (offline; 0 = pure KD).
    lmbda: share of on-policy answers (gkd). beta: JSD(β) (gkd; 0 forward KL, 1 reverse KL).
    max_new_tokens/sample_temperature/top_p: how the student samples its answers (gkd).
    cache_dir: where the teacher's top-k files live (offline); empty: train.out_dir/teacher_topk.
        Files are named by their inputs, so runs with the same teacher and data can share one.
    """

    mode: str = "offline"
    teacher: str = "smollm2"
    student: str = ""
    layers: list[int] = field(default_factory=list)
    top_k: int = 32
    temperature: float = 1.0
    alpha: float = 0.0
    lmbda: float = 0.5
    beta: float = 0.5
    max_new_tokens: int = 128
    sample_temperature: float = 1.0
    top_p: float = 1.0
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"distill.mode={self.mode!r}: choose one of {', '.join(MODES)}")
        if not self.teacher:
            raise ValueError("distill.teacher is not set; pass --distill.teacher=MODEL (a directory, .gguf or alias)")
        if self.student and self.layers:
            raise ValueError("give distill.student (a model) or distill.layers (kept teacher layers), not both")
        if self.top_k < 1 or self.max_new_tokens < 1:
            raise ValueError(f"distill.top_k and distill.max_new_tokens must be >= 1, got {self.top_k}, "
                             f"{self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature}")
        for name in ("alpha", "lmbda", "beta"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"distill.{name} must be in [0, 1], got {getattr(self, name)}")
        SamplingParams(temperature=self.sample_temperature, top_p=self.top_p)  # fails now on bad values


@dataclass
class KDOptimSection(SFTOptimSection):
    """Fine-tuning's optimizer with a larger default lr: a student cut from the teacher's layers
    starts damaged and has further to go than a model being fine-tuned."""

    lr: float = 1e-4


@dataclass
class KDConfig:
    """A distillation run: `distill` (teacher, student, loss), `data` (chats, as for SFT; batch_size
    is rows for offline KD and conversations for GKD), then the trainer's own sections."""

    distill: DistillSection = field(default_factory=DistillSection)
    data: ChatDataSection = field(default_factory=ChatDataSection)
    optim: KDOptimSection = field(default_factory=KDOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: SFTTrainSection = field(default_factory=lambda: SFTTrainSection(out_dir="runs/kd"))

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)
        if self.distill.mode == "gkd" and self.train.distributed in ("fsdp", "ep"):
            raise ValueError(f"distill.mode=gkd samples from the whole student, which "
                             f"train.distributed={self.train.distributed} shards; use --train.distributed=ddp or none")


def load_kd_config(path: str | Path | None = None, overrides: Overrides = (),
                   defaults: dict | None = None) -> KDConfig:
    """`defaults` ← YAML file ← `--section.key=value` overrides (`tokenmind.config.load_config` with `KDConfig`)."""
    return load_config(KDConfig, path, overrides, defaults)


# ---- the run --------------------------------------------------------------------------------------


def load_student(distill: DistillSection, teacher: Pretrained) -> Pretrained:
    """The starting student: `distill.student` checked against the teacher's vocabulary, or the
    teacher's `distill.layers`; with the teacher's tokenizer either way."""
    if not distill.student:
        n = teacher.model.cfg.num_hidden_layers
        model = student_from_layers(teacher.model, distill.layers or range(0, n, 2))
        return Pretrained(model, teacher.tokenizer, teacher.path)
    student = load_model(distill.student)
    if (student.model.cfg.vocab_size != teacher.model.cfg.vocab_size
            or student.tokenizer.backend.get_vocab() != teacher.tokenizer.backend.get_vocab()):
        raise ValueError(f"the student {distill.student!r} does not share the teacher's tokenizer and vocabulary "
                         f"({student.model.cfg.vocab_size} vs {teacher.model.cfg.vocab_size} logits), so their "
                         "distributions cannot be compared; distill into a model of the teacher's family or leave "
                         "distill.student empty to cut one from the teacher's layers")
    return Pretrained(student.model, teacher.tokenizer, student.path)


def offline_loaders(cfg: KDConfig, ctx: DistContext, teacher: Pretrained, chats: ChatData, stats: dict,
                    progress: bool) -> tuple[TopKChatLoader, TopKChatLoader | None]:
    """SFT's chat loaders with the teacher's top-k of their rows (read from the cache, or built
    there first by the main rank); each split's cache file and top-k mass go into `stats`."""
    d, data = cfg.distill, cfg.data
    cache_dir = Path(d.cache_dir or Path(cfg.train.out_dir) / "teacher_topk")
    loaders = []
    for split, plain in zip(("train", "val"), chat_loaders(chats, data, ctx)):
        if plain is None:
            continue
        options = (cache_dir, split, data.seq_len, d.top_k, d.temperature, cfg.train.precision, data.batch_size,
                   ctx.device)
        if ctx.is_main:  # builds the file if it is missing; the other ranks read it once it is there
            topk, path = teacher_topk(teacher, plain.examples, *options, progress=progress)
        ctx.barrier()
        if not ctx.is_main:
            topk, path = teacher_topk(teacher, plain.examples, *options, build=False)
        stats[f"{split}_teacher_topk"] = {"file": str(path), "mean_topk_mass": topk.mean_mass}
        loaders.append(TopKChatLoader(plain.examples, plain.cfg, topk))
    return loaders[0], loaders[1] if len(loaders) > 1 else None


def on_policy_loaders(cfg: KDConfig, ctx: DistContext, student: Pretrained, chats: ChatData,
                      stats: dict) -> tuple[OnPolicyLoader, OnPolicyLoader | None]:
    """GKD's loaders: the train conversations with on-policy final turns, the val ones as they are."""
    d, data = cfg.distill, cfg.data
    if len(chats.turn_end_ids) != 1:
        raise ValueError(f"the chat template ends assistant turns with {sorted(chats.turn_end_ids) or 'no'} special "
                         "token(s); on-policy samples need exactly one to end with (use a chat model's tokenizer)")
    (end_id,) = chats.turn_end_ids
    turns, stats["dropped_prompt_fills_row"] = final_turns(chats.train, data.seq_len)
    val_turns, _ = final_turns(chats.val, data.seq_len)
    # only the end of turn stops a sample (not a plain eos), so the sample is exactly the tokens drawn
    sampling = SamplingParams(max_tokens=d.max_new_tokens, temperature=d.sample_temperature, top_p=d.top_p,
                              stop_token_ids=[end_id], ignore_eos=True)
    loader = OnPolicyLoader(turns, loader_config(data, ctx, data.seed, data.shuffle), d.lmbda, student, sampling,
                            end_id)
    return loader, OnPolicyLoader(val_turns, val_loader_config(data, ctx, len(val_turns)), 0.0) if val_turns else None


def build_kd_trainer(cfg: KDConfig, ctx: DistContext, progress: bool | None = None) -> Trainer:
    """The `Trainer` of a distillation run: teacher and student loaded, the chats rendered with
    their tokenizer, the mode's loaders and objective (offline KD lets the teacher go once its
    top-k is cached). Writes the data's statistics to out_dir/kd_data.json.
    progress: a bar while the teacher fills the cache; None = on a terminal."""
    d = cfg.distill
    teacher = load_model(d.teacher, dtype=torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32)
    teacher.model.requires_grad_(False).to(ctx.device)
    student = load_student(d, teacher)
    chats = chat_data(cfg.data, student)
    add_stop_ids(student.model, student.tokenizer.eos_token_ids | chats.turn_end_ids)
    stats = dict(chats.stats)
    if d.mode == "offline":
        progress = sys.stderr.isatty() if progress is None else progress
        loader, val_loader = offline_loaders(cfg, ctx, teacher, chats, stats, progress)
        objective = OfflineKDObjective(d.temperature, d.alpha)
    else:
        loader, val_loader = on_policy_loaders(cfg, ctx, student, chats, stats)
        objective = GKDObjective(teacher.model, d.beta, d.temperature)
    if ctx.is_main:
        with atomic_open(Path(cfg.train.out_dir) / "kd_data.json") as handle:
            handle.write(json.dumps(stats, indent=2) + "\n")
    return Trainer(cfg, ctx, student.model, loader, val_loader, objective=objective, tokenizer=student.tokenizer)


def kd_train(cfg: KDConfig) -> TrainResult:
    """Distill (or resume) the run `cfg` describes; behind `tokenmind posttrain kd|gkd`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_kd_trainer(cfg, ctx).train()
