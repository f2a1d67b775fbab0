"""LoRA: trainable low-rank updates W + (alpha/r)·B·A on a frozen model's linear layers.

Targets are named as Hugging Face and PEFT name modules (`q_proj`, `v_proj`, `gate_proj`, ...).
The `Transformer` fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so one
`LoRALinear` wraps a fused projection and keeps a separate (A, B) pair per targeted slice of its
output: targeting `q_proj` and `v_proj` alone adapts only those rows and leaves k untouched,
exactly as PEFT does on the unfused model. The base may be a float `nn.Linear` or one of
`model/quant.py`'s int8/int4 layers (QLoRA: the base stays quantized and frozen; gradients flow
to the input through its dequantized weight).

A wrapped layer can hold several named adapters. `LoRARouting` (one object shared by every
layer of a model) says which applies: one name for the whole batch, or an adapter index per
row of the flattened input, which is how the serving engine runs requests for different
adapters in one batch. `merge_lora` folds one adapter into float weights and unwraps the layers.

Adapters are saved and loaded in PEFT's layout (`adapter_config.json` + `adapter_model.safetensors`
with `base_model.model.<HF module>.lora_A.weight` keys), so `peft` loads them onto the
`transformers` model and adapters trained elsewhere load here.
"""

from __future__ import annotations

import itertools
import json
import math
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .checkpoint import atomic_directory
from .transformer import Transformer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# HF module name → (our module inside a block, index of its slice in that module's output)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}  # fmt: skip
_HF_PARENT = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclass
class LoRAConfig:
    """One adapter's shape.

    rank/alpha: the update is (alpha / rank)·B·A (alpha / sqrt(rank) with rslora), A: (rank, in),
        B: (out, rank); B starts at zero so training starts from the base model exactly.
    dropout: on the adapter's input only (the base sees x unchanged), as in PEFT.
    targets: HF module names to adapt, in any of the model's blocks.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    rslora: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {unknown or '[]'} are not adaptable; choose among {', '.join(TARGETS)}")
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA needs rank >= 1, alpha > 0 and 0 <= dropout < 1; got rank={self.rank}, "
                             f"alpha={self.alpha}, dropout={self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRARouting:
    """Which adapter a model's LoRA layers apply, shared by all of them: `active` names one for
    every row (None: the base model alone), or `groups` (set by the engine before each step with
    `set_rows`) gives the rows of the flattened input that each adapter applies to."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.groups: dict[str, torch.Tensor] | None = None

    def set_rows(self, adapters: list[str | None], device: torch.device | str = "cpu") -> None:
        """One adapter name (or None) per row of the next forward's flattened input; the row
        indices are grouped once here, not in every layer."""
        by_name: dict[str, list[int]] = {}
        for row, name in enumerate(adapters):
            if name is not None:
                by_name.setdefault(name, []).append(row)
        self.groups = {name: torch.tensor(rows, device=device) for name, rows in by_name.items()}

    def clear_rows(self) -> None:
        self.groups = None


class LoRAAdapter(nn.Module):
    """One adapter on one (possibly fused) linear layer: an (A, B) pair per targeted output slice."""

    def __init__(self, in_features: int, slices: dict[str, int], cfg: LoRAConfig) -> None:
        super().__init__()
        self.cfg, self.scale = cfg, cfg.scale
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.lora_A = nn.ParameterDict({name: nn.Parameter(torch.empty(cfg.rank, in_features)) for name in slices})
        self.lora_B = nn.ParameterDict({name: nn.Parameter(torch.zeros(size, cfg.rank))
                                        for name, size in slices.items()})
        for a in self.lora_A.values():  # PEFT's default init: kaiming-uniform A, zero B
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))

    def deltas(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The update to each targeted slice of the layer's output for input x."""
        h = self.dropout(x)
        return {name: (h @ a.to(h.dtype).t()) @ self.lora_B[name].to(h.dtype).t() * self.scale
                for name, a in self.lora_A.items()}

    def weight_delta(self, name: str) -> torch.Tensor:
        """(alpha/r)·B·A for one slice, in float32 (for merging)."""
        return self.lora_B[name].float() @ self.lora_A[name].float() * self.scale


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `t` runs in: the autocast dtype where autocast is on, else t's
    (what a hand-written autograd node must pick itself, its backward running outside autocast)."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


class _FrozenLinearWithLoRA(torch.autograd.Function):
    """y = x·Wᵀ + b, plus scale·(x·A_sᵀ)·B_sᵀ added in place into each adapted output slice s,
    for a frozen float base (W, b get no gradient). As one autograd node it keeps only x and the
    small x·Aᵀ for backward, computes no gradient of W, and writes the updates straight into the
    base's output: no per-slice split/cat copies, no (tokens × out) scale multiply."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
                slices: list[tuple[int, int]], *pairs: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x)  # the autocast dtype (as nn.Linear would run), else x's
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        w = weight.to(dtype)
        y = flat @ w.t() if bias is None else torch.addmm(bias.to(dtype), flat, w.t())
        a = torch.cat(pairs[0::2]).to(dtype)  # every slice's A stacked: one matmul for all of them
        u = (flat @ a.t()).mul_(scale)
        rank = pairs[0].shape[0]
        for i, (offset, size) in enumerate(slices):
            y[:, offset:offset + size].addmm_(u[:, i * rank:(i + 1) * rank], pairs[2 * i + 1].to(dtype).t())
        ctx.save_for_backward(flat, weight, u, *pairs)
        ctx.scale, ctx.slices, ctx.dtype, ctx.x_shape, ctx.x_dtype = scale, slices, dtype, x.shape, x.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        flat, weight, u, *pairs = ctx.saved_tensors
        dtype, rank = ctx.dtype, pairs[0].shape[0]
        dy = grad_y.reshape(-1, grad_y.shape[-1]).to(dtype)
        du = torch.empty_like(u)
        grads: list[torch.Tensor | None] = [None] * len(pairs)
        for i, (offset, size) in enumerate(ctx.slices):
            dy_s, u_s = dy[:, offset:offset + size], u[:, i * rank:(i + 1) * rank]
            b = pairs[2 * i + 1]
            grads[2 * i + 1] = (dy_s.t() @ u_s).to(b.dtype)
            du[:, i * rank:(i + 1) * rank] = dy_s @ b.to(dtype)
        du.mul_(ctx.scale)
        for i, grad_a in enumerate((du.t() @ flat).split(rank)):
            grads[2 * i] = grad_a.to(pairs[2 * i].dtype)
        dx = None
        if ctx.needs_input_grad[0]:  # the first adapted layer's input (frozen embeddings) needs none
            a = torch.cat(pairs[0::2]).to(dtype)
            dx = torch.addmm(du @ a, dy, weight.to(dtype)).to(ctx.x_dtype).reshape(ctx.x_shape)
        return dx, None, None, None, None, *grads


class LoRALinear(nn.Module):
    """A frozen linear layer plus named adapters; see the module docstring for routing."""

    def __init__(self, base: nn.Module, slice_names: list[str], slice_sizes: list[int], routing: LoRARouting) -> None:
        super().__init__()
        self.base = base
        self.slice_names, self.slice_sizes = slice_names, slice_sizes  # the output's parts, in order
        self.adapters = nn.ModuleDict()
        self.routing = routing

    @property
    def in_features(self) -> int:
        return self.base.in_features

    def add_adapter(self, name: str, targets: list[str], cfg: LoRAConfig) -> LoRAAdapter:
        sizes = dict(zip(self.slice_names, self.slice_sizes))
        adapter = LoRAAdapter(self.in_features, {t: sizes[t] for t in self.slice_names if t in targets}, cfg)
        self.adapters[name] = adapter
        return adapter

    def _add(self, y: torch.Tensor, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
        if len(self.slice_names) == 1:
            return y + next(iter(deltas.values()))
        parts = list(y.split(self.slice_sizes, dim=-1))
        for i, name in enumerate(self.slice_names):
            if name in deltas:
                parts[i] = parts[i] + deltas[name]
        return torch.cat(parts, dim=-1)

    def _fused(self, x: torch.Tensor, adapter: LoRAAdapter) -> torch.Tensor | None:
        """The base's output with `adapter`'s updates as one autograd node, where that is the
        same math: a frozen float base, and no dropout drawn on the adapter's input; else None."""
        base = self.base
        if type(base) is not nn.Linear or base.weight.requires_grad or (base.bias is not None and
                                                                        base.bias.requires_grad):
            return None
        if adapter.cfg.dropout and adapter.training:
            return None
        slices, pairs, offset = [], [], 0
        for name, size in zip(self.slice_names, self.slice_sizes):
            if name in adapter.lora_A:
                slices.append((offset, size))
                pairs += [adapter.lora_A[name], adapter.lora_B[name]]
            offset += size
        return _FrozenLinearWithLoRA.apply(x, base.weight, base.bias, adapter.scale, slices, *pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.routing
        if r.groups is None and r.active is not None and r.active in self.adapters:
            y = self._fused(x, self.adapters[r.active])
            if y is not None:
                return y
        y = self.base(x)
        if r.groups is None:
            if r.active is None or r.active not in self.adapters:
                return y
            return self._add(y, self.adapters[r.active].deltas(x))
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        for name, rows in r.groups.items():
            if name in self.adapters:
                updated = self._add(flat_y[rows], self.adapters[name].deltas(flat_x[rows]))
                flat_y = flat_y.index_copy(0, rows, updated)
        return flat_y.reshape(y.shape)


def _slices(model: Transformer, module: str) -> tuple[list[str], list[int]]:
    """The HF names and sizes of a block module's output parts, in order."""
    cfg = model.cfg
    names = [hf for hf, (ours, _) in TARGETS.items() if ours == module]
    if module == "self_attn.qkv_proj":
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return names, [q, kv, kv]
    if module == "mlp.gate_up_proj":
        return names, [cfg.intermediate_size] * 2
    return names, [cfg.hidden_size]


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the adapters the model holds, in the order they were added."""
    names: dict[str, None] = {}
    for layer in lora_layers(model).values():
        names.update(dict.fromkeys(layer.adapters))
    return list(names)


def routing_of(model: nn.Module) -> LoRARouting:
    """The model's shared routing object (a model without LoRA layers gets one when adapted)."""
    layers = lora_layers(model)
    return next(iter(layers.values())).routing if layers else LoRARouting()


def add_lora(model: Transformer, cfg: LoRAConfig, name: str = "default", layers: list[int] | None = None,
             seed: int = 0) -> Transformer:
    """Wrap the targeted linear layers (once) and add adapter `name` to them, made active; freeze
    every parameter but the new adapter's. `layers`: block indices to adapt (default all)."""
    routing = routing_of(model)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        wanted = {TARGETS[t][0] for t in cfg.targets}
        for i, block in enumerate(model.layers):
            if layers is not None and i not in layers:
                continue
            for module in sorted(wanted):
                parent_name, child = module.rsplit(".", 1)
                parent = block.get_submodule(parent_name)
                layer = getattr(parent, child)
                if not isinstance(layer, LoRALinear):
                    layer = LoRALinear(layer, *_slices(model, module), routing)
                    setattr(parent, child, layer)
                if name in layer.adapters:
                    raise ValueError(f"the model already has a LoRA adapter named {name!r}")
                weight = getattr(layer.base, "weight", None)  # float base: the adapter takes its dtype
                dtype = weight.dtype if isinstance(weight, nn.Parameter) else torch.float32
                device = next(itertools.chain(layer.base.parameters(), layer.base.buffers())).device
                layer.add_adapter(name, cfg.targets, cfg).to(device, dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    for pname, p in model.named_parameters():
        p.requires_grad_(f".adapters.{name}." in pname)
    routing.active = name
    return model


@torch.no_grad()
def merge_lora(model: Transformer, name: str | None = None) -> Transformer:
    """Fold adapter `name` (default: the active one) into the base weights and unwrap every LoRA
    layer, so the model is a plain `Transformer` again (other adapters are dropped). The base
    must be float: a quantized base cannot absorb an update without re-quantizing."""
    layers = lora_layers(model)
    if not layers:
        return model
    name = name or next(iter(layers.values())).routing.active
    for path, layer in layers.items():
        base = layer.base
        if name in layer.adapters:
            if not isinstance(base, nn.Linear):
                raise ValueError(f"{path}: cannot merge LoRA into a quantized layer ({type(base).__name__}); "
                                 "merge into the float model, then quantize")
            adapter, offset = layer.adapters[name], 0
            for slice_name, size in zip(layer.slice_names, layer.slice_sizes):
                if slice_name in adapter.lora_A:
                    rows = base.weight[offset:offset + size]
                    rows.copy_((rows.float() + adapter.weight_delta(slice_name)).to(rows.dtype))
                offset += size
        parent_name, child = path.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, base)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# ---- PEFT layout ---------------------------------------------------------------------------------


def _peft_key(layer: int, hf_module: str, matrix: str) -> str:
    parent = next(p for p, children in _HF_PARENT.items() if hf_module in children)
    return f"base_model.model.model.layers.{layer}.{parent}.{hf_module}.{matrix}.weight"


def adapter_parameters(model: Transformer, name: str | None = None) -> dict[str, nn.Parameter]:
    """Adapter `name`'s (default: the active one's) parameters under PEFT's key names."""
    name = name or routing_of(model).active
    out = {}
    for path, layer in lora_layers(model).items():
        if name not in layer.adapters:
            continue
        index = int(path.split(".")[1])  # layers.{i}.<parent>.<module>
        adapter = layer.adapters[name]
        for hf_module in adapter.lora_A:
            out[_peft_key(index, hf_module, "lora_A")] = adapter.lora_A[hf_module]
            out[_peft_key(index, hf_module, "lora_B")] = adapter.lora_B[hf_module]
    if not out:
        raise ValueError(f"the model has no LoRA adapter named {name!r}")
    return out


def adapter_state(model: Transformer, name: str | None = None) -> dict[str, torch.Tensor]:
    """Adapter `name`'s tensors under PEFT's key names (what `save_adapter` writes)."""
    return {key: p.detach() for key, p in adapter_parameters(model, name).items()}


def adapter_config(model: Transformer, name: str | None = None) -> LoRAConfig:
    """The LoRAConfig adapter `name` was built with (rank, targets, scale) read off its layers."""
    name = name or routing_of(model).active
    adapters = [layer.adapters[name] for layer in lora_layers(model).values() if name in layer.adapters]
    if not adapters:
        raise ValueError(f"the model has no LoRA adapter named {name!r}")
    targets = sorted({t for a in adapters for t in a.lora_A}, key=list(TARGETS).index)
    return dataclasses.replace(adapters[0].cfg, targets=targets)


def save_adapter(model: Transformer, out_dir: str | Path, base_model: str, name: str | None = None,
                 tokenizer=None) -> Path:
    """Write adapter `name` as a PEFT adapter directory (atomically: a temp sibling renamed into
    place). base_model: what `base_model_name_or_path` records (how to load the base again).
    tokenizer: saved alongside, with the stop ids the model's config declares (fine-tuning may
    have added some), so the adapter chats as is."""
    cfg = adapter_config(model, name)
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": cfg.targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": cfg.rslora, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "init_lora_weights": True, "inference_mode": True,
    }  # fmt: skip
    with atomic_directory(out_dir) as tmp:
        tensors = {k: v.to(torch.float32).contiguous() for k, v in adapter_state(model, name).items()}
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
            declared = model.cfg.extra.get("eos_token_id")
            stops = tokenizer.eos_token_ids | set([declared] if isinstance(declared, int) else declared or [])
            if stops:
                generation = {"eos_token_id": sorted(stops)}
                (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return Path(out_dir)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable adapter config: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not supported; tokenmind loads LORA adapters")
    unsupported = {k: config[k] for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern")
                   if config.get(k)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if config.get("fan_in_fan_out"):
        unsupported["fan_in_fan_out"] = True
    if unsupported:
        raise ValueError(f"{path}: adapter options {unsupported} are not supported (plain LoRA on q/k/v/o/gate/up/"
                         "down only); retrain without them")
    return config


def load_adapter(model: Transformer, adapter_dir: str | Path, name: str = "default") -> Transformer:
    """Add the PEFT adapter in `adapter_dir` to `model` as `name` (active), checking that its
    tensors fit the model's layers."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} is missing; tokenmind reads adapters as safetensors only")
    tensors = load_file(str(weights_path))
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{adapter_dir}: target_modules is a regular expression ({targets!r}); list module names")
    layer_ids = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in tensors if ".layers." in k})
    rank = int(config["r"])
    cfg = LoRAConfig(rank=rank, alpha=float(config.get("lora_alpha", rank)), dropout=0.0,
                     targets=[t for t in targets], rslora=bool(config.get("use_rslora")))
    add_lora(model, cfg, name=name, layers=layer_ids)
    expected, stored = adapter_parameters(model, name), tensors
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{adapter_dir}: adapter tensors do not match the model (missing: {missing[:3]}, "
                         f"unexpected: {unexpected[:3]}); is it an adapter for this base model?")
    with torch.no_grad():
        for key, param in expected.items():
            if tuple(stored[key].shape) != tuple(param.shape):
                raise ValueError(f"{adapter_dir}: {key} has shape {tuple(stored[key].shape)}, the model needs "
                                 f"{tuple(param.shape)}; is it an adapter for this base model?")
            param.copy_(stored[key])
    return model
