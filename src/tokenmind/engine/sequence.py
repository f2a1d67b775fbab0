"""`Sequence`: one prompt and the tokens generated after it, as the engine tracks them.

The scheduler and block manager only ever look at three numbers of a sequence: how many tokens
it has, how many of those already have their keys/values in the cache (`num_computed_tokens`), and
which blocks hold them (`block_table`). The difference of the first two is the work of its next
step: a whole prompt (or a chunk of it), a single decode token, or everything again after a
preemption. Its own `torch.Generator` makes a seeded request reproducible whatever else runs.

A prompt may carry `PromptEmbeds`: rows of input embeddings given for some of its positions (an
image's projected features at its placeholder tokens) instead of looked up from the token ids. The
runner splices them in whenever a step computes those positions — a chunk of a split prefill, or a
recompute after preemption — and the prefix cache keys a block by them as well as by its tokens.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from .outputs import TokenLogprob
from .sampling import SamplingParams, make_generator


@dataclass(frozen=True)
class PromptEmbeds:
    """Input embeddings (n, hidden) for prompt positions start..start + n - 1, replacing what the
    model's `embed` gives their token ids (the rows the first layer reads, after any embedding scale).

    `key` names the content for the prefix cache: blocks that hold these positions are keyed by it,
    so equal tokens with different embeddings never share k/v. By default it is a digest of the
    tensor; a caller may pass one of its own source instead (the server: a digest of the image bytes).
    """

    start: int
    values: torch.Tensor
    key: bytes = field(default=b"")

    def __post_init__(self):
        if self.values.dim() != 2:
            raise ValueError(f"prompt embeddings must be (n, hidden); got shape {tuple(self.values.shape)}")
        if self.start < 0:
            raise ValueError(f"prompt embeddings start at a prompt position >= 0; got {self.start}")
        if not self.key:
            object.__setattr__(self, "key", tensor_digest(self.values))

    @property
    def stop(self) -> int:
        return self.start + self.values.shape[0]


def tensor_digest(t: torch.Tensor) -> bytes:
    """128-bit BLAKE2b of a tensor's shape, dtype and bytes."""
    h = hashlib.blake2b(f"{tuple(t.shape)}{t.dtype}".encode(), digest_size=16)
    h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


class SequenceStatus(Enum):
    WAITING = auto()  # queued: no blocks (new, or preempted and to be recomputed)
    RUNNING = auto()  # holds blocks; computes its pending tokens when scheduled
    FINISHED = auto()


class Sequence:
    """A prompt plus its output tokens, with its cache state and per-request sampling state.

    `token_ids` is prompt + output. The last token is always pending (its k/v is computed in the
    step that samples after it), so a running sequence has `num_computed_tokens < num_tokens`; only a
    beam whose group is split over steps waits with nothing pending until its group mates catch up.
    `pending_forks` counts the siblings still to be split off when the prompt is done (n > 1, or the
    beams of a beam search: `beam` is the request's `BeamSearch`, shared by its beams).
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int],
                 max_len: int, index: int = 0, device: torch.device | str = "cpu",
                 arrival_time: float | None = None):
        self.request_id, self.index, self.params = request_id, index, params
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.stop_ids = stop_ids  # EOS (unless ignore_eos) and the params' stop token ids
        self.max_len = max_len  # prompt + output never exceed this (max_tokens, context)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last allocation
        seed = None if params.seed is None else params.seed + index
        self.generator = make_generator(seed, device)
        self.pending_forks = params.num_sequences - 1 if index == 0 else 0
        self.logprobs: list[TokenLogprob] = []
        # log P(prompt token i | tokens < i) as the prefill computes them; token 0 has none
        self.prompt_logprobs = [TokenLogprob(self.token_ids[0], None, None)] if prompt_ids else []
        self.beam: Any = None  # the request's `BeamSearch` when it is a beam search
        self.matcher: Any = None  # the llguidance matcher of a structured-output request (`structured.py`)
        self.finish_reason: str | None = None
        self.stream: Any = None  # the engine's output state: detokenizer, stop strings, what was reported
        # speculative decoding: slots the scheduler may add for drafts this step, the adaptive draft
        # length, the proposer's own per-sequence state, and this step's draft
        self.num_lookahead = 0
        self.spec_k = 0
        self.spec_state: Any = None
        self.draft: Any = None
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.adapter: str | None = None  # the LoRA adapter this request runs with (None: the base model)
        self.embeds: list[PromptEmbeds] = []  # prompt positions whose input embeddings are given, in order
        self.first_scheduled_time: float | None = None  # when it first left the queue
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose k/v the next step must compute."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all computed yet: its prefill must yield every row's
        logits, so it may not skip tokens through the prefix cache."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def fork(self, index: int) -> Sequence:
        """A sibling for completion `index` of the same request, sharing everything computed so far.

        Its generator is seeded with seed + index, so n seeded completions differ yet reproduce.
        Blocks are not copied here: the block manager adds the references.
        """
        child = Sequence(self.request_id, self.token_ids, self.params, self.stop_ids, self.max_len, index,
                         self.generator.device, self.arrival_time)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens, child.num_cached_tokens = self.num_computed_tokens, self.num_cached_tokens
        child.status, child.first_scheduled_time = self.status, self.first_scheduled_time
        child.adapter, child.beam, child.embeds = self.adapter, self.beam, self.embeds
        child.prompt_logprobs = list(self.prompt_logprobs)
        child.matcher = None if self.matcher is None else self.matcher.deep_copy()
        return child

    @property
    def cache_salt(self) -> bytes | None:
        """What a prefix-cache key starts from besides the tokens: k/v computed under one LoRA
        adapter differ from the same tokens' under another."""
        return None if self.adapter is None else b"lora:" + self.adapter.encode()

    def embeds_key(self, start: int, stop: int) -> bytes:
        """What of positions start..stop - 1 comes from prompt embeddings: the key of each override
        that overlaps them and where (b"" when none does), for the prefix-cache key of a block."""
        parts = []
        for e in self.embeds:
            a, b = max(e.start, start), min(e.stop, stop)
            if a < b:
                parts.append(struct.pack("<3q", a - start, b - start, a - e.start) + e.key)
        return b"".join(parts)

    @property
    def queue_s(self) -> float | None:
        """Time spent waiting in the queue before its first step, from arrival."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)
