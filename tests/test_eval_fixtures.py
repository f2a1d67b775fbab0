"""Shared pieces of the tests/test_eval_*.py files: a byte tokenizer and tiny models whose
next-token distributions are known exactly (uniform, or a hand-written bigram table)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer.streaming import StreamDecoder

EOS = 256
VOCAB = 257


class ByteTokenizer:
    """Token id = one UTF-8 byte; 256 is EOS. No chat template: evaluated as a base model."""

    bos_token_id = None
    eos_token_id = EOS
    eos_token_ids = {EOS}
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens=False):
        return StreamDecoder(self.decode)


class ChatByteTokenizer(ByteTokenizer):
    """A byte tokenizer with a minimal chat format, so evaluators treat it as a chat model."""

    chat_template = "<{role}>{content}\n"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(self.chat_template.format(**m) for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def config(vocab=VOCAB, hidden=32, layers=2, context=128) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context)


def random_model(vocab=VOCAB, context=128, seed=0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config(vocab, context=context)).eval()
    model.init_weights(std=0.5)  # large weights → peaked, position-dependent distributions
    return model


def zero_model(vocab=VOCAB) -> Transformer:
    """All weights zero: every next-token distribution is uniform, so the loss is exactly ln(vocab)."""
    model = Transformer(config(vocab)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def bigram_model(table: torch.Tensor, context=128) -> Transformer:
    """A real Transformer whose logits at a position depend only on that position's token:
    `table[current, next]`. Attention and MLP outputs are zeroed, so the residual stream is the
    embedding, a one-hot of the token, and the LM head reads the table off it."""
    vocab = table.shape[0]
    model = Transformer(config(vocab, hidden=-(-vocab // 8) * 8, layers=1, context=context)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.norm, model.layers[0].input_layernorm, model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        scale = model.norm(model.embed_tokens.weight[:1])[0, 0]  # what the final norm makes of a one-hot
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = table.T / scale
    return model


def preferring(favourites: dict[str, float]) -> torch.Tensor:
    """A bigram table where, after any token, each favourite character gets the given logit (others 0)."""
    table = torch.zeros(VOCAB, VOCAB)
    for char, logit in favourites.items():
        table[:, ord(char)] = logit
    return table


def chain(text: str, strength: float = 30.0) -> torch.Tensor:
    """A bigram table that, greedily, continues any character of `text` with the next one and ends with EOS."""
    table = torch.zeros(VOCAB, VOCAB)
    for cur, nxt in zip(text, text[1:]):
        table[ord(cur), ord(nxt)] = strength
    table[ord(text[-1]), EOS] = strength
    return table


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_bigram_model_reads_its_table():
    table = preferring({"x": 5.0})
    logp = bigram_model(table)(torch.tensor([[1, 2, 3]])).log_softmax(-1)
    expected = table[[1, 2, 3]].log_softmax(-1)
    torch.testing.assert_close(logp[0], expected, atol=1e-4, rtol=0)
