"""The training loop end to end: learning, outputs, precision, checkpointing, divergence, config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_helpers import VOCAB, one_thread, pretrainer, tiny_config, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.model.checkpoint import load_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.train import NextTokenObjective, TrainingDiverged, load_config, pretrain, save_resolved
from tokenmind.train.checkpoint import latest_checkpoint
from tokenmind.jsonl import read_jsonl
from tokenmind.train.metrics import flops_per_token
from tokenmind.train.objectives import token_loss


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"))


def test_pretrain_learns_and_writes_every_output(shards: Path, tmp_path: Path) -> None:
    cfg = tiny_config(shards, tmp_path, "--train.steps=40", "--optim.lr=1e-2", "--train.eval_every=20",
                      "--train.checkpoint_every=20")
    result = pretrain(cfg)

    assert result.steps == 40 and result.tokens_seen == 40 * 4 * 32
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 1.0  # 5.7 nats (uniform) → well below
    assert result.final_val_loss is not None and result.final_val_loss < result.losses[0] - 1.0
    assert result.tokens_per_s > 0 and 0 < result.mfu < 1

    records = read_jsonl(result.metrics_path)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 41))
    assert set(train[0]) == {"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s", "mfu", "tokens", "elapsed"}
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert train[0]["lr"] == pytest.approx(5e-3)  # warmup step 1 of 2
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert load_config(tmp_path / "config.yaml") == cfg  # the resolved config reproduces the run
    assert result.checkpoint_path == tmp_path / "checkpoints" / "step_000040"
    exported = load_hf_dir(result.final_model_path)  # an HF directory of the trained weights
    trained = load_file(result.checkpoint_path / "model.safetensors")
    assert torch.equal(exported.layers[1].mlp.down_proj.weight, trained["layers.1.mlp.down_proj.weight"])


def test_bf16_autocast_keeps_fp32_master_weights(shards: Path, tmp_path: Path) -> None:
    trainer = pretrainer(tiny_config(shards, tmp_path, "--train.precision=bf16"))
    out_dtypes = []  # (the output layer runs inside the chunked loss, `train/losses.py`, not as a module)
    trainer.model.layers[-1].mlp.down_proj.register_forward_hook(lambda m, i, out: out_dtypes.append(out.dtype))
    stats = trainer.train_step()
    assert out_dtypes == [torch.bfloat16]  # the matmuls ran in bf16
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    state = trainer.optimizer.state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_gradient_checkpointing_gives_the_same_gradients(shards: Path, tmp_path: Path) -> None:
    trainer = pretrainer(tiny_config(shards, tmp_path))
    batch = next(trainer.loader)
    grads = []
    for checkpointing in (False, True):
        trainer.model.gradient_checkpointing = checkpointing
        trainer.model.zero_grad()
        terms = NextTokenObjective()(trainer.model, batch, "fp32")
        (terms.loss / terms.count).backward()
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-5)


def test_compiled_loss_follows_the_eager_loss_curve(shards: Path, tmp_path: Path) -> None:
    """train.compile=true compiles model + loss as one graph (packed rows with document masks
    included); its losses match the eager run's step for step."""
    curves = []
    for compile in (False, True):
        torch.manual_seed(0)
        trainer = pretrainer(tiny_config(shards, tmp_path / str(compile), "--train.steps=3",
                                         f"--train.compile={compile}"))
        assert (trainer.train_objective.loss_fn is not token_loss) == compile
        assert trainer.objective.loss_fn is token_loss  # validation stays eager
        curves.append([trainer.train_step()["loss"] for _ in range(3)])
    assert curves[0][-1] < curves[0][0]
    assert curves[1] == pytest.approx(curves[0], rel=1e-4, abs=1e-4)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(shards: Path, tmp_path: Path) -> None:
    trainer = pretrainer(tiny_config(shards, tmp_path, "--train.checkpoint_every=2", "--train.keep_last=1"))

    def poison_after_step_3(module, inputs, output):
        return output * float("nan") if trainer.step >= 3 else None

    trainer.model.norm.register_forward_hook(poison_after_step_3)
    with pytest.raises(TrainingDiverged, match=r"loss is nan .* at step 4.*step_000002"):
        trainer.train()
    last = latest_checkpoint(tmp_path / "checkpoints")
    assert last is not None and last.name == "step_000002"
    assert all(torch.isfinite(t).all() for t in load_file(last / "model.safetensors").values())
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_data_problems_fail_before_training(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"--model.vocab_size={VOCAB}"):
        pretrainer(tiny_config(shards, tmp_path, "--model.vocab_size=100"))
    with pytest.raises(ValueError, match="--data.shards=DIR"):
        pretrainer(tiny_config(shards, tmp_path, "--data.shards=''"))
    tiny_val = write_shards(tmp_path / "tiny_val", num_docs=40, val_tokens=40)  # 1 row of 32, batch is 4
    with pytest.raises(ValueError, match="val split: .* hold out more tokens for val"):
        pretrainer(tiny_config(tiny_val, tmp_path / "run"))  # before any training step, not after


def test_config_yaml_overrides_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  betas: [0.9, 0.99]\ntrain:\n  steps: 50\n  peak_flops: 2e12\n")
    cfg = load_config(path, ["--train.steps=7", "--schedule.name", "wsd", "--schedule.warmup_steps=2",
                             "model.rope_scaling={rope_type: linear, factor: 2.0}"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.9, 0.99)  # "1e-3" is a string to YAML 1.1
    assert cfg.train.steps == 7 and cfg.train.peak_flops == 2e12 and cfg.schedule.name == "wsd"
    assert cfg.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert load_config(save_resolved(cfg, tmp_path / "resolved.yaml")) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["--optim.lrr=1"], r"unknown key in section 'optim' 'lrr' \(did you mean 'lr'\?\); valid: name, lr, betas"),
    (["--optimizer.lr=1"], r"unknown config section 'optimizer' \(did you mean 'optim'\?\)"),
    (["--train.steps=ten"], r"train.steps: expected int, got 'ten'"),
    (["--optim.name=sgd"], r"optim.name='sgd' is not one of adamw, muon"),
    (["--train.grad_accum=0"], r"train.grad_accum must be >= 1"),
    (["--data.seq_len=4096"], r"exceeds model.max_position_embeddings=2048; shorten data.seq_len"),
    (["--train.steps=10"], r"schedule.warmup_steps=100 exceeds train.steps=10; lower --schedule.warmup_steps"),
    (["--schedule.name=wsd", "--train.steps=10", "--schedule.warmup_steps=9"], r"lower schedule.warmup_steps"),
    (["--train.steps"], r"has no value; write --section.key=value"),
    (["--model.rope_scaling.factor=2"], r"must be section.key"),
])
def test_config_errors_name_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_flops_per_token_counts_matmul_parameters_and_attention() -> None:
    cfg = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4)
    per_layer = 16 * 48 + 16 * 16 + 3 * 16 * 32 + 2 * 16  # qkv, o, gate/up/down, norms
    n = 2 * per_layer + 16 + 100 * 16  # + final norm + LM head (the embedding lookup is free)
    assert flops_per_token(cfg, seq_len=8) == 6 * n + 12 * 2 * 16 * 8
    tied = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    assert flops_per_token(tied, seq_len=8) == flops_per_token(cfg, seq_len=8)


def test_gradient_clipping_rescales_to_the_limit_and_reports_the_norm_before_it() -> None:
    """Gradients of global norm 5 (a 3-4-0 triangle over two tensors) come out with norm 1 at
    grad_clip=1, direction kept; grad_clip=0 only measures."""
    from tokenmind.train.distributed import clip_grad_norm

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert float(clip_grad_norm([a, b], 1.0)) == pytest.approx(5.0)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0]) and b.grad.tolist() == pytest.approx([0.8])
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert float(clip_grad_norm([a, b], 0.0)) == pytest.approx(5.0)
    assert a.grad.tolist() == [3.0, 0.0] and b.grad.tolist() == [4.0]
