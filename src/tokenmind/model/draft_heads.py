"""Draft heads: small modules trained on top of a frozen model to propose its next tokens.

Both read the model's final-normed hidden state h_t (the feature that its LM head turns into the
logits of token t + 1) and both reuse the model's own embedding and LM head, frozen and shared,
so a head file holds only the head's new weights.

* `MedusaHeads` (Cai et al. 2024): K heads; head k (1-based) predicts token t + k + 1 from h_t
  alone, through a residual block h + SiLU(W h + b) and then the model's LM head. W starts at
  zero, so an untrained head says what the LM head says (token t + 1), the paper's start.
* `EagleHead` (Li et al. 2024, EAGLE-1): one decoder `Block` over fc([embedding of token t + 1;
  h_t]) that predicts the next feature h_{t+1}; the LM head reads the token off that prediction.
  At draft time it runs autoregressively on its own predicted features. It has the call
  signature of a multi-token prediction depth (`MTPLayer`: embeddings, previous hidden state,
  RoPE, attention metadata, KV pool), so the engine drafts with it as with a one-depth MTP
  model whose depth is reused for every further draft, and `Transformer.draft_step` runs it.

A trained head is a directory next to its base model, never inside it: `head.json` (method,
sizes, how it was trained) and `head.safetensors`, written atomically (`save_draft_head`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .checkpoint import atomic_directory
from .config import ModelConfig
from .transformer import Block

DRAFT_HEAD_METHODS = ("medusa", "eagle")


class MedusaHeads(nn.Module):
    """K residual blocks; `forward(h)` gives each head's hidden state (K, ..., hidden) for the shared LM head."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # the identity at start: each head begins as the LM head itself
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([hidden + F.silu(block(hidden)) for block in self.blocks])


class EagleHead(Block):
    """fc([embedding; feature]) → one decoder block of the model's shape (dense MLP) → the predicted
    next feature. Layer 0 of its own KV pool. Slot p reads (feature of p - 1, token p) at RoPE
    position p, the layout of `MTPLayer`, so its output at p predicts feature p and token p + 1."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, 0, moe=False)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, embeds, prev, cos, sin, attn, kv_cache=None):
        return super().forward(self.fc(torch.cat([embeds, prev], dim=-1)), cos, sin, attn, kv_cache)


DraftHead = MedusaHeads | EagleHead


def build_draft_head(method: str, cfg: ModelConfig, num_heads: int = 4) -> DraftHead:
    """A fresh head for a model of config `cfg` (`num_heads`: Medusa's K)."""
    if method == "medusa":
        return MedusaHeads(cfg.hidden_size, num_heads)
    if method == "eagle":
        head = EagleHead(cfg)
        for name, p in head.named_parameters():  # the model's init: N(0, 0.02) matrices, unit norms, zero biases
            with torch.no_grad():
                p.fill_(1.0) if name.endswith("norm.weight") else p.zero_() if p.ndim == 1 else p.normal_(0, 0.02)
        return head
    raise ValueError(f"unknown draft head {method!r}; choose one of {', '.join(DRAFT_HEAD_METHODS)}")


def head_method(head: DraftHead) -> str:
    return "medusa" if isinstance(head, MedusaHeads) else "eagle"


def save_draft_head(head: DraftHead, cfg: ModelConfig, out_dir: str | Path, info: dict[str, Any] | None = None) -> Path:
    """Write `head.json` + `head.safetensors` (fp32) atomically. `info`: how it was trained (kept in the json)."""
    meta = {"method": head_method(head), "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
            "num_heads": head.num_heads if isinstance(head, MedusaHeads) else 1, **(info or {})}
    with atomic_directory(out_dir) as tmp:
        tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in head.state_dict().items()}
        save_file(tensors, str(tmp / "head.safetensors"), metadata={"format": "pt"})
        (tmp / "head.json").write_text(json.dumps(meta, indent=2) + "\n")
    return Path(out_dir)


def read_head_meta(path: str | Path) -> dict[str, Any]:
    meta_path = Path(path) / "head.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path}: no head.json there; give a directory written by `tokenmind posttrain "
                                "medusa|eagle` (its out_dir/head)")
    return json.loads(meta_path.read_text())


def load_draft_head(path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", method: str | None = None) -> DraftHead:
    """The head saved at `path`, checked against the model (config `cfg`) it will draft for, and,
    when given, against the `method` the caller expects."""
    meta = read_head_meta(path)
    if method is not None and meta["method"] != method:
        raise ValueError(f"{path} holds a {meta['method']} head, not a {method} one; use "
                         f"--speculative {meta['method']}:{path}")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        if meta[key] != getattr(cfg, key):
            raise ValueError(f"{path}: the head was trained for a model with {key}={meta[key]}, this model has "
                             f"{getattr(cfg, key)}; train a head on this model (tokenmind posttrain {meta['method']})")
    head = build_draft_head(meta["method"], cfg, meta["num_heads"])
    head.load_state_dict(load_file(str(Path(path) / "head.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
