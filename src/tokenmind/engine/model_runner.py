"""`ModelRunner`: turns a step's chunks of tokens into one forward pass over the block pool.

A chunk is some new tokens of one sequence at known positions: a prompt (or a piece of it), a
decode token, or a decode token followed by draft tokens to verify. The chunks are laid back to
back in one row (1, N) with their positions; `PagedAttentionMetadata` tells attention where each
token's k/v goes (slot = block * block_size + offset, from the sequence's block table) and which
blocks each sequence reads. The LM head then runs only on the rows someone needs: the last token
of a chunk that completes its sequence's pending tokens (to sample from), every token of a
verification chunk, none of a mid-prompt chunk. A model with LoRA adapters (`model/lora.py`)
is told which adapter each token's row runs, so requests for different adapters share the step.
Where a chunk covers prompt positions with given embeddings (`PromptEmbeds`: an image's features),
the pass embeds the token ids, overwrites those rows, and runs the layers on the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.lora import adapter_names, routing_of
from ..model.paged_attention import PagedAttentionMetadata, PagedKVCache
from ..model.transformer import Transformer
from .sequence import Sequence


@dataclass
class Chunk:
    """New tokens of one sequence, starting at position `start`; `logits`: "last", "all" or "none"."""

    seq: Sequence
    token_ids: list[int]
    start: int
    logits: str = "last"


def prepare(chunks: list[Chunk], block_size: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, list[int]]:
    """(input_ids (1, N), positions (1, N), metadata, the rows whose logits are wanted)."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, seq_lens, rows = [0], [], []
    for chunk in chunks:
        a, b, table = chunk.start, chunk.start + len(chunk.token_ids), chunk.seq.block_table
        first = len(ids)
        ids += chunk.token_ids
        positions += range(a, b)
        slots += [table[p // bs] * bs + p % bs for p in range(a, b)]
        starts.append(len(ids))
        seq_lens.append(b)
        if chunk.logits == "all":
            rows += range(first, len(ids))
        elif chunk.logits == "last":
            rows.append(len(ids) - 1)
    width = max(-(-n // bs) for n in seq_lens)
    tables = [c.seq.block_table[:width] + [0] * (width - min(width, len(c.seq.block_table))) for c in chunks]
    meta = PagedAttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=device), starts, seq_lens,
                                  torch.tensor(tables, dtype=torch.int64, device=device))
    return torch.tensor([ids], device=device), torch.tensor([positions], device=device), meta, rows


class ModelRunner:
    """Owns a model and the KV block pool (`kv_cache`) it reads and writes. `hidden` keeps the last
    pass's final hidden states (N, hidden), one row per fed token in chunk order: multi-token
    prediction drafts from them."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, prompt_embeds: bool = True):
        """prompt_embeds: splice the sequences' `PromptEmbeds` in (False: a draft model, which has
        its own embedding width and reads the placeholder token ids)."""
        self.model, self.prompt_embeds = model, prompt_embeds
        weight = model.embed_tokens.weight
        self.device, self.block_size = weight.device, block_size
        self.kv_cache = PagedKVCache(model.cfg, num_blocks, block_size, dtype=weight.dtype, device=weight.device)
        self.adapters = adapter_names(model)  # the LoRA adapters a request may name
        self.routing = routing_of(model)
        self.hidden: torch.Tensor | None = None

    def run(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[int]]:
        """Compute the chunks' k/v; return (R, V) float32 logits of the wanted rows, in chunk order,
        and each chunk's first row among them."""
        input_ids, positions, meta, rows = prepare(chunks, self.block_size, self.device)
        if self.adapters:
            self.routing.set_rows([c.seq.adapter for c in chunks for _ in c.token_ids], self.device)
        try:
            with torch.inference_mode():
                hidden = self._hidden_states(chunks, input_ids, positions, meta)
                logits = self._logits(hidden, rows)
            self.hidden = hidden[0]
        finally:
            self.routing.clear_rows()
        offsets, at = [], 0
        for chunk in chunks:
            offsets.append(at)
            at += {"all": len(chunk.token_ids), "last": 1, "none": 0}[chunk.logits]
        return logits, offsets

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(R, V) float32 logits of `rows` (increasing, distinct) of the step's hidden states. A step that
        wants every row (all decode) takes them as a view, and float32 logits are not cast again."""
        if not rows:
            return hidden.new_empty(0, 0)
        logits = self.model.decode_logits(hidden[0] if len(rows) == hidden.shape[1] else hidden[0, rows])
        return logits if logits.dtype == torch.float32 else logits.float()

    def _hidden_states(self, chunks: list[Chunk], input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: PagedAttentionMetadata) -> torch.Tensor:
        """The model's final hidden states (1, N, hidden), with the chunks' prompt embeddings spliced in."""
        rows, values = overrides(chunks) if self.prompt_embeds else ([], [])
        if not rows:
            return self.model.hidden_states(input_ids, positions, meta, self.kv_cache)
        x = self.model.embed(input_ids)
        x[0, torch.tensor(rows, device=x.device)] = torch.cat(values).to(x.dtype)
        return self.model.norm(self.model.run_layers(x, positions, meta, self.kv_cache))


def overrides(chunks: list[Chunk]) -> tuple[list[int], list[torch.Tensor]]:
    """(rows of the flat step, the embedding rows that replace them) for every prompt position with
    given embeddings that some chunk computes; a chunk may cover any part of an override."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    first = 0
    for chunk in chunks:
        a, b = chunk.start, chunk.start + len(chunk.token_ids)
        for e in chunk.seq.embeds:
            lo, hi = max(a, e.start), min(b, e.stop)
            if lo < hi:
                rows += range(first + lo - a, first + hi - a)
                values.append(e.values[lo - e.start:hi - e.start])
        first += b - a
    return rows, values

