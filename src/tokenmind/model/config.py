"""`ModelConfig`: the one description of a decoder-only Transformer, and its mapping to HF `config.json`.

Every supported family (Llama, Mistral, Qwen2, Qwen3, SmolLM, Gemma 2, Gemma 3; the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, and DeepSeek-V2/V3 with multi-head latent attention
and V3's multi-token prediction) is the same network with a few switches, so the switches live
here and the `Transformer` reads only this dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                         "deepseek_v2", "deepseek_v3", "gemma2", "gemma3_text")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


@dataclass
class ModelConfig:
    """Sizes and switches of a decoder-only Transformer. Field names follow HF `config.json`."""

    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None → same as num_attention_heads (MHA); 1 → MQA
    head_dim: int | None = None  # None → hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"dynamic"|"yarn"|"llama3", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    qk_norm_per_head: bool = True  # False (OLMoE): one RMSNorm over all heads of q, and one over all of k
    clip_qkv: float | None = None  # OLMoE: clamp q, k and v to [-clip, clip]
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    attn_logit_softcapping: float | None = None  # scores → cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    # Mixture of experts (num_experts > 0): each token's MLP is the weighted sum of its
    # num_experts_per_tok best-scoring experts (of moe_intermediate_size; None → intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True  # renormalise the chosen experts' probabilities to sum to 1 (Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    decoder_sparse_step: int = 1  # layers i with (i + 1) % step == 0 are MoE, the rest dense ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and these are dense regardless
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in training
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (ST-MoE): keeps router logits small
    # DeepSeek routing: scores by softmax or sigmoid; "greedy" top-k, or first the topk_group best of
    # n_group expert groups ("group_limited_greedy": a group's score is its best expert, V2;
    # "noaux_tc": sigmoid scores plus a per-expert bias that only steers the choice, a group's score
    # its best two, V3); chosen weights times routed_scaling_factor; n_shared_experts always-on experts
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # the first k layers keep a dense MLP
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing: bias step per training step (noaux_tc)
    # Multi-head latent attention (kv_lora_rank > 0, DeepSeek): keys and values are expanded per head
    # from a kv_lora_rank latent plus one shared qk_rope_head_dim RoPE key, and only those are cached
    q_lora_rank: int | None = None  # queries through a low-rank bottleneck; None → one q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek)
    # Gemma 2 / 3 (the family's fixed traits are the properties sandwich_norm, scale_embeddings, rms_norm_unit_offset)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: int | None = None  # attention scores scaled by this ** -0.5 (None → head_dim ** -0.5)
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention"; None → all slide
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers, unscaled (None → 10000)
    # Multi-token prediction (DeepSeek-V3): D extra depths after the model, depth k predicting the token
    # k + 1 ahead; trained with weight mtp_loss_weight (the paper's λ: 0.3, later 0.1), and at inference
    # the engine's `--speculative mtp` drafter. Not counted in num_parameters (as V3's 671B leaves them out).
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.3
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)  # HF keys we carry through unchanged

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.kv_lora_rank:
            self.head_dim = self.qk_rope_head_dim  # the rotary part is what RoPE sees (as in transformers)
            if not (self.qk_rope_head_dim > 0 and self.qk_nope_head_dim > 0 and self.v_head_dim > 0):
                raise ValueError("multi-head latent attention (kv_lora_rank > 0) needs positive qk_rope_head_dim, "
                                 "qk_nope_head_dim and v_head_dim")
            if self.num_key_value_heads not in (None, self.num_attention_heads):
                raise ValueError("multi-head latent attention expands keys and values for every head: set "
                                 f"num_key_value_heads to num_attention_heads={self.num_attention_heads} "
                                 "(or leave it unset)")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention shares each "
                "key/value head across an equal group of query heads)"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
            self.rope_scaling = {**self.rope_scaling, "rope_type": rope_type}
            self.rope_scaling.pop("type", None)
            self.rope_scaling.pop("rope_theta", None)
            if rope_type == "default":
                self.rope_scaling = None
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.model_type == "deepseek_v2":
            self.norm_topk_prob = False  # transformers' DeepSeek-V2 never renormalises the top-k weights
        if self.num_experts:
            if self.model_type in ("mixtral", "olmoe") \
                    and self.moe_intermediate_size not in (None, self.intermediate_size):
                raise ValueError(f"{self.model_type}'s experts are intermediate_size wide (its config.json has no "
                                 "moe_intermediate_size): set intermediate_size to the expert width instead")
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                 f"num_experts={self.num_experts}")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")
            if self.topk_method not in TOPK_METHODS:
                raise ValueError(f"unsupported topk_method {self.topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                                 f"topk_group={self.topk_group} be between 1 and n_group")
            if self.router_bias_update_rate and self.topk_method != "noaux_tc":
                raise ValueError("router_bias_update_rate (auxiliary-loss-free balancing) steers the per-expert "
                                 "bias of topk_method='noaux_tc' routing; set topk_method='noaux_tc'")
            if self.hidden_act != "silu":
                raise ValueError(f"hidden_act={self.hidden_act!r}: a mixture's experts are SwiGLU MLPs; use 'silu'")
        if self.num_nextn_predict_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError(f"num_nextn_predict_layers ({self.num_nextn_predict_layers}) and mtp_loss_weight "
                             f"({self.mtp_loss_weight}) must be >= 0")
        if self.num_nextn_predict_layers and self.model_type != "deepseek_v3":
            raise ValueError("multi-token prediction modules (num_nextn_predict_layers) follow DeepSeek-V3's "
                             "architecture and checkpoint layout; set model_type='deepseek_v3' or "
                             "num_nextn_predict_layers=0")
        self._check_gemma_fields()

    def _check_gemma_fields(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}")
        if self.layer_types is not None:
            if self.model_type not in GEMMA_MODEL_TYPES:
                raise ValueError(f"layer_types (local and global layers) is Gemma's; model_type {self.model_type!r} "
                                 "slides every layer when sliding_window is set")
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                                 f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if self.model_type == "gemma3_text":
            if self.attn_logit_softcapping is not None:
                raise ValueError("transformers' Gemma 3 does not soft-cap attention scores: leave "
                                 "attn_logit_softcapping unset for gemma3_text (final_logit_softcapping is applied)")
            if self.rope_local_theta is None:
                self.rope_local_theta = 10_000.0  # transformers' default rope_local_base_freq
        elif self.rope_local_theta is not None:
            raise ValueError(f"rope_local_theta is Gemma 3's local RoPE base; model_type {self.model_type!r} has one "
                             "RoPE for all layers (set rope_theta)")

    def is_sliding_layer(self, i: int) -> bool:
        """Whether layer i is a local one: attends through the sliding window (when there is one) and,
        in Gemma 3, rotates by the local RoPE. Gemma alternates local and global layers (layer_types)."""
        return self.layer_types is None or self.layer_types[i] == "sliding_attention"

    @property
    def sandwich_norm(self) -> bool:
        """Gemma 2/3: besides the pre-norms, each sublayer's output is normed before it joins the
        residual stream (post-attention, post-feedforward), and the MLP has its own pre-norm."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def scale_embeddings(self) -> bool:
        """Gemma: token embeddings are multiplied by sqrt(hidden_size) (the tied LM head is not)."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def rms_norm_unit_offset(self) -> bool:
        """Gemma: RMSNorm scales by (1 + weight), so its weights are stored (and initialised) around 0."""
        return self.model_type in GEMMA_MODEL_TYPES

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (Qwen2-MoE's sparse step and dense-only layers)."""
        return (self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
                and i not in self.mlp_only_layers and i >= self.first_k_dense_replace)

    @property
    def shared_experts_intermediate_size(self) -> int:
        """Width of the always-on expert MLP: Qwen2-MoE's gated one or DeepSeek's n_shared_experts."""
        return self.shared_expert_intermediate_size or self.n_shared_experts * (self.moe_intermediate_size or 0)

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: head_dim, or under MLA the no-RoPE part plus the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    def kv_cache_entry(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of one cached token in one layer. Multi-head latent attention
        caches one entry, the normed latent followed by the RoPE key, whose first kv_lora_rank values
        double as the value: its value width counts no extra memory (see `PagedKVCache`)."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_key_value_heads, self.head_dim, self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once), for MFU and reports."""
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if self.kv_lora_rank:
            attn = self._mla_parameters
        else:
            attn = d * h * hd * 2 + d * kv * hd * 2
            attn += ((h + 2 * kv) * hd if self.qkv_bias else 0) + (d if self.o_bias else 0)
        shared = self.shared_experts_intermediate_size
        moe = (self.num_experts * (3 * d * (self.moe_intermediate_size or 0) + d)
               + (3 * shared * d if shared else 0) + (d if self.shared_expert_intermediate_size else 0))
        dense = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d if self.mlp_bias else 0)
        mlps = sum(moe if self.is_moe_layer(i) else dense
                   for i in range(self.num_hidden_layers))
        qk_norms = 0 if not self.qk_norm else 2 * hd if self.qk_norm_per_head else (h + kv) * hd
        norms = (4 if self.sandwich_norm else 2) * d + qk_norms
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + norms) + mlps + emb + d

    @property
    def _mla_parameters(self) -> int:
        d, h, rank, rope = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim
        bias = self.qkv_bias
        q_out = h * self.qk_head_dim
        q = d * q_out if self.q_lora_rank is None else \
            d * self.q_lora_rank + (self.q_lora_rank if bias else 0) + self.q_lora_rank + self.q_lora_rank * q_out
        kv = d * (rank + rope) + (rank + rope if bias else 0) + rank
        kv += rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d + (d if self.o_bias else 0)

    @property
    def num_active_parameters(self) -> int:
        """Parameters a token passes through: a mixture of experts counts only its top-k experts (the N of
        the 6·N FLOPs per trained token); equal to num_parameters for a dense model."""
        if not self.num_experts:
            return self.num_parameters
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_parameters - idle * sum(map(self.is_moe_layer, range(self.num_hidden_layers)))

    # ---- Hugging Face config.json ----------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a HF `config.json` dict (both the v4 `rope_scaling` and v5 `rope_parameters` forms)."""
        model_type = hf.get("model_type")
        if model_type == "bert":
            raise ValueError("this config.json describes a BERT encoder, not a causal LM: load it with "
                             "tokenmind.model.encoder.load_encoder (sentence embeddings)")
        if model_type == "gemma3":
            raise ValueError("this config.json is Gemma 3's multimodal model (Gemma3ForConditionalGeneration); "
                             "tokenmind loads the text-only gemma3_text checkpoints (Gemma3ForCausalLM)")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json is missing required keys: {', '.join(missing)}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        bias = bool(hf.get("attention_bias", False))
        sliding = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not hf.get("use_sliding_window", False):
            sliding = None
        known = {f.name for f in dataclasses.fields(cls)} | {
            "rope_parameters", "attention_bias", "use_sliding_window", "architectures", "torch_dtype", "dtype",
            "transformers_version", "hidden_act", "num_local_experts", "qkv_bias", "n_routed_experts",
            "hidden_activation", "rope_local_base_freq", "sliding_window_pattern", "num_mtp_layers",
        }
        if model_type not in GEMMA_MODEL_TYPES:
            known.discard("layer_types")  # other families' ride along in `extra` (transformers derives them)
        act = (hf.get("hidden_activation", "gelu_pytorch_tanh") if model_type in GEMMA_MODEL_TYPES
               else hf.get("hidden_act", "silu"))
        if act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {act!r} in config.json; supported: {', '.join(HIDDEN_ACTS)}")
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope or None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=hf.get("qkv_bias", True) if model_type in ("qwen2", "qwen2_moe") else bias,
            o_bias=False if model_type in ("qwen2", "qwen2_moe") else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe", "gemma3_text"),
            qk_norm_per_head=model_type != "olmoe",
            clip_qkv=hf.get("clip_qkv"),
            sliding_window=sliding,
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            model_type=model_type,
            extra={k: v for k, v in hf.items() if k not in known},
            hidden_act=act,
            **_moe_from_hf(hf, model_type),
            **_mla_from_hf(hf, model_type),
            **_mtp_from_hf(hf, model_type),
        )
        return cls(**{**fields, **_gemma_from_hf(hf, model_type)})

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that `transformers` loads into the matching *ForCausalLM class."""
        hf: dict[str, Any] = {
            **self.extra,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "torch_dtype": "float32",
        }
        if self.model_type in ("llama", "qwen3", "qwen3_moe", "olmoe", *DEEPSEEK_MODEL_TYPES):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "qwen2_moe":
            hf["qkv_bias"] = self.qkv_bias
        if self.model_type in ("llama", "deepseek_v2"):
            hf["mlp_bias"] = self.mlp_bias
        if self.clip_qkv is not None:
            hf["clip_qkv"] = self.clip_qkv
        if self.model_type == "mistral" or self.sliding_window is not None:
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            hf["use_sliding_window"] = self.sliding_window is not None
        if self.num_experts and self.router_z_loss_coef:
            hf["router_z_loss_coef"] = self.router_z_loss_coef  # ours: transformers carries it through
        if self.model_type == "mixtral":
            hf.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      router_aux_loss_coef=self.router_aux_loss_coef)
        elif self.model_type in ("qwen2_moe", "qwen3_moe"):
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                      router_aux_loss_coef=self.router_aux_loss_coef)
            if self.model_type == "qwen2_moe":
                hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        elif self.model_type == "olmoe":
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      norm_topk_prob=self.norm_topk_prob, router_aux_loss_coef=self.router_aux_loss_coef)
        elif self.model_type in DEEPSEEK_MODEL_TYPES:
            hf.update(n_routed_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, n_shared_experts=self.n_shared_experts,
                      first_k_dense_replace=self.first_k_dense_replace, norm_topk_prob=self.norm_topk_prob,
                      routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
                      topk_group=self.topk_group, kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
                      qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                      v_head_dim=self.v_head_dim)
            if self.model_type == "deepseek_v2":
                hf["topk_method"] = self.topk_method
            else:  # written even when 0: transformers' default is 1
                hf.update(rope_interleave=self.rope_interleave, num_nextn_predict_layers=self.num_nextn_predict_layers)
                if self.num_nextn_predict_layers:
                    hf["mtp_loss_weight"] = self.mtp_loss_weight  # ours, carried through
            if self.router_bias_update_rate:
                hf["router_bias_update_rate"] = self.router_bias_update_rate  # ours, carried through
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                hf[name] = getattr(self, name)
        if self.model_type in GEMMA_MODEL_TYPES:
            hf.update(_gemma_to_hf(self))
        return hf


def _moe_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json ({} for dense
    families). HF's defaults differ by family: Mixtral always renormalises the top-k, Qwen's only
    with norm_topk_prob; only Qwen2-MoE has a shared expert."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if model_type == "olmoe":
        return {"num_experts": hf.get("num_experts", 64), "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
                "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
                "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.01),
                "router_z_loss_coef": hf.get("router_z_loss_coef", 0.0)}
    if model_type in DEEPSEEK_MODEL_TYPES:
        v3 = model_type == "deepseek_v3"
        return {"num_experts": hf.get("n_routed_experts", 256 if v3 else 64),
                "num_experts_per_tok": hf.get("num_experts_per_tok") or 8,
                "moe_intermediate_size": hf.get("moe_intermediate_size", 2048 if v3 else 1407),
                "n_shared_experts": hf.get("n_shared_experts") or 0,
                "first_k_dense_replace": hf.get("first_k_dense_replace") or 0,
                "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
                "routed_scaling_factor": float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
                "scoring_func": "sigmoid" if v3 else "softmax",
                "topk_method": "noaux_tc" if v3 else hf.get("topk_method") or "greedy",
                "n_group": hf.get("n_group") or 1, "topk_group": hf.get("topk_group") or 1,
                "router_bias_update_rate": hf.get("router_bias_update_rate", 0.0),
                "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.0),
                "router_z_loss_coef": hf.get("router_z_loss_coef", 0.0)}
    if model_type == "mixtral":
        return {"num_experts": hf.get("num_local_experts", 8), "num_experts_per_tok": hf.get("num_experts_per_tok", 2),
                "norm_topk_prob": True, "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
                "router_z_loss_coef": hf.get("router_z_loss_coef", 0.0)}
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts (num_experts is its alias)
    out = {"num_experts": hf.get("num_experts", hf.get("num_local_experts", 60 if model_type == "qwen2_moe" else 128)),
           "num_experts_per_tok": hf.get("num_experts_per_tok", 4 if model_type == "qwen2_moe" else 8),
           "moe_intermediate_size": hf.get("moe_intermediate_size", 1408 if model_type == "qwen2_moe" else 768),
           "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
           "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
           "mlp_only_layers": list(hf.get("mlp_only_layers") or []),
           "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
           "router_z_loss_coef": hf.get("router_z_loss_coef", 0.0)}
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size", 5632)
    return out


def _mtp_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """DeepSeek-V3's multi-token prediction depths ({} otherwise). transformers writes
    `num_nextn_predict_layers` (its alias `num_mtp_layers` is read too) and defaults it to 1 even for
    checkpoints without those weights; the loader then drops them (`checkpoint.build_model`)."""
    if model_type != "deepseek_v3":
        return {}
    return {"num_nextn_predict_layers": int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0),
            "mtp_loss_weight": float(hf.get("mtp_loss_weight", 0.3))}


def _mla_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The multi-head latent attention fields of a DeepSeek-V2/V3 config.json ({} otherwise). V2's
    complex-number RoPE rotates adjacent pairs, which is V3's rope_interleave."""
    if model_type not in DEEPSEEK_MODEL_TYPES:
        return {}
    return {"kv_lora_rank": hf.get("kv_lora_rank", 512), "q_lora_rank": hf.get("q_lora_rank", 1536),
            "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128), "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
            "v_head_dim": hf.get("v_head_dim") or 128,
            "rope_interleave": bool(hf.get("rope_interleave", True)) if model_type == "deepseek_v3" else True}
def _gemma_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 fields of a config.json ({} for other families), with the defaults of
    transformers' config classes for keys it leaves out (soft-capping on in Gemma 2, tied
    embeddings, a 4096-token window, head_dim 256). Gemma 3's RoPE comes per layer type: the v5
    `rope_parameters` {"full_attention": ..., "sliding_attention": ...}, or the v4 `rope_theta` +
    `rope_scaling` (global layers) and `rope_local_base_freq` (local layers)."""
    if model_type not in GEMMA_MODEL_TYPES:
        return {}
    if hf.get("use_bidirectional_attention"):
        raise ValueError("this config.json sets use_bidirectional_attention (an embedding model, not a causal LM); "
                         "tokenmind runs Gemma as a causal decoder only")
    n = hf["num_hidden_layers"]
    pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
    out = {"head_dim": hf.get("head_dim", 256), "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
           "max_position_embeddings": hf.get("max_position_embeddings", 8192 if model_type == "gemma2" else 131_072),
           "sliding_window": hf.get("sliding_window", 4096),
           "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
           "layer_types": hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                                     for i in range(n)],
           "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
           # transformers' Gemma 3 attention never applies attn_logit_softcapping, whatever the config says
           "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None}
    if model_type == "gemma3_text":
        rope = hf.get("rope_parameters") or {}
        if "full_attention" in rope or "sliding_attention" in rope:
            glob = dict(rope.get("full_attention") or {})
            local = dict(rope.get("sliding_attention") or {})
        else:
            glob = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
            local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported RoPE type {local['rope_type']!r} for Gemma 3's sliding layers; only "
                             "'default' (rope_local_base_freq) is supported there")
        out.update(rope_theta=float(glob.get("rope_theta", 1_000_000.0)), rope_scaling=glob,
                   rope_local_theta=float(local.get("rope_theta", 10_000.0)))
    return out


def _gemma_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Gemma keys of config.json. Soft-capping is written even when off: transformers' Gemma 2
    turns it on when the key is missing."""
    hf = {"hidden_activation": cfg.hidden_act, "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
          "layer_types": cfg.layer_types or ["sliding_attention"] * cfg.num_hidden_layers,
          "sliding_window": cfg.sliding_window, "attention_bias": cfg.qkv_bias,
          "attn_logit_softcapping": cfg.attn_logit_softcapping,
          "final_logit_softcapping": cfg.final_logit_softcapping}
    if cfg.model_type == "gemma3_text":
        hf["rope_local_base_freq"] = cfg.rope_local_theta
    return hf
