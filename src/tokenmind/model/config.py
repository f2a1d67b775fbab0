"""`ModelConfig`: the one description of a decoder-only Transformer, and its mapping to HF `config.json`.

Every supported family (Llama, Mistral, Qwen2, Qwen3, SmolLM; the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE) is the same network with a few switches, so the switches live here and
the `Transformer` reads only this dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
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
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)  # HF keys we carry through unchanged

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
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
        if self.num_experts:
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                 f"num_experts={self.num_experts}")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (Qwen2-MoE's sparse step and dense-only layers)."""
        return (self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
                and i not in self.mlp_only_layers)

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once), for MFU and reports."""
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        attn += ((h + 2 * kv) * hd if self.qkv_bias else 0) + (d if self.o_bias else 0)
        moe = (self.num_experts * (3 * d * (self.moe_intermediate_size or 0) + d)
               + (3 * self.shared_expert_intermediate_size * d + d if self.shared_expert_intermediate_size else 0))
        dense = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d if self.mlp_bias else 0)
        mlps = sum(moe if self.is_moe_layer(i) else dense
                   for i in range(self.num_hidden_layers))
        norms = 2 * d + (2 * hd if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + norms) + mlps + emb + d

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
            "transformers_version", "hidden_act", "num_local_experts", "qkv_bias",
        }
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        return cls(
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
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            model_type=model_type,
            extra={k: v for k, v in hf.items() if k not in known},
            **_moe_from_hf(hf, model_type),
        )

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
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "qwen2_moe":
            hf["qkv_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
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
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                hf[name] = getattr(self, name)
        return hf


def _moe_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json ({} for dense
    families). HF's defaults differ by family: Mixtral always renormalises the top-k, Qwen's only
    with norm_topk_prob; only Qwen2-MoE has a shared expert."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
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
