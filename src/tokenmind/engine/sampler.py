"""Batched sampling: one row of logits per sequence, each row under its own `SamplingParams`.

Order per row: penalties (they change what the model "thinks", so logprobs see them) → the
grammar's mask, for a structured-output request → greedy argmax, or temperature → top-k →
top-p → min-p → a draw from the row's own generator. Drawing row by row with each sequence's
generator is what makes a seeded request give the same text whichever other requests share
the batch.

Logprobs are the log-softmax of the penalized logits *before* temperature, filtering and any
grammar's mask: they describe the model's distribution, not the sampling recipe, so they stay comparable across
temperatures and match a plain forward pass when no penalty is set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .outputs import TokenLogprob
from .sampling import SamplingParams
from .structured import GrammarCompiler, mask_logits

if TYPE_CHECKING:
    from .sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """(S, V) logits with each row's repetition / presence / frequency penalties applied (a copy if any).

    repetition (HF): every token seen in prompt or output has its logit divided by p if positive,
    multiplied by p if not. presence / frequency (OpenAI): logit -= presence * [count > 0] +
    frequency * count, counting the generated tokens only.
    """
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0 or s.params.presence_penalty
            or s.params.frequency_penalty]
    if not rows:
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    for i in rows:
        p, seq = seqs[i].params, seqs[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            counts = torch.bincount(torch.tensor(seq.output_ids, device=logits.device), minlength=V).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for (R, V) logits with per-row settings; dropped → -inf.

    The batched form of `sampling.filter_logits` (same definitions, one sort for all rows).
    """
    R, V = logits.shape
    dev = logits.device
    logits = logits.float() / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    if any(p.top_k for p in params) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(-1, descending=True)
        k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev)[:, None]
        kth = sorted_logits.gather(-1, k - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties with the kth stay
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = ((probs.cumsum(-1) - probs) >= top_p) & (top_p < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


CANDIDATES = 256  # the likeliest tokens a filtered draw is decided among, when that is exact


def draw(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of (R, V) logits, drawn under each row's filters with its own generator:
    rows without top-k, top-p or min-p by `draw_unfiltered`, the others by `draw_filtered`."""
    plain = [not (s.params.top_k or s.params.top_p < 1 or s.params.min_p) for s in seqs]
    tokens = [0] * len(seqs)
    for flag, fn in ((True, draw_unfiltered), (False, draw_filtered)):
        rows = [i for i in range(len(seqs)) if plain[i] == flag]
        if rows:
            part = logits if len(rows) == len(seqs) else logits[rows]
            for i, token in zip(rows, fn(part, [seqs[i] for i in rows])):
                tokens[i] = token
    return tokens


def draw_unfiltered(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row from softmax(logits / temperature) by inverting the row's CDF at one uniform
    from its generator: the whole batch in one exp, cumulative sum and binary search, where a
    multinomial draws an exponential per vocabulary entry and row (that was ~10% of an RL rollout's
    decode time at 32 rows × 49k tokens). The sums run in float64, so rounding moves no token's
    probability by more than ~1e-11."""
    dev = logits.device
    temperature = torch.tensor([s.params.temperature for s in seqs], device=dev)[:, None]
    z = logits.float()
    cdf = torch.sub(z, z.amax(-1, keepdim=True)).div_(temperature).exp_().cumsum(-1, dtype=torch.float64)
    u = torch.cat([torch.rand(1, generator=s.generator, device=dev, dtype=torch.float64) for s in seqs])
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # first entry past u·total
    return tokens.clamp_(max=logits.shape[-1] - 1).tolist()


def draw_filtered(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """`draw` for rows with top-k, top-p or min-p. A draw needs only the tokens its filters keep.
    Where they provably drop every token outside the `CANDIDATES` likeliest, the row is filtered and
    drawn among those alone (the same distribution as `filter_batch` over the whole vocabulary, at a
    fraction of the cost of sorting and sampling 50k entries per row); other rows take the full path.
    """
    R, V = logits.shape
    params = [s.params for s in seqs]
    dev = logits.device
    scaled = logits.float() / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    K = min(CANDIDATES, V)
    vals, idx = scaled.topk(K)  # descending
    last = vals[:, -1].clone()  # the largest value a token outside the candidates can have
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev)
    by_k = top_k < K
    kth = vals.gather(-1, (top_k.clamp(max=K) - 1)[:, None])
    by_k &= vals[:, -1] < kth[:, 0]  # no tie with the kth token outside the candidates
    vals = torch.where(by_k[:, None] & (vals < kth), float("-inf"), vals)
    norm = torch.where(by_k[:, None], vals.logsumexp(-1, keepdim=True), scaled.logsumexp(-1, keepdim=True))
    probs = (vals - norm).exp()  # each candidate's probability among what top-k keeps
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    by_p = (top_p[:, 0] < 1) & (probs.sum(-1) >= top_p[:, 0])
    vals = torch.where((top_p < 1) & (probs.cumsum(-1) - probs >= top_p), float("-inf"), vals)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    log_min_p = min_p.clamp_min(1e-30).log()
    by_min = (min_p > 0) & (last - vals[:, 0] < log_min_p)  # every token outside is below min_p × the top's
    vals = torch.where((min_p[:, None] > 0) & (vals - vals[:, :1] < log_min_p[:, None]), float("-inf"), vals)
    exact = (by_k | by_p | by_min).tolist()
    tokens = [0] * R
    full = [i for i in range(R) if not exact[i]]
    cand = vals.softmax(-1)
    for i in range(R):
        if exact[i]:
            tokens[i] = int(idx[i, torch.multinomial(cand[i], 1, generator=seqs[i].generator)])
    if full:
        probs = filter_batch(logits[full], [params[i] for i in full]).softmax(-1)
        for j, i in enumerate(full):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=seqs[i].generator))
    return tokens


def sample_batch(logits: torch.Tensor, seqs: list[Sequence],
                 grammar: GrammarCompiler | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick the next token of each sequence from its row of (S, V) logits; also its logprobs if asked.
    Sequences with a grammar (`structured.py`) pick only among the tokens it allows."""
    logits = apply_penalties(logits.float(), seqs)
    allowed = mask_logits(logits, [s.matcher for s in seqs], grammar)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if len(sampled) == len(seqs):  # no argmax over the vocabulary, no copy of the rows
        token_list = draw(allowed, seqs)
    else:
        token_list = allowed.argmax(-1).tolist()
        if sampled:
            for i, token in zip(sampled, draw(allowed[sampled], [seqs[i] for i in sampled])):
                token_list[i] = token
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if wanted:
        logp = logits[wanted].log_softmax(-1)
        for j, i in enumerate(wanted):
            logprobs[i] = token_logprobs(logp[j:j + 1], [token_list[i]], seqs[i].params.logprobs)[0]
    return token_list, logprobs


def token_logprobs(logp: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """For (n, V) log-probabilities and the n chosen tokens: each one's logprob and the top k."""
    top_vals, top_ids = logp.topk(k, dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    return [TokenLogprob(t, c, list(zip(ids, vals))) for t, c, ids, vals in
            zip(tokens, chosen, top_ids.tolist(), top_vals.tolist())]
