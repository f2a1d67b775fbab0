"""Read GGUF files (llama.cpp's format): metadata, the embedded tokenizer, dequantized tensors.

A GGUF file speaks llama.cpp's dialect: its own metadata keys, its own tensor names, for the
llama family q/k projection rows permuted for llama.cpp's interleaved RoPE, and for Gemma norm
weights stored with 1 added (llama.cpp scales by the weight, HF by 1 + weight) and settings it
derives rather than stores (layer pattern, attention scale). This module translates all of it to
Hugging Face conventions (a `config.json` dict, HF parameter names, HF row layout), so
the rest of tokenmind never needs to know a checkpoint came from a GGUF file.

Mixtures of experts (Mixtral, which llama.cpp writes as a "llama" file with `llama.expert_count`,
Qwen2-MoE, Qwen3-MoE) keep each layer's experts in 3-D slabs, one (rows, cols) matrix per expert:
numpy shape (E, I, H) for `ffn_gate_exps` / `ffn_up_exps` and (E, H, I) for `ffn_down_exps` (GGUF
lists dimensions fastest first, so the header says (H, I, E)). transformers 5 holds the same
slabs, with gate and up joined along each expert's rows into `mlp.experts.gate_up_proj` (E, 2I, H).

Tensors stay memory-mapped: `read_gguf` only parses the header, and dequantization happens when
`load_state_dict` (everything, fp32) or `raw_tensor` (one tensor, still quantized) asks for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..tokenizer.gguf_backend import GGUFTokenizer
from .gguf_format import GGUFByteOrderError, GGUFFile, GGUFFormatError, GGUFTensor, read_gguf_file

# GGUF `general.architecture` -> (HF model_type, HF class, are q/k rows permuted?). llama.cpp's
# converter permutes q/k only for the llama family (Mistral GGUFs are written as "llama" too).
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("mistral", "MistralForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
}
# Gemma in llama.cpp: every `*norm.weight` is stored as 1 + HF's weight; every `pattern`-th layer is
# global, the rest local (sliding); the layer count of the 27B model, whose attention scale is
# 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim) (llama.cpp's llama-model.cpp).
_GEMMA = {"gemma2": {"pattern": 2, "layers_27b": 46}, "gemma3": {"pattern": 6, "layers_27b": 62}}
_MIXTRAL = ("mixtral", "MixtralForCausalLM", True)  # a "llama" file with experts, permuted like llama
# Whether llama.cpp renormalises the chosen experts' weights to sum to 1 (its build_moe_ffn `norm_w`,
# fixed per architecture; a `{arch}.expert_weights_norm` key overrides it). Mixtral always does.
_NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
_SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX, llama.cpp's default for these families

# The types whose `gguf.quants.dequantize` output tests/test_gguf.py checks against a reference.
SUPPORTED_QUANT_TYPES = frozenset(
    GGMLQuantizationType[name] for name in "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K".split()
)

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router (E, H)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Expert slabs: transformers 5 names the parameter itself (no `.weight`), and its gate_up_proj is
# ffn_gate_exps then ffn_up_exps along each expert's rows: GGUF name -> (HF name, place in it).
_EXPERT_NAMES = {
    "ffn_gate_exps": ("mlp.experts.gate_up_proj", 0),
    "ffn_up_exps": ("mlp.experts.gate_up_proj", 1),
    "ffn_down_exps": ("mlp.experts.down_proj", 0),
}
_GEMMA_BLOCK_NAMES = {  # Gemma's four norms a block: ffn_norm is the MLP's pre-norm there
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
_PER_EXPERT_NAME = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")  # older conversions: one per expert


class GGUFError(ValueError):
    """A file that is not a GGUF file, is damaged, or holds something this reader cannot translate."""


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, translated to Hugging Face conventions."""

    path: Path
    architecture: str  # GGUF `general.architecture`, e.g. "llama"
    config: dict  # a Hugging Face `config.json` dict (model_type, hidden_size, ...)
    tokenizer: GGUFTokenizer
    metadata: dict = field(default_factory=dict, repr=False)  # every GGUF key, decoded
    # HF name -> the GGUF tensor(s) it is made of: one, or an expert gate_up_proj's gate and up slabs
    _tensors: dict[str, tuple[GGUFTensor, ...]] = field(default_factory=dict, repr=False)

    @property
    def tensor_names(self) -> list[str]:
        """HF names of the tensors in the file, in file order."""
        return list(self._tensors)

    def raw_tensor(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        """One tensor as stored (quantized blocks, or floats), for kernels that consume blocks directly.

        Returns (data, type, torch_shape). `data` is what `gguf.quants.dequantize(data, type)` takes:
        one row per output row, `torch_shape[:-1]` rows ((E, rows) for an expert slab). q/k rows come
        back in HF order already: a quantization block never spans two rows, so permuting (or
        joining) rows of raw blocks is exact. Unpermuted single tensors are zero-copy, read-only
        views of the memory-mapped file. An expert gate_up_proj whose gate and up slabs are stored
        in different types has no one raw form: GGUFError (`tensor` still dequantizes it). Gemma's
        norm weights come back as stored (llama.cpp's 1 + weight); `tensor` gives HF's.
        """
        parts = [self._raw_part(name, t) for t in self._parts(name)]
        if len(parts) == 1:
            return parts[0]
        types = {qtype for _, qtype, _ in parts}
        if len(types) > 1:
            stored = " and ".join(f"{t.name} ({t.tensor_type.name})" for t in self._tensors[name])
            raise GGUFError(f"{self.path}: {name} joins {stored}; blocks of different types cannot be joined "
                            "raw (use .tensor(name) for its float values)")
        shapes = [shape for *_, shape in parts]
        joined = (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1])
        return np.concatenate([data for data, _, _ in parts], axis=-2), types.pop(), joined

    def load_state_dict(self, progress: bool = False, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to a float32 torch tensor, with HF names, shapes and row order.
        Tensors named in `skip` come back as meta placeholders of the right shape: a quantized load
        takes them from their blocks instead (`quant.gguf_block_tensors`), so dequantizing is wasted."""
        names = self.tensor_names
        if progress:
            from rich.progress import track

            names = track(names, description=f"Dequantizing {self.path.name}", transient=True)
        return {name: torch.empty(self.raw_tensor(name)[2], device="meta") if name in skip else self.tensor(name)
                for name in names}

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor (HF name) dequantized to float32, in HF shape and row order."""
        values = [self._dequantize(name, t, *self._raw_part(name, t)) for t in self._parts(name)]
        return values[0] if len(values) == 1 else torch.cat(values, dim=-2)

    def _parts(self, name: str) -> tuple[GGUFTensor, ...]:
        if name not in self._tensors:
            raise KeyError(f"{self.path}: no tensor {name!r} (HF name); see .tensor_names")
        return self._tensors[name]

    def _raw_part(self, name: str, t: GGUFTensor) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        """One GGUF tensor's raw data in HF row order and shape."""
        data, shape = t.data, tuple(reversed(t.shape))
        if name.endswith(".shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp squeezes HF's (1, H)
            data, shape = data.reshape(1, -1), (1, *shape)
        n_heads = self._permuted_heads(name)
        if n_heads is not None:
            data = _unpermute_rows(data, n_heads)
        return data, t.tensor_type, shape

    def _dequantize(self, name: str, t: GGUFTensor, data: np.ndarray, qtype: GGMLQuantizationType,
                    shape: tuple[int, ...]) -> torch.Tensor:
        if qtype not in SUPPORTED_QUANT_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_QUANT_TYPES))
            raise GGUFError(f"{self.path}: tensor {t.name!r} ({name}) is {qtype.name}, which cannot be dequantized; "
                            f"supported types: {supported}")
        values = dequantize(data, qtype)
        if self.architecture in _GEMMA and name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # llama.cpp stored 1 + weight (a new array: the map stays read-only)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
            values = np.array(values)
        return torch.from_numpy(values.reshape(shape))

    def _permuted_heads(self, name: str) -> int | None:
        """How many heads llama.cpp permuted this tensor's rows over, or None if it did not."""
        if not _ARCHITECTURES[self.architecture][2]:
            return None
        if ".self_attn.q_proj." in name:
            return self.config["num_attention_heads"]
        if ".self_attn.k_proj." in name:
            return self.config["num_key_value_heads"]
        return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    HF's rotary embedding rotates the two halves of each head (rotate_half); llama.cpp rotates
    adjacent pairs. Its converter therefore reorders each head's rows from [x0..x_{h/2-1}, y0..] to
    [x0, y0, x1, y1, ...]: `w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2)`.
    The inverse splits the pairs back out: reshape to (n_heads, head_dim // 2, 2) and swap back.
    """
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str) -> tuple[str, int] | None:
    """(HF name, place among the GGUF tensors joined in it) of a GGUF tensor name, or None."""
    match = _TENSOR_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    block, base, kind = match.groups()
    if block is None:
        hf = _TOP_LEVEL_NAMES.get(base)
        return None if hf is None else (f"{hf}.{kind}", 0)
    if base in _EXPERT_NAMES and kind == "weight":
        hf, place = _EXPERT_NAMES[base]
        return f"model.layers.{block}.{hf}", place
    hf = (_BLOCK_NAMES | _GEMMA_BLOCK_NAMES if arch in _GEMMA else _BLOCK_NAMES).get(base)
    return None if hf is None else (f"model.layers.{block}.{hf}.{kind}", 0)


def _open(path: Path) -> GGUFFile:
    """Parse the container, turning its ways of failing on damaged input into one GGUFError."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return read_gguf_file(path)
    except GGUFByteOrderError as e:
        raise GGUFError(f"{path} is byte-swapped (written for the other endianness); not supported") from e
    except GGUFFormatError as e:
        raise GGUFError(f"{path} is truncated or corrupt ({e})") from e


def _require(meta: dict, key: str, path: Path) -> object:
    if key not in meta:
        raise GGUFError(f"{path}: required metadata key {key!r} is missing")
    return meta[key]


def _read_tokenizer(meta: dict, path: Path) -> GGUFTokenizer:
    p = "tokenizer.ggml."
    model = _require(meta, p + "model", path)
    tokens = _require(meta, p + "tokens", path)
    fields = ["model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id",
              "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token"]  # fmt: skip
    used = {p + f for f in fields} | {"tokenizer.chat_template"}
    return GGUFTokenizer(
        model=model,
        pre=meta.get(p + "pre"),
        tokens=tokens,
        token_types=meta.get(p + "token_type", [1] * len(tokens)),
        merges=meta.get(p + "merges", []),
        scores=meta.get(p + "scores"),
        bos_token_id=meta.get(p + "bos_token_id"),
        eos_token_id=meta.get(p + "eos_token_id"),
        unk_token_id=meta.get(p + "unknown_token_id"),
        pad_token_id=meta.get(p + "padding_token_id"),
        # The usual llama.cpp default when the key is absent: SentencePiece vocabularies add BOS.
        add_bos_token=meta.get(p + "add_bos_token", model == "llama"),
        add_eos_token=meta.get(p + "add_eos_token", False),
        chat_template=meta.get("tokenizer.chat_template"),
        extra={k: v for k, v in meta.items() if k.startswith("tokenizer.") and k not in used},
    )


def _rope_scaling(meta: dict, arch: str, path: Path) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # the key before rope.scaling.* existed
        return {"rope_type": "linear", "factor": meta[f"{arch}.rope.scale_linear"]}
    if kind in (None, "none"):
        return None
    factor = _require(meta, f"{arch}.rope.scaling.factor", path)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _require(meta, f"{arch}.rope.scaling.original_context_length", path)
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for gguf_key, hf_key in [("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")]:
            if f"{arch}.rope.scaling.{gguf_key}" in meta:
                scaling[hf_key] = meta[f"{arch}.rope.scaling.{gguf_key}"]
        return scaling
    raise GGUFError(f"{path}: unsupported RoPE scaling type {kind!r} (supported: linear, yarn)")


def _build_config(meta: dict, arch: str, model_type: str, shapes: dict[str, tuple[int, ...]],
                  tokenizer: GGUFTokenizer, path: Path) -> dict:
    """The HF config.json of the file; `shapes` maps its GGUF tensor names to their GGUF shapes."""
    def req(key):
        return _require(meta, f"{arch}.{key}", path)

    hidden, heads = req("embedding_length"), req("attention.head_count")
    config = {
        "model_type": model_type,
        "architectures": [_MIXTRAL[1] if model_type == "mixtral" else _ARCHITECTURES[arch][1]],
        "vocab_size": meta.get(f"{arch}.vocab_size", len(tokenizer.tokens)),
        "hidden_size": hidden,
        "intermediate_size": req("feed_forward_length"),
        "num_hidden_layers": req("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": req("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),  # llama.cpp's default
        "max_position_embeddings": req("context_length"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
    }
    if model_type == "qwen2_moe":  # its config calls the q/k/v biases qkv_bias
        config["qkv_bias"] = config["attention_bias"]
    if model_type in _NORM_TOPK:
        config.update(_moe_config(meta, arch, model_type, shapes, config["num_hidden_layers"], path))
    rope_scaling = _rope_scaling(meta, arch, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if f"{arch}.attention.sliding_window" in meta:
        config["sliding_window"] = meta[f"{arch}.attention.sliding_window"]
    if arch in _GEMMA:
        config.update(_gemma_config(meta, arch, config, path))
    return config


def _gemma_config(meta: dict, arch: str, config: dict, path: Path) -> dict:
    """The Gemma keys of config.json, from the metadata llama.cpp writes and the settings it derives:
    the local/global layer pattern (or `attention.sliding_window_pattern` where a file has it), the
    attention scale, Gemma 2's default soft-caps (50, 30) and window (4096), Gemma 3's local RoPE
    base (10000 unless `rope.freq_base_swa`)."""
    n, gemma = config["num_hidden_layers"], _GEMMA[arch]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", gemma["pattern"])
    sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(n)]
    if len(sliding) != n:
        raise GGUFError(f"{path}: {arch}.attention.sliding_window_pattern has {len(sliding)} entries for {n} layers")
    big = n == gemma["layers_27b"]
    out = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"],
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping", 50.0)
        out["sliding_window"] = meta.get(f"{arch}.attention.sliding_window", 4096)
    else:
        out["sliding_window"] = _require(meta, f"{arch}.attention.sliding_window", path)
        out["rope_local_base_freq"] = meta.get(f"{arch}.rope.freq_base_swa", 10000.0)
    return out
def _moe_config(meta: dict, arch: str, model_type: str, shapes: dict[str, tuple[int, ...]], n_layers: int,
                path: Path) -> dict:
    """The mixture-of-experts keys of config.json, as transformers names them for `model_type`.
    Layers without a router (`ffn_gate_inp`) are dense; expert sizes missing from the metadata
    (older conversions) are read off the first slab's shape."""
    def req(key):
        return _require(meta, f"{arch}.{key}", path)

    gating = meta.get(f"{arch}.expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise GGUFError(f"{path}: {arch}.expert_gating_func is {gating} (sigmoid routing); tokenmind's experts are "
                        "routed by softmax only")
    if meta.get(f"{arch}.expert_weights_scale", 1.0) != 1.0:
        raise GGUFError(f"{path}: {arch}.expert_weights_scale={meta[f'{arch}.expert_weights_scale']} scales the "
                        "experts' output, which tokenmind's mixture of experts does not do")
    n_experts, top_k = req("expert_count"), req("expert_used_count")
    normalize = bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[model_type]))
    if model_type == "mixtral":
        if not normalize:
            raise GGUFError(f"{path}: {arch}.expert_weights_norm is false, but Mixtral always renormalises the "
                            "chosen experts' weights")
        return {"num_local_experts": n_experts, "num_experts_per_tok": top_k}

    def rows(gguf_name: str) -> int:  # a GGUF shape lists the columns first: (H, I[, E]) -> I
        return shapes[gguf_name][1] if gguf_name in shapes else 0

    moe_layers = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    first = moe_layers[0] if moe_layers else 0
    config = {"num_experts": n_experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": meta.get(f"{arch}.expert_feed_forward_length")
              or rows(f"blk.{first}.ffn_gate_exps.weight"),
              "norm_topk_prob": normalize, "decoder_sparse_step": 1,
              "mlp_only_layers": [i for i in range(n_layers) if i not in moe_layers]}
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = (meta.get(f"{arch}.expert_shared_feed_forward_length")
                                                     or rows(f"blk.{first}.ffn_gate_shexp.weight"))
    return config


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Parse a GGUF file's header into HF config, tokenizer and tensor index; no tensor data is read."""
    path = Path(path)
    file = _open(path)
    meta = file.metadata
    arch = _require(meta, "general.architecture", path)
    n_experts = meta.get(f"{arch}.expert_count", 0)
    if arch not in _ARCHITECTURES:
        if n_experts:
            raise GGUFError(f"{path}: unsupported mixture-of-experts GGUF architecture {arch!r} ({n_experts} experts);"
                            " supported: Mixtral (written as 'llama'), qwen2moe, qwen3moe")
        supported = ", ".join(_ARCHITECTURES)
        raise GGUFError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {supported}")
    model_type = _MIXTRAL[0] if arch == "llama" and n_experts else _ARCHITECTURES[arch][0]
    if n_experts and model_type not in _NORM_TOPK:
        raise GGUFError(f"{path}: a {arch!r} file with {n_experts} experts has no Hugging Face equivalent; the "
                        "mixtures of experts supported are Mixtral (written as 'llama'), qwen2moe, qwen3moe")

    parts: dict[str, dict[int, GGUFTensor]] = {}
    for t in file.tensors:
        mapped = _hf_name(t.name, arch)
        if mapped is None and _PER_EXPERT_NAME.fullmatch(t.name):
            raise GGUFError(f"{path}: tensor {t.name!r} is one expert's matrix, an older llama.cpp layout; "
                            "re-convert the model with a current convert_hf_to_gguf.py, which stacks each layer's "
                            "experts into ffn_gate_exps / ffn_up_exps / ffn_down_exps")
        if mapped is None:  # e.g. llama 3's rope_freqs.weight: dropping it would change the model
            raise GGUFError(f"{path}: tensor {t.name!r} has no Hugging Face {model_type} equivalent")
        hf_name, place = mapped
        parts.setdefault(hf_name, {})[place] = t
    tensors = {}
    for hf_name, found in parts.items():
        if hf_name.endswith(".experts.gate_up_proj") and len(found) != 2:
            only = next(iter(found.values())).name
            raise GGUFError(f"{path}: {hf_name} joins a layer's ffn_gate_exps and ffn_up_exps, but the file has "
                            f"only {only!r} of the two")
        tensors[hf_name] = tuple(found[i] for i in sorted(found))

    tokenizer = _read_tokenizer(meta, path)
    shapes = {t.name: t.shape for t in file.tensors}
    config = _build_config(meta, arch, model_type, shapes, tokenizer, path)
    return GGUFCheckpoint(path, arch, config, tokenizer, metadata=meta, _tensors=tensors)
