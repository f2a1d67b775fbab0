"""Language-modelling quality: loss, perplexity and bits per byte, on text or on a token-shard val split.

Loss and perplexity depend on the tokenizer (a model with a bigger vocabulary predicts fewer,
harder tokens), so they only compare models that share one. Bits per byte divide the same total
negative log-likelihood by the UTF-8 bytes of the text instead of its tokens:

    bpb = total nats / (ln 2 · total bytes)

which compares any two models on the same text, whatever their tokenizers.

Text longer than the context window is scored with a sliding window: each window scores only
the tokens the previous windows did not, with the `seq_len - stride` tokens before them as
context, so every token is predicted once and (after the first window) never from scratch.
Each text starts from the tokenizer's BOS (else EOS) token, so its first token is scored too and
every byte is accounted for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..data.loader import LoaderConfig, PackedLoader
from ..data.shards import TokenShards
from ..train.objectives import NextTokenObjective
from .loglik import Request, loglikelihoods


def windows(ids: Sequence[int], seq_len: int, stride: int) -> list[Request]:
    """(context, continuation) requests that score ids[1:] given ids[0] with at most `seq_len`
    inputs per window; windows after the first score `stride` new tokens each."""
    requests, scored, n = [], 0, len(ids) - 1
    while scored < n:
        end = min(scored + (stride if scored else seq_len), n)
        begin = max(0, end - seq_len)
        requests.append((ids[begin:scored + 1], ids[scored + 1:end + 1]))
        scored = end
    return requests


def evaluate_lm(model, data: str | Sequence[str] | Sequence[int] | torch.Tensor, tokenizer=None, *,
                seq_len: int | None = None, stride: int | None = None, batch_size: int = 8,
                progress: Callable[[int], None] | None = None) -> dict[str, float | int | None]:
    """Loss (nats/token), perplexity and bits per byte of `model` on `data`.

    data: a text or a list of texts (needs `tokenizer`; each text is scored on its own), or one
        stream of token ids (its first token is context only; bits per byte need `tokenizer` to
        decode the rest back to bytes, else they are None).
    seq_len: tokens per window (default: the model's context window); stride: new tokens scored
        per later window (default seq_len // 2).
    """
    seq_len = seq_len or model.cfg.max_position_embeddings
    stride = stride or max(1, seq_len // 2)
    if not 1 <= seq_len <= model.cfg.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} must be in [1, {model.cfg.max_position_embeddings}] (the model's "
                         "context window)")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} must be in [1, seq_len={seq_len}]")
    if isinstance(data, str) or (len(data) and isinstance(data[0], str)):
        if tokenizer is None:
            raise ValueError("scoring text needs the model's tokenizer; pass tokenizer=")
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to start each text from")
        texts = [data] if isinstance(data, str) else list(data)
        streams = [[start, *tokenizer.encode(text, add_special_tokens=False)] for text in texts]
        num_bytes: int | None = sum(len(text.encode("utf-8")) for text in texts)
    else:
        streams = [[int(t) for t in data]]
        num_bytes = len(tokenizer.decode(streams[0][1:]).encode("utf-8")) if tokenizer is not None else None
    requests = [r for ids in streams for r in windows(ids, seq_len, stride)]
    nll = -sum(loglikelihoods(model, requests, batch_size, progress))
    return summarize(nll, sum(len(ids) - 1 for ids in streams), num_bytes)


def shard_val_loss(model, shards_dir: str | Path, batches: int = 20, seq_len: int = 1024, batch_size: int = 8,
                   tokenizer=None, progress: Callable[[int], None] | None = None) -> dict[str, float | int | None]:
    """Loss, perplexity and bits per byte on the first `batches` batches of a token-shard `val` split.

    Rows are packed and document-masked exactly as training's validation (`train.trainer`) reads
    them, so with the run's `seq_len` and `batch_size` this reproduces its final val loss. Bits per
    byte need `tokenizer` to turn the target tokens back into bytes (None without it).
    """
    shards = TokenShards(shards_dir, "val")
    if shards.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"{shards_dir} holds token ids up to {shards.vocab_size - 1} but the model's vocabulary "
                         f"has {model.cfg.vocab_size}: the shards were made with another tokenizer")
    loader = PackedLoader(shards, LoaderConfig(batch_size=batch_size, seq_len=seq_len, shuffle=False))
    device, objective = model.embed_tokens.weight.device, NextTokenObjective()
    nll, tokens, num_bytes = 0.0, 0, 0
    with torch.inference_mode():
        for _ in range(min(batches, loader.batches_per_epoch)):
            batch = next(loader)
            nll += float(objective(model, batch.to(device), "fp32").loss)
            tokens += batch.targets.numel()
            if tokenizer is not None:
                num_bytes += sum(len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8"))
                                 for row in batch.targets.tolist())
            if progress is not None:
                progress(1)
    return summarize(nll, tokens, num_bytes if tokenizer is not None else None)


def summarize(nll: float, tokens: int, num_bytes: int | None) -> dict[str, float | int | None]:
    """The metrics of a total negative log-likelihood (nats) over `tokens` tokens and `num_bytes` bytes."""
    loss = nll / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens, "bytes": num_bytes,
            "bits_per_byte": nll / (math.log(2) * num_bytes) if num_bytes else None}
