"""The VAE on the project's Trainer and latent diffusion end to end: scikit-learn's 8×8 digits, a
VAE to 2×4×4 latents, a DiT with patch size 1 on them, samples decoded to pixels; in seconds."""

import numpy as np
import pytest
import torch
from PIL import Image

from tokenmind.cli import main
from tokenmind.diffusion.config import load_config
from tokenmind.diffusion.data import load_split, to_model_range
from tokenmind.diffusion.latent import encode_images, latent_split
from tokenmind.diffusion.sampling import generate
from tokenmind.diffusion.train import load_diffusion_model, train_diffusion
from tokenmind.diffusion.vae import load_vae
from tokenmind.diffusion.vae_train import load_vae_config, train_vae
from tokenmind.jsonl import read_jsonl

torch.set_num_threads(1)


def vae_config(out_dir, steps=40, **overrides):
    return load_vae_config(overrides={
        "vae.latent_channels": 2, "vae.base_channels": 16, "vae.channel_mults": [1, 2], "vae.kl_weight": 1e-2,
        "vae.calibration_images": 512, "data.dataset": "digits", "data.batch_size": 32, "optim.lr": 2e-3,
        "optim.weight_decay": 0.0, "schedule.name": "constant", "schedule.warmup_steps": 0, "train.steps": steps,
        "train.precision": "fp32", "train.eval_batches": 2, "train.out_dir": str(out_dir), "train.device": "cpu",
        **overrides})


@pytest.fixture(scope="module")
def trained_vae(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae")
    return train_vae(vae_config(out)), out


def test_vae_training_on_the_trainer_lowers_both_terms(trained_vae):
    result, out = trained_vae
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reconstruction" in r]
    assert len(rows) == 40 and rows[-1]["images"] == 40 * 32

    def mean(key, part):
        return float(np.mean([r[key] for r in part]))

    first, last = mean("reconstruction", rows[:5]), mean("reconstruction", rows[-5:])
    assert last < 0.5 * first, (first, last)
    assert mean("loss", rows[-5:]) < 0.5 * mean("loss", rows[:5])
    assert all(r["kl"] >= 0 for r in rows)
    val = [r for r in read_jsonl(out / "metrics.jsonl") if "val_reconstruction" in r][-1]
    assert val["val_kl"] >= 0 and val["val_reconstruction"] < first
    # the export is the calibrated VAE: latents of the training images have unit variance
    vae = load_vae(out / "final")
    images = load_split("digits", "train")[0][:512]
    latents = vae.to_latents(to_model_range(images), torch.Generator().manual_seed(1))
    assert vae.cfg.scaling_factor != 1.0 and 0.8 < latents.std().item() < 1.25
    decoded = vae.from_latents(encode_images(vae, images[:64]))
    assert ((decoded - to_model_range(images[:64])) ** 2).sum(dim=(1, 2, 3)).mean() < first


def test_vae_resume_equals_uninterrupted(tmp_path, capsys):
    whole = train_vae(vae_config(tmp_path / "whole", steps=6))
    train_vae(vae_config(tmp_path / "split", steps=3, **{"train.checkpoint_every": 3}))
    resumed = train_vae(vae_config(tmp_path / "split", steps=6))
    assert resumed.losses == whole.losses[3:]
    a, b = load_vae(tmp_path / "whole" / "final"), load_vae(tmp_path / "split" / "final")
    assert a.cfg == b.cfg
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    # the CLI on a finished run: nothing left to train, the export is rewritten, no loss to print
    main(["diffusion", "train-vae", "--config", str(tmp_path / "split" / "config.yaml"), "--train.resume=true"])
    assert "done: 6 steps, 192 images\n" in capsys.readouterr().out
    assert load_vae(tmp_path / "split" / "final").cfg == b.cfg


def latent_config(out_dir, vae_dir, **overrides):
    return load_config(overrides={
        "model.options": {"patch_size": 1, "hidden_size": 32, "num_layers": 2, "num_heads": 2},
        "diffusion.latent_vae": str(vae_dir), "diffusion.clip_sample": False, "data.dataset": "digits",
        "data.batch_size": 32, "optim.lr": 1e-3, "optim.weight_decay": 0.0, "schedule.name": "constant",
        "schedule.warmup_steps": 0, "train.steps": 20, "train.precision": "fp32", "train.eval_batches": 2,
        "train.out_dir": str(out_dir), "train.device": "cpu", **overrides})


def test_latent_diffusion_end_to_end(trained_vae, tmp_path):
    _, vae_dir = trained_vae
    result = train_diffusion(latent_config(tmp_path / "latent", vae_dir))
    assert result.losses[-1] < result.losses[0]
    # the DiT sees the cached, scaled latents: (2, 4, 4) for 8×8 digits
    latents, labels = latent_split(vae_dir, "digits", "train")
    assert latents.shape == (1600, 2, 4, 4) and len(labels) == 1600
    assert (vae_dir / "final" / "latents" / "digits-pad0-train.safetensors").is_file()
    digits = load_split("digits", "train")[0][:16]
    torch.testing.assert_close(latents[:16], encode_images(load_vae(vae_dir / "final"), digits))
    model, cfg = load_diffusion_model(tmp_path / "latent")
    assert model.cfg.in_channels == 2 and model.cfg.sample_size == 4 and model.cfg.patch_size == 1
    assert cfg.diffusion.latent_vae == str(tmp_path / "latent" / "final" / "vae")  # the copy travels with the model
    # sampling decodes to pixels: a 4×4 grid of 8×8 images (2-pixel gaps) at 4× scale
    for out, argv in ((tmp_path / "lib.png", None), (tmp_path / "cli.png", ["--sampler", "ddim"])):
        if argv is None:
            generate(tmp_path / "latent", out, n=16, steps=4, sampler="ddim", progress=False)
        else:
            main(["diffusion", "sample", "--model", str(tmp_path / "latent"), "--n", "16", "--steps", "4",
                  "--out", str(out), *argv])
        assert Image.open(out).size == (4 * (4 * 10 + 2), 4 * (4 * 10 + 2))
    assert Image.open(tmp_path / "lib.png").tobytes() == Image.open(tmp_path / "cli.png").tobytes()


def test_latent_config_errors_name_the_fix(trained_vae, tmp_path):
    _, vae_dir = trained_vae
    with pytest.raises(ValueError, match="clip_sample=false"):
        latent_config(tmp_path, vae_dir, **{"diffusion.clip_sample": True})
    with pytest.raises(FileNotFoundError, match="train-vae"):
        train_diffusion(latent_config(tmp_path / "a", tmp_path / "missing"))
    with pytest.raises(ValueError, match="same data.dataset"):
        train_diffusion(latent_config(tmp_path / "b", vae_dir, **{"data.pad_to": 10}))
