"""Images in, pixel values out: what every vision model here (ViT, CLIP, the VLM) is fed.

`to_pixel_values` turns uint8 arrays or PIL images of any size and channel count into the float
(B, C, S, S) batch in [-1, 1] a ViT takes: RGB ↔ grayscale conversion (ITU-R 601 luma, as PIL's
"L" mode computes it), a resize to S×S when the size differs (bilinear with antialiasing; a
non-square image is stretched, not cropped, so nothing of it is lost), and the same scaling to
[-1, 1] as the diffusion data (`diffusion.data.to_model_range`). `decode_image` reads untrusted
bytes (an upload, a data URL) into a PIL image with limits checked before decoding, and says in
a `ValueError` what is wrong, which a server maps to a 400.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from tokenmind.diffusion.data import to_model_range

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, PIL's RGB → L weights


def _from_pil(images: Sequence[Image.Image], image_size: int, channels: int) -> torch.Tensor:
    """PIL images (any mode, any size) → uint8 (B, C, S, S), converted and resized by PIL."""
    mode = "L" if channels == 1 else "RGB"
    rows = []
    for image in images:
        image = image.convert(mode)  # palette, RGBA, CMYK, 16-bit ... all to L or RGB
        if image.size != (image_size, image_size):
            image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.uint8)
        rows.append(array[None] if channels == 1 else array.transpose(2, 0, 1))
    return torch.from_numpy(np.stack(rows))


def _channels_first(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, H, W) or (B, H, W, C) → (B, C, H, W)."""
    if images.dim() == 3:
        return images[:, None]
    if images.dim() == 4 and images.shape[-1] in (1, 3, 4):
        return images.permute(0, 3, 1, 2)
    raise ValueError(f"images of shape {tuple(images.shape)}: expected (B, H, W) grayscale or (B, H, W, C) with "
                     "C = 1, 3 or 4 channels last")


def _convert_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """float (B, C, H, W) with C in 1, 3, 4 → (B, channels, H, W); alpha is dropped."""
    if x.shape[1] == 4:
        x = x[:, :3]
    if x.shape[1] == channels:
        return x
    if channels == 1:  # RGB → luma
        return (x * x.new_tensor(_LUMA)[None, :, None, None]).sum(dim=1, keepdim=True)
    return x.expand(-1, 3, -1, -1)  # gray → RGB: the same value in each channel


def to_pixel_values(images, image_size: int, channels: int) -> torch.Tensor:
    """Images → float (B, channels, image_size, image_size) in [-1, 1].

    images: a uint8 numpy array or tensor (B, H, W) or (B, H, W, C) (C = 1, 3 or 4; values 0..255),
    or a list of PIL images (any mode and size). channels: 1 (grayscale) or 3 (RGB)."""
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if isinstance(images, Image.Image):
        raise TypeError("pass a list of PIL images (a batch), e.g. [image]")
    if isinstance(images, (list, tuple)):
        if not images:
            raise ValueError("no images given")
        if not all(isinstance(im, Image.Image) for im in images):
            raise TypeError("a list of images must hold PIL images; stack arrays into one (B, H, W[, C]) array")
        return to_model_range(_from_pil(images, image_size, channels))
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8:
        raise TypeError(f"images must be uint8 (0..255), got {x.dtype}; a float batch in [-1, 1] is already "
                        "pixel values")
    x = to_model_range(_channels_first(x))  # float, [-1, 1]
    x = _convert_channels(x, channels)
    if x.shape[-2:] != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=True)
    return x.contiguous()


def decode_image(data: bytes, max_bytes: int, max_pixels: int) -> Image.Image:
    """PNG, JPEG or WebP bytes → a decoded PIL image. Raises ValueError naming the problem: more
    than max_bytes bytes, not an image, another format, more than max_pixels pixels (checked from
    the header, before decoding: a small file can decode into gigabytes), or a truncated file."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ValueError(f"the image is {len(data):,} bytes, over the limit of {max_bytes:,} bytes; "
                         "send a smaller image")
    if not data:
        raise ValueError("the image is empty (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels decides, below
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ValueError(f"the image has too many pixels ({e}); downscale it first") from e
        except Image.UnidentifiedImageError as e:
            raise ValueError("the data is not an image (PIL cannot identify it); send a PNG, JPEG or WebP file") from e
        if image.format not in IMAGE_FORMATS:
            raise ValueError(f"unsupported image format {image.format}; send PNG, JPEG or WebP")
        width, height = image.size
        if width * height > max_pixels:
            raise ValueError(f"the image is {width}x{height} = {width * height:,} pixels, over the limit of "
                             f"{max_pixels:,}; downscale it first")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"the {image.format} image could not be decoded ({e}); the file is truncated or "
                             "corrupt") from e
    return image
