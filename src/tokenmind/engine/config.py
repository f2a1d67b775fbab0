"""`EngineConfig`: the knobs of the batched engine, and how big its KV block pool gets.

The pool is the engine's one big allocation, so it is sized from memory, not from a request
count: an explicit byte budget, or a fraction of what is free when the engine starts (MemAvailable
from /proc/meminfo on CPU, `torch.cuda.mem_get_info` on GPU). Everything else bounds one step:
how many sequences run together and how many new tokens one forward pass may take.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.paged_attention import PagedKVCache
from ..model.load import DTYPES
from .speculative import SpeculativeConfig


@dataclass
class EngineConfig:
    """Batched-engine settings. `kv_cache_bytes`, when set, wins over `kv_cache_fraction`."""

    block_size: int = 16  # tokens per KV block: the unit of allocation, sharing and prefix caching
    kv_cache_bytes: int | None = None  # exact byte budget for the block pool
    kv_cache_fraction: float = 0.5  # else: this fraction of the memory free at start
    max_num_seqs: int = 64  # sequences running at once (each decodes one token per step)
    max_num_batched_tokens: int = 2048  # new tokens per step, decodes and prefill chunks together
    enable_chunked_prefill: bool = True  # split long prompts across steps so decodes keep flowing
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompts that start the same way
    max_model_len: int | None = None  # longest sequence (prompt + output); None = the model's context
    max_queue_wait: float | None = None  # seconds a request may wait for its first step; then it ends "timeout"
    speculative: SpeculativeConfig | None = None  # draft tokens and verify them in one pass (see speculative.py)
    dtype: str | torch.dtype | None = None  # model and KV cache dtype ("bf16", ...); None = the model's own
    device: str | None = None  # None = where the model already is

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
            self.dtype = DTYPES[self.dtype]
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive (or None to use kv_cache_fraction), "
                             f"got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} cannot give each of "
                             f"max_num_seqs={self.max_num_seqs} running sequences its decode token; raise "
                             "max_num_batched_tokens or lower max_num_seqs")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise ValueError(f"max_queue_wait must be > 0 seconds (or None: wait as long as it takes), "
                             f"got {self.max_queue_wait}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and an output token), "
                             f"got {self.max_model_len}")

    def resolve_max_model_len(self, model_cfg: ModelConfig) -> int:
        """The configured limit, never beyond the model's context window."""
        context = model_cfg.max_position_embeddings
        length = context if self.max_model_len is None else min(self.max_model_len, context)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < length:
            raise ValueError(f"without chunked prefill a whole prompt must fit one step, but "
                             f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={length}; "
                             "enable chunked prefill, raise max_num_batched_tokens or lower max_model_len")
        return length

    def resolve_num_blocks(self, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
        """How many KV blocks the pool gets.

        A fraction of free memory is capped at what `max_num_seqs` full-length sequences can use,
        so a tiny model does not grab gigabytes; an explicit `kv_cache_bytes` is taken as given
        (the extra blocks keep more prefixes cached).
        """
        per_block = PagedKVCache.bytes_per_block(model_cfg, self.block_size, dtype)
        if self.kv_cache_bytes is not None:
            budget, source = self.kv_cache_bytes, f"kv_cache_bytes={self.kv_cache_bytes}"
        else:
            free = free_memory_bytes(device)
            budget, source = int(free * self.kv_cache_fraction), f"kv_cache_fraction={self.kv_cache_fraction} of " \
                                                                 f"{free / 2**30:.1f} GiB free"
        num_blocks = budget // per_block
        if self.kv_cache_bytes is None:
            blocks_per_seq = -(-self.resolve_max_model_len(model_cfg) // self.block_size)
            num_blocks = min(num_blocks, self.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(f"{source} holds no KV block of {per_block} bytes (block_size={self.block_size}); "
                             "raise kv_cache_bytes / kv_cache_fraction or lower block_size")
        return num_blocks


def free_memory_bytes(device: torch.device) -> int:
    """Memory free right now on `device`: CUDA's free bytes, or MemAvailable for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set EngineConfig.kv_cache_bytes instead")
