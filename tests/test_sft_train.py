"""SFT end to end on a tiny model: it learns planted answers and the export chats them; resume is
exact; micro-batches weigh every assistant token the same; init_from a pre-training run; config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_sft_helpers import (
    COLORS,
    conversations,
    question,
    sft_trainer,
    tiny_model_dir,
    tiny_sft_config,
    tiny_tokenizer,
    write_chats,
)
from test_train_helpers import crash_in_step_5, one_thread, tiny_config  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.chat import ChatSession
from tokenmind.data.shards import ShardConfig, ShardWriter
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.checkpoint import load_hf_dir
from tokenmind.data.loader import IGNORE_INDEX
from tokenmind.posttrain import load_sft_config, sft
from tokenmind.posttrain.sft import load_start
from tokenmind.model.load import load_model
from tokenmind.train import pretrain, save_resolved
from tokenmind.jsonl import read_jsonl


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a random tiny model directory with its tokenizer, the planted chats file)."""
    root = tmp_path_factory.mktemp("sft")
    return tiny_model_dir(root / "init", tiny_tokenizer()), write_chats(root / "chats.jsonl", conversations())


def train_records(out_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


def test_sft_learns_planted_answers_and_the_export_chats_them(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, chats = setup
    cfg = tiny_sft_config(model_dir, chats, tmp_path, "--train.steps=80", "--data.batch_size=8",
                          "--schedule.name=constant", "--optim.lr=5e-3", "--schedule.warmup_steps=5",
                          "--train.eval_every=40")
    result = sft(cfg)

    assert result.losses[0] > 5.0  # ~ln(vocab): the random model knows nothing
    assert sum(result.losses[-5:]) / 5 < 0.05 and result.final_val_loss < 0.05
    assert [r["step"] for r in read_jsonl(result.metrics_path) if "val_loss" in r] == [40, 80]
    assert result.plot_path.is_file() and load_sft_config(tmp_path / "config.yaml") == cfg
    stats = json.loads((tmp_path / "sft_data.json").read_text())
    assert stats["conversations"] == 96 and stats["val_conversations"] == 10 and stats["truncated"] == 0
    assert stats["packing_efficiency"] > 0.8

    chat_model = load_model(result.final_model_path)  # what `tokenmind chat --model <run>/final` loads
    assert chat_model.tokenizer.token_to_id("<|im_end|>") in chat_model.tokenizer.eos_token_ids
    for fruit, color in COLORS.items():
        session = ChatSession(chat_model, SamplingParams(max_tokens=8, temperature=0))
        assert "".join(session.send(question(fruit))) == color, fruit


def test_sft_resume_retraces_the_uninterrupted_run(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, chats = setup
    args = ["--data.batch_size=2", "--train.grad_accum=2", "--train.checkpoint_every=4", "--train.keep_last=0"]
    sft(tiny_sft_config(model_dir, chats, tmp_path / "straight", *args))

    crashed_cfg = tiny_sft_config(model_dir, chats, tmp_path / "crashed", *args)
    crash_in_step_5(sft_trainer(crashed_cfg))

    resumed = sft(crashed_cfg)
    assert len(resumed.losses) == 4  # steps 5..8 only
    a, b = train_records(tmp_path / "straight"), train_records(tmp_path / "crashed")
    assert [r["step"] for r in b] == list(range(1, 9))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key  # bit-identical in fp32 on CPU
    end_a, end_b = (load_file(tmp_path / run / "checkpoints" / "step_000008" / "model.safetensors")
                    for run in ("straight", "crashed"))
    assert all(torch.equal(end_a[k], end_b[k]) for k in end_a)


def test_every_assistant_token_weighs_the_same_across_micro_batches(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, chats = setup
    whole = sft_trainer(tiny_sft_config(model_dir, chats, tmp_path / "whole", "--data.batch_size=4"))
    split = sft_trainer(tiny_sft_config(model_dir, chats, tmp_path / "split", "--data.batch_size=2",
                                        "--train.grad_accum=2"))
    halves = [split.loader.batch_for_rows(split.loader.rows_for_epoch(0)[i:i + 2]) for i in (0, 2)]
    trained = [int((half.targets != IGNORE_INDEX).sum()) for half in halves]
    assert trained[0] != trained[1]  # a mean of means would be biased
    a, b = whole.train_step(), split.train_step()
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for p, q in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_init_from_a_pretraining_run(setup: tuple[Path, Path], tmp_path: Path) -> None:
    _, chats = setup
    tokenizer = tiny_tokenizer()
    tokenizer.save(tmp_path / "tokenizer")
    with ShardWriter(tmp_path / "shards", vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                     cfg=ShardConfig(tokens_per_shard=4000, val_tokens=400)) as writer:
        for chat in conversations(repeats=4):
            writer.add(np.array(tokenizer.apply_chat_template(chat)))
    run = pretrain(tiny_config(tmp_path / "shards", tmp_path / "pre", f"--model.vocab_size={tokenizer.vocab_size}",
                               "--model.max_position_embeddings=128", f"--data.tokenizer={tmp_path / 'tokenizer'}",
                               "--train.steps=3"))

    cfg = tiny_sft_config(tmp_path / "pre", chats, tmp_path / "sft", "--train.steps=2")
    assert load_start(cfg.sft).path == run.final_model_path  # a run folder stands for its final/ export
    trainer = sft_trainer(cfg)
    pretrained = load_hf_dir(run.final_model_path).state_dict()
    assert all(torch.equal(v, pretrained[k]) for k, v in trainer.model.state_dict().items())
    result = trainer.train()
    assert result.steps == 2 and all(np.isfinite(result.losses))
    assert load_model(result.final_model_path).model.cfg.vocab_size == tokenizer.vocab_size


def test_missing_pieces_fail_before_training(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, chats = setup
    with pytest.raises(ValueError, match="--sft.init_from=MODEL"):
        sft_trainer(tiny_sft_config("''", chats, tmp_path))
    with pytest.raises(ValueError, match="--data.files=PATH"):
        sft_trainer(tiny_sft_config(model_dir, chats, tmp_path, "--data.files=[]"))
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=128; lower --data.seq_len"):
        sft_trainer(tiny_sft_config(model_dir, chats, tmp_path, "--data.seq_len=256"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json .* --sft.tokenizer=DIR"):
        sft_trainer(tiny_sft_config(bare, chats, tmp_path))
    trainer = sft_trainer(tiny_sft_config(bare, chats, tmp_path, f"--sft.tokenizer={model_dir}"))
    assert trainer.tokenizer.vocab_size == trainer.model.cfg.vocab_size


def test_sft_config_yaml_overrides_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("sft:\n  init_from: smollm2\ndata:\n  files: [a.jsonl, b.jsonl]\n  seq_len: 512\n"
                    "optim:\n  lr: 1e-5\ntrain:\n  steps: 50\n")
    cfg = load_sft_config(path, ["--data.files=c.jsonl", "--schedule.warmup_steps=5"])
    assert cfg.sft.init_from == "smollm2" and cfg.data.files == ["c.jsonl"] and cfg.data.seq_len == 512
    assert cfg.optim.lr == 1e-5 and cfg.optim.weight_decay == 0.0 and cfg.train.out_dir == "runs/sft"
    assert load_sft_config(save_resolved(cfg, tmp_path / "resolved.yaml")) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["--model.hidden_size=8"], r"unknown config section 'model'; valid: sft, data, lora, optim, schedule, train"),
    (["--sft.init=x"], r"unknown key in section 'sft' 'init' \(did you mean 'init_from'\?\)"),
    (["--data.val_fraction=1"], r"data.val_fraction must be in \[0, 1\)"),
    (["--train.steps=10"], r"schedule.warmup_steps=100 exceeds train.steps=10"),
    (["--sft.init_from"], r"has no value"),
])
def test_sft_config_errors_name_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_sft_config(None, overrides)
