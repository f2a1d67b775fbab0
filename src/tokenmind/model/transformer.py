"""The one `Transformer` used for training, simple generation and the serving engine.

A Llama-style decoder: token embedding → N × [RMSNorm → attention (RoPE, MHA/GQA/MQA, optional
q/k norm, bias, sliding window, soft-capping) → residual → RMSNorm → SwiGLU MLP → residual] →
RMSNorm → LM head. Module names follow Hugging Face checkpoints, except that q/k/v and gate/up
are each one fused matrix (`qkv_proj`, `gate_up_proj`): one matmul instead of three or two,
which matters when decode is bound by per-op overhead. `checkpoint.py` splits and joins them.
In a mixture-of-experts model (`cfg.num_experts`) the MLP of some or all layers is a `MoE`.
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

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """num_experts SwiGLU MLPs stored as 3-D tensors, the layout of `transformers` 5:
    gate_up_proj (E, 2·f, d) and down_proj (E, d, f)."""

    def __init__(self, num_experts: int, d: int, f: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d, f))

    def forward(self, x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (N, d); expert and weight (N, k): each token's chosen experts and their weights → (N, d).

        The N·k (token, expert) pairs are sorted by expert and each projection runs as one grouped
        matmul (`F.grouped_mm`: expert e multiplies its rows, offsets mark where each group ends),
        with no Python loop over experts and no host sync; the results are summed back per token
        (one core, 8 experts of 256 → 512, top 2: forward + backward of 1,024 tokens 51 ms, 70
        with a Python loop over the groups; a batch-4 decode layer 453 µs against 493). One token
        (decode at batch 1) takes `_one_token` instead."""
        if x.shape[0] == 1:
            return self._one_token(x, expert, weight)
        k = expert.shape[1]
        pairs = expert.flatten()
        order = pairs.argsort(stable=True)
        token = order // k  # the tokens, grouped by expert
        ends = torch.bincount(pairs, minlength=self.gate_up_proj.shape[0]).cumsum(0, dtype=torch.int32)
        gate, up = F.grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        y = y * weight.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)

    def _one_token(self, x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (1, d): the k experts' outputs (k, d), summed by one (1, k) @ (k, d). At one row the
        grouped path's sort, count, gather and scatter, and grouped_mm's pass over every expert,
        cost more than the chosen experts' matmuls (same sizes: 162 µs a layer, 238 with grouped_mm)."""
        outs = []
        for e in expert[0].tolist():
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return weight.to(x.dtype) @ torch.cat(outs)


class MoE(nn.Module):
    """Sparse mixture of experts: a linear router scores the experts per token (softmax), the
    top num_experts_per_tok run (`Experts`) and their outputs are summed, weighted by those
    probabilities (renormalised to sum to 1 with norm_topk_prob: Mixtral). Qwen2-MoE adds a
    shared expert that every token passes through, scaled by sigmoid(shared_expert_gate(x)).

    In training with a router loss weighted (cfg.router_aux_loss_coef, router_z_loss_coef),
    `router_logits` keeps the last forward's (N, E) router logits for `router_aux_loss`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.aux_loss_coef, self.z_loss_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        if self.normalize:  # the top k's softmax probabilities renormalised = the softmax of their logits
            top, expert = torch.topk(logits.float(), self.top_k, dim=-1)
            weight = top.softmax(dim=-1)
        else:
            weight, expert = torch.topk(logits.float().softmax(dim=-1), self.top_k, dim=-1)
        out = self.experts(flat, expert, weight)
        if hasattr(self, "shared_expert"):
            out = torch.addcmul(out, torch.sigmoid(self.shared_expert_gate(flat)), self.shared_expert(flat))
        self.router_logits = logits if self.training and (self.aux_loss_coef or self.z_loss_coef) else None
        return out.view_as(x)


def load_balancing_loss(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch Transformer / Mixtral auxiliary loss over (N, E) router logits: E · Σ_e f_e · P_e,
    with f_e the share of the N tokens that chose expert e among their top k (so Σ f = k) and P_e
    the mean router probability of e. It is k when the load is even and grows as tokens crowd onto
    a few experts; its gradient reaches the router through P (f counts choices)."""
    probs = router_logits.float().softmax(dim=-1)
    num_experts = probs.shape[-1]
    chosen = probs.topk(top_k, dim=-1).indices.flatten()
    share = torch.bincount(chosen, minlength=num_experts).float() / probs.shape[0]
    return num_experts * (share * probs.mean(dim=0)).sum()


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss over (N, E) router logits: the mean of logsumexp(logits)², which keeps the
    logits small, so the router's softmax stays in a range where bf16 rounding does not flip choices."""
    return torch.logsumexp(router_logits.float(), dim=-1).square().mean()


def router_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """aux_coef · load_balancing_loss + z_coef · router_z_loss over every MoE layer's router
    logits of the last training forward (all layers' tokens pooled, as transformers does), or
    None when nothing was kept."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.router_logits is not None]
    if not layers:
        return None
    logits, first = torch.cat([m.router_logits for m in layers]), layers[0]
    loss = first.aux_loss_coef * load_balancing_loss(logits, first.top_k)
    return loss + first.z_loss_coef * router_z_loss(logits) if first.z_loss_coef else loss


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)

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
