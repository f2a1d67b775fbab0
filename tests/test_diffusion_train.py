"""Diffusion training on the project's Trainer, the sampling loop and classifier-free guidance, the
image data: all on scikit-learn's 8×8 digits with a tiny convolutional denoiser, in seconds."""

import gzip
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from tokenmind.diffusion.config import load_config
from tokenmind.diffusion.data import (
    ImageLoader,
    extract_fashion_mnist,
    load_digits,
    load_fashion_mnist,
    read_idx,
    to_model_range,
)
from tokenmind.diffusion.objectives import DenoisingObjective, FlowMatchingObjective, drop_labels
from tokenmind.diffusion.sampling import compile_for_sampling, generate, guided_output, make_scheduler, sample
from tokenmind.diffusion.schedules import NoiseSchedule
from tokenmind.cli import main
from tokenmind.diffusion.train import build_model, load_diffusion_model, train_diffusion
from tokenmind.jsonl import read_jsonl
from tokenmind.model import cpu

torch.set_num_threads(1)
CONFIG = Path(__file__).resolve().parent.parent / "src/tokenmind/configs/diffusion_fashion.yaml"


class TinyDenoiser(nn.Module):
    """The agreed model interface at its smallest: model(x (B, C, H, W), t (B,) float,
    labels (B,) or None; num_classes = no class) → (B, C, H, W)."""

    def __init__(self, channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.inp = nn.Conv2d(channels, width, 3, padding=1)
        self.time = nn.Linear(16, width)
        self.label = nn.Embedding(num_classes + 1, width)
        self.mid = nn.Conv2d(width, width, 3, padding=1)
        self.out = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x, t, class_labels=None):
        freqs = torch.exp(-math.log(1000) * torch.arange(8, device=x.device) / 8)
        angles = t[:, None].float() * freqs
        cond = self.time(torch.cat([angles.sin(), angles.cos()], dim=1))
        labels = class_labels if class_labels is not None else torch.full_like(t, self.num_classes, dtype=torch.long)
        cond = cond + self.label(labels)
        h = torch.nn.functional.silu(self.inp(x) + cond[:, :, None, None])
        return self.out(torch.nn.functional.silu(self.mid(h)))


def tiny_factory(cfg):
    return TinyDenoiser()


def digits_config(tmp_path, objective="ddpm", steps=30, **overrides):
    return load_config(overrides={
        "data.dataset": "digits", "data.batch_size": 32, "diffusion.objective": objective,
        "optim.lr": 3e-3, "optim.weight_decay": 0.0, "schedule.name": "constant", "schedule.warmup_steps": 0,
        "train.steps": steps, "train.precision": "fp32", "train.eval_batches": 2, "train.out_dir": str(tmp_path),
        "train.device": "cpu", **overrides})


@pytest.mark.parametrize("objective,extra", [("ddpm", {"diffusion.prediction_type": "epsilon"}),
                                             ("ddpm", {"diffusion.prediction_type": "v_prediction"}),
                                             ("flow", {"diffusion.t_sampling": "logit_normal"})])
def test_training_lowers_the_loss(tmp_path, objective, extra):
    result = train_diffusion(digits_config(tmp_path, objective, steps=40, **extra), tiny_factory)
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    assert last < 0.8 * first, (first, last)
    assert result.final_val_loss is not None and math.isfinite(result.final_val_loss)
    assert (tmp_path / "final" / "model.safetensors").is_file() and (tmp_path / "loss.png").is_file()
    record = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r][-1]
    assert record["images_per_s"] > 0 and record["images"] == 40 * 32 and record["mfu"] is None


def test_resume_continues_the_same_loss_curve(tmp_path):
    whole = train_diffusion(digits_config(tmp_path / "whole", steps=6), tiny_factory)
    train_diffusion(digits_config(tmp_path / "split", steps=3, **{"train.checkpoint_every": 3}), tiny_factory)
    resumed = train_diffusion(digits_config(tmp_path / "split", steps=6), tiny_factory)
    assert resumed.losses == whole.losses[3:]
    a, _ = load_diffusion_model(tmp_path / "whole", tiny_factory)
    b, _ = load_diffusion_model(tmp_path / "split", tiny_factory)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_guidance_in_one_batched_forward_equals_two_forwards():
    torch.manual_seed(0)
    model = TinyDenoiser()
    x, t, labels = torch.randn(4, 1, 8, 8), torch.tensor([10.0, 500.0, 999.0, 0.0]), torch.tensor([1, 7, 3, 0])
    calls = []
    model.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    guided = guided_output(model, x, t, labels, 3.0, num_classes=10)
    assert calls == [8]  # one forward over the conditional and the null-class rows
    cond, uncond = model(x, t, labels), model(x, t, torch.full_like(labels, 10))
    torch.testing.assert_close(guided, uncond + 3.0 * (cond - uncond))
    torch.testing.assert_close(guided_output(model, x, t, labels, 1.0, 10), cond)


@pytest.mark.parametrize("objective,sampler", [("ddpm", "ddpm"), ("ddpm", "ddim"), ("flow", "euler")])
def test_sampling_is_seeded_and_has_the_right_shape(tmp_path, objective, sampler):
    cfg = digits_config(tmp_path, objective)
    torch.manual_seed(0)
    model = TinyDenoiser().eval()
    scheduler = make_scheduler(cfg, sampler, eta=0.5)
    labels = torch.arange(3)

    def draw(seed):
        return sample(model, scheduler, (3, 1, 8, 8), labels, steps=5, guidance_scale=2.0,
                      generator=torch.Generator().manual_seed(seed), num_classes=10)

    a, b, c = draw(0), draw(0), draw(1)
    assert a.shape == (3, 1, 8, 8) and torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampler_loop_matches_diffusers_loop():
    """The whole DDPM loop with guidance, against diffusers' scheduler driven the way its pipelines
    drive it: the initial noise and every step's noise from one generator."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = TinyDenoiser().eval()
    labels = torch.tensor([2, 5])
    cfg = load_config(overrides={"data.dataset": "digits", "diffusion.beta_schedule": "squaredcos_cap_v2",
                                 "diffusion.prediction_type": "v_prediction"})
    ours = sample(model, make_scheduler(cfg, "ddpm"), (2, 1, 8, 8), labels, steps=10, guidance_scale=2.5,
                  generator=torch.Generator().manual_seed(4), num_classes=10)
    ref = diffusers.DDPMScheduler(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction",
                                  timestep_spacing="trailing")
    ref.set_timesteps(10)
    g = torch.Generator().manual_seed(4)
    x = torch.randn((2, 1, 8, 8), generator=g)
    with torch.no_grad():
        for t in ref.timesteps:
            out = model(torch.cat([x, x]), torch.full((4,), float(t)), torch.cat([labels, torch.full((2,), 10)]))
            cond, uncond = out.chunk(2)
            x = ref.step(uncond + 2.5 * (cond - uncond), t, x, generator=g).prev_sample
    torch.testing.assert_close(ours, x)


def test_a_flow_model_must_sample_with_euler(tmp_path):
    with pytest.raises(ValueError, match="samples with euler, not 'ddim'"):
        make_scheduler(digits_config(tmp_path, "flow"), "ddim")


def test_generate_writes_a_png_grid_of_the_class(tmp_path):
    train_diffusion(digits_config(tmp_path, steps=2), tiny_factory)
    out = generate(tmp_path, tmp_path / "grid.png", class_name="7", n=4, steps=3, sampler="ddim",
                   model_factory=tiny_factory, progress=False)
    picture = Image.open(out)
    assert picture.size == (4 * (2 * 10 + 2), 4 * (2 * 10 + 2))  # 2×2 images of 8 px, 2 px gaps, 4× scale
    with pytest.raises(ValueError, match="unknown class 'sneaker' for digits"):
        generate(tmp_path, tmp_path / "x.png", class_name="sneaker", model_factory=tiny_factory)


def test_shipped_config_loads_and_the_data_decide_the_image_shape():
    cfg = load_config(CONFIG)
    assert (cfg.model.kind, cfg.data.dataset, cfg.diffusion.objective) == ("dit", "fashion-mnist", "ddpm")
    with pytest.raises(ValueError, match="model.options sets sample_size, which the data decide"):
        build_model(load_config(CONFIG, ["model.options={sample_size: 32}"]))
    with pytest.raises(ValueError, match="diffusion.objective='gan' is not one of ddpm, flow"):
        load_config(CONFIG, ["diffusion.objective=gan"])


@pytest.mark.parametrize("flags,device,expected", [({"avx512f", "avx512_bf16"}, "cpu", "fp32"),
                                                   ({"avx512_bf16", "amx_bf16"}, "cpu", "bf16"),
                                                   (set(), "cuda", "bf16")])
def test_auto_precision_is_bf16_only_where_it_is_faster(monkeypatch, flags, device, expected):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert cpu.fastest_autocast(device) == expected
    if device == "cpu":  # the config resolves auto (its default) on the run's device, and saves it resolved
        assert load_config(overrides={"train.device": "cpu"}).train.precision == expected
        assert load_config(overrides={"train.device": "cpu", "train.precision": "bf16"}).train.precision == "bf16"


@pytest.mark.slow  # compiling takes ~20-40 s of CPU
def test_compiled_sampler_equals_eager(tmp_path):
    cfg = digits_config(tmp_path, **{"model.options": {"patch_size": 2, "hidden_size": 32, "num_layers": 2,
                                                       "num_heads": 2}})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # adaLN-Zero starts every block at the identity: move off it so all paths count
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    scheduler, labels = make_scheduler(cfg, "ddim"), torch.arange(4)

    def draw(m):
        return sample(m, scheduler, (4, 1, 8, 8), labels, steps=3, guidance_scale=3.0,
                      generator=torch.Generator().manual_seed(0), num_classes=10)

    compiled = compile_for_sampling(model)
    torch.testing.assert_close(draw(compiled), draw(model), atol=1e-4, rtol=1e-4)
    if torch._C.has_mkl:  # frozen weights are packed for MKL: no linear is left as a plain addmm
        with torch.profiler.profile() as prof:
            draw(compiled)
        ops = {e.key for e in prof.key_averages()}
        assert "mkl::_mkl_linear" in ops and "aten::addmm" not in ops, sorted(ops)


def test_cli_sample_without_a_trained_model_is_a_clear_error(tmp_path, capsys):
    assert main(["diffusion", "sample", "--model", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "holds no trained diffusion model" in capsys.readouterr().err


def test_objectives_draw_from_the_batch_seed_alone():
    images, labels = load_digits()
    batch = next(ImageLoader(images, labels, 8, seed=0))
    model = TinyDenoiser()
    for objective in (DenoisingObjective(NoiseSchedule(), "sample", num_classes=10),
                      FlowMatchingObjective(num_classes=10)):
        a, b = objective(model, batch, "fp32"), objective(model, batch, "fp32")
        assert a.count == 8 and torch.equal(a.loss, b.loss)


def test_label_dropout_rate():
    labels = torch.zeros(20_000, dtype=torch.long)
    dropped = drop_labels(labels, 10, 0.1, torch.Generator().manual_seed(0))
    assert set(dropped.unique().tolist()) == {0, 10}
    assert abs((dropped == 10).float().mean().item() - 0.1) < 0.01


def test_image_loader_scales_pads_and_resumes():
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == torch.uint8 and int(images.max()) == 255
    loader = ImageLoader(images, labels, 16, seed=3, pad_to=12)
    first = next(loader)
    assert first.images.shape == (16, 1, 12, 12)
    assert first.images.min() == -1 and first.images.max() <= 1 and (first.images[:, :, :2] == -1).all()
    for _ in range(200):  # past an epoch boundary (112 batches)
        next(loader)
    state = loader.state_dict()
    expected = next(loader)
    again = ImageLoader(images, labels, 16, seed=3, pad_to=12)
    again.load_state_dict(state)
    got = next(again)
    assert torch.equal(got.images, expected.images) and got.noise_seed == expected.noise_seed
    with pytest.raises(ValueError, match="cannot pad 8x8 images evenly to 11x11"):
        to_model_range(images[:1], pad_to=11)


def test_read_idx_checks_the_header():
    labels = np.arange(5, dtype=np.uint8)
    data = (0x801).to_bytes(4, "big") + (5).to_bytes(4, "big") + labels.tobytes()
    assert read_idx(gzip.decompress(gzip.compress(data)), 1, "labels").tolist() == list(range(5))
    with pytest.raises(Exception, match="IDX magic 0x801, expected 0x803"):
        read_idx(data, 3, "images")
    with pytest.raises(Exception, match="truncated"):
        read_idx(data[:-1], 1, "labels")


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("TOKENMIND_NETWORK_TESTS") != "1", reason="set TOKENMIND_NETWORK_TESTS=1")
def test_fashion_mnist_from_its_debian_package(tmp_path):
    images, labels = load_fashion_mnist("test", cache_dir=tmp_path)
    assert images.shape == (10_000, 28, 28) and labels.bincount().tolist() == [1000] * 10
    assert (tmp_path / "images" / "fashion-mnist.npz").is_file()
    deb = next((tmp_path / "downloads" / "debian" / "dataset-fashion-mnist").glob("*.deb"))
    train = extract_fashion_mnist(deb)[0]
    assert train["id"] == "train" and train["images"].shape == (60_000, 28, 28)
