"""fp16 training with dynamic loss scaling: overflow steps skipped, the scale halves and grows
as torch's GradScaler would, and a resumed run restores it exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    crash_in_step_5,
    one_thread,
    pretrainer,
    tiny_config,
    write_shards,
)

from tokenmind.jsonl import read_jsonl
from tokenmind.train import pretrain
from tokenmind.train.precision import LossScaler


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"))


def train_records(out_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


def test_loss_scaler_follows_torch_grad_scaler() -> None:
    """The same overflow pattern drives our scale and torch.amp.GradScaler's through the same values."""
    ours = LossScaler(init_scale=1024.0, growth_interval=3)
    reference = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for overflow in [False, False, False, True, False, True, True, False, False, False, False]:
        reference.scale(weight.sum()).backward()
        if overflow:
            weight.grad[0] = float("inf")
        reference.step(optimizer)
        reference.update()
        optimizer.zero_grad()
        ours.update(float("inf") if overflow else 1.0)
        assert ours.scale == reference.get_scale()
    assert ours.skipped_steps == 3


def test_an_overflowing_step_is_skipped_and_halves_the_scale(shards: Path, tmp_path: Path) -> None:
    trainer = pretrainer(tiny_config(shards, tmp_path, "--train.precision=fp16", "--train.loss_scale=1024",
                                     "--train.steps=4"))
    matmul_dtypes = []
    trainer.model.layers[-1].mlp.down_proj.register_forward_hook(lambda m, i, out: matmul_dtypes.append(out.dtype))
    poison = trainer.model.layers[0].mlp.down_proj.weight
    poison.register_hook(lambda g: g * float("inf") if trainer.step == 1 else g)  # in step 2 only
    trainer.train_step()
    trainer.step += 1
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    adam_steps = [float(s["step"]) for s in trainer.optimizer.state.values()]
    lr_before = trainer.scheduler.get_last_lr()
    skipped = trainer.train_step()
    trainer.step += 1
    assert skipped["loss_scale"] == 1024 and skipped["skipped_steps"] == 1
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name  # no update
    assert [float(s["step"]) for s in trainer.optimizer.state.values()] == adam_steps  # nor optimizer state
    assert trainer.scheduler.get_last_lr() != lr_before  # the schedule still moves with the step
    after = trainer.train_step()
    assert after["loss_scale"] == 512 and after["skipped_steps"] == 1
    assert torch.isfinite(torch.tensor(after["grad_norm"]))
    assert matmul_dtypes[0] == torch.float16  # autocast ran the matmuls in fp16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_the_scale_grows_after_the_growth_interval(shards: Path, tmp_path: Path) -> None:
    result = pretrain(tiny_config(shards, tmp_path, "--train.precision=fp16", "--train.loss_scale=4",
                                  "--train.loss_scale_growth_interval=2", "--train.steps=6"))
    records = train_records(tmp_path)
    assert [r["loss_scale"] for r in records] == [4, 4, 8, 8, 16, 16]
    assert [r["skipped_steps"] for r in records] == [0] * 6
    assert result.losses[-1] < result.losses[0]


def test_an_fp16_resume_restores_the_loss_scale(shards: Path, tmp_path: Path) -> None:
    args = ["--train.precision=fp16", "--train.loss_scale=4", "--train.loss_scale_growth_interval=3",
            "--train.checkpoint_every=4", "--train.keep_last=0"]
    pretrain(tiny_config(shards, tmp_path / "straight", *args))
    crashed = tiny_config(shards, tmp_path / "crashed", *args)
    crash_in_step_5(pretrainer(crashed))
    pretrain(crashed)
    a, b = train_records(tmp_path / "straight"), train_records(tmp_path / "crashed")
    assert [r["loss_scale"] for r in a] == [4, 4, 4, 8, 8, 8, 16, 16]  # grown at steps 3 and 6: across the resume
    for key in ("loss", "grad_norm", "loss_scale"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_precision_config_errors_name_the_fix(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one of fp32, bf16, fp16, fp8"):
        tiny_config(shards, tmp_path, "--train.precision=fp4")
    with pytest.raises(ValueError, match="train.gradient_checkpointing=false"):
        tiny_config(shards, tmp_path, "--train.precision=fp8", "--train.gradient_checkpointing=true")
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        tiny_config(shards, tmp_path, "--train.loss_scale=0")
