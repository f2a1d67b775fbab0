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
context's last n tokens; no second model, q is a point mass), `DraftModelProposer` (a smaller
model with the target's vocabulary), `MTPProposer` (the target's own multi-token prediction
depths, DeepSeek-V3, or a trained EAGLE head run as one depth reused for every draft) and
`MedusaProposer` (trained Medusa heads: one token per head from the last hidden state, a single
chain, no tree). The last two draft from the target's hidden states, which the engine hands them
after every step (`HiddenStateProposer.observe`). The draft model and the MTP depths keep their
own block pool with the target's geometry and read it through the target's block tables and
slots, so they need no bookkeeping of their own beyond how far each sequence's entries are
computed; copy-on-write copies every pool.

The draft length adapts per sequence (`adaptive`): +2 after a round that kept every draft, −1
after one with a rejection, never below 1 (the heuristic of HF's assisted generation), so text
the proposer cannot predict costs short verifications only. Output is unaffected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..model.draft_heads import DRAFT_HEAD_METHODS, MedusaHeads, load_draft_head
from ..model.paged_attention import PagedKVCache
from ..model.transformer import Transformer
from .model_runner import Chunk, ModelRunner, prepare
from .outputs import TokenLogprob
from .sampler import filter_batch, token_logprobs
from .sequence import Sequence


@dataclass
class SpeculativeConfig:
    """How the engine speculates. method: "ngram" (prompt lookup), "draft" (a draft model, given
    to the engine), "mtp" (the model's multi-token prediction depths), "medusa" or "eagle" (a
    trained draft head, the directory `head`). num_speculative_tokens: the most drafts per
    sequence and step."""

    method: str = "ngram"
    num_speculative_tokens: int = 8  # on 2 cores 8 was best for prompt lookup (bench_speculative)
    adaptive: bool = True
    max_ngram: int = 3
    min_ngram: int = 1
    head: str | None = None  # medusa / eagle: the directory `tokenmind posttrain medusa|eagle` wrote

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "mtp", *DRAFT_HEAD_METHODS):
            raise ValueError(f"speculative method {self.method!r}: choose 'ngram' (prompt lookup), 'draft' "
                             "(a smaller model with the same tokenizer), 'mtp' (the model's multi-token "
                             "prediction depths), 'medusa' or 'eagle' (a trained draft head)")
        if (self.method in DRAFT_HEAD_METHODS) != (self.head is not None):
            raise ValueError(f"speculative method {self.method!r} with head={self.head!r}: 'medusa' and 'eagle' "
                             "need the trained head's directory (--speculative medusa:PATH), the others none")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


def parse_speculative(value: str, num_speculative_tokens: int = 8) -> SpeculativeConfig | None:
    """The config a `--speculative` value names: 'ngram', 'mtp', 'medusa:PATH' or 'eagle:PATH'; None
    for anything else, which is a draft model's reference (its caller loads it)."""
    method, _, head = value.partition(":")
    if value in ("ngram", "mtp") or method in DRAFT_HEAD_METHODS:
        return SpeculativeConfig(method, num_speculative_tokens, head=head or None)
    return None


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
        self.runner = ModelRunner(model, num_blocks, block_size, prompt_embeds=False)
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
            _draw(logits, [seqs[i] for i in live], [drafts[i] for i in live], [probs[i] for i in live])
        _stack_probs(drafts, probs)
        return drafts

    def verified(self, seq: Sequence, num_tokens_before: int, drafted: int, accepted: int) -> None:
        # The pool holds the context and the drafts fed back in (all but the last); of those, the kept ones.
        seq.spec_state = num_tokens_before + min(accepted, max(drafted - 1, 0))


def _draw(logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], probs: list[list[torch.Tensor]]) -> None:
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


def _stack_probs(drafts: list[Draft], probs: dict[int, list[torch.Tensor]]) -> None:
    """Each sampled draft's q rows, one per token, as the (k, V) tensor `verify` reads."""
    for i, ps in probs.items():
        if ps:
            drafts[i].probs = torch.stack(ps)


class MTPState:
    """One sequence's drafting state: the target's final hidden states of positions start, start + 1,
    ... as the steps computed them (rows past the sequence's length are rejected drafts', replaced
    when those positions run again), and `done`: every depth's pool entries below it come from
    the sequence's real tokens (or, past a prefix-cache hit, are the ones the cached blocks hold).

    The rows live in a buffer grown by doubling, so a sequence that goes on without drafting (a
    penalised or grammar-bound request never drafts) costs amortised O(1) per token, not a copy
    of its whole history every step."""

    def __init__(self, start: int, rows: torch.Tensor):
        self.start = self.done = start
        self.buffer, self.length = rows, len(rows)

    def put(self, start: int, rows: torch.Tensor) -> None:
        """The rows of positions start.., replacing those held from `start` on."""
        at, end = start - self.start, start - self.start + len(rows)
        if end > len(self.buffer):
            grown = self.buffer.new_empty(max(end, 2 * len(self.buffer)), self.buffer.shape[1])
            grown[:at] = self.buffer[:at]
            self.buffer = grown
        self.buffer[at:end] = rows
        self.length = end

    def rows(self, a: int, b: int) -> torch.Tensor:
        """The hidden states of positions a..b-1."""
        return self.buffer[a - self.start:b - self.start]

    def forget_before(self, position: int) -> None:
        drop = min(max(0, position - self.start), self.length)
        self.start, self.buffer, self.length = self.start + drop, self.buffer[drop:], self.length - drop


class HiddenStateProposer:
    """A proposer that drafts from the target's final hidden states: the engine hands it every
    step's (`observe`), and each sequence keeps them by position in an `MTPState`."""

    def observe(self, chunks: list[Chunk], hidden: torch.Tensor) -> None:
        """Keep the target's final hidden states (N, hidden) of a step's chunks (`ModelRunner.hidden`)."""
        at = 0
        for chunk in chunks:
            rows, at = hidden[at:at + len(chunk.token_ids)], at + len(chunk.token_ids)
            st = chunk.seq.spec_state
            if isinstance(st, MTPState):
                st.put(chunk.start, rows)
            else:  # new or preempted; after a prefix-cache hit the cached part is trusted as the pool holds it
                chunk.seq.spec_state = MTPState(chunk.start, rows.clone())


class MTPProposer(HiddenStateProposer):
    """Drafts with the target's own multi-token prediction depths (DeepSeek-V3 §2.2), over a block
    pool of their own (one layer per depth) read through the target's block tables. `layers`
    replaces the model's depths with other layers of their signature: an EAGLE head
    (`model/draft_heads.py:EagleHead`) is one depth, reused for every draft as it was trained.

    Depth j (0-based) writes slot p from (depth j - 1's output at p - 1, token p): the target's
    final hidden state for j = 0, which the engine hands over after every step (`observe`). With N
    tokens, the last one not yet run by the target, depth 0 at slot N - 1 predicts token N, the
    first draft; depth j at slot N - 1 + j, fed the drafts as its tokens p >= N, predicts draft
    j + 1 — the chain the depths were trained as. Every depth runs each round, so the real slots
    below N are filled even when fewer drafts are asked for than there are depths. More drafts than
    depths reuse the last depth, fed its own previous output (vLLM reuses depth 1 for V3's single
    depth the same way): an untrained use, so later drafts are accepted less often. Slots written
    from drafts are recomputed the next round; the depth j chunk starts D - 1 - j slots below
    `done` so each depth finds its previous depth's outputs computed in the same round.
    """

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, layers: nn.ModuleList | None = None):
        self.model = model
        self.layers = model.mtp if layers is None else layers
        self.depths = len(self.layers)
        weight = model.embed_tokens.weight
        cfg = dataclasses.replace(model.cfg, num_hidden_layers=self.depths)  # one pool layer per depth
        self.kv_cache = PagedKVCache(cfg, num_blocks, block_size, dtype=weight.dtype, device=weight.device)
        self.block_size, self.device = block_size, weight.device

    def copy_block(self, src: int, dst: int) -> None:
        self.kv_cache.copy_block(src, dst)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        D = self.depths
        drafts = [Draft([]) for _ in seqs]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
        # Every step the target ran for a sequence left its hidden states (`observe`), the last token's
        # at N - 2 at least; a sequence it has not run yet (a fresh fork) drafts nothing.
        live = [i for i, seq in enumerate(seqs) if isinstance(seq.spec_state, MTPState)]
        prev: dict[int, torch.Tensor] = {}  # each live sequence's outputs of the previous round
        for r in range(max([D, *(ks[i] for i in live)]) if live else 0):
            depth = min(r, D - 1)
            chunks, owners, inputs, wanted = [], [], [], []
            for i in live:
                seq, st, k, N = seqs[i], seqs[i].spec_state, ks[i], seqs[i].num_tokens
                if r < D:  # the chain: real slots from below `done`, then the drafts so far
                    first, last = max(st.done - (D - 1 - r), st.start + 1 + r), N - 1 + (r if r < k else 0)
                    if first > last:  # (nothing real to catch up at this depth yet)
                        continue
                    h = st.rows(first - 1, last) if r == 0 else prev[i][:last - first + 1]
                elif r < k:  # past the depths: the last depth again, one slot
                    first = last = N - 1 + r
                    h = prev[i][-1:]
                else:
                    continue
                tokens = [seq.token_ids[p] if p < N else drafts[i].tokens[p - N] for p in range(first, last + 1)]
                chunks.append(Chunk(seq, tokens, first, logits="last" if r < k else "none"))
                owners.append(i)
                inputs.append(h)
                if r < k:
                    wanted.append(i)
            if not chunks:
                continue
            ids, positions, meta, rows = prepare(chunks, self.block_size, self.device)
            meta.first_key = depth + 1
            with torch.inference_mode():
                out = self.model.draft_step(self.layers[depth], ids, torch.cat(inputs)[None], positions, meta,
                                            self.kv_cache)[0]
                if rows:
                    _draw(self.model.logits(out[rows]).float(), [seqs[i] for i in wanted],
                          [drafts[i] for i in wanted], [probs[i] for i in wanted])
            for i, rows_i in zip(owners, out.split([len(c.token_ids) for c in chunks])):
                prev[i] = rows_i
        for i in live:  # every depth's real slots now reach N; keep the hidden states the next round reads
            st = seqs[i].spec_state
            st.done = seqs[i].num_tokens
            st.forget_before(st.done - D)
        _stack_probs(drafts, probs)
        return drafts

    def verified(self, seq: Sequence, num_tokens_before: int, drafted: int, accepted: int) -> None:
        pass  # the next round recomputes every slot from `done` on, from the hidden states `observe` keeps


class MedusaProposer(HiddenStateProposer):
    """Medusa-1 drafting (Cai et al. 2024) as a single chain: from the hidden state of the last token
    the target ran (position N - 2, which predicted token N - 1, the sequence's last), head k
    proposes token N + k - 1, k = 1..K, all in one pass of K small blocks and the shared LM head.
    Each head's token is its own top-1 (or a draw from its own q); no tree of candidates: the
    engine's verification step checks the one chain. A draft of more than K tokens is cut to K."""

    def __init__(self, model: Transformer, heads: MedusaHeads):
        self.model, self.heads = model, heads

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
        live = [i for i, seq in enumerate(seqs) if isinstance(seq.spec_state, MTPState)
                and 0 <= seq.num_tokens - 2 - seq.spec_state.start < seq.spec_state.length]
        if live:
            h = torch.cat([seqs[i].spec_state.rows(seqs[i].num_tokens - 2, seqs[i].num_tokens - 1) for i in live])
            with torch.inference_mode():
                logits = self.model.logits(self.heads(h)).float()  # (K, live, V)
            for k in range(min(self.heads.num_heads, max(ks[i] for i in live))):
                wanted = [j for j, i in enumerate(live) if ks[i] > k]
                _draw(logits[k, wanted], [seqs[live[j]] for j in wanted], [drafts[live[j]] for j in wanted],
                      [probs[live[j]] for j in wanted])
        for seq in seqs:  # only the newest row is ever read again
            if isinstance(seq.spec_state, MTPState):
                seq.spec_state.forget_before(seq.num_tokens - 2)
        _stack_probs(drafts, probs)
        return drafts

    def verified(self, seq: Sequence, num_tokens_before: int, drafted: int, accepted: int) -> None:
        pass  # the next step's hidden states arrive through `observe`


def make_proposer(config: SpeculativeConfig, model: Transformer, draft_model: Transformer | None, num_blocks: int,
                  block_size: int) -> Proposer:
    """The proposer `config` names; a draft model must share the target's vocabulary, a draft head
    must have been trained on a model of the target's shape."""
    if config.method == "ngram":
        return NgramProposer(config.max_ngram, config.min_ngram)
    if config.method in DRAFT_HEAD_METHODS:
        weight = model.embed_tokens.weight
        head = load_draft_head(config.head, model.cfg, weight.dtype, weight.device, method=config.method)
        if config.method == "medusa":
            return MedusaProposer(model, head)
        return MTPProposer(model, num_blocks, block_size, layers=nn.ModuleList([head]))
    if config.method == "mtp":
        if not len(model.mtp):
            raise ValueError("speculative method 'mtp' drafts with the model's multi-token prediction depths, and "
                             "this model has none (num_nextn_predict_layers=0); use 'ngram' or a draft model")
        return MTPProposer(model, num_blocks, block_size)
    target_vocab = model.cfg.vocab_size
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
