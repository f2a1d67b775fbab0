"""Vision: a ViT encoder on the shared Transformer blocks, image decoding and pixel values, ViT
classification and CLIP-style contrastive training on the one `Trainer` (docs/vision.md)."""

from .images import decode_image, to_pixel_values
from .vit import ViT, ViTConfig, load_vit, save_vit

__all__ = ["ViT", "ViTConfig", "decode_image", "load_vit", "save_vit", "to_pixel_values"]
