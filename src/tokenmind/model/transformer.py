"""The one `Transformer` used for training, simple generation and the serving engine.

A Llama-style decoder: token embedding → N × [RMSNorm → attention (RoPE, MHA/GQA/MQA, optional
q/k norm, bias, sliding window, soft-capping) → residual → RMSNorm → SwiGLU MLP → residual] →
RMSNorm → LM head. Module names follow Hugging Face checkpoints, except that q/k/v and gate/up
are each one fused matrix (`qkv_proj`, `gate_up_proj`): one matmul instead of three or two,
which matters when decode is bound by per-op overhead. `checkpoint.py` splits and joins them.
In a mixture-of-experts model (`cfg.num_experts`) the MLP of some or all layers is a `MoE`;
DeepSeek models attend through `LatentAttention` (multi-head latent attention), and DeepSeek-V3
may add multi-token prediction depths after the model (`MTPLayer`, `Transformer.mtp`).
Gemma 2/3 add their traits through `ModelConfig`: a `SandwichBlock` (norms after each sublayer
too), GELU-tanh in the gated MLP, RMSNorm by (1 + weight), embeddings × sqrt(hidden), the
query_pre_attn_scalar, and local (sliding, own RoPE in Gemma 3) layers between global ones.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import native
from .attention import AttentionMetadata, DenseAttentionMetadata, DenseMask, attend
from .config import ModelConfig
from .paged_attention import PagedAttentionMetadata, PagedKVCache, cache_native_ok
from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in float32 like HF.

    unit_offset (Gemma): the scale is 1 + weight, so the stored weight starts at 0, not 1."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + 1.0 if self.unit_offset else self.weight
        if x.dtype == torch.float32 and weight.dtype == torch.float32:  # the decode hot path: one op
            if x.shape[-1] % 8 == 0 and native.takes(x, weight):
                return native.rms_norm(x, weight, self.eps)  # one call where F.rms_norm dispatches ~20
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        # Lower precision: normalize and scale in fp32, like HF, then cast back.
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.eps).to(x.dtype)


def rms_norm(cfg: ModelConfig, dim: int | None = None) -> RMSNorm:
    """The family's RMSNorm over `dim` features (default hidden_size)."""
    return RMSNorm(dim or cfg.hidden_size, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.qkv_proj = nn.Linear(d, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        self.qk_norm_per_head = cfg.qk_norm_per_head
        if cfg.qk_norm:  # per head (Qwen3, Gemma 3), or over all heads at once (OLMoE)
            q_width, k_width = (self.head_dim, self.head_dim) if cfg.qk_norm_per_head else \
                (self.n_heads * self.head_dim, self.n_kv * self.head_dim)
            self.q_norm = rms_norm(cfg, q_width)
            self.k_norm = rms_norm(cfg, k_width)
        self.clip_qkv = cfg.clip_qkv
        self.softcap = cfg.attn_logit_softcapping
        self.window = cfg.sliding_window if cfg.is_sliding_layer(layer_idx) else None
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: DenseMask | PagedAttentionMetadata,
                kv_cache: PagedKVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        if hasattr(self, "q_norm") and not self.qk_norm_per_head:
            q, k, v = qkv.split([self.n_heads * self.head_dim] + [self.n_kv * self.head_dim] * 2, dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qkv = qkv.view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = qkv[:, :, :self.n_heads + self.n_kv], qkv[:, :, self.n_heads + self.n_kv:]
        if hasattr(self, "q_norm") and self.qk_norm_per_head:
            q, k = qk.split([self.n_heads, self.n_kv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = apply_rotary(qk, cos, sin)  # (B, T, H + H_kv, D)
        q, k = qk[:, :, :self.n_heads], qk[:, :, self.n_heads:]
        out = attend(q, k, v, attn, kv_cache, self.layer_idx, scale=self.scale, softcap=self.softcap,
                     window=self.window)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). Each token's keys and values come from one
    kv_lora_rank latent (`kv_a_proj_with_mqa` → RMSNorm) through `kv_b_proj`, plus a single
    qk_rope_head_dim key part that carries RoPE and is shared by every head; queries go through
    an optional low-rank bottleneck (`q_a_proj` → RMSNorm → `q_b_proj`).

    Whole sequences (training, scoring) expand the latent into per-head keys and values, as the
    paper writes it. Over the paged cache only the latent and the RoPE key are stored, and
    `kv_b_proj` is absorbed instead: its key half folds into each head's query (q·W_k·c = (W_kᵀq)·c)
    and its value half applies after attention, so the heads attend, like multi-query attention,
    to one (kv_lora_rank + qk_rope_head_dim) entry per token whose first kv_lora_rank values are
    also its value."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.rank, self.interleave = h, cfg.kv_lora_rank, cfg.rope_interleave
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' fixed epsilon for both bottlenecks
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=cfg.o_bias)
        self.scale = cfg.qk_head_dim ** -0.5 * _yarn_softmax_scale(cfg.rope_scaling)
        self.window = None  # DeepSeek attends to the whole context

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: DenseMask | PagedAttentionMetadata,
                kv_cache: PagedKVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(B, T, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent, k_rot = self.kv_a_layernorm(latent)[:, :, None], k_rot[:, :, None]  # one "head" each
        if self.interleave:  # rotate adjacent pairs: gather evens then odds, the same permutation for q and k
            q_rot, k_rot = (torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1) for t in (q_rot, k_rot))
        q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
        w_k, w_v = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)
        if isinstance(attn, PagedAttentionMetadata):
            query = torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, w_k), q_rot], dim=-1)
            entry = torch.cat([latent, k_rot], dim=-1)  # (B, T, 1, rank + rope): what the cache holds
            out = attend(query, entry, entry[..., :self.rank], attn, kv_cache, self.layer_idx, scale=self.scale,
                         softcap=None, window=None)
            out = torch.einsum("bthr,hvr->bthv", out, w_v)
        else:
            k_nope, v = self.kv_b_proj(latent[:, :, 0]).view(B, T, self.n_heads, -1).split([self.nope, self.v_dim], -1)
            k = torch.cat([k_nope, k_rot.expand(B, T, self.n_heads, self.rope)], dim=-1)
            out = attend(torch.cat([q_nope, q_rot], dim=-1), k, v, attn, None, self.layer_idx, scale=self.scale,
                         softcap=None, window=None)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.v_dim))


def _yarn_softmax_scale(rope_scaling: dict | None) -> float:
    """DeepSeek's YaRN also sharpens the softmax: its scale is multiplied by mscale(factor, mscale_all_dim)²."""
    if not rope_scaling or rope_scaling.get("rope_type") != "yarn" or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    factor = rope_scaling["factor"]
    mscale = 0.1 * rope_scaling["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
    return mscale * mscale


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with Gemma's tanh-approximated GELU."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
        self.act = F.silu if cfg.hidden_act == "silu" else partial(F.gelu, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and gate_up.shape[-1] % 16 == 0 and native.takes(gate_up):
            return self.down_proj(native.silu_mul(gate_up))  # one call for chunk, silu and the product
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Experts(nn.Module):
    """num_experts SwiGLU MLPs stored as 3-D tensors, the layout of `transformers` 5:
    gate_up_proj (E, 2·f, d) and down_proj (E, d, f). Expert parallelism
    (`train/expert_parallel.py`) holds a slice of them and overrides only `run_grouped`."""

    holds_all_experts = True  # False for a rank's slice: every row must go through run_grouped

    def __init__(self, num_experts: int, d: int, f: int):
        super().__init__()
        self.num_experts = num_experts
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
        if x.shape[0] == 1 and self.holds_all_experts:
            return self._one_token(x, expert, weight)
        k = expert.shape[1]
        pairs = expert.flatten()
        order = pairs.argsort(stable=True)
        token = order // k  # the tokens, grouped by expert
        counts = torch.bincount(pairs, minlength=self.num_experts)
        y = self.run_grouped(x[token], counts) * weight.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)

    def _one_token(self, x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (1, d): the k experts' outputs (k, d), summed by one (1, k) @ (k, d). At one row the
        grouped path's sort, count, gather and scatter, and grouped_mm's pass over every expert,
        cost more than the chosen experts' matmuls (same sizes: 162 µs a layer, 238 with grouped_mm)."""
        outputs = torch.cat([self.expert(e, x) for e in expert.tolist()[0]])
        return (weight if weight.dtype == x.dtype else weight.to(x.dtype)) @ outputs

    def run_grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (N·k, d) grouped by expert, counts[e] of them for expert e → each row's expert
        output, in the same order: one grouped matmul per projection."""
        ends = counts.cumsum(0, dtype=torch.int32)
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU over its rows (n, d) → (n, d)."""
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


def _float(x: torch.Tensor) -> torch.Tensor:
    """x in float32; no op dispatched when it already is (a decode step calls this per MoE layer)."""
    return x if x.dtype == torch.float32 else x.float()


class Router(nn.Linear):
    """Scores the experts for each token and picks its top k (`route`); the weight is HF's
    `mlp.gate.weight`.

    Scores are a softmax (Mixtral, Qwen, OLMoE, DeepSeek-V2) or a sigmoid (DeepSeek-V3) of the
    logits. Group-limited routing first keeps the topk_group best of n_group equal expert groups
    (a group scores its best expert, V2, or its best two, V3) and picks the top k inside them. A
    "noaux_tc" router adds `e_score_correction_bias` to the scores for the choice only — the
    weights stay the raw scores — which is how auxiliary-loss-free balancing steers load
    (`balance_experts`). Chosen weights are optionally renormalised, then scaled."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.num_experts, bias=False)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.sigmoid, self.method = cfg.scoring_func == "sigmoid", cfg.topk_method
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.bias_update_rate = cfg.router_bias_update_rate
        if self.method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, E) router logits → each token's expert weights and expert ids, both (N, k)."""
        if self.normalize and not self.sigmoid and self.method == "greedy":  # Mixtral: the top k's softmax
            top, expert = torch.topk(_float(logits), self.top_k, dim=-1)  # probabilities renormalised are
            weight = top.softmax(dim=-1)  # the softmax of their logits: fewer ops
            return weight * self.scaling if self.scaling != 1.0 else weight, expert
        scores = _float(logits).sigmoid() if self.sigmoid else _float(logits).softmax(dim=-1)
        choice = scores + self.e_score_correction_bias if self.method == "noaux_tc" else scores
        if self.method != "greedy" and self.n_group > 1:
            groups = choice.view(len(choice), self.n_group, -1)
            group_score = groups.topk(2, dim=-1).values.sum(-1) if self.method == "noaux_tc" else groups.amax(-1)
            dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(self.topk_group, dim=-1).indices, False)
            choice = choice.masked_fill(dropped.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        expert = choice.topk(self.top_k, dim=-1).indices
        weight = scores.gather(1, expert)
        if self.normalize:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return weight * self.scaling if self.scaling != 1.0 else weight, expert


class MoE(nn.Module):
    """Sparse mixture of experts: the `Router` picks each token's top num_experts_per_tok experts,
    they run (`Experts`), and their outputs are summed with the router's weights. Qwen2-MoE adds a
    shared expert every token passes through, scaled by sigmoid(shared_expert_gate(x)); DeepSeek
    adds n_shared_experts ungated (`shared_experts`, one MLP of their total width).

    In training, `expert_load` counts the tokens each expert received since `balance_experts`
    last read it, and with a router loss weighted (cfg.router_aux_loss_coef, router_z_loss_coef)
    `router_logits` keeps the last forward's (N, E) router logits for `router_aux_loss`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.aux_loss_coef, self.z_loss_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        elif cfg.n_shared_experts:
            self.shared_experts = MLP(cfg, cfg.shared_experts_intermediate_size)
        # counts (an integer survives model.to(bf16)); on the CPU even in the loader's meta skeleton,
        # like RoPE's frequencies, since no checkpoint holds it
        self.register_buffer("expert_load", torch.zeros(cfg.num_experts, dtype=torch.long, device="cpu"),
                             persistent=False)
        self.router_logits: torch.Tensor | None = None

    def _native_mixture(self) -> tuple | None:
        """The router and experts as `native.decode_layers` reads a mixture (router weight, experts' gate_up and
        down, the shared expert's gate weight or None, top k, routing), or None where the kernel cannot run it:
        only a softmax router's plain top k (Mixtral, Qwen2/3-MoE; no groups, sigmoid scores or bias), every
        expert held here, at most Qwen2-MoE's one gated shared expert (not DeepSeek's ungated ones), all
        float32 and contiguous with widths a multiple of 8."""
        router, experts = self._modules["gate"], self._modules["experts"]
        gate = self._modules.get("shared_expert_gate")
        tensors = [router.weight, experts.gate_up_proj, experts.down_proj] + ([] if gate is None else [gate.weight])
        if (router.sigmoid or router.method != "greedy" or type(experts) is not Experts
                or "shared_experts" in self._modules or gate is not None and gate.bias is not None
                or not all(t.dtype == torch.float32 and t.is_contiguous() and t.shape[-1] % 8 == 0 for t in tensors)):
            return None
        routing = native.ROUTE_TOPK_SOFTMAX if router.normalize else native.ROUTE_SOFTMAX_TOPK
        return (tensors[0], tensors[1], tensors[2], None if gate is None else tensors[3], self.top_k, routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        weight, expert = self.gate.route(logits)
        out = self.experts(flat, expert, weight)
        if hasattr(self, "shared_expert"):
            out = torch.addcmul(out, torch.sigmoid(self.shared_expert_gate(flat)), self.shared_expert(flat))
        elif hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        if self.training:
            self.expert_load += torch.bincount(expert.flatten(), minlength=len(self.expert_load))
        self.router_logits = logits if self.training and (self.aux_loss_coef or self.z_loss_coef) else None
        return out.view_as(x)


@torch.no_grad()
def balance_experts(model: nn.Module, mean_over_ranks=None) -> list[torch.Tensor]:
    """Read and reset every MoE layer's expert load since the last call, as fractions of the
    routed (token, expert) pairs per layer, and apply auxiliary-loss-free balancing (DeepSeek-V3):
    a router with a bias update rate γ moves each expert's bias by γ·sign(mean load − load), so
    an overloaded expert is chosen less from the next step on, without a loss term pulling on the
    router's gradients. `mean_over_ranks` (data parallelism) averages the counts first, so every
    rank applies the same update."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return []
    loads = torch.stack([m.expert_load for m in layers]).float()
    if mean_over_ranks is not None:
        loads = mean_over_ranks(loads)
    for m, load in zip(layers, loads):
        m.expert_load.zero_()
        rate = m.gate.bias_update_rate
        if rate and load.sum() > 0:
            m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
    return list(loads / loads.sum(dim=-1, keepdim=True).clamp(min=1))


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
    """layer_idx: the layer's index in its KV pool; moe: whether its MLP is a mixture of experts
    (default: what the config says of layer layer_idx)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, moe: bool | None = None):
        super().__init__()
        self.input_layernorm = rms_norm(cfg)
        self.self_attn = LatentAttention(cfg, layer_idx) if cfg.kv_lora_rank else Attention(cfg, layer_idx)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = MoE(cfg) if (cfg.is_moe_layer(layer_idx) if moe is None else moe) else MLP(cfg)
        self.local_rope = cfg.rope_local_theta is not None and cfg.is_sliding_layer(layer_idx)  # Gemma 3

    def forward(self, x, cos, sin, attn, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _native_linears(self) -> list | None:
        """qkv, o, gate/up and down if this block can run in a native all-decode step
        (`Transformer._decode_natively`): a plain Llama-family block (no biases but qkv's, no q/k norms,
        clipping or soft-capping; SwiGLU, or a float32 mixture of SwiGLU experts that `MoE._native_mixture`
        takes, whose shared expert's gate/up and down stand here, None without one) whose linears are int4
        or int8 on the native kernels, or float32 `nn.Linear`s. Decided once, and again if one is replaced."""
        found = self.__dict__.get("_native_layer", False)
        if found is False or (found and not self._still_holds(found)):  # e.g. LoRA wrapped a linear since
            found = self.__dict__["_native_layer"] = self._find_native_linears()
        return found

    def _still_holds(self, linears: list) -> bool:
        # Runs for every layer of every decode step: the module dicts directly (nn.Module.__getattr__ costs ~0.5 µs).
        attn, mlp = self._modules["self_attn"]._modules, self._modules["mlp"]
        ffn = mlp._modules.get("shared_expert") if type(mlp) is MoE else mlp
        ffn = {} if ffn is None else ffn._modules
        return (linears[0] is attn.get("qkv_proj") and linears[1] is attn.get("o_proj")
                and linears[2] is ffn.get("gate_up_proj") and linears[3] is ffn.get("down_proj")
                and all(type(lin) is not nn.Linear or _native_float_weight(lin) for lin in linears))

    def _find_native_linears(self) -> list | None:
        from .quant import Int4Linear, Int8Linear

        attn, mlp, norms = self.self_attn, self.mlp, (self.input_layernorm, self.post_attention_layernorm)
        if not (type(self) is Block and type(attn) is Attention and type(mlp) in (MLP, MoE)):
            return None
        ffn = mlp if type(mlp) is MLP else getattr(mlp, "shared_expert", None)
        if type(mlp) is MoE and mlp._native_mixture() is None:
            return None
        if ffn is not None and not (type(ffn) is MLP and ffn.act is F.silu and ffn.down_proj.in_features % 8 == 0):
            return None
        linears = [attn.qkv_proj, attn.o_proj] + ([None, None] if ffn is None else [ffn.gate_up_proj, ffn.down_proj])
        plain = (not hasattr(attn, "q_norm") and attn.clip_qkv is None and attn.softcap is None
                 and not any(n.unit_offset for n in norms) and norms[0].eps == norms[1].eps
                 and attn.head_dim % 16 == 0 and attn.n_heads % attn.n_kv == 0
                 and attn.n_heads // attn.n_kv <= native.MAX_QUERY_GROUP)
        quantized_ok = [type(lin) in (Int4Linear, Int8Linear) and lin.padded_in == lin.in_features
                        and lin.compute_dtype == torch.bfloat16 and lin._native_ready() for lin in linears]
        float_ok = [lin is None or (type(lin) is nn.Linear and _native_float_weight(lin)) for lin in linears]
        if not plain or not all(q or f for q, f in zip(quantized_ok, float_ok)):
            return None
        qkv_bias = linears[0].bias  # Qwen2's is added in the kernel; no other linear may have one
        if (qkv_bias is not None and not (qkv_bias.dtype == torch.float32 and qkv_bias.is_contiguous())
                or any(lin is not None and lin.bias is not None for lin in linears[1:])):
            return None
        return linears


def _native_float_weight(linear: nn.Linear) -> bool:
    """Whether `native.f32_matmul` can read this plain linear's weight: float32, contiguous, on the CPU, K % 8 == 0."""
    w = linear._parameters["weight"]
    return (native.preferred() and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
            and w.shape[1] % 8 == 0)


class SandwichBlock(Block):
    """Gemma 2/3: each sublayer is normed on the way in and on the way out, before its output joins
    the residual stream. HF's names: post_attention_layernorm norms the attention's output here
    (not the MLP's input, as in `Block`), and the MLP has pre_/post_feedforward_layernorm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = rms_norm(cfg)
        self.post_feedforward_layernorm = rms_norm(cfg)

    def forward(self, x, cos, sin, attn, kv_cache=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class MTPLayer(Block):
    """One multi-token prediction depth (DeepSeek-V3, arXiv 2412.19437 §2.2): the previous depth's
    output h (the main model's final-normed hidden state for the first depth) and the embedding of
    the next token are each RMS-normed, concatenated as [embedding; hidden] and projected back to
    the model width (`eh_proj`), run through one decoder block of its own, and normed again
    (`shared_head.norm`) for the shared LM head. That normed output is also what the next depth
    reads, as transformers' `MtpModel` and SGLang chain the depths (vLLM chains the output before
    the norm; V3 ships one depth, where the two agree). Module names are those of V3's checkpoint
    layer `model.layers.{num_hidden_layers + depth}`; its block is a mixture of experts whenever
    the model has experts (layer 61 of V3 is).

    Layout: the depth reads slot p as (h of the previous depth at p - 1, token p) at RoPE position p,
    so its output at p predicts token p + 1, like the main model's, and its key/value at p depends
    on tokens 0..p only — a block of the engine's pool holds MTP entries that are a function of the
    block's tokens and prefix, like the model's own, so prefix sharing and copy-on-write hold. The
    first `depth + 1` slots have no previous hidden state and are never attended to."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__(cfg, depth, moe=cfg.num_experts > 0)  # depth: its layer in the MTP pool
        self.loss_weight = cfg.mtp_loss_weight  # λ of the training objective
        d = cfg.hidden_size
        self.enorm, self.hnorm = rms_norm(cfg), rms_norm(cfg)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = nn.ModuleDict({"norm": rms_norm(cfg)})  # the head itself is the model's

    def forward(self, embeds, prev, cos, sin, attn, kv_cache=None):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev)], dim=-1))
        return self.shared_head["norm"](super().forward(x, cos, sin, attn, kv_cache))


def mtp_chain_valid(document_ids: torch.Tensor | None, shape: torch.Size, depth: int) -> torch.Tensor:
    """(B, T) bool: slots of a dense batch where MTP depth `depth` (1-based) has a chain, i.e. the main
    model's hidden state `depth` positions back lies in the same row and document."""
    p = torch.arange(shape[1], device=document_ids.device if document_ids is not None else None)
    valid = (p >= depth).expand(shape)
    if document_ids is not None:
        back = document_ids[:, (p - depth).clamp(min=0)]
        valid = valid & (back == document_ids)
    return valid


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # A skeleton on the meta device (the loader's) skips the embedding's random init: meta
        # normal_ runs a Python decomposition that first imports torch._dynamo (0.8 s of start-up).
        skeleton = torch.empty(cfg.vocab_size, cfg.hidden_size) if torch.empty(0).is_meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=skeleton)
        block = SandwichBlock if cfg.sandwich_norm else Block
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.local_rotary = RotaryEmbedding(cfg, local=True) if cfg.rope_local_theta is not None else None
        self.mtp = nn.ModuleList(MTPLayer(cfg, k) for k in range(cfg.num_nextn_predict_layers))
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
        return self.norm(self.run_layers(self.embed(input_ids), positions, attn, kv_cache))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) → the residual stream's start (B, T, hidden)."""
        x = self.embed_tokens(input_ids)
        if self.cfg.scale_embeddings:  # × sqrt(hidden), first rounded to the activations' dtype as in HF
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)  # 0-dim: a scalar on any device
        return x

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                   attn: AttentionMetadata | None = None, kv_cache: PagedKVCache | None = None,
                   layers: slice = slice(None)) -> torch.Tensor:
        """The residual stream x (B, T, hidden) through `self.layers[layers]` (all by default; a
        pipeline stage runs its own slice), before the final norm; arguments as in `hidden_states`."""
        blocks = list(self.layers._modules.values())[layers]  # a ModuleList slice would build a new module per step
        windows = {layer.self_attn.window for layer in blocks}
        if isinstance(attn, PagedAttentionMetadata):
            if positions is None or kv_cache is None:
                raise ValueError("paged attention needs explicit positions and the PagedKVCache it describes")
            masks: dict[int | None, DenseMask | PagedAttentionMetadata] = dict.fromkeys(windows, attn)
        else:
            if kv_cache is not None:
                raise ValueError("a kv_cache is read through paged attention metadata (the engine builds it); "
                                 "a dense batch attends to itself")
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])
            meta = attn or DenseAttentionMetadata()
            masks = {window: meta.resolve(positions, window) for window in windows}  # one per window, not per layer
        ropes = {False: self.rotary(positions, x.dtype)}
        if self.local_rotary is not None:
            ropes[True] = self.local_rotary(positions, x.dtype)
        if isinstance(attn, PagedAttentionMetadata) and native.takes(x):
            out = self._decode_natively(blocks, x, ropes, attn, kv_cache)
            if out is not None:
                return out
        for layer in blocks:
            (cos, sin), mask = ropes[layer.local_rope], masks[layer.self_attn.window]
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache)
        return x

    def _decode_natively(self, blocks, x, ropes, meta: PagedAttentionMetadata, cache: PagedKVCache):
        """The blocks' all-decode step in one native call (`native.decode_layers`), or None where this step
        is not one (some sequence brings several tokens, a block is not of the kinds `Block._native_linears`
        takes, the blocks differ in window or rotary table, or the pool or the tables are not what the kernel
        reads): then the blocks run one by one."""
        first = blocks[0].self_attn if blocks else None
        if (first is None or x.dim() != 3 or x.shape[0] != 1 or not cache_native_ok(cache)
                or meta.slot_mapping.dtype != torch.int64):
            return None
        layers, eps, local = [], blocks[0].input_layernorm.eps, blocks[0].local_rope
        for block in blocks:  # every step: module dicts directly, as in Block._still_holds
            linears, mods = block._native_linears(), block._modules
            attn, ln1, ln2 = mods["self_attn"], mods["input_layernorm"], mods["post_attention_layernorm"]
            mlp = mods["mlp"]
            mixture = mlp._native_mixture() if type(mlp) is MoE else None
            if (linears is None or attn.window != first.window or block.local_rope != local or ln1.eps != eps
                    or mixture is None and type(mlp) is MoE):
                return None
            layers.append(((ln1._parameters["weight"], ln2._parameters["weight"]), linears, attn.layer_idx, mixture))
        dec = meta.decode_batch(cache.block_size, first.window)
        cos, sin = ropes[blocks[0].local_rope]
        n = x.shape[1]
        if (dec is None or dec.rows is not None or dec.block_tables.dtype != torch.int64
                or cos.shape != (1, n, 1, first.head_dim) or sin.shape != cos.shape or cos.dtype != torch.float32
                or not (cos.is_contiguous() and sin.is_contiguous())):
            return None
        from .quant import int4_block_rows

        out = x.clone()
        native.decode_layers(out, layers, eps, int4_block_rows(), cos, sin, cache.k, cache.v, meta.slot_mapping,
                             dec.block_tables, dec.lens_tensor(), meta.first_key, first.window,
                             (first.n_heads, first.n_kv, first.head_dim), first.scale, self.cfg.routed_scaling_factor)
        return out

    def hf_config(self) -> dict:
        """The config.json that `transformers` loads this model's checkpoint with."""
        return self.cfg.to_hf()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._capped(self.lm_head(hidden))

    def decode_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` for the engine's few rows of a step: a float32 output layer runs `native.f32_matmul`
        there (~2x MKL's sgemm on AVX2). Only the engine takes it: evaluations keep `logits`, whose result
        for a row does not depend on how many rows are scored with it. A subclass's own `logits` always runs."""
        head = self.lm_head
        few_rows = hidden.numel() <= native.F32_MAX_ROWS * hidden.shape[-1]
        if (type(self).logits is Transformer.logits and type(head) is nn.Linear and head.bias is None and few_rows
                and native.takes(hidden, head.weight) and _native_float_weight(head)):
            return self._capped(native.f32_matmul(hidden, head.weight))
        return self.logits(hidden)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionMetadata | None = None, kv_cache: PagedKVCache | None = None,
                logits_at: torch.Tensor | None = None, mtp: bool = False):
        """Logits (B, T, vocab) for every position; see `hidden_states` for the arguments.
        logits_at: flat indices into the B·T positions; then only their logits, (N, vocab): a
        loss on a few positions skips the output layer (a large share of a small model's
        compute) everywhere else.
        mtp: (training) also run the multi-token prediction depths; returns (logits, [each depth's
        (B, T, vocab) logits]), where depth k's at position p predict token p + 1 from the main
        model's hidden state at p - k and the tokens p - k + 1..p (`mtp_hidden_states`)."""
        hidden = self.hidden_states(input_ids, positions, attn, kv_cache)
        if mtp:
            if logits_at is not None or kv_cache is not None:
                raise ValueError("mtp=True is for training on whole sequences: no logits_at, no kv_cache")
            depths = self.mtp_hidden_states(input_ids, hidden, positions, attn)
            return self.logits(hidden), [self.logits(h) for h in depths]
        if logits_at is not None:
            hidden = hidden.flatten(0, 1)[logits_at]
        return self.logits(hidden)

    def mtp_hidden_states(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                          attn: DenseAttentionMetadata | None = None) -> list[torch.Tensor]:
        """Every multi-token prediction depth's output (B, T, hidden) over a dense batch, from the main
        model's final-normed `hidden`. Depth k reads each slot's previous-depth state one position
        back (`MTPLayer`); slots whose chain would reach before their document's (or row's) start
        attend only to themselves and are attended by none, so they leave the rest untouched."""
        if isinstance(attn, PagedAttentionMetadata) or (attn is not None and (
                attn.prefix_len is not None or attn.parent_ids is not None)):
            raise ValueError("multi-token prediction trains on causal rows of packed documents (document_ids, "
                             "key_padding); shared-prefix batches and the paged cache are not supported here")
        attn = attn or DenseAttentionMetadata()
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        outputs, h = [], hidden
        for k in range(len(self.mtp)):
            valid = mtp_chain_valid(attn.document_ids, input_ids.shape, k + 1)
            if attn.key_padding is not None:
                valid = valid & attn.key_padding
            meta = DenseAttentionMetadata(document_ids=attn.document_ids, key_padding=valid)
            h = self.mtp_step(k, input_ids, F.pad(h[:, :-1], (0, 0, 1, 0)), positions, meta)
            outputs.append(h)
        return outputs

    def mtp_step(self, depth: int, input_ids: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                 attn: DenseAttentionMetadata | PagedAttentionMetadata, kv_cache: PagedKVCache | None = None
                 ) -> torch.Tensor:
        """Multi-token prediction depth `depth` (0-based) over slots already aligned: prev[:, p] is the
        previous depth's output for the position before input_ids[:, p]. Dense batches attend under
        `attn`; the engine passes the MTP modules' own paged pool (one layer per depth) and metadata
        whose `first_key` hides the slots without a chain."""
        return self.draft_step(self.mtp[depth], input_ids, prev, positions, attn, kv_cache)

    def draft_step(self, layer: nn.Module, input_ids: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                   attn: DenseAttentionMetadata | PagedAttentionMetadata, kv_cache: PagedKVCache | None = None
                   ) -> torch.Tensor:
        """Run a drafting layer that reads (this model's embedding of token p, a hidden state for p - 1)
        at RoPE position p: an MTP depth, or an EAGLE head (`draft_heads.EagleHead`)."""
        cos, sin = self.rotary(positions, prev.dtype)
        mask = attn if isinstance(attn, PagedAttentionMetadata) else attn.resolve(positions, layer.self_attn.window)
        return layer(self.embed_tokens(input_ids), prev, cos, sin, mask, kv_cache)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) for matrices, ones for norms (zeros where the norm scales by 1 + weight),
        zeros for biases (GPT-2 / Llama recipe)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if self.cfg.rms_norm_unit_offset else 1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
