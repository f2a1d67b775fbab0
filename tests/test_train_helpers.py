"""Shared pieces of the tests/test_train_*.py files: tiny learnable shards, a tiny run config and its trainer.

The corpus is arithmetic progressions (start s, stride 1–3, modulo the vocabulary): the next
token follows from the previous two, so a 2-layer model's loss falls within a few dozen steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmind.data.shards import ShardConfig, ShardWriter
from tokenmind.train.checkpoint import latest_checkpoint
from tokenmind.train.config import RunConfig, load_config
from tokenmind.train.distributed import init_distributed
from tokenmind.train.trainer import Trainer, build_pretrainer

VOCAB = 300
EOS = 0


def write_shards(root: Path, num_docs: int = 300, seed: int = 0, val_tokens: int = 400) -> Path:
    """A shard folder of `num_docs` progressions (train) plus a held-out tail (val)."""
    rng = np.random.default_rng(seed)
    cfg = ShardConfig(tokens_per_shard=2000, val_tokens=val_tokens)
    with ShardWriter(root, vocab_size=VOCAB, eos_token_id=EOS, cfg=cfg) as writer:
        for _ in range(num_docs):
            start, stride, length = rng.integers(1, VOCAB), rng.integers(1, 4), rng.integers(8, 48)
            writer.add((start + stride * np.arange(length)) % (VOCAB - 1) + 1)
    return root


def tiny_config(shards: Path, out_dir: Path, *overrides: str) -> RunConfig:
    """2 layers, dim 64, GQA 4/2 heads, 4 rows × 32 tokens, 8 fp32 steps; `overrides` win."""
    base = [
        f"--model.vocab_size={VOCAB}", "--model.hidden_size=64", "--model.intermediate_size=128",
        "--model.num_hidden_layers=2", "--model.num_attention_heads=4", "--model.num_key_value_heads=2",
        "--model.max_position_embeddings=64",
        f"--data.shards={shards}", "--data.batch_size=4", "--data.seq_len=32",
        "--optim.lr=3e-3", "--schedule.warmup_steps=2",
        "--train.steps=8", "--train.precision=fp32", "--train.eval_batches=2", f"--train.out_dir={out_dir}",
    ]
    return load_config(None, base + list(overrides))


def pretrainer(cfg: RunConfig) -> Trainer:
    """The pre-training `Trainer` of `cfg`, in this process (or the process group it already joined)."""
    return build_pretrainer(cfg, init_distributed(cfg.train.distributed, cfg.train.device))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run on one intra-op thread: on a shared 2-core machine, two OpenMP threads
    spin-wait on each other for every small op and make a step ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Preempted(Exception):
    """Stands in for a killed job."""


def crash(cfg: RunConfig, crash_in_step: int) -> None:
    """Train `cfg` until step `crash_in_step` dies as a killed job would (in this process, or the
    process group it joined). Every rank dies as the step starts, before any rank waits on another
    (pipeline stages run different layers)."""
    trainer = pretrainer(cfg)
    step = trainer.train_step

    def dying_step():
        if trainer.step == crash_in_step - 1:
            raise Preempted
        return step()

    trainer.train_step = dying_step
    with contextlib.suppress(Preempted):
        trainer.train()


def crash_then_resume(cfg: RunConfig, crash_in_step: int) -> None:
    """`crash` `cfg` in step `crash_in_step`, then run it again, resuming from its last checkpoint."""
    from tokenmind.train import pretrain

    crash(cfg, crash_in_step)
    pretrain(cfg)


def crash_in_step_5(trainer) -> None:
    """Train until step 5's forward pass, then die as a killed job would: step 5 ran after the
    step-4 checkpoint (the run must checkpoint at step 4), so its work is lost."""

    def hook(module, inputs, output):
        if trainer.step == 5:
            raise Preempted

    trainer.model.norm.register_forward_hook(hook)
    with pytest.raises(Preempted):
        trainer.train()
    assert latest_checkpoint(trainer.checkpoint_root).name == "step_000004"
