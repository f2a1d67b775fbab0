"""`ModelRunner`: turns one scheduled step into a forward pass over the block pool.

The scheduled sequences' new tokens are laid back to back in one row (1, N) with their positions;
`PagedAttentionMetadata` tells attention where each token's k/v goes (slot = block * block_size +
offset) and which blocks each sequence reads. The LM head then runs only on the rows that are
sampled from: the last token of every sequence whose pending tokens this step completes — a
decode, or the final chunk of a prompt. A mid-prompt chunk needs no logits.
"""

from __future__ import annotations

import torch

from ..model.paged_attention import PagedAttentionMetadata, PagedKVCache
from ..model.transformer import Transformer
from .sequence import Sequence


class ModelRunner:
    """Owns the model and the KV block pool (`kv_cache`) it reads and writes."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int):
        self.model = model
        weight = model.embed_tokens.weight
        self.device, self.block_size = weight.device, block_size
        self.kv_cache = PagedKVCache(model.cfg, num_blocks, block_size, dtype=weight.dtype, device=weight.device)

    def prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata,
                                                                   list[int], list[Sequence]]:
        """(input_ids (1, N), positions (1, N), metadata, rows to sample, their sequences) for (seq, n) pairs."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens, sample_rows, ready = [0], [], [], []
        for seq, n in batch:
            a, b = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[a:b]
            positions += range(a, b)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(a, b)]
            starts.append(len(ids))
            seq_lens.append(b)
            if b == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                ready.append(seq)
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch]
        dev = self.device
        meta = PagedAttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=dev), starts, seq_lens,
                                      torch.tensor(tables, dtype=torch.int64, device=dev))
        return torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), meta, sample_rows, ready

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute this step's k/v; return (S, V) float32 logits and the sequences they belong to."""
        input_ids, positions, meta, rows, ready = self.prepare(batch)
        with torch.inference_mode():
            hidden = self.model.hidden_states(input_ids, positions, kv_cache=self.kv_cache, attn=meta)
            logits = self.model.logits(hidden[0, rows]).float() if rows else hidden.new_empty(0, 0)
        return logits, ready
