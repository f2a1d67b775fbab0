"""Speculative decoding on the simple single-sequence loop: draft k tokens cheaply, verify them in one pass.

Each round a `Drafter` proposes up to k tokens; the target model scores the last emitted token
plus all k drafts in ONE forward over its KV cache, giving the target's distribution at k + 1
positions. Greedy keeps the longest draft prefix that matches the target's argmax, then the
target's own next token, so the output is token-identical to `generate` (up to float rounding:
scoring k + 1 positions at once sums in a different order than one at a time, which could only
flip an exact near-tie between two top logits). Sampling uses the
accept/reject rule of Leviathan et al. 2023 / Chen et al. 2023: keep draft token x with
probability min(1, p(x) / q(x)); on the first rejection draw from norm(max(0, p − q)); if every
draft is kept draw a bonus token from p. p and q are both taken after the same temperature /
top-k / top-p / min-p filtering, so the output distribution is exactly the target's.

Drafters: `NgramDrafter` (prompt lookup: copy what followed the latest earlier occurrence of the
context's last n tokens; no second model, q is a point mass) and `ModelDrafter` (a smaller model
with the same vocabulary, with its own KV cache that follows the accepted context).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from .generate import Generated, check_prompt
from .sampling import SamplingParams, filter_logits, make_generator

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, the distribution q each one was drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V) float32 q after filtering; None = point masses


class Drafter(Protocol):
    def propose(self, context_ids: list[int], k: int, params: SamplingParams = GREEDY,
                generator: torch.Generator | None = None) -> Draft:
        """Up to k tokens to follow `context_ids` (prompt + accepted output). May return fewer, or none.

        A drafter that samples must draw each token from the `probs` it returns, using `generator`;
        one that returns `probs=None` proposes deterministically (q is a point mass on each token).
        """
        ...


@dataclass
class SpecStats:
    rounds: int = 0  # target forwards after the prefill (plain decoding needs one per token)
    drafted: int = 0  # draft tokens the target verified
    accepted: int = 0  # of those, how many it kept
    emitted: int = 0  # tokens yielded (stop token excluded)
    draft_s: float = 0.0  # wall time in the drafter
    target_s: float = 0.0  # wall time in target forwards and acceptance (prefill included)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "emitted": self.emitted, "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_forward": round(self.tokens_per_forward, 3),
                "draft_s": round(self.draft_s, 4), "target_s": round(self.target_s, 4)}


# ----------------------------------------------------------------------------- drafters


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    `max_ngram` down to `min_ngram`) and propose the tokens that followed it.

    If the match is so recent that fewer than k tokens follow it, the copy continues with the same
    period (so "a b a b" proposes "a b a b ..."). An index of every n-gram's latest start is kept and
    extended incrementally while successive contexts extend each other, so a round costs O(new tokens).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._seen: list[int] = []  # the context the index was built from
        self._index: dict[int, dict[tuple[int, ...], int]] = {}  # n → n-gram → latest start

    def propose(self, context_ids: list[int], k: int, params: SamplingParams = GREEDY,
                generator: torch.Generator | None = None) -> Draft:
        L = len(context_ids)
        if k <= 0 or L < self.min_ngram + 1:
            return Draft([])
        self._update_index(context_ids)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self._index[n].get(tuple(context_ids[L - n:]))
            if start is None:
                continue
            period = L - n - start  # ≥ 1: the match ends before the last token
            ext = list(context_ids[start + n:start + n + k])
            while len(ext) < k:
                ext.append(ext[len(ext) - period])
            return Draft(ext)
        return Draft([])

    def _update_index(self, ids: list[int]) -> None:
        """Index every n-gram that ends before the last token (the last n tokens themselves are the query)."""
        seen = self._seen
        if len(seen) > len(ids) or ids[:len(seen)] != seen:  # a new request: start over
            self._seen, self._index = [], {}
            seen = self._seen
        for n in range(self.min_ngram, self.max_ngram + 1):
            table = self._index.setdefault(n, {})
            # An n-gram starting at s ends at s + n − 1 ≤ L − 2; starts ≤ len(seen) − n − 1 are indexed already.
            for s in range(max(0, len(seen) - n), len(ids) - n):
                table[tuple(ids[s:s + n])] = s
        seen.extend(ids[len(seen):])


class ModelDrafter:
    """A smaller Transformer with the target's vocabulary drafts autoregressively.

    It keeps its own KV cache and the token ids it holds; each `propose` first rolls the cache back
    to the longest prefix it shares with the new context (dropping rejected drafts), then feeds the
    rest. Greedy params draft the argmax; otherwise tokens are drawn from the filtered softmax q.
    """

    def __init__(self, draft_model: Transformer):
        self.model = draft_model
        self.cache: KVCache | None = None
        self.ids: list[int] = []  # tokens whose keys/values are in the cache

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def propose(self, context_ids: list[int], k: int, params: SamplingParams = GREEDY,
                generator: torch.Generator | None = None) -> Draft:
        k = min(k, self.model.cfg.max_position_embeddings - len(context_ids))
        if k <= 0 or not context_ids:
            return Draft([])
        keep = self._shared_prefix(context_ids)
        self._reserve(len(context_ids) + k - 1)
        self.cache.length = keep  # later slots are simply overwritten
        del self.ids[keep:]
        device = self.model.embed_tokens.weight.device
        feed = context_ids[keep:]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        with torch.inference_mode():
            for i in range(k):
                logits = self.model.logits(
                    self.model.hidden_states(torch.tensor([feed], device=device), kv_cache=self.cache)[:, -1])
                self.ids.extend(feed)
                if params.greedy:
                    token = int(logits.argmax(-1))
                else:
                    q = filter_logits(logits, params).softmax(-1)  # (1, V)
                    token = int(torch.multinomial(q, 1, generator=generator))
                    probs.append(q[0])
                tokens.append(token)
                feed = [token]
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _shared_prefix(self, context_ids: list[int]) -> int:
        """Length of the cached prefix still valid for `context_ids`, leaving ≥ 1 token to feed."""
        n = min(len(self.ids), len(context_ids) - 1)
        if self.ids[:n] == context_ids[:n]:
            return n
        i = 0
        while i < n and self.ids[i] == context_ids[i]:
            i += 1
        return i

    def _reserve(self, needed: int) -> None:
        """Make the cache hold at least `needed` slots, keeping what it has (grows geometrically)."""
        if self.cache is not None and self.cache.max_len >= needed:
            return
        cap = self.model.cfg.max_position_embeddings
        size = min(cap, max(needed, 256, 2 * (self.cache.max_len if self.cache is not None else 0)))
        new = self.model.new_kv_cache(1, size)
        if self.cache is not None:
            n = min(self.cache.length, len(self.ids))
            new.k[..., :n, :] = self.cache.k[..., :n, :]
            new.v[..., :n, :] = self.cache.v[..., :n, :]
            new.length = n
        self.cache = new


def truncated_draft(model: Transformer, num_layers: int) -> Transformer:
    """A self-speculative draft: the target's first `num_layers` blocks + its final norm and LM head.

    The modules are shared with `model` (no copy of the weights). Early layers without a trained exit
    are a rough draft; acceptance depends on how much the last layers change the prediction.
    """
    if not 1 <= num_layers <= model.cfg.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {model.cfg.num_hidden_layers}], got {num_layers}")
    cfg = replace(model.cfg, num_hidden_layers=num_layers)
    with torch.device("meta"):
        draft = Transformer(cfg)
    draft.embed_tokens, draft.norm, draft.lm_head = model.embed_tokens, model.norm, model.lm_head
    draft.rotary = model.rotary
    draft.layers = nn.ModuleList(model.layers[:num_layers])
    draft.training = model.training  # not .eval(): that would recurse into the shared modules
    return draft


# ----------------------------------------------------------------------------- the loop


def _verify_greedy(logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """logits (n + 1, V) → (number of drafts kept, the target's next token)."""
    target = logits.argmax(-1).tolist()
    m = 0
    while m < len(draft) and draft[m] == target[m]:
        m += 1
    return m, target[m]


def verify_sampled(p: torch.Tensor, draft: Draft, generator: torch.Generator | None) -> tuple[int, int]:
    """The accept/reject rule. p (n + 1, V): the target's filtered probabilities at each draft position
    and after the last. Returns (number of drafts kept, the token drawn after them)."""
    n = len(draft.tokens)
    if n:
        idx = torch.tensor(draft.tokens, device=p.device)
        rows = torch.arange(n, device=p.device)
        px = p[rows, idx]
        qx = draft.probs[rows, idx] if draft.probs is not None else torch.ones_like(px)
        u = torch.rand(n, generator=generator, device=p.device)
        keep = (u * qx < px).tolist()  # u < p(x) / q(x), with prob min(1, p(x) / q(x))
        m = keep.index(False) if False in keep else n
    else:
        m = 0
    if m == n:  # every draft kept: a bonus token from p
        return m, int(torch.multinomial(p[n], 1, generator=generator))
    if draft.probs is not None:
        residual = (p[m] - draft.probs[m]).clamp_min(0.0)
    else:
        residual = p[m].clone()
        residual[draft.tokens[m]] = 0.0
    if not float(residual.sum()) > 0.0:  # p ≤ q everywhere only if p == q, where rejection has prob 0
        residual = p[m]
    return m, int(torch.multinomial(residual, 1, generator=generator))


def speculative_stream(model: Transformer, prompt_ids: list[int], params: SamplingParams, drafter: Drafter,
                       k: int = 4, eos_token_ids: Iterable[int] = (), result: Generated | None = None,
                       stats: SpecStats | None = None, adaptive: bool = False) -> Iterator[int]:
    """Yield generated token ids like `stream_tokens`, several per target forward when drafts are kept.

    `result` and `stats`, if given, are filled in as generation goes. The stop token is not yielded,
    and nothing past a stop token or past max_tokens is, even inside a run of accepted drafts.
    adaptive: treat k as a ceiling and adjust the draft length each round (+2 after a round that kept
    every draft, −1 after one with a rejection, never below 1; the heuristic HF assisted generation
    uses), so text the drafter cannot predict costs short verifications only. Output is unaffected.
    """
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    context = check_prompt(model, prompt_ids)
    draft_vocab = getattr(drafter, "vocab_size", None)
    if draft_vocab is not None and draft_vocab != model.cfg.vocab_size:
        raise ValueError(f"the draft model's vocab_size is {draft_vocab} but the target's is "
                         f"{model.cfg.vocab_size}; a draft model must share the target's tokenizer and vocabulary")
    max_tokens = min(params.max_tokens, context - len(prompt_ids))
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    result = result if result is not None else Generated([], "length")
    result.token_ids.clear()
    result.finish_reason = "length"
    stats = stats if stats is not None else SpecStats()
    device = model.embed_tokens.weight.device
    # Invariant: the cache holds every token of `ids` but the last, which each round feeds first.
    cache = model.new_kv_cache(1, len(prompt_ids) + max_tokens)
    generator = make_generator(params.seed, device)
    ids = list(prompt_ids)
    k_now = k
    with torch.inference_mode():
        t0 = time.perf_counter()
        if len(ids) > 1:
            model.hidden_states(torch.tensor([ids[:-1]], device=device), kv_cache=cache)
        stats.target_s += time.perf_counter() - t0
        while True:
            remaining = max_tokens - len(result.token_ids)
            t0 = time.perf_counter()
            budget = min(k_now, remaining - 1)  # the round's own next token counts too
            draft = drafter.propose(ids, budget, params, generator) if budget > 0 else Draft([])
            draft.tokens = draft.tokens[:budget]
            t1 = time.perf_counter()
            stats.draft_s += t1 - t0
            n = len(draft.tokens)
            start = cache.length
            logits = model(torch.tensor([[ids[-1], *draft.tokens]], device=device), kv_cache=cache)[0]  # (n+1, V)
            if params.greedy:
                m, nxt = _verify_greedy(logits, draft.tokens)
            else:
                m, nxt = verify_sampled(filter_logits(logits, params).softmax(-1), draft, generator)
            cache.length = start + 1 + m  # roll back: drop the rejected drafts' keys/values
            stats.target_s += time.perf_counter() - t1
            stats.rounds += 1
            stats.drafted += n
            stats.accepted += m
            if adaptive and n:
                k_now = min(k, k_now + 2) if m == n else max(1, k_now - 1)
            for token in (*draft.tokens[:m], nxt):
                if token in stops:
                    result.finish_reason = "stop"
                    return
                result.token_ids.append(token)
                ids.append(token)
                stats.emitted += 1
                yield token
                if len(result.token_ids) == max_tokens:
                    return


def speculative_generate(model: Transformer, prompt_ids: list[int], params: SamplingParams, drafter: Drafter,
                         k: int = 4, eos_token_ids: Iterable[int] = (),
                         adaptive: bool = False) -> tuple[Generated, SpecStats]:
    """Run `speculative_stream` to the end; return the ids, why it stopped, and the draft statistics."""
    result, stats = Generated([], "length"), SpecStats()
    for _ in speculative_stream(model, prompt_ids, params, drafter, k, eos_token_ids, result, stats, adaptive):
        pass
    return result, stats
