"""Attention over a paged KV cache: the engine's view of the same `Attention` module.

The engine flattens every scheduled sequence's new tokens into one row (1, N) and describes
them with `PagedAttentionMetadata`: where each token's key/value goes (`slot_mapping`, a flat
index into the block pool) and, per sequence, which blocks hold its context (`block_tables`).
The model stays ignorant of requests: it writes k/v by slot and reads them back by block table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import math
import mmap

import torch

from . import native
from .config import ModelConfig


class PagedKVCache:
    """The block pool: keys/values of every layer in fixed-size blocks.

    k/v: (layers, num_blocks, block_size, kv_heads, head_dim). Slot s = block * block_size + offset.
    Under multi-head latent attention one entry per token (the latent and the RoPE key) is the key,
    and the value is a view of its first kv_lora_rank values (`values_in_keys`): nothing is stored
    twice, so a block holds several times the tokens of a GQA cache of the same model.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        heads, key_dim, value_dim = cfg.kv_cache_entry()
        shape = (cfg.num_hidden_layers, num_blocks, block_size, heads, key_dim)
        self.values_in_keys = value_dim == 0
        self.k = _zeros_on_first_touch(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        # the same memory indexed by slot, all layers and each layer: made once, not per token and layer
        self.k_slots = self.k.view(shape[0], num_blocks * block_size, *shape[3:])
        if self.values_in_keys:
            self.v, self.v_slots = self.k[..., :cfg.kv_lora_rank], self.k_slots[..., :cfg.kv_lora_rank]
        else:
            self.v = _zeros_on_first_touch(shape[:-1] + (value_dim,), dtype, device)
            self.v_slots = self.v.view(shape[0], num_blocks * block_size, heads, value_dim)
        # per layer, (1, slots, H, D): the step's (1, N, H, D) keys/values copy in along dim 1 with no select first
        self.k_layer_slots, self.v_layer_slots = self.k_slots[:, None].unbind(0), self.v_slots[:, None].unbind(0)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        heads, key_dim, value_dim = cfg.kv_cache_entry()
        elem = torch.empty((), dtype=dtype).element_size()
        return cfg.num_hidden_layers * block_size * heads * (key_dim + value_dim) * elem

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new keys/values, the step's (1, N, H_kv, D), at their N slots."""
        self.k_layer_slots[layer].index_copy_(1, slots, k)
        if not self.values_in_keys:
            self.v_layer_slots[layer].index_copy_(1, slots, v)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write support: duplicate one block's contents in every layer."""
        self.k[:, dst] = self.k[:, src]
        if not self.values_in_keys:
            self.v[:, dst] = self.v[:, src]


def _zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose CPU memory becomes resident only where it is written: an anonymous
    memory map is untouched zero pages, where `torch.zeros` writes every byte. An engine sized for
    a full context (377 MB of fp32 k/v for SmolLM2's 8,192 tokens) then holds the resident memory
    of the tokens it actually caches. (Not numpy's zeros: numpy asks for huge pages, and faulting
    those in stalled a first request by up to 0.25 s.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * torch.empty((), dtype=dtype).element_size(), 1))
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


@dataclass
class PagedAttentionMetadata:
    """Per-step description of the flattened batch (N new tokens from S sequences).

    slot_mapping: (N,) where each new token's k/v is written.
    query_start_loc: python list of S+1 offsets into the N tokens.
    seq_lens: python list of S context lengths *including* this step's tokens.
    block_tables: (S, max_blocks) int64 block ids, padded with 0.
    first_key: positions below it hold no key and are never attended to (a multi-token prediction
        depth k has no entry for the first k positions of a sequence).
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    first_key: int = 0
    _decode: dict = field(default_factory=dict, init=False, repr=False)  # window → DecodeBatch
    _masks: dict = field(default_factory=dict, init=False, repr=False)  # (sequence, window) → causal mask
    _runs: list | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def run_start(self, i: int, block_size: int) -> int | None:
        """The first block of sequence i if the blocks holding its context are consecutive ids (a fresh
        pool hands them out in order), so its keys can be read as a view instead of gathered."""
        if self._runs is None:
            self._runs = []
            for table, n in zip(self.block_tables.tolist(), self.seq_lens):
                used = table[:-(-n // block_size)]
                self._runs.append(used[0] if used == list(range(used[0], used[0] + len(used))) else None)
        return self._runs[i]

    def causal_mask(self, i: int, window: int | None) -> torch.Tensor:
        """Sequence i's mask for its chunk of queries over its context; built once per step."""
        key = (i, window)
        if key not in self._masks:
            q_len = self.query_start_loc[i + 1] - self.query_start_loc[i]
            self._masks[key] = _causal_mask(q_len, self.seq_lens[i], window, self.block_tables.device,
                                            self.first_key)
        return self._masks[key]

    def decode_batch(self, block_size: int, window: int | None) -> DecodeBatch | None:
        """The single-token sequences as one padded batch; built once per step, shared by every layer."""
        if window not in self._decode:
            self._decode[window] = DecodeBatch.build(self, block_size, window)
        batch = self._decode[window]
        return batch if batch.count else None


@dataclass
class DecodeBatch:
    """Which rows of the step are single-token (decode) sequences, the blocks they read, and the
    key-padding mask (None when every sequence has the same length)."""

    count: int  # how many sequences decode
    rows: torch.Tensor | None  # (count,) positions of their tokens in the flattened step; None: all of it
    block_tables: torch.Tensor  # (S, blocks covering the longest)
    longest: int
    mask: torch.Tensor | None  # (S, 1, 1, longest) bool, True = attend
    run: int | None = None  # one sequence whose blocks are consecutive from this id: read a view
    lens: list[int] = field(default_factory=list)  # context length of each decode sequence
    _views: tuple | None = field(default=None, repr=False)  # per layer (keys, values) views, for a run
    _lens: torch.Tensor | None = field(default=None, repr=False)

    def lens_tensor(self) -> torch.Tensor:
        """`lens` as an int64 tensor, made once per step for every layer."""
        if self._lens is None:
            self._lens = torch.tensor(self.lens, dtype=torch.int64)
        return self._lens

    def keys_values(self, cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, H_kv, longest, D) keys and values of the decode sequences in one layer. A run is one
        slice of the pool for every layer at once, cut into per-layer views the first time."""
        if self.run is None:
            k, v = cache.k[layer], cache.v[layer]
            return (_gather_blocks(k, self.block_tables)[:, :self.longest].transpose(1, 2),
                    _gather_blocks(v, self.block_tables)[:, :self.longest].transpose(1, 2))
        if self._views is None:
            a = self.run * cache.block_size
            self._views = tuple(zip(*(slots[:, a:a + self.longest].transpose(1, 2)[:, None].unbind(0)
                                      for slots in (cache.k_slots, cache.v_slots))))
        return self._views[layer]

    @classmethod
    def build(cls, meta: PagedAttentionMetadata, block_size: int, window: int | None) -> DecodeBatch:
        """Which sequences decode, from the step's Python lists. The key-padding mask is made only when
        some key must be hidden (ragged lengths, a window shorter than the context, `first_key`), decided
        from those lists too: no tensor comparison and no host sync in the common step."""
        starts, lens = meta.query_start_loc, meta.seq_lens
        device = meta.block_tables.device
        decode = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
        if not decode:
            return cls(0, None, meta.block_tables[:0], 0, None)
        d_lens = [lens[i] for i in decode]
        longest = max(d_lens)
        width = -(-longest // block_size)
        every = len(decode) == meta.num_seqs
        tables = meta.block_tables[:, :width] if every else meta.block_tables[decode][:, :width]
        run = meta.run_start(decode[0], block_size) if len(decode) == 1 else None
        mask = None
        if min(d_lens) < longest or meta.first_key or (window is not None and longest > window):
            k_pos = torch.arange(longest, device=device)[None, :]
            d_lens_t = torch.tensor(d_lens, device=device)[:, None]
            allowed = (k_pos < d_lens_t) & (k_pos >= meta.first_key)
            if window is not None:
                allowed = allowed & (d_lens_t - 1 - k_pos < window)
            mask = allowed[:, None, None, :]
        rows = None if every else torch.tensor([starts[i] for i in decode], device=device)
        return cls(len(decode), rows, tables, longest, mask, run, d_lens)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, H, D) pool + (S, nb) block ids → (S, nb * bs, H, D), the sequences' entries in order.

    index_select, not `cache[block_tables]`: on CPU advanced indexing is 1.3x (fp32) to 3x (bf16)
    slower, and this gather is the largest cost of a batched decode step."""
    S, nb = block_tables.shape
    return cache.index_select(0, block_tables.reshape(-1)).view(S, nb * cache.shape[1], *cache.shape[2:])


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, run: int | None) -> torch.Tensor:
    """(num_blocks, bs, H, D) + block ids → this sequence's first `length` entries as (H, length, D);
    a view of the pool when its blocks are consecutive from `run`."""
    if run is not None:
        nb = -(-length // cache.shape[1])
        return cache[run:run + nb].reshape(-1, *cache.shape[2:])[:length].transpose(0, 1)
    return _gather_blocks(cache, block_table[None])[0, :length].transpose(0, 1)


def _causal_mask(q_len: int, k_len: int, window: int | None, device, first_key: int = 0) -> torch.Tensor:
    """Causal (and windowed) mask for queries that are the last q_len of k_len positions, over keys
    from position first_key on."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if first_key:
        allowed = allowed & (k_pos >= first_key)
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    return allowed


def cache_native_ok(cache: PagedKVCache) -> bool:
    """Whether the native kernels can read and write this pool: float32 on the CPU, per-head keys and
    values of their own (not latent attention's shared entry), widths they vectorize."""
    k = cache.k
    return (native.preferred() and k.dtype == torch.float32 and k.device.type == "cpu" and not cache.values_in_keys
            and k.shape[-1] % 8 == 0 and cache.v.shape[-1] % 8 == 0)


def _native_decode_ok(q: torch.Tensor, cache: PagedKVCache) -> bool:
    """Whether `native.decode_attention` can take this layer's all-decode step: the pool (`cache_native_ok`),
    float32 queries whose heads share key heads evenly, no autograd (`native.takes`)."""
    kv_heads = cache.k.shape[3]
    return (cache_native_ok(cache) and native.takes(q, contiguous=False) and q.shape[2] % kv_heads == 0
            and q.shape[2] // kv_heads <= native.MAX_QUERY_GROUP)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, layer: int,
                    meta: PagedAttentionMetadata, window: int | None, attend: Callable,
                    native_scale: float | None = None) -> torch.Tensor:
    """q (1, N, H, D), k/v (1, N, H_kv, D | D_v) for the new tokens → attention output (1, N, H, D_v).

    `attend(q, k, v, mask, causal)` is the layer's kernel on (B, H, T, D) tensors
    (`attention.scaled_dot_product`), so soft-capping and GQA behave exactly as in the dense path.
    `native_scale`: the layer's softmax scale where its attention is plain (no soft-capping), which lets
    an all-decode step run `native.decode_attention` instead (see `_native_decode_ok`).
    Single-token (decode) sequences run as one padded batch; multi-token chunks (prefill, draft
    verification) one sequence at a time. Masks are built once per step, and a sequence whose
    blocks are consecutive is read through a view of the pool instead of a gathered copy.
    """
    cache.write(layer, meta.slot_mapping, k, v)
    starts, lens = meta.query_start_loc, meta.seq_lens
    dec = meta.decode_batch(cache.block_size, window)
    if dec is not None:
        if (dec.rows is None and native_scale is not None and dec.block_tables.dtype == torch.int64
                and _native_decode_ok(q, cache)):
            # an all-decode step read in place from the pool: no gather, no padding, no mask
            return native.decode_attention(q[0].contiguous(), cache.k[layer], cache.v[layer], dec.block_tables,
                                           dec.lens_tensor(), meta.first_key, window, native_scale)[None]
        keys, vals = dec.keys_values(cache, layer)  # (S, H_kv, L, D)
        if dec.rows is None:  # an all-decode step: no scatter into a bigger output; (1, N) ↔ (N, 1) is a permute
            return attend(q.permute(1, 2, 0, 3), keys, vals, dec.mask, False).permute(2, 0, 1, 3)
    q = q[0]
    out = q.new_empty(*q.shape[:2], v.shape[-1])  # values may be narrower than keys (latent attention)
    if dec is not None:
        out[dec.rows] = attend(q[dec.rows][:, :, None], keys, vals, dec.mask, False)[:, :, 0]
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    for i in range(meta.num_seqs):
        a, b = starts[i], starts[i + 1]
        if b - a == 1:
            continue
        run = meta.run_start(i, cache.block_size)
        keys = _gather(k_cache, meta.block_tables[i], lens[i], run)[None]
        vals = _gather(v_cache, meta.block_tables[i], lens[i], run)[None]
        out[a:b] = attend(q[a:b].transpose(0, 1)[None], keys, vals, meta.causal_mask(i, window), False)[0] \
            .transpose(0, 1)
    return out[None]
