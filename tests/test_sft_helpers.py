"""Shared pieces of the tests/test_sft_*.py files: a planted Q→A chat set, a tiny BPE tokenizer
trained on it, a tiny random model saved as an HF directory, a tiny SFT config and its trainer.

The planted task: "What color is a <fruit>?" → "<color>". The answer is a lookup of a word the
user wrote, which a 2-layer model learns in a few dozen steps, and greedy decoding either gets
it exactly right or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.posttrain import SFTConfig, build_sft_trainer, load_sft_config
from tokenmind.tokenizer import Tokenizer
from tokenmind.tokenizer.train import train_bpe
from tokenmind.train import Trainer
from tokenmind.train.distributed import init_distributed

COLORS = {"apple": "red", "banana": "yellow", "grape": "purple", "lime": "green", "plum": "violet",
          "coconut": "brown", "blueberry": "blue", "lemon": "yellow"}


def question(fruit: str) -> str:
    return f"What color is a {fruit}?"


def conversations(repeats: int = 6) -> list[list[dict[str, str]]]:
    """Single questions, some with a system prompt, and two-question conversations."""
    chats = []
    fruits = list(COLORS)
    for r in range(repeats):
        for i, fruit in enumerate(fruits):
            turn = [{"role": "user", "content": question(fruit)}, {"role": "assistant", "content": COLORS[fruit]}]
            if (i + r) % 3 == 0:
                turn = [{"role": "system", "content": "Answer with one word."}, *turn]
            chats.append(turn)
            other = fruits[(i + r + 1) % len(fruits)]
            chats.append(turn + [{"role": "user", "content": question(other)},
                                 {"role": "assistant", "content": COLORS[other]}])
    return chats


def write_chats(path: Path, chats: list[list[dict[str, str]]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats), encoding="utf-8")
    return path


def chatml_text(chat: list[dict[str, str]]) -> str:
    return "".join(f"{m['role']}\n{m['content']}\n" for m in chat)


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE (ChatML template, `<|im_end|>` a stop id) trained on the planted chats."""
    texts = [chatml_text(chat) for chat in conversations()]
    return train_bpe(texts * 4, vocab_size=400)


def tiny_model_dir(path: Path, tokenizer: Tokenizer, seed: int = 0) -> Path:
    """A randomly initialized 2-layer, dim-64 model with `tokenizer`, saved as an HF directory."""
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = Transformer(cfg)
    model.init_weights(0.02, torch.Generator().manual_seed(seed))
    return save_hf_dir(model, path, tokenizer=tokenizer)


def tiny_sft_config(init_from: Path, files: Path, out_dir: Path, *overrides: str) -> SFTConfig:
    """4 rows × 96 tokens, fp32, lr 3e-3, 8 steps; `overrides` win."""
    base = [f"--sft.init_from={init_from}", f"--data.files={files}", "--data.batch_size=4", "--data.seq_len=96",
            "--data.val_fraction=0.1", "--optim.lr=3e-3", "--schedule.warmup_steps=2", "--train.steps=8",
            "--train.precision=fp32", "--train.eval_batches=2", f"--train.out_dir={out_dir}"]
    return load_sft_config(None, base + list(overrides))


def sft_trainer(cfg: SFTConfig) -> Trainer:
    """The SFT `Trainer` of `cfg`, in this process."""
    return build_sft_trainer(cfg, init_distributed(cfg.train.distributed, cfg.train.device))
