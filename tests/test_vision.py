"""The ViT (shared blocks, bidirectional attention, class token or mean pooling), image decoding
and pixel values."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tokenmind.model.transformer import Block
from tokenmind.vision.images import decode_image, to_pixel_values
from tokenmind.vision.vit import ViT, ViTConfig, load_vit, save_vit

TINY = dict(image_size=8, patch_size=2, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


def tiny_vit(**kw) -> ViT:
    torch.manual_seed(0)
    return ViT(ViTConfig(**{**TINY, **kw})).eval()


def test_vit_shapes_cls_and_mean_pooling():
    x = torch.rand(3, 1, 8, 8) * 2 - 1
    cls = tiny_vit(num_classes=5)
    assert all(isinstance(m, Block) for m in cls.layers)
    assert cls.features(x).shape == (3, 1 + 16, 32)  # class token + 4x4 patches
    assert cls.pooled(x).shape == (3, 32) and cls(x).shape == (3, 5)
    torch.testing.assert_close(cls.pooled(x), cls.features(x)[:, 0])
    mean = tiny_vit(pool="mean")
    tokens = mean.features(x)
    assert tokens.shape == (3, 16, 32)
    torch.testing.assert_close(mean.pooled(x), tokens.mean(1))
    with pytest.raises(ValueError, match="no classification head"):
        mean(x)
    with pytest.raises(ValueError, match=r"expects \(B, 1, 8, 8\)"):
        cls.features(torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ViTConfig(image_size=28, patch_size=3)


def test_vit_attention_is_bidirectional_and_patches_are_raster_ordered():
    model = tiny_vit()
    x = torch.rand(2, 1, 8, 8) * 2 - 1
    base = model.features(x)
    changed = x.clone()
    changed[:, :, 6:, 6:] = -changed[:, :, 6:, 6:]  # the LAST patch (bottom right)
    out = model.features(changed)
    # causal attention would leave every earlier token untouched; here the class token and the first patch move
    assert (out[:, 0] - base[:, 0]).abs().max() > 1e-4
    assert (out[:, 1] - base[:, 1]).abs().max() > 1e-4
    # a patch's own token changes the most at its raster index: row 3, column 1 of 4x4 → token 1 + 13
    other = x.clone()
    other[:, :, 6:, 2:4] = -other[:, :, 6:, 2:4]
    moved = (model.features(other) - base).abs().amax(dim=(0, 2))
    assert int(moved[1:].argmax()) == 13
    # each image is encoded on its own: batch rows do not mix
    torch.testing.assert_close(model.features(x[:1]), base[:1])


def test_vit_positions_break_permutation_symmetry():
    """Without its position table a ViT is blind to where a patch is; with it, shuffling patches changes the feature."""
    model = tiny_vit(pool="mean")
    x = torch.rand(1, 1, 8, 8) * 2 - 1
    swapped = x.clone()
    swapped[..., 0:2, 0:2], swapped[..., 6:8, 6:8] = x[..., 6:8, 6:8], x[..., 0:2, 0:2]
    assert (model.pooled(x) - model.pooled(swapped)).abs().max() > 1e-4
    with torch.no_grad():
        model.pos_embed.zero_()
    torch.testing.assert_close(model.pooled(x), model.pooled(swapped))  # mean pooling of a set: order-free


def test_vit_save_load_round_trip(tmp_path):
    model = tiny_vit(num_classes=3)
    path = save_vit(model, tmp_path / "vit")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_vit(path)
    assert loaded.cfg == model.cfg and not loaded.training
    x = torch.rand(2, 1, 8, 8) * 2 - 1
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not a ViT"):
        load_vit(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_vit(tmp_path / "missing")


def test_to_pixel_values_converts_resizes_and_scales():
    gray = np.zeros((2, 28, 28), dtype=np.uint8)
    gray[:, :, 14:] = 255
    x = to_pixel_values(gray, 28, 1)
    assert x.shape == (2, 1, 28, 28) and x.dtype == torch.float32
    assert x.min() == -1 and x.max() == 1
    small = to_pixel_values(torch.from_numpy(gray), 14, 1)
    assert small.shape == (2, 1, 14, 14) and small[0, 0, 0, 0] == -1 and small[0, 0, 0, -1] == 1
    rgb = np.zeros((1, 10, 12, 3), dtype=np.uint8)
    rgb[..., 0] = 255  # pure red
    as_gray = to_pixel_values(rgb, 8, 1)
    assert as_gray.shape == (1, 1, 8, 8)
    torch.testing.assert_close(as_gray, torch.full_like(as_gray, 0.299 * 2 - 1))
    assert to_pixel_values(gray, 28, 3).shape == (2, 3, 28, 28)
    pil = [Image.fromarray(rgb[0]), Image.fromarray(gray[0]).convert("P")]
    out = to_pixel_values(pil, 8, 3)
    assert out.shape == (2, 3, 8, 8) and out[0, 0].min() == 1 and out[0, 1].max() == -1
    with pytest.raises(TypeError, match="uint8"):
        to_pixel_values(np.zeros((1, 4, 4), dtype=np.float32), 4, 1)
    with pytest.raises(ValueError, match="channels last"):
        to_pixel_values(np.zeros((1, 4, 4, 5), dtype=np.uint8), 4, 1)


def _encoded(fmt: str, size=(6, 5)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format=fmt)
    return buf.getvalue()


def test_decode_image_accepts_png_jpeg_webp_and_names_what_is_wrong():
    for fmt in ("PNG", "JPEG", "WEBP"):
        image = decode_image(_encoded(fmt), max_bytes=1 << 20, max_pixels=1000)
        assert image.size == (6, 5) and image.format == fmt
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"hello, this is text", 1 << 20, 1000)
    with pytest.raises(ValueError, match="over the limit of 10 bytes"):
        decode_image(_encoded("PNG"), 10, 1000)
    with pytest.raises(ValueError, match="unsupported image format GIF"):
        decode_image(_encoded("GIF"), 1 << 20, 1000)
    with pytest.raises(ValueError, match="pixels, over the limit"):
        decode_image(_encoded("PNG", (100, 100)), 1 << 20, 1000)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        decode_image(_encoded("PNG", (64, 64))[:-30], 1 << 20, 10_000)
    with pytest.raises(ValueError, match="empty"):
        decode_image(b"", 100, 100)
