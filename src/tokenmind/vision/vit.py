"""The vision transformer (ViT; Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words").

An image (B, C, H, W) in [-1, 1] is cut into p×p patches by a strided convolution (the patch
embedding: one linear map of each patch's p·p·C pixels to a hidden-size token), a learned class
token is put in front (pool="cls"), a learned position embedding is added to every token, and the
tokens run through the project's own `Block`s (`model/transformer.py`: RMSNorm, attention through
`model.attention.attend`, SwiGLU MLP) with BIDIRECTIONAL attention — `DenseMask(None,
causal=False)`, as the DiT does — so every token sees every other; a final RMSNorm closes the stack.
The image's feature is the class token's final state (pool="cls") or the mean of the patch tokens
(pool="mean"); a linear head on it gives class logits when num_classes > 0.

Positions: learned absolute embeddings, one per token (ViT's choice), and the blocks' RoPE is
neutralised by rotating every token by angle 0 (cos = 1, sin = 0). A 1-D raster RoPE would tell
the attention that the last patch of one row and the first of the next are neighbours and that
vertically adjacent patches are a whole row apart; a learned table lets the model find the 2-D
layout itself (at 7×7 patches it does in a few hundred steps), and it has a fixed token count,
which an image encoder of a fixed resolution has anyway.

The trained model is a directory `config.json` (the `ViTConfig`) + `model.safetensors`
(`save_vit`, `load_vit`), written atomically.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.utils.checkpoint
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.model.attention import DenseMask
from tokenmind.model.checkpoint import atomic_directory
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Block, rms_norm

MODEL_TYPE = "tokenmind-vit"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
POOLS = ("cls", "mean")
_BIDIRECTIONAL = DenseMask(None, causal=False)


@dataclass
class ViTConfig:
    """A ViT's shape; the defaults suit 28×28 grayscale Fashion-MNIST (7×7 = 49 patches of 4×4).

    image_size: height = width of the input; patch_size: p (must divide image_size); in_channels:
    1 (grayscale) or 3 (RGB). hidden_size, num_layers, num_heads, intermediate_size: the blocks
    (intermediate_size is the SwiGLU MLP's width). pool: "cls" (a learned class token's final
    state) or "mean" (the mean of the patch tokens). num_classes: > 0 adds a linear classification
    head on the pooled feature; 0 is an encoder only (CLIP, a VLM's vision tower).
    """

    image_size: int = 28
    patch_size: int = 4
    in_channels: int = 1
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    pool: str = "cls"
    num_classes: int = 0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}; "
                             "pick a patch size that divides the image side")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.num_classes < 0 or self.in_channels < 1 or self.num_layers < 1:
            raise ValueError(f"num_classes ({self.num_classes}) must be >= 0, in_channels ({self.in_channels}) "
                             f"and num_layers ({self.num_layers}) >= 1")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Tokens `ViT.features` returns per image: the patches, plus the class token with pool="cls"."""
        return self.num_patches + (self.pool == "cls")

    def model_config(self) -> ModelConfig:
        """The `ModelConfig` of the shared blocks: Llama-style pre-norm blocks of this width and
        depth, full multi-head attention (no GQA), no vocabulary of their own."""
        return ModelConfig(vocab_size=1, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           max_position_embeddings=self.num_tokens, rms_norm_eps=1e-6)


class ViT(nn.Module):
    """pixel_values (B, C, H, W) float in [-1, 1] → tokens (`features`), one feature per image
    (`pooled`) or class logits (`forward`, with cfg.num_classes > 0)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        D, p, mcfg = cfg.hidden_size, cfg.patch_size, cfg.model_config()
        self.patch_embed = nn.Conv2d(cfg.in_channels, D, kernel_size=p, stride=p)
        if cfg.pool == "cls":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, D))
        self.layers = nn.ModuleList(Block(mcfg, i) for i in range(cfg.num_layers))
        self.norm = rms_norm(mcfg)
        if cfg.num_classes:
            self.head = nn.Linear(D, cfg.num_classes)
        # RoPE at angle 0 for every token: the identity rotation (see the module docstring)
        self.register_buffer("rope_cos", torch.ones(1, 1, 1, mcfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.zeros(1, 1, 1, mcfg.head_dim), persistent=False)
        self.gradient_checkpointing = False  # the Trainer's train.gradient_checkpointing
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """ViT's init: N(0, std) for linears, positions and the class token, Xavier-uniform for the
        patch embedding (a linear map of flattened patches), zero biases (norms keep their ones)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
        w = self.patch_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1), generator=generator)
        self.patch_embed.bias.zero_()
        self.pos_embed.normal_(0.0, std, generator=generator)
        if self.cfg.pool == "cls":
            self.cls_token.normal_(0.0, std, generator=generator)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) in [-1, 1] → final-normed tokens (B, T, hidden): the class token first
        (pool="cls"), then the patches in raster order (row by row, left to right)."""
        cfg = self.cfg
        if pixel_values.dim() != 4 or pixel_values.shape[1:] != (cfg.in_channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"ViT expects (B, {cfg.in_channels}, {cfg.image_size}, {cfg.image_size}) pixel values, "
                             f"got {tuple(pixel_values.shape)}; convert images with "
                             "tokenmind.vision.images.to_pixel_values")
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (B, N, D)
        if cfg.pool == "cls":
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        x = x + self.pos_embed
        cos, sin = self.rope_cos.to(x.dtype), self.rope_sin.to(x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, _BIDIRECTIONAL, use_reentrant=False)
            else:
                x = layer(x, cos, sin, _BIDIRECTIONAL)
        return self.norm(x)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """`features` tokens (B, T, hidden) → one feature per image (B, hidden)."""
        return tokens[:, 0] if self.cfg.pool == "cls" else tokens.mean(dim=1)

    def pooled(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) → (B, hidden): the class token's final state, or the mean patch token."""
        return self.pool(self.features(pixel_values))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) → class logits (B, num_classes)."""
        if not self.cfg.num_classes:
            raise ValueError("this ViT has no classification head (num_classes=0); use .pooled() or .features(), "
                             "or build it with ViTConfig(num_classes=N)")
        return self.head(self.pooled(pixel_values))


def write_vit(model: ViT, folder: Path) -> None:
    """config.json (the `ViTConfig`) + model.safetensors into the existing directory `folder`."""
    config = {"model_type": MODEL_TYPE, **asdict(model.cfg)}
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file({k: v.detach().float().contiguous() for k, v in model.state_dict().items()},
              str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


def save_vit(model: ViT, path: str | Path) -> Path:
    """Write `model` as the directory `path`: config.json (its `ViTConfig`) + model.safetensors,
    atomically (a temporary sibling renamed into place)."""
    with atomic_directory(path) as tmp:
        write_vit(model, tmp)
    return Path(path)


def read_vit_config(path: str | Path) -> ViTConfig:
    """The `ViTConfig` of a directory `save_vit` wrote."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; pass a directory written by save_vit (a "
                                "`tokenmind vision train-vit` or `train-clip` run's final/ folder)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        found = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(f"{config_path} describes model_type {found!r}, not a ViT ({MODEL_TYPE!r}); "
                         "load it with the loader of its own kind")
    known = {f.name for f in fields(ViTConfig)}
    return ViTConfig(**{k: v for k, v in config.items() if k in known})


def load_vit(path: str | Path, device: str | torch.device = "cpu") -> ViT:
    """The ViT a `save_vit` directory holds, in eval mode."""
    model = ViT(read_vit_config(path))
    weights = Path(path) / WEIGHTS_NAME
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights} is missing or not a readable safetensors file ({e}); re-save the model") from e
    model.load_state_dict(state)
    return model.to(device).eval()
