"""Attention metadata and the one attention function every caller of the `Transformer` goes through.

The caller describes its batch; the model never sees requests, loaders or caches' owners:

* `DenseAttentionMetadata` (or None): whole sequences in a (B, T) batch, attended without a
  cache — training, scoring, and a plain forward pass. Causal within each row, plus what the
  batch needs: document ids (packed rows: a token sees only earlier tokens of its own document),
  a shared prefix (one context followed by several continuations, each seeing the context and
  itself: how multiple-choice scoring runs a question's context once) and key padding.
* `PagedAttentionMetadata` (`paged_attention.py`): the engine's flattened step over a block pool.

`attend` dispatches on it: SDPA (its flash path when the mask is plainly causal) for dense
batches, the paged gather for the engine. Both use the same kernel (`scaled_dot_product`), so
soft-capping and GQA behave the same everywhere; sliding windows are part of either mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .paged_attention import PagedAttentionMetadata, PagedKVCache, paged_attention


@dataclass
class DenseAttentionMetadata:
    """Structure of a (B, T) batch of whole sequences; None fields mean "plain causal".

    document_ids: (B, T) int; a token attends only to earlier tokens with the same id (packed
        training rows; pass positions that restart at each document too).
    prefix_len: (B,) int; the first `prefix_len` tokens of a row are visible to every later token
        of the row, whatever its document (a context shared by the continuations packed after it).
    parent_ids: (B, T) int; besides its own document, a token also sees the (earlier) document
        named here, -1 for none: several continuations packed after their one shared prompt, with
        other prompts and continuations in the same row (preference pairs).
    key_padding: (B, T) bool, False where the token is padding: no token attends to it.
    """

    document_ids: torch.Tensor | None = None
    prefix_len: torch.Tensor | None = None
    parent_ids: torch.Tensor | None = None
    key_padding: torch.Tensor | None = None

    def resolve(self, positions: torch.Tensor, window: int | None) -> DenseMask:
        """The mask for `positions` (B, T), built once per forward and shared by every layer."""
        docs, padding = self.document_ids, self.key_padding
        if docs is not None and self.prefix_len is None and self.parent_ids is None \
                and not torch.compiler.is_compiling() and bool((docs == docs[:, :1]).all()):  # a data-dependent branch breaks compiled graphs
            docs = None  # one document per row: plain causal, so SDPA keeps its mask-free kernel
        if padding is not None and not torch.compiler.is_compiling() and bool(padding.all()):
            padding = None
        B, T = positions.shape
        window_bites = window is not None and T > window
        if docs is None and padding is None and self.prefix_len is None and not window_bites:
            return DenseMask(None, causal=T > 1)
        slots = torch.arange(T, device=positions.device)
        allowed = (slots[None, :] <= slots[:, None])[None]  # (1, T, T): causal in row order
        if window is not None:
            allowed = allowed & (positions[:, :, None] - positions[:, None, :] < window)
        if docs is not None:
            same = docs[:, :, None] == docs[:, None, :]
            if self.prefix_len is not None:
                same = same | (slots[None, None, :] < self.prefix_len[:, None, None])
            if self.parent_ids is not None:
                same = same | (docs[:, None, :] == self.parent_ids[:, :, None])
            allowed = allowed & same
        if padding is not None:
            allowed = allowed & padding[:, None, :]
            allowed = allowed | torch.eye(T, dtype=torch.bool, device=positions.device)[None]  # padding rows stay finite
        return DenseMask(allowed[:, None], causal=False)


@dataclass
class DenseMask:
    """A resolved dense mask: (B|1, 1, T, T) bool (True = may attend), or None with `causal`."""

    tensor: torch.Tensor | None
    causal: bool


AttentionMetadata = DenseAttentionMetadata | PagedAttentionMetadata


def scaled_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       causal: bool, *, scale: float, softcap: float | None) -> torch.Tensor:
    """(B, H, T, D) queries over (B, H_kv, S, D) keys/values; mask (B|1, 1, T, S) bool, True = attend.

    With `causal` and no mask, the queries are the last T of the S positions."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    # Soft-capping bends the scores before softmax, which the fused kernel cannot do.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = softcap * torch.tanh(scores / softcap)
    if causal:
        T, S = q.shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: DenseMask | PagedAttentionMetadata,
           kv_cache: PagedKVCache | None, layer: int, *, scale: float, softcap: float | None,
           window: int | None) -> torch.Tensor:
    """One layer's attention: q (B, T, H, D), k/v (B, T, H_kv, D) → (B, T, H, D).

    Dense: the batch attends to itself under its resolved mask. Paged: the new k/v are written
    to their slots in the block pool and each sequence attends over its blocks (B == 1, the T
    tokens being every scheduled sequence's new tokens back to back).
    """
    kernel: Callable = partial(scaled_dot_product, scale=scale, softcap=softcap)
    if isinstance(attn, PagedAttentionMetadata):
        if kv_cache is None:
            raise ValueError("paged attention metadata needs the PagedKVCache it describes")
        return paged_attention(q, k, v, kv_cache, layer, attn, window, kernel,
                               native_scale=scale if softcap is None else None)
    out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn.tensor, attn.causal)
    return out.transpose(1, 2)
