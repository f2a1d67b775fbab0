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

from .config import ModelConfig
from .kv_cache import KVCache
from .paged_attention import PagedAttentionMetadata, PagedKVCache, paged_attention
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: "AttnMask | None",
                kv_cache: KVCache | PagedKVCache | None = None, cache_start: int = 0,
                paged: PagedAttentionMetadata | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = qkv[:, :, :self.n_heads + self.n_kv], qkv[:, :, self.n_heads + self.n_kv:]
        if hasattr(self, "q_norm"):
            q, k = qk.split([self.n_heads, self.n_kv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = apply_rotary(qk, cos, sin).transpose(1, 2)  # (B, H + H_kv, T, D)
        q, k, v = qk[:, :self.n_heads], qk[:, self.n_heads:], v.transpose(1, 2)
        if paged is not None:  # engine path: B == 1, the row is all scheduled sequences' new tokens
            out = paged_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), kv_cache,
                                  self.layer_idx, paged, self.window, self._attend)
            return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))
        if kv_cache is not None:
            k, v = kv_cache.write(self.layer_idx, cache_start, k, v)  # (B, H_kv, S, D)
        causal = mask.causal
        out = self._attend(q, k, v, mask.tensor, causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool = False) -> torch.Tensor:
        """(B, H, T, D) queries over (B, H_kv, S, D) keys; mask (B|1, 1, T, S) bool, True = attend."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=self.scale, enable_gqa=self.n_kv != self.n_heads)
        # Soft-capping bends the scores before softmax, which the fused kernel cannot do.
        group = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * self.scale
        scores = self.softcap * torch.tanh(scores / self.softcap)
        if causal:
            T, S = q.shape[2], k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v


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

    def forward(self, x, cos, sin, mask, kv_cache=None, cache_start=0, paged=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, cache_start, paged)
        return x + self.mlp(self.post_attention_layernorm(x))


class AttnMask:
    """Which keys each query may see: causal, minus padding, within the sliding window, same document.

    Stays symbolic (`tensor is None`) in the common cases so SDPA can use its fast paths:
    plain causal prefill (`causal=True`) and single-token decode with no padding (no mask at all).
    """

    def __init__(self, q_slots: torch.Tensor, num_keys: int, key_mask: torch.Tensor | None,
                 sliding_window: int | None, document_ids: torch.Tensor | None = None):
        if (document_ids is not None and not torch.compiler.is_compiling()  # a data-dependent branch breaks graphs
                and bool((document_ids == document_ids[:, :1]).all())):
            document_ids = None  # one document per row: plain causal, so SDPA keeps its mask-free kernel
        self.q_slots, self.num_keys, self.key_mask, self.window = q_slots, num_keys, key_mask, sliding_window
        self.document_ids = document_ids
        T = q_slots.shape[0]
        window_bites = sliding_window is not None and num_keys > sliding_window
        plain = key_mask is None and document_ids is None and not window_bites
        self.causal = plain and T > 1 and T == num_keys
        self.tensor = None if plain and (T == 1 or self.causal) else self.materialize(T, num_keys, q_slots.device)

    def materialize(self, T: int, S: int, device) -> torch.Tensor | None:
        """(B or 1, 1, T, S) bool; True = may attend."""
        k_slots = torch.arange(S, device=device)
        allowed = k_slots[None, :] <= self.q_slots[:, None]  # (T, S)
        if self.window is not None:
            allowed = allowed & (self.q_slots[:, None] - k_slots[None, :] < self.window)
        allowed = allowed[None, None]
        if self.document_ids is not None:  # packed training rows: never attend across documents
            docs = self.document_ids
            allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
        if self.key_mask is not None:
            allowed = allowed & self.key_mask[:, None, None, :S]
            # A padding query would see no key at all; let it see itself so softmax stays finite.
            allowed = allowed | (k_slots[None, :] == self.q_slots[:, None])[None, None]
        return allowed


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.gradient_checkpointing = False  # recompute each block's activations in backward (saves memory)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                      attention_mask: torch.Tensor | None = None, kv_cache: KVCache | PagedKVCache | None = None,
                      document_ids: torch.Tensor | None = None,
                      attn: PagedAttentionMetadata | None = None) -> torch.Tensor:
        """input_ids (B, T) → final-normed hidden states (B, T, hidden).

        positions: (B, T) token positions for RoPE; default: cache offset + arange(T).
        attention_mask: (B, T) 1 for real tokens, 0 for (left) padding.
        kv_cache: a `KVCache`; the new keys/values are appended and attention sees all cached ones.
        document_ids: (B, T) for packed training rows: tokens attend only within their document
            (pass positions that restart at each document too).
        attn: the engine's paged metadata; then input_ids is (1, N) — the new tokens of every scheduled
            sequence back to back — positions are required and kv_cache is the `PagedKVCache` block pool.
        """
        if attn is not None:
            if positions is None or not isinstance(kv_cache, PagedKVCache):
                raise ValueError("paged attention needs explicit positions and a PagedKVCache")
            x = self.embed_tokens(input_ids)
            cos, sin = self.rotary(positions, x.dtype)
            for layer in self.layers:
                x = layer(x, cos, sin, None, kv_cache, 0, attn)
            return self.norm(x)
        if document_ids is not None and kv_cache is not None:
            raise ValueError("document_ids is for packed training batches; it cannot be combined with a kv_cache")
        B, T = input_ids.shape
        start = kv_cache.reserve(T, attention_mask) if kv_cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        if kv_cache is not None:
            key_mask = kv_cache.key_mask[:, :start + T] if kv_cache.has_padding else None
        else:
            key_mask = attention_mask.bool() if attention_mask is not None and not attention_mask.all() else None
        q_slots = torch.arange(start, start + T, device=input_ids.device)
        mask = AttnMask(q_slots, start + T, key_mask, self.cfg.sliding_window, document_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache, start)
        if kv_cache is not None:
            kv_cache.commit(T)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None, kv_cache: KVCache | PagedKVCache | None = None,
                document_ids: torch.Tensor | None = None,
                attn: PagedAttentionMetadata | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for every position; see `hidden_states` for the arguments."""
        return self.logits(self.hidden_states(input_ids, positions, attention_mask=attention_mask,
                                              kv_cache=kv_cache, document_ids=document_ids, attn=attn))

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch_size, max_len, dtype=p.dtype, device=p.device)

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
