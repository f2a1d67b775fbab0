"""The diffusion policy on synthetic demonstrations: its objective, sampling, normalisation, training on
the one Trainer (exact resume, EMA, export) and the receding-horizon runner, all with tiny networks."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenmind.embodied.diffusion_policy import DiffusionPolicy, DiffusionPolicyConfig, Normalizer, crop
from tokenmind.embodied.policy import ChunkingPolicy, load_policy
from tokenmind.embodied.policy_train import (
    EMA,
    ChunkDenoisingObjective,
    ChunkLoader,
    episode_bounds,
    exported_state,
    load_policy_config,
    train_policy,
)
from tokenmind.jsonl import read_jsonl

torch.set_num_threads(1)

TINY = {"n_obs_steps": 2, "horizon": 8, "n_action_steps": 4, "image_size": 16, "crop_size": 12,
        "vision_channels": [8, 16], "num_keypoints": 4, "obs_feature_dim": 8, "down_dims": [16, 32], "groups": 4,
        "kernel_size": 3, "time_embed_dim": 16, "num_train_timesteps": 50, "num_inference_steps": 10}


def rule(agent_pos: np.ndarray) -> np.ndarray:
    """The toy expert: steer to the mirror image of the agent's position."""
    return np.stack([512 - agent_pos[..., 0], 100 + 0.5 * agent_pos[..., 1]], axis=-1).astype(np.float32)


def toy_demos(episodes: int = 24, length: int = 12, seed: int = 0) -> SimpleNamespace:
    """Demonstrations-shaped arrays: each episode holds the agent still at a random position, random
    noise for pixels, and the rule's action at every frame."""
    rng = np.random.default_rng(seed)
    pos = np.repeat(rng.uniform(0, 512, (episodes, 2)), length, axis=0).astype(np.float32)
    n = episodes * length
    return SimpleNamespace(pixels=rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8), agent_pos=pos,
                           action=rule(pos), episode_index=np.repeat(np.arange(episodes), length),
                           frame_index=np.tile(np.arange(length), episodes),
                           block_pose=rng.uniform([100, 100, -np.pi], [400, 400, np.pi], (n, 3)).astype(np.float32))


def tiny_config(tmp_path, steps: int = 6, **overrides):
    values = {**{f"policy.{k}": v for k, v in TINY.items()}, "data.batch_size": 8, "train.steps": steps,
              "train.out_dir": str(tmp_path / "run"), "train.precision": "fp32", "train.device": "cpu",
              "schedule.warmup_steps": 0, "train.ema_decay": 0.99, **overrides}
    return load_policy_config(overrides=values)


def tiny_policy(**overrides) -> DiffusionPolicy:
    torch.manual_seed(0)
    policy = DiffusionPolicy(DiffusionPolicyConfig(**{**TINY, **overrides}))
    demos = toy_demos()
    block = demos.block_pose[:, :2] if policy.cfg.uses_block_pose else None
    policy.normalizer.fit(demos.agent_pos, demos.action, block)
    return policy


def test_normalizer_round_trip_and_range():
    demos = toy_demos()
    norm = Normalizer(2, 2).fit(demos.agent_pos, demos.action)
    x = torch.as_tensor(demos.action)
    scaled = norm.normalize("action", x)
    assert scaled.min() >= -1 - 1e-6 and scaled.max() <= 1 + 1e-6
    assert torch.allclose(scaled.amin(0), torch.full((2,), -1.0)) and torch.allclose(scaled.amax(0), torch.ones(2))
    assert torch.allclose(norm.unnormalize("action", scaled), x, atol=1e-3)
    constant = Normalizer(1, 1).fit(np.full((5, 1), 7.0), np.full((5, 1), 3.0))  # no spread: no division by 0
    assert torch.allclose(constant.unnormalize("state", constant.normalize("state", torch.tensor([[7.0]]))),
                          torch.tensor([[7.0]]))


def test_loader_windows_repeat_at_episode_edges():
    demos = toy_demos(episodes=3, length=5)
    demos.action = np.arange(15, dtype=np.float32)[:, None].repeat(2, 1)
    loader = ChunkLoader(demos.pixels, demos.agent_pos, demos.action, demos.episode_index, np.arange(15), 2, 8, 4,
                         shuffle=False)
    batch = loader.window(torch.tensor([5, 9]))  # the first and the last frame of episode 1
    assert batch.pixels.shape == (2, 2, 16, 16, 3) and batch.action.shape == (2, 8, 2)
    assert batch.action[0, :, 0].tolist() == [5, 5, 6, 7, 8, 9, 9, 9]  # the past before the start repeats frame 5
    assert batch.action[1, :, 0].tolist() == [8, 9, 9, 9, 9, 9, 9, 9]  # the future past the end repeats the last
    assert torch.equal(batch.pixels[0, 0], batch.pixels[0, 1])
    first, last = episode_bounds(np.array([0, 0, 1, 1, 1]))
    assert first.tolist() == [0, 0, 2, 2, 2] and last.tolist() == [1, 1, 4, 4, 4]
    with pytest.raises(ValueError, match="not contiguous"):
        episode_bounds(np.array([0, 1, 0]))


def test_crop_random_and_centre():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    assert torch.equal(crop(x, 4, None), x[:, :, 1:5, 1:5])
    a, b = crop(x, 4, torch.Generator().manual_seed(1)), crop(x, 4, torch.Generator().manual_seed(1))
    assert a.shape == (2, 3, 4, 4) and torch.equal(a, b)


@pytest.mark.parametrize("objective,prediction", [("ddpm", "epsilon"), ("ddpm", "sample"), ("flow", "epsilon")])
def test_objective_loss_on_a_batch(objective, prediction):
    policy = tiny_policy(objective=objective, prediction_type=prediction,
                         sampler="euler" if objective == "flow" else "ddim", noise_draws=2)
    demos = toy_demos()
    loader = ChunkLoader(demos.pixels, demos.agent_pos, demos.action, demos.episode_index,
                         np.arange(len(demos.action)), 2, 8, 8, seed=3)
    batch = next(loader)
    objective_fn = ChunkDenoisingObjective(policy.cfg)
    terms = objective_fn(policy, batch, "fp32")
    assert terms.count == 8 and terms.loss.ndim == 0 and torch.isfinite(terms.loss)
    # an untrained network's output is ~0, so each sample's loss is about the target's mean square
    assert 0.05 < terms.loss.item() / 8 < 5
    assert torch.equal(terms.loss, objective_fn(policy, batch, "fp32").loss)  # the batch's noise_seed fixes the draws
    terms.loss.backward()
    assert policy.encoder.stem[0].weight.grad.abs().sum() > 0  # the encoder trains end to end
    assert policy.denoiser.final[1].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("objective,sampler", [("ddpm", "ddim"), ("ddpm", "ddpm"), ("flow", "euler")])
def test_sampling_returns_a_chunk_in_range(objective, sampler):
    policy = tiny_policy(objective=objective, sampler=sampler).eval()
    demos = toy_demos()
    pixels = torch.as_tensor(demos.pixels[:6]).view(3, 2, 16, 16, 3)
    pos = torch.as_tensor(demos.agent_pos[:6]).view(3, 2, 2)
    chunk = policy.predict_action_chunk(pixels, pos, torch.Generator().manual_seed(0))
    assert chunk.shape == (3, 8, 2)
    low, high = policy.normalizer.action_min, policy.normalizer.action_max
    assert (chunk >= low - 1e-3).all() and (chunk <= high + 1e-3).all()
    again = policy.predict_action_chunk(pixels, pos, torch.Generator().manual_seed(0))
    assert torch.equal(chunk, again)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="n_action_steps"):
        DiffusionPolicyConfig(horizon=16, n_obs_steps=2, n_action_steps=16)
    with pytest.raises(ValueError, match="halve"):
        DiffusionPolicyConfig(horizon=10, down_dims=(64, 128, 256))
    with pytest.raises(ValueError, match="euler"):
        DiffusionPolicyConfig(objective="flow", sampler="ddim")


def test_state_policy_conditions_on_the_block_pose_without_a_cnn():
    """obs_mode=state: no image encoder; per step normalised agent position, block x, y, sin θ, cos θ."""
    policy = tiny_policy(obs_mode="state")
    assert policy.encoder is None and policy.cond_dim == 2 * (2 + 4)
    demos = toy_demos()
    pos = torch.as_tensor(demos.agent_pos[:4]).view(2, 2, 2)
    block = torch.as_tensor(demos.block_pose[:4]).view(2, 2, 3)
    cond = policy.encode_obs(None, pos, block_pose=block)
    assert cond.shape == (2, 12) and cond.abs().max() <= 1 + 1e-5
    turned = block.clone()
    turned[..., 2] += 2 * np.pi  # the same pose: the angle enters only through sin and cos
    assert torch.allclose(policy.encode_obs(None, pos, block_pose=turned), cond, atol=1e-5)
    assert torch.allclose(cond.view(2, 2, 6)[..., 4:], torch.stack([block[..., 2].sin(), block[..., 2].cos()], -1))
    loader = ChunkLoader(None, demos.agent_pos, demos.action, demos.episode_index, np.arange(len(demos.action)), 2,
                         8, 8, block_pose=demos.block_pose)
    batch = next(loader)
    assert batch.pixels is None and batch.block_pose.shape == (8, 2, 3)
    terms = ChunkDenoisingObjective(policy.cfg)(policy, batch, "fp32")
    terms.loss.backward()
    assert policy.denoiser.final[1].weight.grad.abs().sum() > 0
    chunk = policy.eval().predict_action_chunk(None, pos, torch.Generator().manual_seed(0), block_pose=block)
    assert chunk.shape == (2, 8, 2)
    both = tiny_policy(obs_mode="pixels+state")
    assert both.encoder is not None and both.cond_dim == 2 * (8 + 2 + 4)


def test_a_state_policy_plays_the_same_episodes_without_rendering():
    """The evaluator steps a state policy in an env that renders nothing: its actions must not change."""
    from tokenmind.embodied.demos import run_episode
    from tokenmind.embodied.env import make_env

    runner = ChunkingPolicy(tiny_policy(obs_mode="state"), seed=0)
    assert not runner.reads_pixels and ChunkingPolicy(tiny_policy(), seed=0).reads_pixels
    played = []

    def play(env):
        actions = []
        act = runner.act
        runner.act = lambda obs: actions.append(act(obs)) or actions[-1]
        ep = run_episode(env, runner, seed=7, max_steps=12, keep_frames=False)
        del runner.act
        played.append((np.stack(actions), ep["coverage"]))

    play(make_env())
    play(make_env(pixels=False))
    (seen, seen_cov), (blind, blind_cov) = played
    assert seen.shape == (12, 2) and np.array_equal(seen, blind) and seen_cov == blind_cov


def test_obs_mode_mismatches_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="obs_mode='depth' is not one of pixels, state"):
        DiffusionPolicyConfig(obs_mode="depth")
    demos = toy_demos()
    pos = torch.as_tensor(demos.agent_pos[:2]).view(1, 2, 2)
    with pytest.raises(ValueError, match="conditions on the block pose"):
        tiny_policy(obs_mode="state").encode_obs(None, pos)
    with pytest.raises(ValueError, match="conditions on pixels"):
        tiny_policy().encode_obs(None, pos)
    with pytest.raises(ValueError, match="block positions given"):
        Normalizer(2, 2).fit(demos.agent_pos, demos.action, demos.block_pose[:, :2])
    old = SimpleNamespace(**{**vars(demos), "block_pose": None})  # recorded before the column existed
    with pytest.raises(ValueError, match="no block_pose column.*tokenmind embodied record"):
        train_policy(tiny_config(tmp_path, **{"policy.obs_mode": "state"}), old)
    train_policy(tiny_config(tmp_path / "pixels", steps=1), old)  # pixel policies still train on them


def test_state_policy_save_load_round_trip(tmp_path):
    demos = toy_demos()
    result = train_policy(tiny_config(tmp_path, steps=2, **{"policy.obs_mode": "state"}), demos)
    config = json.loads((result.out_dir / "final" / "config.json").read_text())
    assert config["policy"]["obs_mode"] == "state"
    policy = load_policy(result.out_dir, seed=1)
    assert policy.model.cfg.obs_mode == "state" and policy.model.encoder is None
    obs = [{"agent_pos": demos.agent_pos[i], "block_pose": demos.block_pose[i]} for i in range(6)]  # no pixels needed

    def rollout(p):
        p.reset()
        return np.stack([p.act(o) for o in obs])

    actions = rollout(policy)
    assert actions.shape == (6, 2) and np.array_equal(actions, rollout(load_policy(result.out_dir, seed=1)))
    weights = load_policy(result.out_dir).model.state_dict()
    assert torch.equal(weights["normalizer.block_max"], torch.as_tensor(demos.block_pose[:, :2].max(0)))
    with pytest.raises(KeyError, match="block_pose"):
        policy.act({"pixels": demos.pixels[0], "agent_pos": demos.agent_pos[0]})


def test_ema_update_and_export():
    policy = tiny_policy()
    params = list(policy.parameters())
    policy.ema = EMA(params, max_decay=0.5, power=1.0)
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    decay = policy.ema.update(params)  # 1 − (1 + 1)^−1 = 0.5
    assert decay == 0.5 and int(policy.ema.updates) == 1
    assert torch.allclose(policy.ema.shadows()[0], before[0] + 0.5)
    state = exported_state(policy)
    assert not any(k.startswith("ema.") for k in state)
    assert torch.allclose(state["encoder.stem.0.weight"], before[0] + 0.5)
    assert torch.equal(state["normalizer.action_max"], policy.normalizer.action_max)


def test_exact_resume_equals_uninterrupted_run(tmp_path):
    demos = toy_demos()
    constant = {"schedule.name": "constant"}  # the LR schedule must not depend on where the first run stopped
    full = train_policy(tiny_config(tmp_path / "a", steps=6, **constant), demos)
    train_policy(tiny_config(tmp_path / "b", steps=3, **constant), demos)
    resumed = train_policy(tiny_config(tmp_path / "b", steps=6, **constant), demos)
    assert resumed.losses == full.losses[3:]
    a = load_policy(full.out_dir).model.state_dict()
    b = load_policy(resumed.out_dir).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the EMA continued exactly too
    rows = list(read_jsonl(full.metrics_path))
    assert any("ema_decay" in r for r in rows) and any("samples_per_s" in r for r in rows)


@pytest.mark.slow
def test_training_learns_the_toy_rule(tmp_path):
    """A couple of hundred steps on the toy demonstrations: the sampled actions follow the rule, which
    depends only on agent_pos (the pixels are noise), far better than the untrained policy."""
    demos = toy_demos(episodes=32, length=8)
    cfg = tiny_config(tmp_path, steps=200, **{"optim.lr": 3e-3, "data.batch_size": 32, "train.ema_decay": 0.95,
                                              "schedule.warmup_steps": 20, "policy.noise_draws": 4,
                                              "train.log_every": 50})
    result = train_policy(cfg, demos)
    trained = load_policy(result.out_dir).model
    untrained = tiny_policy()
    rng = np.random.default_rng(7)
    pos = rng.uniform(0, 512, (16, 2)).astype(np.float32)
    pixels = torch.as_tensor(rng.integers(0, 256, (16, 2, 16, 16, 3), dtype=np.uint8))
    window = torch.as_tensor(pos)[:, None].repeat(1, 2, 1)
    want = torch.as_tensor(rule(pos))[:, None]

    def error(policy):
        chunk = policy.predict_action_chunk(pixels, window, torch.Generator().manual_seed(0))
        return (chunk - want).norm(dim=-1).mean().item()

    trained_error, untrained_error = error(trained), error(untrained)
    assert trained_error < 60, trained_error  # in env units (pixels); the actions span ~400
    assert trained_error < untrained_error / 3, (trained_error, untrained_error)


def test_load_policy_round_trip_and_receding_horizon(tmp_path):
    demos = toy_demos()
    result = train_policy(tiny_config(tmp_path, steps=2), demos)
    obs = [{"pixels": demos.pixels[i], "agent_pos": demos.agent_pos[i].astype(np.float64)} for i in range(10)]

    def rollout(policy):
        policy.reset()
        return np.stack([policy.act(o) for o in obs])

    first, second = load_policy(result.out_dir, seed=3), load_policy(result.out_dir / "final", seed=3)
    actions = rollout(first)
    assert actions.shape == (10, 2)
    assert np.array_equal(actions, rollout(second))  # same files, same seed: same actions
    assert np.array_equal(actions, rollout(first))  # reset restarts the noise
    calls = []
    runner = ChunkingPolicy(first.model, seed=3)
    plan = runner.plan
    runner.plan = lambda: calls.append(1) or plan()
    for o in obs:
        runner.act(o)
    assert len(calls) == 3  # re-plans every n_action_steps = 4 steps: at steps 0, 4 and 8
    assert obs[0]["agent_pos"].dtype == np.float64  # the caller's observation is not modified
    with pytest.raises(FileNotFoundError, match="no trained policy"):
        load_policy(tmp_path / "nothing")
