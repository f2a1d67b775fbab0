"""A LLaVA-style vision-language model: ViT features → an MLP projector → image tokens spliced into
a language model's input embeddings (Liu et al. 2023, "Visual Instruction Tuning"; LLaVA-1.5's
two-layer GELU projector).

The prompt carries `tokens_per_image` copies of one placeholder token id per image, where the
user wrote `<image>` (`IMAGE_PLACEHOLDER`; `expand_image_placeholders`, `render_vlm_chat`). The
placeholder is an existing special token of the language model's vocabulary that its chat
template never writes (`choose_image_token`: SmolLM2's `<empty_output>`), so the embedding table
is not resized; its embedding never matters because `embed` overwrites those rows, in order, with
the image embeddings. Everything after the splice is the one `Transformer` (`run_layers`, `norm`,
`logits`), so training, evaluation and the serving engine (which receives the spliced rows as
prompt-embedding overrides) run the same model.

Image tokens: the ViT's class token (when it has one) plus its patch grid (7×7 at patch 4) pooled to
`pool_grid`×`pool_grid` (0 keeps every patch). Fewer image tokens make every prompt shorter, and
a 135M LM on a CPU pays per token; `docs/vision.md` has the measured trade-off.

On disk a VLM is one directory (`save_vlm`): the language model exactly as the project saves a
model (HF config.json + model.safetensors + tokenizer, so `load_model` also reads it as a plain
LM), `vision/` (`save_vit`), `projector.safetensors` and `vlm_config.json`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmind.model.attention import AttentionMetadata
from tokenmind.model.checkpoint import atomic_directory, save_hf_dir
from tokenmind.model.load import load_model, resolve_model_path
from tokenmind.model.lora import lora_layers, merge_lora
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer import Tokenizer

from .vit import ViT, load_vit, save_vit

IMAGE_PLACEHOLDER = "<image>"  # what a user writes where an image goes
MODEL_TYPE = "tokenmind-vlm"
VLM_CONFIG = "vlm_config.json"
PROJECTOR_WEIGHTS = "projector.safetensors"
VISION_DIR = "vision"


def choose_image_token(tokenizer: Tokenizer) -> str:
    """The placeholder for image tokens: the last special token of the vocabulary that is not bos,
    eos, pad or unk and that the chat template does not write (SmolLM2: `<empty_output>`), so no
    embedding row has to be added."""
    template = tokenizer.get_chat_template()
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
                *tokenizer.eos_token_ids}
    free = [(i, t.content) for i, t in tokenizer.backend.get_added_tokens_decoder().items()
            if t.special and i not in reserved and t.content not in template]
    if not free:
        raise ValueError("the tokenizer has no spare special token to stand for image tokens; name one with "
                         "image_token=... (a special token the chat template never writes)")
    return max(free)[1]


class Projector(nn.Module):
    """LLaVA-1.5's projector: Linear(vision → text) → GELU → Linear(text → text), per image token."""

    def __init__(self, vision_hidden: int, text_hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VisionLanguageModel(nn.Module):
    """vision (a `ViT`) + projector + language_model (the one `Transformer`).

    image_token_id: the prompt's placeholder id, repeated tokens_per_image times per image.
    image_size/image_channels: what `to_pixel_values` must produce for `vision`.
    """

    def __init__(self, vision: ViT, language_model: Transformer, image_token_id: int, pool_grid: int = 2,
                 projector: Projector | None = None):
        super().__init__()
        if not 0 <= image_token_id < language_model.cfg.vocab_size:
            raise ValueError(f"image_token_id {image_token_id} is outside the language model's vocabulary "
                             f"(0..{language_model.cfg.vocab_size - 1})")
        side = vision.cfg.image_size // vision.cfg.patch_size
        if pool_grid > side:
            raise ValueError(f"pool_grid {pool_grid} is larger than the ViT's {side}x{side} patch grid; use at most "
                             f"{side} (or 0 for every patch)")
        self.vision, self.language_model = vision, language_model
        self.projector = projector or Projector(vision.cfg.hidden_size, language_model.cfg.hidden_size)
        self.image_token_id, self.pool_grid = image_token_id, pool_grid
        self.has_cls = vision.cfg.pool == "cls"
        self.tokens_per_image = self.has_cls + (pool_grid * pool_grid if pool_grid else side * side)
        self.image_size, self.image_channels = vision.cfg.image_size, vision.cfg.in_channels
        self.gradient_checkpointing = False  # set by the Trainer; handed to the language model

    @property
    def cfg(self):
        return self.language_model.cfg

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, C, H, W) in [-1, 1] → (n, tokens_per_image, vision hidden): the class token, then
        the patch grid pooled to pool_grid × pool_grid in raster order."""
        vision_dtype = self.vision.patch_embed.weight.dtype
        tokens = self.vision.features(pixel_values.to(vision_dtype))
        patches = tokens[:, 1:] if self.has_cls else tokens
        if self.pool_grid:
            n, count, d = patches.shape
            side = int(count ** 0.5)
            grid = patches.transpose(1, 2).reshape(n, d, side, side)
            patches = F.adaptive_avg_pool2d(grid, self.pool_grid).flatten(2).transpose(1, 2)
        return torch.cat([tokens[:, :1], patches], dim=1) if self.has_cls else patches

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, C, H, W) in [-1, 1] → (n, tokens_per_image, LM hidden) in the language model's dtype:
        the rows that replace each image's placeholders."""
        features = self.image_features(pixel_values)
        projected = self.projector(features.to(self.projector.linear_1.weight.dtype))
        return projected.to(self.language_model.embed_tokens.weight.dtype)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) → input embeddings (B, T, hidden) with the placeholder rows overwritten,
        in reading order (row by row), by the images' embeddings (from pixel_values, or given)."""
        x = self.language_model.embed(input_ids)
        if image_embeds is None and pixel_values is not None:
            image_embeds = self.image_embeddings(pixel_values)
        slots = input_ids == self.image_token_id
        wanted = int(slots.sum())
        given = 0 if image_embeds is None else image_embeds.shape[0] * image_embeds.shape[1]
        if wanted != given:
            images = 0 if image_embeds is None else image_embeds.shape[0]
            raise ValueError(f"the prompt has {wanted} image placeholder tokens but {images} image(s) give {given} "
                             f"(tokens_per_image={self.tokens_per_image}); write {IMAGE_PLACEHOLDER} once per image "
                             "and expand it with expand_image_placeholders")
        if not wanted:
            return x
        return x.masked_scatter(slots.unsqueeze(-1), image_embeds.to(x.dtype))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, attn: AttentionMetadata | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) of the prompt with its images spliced in; positions and attn as in
        `Transformer.hidden_states`; logits_at: only these flat positions' logits, (N, vocab)."""
        lm = self.language_model
        lm.gradient_checkpointing = self.gradient_checkpointing
        hidden = lm.norm(lm.run_layers(self.embed(input_ids, pixel_values), positions, attn))
        if logits_at is not None:
            hidden = hidden.flatten(0, 1)[logits_at]
        return lm.logits(hidden)

    def config(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """The vlm_config.json of this model."""
        token = tokenizer.id_to_token(self.image_token_id)
        return {"model_type": MODEL_TYPE, "image_token": token, "pool_grid": self.pool_grid,
                "image_token_id": self.image_token_id, "tokens_per_image": self.tokens_per_image,
                "image_placeholder": IMAGE_PLACEHOLDER, "image_size": self.image_size,
                "image_channels": self.image_channels}


def expand_image_placeholders(text: str, image_token: str, tokens_per_image: int) -> tuple[str, int]:
    """(text with every `<image>` replaced by tokens_per_image copies of image_token, the number of
    images). Text that already holds the raw image token is refused: it would be read as an image."""
    if image_token in text:
        raise ValueError(f"the text contains the reserved image token {image_token!r}; write {IMAGE_PLACEHOLDER} "
                         "where an image goes")
    return text.replace(IMAGE_PLACEHOLDER, image_token * tokens_per_image), text.count(IMAGE_PLACEHOLDER)


def render_vlm_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], model: VisionLanguageModel,
                    add_generation_prompt: bool = False) -> tuple[list[int], list[int], int]:
    """(ids, assistant mask, number of images) of a chat whose string contents may hold `<image>`,
    rendered by the tokenizer's own chat template after expanding the placeholders."""
    token = tokenizer.id_to_token(model.image_token_id)
    expanded, images = [], 0
    for m in messages:
        content, n = expand_image_placeholders(m["content"], token, model.tokens_per_image)
        expanded.append({**m, "content": content})
        images += n
    ids, mask = tokenizer.render_chat(expanded, add_generation_prompt=add_generation_prompt)
    if ids.count(model.image_token_id) != images * model.tokens_per_image:
        raise ValueError(f"the chat template did not keep the {images} image(s)' placeholder tokens intact")
    return ids, mask, images


def build_vlm(vision: ViT, language_model: Transformer, tokenizer: Tokenizer, image_token: str = "",
              pool_grid: int = 2, seed: int = 0) -> VisionLanguageModel:
    """A VLM of a trained ViT and LM with a fresh projector (initialized from `seed`); image_token
    empty: `choose_image_token`."""
    token = image_token or choose_image_token(tokenizer)
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"image_token {token!r} is not in the tokenizer's vocabulary; choose one of its special "
                         "tokens")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        projector = Projector(vision.cfg.hidden_size, language_model.cfg.hidden_size)
    return VisionLanguageModel(vision, language_model, token_id, pool_grid, projector)


def save_vlm(model: VisionLanguageModel, tokenizer: Tokenizer, path: str | Path) -> Path:
    """Write `model` as one directory, atomically: the language model as `save_hf_dir` writes it
    (LoRA adapters merged into a copy first), `vision/`, the projector and `vlm_config.json`."""
    lm = model.language_model
    if lora_layers(lm):
        lm = merge_lora(copy.deepcopy(lm))
    with atomic_directory(path) as tmp:
        save_hf_dir(lm, tmp, tokenizer=tokenizer)  # fills (replaces) tmp, then the rest joins it
        save_vit(model.vision, tmp / VISION_DIR)
        save_file({k: v.detach().float().contiguous() for k, v in model.projector.state_dict().items()},
                  str(tmp / PROJECTOR_WEIGHTS), metadata={"format": "pt"})
        (tmp / VLM_CONFIG).write_text(json.dumps(model.config(tokenizer), indent=2) + "\n", encoding="utf-8")
    return Path(path)


def vlm_dir(path: str | Path) -> Path | None:
    """The directory holding a saved VLM (`path` itself or a run folder's `final/`), or None."""
    for folder in (Path(path).expanduser(), Path(path).expanduser() / "final"):
        if (folder / VLM_CONFIG).is_file():
            return folder
    return None


def is_vlm_dir(path: str | Path) -> bool:
    """Whether `path` (or its `final/`) holds a VLM written by `save_vlm`."""
    return vlm_dir(path) is not None


def read_vlm_config(folder: Path) -> dict[str, Any]:
    config_path = folder / VLM_CONFIG
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path} is not a readable VLM config ({e}); re-save the model with save_vlm") from e
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{config_path} does not describe a {MODEL_TYPE} model")
    return config


def load_vlm(path: str | Path, dtype: torch.dtype | str = torch.float32) -> tuple[VisionLanguageModel, Tokenizer]:
    """(VLM in eval mode, its tokenizer) from a `save_vlm` directory or a run folder holding `final/`.
    dtype: the language model's (as `load_model` takes it); the ViT and projector stay float32."""
    folder = vlm_dir(path)
    if folder is None:
        raise FileNotFoundError(f"{path} holds no VLM ({VLM_CONFIG} missing); pass a `tokenmind vision train-vlm` "
                                "run folder or its final/ folder")
    config = read_vlm_config(folder)
    pretrained = load_model(resolve_model_path(folder), dtype=dtype)
    vision = load_vit(folder / VISION_DIR)
    model = VisionLanguageModel(vision, pretrained.model, int(config["image_token_id"]), int(config["pool_grid"]))
    if pretrained.tokenizer.id_to_token(model.image_token_id) != config["image_token"]:
        raise ValueError(f"{folder}: image_token_id {model.image_token_id} is not {config['image_token']!r} in the "
                         "saved tokenizer; the directory is inconsistent, re-save it")
    model.projector.load_state_dict(load_file(str(folder / PROJECTOR_WEIGHTS)))
    return model.eval(), pretrained.tokenizer
