"""`Scheduler`: continuous batching — which sequences compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest
first: each asks for its pending tokens (one for a decode, the rest of its prompt for a chunked
prefill), plus its `num_lookahead` slots for draft tokens when the engine speculates (dropped
first when blocks run short). Then waiting sequences are admitted first-come-first-served while the budget, the
sequence limit and free blocks last; a prompt longer than what is left of the budget is split
(chunked prefill), so a long prompt never stalls the decodes of everybody else.

When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt and the tokens it already generated) when blocks free up — with prefix caching, often
from cache. Preempting the newest keeps the oldest, closest-to-done sequences moving.
"""

from __future__ import annotations

import time
from collections import deque

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of new tokens to compute) for the next step; slots are ready on return."""
        bm, budget = self.block_manager, self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget:
            seq = self.running[i]
            if not seq.num_pending_tokens:  # a beam waiting for the rest of its group (`beam.py`)
                i += 1
                continue
            n = min(seq.num_pending_tokens + seq.num_lookahead, budget)
            if not bm.can_append(seq, n):
                n = min(seq.num_pending_tokens, budget)  # no room for drafts: decode plainly
            while not bm.can_append(seq, n):
                victim = self.running.pop()  # the newest; never one already in this batch
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, n)
                batch.append((seq, n))
                budget -= n
                i += 1
        # Admitting while others were just preempted for lack of blocks would only thrash.
        while self.waiting and budget and not preempted:
            seq = self.waiting[0]
            if self._num_seqs() + 1 + seq.pending_forks > self.max_num_seqs or not bm.can_allocate(seq):
                break
            if not self.chunked_prefill and seq.num_tokens > budget:
                break
            bm.allocate(seq)
            n = min(seq.num_pending_tokens, budget)
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def overdue(self, now: float, max_wait: float) -> list[Sequence]:
        """Waiting sequences that never ran and arrived more than `max_wait` seconds before `now`.

        A preempted sequence was admitted once and is not counted: its client already has tokens.
        """
        return [seq for seq in self.waiting if seq.first_scheduled_time is None and now - seq.arrival_time > max_wait]

    def _num_seqs(self) -> int:
        """Running sequences plus the n > 1 siblings they will fork (their places are reserved)."""
        return len(self.running) + sum(seq.pending_forks for seq in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status, seq.spec_state = SequenceStatus.WAITING, None  # a draft model's pool state is gone too
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run the siblings of an n > 1 request next to their parent, sharing its blocks."""
        for child in children:
            self.block_manager.fork(parent, child)
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        parent.pending_forks = 0

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (done or aborted) and release its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
