"""Log-likelihood of continuations given contexts: the one forward-pass primitive of the scored evals.

Multiple choice asks "how likely is each answer after this question?" and perplexity asks "how
likely is each new window of text after the text before it?"; both reduce to a list of
(context ids, continuation ids) requests whose continuation log-probabilities are summed.

Two things make it fast enough for a CPU:

* Requests with the same context (the choices of one question) run that context once: it is
  prefilled into a KV cache, the cache rows are repeated once per continuation, and only the
  continuations run on top. On 4-choice questions this cuts the tokens pushed through the model
  by 2-3.5x (ARC to MMLU), and continuation rows are right-padded only to the longest choice.
* Logits are computed only at the positions that predict continuation tokens: with a 49k
  vocabulary the LM head over every context position costs a large share of the model.

Left padding of contexts uses explicit positions, so each row sees the positions 0, 1, 2, ... it
would see alone; batched scores equal one-at-a-time scores up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
LOGIT_ROWS = 2048  # positions per LM-head chunk: bounds the (rows, vocab) float32 logits in memory


def loglikelihoods(model, requests: Sequence[Request], batch_size: int = 32,
                   progress: Callable[[int], None] | None = None) -> list[float]:
    """Sum of log p(continuation | context) in nats for each request, in request order.

    `model` is a `Transformer` (anything with `hidden_states`, `logits`, `new_kv_cache` and `cfg`).
    `batch_size` bounds the continuation rows per forward pass. Contexts longer than the model's
    window lose their oldest tokens. `progress(n)` is called as n more requests are done.
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
    order = sorted(groups.items(), key=lambda g: -(len(g[0]) + max(len(requests[i][1]) for i in g[1])))
    scores = [0.0] * len(requests)
    batch: list[tuple[tuple[int, ...], list[int]]] = []
    for group in order:
        if batch and sum(len(m) for _, m in batch) + len(group[1]) > batch_size:
            _score_batch(model, batch, requests, scores, progress)
            batch = []
        batch.append(group)
    if batch:
        _score_batch(model, batch, requests, scores, progress)
    return scores


@torch.inference_mode()
def _score_batch(model, batch: list[tuple[tuple[int, ...], list[int]]], requests: Sequence[Request],
                 scores: list[float], progress: Callable[[int], None] | None) -> None:
    device = model.embed_tokens.weight.device
    rows = [(g, i) for g, (_, members) in enumerate(batch) for i in members]
    P = max(len(ctx) for ctx, _ in batch) - 1  # every context token but the last goes into the cache
    Q = max(len(requests[i][1]) for _, i in rows)  # last context token + continuation minus its last token
    if P:
        cache = model.new_kv_cache(len(batch), P)
        ids, mask, pos = (torch.zeros(len(batch), P, dtype=torch.long) for _ in range(3))
        for g, (ctx, _) in enumerate(batch):
            n = len(ctx) - 1
            ids[g, P - n:], mask[g, P - n:], pos[g, P - n:] = torch.tensor(ctx[:-1]), 1, torch.arange(n)
        model.hidden_states(ids.to(device), pos.to(device), attention_mask=mask.to(device), kv_cache=cache)
        # A cache with one row per continuation, each a copy of its context's row, filled through
        # the same reserve/write/commit calls a forward pass makes.
        index = torch.tensor([g for g, _ in rows], device=device)
        prefix, cache = cache, model.new_kv_cache(len(rows), P + Q)
        cache.reserve(P, mask.to(device)[index])
        for layer in range(prefix.k.shape[0]):
            cache.write(layer, 0, prefix.k[layer, index, :, :P], prefix.v[layer, index, :, :P])
        cache.commit(P)
    else:
        cache = model.new_kv_cache(len(rows), Q)
    ids, targets, mask, pos = (torch.zeros(len(rows), Q, dtype=torch.long) for _ in range(4))
    for r, (g, i) in enumerate(rows):
        ctx, cont = batch[g][0], [int(t) for t in requests[i][1]]
        n = len(cont)
        ids[r, :n], targets[r, :n], mask[r, :n] = torch.tensor([ctx[-1], *cont[:-1]]), torch.tensor(cont), 1
        pos[r] = torch.arange(len(ctx) - 1, len(ctx) - 1 + Q)
    hidden = model.hidden_states(ids.to(device), pos.to(device), attention_mask=mask.to(device), kv_cache=cache)
    real = mask.bool().to(device)
    logp = token_logprobs(model, hidden[real], targets.to(device)[real])
    row_of = torch.arange(len(rows), device=device)[:, None].expand(-1, Q)[real]
    sums = torch.zeros(len(rows), dtype=torch.float64, device=device).index_add_(0, row_of, logp.double())
    for (_, i), s in zip(rows, sums.tolist()):
        scores[i] = s
    if progress is not None:
        progress(len(rows))


def token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) in float32 for (N, hidden) final hidden states and (N,) target ids, the LM head
    applied in chunks of LOGIT_ROWS so the (N, vocab) logits never exist at once."""
    out = [-F.cross_entropy(model.logits(hidden[s:s + LOGIT_ROWS]).float(), targets[s:s + LOGIT_ROWS],
                            reduction="none") for s in range(0, len(targets), LOGIT_ROWS)]
    return torch.cat(out) if out else torch.zeros(0, device=hidden.device)
