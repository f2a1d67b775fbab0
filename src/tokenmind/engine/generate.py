"""The simple generation loop: one sequence, a contiguous KV cache, one token per step, streamed.

This is the reference the batched engine is checked against, and what `tokenmind generate` /
`tokenmind chat` run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..model.transformer import Transformer
from .sampling import SamplingParams, make_generator, sample


@dataclass
class Generated:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length" (max_tokens or context full)


def check_prompt(model: Transformer, prompt_ids: list[int]) -> int:
    """Refuse a prompt that is empty or fills the context window; return the window's length."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token (e.g. the BOS token)")
    context = model.cfg.max_position_embeddings
    if len(prompt_ids) >= context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context window is {context}; "
                         "shorten the prompt")
    return context


def stream_tokens(model: Transformer, prompt_ids: list[int], params: SamplingParams,
                  eos_token_ids: Iterable[int] = (), result: Generated | None = None) -> Iterator[int]:
    """Yield generated token ids one at a time. The stop token itself is not yielded.

    If `result` is given it is filled in as generation goes (ids and finish reason).
    """
    context = check_prompt(model, prompt_ids)
    max_tokens = min(params.max_tokens, context - len(prompt_ids))
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    result = result if result is not None else Generated([], "length")
    result.token_ids.clear()
    result.finish_reason = "length"
    device = model.embed_tokens.weight.device
    cache = model.new_kv_cache(1, len(prompt_ids) + max_tokens)
    generator = make_generator(params.seed, device)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=device)
        logits = model.logits(model.hidden_states(ids, kv_cache=cache)[:, -1])
        for step in range(max_tokens):
            token = int(sample(logits, params, generator))
            if token in stops:
                result.finish_reason = "stop"
                return
            result.token_ids.append(token)
            yield token
            if step + 1 < max_tokens:
                logits = model(torch.tensor([[token]], device=device), kv_cache=cache)[:, -1]


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams,
             eos_token_ids: Iterable[int] = ()) -> Generated:
    """Run `stream_tokens` to the end and return the ids and why it stopped."""
    result = Generated([], "length")
    for _ in stream_tokens(model, prompt_ids, params, eos_token_ids, result):
        pass
    return result
