"""Checkpoint I/O: HF directories (config.json + safetensors, sharded or not) and GGUF files in;
HF directories out. Weights are only ever read through safetensors/GGUF, never `torch.load`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .quant import Int4Linear, QuantizedLinear, _replace
from .transformer import Transformer

SAFETENSORS_INDEX = "model.safetensors.index.json"

# An int4 checkpoint (`tokenmind convert --quantize int4|gptq|awq`): config.json's quantization_config
# names this method, and each int4 linear is stored as `<name>.qweight` / `.scales` / `.zeros`
# (`Int4Linear.portable`) in place of `<name>.weight`, under HF names (fused layers split back apart).
INT4_METHOD = "tokenmind_int4"
_INT4_PARTS = ("qweight", "scales", "zeros")

_FUSED = {  # our fused module → the HF modules stacked in it, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared_experts.gate_up_proj": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
}

# A DeepSeek-V3 multi-token prediction depth k is checkpoint layer num_hidden_layers + k; it also
# stores copies of the embedding and LM head, which ours shares with the model (`MTPLayer`).
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def from_hf_state_dict(hf: dict[str, torch.Tensor], num_hidden_layers: int | None = None) -> dict[str, torch.Tensor]:
    """HF names (`model.layers.0.self_attn.q_proj.weight`, ...) → ours (fused q/k/v and gate/up).
    With `num_hidden_layers`, layers past it are multi-token prediction depths (`mtp.{k}.`)."""
    ours = {k.removeprefix("model."): v for k, v in hf.items() if "rotary_emb" not in k}
    if num_hidden_layers is not None:
        for name in [n for n in ours if n.startswith("layers.")]:
            _, index, rest = name.split(".", 2)
            if int(index) >= num_hidden_layers:
                tensor = ours.pop(name)
                if rest not in _MTP_COPIES:
                    ours[f"mtp.{int(index) - num_hidden_layers}.{rest}"] = tensor
    for name in list(ours):
        for fused, parts in _FUSED.items():
            if name.split(".", 2)[-1].startswith(parts[0] + "."):  # layers.{i}.<part>.<weight|bias>
                prefix, suffix = name.split(parts[0])
                keys = [prefix + p + suffix for p in parts]
                if all(k in ours for k in keys):
                    ours[prefix + fused + suffix] = _stack_rows([ours.pop(k) for k in keys])
    return ours


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat on dim 0; placeholders (meta) stay one placeholder without running meta arithmetic,
    which would import torch._dynamo (0.8 s of a cold start)."""
    if any(p.is_meta for p in parts):
        return torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype, device="meta")
    return torch.cat(parts, dim=0)

def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our state dict → HF names, with the fused projections split back apart."""
    cfg, hf = model.cfg, {}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.intermediate_size] * 2,
             "mlp.shared_expert.gate_up_proj": [cfg.shared_expert_intermediate_size] * 2,
             "mlp.shared_experts.gate_up_proj": [cfg.shared_experts_intermediate_size] * 2}
    state = _portable_state_dict(model)
    for k in range(cfg.num_nextn_predict_layers):  # the checkpoint layout keeps per-depth copies of both
        state[f"mtp.{k}.embed_tokens.weight"] = state["embed_tokens.weight"].clone()  # (safetensors refuses
        state[f"mtp.{k}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()  # shared memory)
    for name, tensor in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.startswith("mtp."):
            _, k, rest = name.split(".", 2)
            name = f"layers.{cfg.num_hidden_layers + int(k)}.{rest}"
        hf_name = name if name.startswith(("lm_head.", "score.")) else f"model.{name}"  # heads sit outside `model.`
        for fused, parts in _FUSED.items():
            if f".{fused}." in name:
                for part, piece in zip(parts, tensor.split(sizes[fused], dim=0)):
                    hf[hf_name.replace(fused, part)] = piece
                break
        else:
            hf[hf_name] = tensor
    return hf

def _portable_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each int4 linear's kernel buffers replaced by its portable tensors."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            del state[f"{name}.weight"], state[f"{name}.scales_and_zeros"]
            state.update((f"{name}.{part}", t) for part, t in zip(_INT4_PARTS, module.portable()))
        elif isinstance(module, QuantizedLinear):
            raise ValueError(f"{name} is {type(module).__name__}: only float and int4 layers can be saved; "
                             "load the model with quantize=None (or int4) to save it")
    return state


def int4_quantization_config(model: Transformer) -> dict | None:
    """config.json's quantization_config for a model with int4 linears (None without any): the storage
    method, the group size, and how the codes were chosen ("rtn", "gptq", "awq", "Q4_1", ...)."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not layers:
        return None
    sizes = {m.group_size for m in layers}
    if len(sizes) > 1:
        raise ValueError(f"the int4 layers mix group sizes {sorted(sizes)}; a checkpoint stores one")
    return {"quant_method": INT4_METHOD, "bits": 4, "group_size": sizes.pop(),
            "algorithm": "+".join(sorted({m.source or "rtn" for m in layers})),
            "format": "w = (q - 8) * scale + zero per group of group_size inputs; qweight: two codes per byte, "
                      "even input column in the low nibble"}


def _take_int4(hf: dict[str, torch.Tensor], quantization: dict, source: str) -> dict[str, torch.Tensor]:
    """Move the int4 tensors out of an HF state dict, leaving a meta placeholder `.weight` for each."""
    if quantization.get("quant_method") != INT4_METHOD or not isinstance(quantization.get("group_size"), int):
        raise ValueError(f"{source}: quantization_config {quantization} is not one tokenmind reads (it reads "
                         f"quant_method {INT4_METHOD!r} with a group_size, as `tokenmind convert --quantize` writes); "
                         "load the float checkpoint instead")
    int4 = {}
    for key in [k for k in hf if k.endswith(".qweight")]:
        base = key.removesuffix(".qweight")
        if not all(f"{base}.{part}" in hf for part in _INT4_PARTS):
            raise ValueError(f"{source}: {key} comes without its .scales and .zeros; the checkpoint is incomplete")
        for part in _INT4_PARTS:
            int4[f"{base}.{part}"] = hf.pop(f"{base}.{part}")
        hf[f"{base}.weight"] = torch.empty(int4[key].shape[0], 2 * int4[key].shape[1], device="meta")
    return int4


def _attach_int4(model: Transformer, int4: dict[str, torch.Tensor], group_size: int) -> None:
    """Swap the placeholder linears for `Int4Linear`s built from the (HF-named) int4 tensors."""
    ours = from_hf_state_dict(int4, model.cfg.num_hidden_layers)  # fuses q/k/v and gate/up rows as for weights
    for key in [k for k in ours if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        linear = model.get_submodule(name)
        bias = None if linear.bias is None else linear.bias.detach()
        module = Int4Linear.from_portable(*(ours[f"{name}.{part}"] for part in _INT4_PARTS), group_size, bias)
        _replace(model, name, module)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated or corrupt — "
            "re-download or re-save the checkpoint"
        ) from e

def read_hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, following a shard index when there is one."""
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = model_dir / shard
            if not shard_path.exists():
                raise FileNotFoundError(f"{index} names shard {shard}, which is missing from {model_dir}")
            tensors.update(_read_safetensors(shard_path))
        return tensors
    single = model_dir / "model.safetensors"
    if single.exists():
        return _read_safetensors(single)
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(
            f"{model_dir} has only pickle weights (*.bin/*.pt); tokenmind reads safetensors only because "
            "unpickling runs arbitrary code — convert with transformers' save_model(safe_serialization=True)"
        )
    raise FileNotFoundError(f"no model.safetensors or {SAFETENSORS_INDEX} in {model_dir}")

def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *, source: str,
                dtype: torch.dtype = torch.float32, cls: type[Transformer] = Transformer) -> Transformer:
    """Create a `Transformer` (or the subclass `cls`) and load HF-named weights into it, checking
    names and shapes. Meta tensors in `state_dict` stay placeholders for the caller to replace
    (a quantized GGUF load swaps those linears for kernels built from the file's blocks). A config
    that announces multi-token prediction depths whose weights the checkpoint lacks (transformers
    saves DeepSeek-V3 without them but keeps num_nextn_predict_layers) loads without them; depths
    past the config's count are skipped, as transformers skips them all."""
    ours = from_hf_state_dict(state_dict, cfg.num_hidden_layers)
    if cfg.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in ours):
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    ours = {k: v for k, v in ours.items() if not k.startswith("mtp.")
            or int(k.split(".")[1]) < cfg.num_nextn_predict_layers}
    with torch.device("meta"):
        model = cls(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings or model.lm_head is None:
        ours.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: checkpoint tensors do not match the config "
            f"(missing: {missing[:5]}{'...' if len(missing) > 5 else ''}; "
            f"unexpected: {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}); "
            "check that config.json belongs to these weights"
        )
    for name, shape in expected.items():
        if tuple(ours[name].shape) != tuple(shape):
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(ours[name].shape)}, the config implies "
                f"{tuple(shape)}; check hidden_size/heads/vocab_size in config.json"
            )
    # The skeleton's meta parameters are swapped for the checkpoint's tensors (no to_empty: meta
    # empty_like imports sympy, 0.4 s); its one buffer, RoPE's frequencies, is already on the CPU.
    # `load_model` checks that nothing is left on meta once quantized layers are in place.
    model.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype).eval()

def load_hf_dir(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found; a Hugging Face model directory needs config.json")
    try:
        hf_cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    cfg = ModelConfig.from_hf(hf_cfg)
    cls = Transformer
    if any(a.endswith("ForSequenceClassification") for a in hf_cfg.get("architectures") or []):
        from .reward_model import RewardModel, check_reward_config

        check_reward_config(hf_cfg, config_path)
        cls = RewardModel
    hf = read_hf_state_dict(model_dir)
    quantization = hf_cfg.get("quantization_config")
    int4 = _take_int4(hf, quantization, str(config_path)) if quantization else {}
    model = build_model(cfg, hf, source=str(model_dir), dtype=dtype, cls=cls)
    if int4:
        _attach_int4(model, int4, quantization["group_size"])
    return model

@contextlib.contextmanager
def atomic_directory(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `out_dir` to fill; on success it replaces `out_dir`, on any
    error it is removed: an interrupted save never leaves a half-written directory under the name."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf_dir(model: Transformer, out_dir: str | Path, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ the tokenizer's files) so `transformers` loads
    it, atomically (`atomic_directory`). int4 linears are stored as they run (`INT4_METHOD`): tokenmind
    loads those back, `transformers` does not."""
    config, quantization = model.hf_config(), int4_quantization_config(model)
    if quantization:
        config["quantization_config"] = quantization
    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: (v.detach() if k.endswith(_INT4_PARTS) else v.detach().to(torch.float32)).contiguous()
                   for k, v in to_hf_state_dict(model).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save(tmp)
    return Path(out_dir)
