"""The diffusion package's networks: DiT against diffusers' `DiTTransformer2DModel` on the same
weights, adaLN-Zero's identity at init, the U-Net and VAE shapes, the VAE's loss terms and a
few training steps on sklearn's 8×8 digits, and FID's properties against direct computations."""

import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.linalg
import torch
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.diffusion.dit import (
    DiT,
    DiTConfig,
    dit_config_from_diffusers,
    dit_from_diffusers,
    dit_to_diffusers,
    load_diffusers_dit,
    save_diffusers_dit,
)
from tokenmind.diffusion.fid import (
    ClassifierConfig,
    class_accuracy,
    fid,
    frechet_distance,
    gaussian_stats,
    load_classifier,
    save_classifier,
    train_classifier,
)
from tokenmind.diffusion.unet import UNet, UNetConfig, load_unet, save_unet
from tokenmind.diffusion.vae import VAE, VAEConfig, VAEObjective, load_vae

diffusers = pytest.importorskip("diffusers")


def tiny_diffusers_dit(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kwargs = dict(sample_size=8, patch_size=2, in_channels=4, out_channels=8, num_layers=2, num_attention_heads=2,
                  attention_head_dim=16, num_embeds_ada_norm=10, norm_eps=1e-5)
    return diffusers.DiTTransformer2DModel(**{**kwargs, **overrides}).eval()


def dit_inputs(batch: int = 4, channels: int = 4, size: int = 8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.tensor([0.0, 17.5, 500.0, 999.0])[:batch]
    labels = torch.tensor([0, 3, 9, 10])[:batch]  # 10 = the null class of classifier-free guidance
    return x, t, labels


def test_dit_matches_diffusers_on_the_same_weights():
    """Random (non-zero) weights in diffusers' layout, each block with its own embedder as
    diffusers trains them: tokenmind's DiT loaded through the converter gives the same output."""
    ref = tiny_diffusers_dit()
    cfg = dit_config_from_diffusers(dict(ref.config), shared_conditioning=False)
    assert cfg.learn_sigma and cfg.hidden_size == 32 and cfg.num_classes == 10
    model = DiT(cfg).eval()
    model.load_state_dict(dit_from_diffusers(ref.state_dict(), cfg))
    x, t, labels = dit_inputs()
    with torch.no_grad():
        expected = ref(x, t, labels).sample
        got = model(x, t, labels)
    assert got.shape == (4, 8, 8, 8)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    truncated = {k: v for k, v in ref.state_dict().items() if not k.startswith("transformer_blocks.1.")}
    with pytest.raises(ValueError, match="lacks transformer_blocks.1"):
        dit_from_diffusers(truncated, cfg)
    # and back: our weights in diffusers' layout load into diffusers and give the same output
    again = tiny_diffusers_dit(seed=5)
    again.load_state_dict(dit_to_diffusers(model))
    with torch.no_grad():
        torch.testing.assert_close(again(x, t, labels).sample, expected, atol=1e-5, rtol=0)


def test_a_dit_directory_written_by_diffusers_loads_with_one_shared_embedder(tmp_path):
    """A checkpoint whose blocks hold one embedder (as converted from the paper's code) loads as
    the paper's shared-conditioning DiT and still matches; ours saves back in the same layout."""
    ref = tiny_diffusers_dit(out_channels=None)
    state = ref.state_dict()
    for i in range(1, 2):
        for k in [k for k in state if k.startswith("transformer_blocks.0.norm1.emb.")]:
            state[k.replace("transformer_blocks.0.", f"transformer_blocks.{i}.")] = state[k].clone()
    ref.load_state_dict(state)
    ref.save_pretrained(tmp_path / "ref", safe_serialization=True)
    model = load_diffusers_dit(tmp_path / "ref")
    assert model.cfg.shared_conditioning and len(model.conditioning) == 1 and not model.cfg.learn_sigma
    x, t, labels = dit_inputs()
    with torch.no_grad():
        expected = ref(x, t, labels).sample
        torch.testing.assert_close(model(x, t, labels), expected, atol=1e-5, rtol=0)
        save_diffusers_dit(model, tmp_path / "ours")
        back = diffusers.DiTTransformer2DModel.from_pretrained(tmp_path / "ours").eval()
        torch.testing.assert_close(back(x, t, labels).sample, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="shared_conditioning=False"):
        dit_from_diffusers(tiny_diffusers_dit(seed=3).state_dict(), model.cfg)


def test_dit_blocks_start_as_the_identity_and_the_output_at_zero():
    """adaLN-Zero: every block's modulation starts at zero, so its gates are zero and the block
    passes its input through; the zero-initialized output layer makes the whole DiT output 0."""
    torch.manual_seed(0)
    model = DiT(DiTConfig(sample_size=8, in_channels=1, patch_size=2, hidden_size=32, num_layers=2, num_heads=2))
    x, t, labels = dit_inputs(channels=1)
    tokens = torch.randn(4, 16, 32)
    cond = model.conditioning[0](t, labels)
    assert cond.abs().sum() > 0  # the conditioning itself is not zero; only its modulation is
    for block in model.blocks:
        torch.testing.assert_close(block(tokens, cond), tokens, atol=0, rtol=0)
    assert torch.equal(model(x, t, labels), torch.zeros_like(x))
    # the first step moves only the (zero) output layer, whose input does not see the labels yet;
    # from the second on the modulations get gradients and the labels change the output
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = torch.randn_like(x)
    for _ in range(2):
        opt.zero_grad()
        ((model(x, t, labels) - target) ** 2).mean().backward()
        opt.step()
    with torch.no_grad():
        out_a, out_b = model(x, t, labels), model(x, t, torch.zeros_like(labels))
    assert out_a.abs().sum() > 0 and not torch.equal(out_a, out_b)


def test_dit_configs_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="patch_size"):
        DiTConfig(sample_size=7, patch_size=2)
    with pytest.raises(ValueError, match="no diffusers layout"):
        dit_to_diffusers(DiT(DiTConfig(sample_size=4, patch_size=2, hidden_size=16, num_heads=2, num_layers=1,
                                       pos_embed="learned")))
    model = DiT(DiTConfig(sample_size=8, patch_size=2, hidden_size=16, num_heads=2, num_layers=1))
    with pytest.raises(ValueError, match="DiTConfig.in_channels/sample_size"):
        model(torch.zeros(1, 1, 7, 7), torch.zeros(1))


def test_learned_positions_train(tmp_path):
    model = DiT(DiTConfig(sample_size=4, patch_size=2, hidden_size=16, num_heads=2, num_layers=1,
                          pos_embed="learned"))
    assert any(name == "pos_embed" for name, _ in model.named_parameters())
    assert json.dumps(model.cfg.__dict__)  # the config is plain data
    assert np.isfinite(model(torch.randn(2, 1, 4, 4), torch.ones(2), None).sum().item())


# ---- U-Net and VAE --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 8×8 digits as float (N, 1, 8, 8) in [-1, 1] and their labels."""
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    return torch.tensor(d.images, dtype=torch.float32)[:, None] / 8 - 1, torch.tensor(d.target)


@pytest.mark.parametrize("cfg", [
    UNetConfig(sample_size=8, in_channels=4, base_channels=16, channel_mults=(1, 2), attention_levels=(1,),
               num_res_blocks=2, num_classes=10),
    UNetConfig(sample_size=28, base_channels=8, channel_mults=(1, 2, 2), attention_levels=(2,), num_heads=2),
])
def test_unet_shapes_conditioning_and_round_trip(cfg, tmp_path):
    torch.manual_seed(0)
    model = UNet(cfg)
    x = torch.randn(3, cfg.in_channels, cfg.sample_size, cfg.sample_size)
    t, labels = torch.tensor([0.0, 10.0, 999.0]), torch.tensor([1, 2, 10])
    assert torch.equal(model(x, t, labels), torch.zeros_like(x))  # zero-initialized output layer
    for conv in model.modules():  # open the zero-initialized residual branches and output to see the conditioning
        if isinstance(conv, torch.nn.Conv2d) and not conv.weight.any():
            torch.nn.init.normal_(conv.weight, std=0.05)
    with torch.no_grad():
        out = model(x, t, labels)
        assert out.shape == x.shape
        assert not torch.equal(out, model(x, t, None)) and not torch.equal(out, model(x, t + 1, labels))
        save_unet(model, tmp_path / "unet")
        torch.testing.assert_close(load_unet(tmp_path / "unet")(x, t, labels), out, atol=0, rtol=0)
    with pytest.raises(ValueError, match="does not halve"):
        UNetConfig(sample_size=7, channel_mults=(1, 2))
    with pytest.raises(ValueError, match="not a TokenmindVAE"):
        load_vae(tmp_path / "unet")


def test_vae_loss_terms_are_the_formulas():
    """reconstruction = summed squared error of the decoded sample, KL = ½Σ(μ² + σ² − 1 − log σ²),
    checked against a direct computation with the same draw of ε."""
    torch.manual_seed(0)
    cfg = VAEConfig(sample_size=8, channel_mults=(1, 2), base_channels=8, latent_channels=2)
    model = VAE(cfg)
    images = torch.rand(4, 1, 8, 8) * 2 - 1
    batch = SimpleNamespace(images=images, noise_seed=7)
    terms = VAEObjective(kl_weight=0.5)(model, batch, "fp32")
    posterior = model.encode(images)
    assert posterior.mean.shape == (4, 2, 4, 4) and cfg.latent_size == 4
    eps = torch.randn(posterior.mean.shape, generator=torch.Generator().manual_seed(7))
    z = posterior.mean + (0.5 * posterior.logvar).exp() * eps
    reconstruction = ((model.decode(z) - images) ** 2).sum()
    var = posterior.logvar.exp()
    kl = 0.5 * (posterior.mean ** 2 + var - 1 - posterior.logvar).sum()
    torch.testing.assert_close(terms.metrics["reconstruction"], reconstruction.detach())
    torch.testing.assert_close(terms.metrics["kl"], kl.detach())
    torch.testing.assert_close(terms.loss, reconstruction + 0.5 * kl)
    assert terms.count == 4
    # KL of N(0, I) against itself is 0; shifting the mean by m adds m²/2 per entry
    zero = torch.zeros(1, 2, 4, 4)
    assert type(posterior)(zero, zero).kl().item() == 0.0
    torch.testing.assert_close(type(posterior)(zero + 2, zero).kl(), torch.tensor([2.0 * 32]))


# ---- FID ------------------------------------------------------------------------------------------


def random_covariance(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


def test_frechet_distance_matches_the_closed_forms():
    rng = np.random.default_rng(0)
    d = 6
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    s1, s2 = random_covariance(rng, d), random_covariance(rng, d)
    # Tr((Σ₁Σ₂)^½) = Σ √λ over the eigenvalues of Σ₁Σ₂ (similar to Σ₁^½ Σ₂ Σ₁^½, which is PSD)
    root1 = scipy.linalg.sqrtm(s1).real
    direct = (mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) \
        - 2 * np.sqrt(np.linalg.eigvalsh(root1 @ s2 @ root1)).sum()
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(direct, rel=1e-8)
    # diagonal covariances: Σᵢ (√aᵢ − √bᵢ)²
    a, b = rng.uniform(0.1, 2, d), rng.uniform(0.1, 2, d)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-9)
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0, abs=1e-9)


def test_fid_is_zero_on_the_same_set_and_grows_with_a_shift(digits, tmp_path):
    images, labels = digits
    cfg = ClassifierConfig(sample_size=8, channels=(8, 16), feature_dim=16)
    model = train_classifier(images[:1400], labels[:1400], cfg, epochs=4, batch_size=64, lr=5e-3)
    accuracy = class_accuracy(model, images[1400:], labels[1400:])
    assert accuracy > 0.8, accuracy
    held_out = images[1400:]
    assert fid(model, held_out, held_out) == pytest.approx(0, abs=1e-6)
    shifts = [fid(model, held_out, (held_out + s).clamp(-1, 1)) for s in (0.1, 0.3, 0.6)]
    assert 0 < shifts[0] < shifts[1] < shifts[2]
    mu, sigma = gaussian_stats(np.random.default_rng(0).normal(size=(50, 3)))
    assert mu.shape == (3,) and sigma.shape == (3, 3)
    save_classifier(model, tmp_path / "classifier")
    assert class_accuracy(load_classifier(tmp_path / "classifier"), held_out, labels[1400:]) == accuracy


def test_frechet_distance_on_rank_deficient_features_is_finite_and_quiet():
    # dead ReLU units (zero variance) make Σ₁Σ₂ singular, where scipy's sqrtm warns
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(50, 8)), rng.normal(size=(50, 8))
    x[:, :2], y[:, :1] = 0, 0
    (mu1, s1), (mu2, s2) = gaussian_stats(x), gaussian_stats(y)
    w, v = np.linalg.eigh(s1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    expected = (mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) \
        - 2 * np.sqrt(np.clip(np.linalg.eigvalsh(root1 @ s2 @ root1), 0, None)).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy's LinAlgWarning would fail here
        got = frechet_distance(mu1, s1, mu2, s2)
    assert got == pytest.approx(expected, rel=1e-6)
