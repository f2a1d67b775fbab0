"""Reward models: an outcome RM from preference pairs, a process RM from per-step labels.

Both are a `RewardModel` (the Transformer with a scalar head, `model/reward_model.py`) started
from a language model's weights and trained by the one trainer:

* Outcome (Bradley–Terry): P(chosen ≻ rejected) = σ(r(x, y_w) − r(x, y_l)) with r the score at
  the last token of the whole conversation; the loss is −log of it per pair (TRL's
  RewardTrainer, optionally plus a centring term c·(r_w + r_l)² that keeps scores near zero so
  they can be compared across prompts). Data: the preference pairs the DPO family reads
  (`preference_data`), packed the same way.
* Process (PRM, Lightman et al. 2023 / Math-Shepherd): one label per reasoning step, the score
  at the step's last token trained with binary cross-entropy against it, so the model says which
  step went wrong, not only whether the answer did. Data: TRL's stepwise-supervision records
  `{"prompt", "completions": [step, ...], "labels": [bool, ...]}` (`tasks.stepwise_examples`
  writes verifiable ones), rendered as the chat the policy writes: the prompt as the user turn,
  the steps one per line as the assistant's answer. Each becomes an SFT-style `Example` whose
  targets are the labels (1/0) at step ends and IGNORE_INDEX elsewhere, so the chat packing
  and loader are reused as they are.

`load_reward_model(path).score(prompts, completions)` scores answers for best-of-N and
rejection sampling; `.score_steps(prompt, steps)` gives a PRM's per-step probabilities.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmind.config import Overrides, load_config
from tokenmind.data.loader import IGNORE_INDEX, LoaderConfig, TokenBatch
from tokenmind.jsonl import located_objects
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.load import Pretrained, load_model
from tokenmind.model.reward_model import RewardModel
from tokenmind.tokenizer import Tokenizer
from tokenmind.train.config import ScheduleSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import Trainer, TrainResult, loader_config

from .data import ChatLoader, Example, expand_files, pack
from .preference_data import PAIRED, SequenceBatch, Unit, UnitLoader, prepare_preferences, read_preferences, tokenize
from .sft import ChatDataSection, SFTOptimSection, SFTSection, SFTTrainSection, val_loader_config

KINDS = ("outcome", "process")


def position_scores(model: nn.Module, batch: SequenceBatch | TokenBatch, precision: str) -> torch.Tensor:
    """(B, T) the reward model's score at every position of packed rows, in fp32."""
    attn = DenseAttentionMetadata(document_ids=batch.document_ids, parent_ids=getattr(batch, "parent_ids", None))
    with autocast(batch.input_ids.device, precision):
        scores = model(batch.input_ids, batch.positions, attn)
    return scores.float()


class PairwiseRewardObjective:
    """Bradley–Terry loss on `SequenceBatch`es of pairs; units are pairs. Metrics: accuracy (chosen
    scored higher), margin, mean score."""

    def __init__(self, center_coefficient: float = 0.0, scores_fn=position_scores) -> None:
        self.center_coefficient, self.scores_fn = center_coefficient, scores_fn

    def __call__(self, model: nn.Module, batch: SequenceBatch, precision: str) -> LossTerms:
        scores = self.scores_fn(model, batch, precision).flatten()[batch.last]
        chosen, rejected = scores[batch.members[:, 0]], scores[batch.members[:, 1]]
        losses = -F.logsigmoid(chosen - rejected)
        if self.center_coefficient:
            losses = losses + self.center_coefficient * (chosen + rejected) ** 2
        d = (chosen - rejected).detach()
        return LossTerms(losses.sum(), len(losses), {"accuracy": (d > 0).float().sum(), "margin": d.sum(),
                                                     "mean_score": (chosen + rejected).detach().sum() / 2})

    def compiled(self) -> PairwiseRewardObjective:
        return PairwiseRewardObjective(self.center_coefficient, torch.compile(position_scores))


class StepRewardObjective:
    """Binary cross-entropy of the score at each labelled step end (`TokenBatch.targets` 1/0,
    IGNORE_INDEX elsewhere); units are steps. Metric: step accuracy at threshold 0.5."""

    def __init__(self, scores_fn=position_scores) -> None:
        self.scores_fn = scores_fn

    def __call__(self, model: nn.Module, batch: TokenBatch, precision: str) -> LossTerms:
        scores = self.scores_fn(model, batch, precision)
        labelled = batch.targets != IGNORE_INDEX
        logits, labels = scores[labelled], batch.targets[labelled].float()
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        return LossTerms(loss, labelled.sum(), {"accuracy": ((logits.detach() > 0).float() == labels).float().sum()})

    def compiled(self) -> StepRewardObjective:
        return StepRewardObjective(torch.compile(position_scores))


# ---- process supervision data --------------------------------------------------------------------


def step_example(tokenizer: Tokenizer, prompt: str | list[dict], steps: Sequence[str],
                 labels: Sequence[bool] | None = None, separator: str = "\n") -> tuple[list[int], list[int]]:
    """(ids, step-end positions) of a stepwise record: the prompt rendered with the generation
    prompt, then each step and the separator tokenized in turn (so a step's end is a token
    boundary). `labels` only checks the count."""
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels; give one label per step")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ends = []
    for step in steps:
        ids += tokenizer.encode(step + separator)
        ends.append(len(ids) - 1)
    return ids, ends


def read_stepwise(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """TRL stepwise-supervision records, checked."""
    records = []
    for where, record in located_objects(paths):
        ok = ("prompt" in record and isinstance(record.get("completions"), list)
              and isinstance(record.get("labels"), list) and len(record["completions"]) == len(record["labels"]) > 0
              and all(isinstance(b, bool) for b in record["labels"]))
        if not ok:
            raise ValueError(f'{where}: a process-reward record needs "prompt", "completions" (the steps) and '
                             '"labels" (one true/false per step)')
        records.append(record)
    if not records:
        raise ValueError("no process-reward records: the data.files hold no JSONL lines")
    return records


def stepwise_examples_for(tokenizer: Tokenizer, records: Sequence[Mapping[str, Any]], seq_len: int,
                          val_fraction: float, seed: int) -> tuple[list[Example], list[Example], dict[str, Any]]:
    """Train/val `Example`s (targets = step labels at step ends) split by a seeded permutation;
    steps cut off by seq_len lose their labels."""
    n = len(records)
    n_val = min(max(round(n * val_fraction), 1), n - 1) if val_fraction > 0 else 0
    val_ids = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train, val, lost = [], [], 0
    for i, record in enumerate(records):
        ids, ends = step_example(tokenizer, record["prompt"], record["completions"], record["labels"])
        targets = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        for end, label in zip(ends, record["labels"]):
            targets[end] = int(label)
        lost += sum(end >= seq_len for end in ends)
        example = Example(np.asarray(ids[:seq_len], dtype=np.int64), targets[:seq_len])
        if (example.targets != IGNORE_INDEX).any():
            (val if i in val_ids else train).append(example)
    stats = {"records": n, "train_records": len(train), "val_records": len(val), "steps_cut_off": lost,
             "train_steps": int(sum((e.targets != IGNORE_INDEX).sum() for e in train)),
             "train_correct_steps": int(sum((e.targets == 1).sum() for e in train))}
    return train, val, stats


# ---- configuration and entry point ----------------------------------------------------------------


@dataclass
class RewardSection(SFTSection):
    """The starting model (a language model, or a reward model to continue) and the kind.

    kind: outcome (pairs, Bradley–Terry) or process (stepwise labels, per-step BCE).
    center_coefficient: the outcome RM's score-centring weight (TRL's; 0 = off, 0.01 is usual).
    max_length: tokens kept per sequence of a pair; 0 = data.seq_len // 2.
    seed: draws the new scalar head.
    """

    kind: str = "outcome"
    center_coefficient: float = 0.0
    max_length: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"reward.kind={self.kind!r}: choose outcome (pairs) or process (per-step labels)")


@dataclass
class RewardOptimSection(SFTOptimSection):
    """A new head on pretrained blocks learns at a fine-tuning rate."""

    lr: float = 1e-5


@dataclass
class RewardConfig:
    """A whole reward-model run: `reward`, `data`, then the trainer's sections (no LoRA: the new
    head and the blocks train together)."""

    reward: RewardSection = field(default_factory=RewardSection)
    data: ChatDataSection = field(default_factory=ChatDataSection)
    optim: RewardOptimSection = field(default_factory=RewardOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: SFTTrainSection = field(default_factory=lambda: SFTTrainSection(out_dir="runs/reward"))

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_reward_config(path: str | Path | None = None, overrides: Overrides = (),
                       defaults: dict | None = None) -> RewardConfig:
    return load_config(RewardConfig, path, overrides, defaults)


def start_reward_model(section: RewardSection) -> Pretrained:
    """init_from as a reward model: loaded as one, or a language model given a fresh scalar head."""
    if not section.init_from:
        raise ValueError("reward.init_from is not set; pass --reward.init_from=MODEL (a language model to start "
                         "from, e.g. smollm2 or a run's final/, or a reward model to continue)")
    start = load_model(section.init_from, tokenizer=section.tokenizer or None)
    if not isinstance(start.model, RewardModel):
        head = torch.Generator().manual_seed(section.seed)
        start = Pretrained(RewardModel.from_language_model(start.model, head), start.tokenizer, start.path)
    return start


def reward_loaders(cfg: RewardConfig, tokenizer: Tokenizer, ctx: DistContext):
    """(train loader, val loader or None, data stats) for the run's kind."""
    data = cfg.data
    if not data.files:
        raise ValueError("data.files is not set; pass --data.files=PATH (pairs for an outcome RM, stepwise records "
                         "for a process RM)")
    files = expand_files(data.files)
    if cfg.reward.kind == "process":
        train, val, stats = stepwise_examples_for(tokenizer, read_stepwise(files), data.seq_len, data.val_fraction,
                                                  data.seed)
        loader_type, lengths = ChatLoader, [len(e.inputs) for e in val]
    else:
        kind, records = read_preferences(files)
        if kind != PAIRED:
            raise ValueError("an outcome reward model learns from chosen/rejected pairs; data.files hold unpaired "
                             "(completion/label) examples")
        prefs = prepare_preferences(tokenizer, kind, records, cfg.reward.max_length or data.seq_len // 2,
                                    data.val_fraction, data.seed)
        train, val, stats = prefs.train, prefs.val, prefs.stats
        loader_type, lengths = UnitLoader, [u.length for u in val]
    loader = loader_type(train, loader_config(data, ctx, data.seed, data.shuffle))
    val_loader = loader_type(val, val_loader_config(data, ctx, len(pack(lengths, data.seq_len)))) if val else None
    return loader, val_loader, stats


def build_reward_trainer(cfg: RewardConfig, ctx: DistContext) -> Trainer:
    start = start_reward_model(cfg.reward)
    loader, val_loader, stats = reward_loaders(cfg, start.tokenizer, ctx)
    out_dir = Path(cfg.train.out_dir)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "reward_data.json").write_text(json.dumps(stats, indent=2) + "\n")
    objective = (StepRewardObjective() if cfg.reward.kind == "process"
                 else PairwiseRewardObjective(cfg.reward.center_coefficient))
    return Trainer(cfg, ctx, start.model, loader, val_loader, objective=objective, tokenizer=start.tokenizer)


def reward_train(cfg: RewardConfig) -> TrainResult:
    """Train (or resume) a reward model; behind `tokenmind posttrain reward` and `tokenmind posttrain prm`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_reward_trainer(cfg, ctx).train()


# ---- scoring ----------------------------------------------------------------------------------------


class RewardScorer:
    """A trained reward model ready to score answers (higher = better)."""

    def __init__(self, pretrained: Pretrained) -> None:
        if not isinstance(pretrained.model, RewardModel):
            raise ValueError(f"{pretrained.path} is a language model, not a reward model; train one with "
                             "`tokenmind posttrain reward` (or prm)")
        self.model, self.tokenizer = pretrained.model.eval(), pretrained.tokenizer

    @torch.no_grad()
    def score(self, prompts: Sequence[str | list[dict]], completions: Sequence[str]) -> list[float]:
        """The outcome score of each (prompt, completion): the score at the last token of the
        conversation with the completion as the assistant's answer."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        seqs = [tokenize(self.tokenizer, p, c if isinstance(p, str) else [{"role": "assistant", "content": c}])
                for p, c in zip(prompts, completions)]
        units = [Unit([s]) for s in seqs]
        longest = max(len(s.ids) for s in seqs)
        loader = UnitLoader(units, LoaderConfig(batch_size=1, seq_len=max(longest, 512), shuffle=False))
        batch = loader.batch_for_rows(range(len(loader.rows)))
        flat = position_scores(self.model, batch, "fp32").flatten()[batch.last]
        scores = [0.0] * len(units)
        for unit, members in zip(batch.units.tolist(), batch.members.tolist()):
            scores[unit] = float(flat[members[0]])
        return scores

    @torch.no_grad()
    def score_steps(self, prompt: str | list[dict], steps: Sequence[str]) -> list[float]:
        """A process reward model's probability that each step is right."""
        ids, ends = step_example(self.tokenizer, prompt, steps)
        scores = position_scores(self.model, TokenBatch(*(torch.tensor([x]) for x in (
            ids, ids, [0] * len(ids), list(range(len(ids)))))), "fp32")[0]
        return torch.sigmoid(scores[ends]).tolist()


def load_reward_model(path: str | Path) -> RewardScorer:
    """The reward model at `path` (a run folder or its final/), for scoring."""
    return RewardScorer(load_model(path))
