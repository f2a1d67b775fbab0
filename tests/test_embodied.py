"""PushT: the environment wrapper, exact state copies, the demonstrations dataset (layout, atomic save),
recording, the evaluation statistics, and the scripted expert against the random policy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tokenmind.embodied.demos import Demonstrations, record_demonstrations, run_episode
from tokenmind.embodied.env import PushTState, coverage, make_env
from tokenmind.embodied.evaluate import RandomPolicy, evaluate_policy, summarize


class GoTo:
    """A toy policy: always the same target."""

    def __init__(self, target=(256.0, 256.0)):
        self.target = np.array(target, dtype=np.float32)
        self.resets = 0

    def reset(self):
        self.resets += 1

    def act(self, obs):
        assert obs["pixels"].shape == (96, 96, 3)
        return self.target


def test_env_observations():
    env = make_env(seed=0)
    obs, info = env.reset(seed=5)
    assert set(obs) == {"pixels", "agent_pos", "block_pose"}
    assert np.array_equal(obs["block_pose"], PushTState.read(env).block_pose)  # the state policies' input
    assert obs["pixels"].shape == (96, 96, 3) and obs["pixels"].dtype == np.uint8
    assert obs["agent_pos"].shape == (2,)
    assert info["goal_pose"].tolist() == pytest.approx([256, 256, math.pi / 4])
    before = np.linalg.norm(obs["agent_pos"] - [100, 100])
    obs, _, _, _, info = env.step(np.array([100.0, 100.0]))
    assert 0.0 <= info["coverage"] <= 1.0 and np.linalg.norm(obs["agent_pos"] - [100, 100]) < before
    assert make_env(render_size=64).reset(seed=0)[0]["pixels"].shape == (64, 64, 3)
    # The same seed gives the same first episode.
    a, b = make_env().reset(seed=7)[1], make_env().reset(seed=7)[1]
    assert np.array_equal(a["block_pose"], b["block_pose"])


class Looking:
    """Wraps a policy as if it read the camera: the evaluator must then render every episode."""

    reads_pixels = True

    def __init__(self, policy):
        self.policy = policy

    def reset(self):
        self.policy.reset()

    def act(self, obs):
        assert "pixels" in obs
        return self.policy.act(obs)

    def bind(self, env):
        if hasattr(self.policy, "bind"):
            self.policy.bind(env)


def test_an_env_without_camera_gives_the_same_states_unrendered():
    seen, blind = make_env(), make_env(pixels=False)
    a, _ = seen.reset(seed=4)
    b, _ = blind.reset(seed=4)
    assert set(b) == {"agent_pos", "block_pose"} and blind.observation_space["block_pose"].shape == (3,)
    for action in ([300.0, 200.0], [120.0, 380.0], [250.0, 250.0]):
        a, _, _, _, info_a = seen.step(np.array(action))
        b, _, _, _, info_b = blind.step(np.array(action))
        assert all(np.array_equal(a[k], b[k]) for k in b) and info_a["coverage"] == info_b["coverage"]


def test_evaluation_renders_only_the_strips_of_a_policy_that_does_not_look(tmp_path):
    """A baseline that reads no pixels plays unrendered episodes except its strips, with the same results."""
    fast = evaluate_policy(RandomPolicy(seed=3), n_episodes=3, seed=40, max_steps=20, strip_dir=tmp_path / "a",
                           n_strips=1, name="random")
    rendered = evaluate_policy(Looking(RandomPolicy(seed=3)), n_episodes=3, seed=40, max_steps=20,
                               strip_dir=tmp_path / "b", n_strips=1, name="random")
    assert fast["episodes"] == rendered["episodes"] and len(fast["strips"]) == 1
    assert (tmp_path / "a" / "random_seed40.png").read_bytes() == (tmp_path / "b" / "random_seed40.png").read_bytes()


def test_a_solved_episode_played_unrendered_gets_its_strip_by_replay(tmp_path):
    from tokenmind.embodied.expert import ScriptedExpert

    fast = evaluate_policy(ScriptedExpert(), n_episodes=1, seed=1000, strip_dir=tmp_path / "a", n_strips=0,
                           name="expert")
    rendered = evaluate_policy(Looking(ScriptedExpert()), n_episodes=1, seed=1000, strip_dir=tmp_path / "b",
                               n_strips=0, name="expert")
    assert fast["episodes"] == rendered["episodes"] and fast["success_rate"] == 1.0
    strip = "expert_seed1000.png"
    assert (tmp_path / "a" / strip).read_bytes() == (tmp_path / "b" / strip).read_bytes()


def test_state_copy_is_exact_and_replays_identically():
    env = make_env(pixels=False)
    env.reset(seed=3)
    for _ in range(5):
        env.step(np.array([250.0, 250.0]))
    state = PushTState.read(env)
    copy = make_env(pixels=False)
    copy.reset(seed=11)  # a different episode, overwritten below
    state.write(copy)
    assert np.allclose(PushTState.read(copy).block_pose, state.block_pose)
    for k in range(15):  # push towards the block: both copies must move identically
        action = state.block_pose[:2] + np.array([np.cos(k), np.sin(k)]) * 10
        env.step(action)
        copy.step(action)
    assert np.allclose(PushTState.read(env).block_pose, PushTState.read(copy).block_pose)
    assert coverage(env) == pytest.approx(coverage(copy))


def _tiny_demos(n_frames=(3, 2)) -> Demonstrations:
    rng = np.random.default_rng(0)
    n = sum(n_frames)
    return Demonstrations(
        pixels=rng.integers(0, 256, (n, 96, 96, 3), dtype=np.uint8), agent_pos=rng.uniform(0, 512, (n, 2)),
        action=rng.uniform(0, 512, (n, 2)), episode_index=np.repeat(np.arange(len(n_frames)), n_frames),
        frame_index=np.concatenate([np.arange(k) for k in n_frames]), coverage=rng.uniform(0, 1, n),
        block_pose=rng.uniform(0, 512, (n, 3)), meta={"expert": "test"})


def test_demonstrations_round_trip_and_episodes(tmp_path):
    demos = _tiny_demos()
    assert demos.agent_pos.dtype == np.float32 and demos.episode_index.dtype == np.int64
    demos.save(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["data.npz", "meta.json"]
    back = Demonstrations.load(tmp_path / "d")
    for name in ("pixels", "agent_pos", "action", "episode_index", "frame_index", "coverage", "block_pose"):
        assert np.array_equal(getattr(back, name), getattr(demos, name))
    assert back.block_pose.dtype == np.float32 and back.block_pose.shape == (5, 3)
    assert back.meta["n_episodes"] == 2 and back.meta["n_frames"] == 5 and back.meta["expert"] == "test"
    assert back.episodes() == [slice(0, 3), slice(3, 5)]
    assert back.episode_starts.tolist() == [0, 3] and back.episode_ends.tolist() == [3, 5]
    with pytest.raises(ValueError, match="column action"):
        Demonstrations(**{**{k: getattr(demos, k) for k in ("pixels", "agent_pos", "episode_index", "frame_index",
                                                             "coverage")}, "action": demos.action[:2]})
    with pytest.raises(FileNotFoundError, match="embodied record"):
        Demonstrations.load(tmp_path / "missing")


def test_demonstrations_without_block_pose_still_load(tmp_path):
    """Folders recorded before the block_pose column existed load for pixel policies (block_pose None)."""
    demos = _tiny_demos()
    demos.block_pose = None
    demos.save(tmp_path / "old")
    with np.load(tmp_path / "old" / "data.npz") as data:
        assert "block_pose" not in data.files
    back = Demonstrations.load(tmp_path / "old")
    assert back.block_pose is None and np.array_equal(back.pixels, demos.pixels) and back.n_episodes == 2
    with pytest.raises(ValueError, match="column block_pose"):
        Demonstrations(**{k: getattr(demos, k) for k in ("pixels", "agent_pos", "action", "episode_index",
                                                         "frame_index", "coverage")}, block_pose=np.zeros((2, 3)))


def test_demonstrations_save_is_atomic(tmp_path, monkeypatch):
    old = _tiny_demos()
    old.save(tmp_path / "d")

    def broken_savez(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        _tiny_demos((1, 1, 1)).save(tmp_path / "d")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary left behind
    monkeypatch.undo()
    assert Demonstrations.load(tmp_path / "d").n_episodes == 2  # the old dataset is intact


def test_record_short_episodes(tmp_path):
    policy = GoTo()
    demos = record_demonstrations(tmp_path / "demos", n_episodes=2, seed=4, policy=policy, only_successful=False,
                                  progress=False, max_steps=6)
    assert len(demos) == 12 and demos.n_episodes == 2 and policy.resets == 2
    assert demos.frame_index.tolist() == list(range(6)) * 2
    assert np.all(demos.action == [256.0, 256.0])
    meta = json.loads((tmp_path / "demos" / "meta.json").read_text())
    assert meta["episode_seeds"] == [4, 5] and meta["episodes_tried"] == 2 and meta["expert"] == "GoTo"
    # The stored frames are the observations the actions were chosen from.
    obs, _ = make_env().reset(seed=5)
    assert np.array_equal(demos.pixels[6], obs["pixels"])
    assert np.allclose(demos.agent_pos[6], obs["agent_pos"])
    assert np.allclose(demos.block_pose[6], obs["block_pose"]) and demos.block_pose.shape == (12, 3)
    with pytest.raises(RuntimeError, match="none of 2 episodes succeeded"):
        record_demonstrations(None, n_episodes=1, seed=4, policy=GoTo(), progress=False, max_steps=2, max_tries=2)


def test_summarize_matches_hand_computation():
    episodes = [{"success": s, "max_coverage": c, "final_coverage": c / 2, "steps": 10}
                for s, c in [(True, 0.97), (False, 0.5), (False, 0.2), (False, 0.1)]]
    got = summarize(episodes)
    assert got["success_rate"] == 0.25
    assert got["success_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4))
    assert got["mean_coverage"] == pytest.approx(1.77 / 4)
    mean = 1.77 / 4
    std = math.sqrt(sum((c - mean) ** 2 for c in (0.97, 0.5, 0.2, 0.1)) / 3)
    assert got["coverage_se"] == pytest.approx(std / 2)
    assert got["mean_final_coverage"] == pytest.approx(1.77 / 8)


def test_evaluate_policy_on_a_toy_policy(tmp_path):
    result = evaluate_policy(GoTo((200.0, 300.0)), n_episodes=3, seed=20, max_steps=8, strip_dir=tmp_path, n_strips=2)
    assert [ep["seed"] for ep in result["episodes"]] == [20, 21, 22]
    # Replay each episode by hand: max coverage over its steps.
    env = make_env()
    for ep in result["episodes"]:
        env.reset(seed=ep["seed"])
        covs = [env.step(np.array([200.0, 300.0]))[4]["coverage"] for _ in range(8)]
        assert ep["max_coverage"] == pytest.approx(max(covs)) and ep["final_coverage"] == pytest.approx(covs[-1])
    assert result["mean_coverage"] == pytest.approx(np.mean([ep["max_coverage"] for ep in result["episodes"]]))
    assert result["success_rate"] == 0.0 and result["success_se"] == 0.0
    assert [p.split("/")[-1] for p in result["strips"]] == ["GoTo_seed20.png", "GoTo_seed21.png"]
    from PIL import Image

    assert Image.open(result["strips"][0]).size[1] == 2 * (96 + 4)  # one row of frames, scale 2


def test_random_policy_rarely_covers_the_goal():
    result = evaluate_policy(RandomPolicy(seed=0), n_episodes=2, seed=1000, max_steps=30)
    assert result["success_rate"] == 0.0 and result["mean_coverage"] < 0.5


@pytest.mark.slow
def test_expert_beats_random():
    from tokenmind.embodied.expert import ScriptedExpert

    seeds = range(1000, 1003)
    env = make_env()
    expert = [run_episode(env, ScriptedExpert(), s, keep_frames=False) for s in seeds]
    rand = [run_episode(env, RandomPolicy(), s, keep_frames=False) for s in seeds]
    assert np.mean([e["max_coverage"] for e in expert]) > np.mean([e["max_coverage"] for e in rand]) + 0.3
    assert sum(e["success"] for e in expert) >= 2


def test_cli_evaluate_and_record(tmp_path, capsys):
    from tokenmind.cli import main

    out = tmp_path / "random.json"
    assert main(["embodied", "evaluate", "--policy", "random", "--episodes", "2", "--max-steps", "4",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["n_episodes"] == 2 and [ep["seed"] for ep in result["episodes"]] == [1000, 1001]
    assert "random: success 0.0%" in capsys.readouterr().out
    assert main(["embodied", "evaluate", "--policy", str(tmp_path / "nope")]) == 2  # a clear error, no traceback
