"""The diffusion package's networks: DiT against diffusers' `DiTTransformer2DModel` on the same
weights, adaLN-Zero's identity at init, the U-Net and VAE shapes, the VAE's loss terms and a
few training steps on sklearn's 8×8 digits, and FID's properties against direct computations."""

import json

import numpy as np
import pytest
import torch

from tokenmind.diffusion.dit import (
    DiT,
    DiTConfig,
    dit_config_from_diffusers,
    dit_from_diffusers,
    dit_to_diffusers,
    load_diffusers_dit,
    save_diffusers_dit,
)

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
