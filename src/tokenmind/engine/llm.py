"""The engine's front: `Engine` (requests in, one step at a time, outputs out) and `LLM` (batch generate).

`Engine.step()` is the whole loop body: schedule → run the model → sample → append tokens, check
stops, detokenize → report. Everything about a request's *output* lives here: stop token ids and
EOS, `max_tokens` and the context limit, stop strings on the detokenized text, n > 1 siblings
(forked from the parent when its prompt is done, so they share its KV blocks), the beams of a beam
search (forked and pruned each step as `beam.py` chooses), and the deltas a streaming consumer
needs. Scheduling, blocks, the forward pass and sampling are delegated.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..model.attention import DenseAttentionMetadata
from ..model.transformer import Transformer
from ..progress import Bars
from ..model.load import Pretrained, load_model
from .beam import BeamSearch
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import Chunk, ModelRunner
from .outputs import CompletionOutput, EngineStats, RequestOutput, TokenLogprob
from .sampler import sample_batch, token_logprobs
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import PromptEmbeds, Sequence
from .speculative import DraftModelProposer, HiddenStateProposer, MTPProposer, make_proposer, spec_logprobs, verify
from .structured import GrammarCompiler, advance


class OutputStream:
    """One sequence's text: incremental detokenization, stop strings, and what was already reported.

    The stream decoder never yields half a multi-byte character, so stop strings are searched in
    whole characters. While running, the last `len(longest stop) - 1` characters are held back:
    they might be the start of a stop string, and reported text is never taken back.
    """

    def __init__(self, decoder: Any, stop: list[str]):
        self.decoder, self.stop = decoder, stop
        self.holdback = max(map(len, stop), default=1) - 1
        self.text = ""
        self.stopped = False  # ended by a stop string
        self.sent_tokens = 0
        self.sent_chars = 0

    def push(self, token_id: int) -> bool:
        """Add a token's text; True if a stop string now occurs (the text is cut before it)."""
        if self.decoder is None:
            return False
        piece = self.decoder.push(token_id)
        start = max(0, len(self.text) - self.holdback)  # a new match must end inside `piece`
        self.text += piece
        hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        return self.stopped

    def close(self) -> None:
        """Release text still held by the decoder (e.g. an incomplete final character)."""
        if self.decoder is not None and not self.stopped:
            self.text += self.decoder.flush()

    def visible_text(self, finished: bool) -> str:
        return self.text if finished else self.text[:max(0, len(self.text) - self.holdback)]


class Engine:
    """Continuous-batching generation over a paged KV cache for one model.

    Requests go in with `add_request`; every `step()` advances all of them a little and returns
    a `RequestOutput` for each request that changed. Not thread-safe: one thread drives it
    (`AsyncEngine` is the concurrent front).
    """

    def __init__(self, model: Transformer, tokenizer: Any = None, config: EngineConfig | None = None,
                 eos_token_ids: Iterable[int] | None = None, draft_model: Transformer | None = None):
        """`model` runs as given, shared and never modified: the engine neither copies, casts nor
        moves it, so updates to its weights (an RL policy step) are what the next step runs.
        `draft_model`: the drafter for `config.speculative` with method "draft" ("mtp" drafts with
        the model's own multi-token prediction depths, "medusa" and "eagle" with a trained head)."""
        self.config = config = config or EngineConfig()
        weight = model.embed_tokens.weight
        if config.dtype is not None and config.dtype != weight.dtype:
            raise ValueError(f"the model's weights are {weight.dtype} but EngineConfig.dtype is {config.dtype}; load "
                             "the model in that dtype (load_model(..., dtype=...)) or leave EngineConfig.dtype unset")
        if config.device is not None and torch.device(config.device) != weight.device:
            raise ValueError(f"the model is on {weight.device} but EngineConfig.device is {config.device}; move the "
                             "model first or leave EngineConfig.device unset")
        self.model, self.tokenizer = model, tokenizer
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = config.resolve_max_model_len(model.cfg)
        num_blocks = config.resolve_num_blocks(model.cfg, weight.dtype, weight.device)
        # the longest sequence the KV pool can hold at all (its last token is sampled, never cached)
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size + 1)
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        self.proposer = None if config.speculative is None else make_proposer(
            config.speculative, model, draft_model, num_blocks, config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          self._copy_block)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests → their completions
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.num_queue_timeouts = 0
        self.num_drafted = self.num_accepted = 0  # speculative decoding: draft tokens verified, and kept
        self.grammar = GrammarCompiler(tokenizer, model.cfg.vocab_size, self.eos_token_ids)
        self._next_id = itertools.count()

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of one block, in every pool that holds it."""
        self.runner.kv_cache.copy_block(src, dst)
        if isinstance(self.proposer, (DraftModelProposer, MTPProposer)):
            self.proposer.copy_block(src, dst)

    # ----------------------------------------------------------------- requests

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt; text is encoded with the model's special tokens (e.g. BOS)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompts as token id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, adapter: str | None = None,
                    prompt_embeds: Iterable[PromptEmbeds | tuple] | None = None) -> str:
        """Queue a request; returns its id. Requests that could never run are rejected here.
        adapter: one of the model's LoRA adapters to run it with (None: the base model).
        prompt_embeds: input embeddings for some prompt positions instead of their tokens' (an image's
        features at its placeholder tokens): `PromptEmbeds`, or (start, (n, hidden) tensor[, key])."""
        params = params or SamplingParams()
        if adapter is not None and adapter not in self.runner.adapters:
            raise ValueError(f"unknown LoRA adapter {adapter!r}; this engine's model has "
                             f"{', '.join(self.runner.adapters) or 'none'}")
        ids = self.encode(prompt)
        request_id = str(next(self._next_id)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        max_len = self.check_request(ids, params)
        embeds = self.check_embeds(ids, prompt_embeds)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seq = Sequence(request_id, ids, params, stop_ids, max_len, device=self.runner.device)
        seq.adapter, seq.embeds = adapter, embeds
        seq.stream = self._new_stream(params)
        if params.use_beam_search:  # beams are detokenized once, when the search is over
            seq.beam, seq.stream = BeamSearch(params, max_len - len(ids), stop_ids), OutputStream(None, [])
        if params.structured is not None:
            seq.matcher = self.grammar.matcher(params.structured)
        if self.config.speculative is not None:
            seq.spec_k = self.config.speculative.num_speculative_tokens
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        return request_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError naming the fix if this request could never run; else its longest length.

        Reads only what is fixed when the engine is built, so any thread may call it: the server
        checks a request this way before admitting it, and can then answer at once.
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token (e.g. the BOS token)")
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}; "
                             "shorten the prompt")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to detokenize; use stop_token_ids instead")
        if params.num_sequences > self.scheduler.max_num_seqs:
            what = f"num_beams={params.num_beams} beams" if params.use_beam_search else f"n={params.n} completions"
            raise ValueError(f"{what} cannot run at once with max_num_seqs="
                             f"{self.scheduler.max_num_seqs}; lower it or raise max_num_seqs")
        max_len = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        bs, pool = self.config.block_size, self.block_manager.num_blocks
        need = -(-max(max_len - 1, len(prompt_ids)) // bs)  # the last token is sampled, never written
        what = "a sequence"
        if params.use_beam_search:  # in the worst case (each beam recomputed after a preemption) no block is shared
            need, what = need * params.num_beams, f"a beam search of {params.num_beams} sequences"
        if need > pool:
            raise ValueError(f"{what} of {max_len} tokens needs {need} KV blocks but the pool has {pool}; lower "
                             "max_tokens (or num_beams) or give the engine more KV cache memory")
        return max_len

    def check_embeds(self, prompt_ids: list[int], prompt_embeds: Iterable[PromptEmbeds | tuple] | None
                     ) -> list[PromptEmbeds]:
        """The request's prompt embeddings in position order, on the model's device and dtype; raise
        ValueError naming the fix if they do not fit the prompt or the model (safe from any thread)."""
        hidden, weight = self.model.cfg.hidden_size, self.model.embed_tokens.weight
        embeds = []
        for e in prompt_embeds or ():
            e = e if isinstance(e, PromptEmbeds) else PromptEmbeds(*e)
            if e.values.shape[1] != hidden:
                raise ValueError(f"prompt embeddings must have the model's hidden size {hidden}; got "
                                 f"{tuple(e.values.shape)}")
            if e.stop > len(prompt_ids):
                raise ValueError(f"prompt embeddings for positions {e.start}..{e.stop - 1} run past the prompt's "
                                 f"{len(prompt_ids)} tokens; give one placeholder token per embedding row")
            embeds.append(PromptEmbeds(e.start, e.values.to(weight.device, weight.dtype), e.key))
        embeds.sort(key=lambda e: e.start)
        for before, after in itertools.pairwise(embeds):
            if after.start < before.stop:
                raise ValueError(f"prompt embeddings overlap at positions {after.start}..{before.stop - 1}; give "
                                 "each position at most once")
        return embeds

    def _new_stream(self, params: SamplingParams) -> OutputStream:
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True) if self.tokenizer is not None else None
        return OutputStream(decoder, params.stop)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its final output, or None if it is not running."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        now = time.perf_counter()
        for seq in seqs:
            if not seq.is_finished:
                self._finish(seq, "abort", now)
        return self._output(seqs)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (`BlockManager.reset_prefix_cache`): call it after changing the
        model's weights, between batches, so no k/v of the old weights is reused."""
        if self.requests:
            raise RuntimeError(f"{len(self.requests)} requests are unfinished; let them finish or abort them "
                               "before resetting the prefix cache")
        self.block_manager.reset_prefix_cache()

    def embed(self, prompts: list[list[int]], max_batch_tokens: int = 4096) -> torch.Tensor:
        """(N, hidden) float32 unit vectors: the mean of each prompt's final hidden states.

        Not the work of a dedicated embedding model, but a usable one from the LLM itself: prompts
        are packed into rows of at most `max_batch_tokens` tokens (each attends only to itself) and
        run without the KV cache, between engine steps.
        """
        for ids in prompts:
            self.check_request(ids, SamplingParams(max_tokens=0))
        pooled: list[torch.Tensor] = []
        start = 0
        while start < len(prompts):
            stop, size = start, 0
            while stop < len(prompts) and (stop == start or size + len(prompts[stop]) <= max_batch_tokens):
                size += len(prompts[stop])
                stop += 1
            batch = prompts[start:stop]
            ids = torch.tensor([[t for p in batch for t in p]], device=self.runner.device)
            positions = torch.tensor([[i for p in batch for i in range(len(p))]], device=self.runner.device)
            docs = torch.tensor([[d for d, p in enumerate(batch) for _ in p]], device=self.runner.device)
            with torch.inference_mode():
                hidden = self.model.hidden_states(ids, positions, DenseAttentionMetadata(document_ids=docs))[0]
            for chunk in hidden.float().split([len(p) for p in batch]):
                pooled.append(chunk.mean(0))
            start = stop
        return torch.nn.functional.normalize(torch.stack(pooled), dim=-1)

    def stats(self) -> EngineStats:
        bm, waiting = self.block_manager, self.scheduler.waiting
        oldest = min((seq.arrival_time for seq in waiting), default=None)
        return EngineStats(len(self.scheduler.running), len(waiting), bm.usage, bm.prefix_hit_rate,
                           self.num_generated_tokens, self.scheduler.num_preemptions, self.num_steps, bm.num_blocks,
                           0.0 if oldest is None else time.perf_counter() - oldest, self.num_queue_timeouts,
                           self.num_drafted, self.num_accepted)

    # ----------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled tokens; outputs of the requests that changed."""
        expired = self._expire_queue()
        self._offer_lookahead()
        batch = self.scheduler.schedule()
        if not batch:
            if self.requests:
                raise RuntimeError(f"no request could be scheduled although {len(self.requests)} are unfinished; "
                                   "this is an engine bug")
            return expired
        self._propose(batch)
        chunks = [self._chunk(seq, n) for seq, n in batch]
        logits, offsets = self.runner.run(chunks)
        if isinstance(self.proposer, HiddenStateProposer):  # MTP, EAGLE, Medusa draft from the target's states
            self.proposer.observe(chunks, self.runner.hidden)
        self.num_steps += 1
        now = time.perf_counter()
        rows, seqs, changed, beam_requests = [], [], [], []
        for chunk, offset in zip(chunks, offsets):
            seq = chunk.seq
            if seq.draft is not None:  # a verification: its tokens are known now
                self._verify(seq, logits[offset:offset + len(chunk.token_ids)], now)
                changed.append(seq)
                continue
            self.block_manager.mark_computed(seq, len(chunk.token_ids))
            last = offset
            if chunk.logits == "all":  # a prompt chunk whose logprobs were asked for
                self._prompt_logprobs(seq, chunk.start, logits[offset:offset + len(chunk.token_ids)])
                last = offset + len(chunk.token_ids) - 1
            if chunk.start + len(chunk.token_ids) == seq.num_tokens:  # nothing pending: choose the next token
                if seq.beam is not None:  # beam search chooses for the whole group at once
                    seq.beam.rows[seq] = logits[last].clone()
                    beam_requests.append(seq.request_id)
                    continue
                group = [seq] + self._fork(seq)
                if seq.num_tokens >= seq.max_len:  # max_tokens 0: the prompt was all there was to do
                    for member in group:
                        self._finish(member, "length", now)
                    changed.append(seq)
                    continue
                rows += [last] * len(group)
                seqs += group
        if seqs:
            tokens, logprobs = sample_batch(logits[rows], seqs, self.grammar)
            for seq, token, logprob in zip(seqs, tokens, logprobs):
                self._append(seq, token, logprob, now)
        for request_id in dict.fromkeys(beam_requests):
            beams = self.requests[request_id]
            if self._advance_beams(beams, now):  # a beam search reports once, when it is over
                changed.append(beams[0])
        outputs = expired
        for request_id in dict.fromkeys(seq.request_id for seq in changed + seqs):
            out = self._output(self.requests[request_id])
            if out.finished:
                del self.requests[request_id]
            outputs.append(out)
        return outputs

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        """What the runner feeds for a scheduled (sequence, n): its next pending tokens (n of them,
        or the last token plus this step's draft), with logits where a token will be chosen."""
        start = seq.num_computed_tokens
        if seq.draft is not None:
            return Chunk(seq, [seq.token_ids[-1], *seq.draft.tokens], start, logits="all")
        tokens = seq.token_ids[start:start + n]  # n may include lookahead slots no draft filled
        if seq.needs_prompt_logprobs:
            return Chunk(seq, tokens, start, logits="all")
        done = start + len(tokens) == seq.num_tokens  # a mid-prompt chunk needs no logits
        return Chunk(seq, tokens, start, logits="last" if done else "none")

    def _prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Record log P(token p + 1 | tokens <= p) for the prompt positions p of this chunk's rows
        (only those not recorded yet: a preempted sequence recomputes its prompt)."""
        first = len(seq.prompt_logprobs) - 1  # the position whose row predicts the next missing token
        stop = min(start + len(logits), seq.num_prompt_tokens - 1)
        if first < start or first >= stop:
            return
        targets = seq.token_ids[first + 1:stop + 1]
        logp = logits[first - start:stop - start].log_softmax(-1)
        seq.prompt_logprobs += token_logprobs(logp, targets, seq.params.prompt_logprobs)

    # ----------------------------------------------------------------- speculative decoding

    def _offer_lookahead(self) -> None:
        """Before scheduling: let each decoding sequence ask for slots to verify drafts in."""
        spec = self.config.speculative
        if spec is None:
            return
        for seq in self.scheduler.running:
            p = seq.params
            plain = p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty and \
                seq.matcher is None and seq.beam is None
            room = seq.max_len - seq.num_tokens - 1  # verification adds up to k + 1 tokens
            seq.num_lookahead = min(seq.spec_k, room) if plain and seq.num_pending_tokens == 1 and \
                not seq.pending_forks else 0

    def _propose(self, batch: list[tuple[Sequence, int]]) -> None:
        """Drafts for the sequences the scheduler gave lookahead slots (n - 1 of them)."""
        seqs = [(seq, n - 1) for seq, n in batch if seq.num_lookahead and seq.num_pending_tokens == 1 and n > 1]
        for seq, _ in batch:
            seq.draft = None
        if not seqs:
            return
        drafts = self.proposer.propose([s for s, _ in seqs], [k for _, k in seqs])
        for (seq, k), draft in zip(seqs, drafts):
            draft.tokens = draft.tokens[:k]
            if draft.tokens:
                seq.draft = draft

    def _verify(self, seq: Sequence, logits: torch.Tensor, now: float) -> None:
        """Keep the drafts the target agrees with, append them and the target's own next token."""
        draft, before = seq.draft, seq.num_tokens
        tokens = verify(logits, seq, draft)
        kept = len(tokens) - 1
        self.proposer.verified(seq, before, len(draft.tokens), kept)
        self.num_drafted += len(draft.tokens)
        self.num_accepted += kept
        if self.config.speculative.adaptive:
            limit = self.config.speculative.num_speculative_tokens
            seq.spec_k = min(limit, seq.spec_k + 2) if kept == len(draft.tokens) else max(1, seq.spec_k - 1)
        logprobs = spec_logprobs(logits, tokens, seq.params.logprobs) if seq.params.logprobs is not None else None
        for i, token in enumerate(tokens):
            self._append(seq, token, logprobs[i] if logprobs else None, now)
            if seq.is_finished:
                break
        else:  # the last context token and the kept drafts have their k/v now (blocks are keyed by content)
            self.block_manager.mark_computed(seq, 1 + kept)
        seq.draft = None

    def _expire_queue(self) -> list[RequestOutput]:
        """End the requests that waited longer than `max_queue_wait` for their first step ("timeout")."""
        if self.config.max_queue_wait is None:
            return []
        now = time.perf_counter()
        outputs = []
        for seq in self.scheduler.overdue(now, self.config.max_queue_wait):
            self._finish(seq, "timeout", now)
            outputs.append(self._output(self.requests.pop(seq.request_id)))
            self.num_queue_timeouts += 1
        return outputs

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Split off the n - 1 siblings of a request whose prompt just finished."""
        if not seq.pending_forks:
            return []
        children = [seq.fork(i) for i in range(1, seq.pending_forks + 1)]
        for child in children:
            child.stream = self._new_stream(seq.params)
        self.scheduler.add_forks(seq, children)
        self.requests[seq.request_id] += children
        return children

    def _advance_beams(self, beams: list[Sequence], now: float) -> bool:
        """One beam-search step, once every live beam of the request has its next-token logits: the
        beams continued more than once are forked (the forks share their blocks), those continued
        never are released, and each survivor gets its token. True when the search is over."""
        search = beams[0].beam
        if any(seq.num_pending_tokens or seq not in search.rows for seq in beams):
            return False  # a beam of the group is still to be computed (a split batch, a preemption)
        logits = torch.stack([search.rows.pop(seq) for seq in beams])
        chosen = search.step([seq.output_ids for seq in beams], logits)
        if search.first_token_time is None:
            search.first_token_time = now
        kept = {parent for parent, _ in chosen}
        for i, seq in enumerate(beams):
            if i not in kept:
                self.scheduler.finish(seq)
        if search.done:
            search.finish_time = now
            return True
        survivors: list[Sequence] = []
        for rank, (parent, _) in enumerate(chosen):  # every fork before any token is appended
            seq = beams[parent]
            if seq in survivors:
                seq = seq.fork(rank + 1)
                seq.stream = OutputStream(None, [])
                self.scheduler.add_forks(beams[parent], [seq])
            survivors.append(seq)
        for seq, (_, token) in zip(survivors, chosen):
            seq.append_token(token)
        self.requests[beams[0].request_id] = survivors
        self.num_generated_tokens += len(survivors)
        return False

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        if token in seq.stop_ids:  # like generate(): the stop token is not part of the output
            self._finish(seq, "stop", now)
            return
        seq.append_token(token, logprob)
        self.num_generated_tokens += 1
        complete = advance(seq.matcher, token)  # a grammar that allows nothing more
        if seq.stream.push(token) or complete:
            self._finish(seq, "stop", now)
        elif seq.num_tokens >= seq.max_len:
            self._finish(seq, "length", now)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason, seq.finish_time = reason, now
        seq.stream.close()
        self.scheduler.finish(seq)

    def _output(self, seqs: list[Sequence]) -> RequestOutput:
        """A snapshot of a request; the `new_*` fields hold what changed since the previous snapshot."""
        if seqs[0].beam is not None:
            return self._beam_output(seqs)
        completions = []
        for seq in seqs:
            stream, ids = seq.stream, seq.output_ids
            text = stream.visible_text(seq.is_finished)
            logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
            completions.append(CompletionOutput(seq.index, ids, text, seq.finish_reason, logprobs,
                                                new_token_ids=ids[stream.sent_tokens:],
                                                new_text=text[stream.sent_chars:], queue_s=seq.queue_s,
                                                ttft_s=seq.ttft_s,
                                                tpot_s=seq.tpot_s))
            stream.sent_tokens, stream.sent_chars = len(ids), len(text)
        head = seqs[0]
        prompt_logprobs = None
        if head.params.prompt_logprobs is not None and not head.needs_prompt_logprobs:
            prompt_logprobs = list(head.prompt_logprobs)
        return RequestOutput(head.request_id, head.token_ids[:head.num_prompt_tokens], completions,
                             head.num_cached_tokens, prompt_logprobs)

    def _beam_output(self, beams: list[Sequence]) -> RequestOutput:
        """A beam search's only report: its n best hypotheses with their scores, or, ended early
        (aborted, timed out), its live beams as they are."""
        head, search = beams[0], beams[0].beam
        if search.done:
            rows = [(h.token_ids, h.finish_reason, h.score) for h in search.best]
        else:
            rows = [(seq.output_ids, seq.finish_reason, None) for seq in beams]
        first, last = search.first_token_time, search.finish_time
        completions = []
        for i, (ids, reason, score) in enumerate(rows):
            stream = self._new_stream(head.params)
            for token in ids:
                stream.push(token)
            stream.close()
            ttft = None if first is None else first - head.arrival_time
            tpot = None if first is None or last is None or len(ids) < 2 else (last - first) / (len(ids) - 1)
            completions.append(CompletionOutput(i, ids, stream.text, reason, None, new_token_ids=ids,
                                                new_text=stream.text, queue_s=head.queue_s, ttft_s=ttft,
                                                tpot_s=tpot, score=score))
        prompt_logprobs = None
        if head.params.prompt_logprobs is not None and not head.needs_prompt_logprobs:
            prompt_logprobs = list(head.prompt_logprobs)
        return RequestOutput(head.request_id, head.token_ids[:head.num_prompt_tokens], completions,
                             head.num_cached_tokens, prompt_logprobs)


class LLM:
    """Generation over the engine: `LLM("smollm2").generate(prompts, params)` runs a batch to the end,
    `stream(prompt, params)` yields one request's outputs as they come (the CLI's chat).

    `engine_options` are `EngineConfig` fields (block_size, kv_cache_bytes, max_num_seqs, dtype,
    speculative, ...). `draft_model` (a reference, a loaded model or a `Transformer`) drafts for
    `speculative=SpeculativeConfig("draft")`.
    """

    def __init__(self, model: str | Path | Pretrained, draft_model: str | Path | Pretrained | Transformer | None = None,
                 **engine_options: Any):
        config = EngineConfig(**engine_options)
        if not isinstance(model, Pretrained):
            model = load_model(model, dtype=config.dtype or torch.float32)
        if draft_model is not None and not isinstance(draft_model, Transformer):
            dtype = model.model.embed_tokens.weight.dtype
            draft_model = (draft_model if isinstance(draft_model, Pretrained)
                           else load_model(draft_model, dtype=dtype)).model
        self.pretrained, self.tokenizer = model, model.tokenizer
        self.engine = Engine(model.model, model.tokenizer, config, draft_model=draft_model)

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt prefixes after the model's weights changed (`Engine.reset_prefix_cache`)."""
        self.engine.reset_prefix_cache()

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               prompt_embeds: list[PromptEmbeds | tuple] | None = None) -> Iterator[RequestOutput]:
        """One request's outputs, one per step with new tokens (`new_text`, `new_token_ids`), the last
        one finished. Stopping the iteration early aborts the request. `prompt_embeds`: as in
        `Engine.add_request`."""
        request_id = self.engine.add_request(prompt, params, prompt_embeds=prompt_embeds)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(request_id)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | None = None, adapter: str | None = None,
                 prompt_embeds: list[list[PromptEmbeds | tuple] | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) and return the outputs in prompt order.

        `progress`: a progress bar on stderr; None = only for several prompts on a terminal.
        `adapter`: the model's LoRA adapter every request runs with (None: the base model).
        `prompt_embeds`: one list (or None) per prompt, as in `Engine.add_request` — the images of a
        vision-language model's prompts, say.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one or one each")
        embeds_list = [None] * len(prompts) if prompt_embeds is None else prompt_embeds
        if len(embeds_list) != len(prompts):
            raise ValueError(f"got {len(embeds_list)} prompt_embeds lists for {len(prompts)} prompts; give one each "
                             "(None for a prompt without)")
        ids: list[str] = []
        try:
            for prompt, p, embeds in zip(prompts, params_list, embeds_list):
                ids.append(self.engine.add_request(prompt, p, adapter=adapter, prompt_embeds=embeds))
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        if progress is None:
            progress = len(prompts) > 1 and sys.stderr.isatty()
        finals: dict[str, RequestOutput] = {}
        wanted = set(ids)
        start, tokens = time.perf_counter(), self.engine.num_generated_tokens
        with Bars(progress) as bars:
            advance = bars.add("generating", len(prompts))
            while len(finals) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                        if advance is not None:
                            rate = (self.engine.num_generated_tokens - tokens) / (time.perf_counter() - start)
                            advance(1, f"{rate:.1f} tok/s")
        return [finals[i] for i in ids]
