"""Speculative decoding inside the engine: a proposer drafts tokens, one target pass verifies them.

Each step, a running sequence that is decoding may be given k lookahead slots by the scheduler.
A proposer fills up to k of them with draft tokens; the model runner feeds the sequence's last
token plus its drafts as one chunk (the ordinary paged, causal path) and returns the target's
logits at all k + 1 positions; `verify` then keeps a prefix of the drafts and adds one token of
the target's own, so every verification yields at least one token, and up to k + 1.

* Greedy: keep drafts while they equal the target's argmax, then the target's argmax. The text
  is the plain decoding's (up to float rounding: k + 1 positions scored at once sum in another
  order than one at a time, which could flip an exact near-tie between two top logits).
* Sampling: the accept/reject rule of Leviathan et al. 2023 / Chen et al. 2023. Keep draft x with
  probability min(1, p(x) / q(x)); at the first rejection draw from norm(max(0, p − q)); if all
  are kept, draw a bonus token from p. p and q are filtered by the same temperature / top-k /
  top-p / min-p, so the output is distributed exactly as the target's plain sampling.

Proposers: `NgramProposer` (prompt lookup: copy what followed the latest earlier occurrence of the
context's last n tokens; no second model, q is a point mass) and `DraftModelProposer` (a smaller
model with the target's vocabulary). The draft model keeps its own block pool with the target's
geometry and reads it through the target's block tables and slots, so it needs no bookkeeping of
its own beyond how many tokens of each sequence its pool holds; copy-on-write copies both pools.

The draft length adapts per sequence (`adaptive`): +2 after a round that kept every draft, −1
after one with a rejection, never below 1 (the heuristic of HF's assisted generation), so text
the proposer cannot predict costs short verifications only. Output is unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..model.transformer import Transformer
from .model_runner import Chunk, ModelRunner
from .outputs import TokenLogprob
from .sampler import filter_batch, token_logprobs
from .sequence import Sequence


@dataclass
class SpeculativeConfig:
    """How the engine speculates. method: "ngram" (prompt lookup) or "draft" (a draft model, given
    to the engine). num_speculative_tokens: the most drafts per sequence and step."""

    method: str = "ngram"
    num_speculative_tokens: int = 8  # on 2 cores 8 was best for prompt lookup (bench_speculative)
    adaptive: bool = True
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method {self.method!r}: choose 'ngram' (prompt lookup) or 'draft' "
                             "(a smaller model with the same tokenizer)")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, the distribution q each was drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V) float32 q after filtering; None = point masses


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """At most ks[i] draft tokens to follow each sequence's tokens (may be fewer, or none).

        A proposer that samples draws each token from the `probs` it returns with the sequence's
        own generator; one that returns `probs=None` proposes deterministically."""
        ...

    def verified(self, seq: Sequence, num_tokens_before: int, drafted: int, accepted: int) -> None:
        """The target kept `accepted` of the `drafted` tokens proposed after `num_tokens_before` tokens."""
        ...


# ----------------------------------------------------------------------------- proposers


class NgramIndex:
    """Latest start of every n-gram of a sequence's tokens, extended as the sequence grows."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.seen = 0  # tokens indexed
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def lookup(self, ids: list[int], k: int) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the last n tokens (longest n first).

        If the match is so recent that fewer than k tokens follow it, the copy continues with the
        same period (so "a b a b" proposes "a b a b ...")."""
        L = len(ids)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):  # index every n-gram ending before the last token
            table = self.tables[n]
            for s in range(max(0, self.seen - n), L - n):
                table[tuple(ids[s:s + n])] = s
        self.seen = L
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self.tables[n].get(tuple(ids[L - n:]))
            if start is None:
                continue
            period = L - n - start  # >= 1: the match ends before the last token
            ext = list(ids[start + n:start + n + k])
            while len(ext) < k:
                ext.append(ext[len(ext) - period])
            return ext
        return []


class NgramProposer:
    """Prompt lookup: no second model, a point-mass q. Its index lives on the sequence (`spec_state`)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            if not isinstance(seq.spec_state, NgramIndex):
                seq.spec_state = NgramIndex(self.min_ngram, self.max_ngram)
            drafts.append(Draft(seq.spec_state.lookup(seq.token_ids, k) if len(seq.token_ids) > self.min_ngram
                                else []))
        return drafts

    def verified(self, seq: Sequence, num_tokens_before: int, drafted: int, accepted: int) -> None:
        pass  # the index extends itself from the tokens the sequence really has


class DraftModelProposer:
    """A smaller model with the target's vocabulary drafts token by token over its own block pool.

    `seq.spec_state` counts the sequence's tokens whose keys/values the draft pool holds; a
    sequence that lost its blocks (preemption) or is new starts from 0 and is caught up first.
    """

    def __init__(self, model: Transformer, num_blocks: int, block_size: int):
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.vocab_size = model.cfg.vocab_size
        self.max_len = model.cfg.max_position_embeddings

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.kv_cache.copy_block(src, dst)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        ks = [max(0, min(k, self.max_len - seq.num_tokens)) for seq, k in zip(seqs, ks)]
        drafts = [Draft([]) for _ in seqs]
        live = [i for i, k in enumerate(ks) if k]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        # First: everything the pool lacks up to the last token; then one new draft per round.
        chunks = []
        for i in live:
            seq = seqs[i]
            held = seq.spec_state if isinstance(seq.spec_state, int) else 0
            chunks.append(Chunk(seq, seq.token_ids[held:], held, logits="last"))
        for round_ in range(max((ks[i] for i in live), default=0)):
            if round_:
                live = [i for i in live if len(drafts[i].tokens) < ks[i]]
                chunks = [Chunk(seqs[i], [drafts[i].tokens[-1]], seqs[i].num_tokens + round_ - 1, logits="last")
                          for i in live]
            if not live:
                break
            logits = self.runner.run(chunks)[0]
            self._draw(logits, [seqs[i] for i in live], [drafts[i] for i in live], [probs[i] for i in live])
        for i, ps in probs.items():
            if ps:
                drafts[i].probs = torch.stack(ps)
        return drafts

    @staticmethod
    def _draw(logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], probs: list[list[torch.Tensor]]):
        """One draft token per sequence: the argmax for greedy requests, else a draw from the filtered q."""
        greedy = logits.argmax(-1).tolist()
        sampled = [j for j, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            q = filter_batch(logits[sampled], [seqs[j].params for j in sampled]).softmax(-1)
            for row, j in enumerate(sampled):
                greedy[j] = int(torch.multinomial(q[row], 1, generator=seqs[j].generator))
                probs[j].append(q[row])
        for draft, token in zip(drafts, greedy):
            draft.tokens.append(token)

    def verified(self, seq: Sequence, num_tokens_before: int, drafted: int, accepted: int) -> None:
        # The pool holds the context and the drafts fed back in (all but the last); of those, the kept ones.
        seq.spec_state = num_tokens_before + min(accepted, max(drafted - 1, 0))


def make_proposer(config: SpeculativeConfig, draft_model: Transformer | None, target_vocab: int, num_blocks: int,
                  block_size: int) -> Proposer:
    """The proposer `config` names; a draft model must share the target's vocabulary."""
    if config.method == "ngram":
        return NgramProposer(config.max_ngram, config.min_ngram)
    if draft_model is None:
        raise ValueError("speculative method 'draft' needs a draft model (draft_model=...); use 'ngram' for none")
    if draft_model.cfg.vocab_size != target_vocab:
        raise ValueError(f"the draft model's vocab_size is {draft_model.cfg.vocab_size} but the target's is "
                         f"{target_vocab}; a draft model must share the target's tokenizer and vocabulary")
    return DraftModelProposer(draft_model, num_blocks, block_size)


# ----------------------------------------------------------------------------- verification


def verify(logits: torch.Tensor, seq: Sequence, draft: Draft) -> list[int]:
    """The tokens to append after one verification: the kept drafts, then the target's own token.

    logits: (len(draft) + 1, V) float32, the target's at the last context token and each draft."""
    if seq.params.greedy:
        target = logits.argmax(-1).tolist()
        m = 0
        while m < len(draft.tokens) and draft.tokens[m] == target[m]:
            m += 1
        return [*draft.tokens[:m], target[m]]
    p = filter_batch(logits, [seq.params] * len(logits)).softmax(-1)
    m, token = accept_reject(p, draft, seq.generator)
    return [*draft.tokens[:m], token]


def accept_reject(p: torch.Tensor, draft: Draft, generator: torch.Generator | None) -> tuple[int, int]:
    """The rule. p (n + 1, V): the target's filtered probabilities at each draft position and after
    the last. Returns (drafts kept, the token drawn after them)."""
    n = len(draft.tokens)
    m = 0
    if n:
        idx = torch.tensor(draft.tokens, device=p.device)
        rows = torch.arange(n, device=p.device)
        px = p[rows, idx]
        qx = draft.probs[rows, idx] if draft.probs is not None else torch.ones_like(px)
        u = torch.rand(n, generator=generator, device=p.device)
        keep = (u * qx < px).tolist()  # u < p(x) / q(x): probability min(1, p(x) / q(x))
        m = keep.index(False) if False in keep else n
    if m == n:  # every draft kept: a bonus token from p
        return m, int(torch.multinomial(p[n], 1, generator=generator))
    if draft.probs is not None:
        residual = (p[m] - draft.probs[m]).clamp_min(0.0)
    else:
        residual = p[m].clone()
        residual[draft.tokens[m]] = 0.0
    if not float(residual.sum()) > 0.0:  # p <= q everywhere only if p == q, where rejection has probability 0
        residual = p[m]
    return m, int(torch.multinomial(residual, 1, generator=generator))


def spec_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of the appended tokens from the verification logits (no penalties apply here)."""
    return token_logprobs(logits[:len(tokens)].log_softmax(-1), tokens, k)
