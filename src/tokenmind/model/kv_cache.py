"""A contiguous per-batch KV cache for simple generation (the paged cache lives in the engine).

Rows of a batch advance together (left-padded prompts), so one write offset serves all rows;
`key_mask` remembers which cached slots hold padding so attention can skip them.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """Keys/values of every layer: (layers, B, kv_heads, max_len, head_dim)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)  # per-layer views, made once
        self.key_mask = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.has_padding = False
        self.length = 0  # slots filled so far (same for every row)
        self.max_len = max_len

    def reserve(self, num_new: int, attention_mask: torch.Tensor | None) -> int:
        """Claim the next `num_new` slots for a forward pass; returns their start offset."""
        start = self.length
        if start + num_new > self.max_len:
            raise ValueError(
                f"KV cache full: {start} cached + {num_new} new tokens > max_len={self.max_len}; "
                "allocate a larger cache (max_len) or generate fewer tokens"
            )
        if attention_mask is not None:
            self.key_mask[:, start:start + num_new] = attention_mask.bool()
            self.has_padding = self.has_padding or not bool(attention_mask.all())
        return start

    def commit(self, num_new: int) -> None:
        """Mark the slots of a finished forward pass as filled."""
        self.length += num_new

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v (B, kv_heads, T, D) at `start`; return all cached keys/values up to them."""
        end = start + k.shape[2]
        k_all, v_all = self._k_layers[layer][:, :, :end], self._v_layers[layer][:, :, :end]
        k_all[:, :, start:].copy_(k)
        v_all[:, :, start:].copy_(v)
        return k_all, v_all
