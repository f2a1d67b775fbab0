"""`BlockManager`: the one owner of KV blocks — free list, reference counts and the prefix cache.

Sequences hold block ids in their `block_table`; only this class hands blocks out and takes them
back, so a block is never freed while a sequence still reads it. Sharing is by reference count:
siblings of an n > 1 request share all their blocks, and requests whose prompts start the same
way share the full blocks of that common prefix (prefix caching). A block that would be written
while shared is first copied (copy-on-write), so no sequence ever changes another's context.

Prefix cache: once all of a full block's tokens have their k/v computed, the block is keyed by a
hash of its tokens (and of any prompt embeddings given for them) chained with the previous block's
key, so equal keys mean equal prefixes.
Freed blocks keep their key and stay reusable until the pool runs out of uncached free blocks;
then the least recently freed cached block is evicted (LRU).

A sequence's next block is, when it is free, the one after its last: consecutive blocks are read
as one view of the pool instead of being gathered (`paged_attention.py`), which is most of what a
lone sequence (a chat, the CLI) costs beyond the model itself.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Sequence


def block_hash(prev: bytes | None, tokens: Seq[int], embeds: bytes = b"") -> bytes:
    """Key of a full block: its tokens, the key of the block before it, and what of it comes from
    prompt embeddings (`Sequence.embeds_key`: an image's placeholder tokens are the same for every
    image) — 128-bit BLAKE2b."""
    h = hashlib.blake2b(prev or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    if embeds:
        h.update(embeds)
    return h.digest()


def sequence_block_hash(seq: Sequence, prev: bytes | None, i: int, block_size: int) -> bytes:
    """Key of the sequence's block `i` chained after `prev`."""
    a, b = i * block_size, (i + 1) * block_size
    return block_hash(prev, seq.token_ids[a:b], seq.embeds_key(a, b) if seq.embeds else b"")


class BlockManager:
    """Allocates, shares, copies and frees blocks; the scheduler only asks can_* before acting.

    `copy_block(src, dst)` copies one block's k/v (the `PagedKVCache`'s), used for copy-on-write.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 copy_block: Callable[[int, int], None] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.copy_block = copy_block
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks  # content key of full, computed blocks
        self.cached: dict[bytes, int] = {}  # key → the block that serves it
        # Blocks with ref count 0, next to be handed out first: uncached ones at the front,
        # cached ones at the back in the order they were freed (the LRU end is the front).
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.num_copies = 0

    # ----------------------------------------------------------------- metrics

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached-but-unused blocks included: they can be evicted)."""
        return len(self.free_list)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences."""
        return 1.0 - len(self.free_list) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens found in the prefix cache / tokens looked up at allocation."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ----------------------------------------------------------------- admission

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to the sequence's leading full blocks.

        The block holding the last token is never matched: one token must be computed to give
        the logits of the next, and that token's block will be written. A sequence that needs its
        prompt's logprobs computes every token.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        bs, matched, key = self.block_size, [], seq.cache_salt
        for i in range((seq.num_tokens - 1) // bs):
            key = sequence_block_hash(seq, key, i, bs)
            block = self.cached.get(key)
            if block is None:
                break
            matched.append(block)
        return matched

    def can_allocate(self, seq: Sequence) -> bool:
        matched = self._match_prefix(seq)
        fresh = self._num_blocks_for(seq.num_tokens) - len(matched)
        revived = sum(self.ref_counts[b] == 0 for b in matched)  # cached blocks that leave the free list
        return fresh + revived <= len(self.free_list)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens; cached prefix blocks count as computed."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        matched = self._match_prefix(seq)
        for block in matched:
            self._ref(block)
        seq.block_table = list(matched)
        for _ in range(self._num_blocks_for(seq.num_tokens) - len(matched)):
            seq.block_table.append(self._take_free(self._next_of(seq)))
        seq.num_computed_tokens = seq.num_cached_tokens = len(matched) * self.block_size
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens

    # ----------------------------------------------------------------- writing

    def _write_needs(self, seq: Sequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """(blocks to add at the end, table indices of shared blocks the write lands in)."""
        end = seq.num_computed_tokens + num_new_tokens
        last = self._num_blocks_for(end)
        first = seq.num_computed_tokens // self.block_size
        shared = [i for i in range(first, min(last, len(seq.block_table)))
                  if self.ref_counts[seq.block_table[i]] > 1]
        return max(0, last - len(seq.block_table)), shared

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the next `num_new_tokens` of `seq` can get slots (new blocks plus copies)."""
        new, shared = self._write_needs(seq, num_new_tokens)
        return new + len(shared) <= len(self.free_list)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make the next `num_new_tokens` writable: copy shared blocks they land in, add blocks past the end."""
        new, shared = self._write_needs(seq, num_new_tokens)
        for i in shared:
            src, dst = seq.block_table[i], self._take_free(seq.block_table[i - 1] + 1 if i else None)
            if self.copy_block is None:
                raise RuntimeError("copy-on-write needs the KV cache's copy_block")
            self.copy_block(src, dst)
            self._deref(src)
            seq.block_table[i] = dst
            self.num_copies += 1
        for _ in range(new):
            seq.block_table.append(self._take_free(self._next_of(seq)))

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that a step computed `num_new_tokens` more k/v; key the blocks that became full."""
        bs, before = self.block_size, seq.num_computed_tokens
        seq.num_computed_tokens += num_new_tokens
        if not self.enable_prefix_caching:
            return
        for i in range(before // bs, seq.num_computed_tokens // bs):
            block = seq.block_table[i]
            if self.block_keys[block] is not None:  # a shared or cache-hit block, keyed already
                continue
            prev = self.block_keys[seq.block_table[i - 1]] if i else seq.cache_salt
            key = sequence_block_hash(seq, prev, i, bs)
            self.block_keys[block] = key
            self.cached.setdefault(key, block)  # a twin computed concurrently keeps serving the key

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and put the pool back as it was built: all blocks free, in
        index order. For when the model's weights change (a training step on the model an engine
        samples from, as on-policy distillation and RL do): a cached block holds k/v the old
        weights computed, which the new weights would otherwise be served. Restoring the free
        order too makes the next allocations those of a fresh engine, so a run that resumes with
        a new engine samples exactly what the uninterrupted one did. Only with no block held."""
        held = sum(count > 0 for count in self.ref_counts)
        if held:
            raise RuntimeError(f"{held} KV blocks are still held by sequences; finish or abort every request "
                               "before resetting the prefix cache")
        self.block_keys = [None] * self.num_blocks
        self.cached.clear()
        self.free_list = OrderedDict.fromkeys(range(self.num_blocks))

    # ----------------------------------------------------------------- sharing and release

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (copy-on-write protects both later)."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self._ref(block)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its keyed blocks stay cached until evicted."""
        for block in reversed(seq.block_table):  # the tail goes first, so prefixes outlive suffixes in LRU
            self._deref(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_list[block]
        self.ref_counts[block] += 1

    def _deref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block]:
            return
        key = self.block_keys[block]
        self.free_list[block] = None
        if key is not None and self.cached.get(key) == block:
            return  # most recently freed: evicted last
        self.block_keys[block] = None
        self.free_list.move_to_end(block, last=False)  # nothing to keep: reuse it first

    @staticmethod
    def _next_of(seq: Sequence) -> int | None:
        return seq.block_table[-1] + 1 if seq.block_table else None

    def _take_free(self, prefer: int | None = None) -> int:
        """A free block: `prefer` (the one after the sequence's last) if it is free and caches nothing, so
        the LRU order of cached blocks is untouched; else the next in order."""
        if prefer is not None and prefer in self.free_list and self.block_keys[prefer] is None:
            del self.free_list[prefer]
            block = prefer
        else:
            block, _ = self.free_list.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:
            del self.cached[key]
            self.block_keys[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block
