"""Model directories in diffusers' layout: `config.json` + `diffusion_pytorch_model.safetensors`.

Every trained network of this package (DiT, U-Net, VAE, the FID classifier) is saved this way, so
one pair of functions writes and reads them all; a DiT's directory is exactly what diffusers'
`DiTTransformer2DModel.save_pretrained` writes. A save fills a temporary sibling directory and
renames it into place (`model.checkpoint.atomic_directory`); weights are read through safetensors
only, never unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tokenmind.model.checkpoint import atomic_directory

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


def save_weights_dir(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `config` and `tensors` (stored as fp32, contiguous) to the directory `path`, atomically."""
    with atomic_directory(path) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()},
                  str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return Path(path)


def read_weights_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a directory `save_weights_dir` (or diffusers' save_pretrained) wrote."""
    path = Path(path)
    config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{path} needs {CONFIG_NAME} and {WEIGHTS_NAME} (a diffusers-layout model "
                                "directory); pickle weights (*.bin) are not read")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} is not a readable safetensors file ({e}); re-save the model") from e
    return config, tensors
