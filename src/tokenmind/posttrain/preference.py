"""Preference optimization: DPO, IPO, KTO, ORPO and SimPO as objectives of the one trainer.

Each method is a loss over sequence log-probabilities, so all of them share one forward pass:
`sequence_logps` sums the policy's log-prob of every completion token per sequence over the
packed rows of `preference_data` (chosen and rejected side by side, each its own document), and
`pair_losses` / `kto_losses` turn those sums into per-unit losses. With β the strength of the
implicit KL constraint, π the policy, π_ref the frozen reference, y_w/y_l chosen/rejected and
log-ratios r = log π(y|x) − log π_ref(y|x):

* DPO (Rafailov et al. 2023): −log σ(β (r_w − r_l)).
* IPO (Azar et al. 2023): (r_w/|y_w| − r_l/|y_l| − 1/(2β))², log-ratios per token as TRL
  computes it, a squared loss that does not push the margin to infinity.
* KTO (Ethayarajh et al. 2024), unpaired answers with a desirability label:
  w_d (1 − σ(β (r − z))) for desirable, w_u (1 − σ(β (z − r))) for undesirable answers, z the
  batch's KL estimate from mismatched (prompt, other answer) sequences, detached, clamped at 0.
* ORPO (Hong et al. 2024), no reference: the chosen answer's per-token NLL − λ log σ(log odds
  ratio), the odds computed from per-token mean log-probs.
* SimPO (Meng et al. 2024), no reference: −log σ(β (mean log π(y_w) − mean log π(y_l)) − γ).
* An NLL term on the chosen answers (RPO, Pang et al. 2024) can be added to DPO, IPO or SimPO with
  weight α: α × the mean NLL of the micro-batch's chosen tokens, as TRL's "sft" loss term. DPO alone
  can lower the chosen answer's likelihood along with the rejected one's (both fall, the rejected
  faster); on verifier-ranked reasoning pairs the NLL term keeps the right answers likely.

The reference model is never kept in memory: its log-probs do not change, so they are computed
once before training over every unit (the starting weights are the reference; with LoRA that is
the base, since fresh adapters are zero) and cached in out_dir keyed by the data and the model,
so a resumed run reads them back. The logged metrics are TRL's: implicit rewards β·r of chosen
and rejected, their margin, and reward accuracy (the share of pairs where chosen wins).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.config import Overrides, load_config
from tokenmind.data.loader import LoaderConfig
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.progress import Bars
from tokenmind.train.config import ScheduleSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.objectives import LossTerms, autocast
from tokenmind.train.trainer import Trainer, TrainResult, loader_config

from .data import expand_files, pack
from .preference_data import PAIRED, UNPAIRED, PreferenceData, SequenceBatch, Unit, UnitLoader, \
    prepare_preferences, read_preferences
from .sft import ChatDataSection, LoRASection, SFTOptimSection, SFTSection, SFTTrainSection, adapter_base, load_start, \
    val_loader_config

LOSSES = ("dpo", "ipo", "kto", "orpo", "simpo")
NEEDS_REFERENCE = ("dpo", "ipo", "kto")
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "kto": 0.1, "orpo": 0.1, "simpo": 2.0}  # the papers' / TRL's defaults


# ---- the math, on tensors -------------------------------------------------------------------------


def sequence_logps(model: nn.Module, batch: SequenceBatch, precision: str) -> torch.Tensor:
    """(S,) the log-prob the model gives each sequence's completion, summed over its tokens
    (logits computed only where an answer token is predicted)."""
    sequence = batch.sequence.flatten()
    scored = (sequence >= 0).nonzero().squeeze(1)
    attn = DenseAttentionMetadata(document_ids=batch.document_ids, parent_ids=batch.parent_ids)
    with autocast(batch.input_ids.device, precision):
        logits = model(batch.input_ids, batch.positions, attn, logits_at=scored)
    token_logps = -F.cross_entropy(logits.float(), batch.targets.flatten()[scored], reduction="none")
    return token_logps.new_zeros(batch.lengths.shape[0]).index_add(0, sequence[scored], token_logps)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, accurate at both ends (Mächler 2012)."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(loss: str, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, len_chosen: torch.Tensor, len_rejected: torch.Tensor, beta: float,
                gamma: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward) from summed completion log-probs (P,) of
    policy and reference and the completion lengths; see the module docstring for each loss."""
    if loss in ("dpo", "ipo"):
        r_w, r_l = chosen - ref_chosen, rejected - ref_rejected
        if loss == "dpo":
            losses = -F.logsigmoid(beta * (r_w - r_l))
        else:
            losses = (r_w / len_chosen - r_l / len_rejected - 1 / (2 * beta)) ** 2
        return losses, beta * r_w.detach(), beta * r_l.detach()
    mean_w, mean_l = chosen / len_chosen, rejected / len_rejected
    if loss == "simpo":
        losses = -F.logsigmoid(beta * (mean_w - mean_l) - gamma)
    elif loss == "orpo":
        log_odds = (mean_w - mean_l) - (log1mexp(mean_w) - log1mexp(mean_l))
        losses = -mean_w - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown pair loss {loss!r}; choose one of dpo, ipo, orpo, simpo")
    return losses, beta * mean_w.detach(), beta * mean_l.detach()


def kto_losses(answer: torch.Tensor, ref_answer: torch.Tensor, mismatched: torch.Tensor, ref_mismatched: torch.Tensor,
               desirable: torch.Tensor, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-example loss, reward β·r, the KL estimate z) for unpaired answers (U,) with their
    mismatched KL sequences (U,) and desirability (U,) in {0, 1}."""
    kl = (mismatched - ref_mismatched).mean().detach().clamp(min=0)
    ratio = answer - ref_answer
    good = desirable.bool()
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses, beta * ratio.detach(), kl


# ---- the objective ----------------------------------------------------------------------------------


class PreferenceObjective:
    """One of LOSSES on `SequenceBatch`es; the units are pairs (or KTO examples), so the trainer
    averages over them. Metrics (per unit): reward accuracy and margin, chosen/rejected reward
    for pairs; desirable/undesirable reward sums and the KL estimate for KTO."""

    def __init__(self, loss: str, beta: float, gamma: float = 0.0, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, nll_weight: float = 0.0, logps_fn=sequence_logps) -> None:
        if loss not in LOSSES:
            raise ValueError(f"unknown preference loss {loss!r}; choose one of {', '.join(LOSSES)}")
        self.loss, self.beta, self.gamma, self.nll_weight = loss, beta, gamma, nll_weight
        self.weights = (desirable_weight, undesirable_weight)
        self.logps_fn = logps_fn

    def __call__(self, model: nn.Module, batch: SequenceBatch, precision: str) -> LossTerms:
        logps = self.logps_fn(model, batch, precision)
        first, second = batch.members[:, 0], batch.members[:, 1]
        if self.loss == "kto":
            losses, rewards, kl = kto_losses(logps[first], batch.ref_logps[first], logps[second],
                                             batch.ref_logps[second], batch.labels, self.beta, *self.weights)
            good = batch.labels
            return LossTerms(losses.sum(), len(losses), {
                "kl": kl * len(losses), "desirable_reward": (rewards * good).sum(),
                "undesirable_reward": (rewards * (1 - good)).sum()})
        losses, chosen, rejected = pair_losses(
            self.loss, logps[first], logps[second], batch.ref_logps[first], batch.ref_logps[second],
            batch.lengths[first], batch.lengths[second], self.beta, self.gamma)
        total = losses.sum()
        metrics = {"reward_accuracy": (chosen > rejected).float().sum(), "reward_margin": (chosen - rejected).sum(),
                   "chosen_reward": chosen.sum(), "rejected_reward": rejected.sum()}
        if self.nll_weight:
            # the trainer divides by the pair count, so this adds α × the chosen tokens' mean NLL
            nll = -logps[first].sum() / batch.lengths[first].sum()
            total = total + self.nll_weight * nll * len(losses)
            metrics["chosen_nll"] = nll.detach() * len(losses)
        return LossTerms(total, len(losses), metrics)

    def compiled(self) -> PreferenceObjective:
        return PreferenceObjective(self.loss, self.beta, self.gamma, *self.weights, self.nll_weight,
                                   logps_fn=torch.compile(sequence_logps))


# ---- reference log-probs, once ------------------------------------------------------------------


@torch.no_grad()
def compute_reference_logps(model: nn.Module, units: list[Unit], seq_len: int, batch_size: int, precision: str,
                            device: torch.device, progress: bool = True, label: str = "reference") -> None:
    """Fill every unit's `ref_logps` with `model`'s completion log-probs (the model is left in
    train mode). Covers every unit, not only full batches."""
    loader = UnitLoader(units, LoaderConfig(batch_size, seq_len, shuffle=False))
    was_training = model.training
    model.eval()
    rows = len(loader.rows)
    with Bars(progress) as bars:
        advance = bars.add(f"{label} log-probs", rows)
        for begin in range(0, rows, batch_size):
            batch = loader.batch_for_rows(range(begin, min(begin + batch_size, rows))).to(device)
            logps = sequence_logps(model, batch, precision).cpu().numpy()
            for unit, members in zip(batch.units.tolist(), batch.members.cpu().numpy()):
                units[unit].ref_logps = logps[members]
            if advance:
                advance(min(batch_size, rows - begin))
    model.train(was_training)


def data_key(data: PreferenceData, *parts: str) -> str:
    """A digest of the tokenized units and `parts` (what else the cached numbers depend on)."""
    digest = hashlib.sha256("\0".join(parts).encode())
    for units in (data.train, data.val):
        for unit in units:
            for seq in unit.members:
                digest.update(np.int64(seq.start).tobytes() + seq.ids.tobytes())
    return digest.hexdigest()


def cached_reference_logps(path: Path, key: str, data: PreferenceData, compute, write: bool = True) -> bool:
    """Reference log-probs from `path` when its key matches, else from `compute()` (which fills
    the units) and written to `path` atomically. True if they came from the cache."""
    splits = {"train": data.train, "val": data.val}
    if path.is_file():
        try:
            with open(path.with_suffix(".json")) as fh:
                cached_key = json.load(fh)["key"]
        except (OSError, ValueError, KeyError):
            cached_key = None
        if cached_key == key:
            tensors = load_file(path)
            for name, units in splits.items():
                for unit, logps in zip(units, tensors.get(name, torch.empty(0)).numpy()):
                    unit.ref_logps = logps
            return True
    compute()
    if write:
        tensors = {name: torch.tensor(np.stack([u.ref_logps for u in units]))
                   for name, units in splits.items() if units}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, tmp)
        os.replace(tmp, path)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"key": key}) + "\n")
        os.replace(tmp, path.with_suffix(".json"))
    return False


# ---- configuration and entry point ----------------------------------------------------------------


@dataclass
class PreferenceSection(SFTSection):
    """The starting model (init_from, tokenizer: as for SFT; it is also the reference) and the loss.

    loss: dpo, ipo, kto, orpo or simpo. beta: None takes the loss's usual value (0.1; SimPO 2.0);
        for ORPO it is λ, the weight of the odds-ratio term. gamma: SimPO's target reward margin.
    desirable_weight/undesirable_weight: KTO's class weights (keep w_d·n_d / (w_u·n_u) in [1, 4/3]).
    kl_group: KTO's mismatched sequences pair each prompt with another answer of its group.
    nll_weight: α of an NLL term on the chosen answers (RPO; TRL's loss_type=[sigmoid, sft] with
        loss_weights=[1, α]) for dpo, ipo and simpo; 0 = off (ORPO has its own NLL term).
    max_length: tokens kept per sequence (prompt + answer); 0 = data.seq_len // 2, so any pair fits a row.
    """

    loss: str = "dpo"
    beta: float | None = None
    gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    kl_group: int = 8
    max_length: int = 0
    nll_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"preference.loss={self.loss!r}: choose one of {', '.join(LOSSES)}")
        if self.beta is None:
            self.beta = DEFAULT_BETA[self.loss]
        if self.beta <= 0 or self.kl_group < 2 or self.max_length < 0:
            raise ValueError(f"preference.beta must be > 0, kl_group >= 2 and max_length >= 0; got {self.beta}, "
                             f"{self.kl_group}, {self.max_length}")
        if self.nll_weight < 0 or (self.nll_weight and self.loss in ("kto", "orpo")):
            raise ValueError(f"preference.nll_weight={self.nll_weight}: it must be >= 0 and adds to dpo, ipo or simpo "
                             "(ORPO has its own NLL term, KTO has no pairs); set it to 0 for "
                             f"preference.loss={self.loss}")


@dataclass
class PreferenceOptimSection(SFTOptimSection):
    """Preference tuning moves a good model a little: TRL's DPO learning rate."""

    lr: float = 1e-6


@dataclass
class PreferenceConfig:
    """A whole preference run: `preference`, `data` (JSONL of pairs or labelled answers), `lora`,
    then the trainer's sections."""

    preference: PreferenceSection = field(default_factory=PreferenceSection)
    data: ChatDataSection = field(default_factory=ChatDataSection)
    lora: LoRASection = field(default_factory=LoRASection)
    optim: PreferenceOptimSection = field(default_factory=PreferenceOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: SFTTrainSection = field(default_factory=lambda: SFTTrainSection(out_dir="runs/preference"))

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)
        if self.preference.max_length * 2 > self.data.seq_len:
            raise ValueError(f"preference.max_length={self.preference.max_length} leaves no room for a pair in a row "
                             f"of data.seq_len={self.data.seq_len}; keep max_length <= seq_len / 2")


def load_preference_config(path: str | Path | None = None, overrides: Overrides = (),
                           defaults: dict | None = None) -> PreferenceConfig:
    """Defaults ← YAML ← `--section.key=value` overrides, as every config here."""
    return load_config(PreferenceConfig, path, overrides, defaults)


def unpair(records: list[dict]) -> list[dict]:
    """Paired records as KTO's unpaired ones: the chosen answer desirable, the rejected not."""
    return [{"prompt": r["prompt"], "completion": r[answer], "label": answer == "chosen", "_where": r["_where"]}
            for r in records for answer in ("chosen", "rejected")]


def preference_data(cfg: PreferenceConfig, tokenizer) -> PreferenceData:
    """The tokenized units of cfg.data.files for cfg.preference.loss (pairs become unpaired for KTO)."""
    p, data = cfg.preference, cfg.data
    if not data.files:
        raise ValueError("data.files is not set; pass --data.files=PATH (preference JSONL: prompt/chosen/rejected, "
                         "or prompt/completion/label for KTO)")
    kind, records = read_preferences(expand_files(data.files))
    if p.loss == "kto" and kind == PAIRED:
        kind, records = UNPAIRED, unpair(records)
    elif p.loss != "kto" and kind == UNPAIRED:
        raise ValueError(f"preference.loss={p.loss} needs chosen/rejected pairs, but data.files hold unpaired "
                         "(completion/label) examples; use --preference.loss=kto for those")
    max_length = p.max_length or data.seq_len // 2
    return prepare_preferences(tokenizer, kind, records, max_length, data.val_fraction, data.seed, p.kl_group)


def build_preference_trainer(cfg: PreferenceConfig, ctx: DistContext, progress: bool = True) -> Trainer:
    """The `Trainer` of a preference run; reference log-probs computed (or read from the cache) first."""
    p, data, out_dir = cfg.preference, cfg.data, Path(cfg.train.out_dir)
    start = load_start(p, cfg.lora)
    prefs = preference_data(cfg, start.tokenizer)
    if p.loss in NEEDS_REFERENCE:
        key = data_key(prefs, str(start.path.resolve()), cfg.lora.quantize or "", cfg.train.precision)
        start.model.to(ctx.device)
        cached_reference_logps(out_dir / "reference_logps.safetensors", key, prefs, lambda: compute_reference_logps(
            start.model, prefs.train + prefs.val, data.seq_len, data.batch_size, cfg.train.precision, ctx.device,
            progress=progress and ctx.is_main), write=ctx.is_main)
    loader = UnitLoader(prefs.train, loader_config(data, ctx, data.seed, data.shuffle))
    val_loader = None
    if prefs.val:
        rows = pack([u.length for u in prefs.val], data.seq_len)
        val_loader = UnitLoader(prefs.val, val_loader_config(data, ctx, len(rows)))
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "preference_data.json").write_text(json.dumps(prefs.stats, indent=2) + "\n")
    if prefs.stats["truncated"]:
        warnings.warn(f"{prefs.stats['truncated']} of {prefs.stats['records']} examples were cut to "
                      f"{p.max_length or data.seq_len // 2} tokens (see {out_dir / 'preference_data.json'})")
    objective = PreferenceObjective(p.loss, p.beta, p.gamma, p.desirable_weight, p.undesirable_weight, p.nll_weight)
    return Trainer(cfg, ctx, start.model, loader, val_loader, objective=objective, tokenizer=start.tokenizer,
                   adapter_base=adapter_base(p.init_from))


def preference_train(cfg: PreferenceConfig) -> TrainResult:
    """Train (or resume) the preference run `cfg` describes; behind `tokenmind posttrain dpo|ipo|kto|orpo|simpo`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_preference_trainer(cfg, ctx).train()
