"""Beam search: one request's group of beams and the choice of its next beams at each step.

A beam request (`SamplingParams(num_beams=B)`) runs as B sequences of the engine's one step loop,
like the n siblings of a sampled request: they share the prompt's KV blocks, and a beam continued
twice is forked (`Sequence.fork` + `BlockManager.fork`), so its blocks are shared too and the
partly filled last one is copied on its next write. Once every live beam has its next-token
logits, `BeamSearch.step` ranks all (beam, token) continuations of the group by cumulative
log-probability and says which survive; the engine forks, prunes and appends accordingly.

The rules are those of transformers' `generate(num_beams=B, do_sample=False)`, so both give the
same beams and scores on the same weights:

* each step looks at the top K = max(2, 1 + #stop tokens) · B continuations (so at least B of them
  do not stop); of those, the best B that neither hit a stop token nor reach the length limit
  stay live;
* a continuation among the top B that does end becomes a finished hypothesis scored
  sum(logprobs) / L ** length_penalty, L its output length with the stop token; the B best are kept;
* `early_stopping` True ends the search as soon as B hypotheses are finished; False (and "never"
  with length_penalty <= 0) also ends it once B are finished and the best live beam, scored at its
  current length, does not beat the worst of them; "never" with length_penalty > 0 scores the live
  beam at the longest length it could reach instead. A step where every candidate ends (the
  length limit) ends the search too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (without a stop token), length-penalized score, why it ended."""

    token_ids: list[int]
    score: float
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens or the context)


class BeamSearch:
    """The search state of one request: live beams' cumulative log-probabilities, the finished
    hypotheses (best first, at most num_beams) and whether it is over.

    The engine keeps the live sequences themselves; `rows` holds each one's next-token logits
    until the whole group has them (a token budget or a preemption can split a group over steps).
    """

    def __init__(self, params: SamplingParams, max_new_tokens: int, stop_ids: set[int]):
        self.num_beams, self.length_penalty = params.num_beams, params.length_penalty
        self.early_stopping, self.n = params.early_stopping, params.n
        self.max_new_tokens = max_new_tokens  # the output length no beam may pass
        self.stop_ids = stop_ids
        self.scores = [0.0]  # cumulative log-probability of each live beam, in the engine's order
        self.finished: list[Hypothesis] = []
        self.done = False
        self.rows: dict[object, torch.Tensor] = {}  # live sequence → its next-token logits, once computed
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def step(self, outputs: list[list[int]], logits: torch.Tensor) -> list[tuple[int, int]]:
        """Advance the search by one token: `outputs` are the live beams' output tokens (all the same
        length), `logits` their (B, V) next-token logits. Returns the new live beams as (row of
        the parent beam, token), best first, and updates scores, `finished` and `done`; when the
        search is over the result is empty."""
        B, V = logits.shape
        total = torch.tensor(self.scores, dtype=torch.float32, device=logits.device)[:, None] + \
            logits.float().log_softmax(-1)
        K = min(max(2, 1 + len(self.stop_ids)) * self.num_beams, B * V)
        values, flat = total.flatten().topk(K)
        new_len = len(outputs[0]) + 1
        at_limit = new_len >= self.max_new_tokens
        live: list[tuple[int, int]] = []
        scores: list[float] = []
        ended = 0
        for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist())):
            parent, token = divmod(index, V)
            stops = token in self.stop_ids
            if stops or at_limit:
                ended += 1
                if rank < self.num_beams:  # only the top B may finish; the rest are spares for the live set
                    ids = outputs[parent] if stops else [*outputs[parent], token]
                    self._add(Hypothesis(ids, value / new_len ** self.length_penalty, "stop" if stops else "length"))
            elif len(live) < self.num_beams:
                live.append((parent, token))
                scores.append(value)
        self.scores = scores
        self.done = ended == K or self._can_stop(new_len)
        return [] if self.done else live

    def _add(self, hyp: Hypothesis) -> None:
        """Keep the num_beams best finished hypotheses (a later one loses ties, as in transformers)."""
        if self.early_stopping is True and len(self.finished) == self.num_beams:
            return
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: the earlier of equal scores stays ahead
        del self.finished[self.num_beams:]

    def _can_stop(self, length: int) -> bool:
        """Whether no live beam can enter the finished set any more (see the module docstring)."""
        if len(self.finished) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new_tokens
        return self.scores[0] / length ** self.length_penalty <= self.finished[-1].score

    @property
    def best(self) -> list[Hypothesis]:
        """The n hypotheses the request returns, best first."""
        return self.finished[:self.n]
