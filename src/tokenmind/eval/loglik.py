"""Log-likelihood of continuations given contexts: the one forward-pass primitive of the scored evals.

Multiple choice asks "how likely is each answer after this question?" and perplexity asks "how
likely is each new window of text after the text before it?"; both reduce to a list of
(context ids, continuation ids) requests whose continuation log-probabilities are summed.

Two things make it fast enough for a CPU:

* Requests with the same context (the choices of one question) run that context once: one row
  holds the context followed by every continuation, and the attention metadata lets each
  continuation see the context (a shared prefix) and its own earlier tokens only (its own
  document), with positions that restart after the context for each. On 4-choice questions this
  cuts the tokens pushed through the model by 2-3.5x (ARC to MMLU).
* Logits are computed only at the positions that predict continuation tokens: with a 49k
  vocabulary the LM head over every context position costs a large share of the model.

Rows are right-padded (padding is never attended); each continuation sees exactly the positions
and keys it would see alone, so batched scores equal one-at-a-time scores up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..model.attention import DenseAttentionMetadata

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
LOGIT_ROWS = 2048  # positions per LM-head chunk: bounds the (rows, vocab) float32 logits in memory
MAX_BATCH_TOKENS = 16384  # padded tokens per forward pass: bounds the (B, T, T) attention mask


def loglikelihoods(model, requests: Sequence[Request], batch_size: int = 32,
                   progress: Callable[[int], None] | None = None) -> list[float]:
    """Sum of log p(continuation | context) in nats for each request, in request order.

    `model` is a `Transformer` (anything with `hidden_states`, `logits` and `cfg`). `batch_size`
    bounds the continuations per forward pass. Contexts longer than the model's window lose their
    oldest tokens. `progress(n)` is called as n more requests are done.
    """
    window = model.cfg.max_position_embeddings
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, cont) in enumerate(requests):
        if not ctx or not cont:
            raise ValueError(f"request {i} has an empty context or continuation; the context needs at least one "
                             "token (e.g. BOS/EOS) to predict the first continuation token from")
        if len(cont) > window:
            raise ValueError(f"request {i}: the continuation has {len(cont)} tokens, more than the model's "
                             f"context window of {window}")
        key = tuple(int(t) for t in ctx[-(window + 1 - len(cont)):])  # inputs are ctx + cont[:-1]
        groups.setdefault(key, []).append(i)
    # Longest first: a batch that does not fit in memory fails at once, and neighbours pad little.
    order = sorted(groups.items(), key=lambda g: -_row_len(g[0], g[1], requests))
    scores = [0.0] * len(requests)
    batch: list[tuple[tuple[int, ...], list[int]]] = []
    for group in order:
        if batch and (sum(len(m) for _, m in batch) + len(group[1]) > batch_size
                      or (len(batch) + 1) * _row_len(*batch[0], requests) > MAX_BATCH_TOKENS):
            _score_batch(model, batch, requests, scores, progress)
            batch = []
        batch.append(group)
    if batch:
        _score_batch(model, batch, requests, scores, progress)
    return scores


def _row_len(ctx: tuple[int, ...], members: list[int], requests: Sequence[Request]) -> int:
    """Tokens in a group's row: the context, then every continuation but its last token."""
    return len(ctx) + sum(len(requests[i][1]) - 1 for i in members)


@torch.inference_mode()
def _score_batch(model, batch: list[tuple[tuple[int, ...], list[int]]], requests: Sequence[Request],
                 scores: list[float], progress: Callable[[int], None] | None) -> None:
    device = model.embed_tokens.weight.device
    T = max(_row_len(ctx, members, requests) for ctx, members in batch)
    B = len(batch)
    ids, docs, pos = (torch.zeros(B, T, dtype=torch.long) for _ in range(3))
    padding = torch.zeros(B, T, dtype=torch.bool)
    prefix = torch.tensor([len(ctx) for ctx, _ in batch])
    flat_rows, targets, owners = [], [], []  # which hidden state predicts which target, for which request
    for b, (ctx, members) in enumerate(batch):
        P = len(ctx)
        ids[b, :P], pos[b, :P] = torch.tensor(ctx), torch.arange(P)
        at = P
        for doc, i in enumerate(members, start=1):
            cont = [int(t) for t in requests[i][1]]
            n = len(cont) - 1
            ids[b, at:at + n], docs[b, at:at + n], pos[b, at:at + n] = torch.tensor(cont[:-1]), doc, \
                torch.arange(P, P + n)
            flat_rows += [b * T + P - 1, *range(b * T + at, b * T + at + n)]  # the context's last token, then own
            targets += cont
            owners += [i] * len(cont)
            at += n
        padding[b, :at] = True
    meta = DenseAttentionMetadata(document_ids=docs.to(device), prefix_len=prefix.to(device),
                                  key_padding=padding.to(device))
    hidden = model.hidden_states(ids.to(device), pos.to(device), meta).flatten(0, 1)
    logp = token_logprobs(model, hidden[torch.tensor(flat_rows, device=device)], torch.tensor(targets, device=device))
    slot = {i: n for n, i in enumerate(dict.fromkeys(owners))}
    sums = torch.zeros(len(slot), dtype=torch.float64, device=device).index_add_(
        0, torch.tensor([slot[i] for i in owners], device=device), logp.double())
    for i, s in zip(slot, sums.tolist()):
        scores[i] = s
    if progress is not None:
        progress(len(slot))


def token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) in float32 for (N, hidden) final hidden states and (N,) target ids, the LM head
    applied in chunks of LOGIT_ROWS so the (N, vocab) logits never exist at once."""
    out = [-F.cross_entropy(model.logits(hidden[s:s + LOGIT_ROWS]).float(), targets[s:s + LOGIT_ROWS],
                            reduction="none") for s in range(0, len(targets), LOGIT_ROWS)]
    return torch.cat(out) if out else torch.zeros(0, device=hidden.device)
