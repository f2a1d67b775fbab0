"""The one `Transformer` used for training, simple generation and the serving engine.

A Llama-style decoder: token embedding → N × [RMSNorm → attention (RoPE, MHA/GQA/MQA, optional
q/k norm, bias, sliding window, soft-capping) → residual → RMSNorm → SwiGLU MLP → residual] →
RMSNorm → LM head. Module names follow Hugging Face checkpoints, except that q/k/v and gate/up
are each one fused matrix (`qkv_proj`, `gate_up_proj`): one matmul instead of three or two,
which matters when decode is bound by per-op overhead. `checkpoint.py` splits and joins them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .attention import AttentionMetadata, DenseAttentionMetadata, DenseMask, attend
from .config import ModelConfig
from .paged_attention import PagedAttentionMetadata, PagedKVCache
from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in float32 like HF."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the decode hot path: one op
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Lower precision: normalize and scale in fp32, like HF, then cast back.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.qkv_proj = nn.Linear(d, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.softcap = cfg.attn_logit_softcapping
        self.window = cfg.sliding_window
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: DenseMask | PagedAttentionMetadata,
                kv_cache: PagedKVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = qkv[:, :, :self.n_heads + self.n_kv], qkv[:, :, self.n_heads + self.n_kv:]
        if hasattr(self, "q_norm"):
            q, k = qk.split([self.n_heads, self.n_kv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = apply_rotary(qk, cos, sin)  # (B, T, H + H_kv, D)
        q, k = qk[:, :, :self.n_heads], qk[:, :, self.n_heads:]
        out = attend(q, k, v, attn, kv_cache, self.layer_idx, scale=self.scale, softcap=self.softcap,
                     window=self.window)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # A skeleton on the meta device (the loader's) skips the embedding's random init: meta
        # normal_ runs a Python decomposition that first imports torch._dynamo (0.8 s of start-up).
        skeleton = torch.empty(cfg.vocab_size, cfg.hidden_size) if torch.empty(0).is_meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=skeleton)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.gradient_checkpointing = False  # recompute each block's activations in backward (saves memory)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attn: AttentionMetadata | None = None, kv_cache: PagedKVCache | None = None) -> torch.Tensor:
        """input_ids (B, T) → final-normed hidden states (B, T, hidden).

        positions: (B, T) token positions for RoPE; default 0..T-1 in every row.
        attn: how the batch attends (`model/attention.py`): None or `DenseAttentionMetadata` for
            whole sequences (causal; packed documents, shared prefixes, padding); the engine's
            `PagedAttentionMetadata` for a step over the block pool `kv_cache`, where input_ids is
            (1, N) — the new tokens of every scheduled sequence back to back — and positions are
            required.
        """
        x = self.embed_tokens(input_ids)
        if isinstance(attn, PagedAttentionMetadata):
            if positions is None or kv_cache is None:
                raise ValueError("paged attention needs explicit positions and the PagedKVCache it describes")
            mask: DenseMask | PagedAttentionMetadata = attn
        else:
            if kv_cache is not None:
                raise ValueError("a kv_cache is read through paged attention metadata (the engine builds it); "
                                 "a dense batch attends to itself")
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
            mask = (attn or DenseAttentionMetadata()).resolve(positions, self.cfg.sliding_window)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache)
        return self.norm(x)

    def hf_config(self) -> dict:
        """The config.json that `transformers` loads this model's checkpoint with."""
        return self.cfg.to_hf()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionMetadata | None = None, kv_cache: PagedKVCache | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for every position; see `hidden_states` for the arguments.
        logits_at: flat indices into the B·T positions; then only their logits, (N, vocab): a
        loss on a few positions skips the output layer (a large share of a small model's
        compute) everywhere else."""
        hidden = self.hidden_states(input_ids, positions, attn, kv_cache)
        if logits_at is not None:
            hidden = hidden.flatten(0, 1)[logits_at]
        return self.logits(hidden)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) for matrices, ones for norms, zeros for biases (GPT-2 / Llama recipe)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
