"""The objective seam: next-token terms against F.cross_entropy, and an objective with its own
batch type (defined here) trained, weighed per unit, logged and evaluated by the unchanged Trainer."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.data.loader import IGNORE_INDEX, TokenBatch
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train import LossTerms, NextTokenObjective, Trainer, load_config
from tokenmind.train.distributed import init_distributed
from tokenmind.jsonl import read_jsonl
from tokenmind.train.objectives import autocast

VOCAB = 32


def tiny_model(std: float = 0.02) -> Transformer:
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Transformer(cfg)
    model.init_weights(std, torch.Generator().manual_seed(0))
    return model


def test_next_token_terms_sum_what_cross_entropy_averages() -> None:
    model, g = tiny_model(), torch.Generator().manual_seed(0)
    ids, targets = torch.randint(VOCAB, (2, 12), generator=g), torch.randint(VOCAB, (2, 12), generator=g)
    targets[0, :5] = IGNORE_INDEX  # e.g. a prompt SFT does not train on
    targets[1, -3:] = IGNORE_INDEX  # e.g. row padding
    positions = torch.arange(12).repeat(2, 1)
    terms = NextTokenObjective()(model, TokenBatch(ids, targets, torch.zeros_like(ids), positions), "fp32")

    assert int(terms.count) == 24 - 8 and terms.metrics == {}
    logits = model(ids, positions)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(terms.loss / terms.count, expected)


def test_packed_documents_are_scored_as_if_alone() -> None:
    model, g = tiny_model(), torch.Generator().manual_seed(1)
    ids, targets = torch.randint(VOCAB, (12,), generator=g), torch.randint(VOCAB, (12,), generator=g)
    targets[6] = IGNORE_INDEX
    docs = torch.tensor([0] * 7 + [1] * 5)
    positions = torch.cat([torch.arange(7), torch.arange(5)])
    packed = NextTokenObjective()(model, TokenBatch(ids[None], targets[None], docs[None], positions[None]), "fp32")
    alone = [NextTokenObjective()(model, TokenBatch(ids[None, s], targets[None, s], torch.zeros(1, n, dtype=torch.long),
                                                    torch.arange(n)[None]), "fp32")
             for s, n in ((slice(0, 7), 7), (slice(7, 12), 5))]
    assert int(packed.count) == sum(int(t.count) for t in alone) == 11
    torch.testing.assert_close(packed.loss, alone[0].loss + alone[1].loss)


# ---- an objective the trainer has never seen -----------------------------------------------------


@dataclass
class EchoBatch:
    """Tokens to echo back, and a 0/1 weight per position: only weighted positions are trained."""

    ids: torch.Tensor  # (B, T)
    weights: torch.Tensor  # (B, T) float

    def to(self, device: torch.device) -> EchoBatch:
        return EchoBatch(self.ids.to(device), self.weights.to(device))


def echo_loss(model: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor,
              precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed weighted cross-entropy of each *input* token at its own position, summed weighted hits)."""
    with autocast(ids.device, precision):
        logits = model(ids).float()
    nll = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
    hits = (logits.argmax(-1) == ids).float().flatten()
    return (nll * weights.flatten()).sum(), (hits * weights.flatten()).sum()


class EchoObjective:
    """Predict the current token, not the next one; units are the weighted positions; reports accuracy."""

    def __call__(self, model: torch.nn.Module, batch: EchoBatch, precision: str) -> LossTerms:
        loss, hits = echo_loss(model, batch.ids, batch.weights, precision)
        return LossTerms(loss, batch.weights.sum(), {"accuracy": hits})

    def compiled(self) -> EchoObjective:
        return self


class EchoLoader:
    """Seeded `EchoBatch`es, each row trained on a different share of its positions (so micro-batches
    hold different numbers of units); its position is the count of batches served."""

    def __init__(self, seed: int, batch_size: int = 4, seq_len: int = 16) -> None:
        self.seed, self.batch_size, self.seq_len, self.served = seed, batch_size, seq_len, 0
        self.batches_per_epoch = 2

    def __next__(self) -> EchoBatch:
        g = torch.Generator().manual_seed(self.seed * 100_000 + self.served)
        self.served += 1
        shape = (self.batch_size, self.seq_len)
        weights = (torch.rand(shape, generator=g) < torch.rand(self.batch_size, 1, generator=g)).float()
        weights[:, 0] = 1.0  # at least one unit per row
        return EchoBatch(torch.randint(VOCAB, shape, generator=g), weights)

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


def echo_trainer(out_dir: Path, *overrides: str, std: float = 0.02) -> tuple[Trainer, Transformer]:
    """(a Trainer of the echo objective on a tiny model, a copy of that model's starting weights)."""
    cfg = load_config(None, ["--data.batch_size=4", "--data.seq_len=16", "--optim.lr=1e-2",
                             "--schedule.name=constant", "--schedule.warmup_steps=0", "--train.steps=30",
                             "--train.precision=fp32", f"--train.out_dir={out_dir}", *overrides])
    model = tiny_model(std)
    cfg, start = dataclasses.replace(cfg, model=model.cfg), copy.deepcopy(model)
    ctx = init_distributed("none", "cpu")
    return Trainer(cfg, ctx, model, EchoLoader(seed=0), EchoLoader(seed=1), objective=EchoObjective()), start


def test_a_custom_objective_trains_logs_its_metric_and_evaluates(tmp_path: Path) -> None:
    trainer, _ = echo_trainer(tmp_path, "--train.eval_every=15")
    result = trainer.train()

    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 2.0  # ln(32) = 3.5 → near 0
    records = read_jsonl(result.metrics_path)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert list(train[0])[:3] == ["step", "loss", "accuracy"]  # the metric sits next to the loss
    assert train[0]["accuracy"] < 0.2 and train[-1]["accuracy"] > 0.9
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [15, 30] and val[-1]["val_accuracy"] > 0.9
    assert val[-1]["val_loss"] == result.final_val_loss < 0.5
    assert (result.final_model_path / "model.safetensors").is_file()


def test_every_unit_weighs_the_same_across_micro_batches(tmp_path: Path) -> None:
    """A step's loss, metric and gradient are those of Σ losses / Σ units over its micro-batches."""
    trainer, start = echo_trainer(tmp_path, "--train.grad_accum=2", std=0.5)  # per-token losses far apart
    reference = EchoLoader(seed=0)
    terms = [EchoObjective()(start, next(reference), "fp32") for _ in range(2)]
    units = [float(t.count) for t in terms]
    assert units[0] != units[1]  # so a mean of the micro-batch means would differ
    loss = (terms[0].loss + terms[1].loss) / sum(units)
    loss.backward()
    mean_of_means = float(sum(t.loss.detach() / t.count for t in terms)) / 2
    grad_norm = torch.nn.utils.clip_grad_norm_(start.parameters(), float("inf"))

    stats = trainer.train_step()
    assert stats["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert stats["loss"] != pytest.approx(mean_of_means, rel=5e-3)  # measured: 1.3% apart
    assert stats["accuracy"] == pytest.approx(float(terms[0].metrics["accuracy"] + terms[1].metrics["accuracy"])
                                              / sum(units))
    assert stats["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)

