"""LoRA and QLoRA fine-tuning through the one trainer: only the adapters train and are checkpointed,
resume is exact, the export is a PEFT adapter directory that the one loader merges onto its base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sft_helpers import COLORS, conversations, question, sft_trainer, tiny_model_dir, tiny_sft_config, \
    tiny_tokenizer, write_chats
from test_train_helpers import crash_in_step_5, one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.chat import ChatSession
from tokenmind.engine.sampling import SamplingParams
from tokenmind.jsonl import read_jsonl
from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.load import load_model
from tokenmind.model.lora import lora_layers, routing_of
from tokenmind.posttrain import sft

LORA = ["--lora.rank=8", "--lora.alpha=16", "--lora.dropout=0"]
LEARN = [*LORA, "--data.batch_size=8", "--schedule.name=constant", "--optim.lr=3e-3", "--schedule.warmup_steps=5"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random tiny base whose output layer is large enough for low-rank updates below it to
    move the logits (a 0.02-std head caps every logit near 1, whatever the layers below do)."""
    root = tmp_path_factory.mktemp("lora")
    tokenizer = tiny_tokenizer()
    model = load_hf_dir(tiny_model_dir(root / "random", tokenizer))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    return save_hf_dir(model, root / "init", tokenizer=tokenizer), write_chats(root / "chats.jsonl", conversations())


def test_lora_sft_learns_with_a_frozen_base_and_exports_an_adapter(setup, tmp_path: Path) -> None:
    model_dir, chats = setup
    cfg = tiny_sft_config(model_dir, chats, tmp_path, *LEARN, "--train.steps=120", "--train.checkpoint_every=60")
    trainer = sft_trainer(cfg)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in trainer.model.named_parameters() if n in trainable}
    base_before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "adapters" not in k}
    result = trainer.train()

    assert sum(result.losses[-5:]) / 5 < 0.1
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in base_before.items())
    saved = load_file(tmp_path / "checkpoints" / "step_000120" / "model.safetensors")
    assert set(saved) == trainable  # the checkpoint holds the adapters, not the base
    final = result.final_model_path
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)

    chat_model = load_model(tmp_path)  # the run folder → final/ → base + adapter, merged
    assert not lora_layers(chat_model.model)
    assert chat_model.tokenizer.token_to_id("<|im_end|>") in chat_model.tokenizer.eos_token_ids
    for fruit, color in COLORS.items():
        session = ChatSession(chat_model, SamplingParams(max_tokens=8, temperature=0))
        assert "".join(session.send(question(fruit))) == color, fruit
    untouched = load_hf_dir(model_dir).state_dict()
    assert any(not torch.equal(v, untouched[k]) for k, v in chat_model.model.state_dict().items())


def test_lora_resume_retraces_the_uninterrupted_run(setup, tmp_path: Path) -> None:
    model_dir, chats = setup
    args = [*LORA, "--lora.dropout=0.1", "--data.batch_size=2", "--train.checkpoint_every=4", "--train.keep_last=0",
            "--optim.lr=1e-2"]
    sft(tiny_sft_config(model_dir, chats, tmp_path / "straight", *args))
    crashed_cfg = tiny_sft_config(model_dir, chats, tmp_path / "crashed", *args)
    crash_in_step_5(sft_trainer(crashed_cfg))
    resumed = sft(crashed_cfg)
    assert len(resumed.losses) == 4
    a, b = ([r for r in read_jsonl(tmp_path / run / "metrics.jsonl") if "loss" in r] for run in ("straight", "crashed"))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_qlora_trains_adapters_over_an_int8_base(setup, tmp_path: Path) -> None:
    model_dir, chats = setup
    cfg = tiny_sft_config(model_dir, chats, tmp_path, *LEARN, "--lora.quantize=int8", "--train.steps=30")
    result = sft(cfg)
    assert result.losses[-1] < result.losses[0] / 2
    quantized = load_model(result.final_model_path, quantize="int8")  # the adapter stays a separate path
    assert lora_layers(quantized.model)
    merged = load_model(result.final_model_path)
    x = torch.tensor([[1, 5, 9, 14, 30, 2]])
    with torch.no_grad():
        want = merged.model(x)
        with_adapter = (quantized.model(x) - want).abs().mean()
        routing_of(quantized.model).active = None
        without = (quantized.model(x) - want).abs().mean()
    assert with_adapter < without / 3  # what is left is the int8 rounding of the base


def test_bad_lora_options_are_refused(setup, tmp_path: Path) -> None:
    model_dir, chats = setup
    with pytest.raises(ValueError, match="not adaptable"):
        tiny_sft_config(model_dir, chats, tmp_path, "--lora.rank=4", "--lora.targets=[lm_head]")
    with pytest.raises(ValueError, match="needs lora.rank"):
        tiny_sft_config(model_dir, chats, tmp_path, "--lora.quantize=int4")
