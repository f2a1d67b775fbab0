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


def save_weights_dir(path: str | Path, class_name: str, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `config` (with `_class_name`, as diffusers names the model class) and `tensors` (floats
    stored as fp32) to the directory `path`, atomically."""
    with atomic_directory(path) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps({"_class_name": class_name, **config}, indent=2) + "\n")
        save_file({k: (v.float() if v.is_floating_point() else v).detach().contiguous() for k, v in tensors.items()},
                  str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return Path(path)


def read_weights_dir(path: str | Path, class_name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config without its `_class_name`, tensors) of a directory `save_weights_dir` (or diffusers'
    save_pretrained) wrote for a `class_name` model; another class is refused by name."""
    path = Path(path)
    config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{path} needs {CONFIG_NAME} and {WEIGHTS_NAME} (a diffusers-layout model "
                                "directory); pickle weights (*.bin) are not read")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    found = config.pop("_class_name", None)
    if found != class_name:
        raise ValueError(f"{path} holds a {found or 'model without _class_name'}, not a {class_name}; "
                         "load it with the loader of its own class")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} is not a readable safetensors file ({e}); re-save the model") from e
    return config, tensors
