"""Checkpoints: a resumed run retraces the uninterrupted loss curve; saves are atomic; pruning."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_train_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    crash_in_step_5,
    one_thread,
    pretrainer,
    tiny_config,
    write_shards,
)

from tokenmind.train import pretrain
from tokenmind.train.checkpoint import (
    TrainingState,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from tokenmind.train.distributed import DistContext
from tokenmind.jsonl import read_jsonl


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"))


def train_records(out_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_retraces_the_uninterrupted_loss_curve(shards: Path, tmp_path: Path, grad_accum: int) -> None:
    args = [f"--train.grad_accum={grad_accum}", "--train.checkpoint_every=4", "--train.keep_last=0"]
    straight = pretrain(tiny_config(shards, tmp_path / "straight", *args))

    crashed_cfg = tiny_config(shards, tmp_path / "crashed", *args)
    crash_in_step_5(pretrainer(crashed_cfg))
    assert [r["step"] for r in train_records(tmp_path / "crashed")] == [1, 2, 3, 4, 5]

    resumed = pretrain(crashed_cfg)
    assert len(resumed.losses) == 4  # steps 5..8 only
    a, b = train_records(tmp_path / "straight"), train_records(tmp_path / "crashed")
    assert [r["step"] for r in b] == list(range(1, 9))  # the lost step-5 record was replaced
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key  # bit-identical in fp32 on CPU
    assert straight.losses == [r["loss"] for r in a]
    end_a = load_file(tmp_path / "straight" / "checkpoints" / "step_000008" / "model.safetensors")
    end_b = load_file(tmp_path / "crashed" / "checkpoints" / "step_000008" / "model.safetensors")
    assert end_a.keys() == end_b.keys()
    assert all(torch.equal(end_a[k], end_b[k]) for k in end_a)


def test_keep_last_prunes_old_checkpoints(shards: Path, tmp_path: Path) -> None:
    cfg = tiny_config(shards, tmp_path, "--train.steps=5", "--train.checkpoint_every=1", "--train.keep_last=2")
    pretrain(cfg)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000004", "step_000005"]


def test_existing_run_is_not_overwritten_without_resume(shards: Path, tmp_path: Path) -> None:
    pretrain(tiny_config(shards, tmp_path, "--train.steps=2"))
    with pytest.raises(FileExistsError, match="train.resume=true"):
        pretrainer(tiny_config(shards, tmp_path, "--train.steps=4", "--train.resume=false"))


def test_interrupted_save_leaves_no_final_checkpoint(tmp_path: Path) -> None:
    ctx = DistContext("none", torch.device("cpu"))
    good = TrainingState(model={"w": torch.ones(3)}, optimizer={"state": {}}, trainer={"step": 1},
                         rank={"loader": {"epoch": 0}})
    save_checkpoint(tmp_path, 1, good, ctx)
    broken = TrainingState(model={"w": torch.zeros(3)}, optimizer={"state": {"x": lambda: 0}},
                           trainer={"step": 2}, rank={})
    with pytest.raises(Exception):  # pickling the lambda fails mid-save, after the weights were written
        save_checkpoint(tmp_path, 2, broken, ctx)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    (tmp_path / "step_000003.tmp").mkdir()  # what a killed process leaves behind
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    loaded = load_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(loaded.model["w"], torch.ones(3)) and loaded.trainer == {"step": 1}


def test_tied_embeddings_are_stored_once_and_restored(shards: Path, tmp_path: Path) -> None:
    cfg = tiny_config(shards, tmp_path, "--train.steps=2", "--model.tie_word_embeddings=true")
    result = pretrain(cfg)
    stored = load_file(result.checkpoint_path / "model.safetensors")
    assert "lm_head.weight" not in stored  # an alias, named in the file's metadata
    state = load_checkpoint(result.checkpoint_path).model
    assert state["lm_head.weight"] is state["embed_tokens.weight"]


def test_rng_states_survive_a_weights_only_round_trip(tmp_path: Path) -> None:
    def draw() -> tuple:
        return torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(2).tolist()

    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    torch.save(capture_rng(), tmp_path / "rng.pt")
    expected = draw()
    draw()
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draw() == expected
