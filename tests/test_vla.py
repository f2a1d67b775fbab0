"""The vision-language-action model on tiny random parts: prefix and head shapes, the action-token
binning round trip, both heads' objectives, save/load through `load_policy`, exact resume on the
one Trainer, and a tiny overfit per head; one slow test on the real SmolLM2-135M."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_train_helpers import one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.embodied.policy import ChunkingPolicy, load_policy
from tokenmind.embodied.policy_train import ChunkDenoisingObjective, ChunkLoader
from tokenmind.embodied.vla import VLA, VLAConfig, build_vla, load_vla, save_vla
from tokenmind.embodied.vla_train import ActionTokenObjective, load_vla_config, train_vla
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer import Tokenizer
from tokenmind.tokenizer.train import DEFAULT_SPECIAL_TOKENS, train_bpe

TINY = {"lm_layers": 1, "horizon": 4, "n_action_steps": 2, "image_size": 16, "crop_size": 12, "patch_size": 4,
        "vision_hidden": 16, "vision_layers": 1, "vision_heads": 2, "pool_grid": 0, "expert_hidden": 32,
        "expert_layers": 2, "expert_heads": 2, "num_train_timesteps": 100, "num_inference_steps": 8, "n_bins": 32}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return make_tokenizer()


def make_tokenizer() -> Tokenizer:
    texts = ["push the T onto the target", "the agent pushes a block", "user\nhello\nassistant\nhi\n"] * 20
    return train_bpe(texts, vocab_size=300, special_tokens=[*DEFAULT_SPECIAL_TOKENS, "<image_pad>"])


def tiny_lm(tokenizer: Tokenizer) -> Transformer:
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Transformer(cfg)
    model.init_weights(0.02, torch.Generator().manual_seed(0))
    return model


def rule(agent_pos: np.ndarray) -> np.ndarray:
    """The toy expert: steer to the mirror image of the agent's position."""
    return np.stack([512 - agent_pos[..., 0], 100 + 0.5 * agent_pos[..., 1]], axis=-1).astype(np.float32)


def toy_demos(episodes: int = 16, length: int = 6, seed: int = 0) -> SimpleNamespace:
    """Demonstrations-shaped arrays: the agent still at a random position per episode, noise pixels,
    the rule's action at every frame."""
    rng = np.random.default_rng(seed)
    pos = np.repeat(rng.uniform(0, 512, (episodes, 2)), length, axis=0).astype(np.float32)
    n = episodes * length
    return SimpleNamespace(pixels=rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8), agent_pos=pos,
                           action=rule(pos), episode_index=np.repeat(np.arange(episodes), length))


def tiny_vla(tokenizer: Tokenizer, **overrides) -> VLA:
    model = build_vla(VLAConfig(**{**TINY, **overrides}), tiny_lm(tokenizer), tokenizer)
    demos = toy_demos()
    model.normalizer.fit(demos.agent_pos, demos.action)
    return model


def batch_of(demos: SimpleNamespace, size: int = 8):
    loader = ChunkLoader(demos.pixels, demos.agent_pos, demos.action, demos.episode_index,
                         np.arange(len(demos.action)), 1, TINY["horizon"], size, seed=3)
    return next(loader)


def tiny_config(tmp_path, head: str, steps: int = 4, **overrides):
    values = {**{f"policy.{k}": v for k, v in TINY.items()}, "policy.head": head, "data.batch_size": 8,
              "train.steps": steps, "train.out_dir": str(tmp_path / head), "train.precision": "fp32",
              "train.device": "cpu", "schedule.warmup_steps": 0, **overrides}
    return load_vla_config(overrides=values)


def test_prefix_and_flow_head_shapes(tokenizer):
    model = tiny_vla(tokenizer).eval()
    assert model.instruction_ids == tokenizer.encode("push the T onto the target")
    assert model.vlm.image_token_id == tokenizer.token_to_id("<image_pad>")
    batch = batch_of(toy_demos(), 3)
    context = model.encode_obs(batch.pixels, batch.agent_pos)
    assert context.shape == (3, 9 + len(model.instruction_ids) + 1, 32)  # 3x3 patches, instruction, state
    x = torch.randn(3, 4, 2)
    assert model(x, torch.full((3,), 50.0), context).shape == (3, 4, 2)
    chunk = model.predict_action_chunk(batch.pixels, batch.agent_pos, torch.Generator().manual_seed(0))
    assert chunk.shape == (3, 4, 2)
    low, high = model.normalizer.action_min, model.normalizer.action_max
    assert (chunk >= low - 1e-3).all() and (chunk <= high + 1e-3).all()
    assert torch.equal(chunk, model.predict_action_chunk(batch.pixels, batch.agent_pos,
                                                         torch.Generator().manual_seed(0)))


def test_action_expert_follows_the_pi0_block_mask(tokenizer):
    """Image + instruction rows never see the state or the actions, the state row never sees the
    actions, the actions see everything: prefix outputs are the same whatever the noisy chunk and t."""
    model = tiny_vla(tokenizer).eval()
    gen = torch.Generator().manual_seed(0)
    batch = batch_of(toy_demos(), 2)
    with torch.no_grad():
        context = model.encode_obs(batch.pixels, batch.agent_pos)
        L = context.shape[1]

        def rows(x, t, ctx=context):
            return model.expert.hidden_states(x, torch.full((2,), t), ctx)

        x = torch.randn(2, 4, 2, generator=gen)
        base = rows(x, 50.0)
        other = rows(torch.randn(2, 4, 2, generator=gen) * 3, 5.0)  # other actions, another flow step
        assert torch.equal(base[:, :L], other[:, :L])  # prefix and state rows: untouched by the actions
        assert not torch.allclose(base[:, L:], other[:, L:])  # while the action rows move

        moved_state = context.clone()
        moved_state[:, -1] += torch.randn(2, context.shape[-1], generator=gen)
        state = rows(x, 50.0, moved_state)
        assert torch.equal(state[:, :L - 1], base[:, :L - 1])  # image + text do not see the state ...
        assert not torch.allclose(state[:, L - 1:], base[:, L - 1:])  # ... the state and the actions do

        moved_image = context.clone()
        moved_image[:, 0] += torch.randn(2, context.shape[-1], generator=gen)
        image = rows(x, 50.0, moved_image)
        assert not torch.allclose(image[:, 1:L - 1], base[:, 1:L - 1])  # image + text: bidirectional among themselves
        assert not torch.allclose(image[:, L:], base[:, L:])  # the actions read the prefix
        assert torch.equal(model(x, torch.full((2,), 50.0), context), model.expert.out(base[:, L:]))


def test_action_bins_round_trip_within_half_a_bin(tokenizer):
    model = tiny_vla(tokenizer, head="tokens")
    vocab = tokenizer.vocab_size
    assert model.action_token_ids.tolist() == list(range(vocab - 32, vocab))  # the vocabulary's last ids
    low, high = model.normalizer.action_min, model.normalizer.action_max
    actions = low + torch.rand(500, 2, generator=torch.Generator().manual_seed(1)) * (high - low)
    actions = torch.cat([actions, low[None], high[None]])  # the ends fall in the first / last bin
    bins = model.to_bins(actions)
    assert bins.min() >= 0 and bins.max() <= 31 and bins[-2].eq(0).all() and bins[-1].eq(31).all()
    half_bin = (high - low) / 32 / 2
    assert ((model.from_bins(bins) - actions).abs() <= half_bin + 1e-3).all()


def test_flow_objective_trains_vision_and_expert_not_the_frozen_lm(tokenizer):
    model = tiny_vla(tokenizer)
    batch = batch_of(toy_demos())
    objective = ChunkDenoisingObjective(model.cfg)
    terms = objective(model, batch, "fp32")
    assert terms.count == 8 and torch.isfinite(terms.loss)
    assert 0.3 < terms.loss.item() / 8 < 5  # velocity ε − x₀: mean square ≈ 1 + E[x₀²]; an untrained net says ~0
    assert torch.equal(terms.loss, objective(model, batch, "fp32").loss)  # the batch's noise_seed fixes the draws
    terms.loss.backward()
    assert model.vlm.vision.patch_embed.weight.grad.abs().sum() > 0  # gradients reach the ViT through the LM
    assert model.vlm.projector.linear_1.weight.grad.abs().sum() > 0
    assert model.state_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in model.language_model.parameters())


def test_token_objective_is_cross_entropy_on_action_tokens_and_trains_lora(tokenizer):
    model = tiny_vla(tokenizer, head="tokens", lora_rank=4)
    batch = batch_of(toy_demos())
    terms = ActionTokenObjective()(model, batch, "fp32")
    assert terms.count == 8 * 4 * 2  # one unit per action token
    assert abs(terms.loss.item() / terms.count - np.log(32)) < 0.5  # an untrained head is about uniform
    logits, bins = model.action_token_logits(batch.pixels, batch.agent_pos, batch.action)
    assert logits.shape == (8, 8, 32) and torch.equal(bins, model.to_bins(batch.action).flatten(1))
    terms.loss.backward()
    lora = [p for n, p in model.language_model.named_parameters() if ".adapters." in n]
    assert lora and all(p.requires_grad for p in lora) and any(p.grad.abs().sum() > 0 for p in lora)
    assert model.language_model.embed_tokens.weight.grad is None
    assert model.action_out.grad.abs().sum() > 0 and model.action_embed.grad.abs().sum() > 0
    assert torch.equal(model.action_out.detach(), model.language_model.lm_head.weight[model.action_token_ids])
    assert model.expert is None
    decoded = model.decode_action_tokens(batch.pixels[:2], batch.agent_pos[:2])
    assert decoded.shape == (2, 4, 2) and decoded.min() >= 0 and decoded.max() < 32


@pytest.mark.parametrize("head", ["flow", "tokens"])
def test_save_load_round_trip_through_load_policy(tokenizer, tmp_path, head):
    model = tiny_vla(tokenizer, head=head, lora_rank=2 if head == "tokens" else 0).eval()
    save_vla(model, tmp_path / "vla")
    loaded = load_vla(tmp_path / "vla")
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    policy = load_policy(tmp_path / "vla", seed=5)
    assert isinstance(policy, ChunkingPolicy) and isinstance(policy.model, VLA)
    obs = {"pixels": np.zeros((16, 16, 3), np.uint8), "agent_pos": np.array([100.0, 200.0], np.float32)}
    batch = (torch.zeros(1, 1, 16, 16, 3, dtype=torch.uint8), torch.tensor([[[100.0, 200.0]]]))
    want = model.predict_action_chunk(*batch, torch.Generator().manual_seed(5))[0, :2].numpy()
    got = [policy.act(obs) for _ in range(2)]  # two actions executed per chunk
    np.testing.assert_allclose(np.stack(got), want, atol=1e-5)


@pytest.mark.parametrize("head", ["flow", "tokens"])
def test_exact_resume_equals_uninterrupted_run(tokenizer, tmp_path, head):
    demos = toy_demos()
    constant = {"schedule.name": "constant", "policy.lora_rank": 2}

    def run(folder, steps):
        return train_vla(tiny_config(folder, head, steps, **constant), demos, tiny_lm(tokenizer), tokenizer)

    full = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 4)
    assert resumed.losses == full.losses[2:]
    a, b = load_vla(full.final_model_path).state_dict(), load_vla(resumed.final_model_path).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["flow", "tokens"])
def test_each_head_learns_the_toy_rule(tokenizer, tmp_path, head):
    """The action depends only on agent_pos (the pixels are noise): after a short run each head's
    chunks follow the rule far better than the untrained model's."""
    demos = toy_demos(episodes=48, length=4)
    lr = 3e-3 if head == "flow" else 1e-2  # the tokens head learns the rule only through LoRA and its rows
    cfg = tiny_config(tmp_path, head, 150, **{"optim.lr": lr, "schedule.warmup_steps": 10, "data.batch_size": 16,
                                              "policy.lora_rank": 8, "train.log_every": 50})
    result = train_vla(cfg, demos, tiny_lm(tokenizer), tokenizer)
    trained = load_vla(result.final_model_path)
    untrained = tiny_vla(tokenizer, head=head, lora_rank=8).eval()
    rng = np.random.default_rng(7)
    pos = rng.uniform(0, 512, (12, 2)).astype(np.float32)
    pixels = torch.as_tensor(rng.integers(0, 256, (12, 1, 16, 16, 3), dtype=np.uint8))
    want = torch.as_tensor(rule(pos))[:, None]

    def error(model):
        chunk = model.predict_action_chunk(pixels, torch.as_tensor(pos)[:, None], torch.Generator().manual_seed(0))
        return (chunk - want).abs().mean().item()

    assert error(trained) < error(untrained) / 2  # held-out positions: the rule, not the 48 seen ones
    assert error(trained) < (25 if head == "flow" else 60)  # (the tokens head's bins are 16 wide here)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="head"):
        VLAConfig(head="discrete")
    with pytest.raises(ValueError, match="n_obs_steps"):
        VLAConfig(n_obs_steps=2)
    with pytest.raises(ValueError, match="patch_size"):
        VLAConfig(crop_size=84, patch_size=10)


@pytest.mark.slow
def test_smollm2_vla_prefix_and_action_tokens():
    from tokenmind.model.load import load_model

    start = load_model("smollm2", dtype=torch.float32)
    model = build_vla(VLAConfig(head="tokens", lm_layers=2), start.model, start.tokenizer)
    assert len(model.language_model.layers) == 2
    assert model.action_token_ids[0].item() == 49152 - 256 and model.action_token_ids[-1].item() == 49151
    assert start.tokenizer.id_to_token(model.vlm.image_token_id) == "<empty_output>"
    pixels = torch.zeros(1, 1, 96, 96, 3, dtype=torch.uint8)
    context = model.encode_obs(pixels, torch.tensor([[[256.0, 256.0]]]))
    assert context.shape == (1, model.prefix_length, 576) and torch.isfinite(context).all()
