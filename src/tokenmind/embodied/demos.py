"""Demonstrations for behaviour cloning: recorded PushT episodes, stored flat on disk.

LeRobot's dataset layout was the first choice, but its library does not install beside this
project's torch (lerobot 0.4.x pins torch < 2.11; 0.5+ needs Python ≥ 3.12), so the layout is our own,
with LeRobot's column meanings:

    DIR/data.npz    one array per column (zip-deflated: the frames are mostly white table), all frames
                    of all episodes in order
        pixels          (N, 96, 96, 3) uint8    the camera frame the action was chosen from
        agent_pos       (N, 2) float32          agent position (observation.state)
        block_pose      (N, 3) float32          the block's x, y, θ (observation.environment_state);
                                                absent from folders recorded before it existed
        action          (N, 2) float32          the target position sent to the env at that frame
        episode_index   (N,) int64              0..E−1, in recording order
        frame_index     (N,) int64              0..len−1 within the episode
        coverage        (N,) float32            goal coverage *after* the action (the reward signal)
    DIR/meta.json   {"format", "env_id", "fps", "n_frames", "n_episodes", "episode_seeds", "expert",
                     "only_successful", "episodes_tried", "success_rate_tried", "seconds", ...}

Pixel policies need no block_pose, so old folders still load (`block_pose` is then None); state
policies refuse them with the fix (re-record). Frame t pairs the observation before step t with the
action taken at it; the final observation (after the last action) is not stored. `save` writes through `atomic_directory`, so a killed recording
never leaves a half-written dataset under the name.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from tokenmind.embodied.env import ENV_ID, FPS, MAX_STEPS, make_env

FORMAT = "tokenmind-pusht-demos/1"
COLUMNS = {"pixels": np.uint8, "agent_pos": np.float32, "action": np.float32, "episode_index": np.int64,
           "frame_index": np.int64, "coverage": np.float32}
OPTIONAL_COLUMNS = {"block_pose": np.float32}  # None when absent (folders recorded before the column existed)


class Policy(Protocol):
    """What the recorder and `evaluate.evaluate_policy` drive: `reset()` before each episode, then
    `act(obs)` → the (2,) target position for obs = {"pixels", "agent_pos", "block_pose"}. A policy that
    plans from the simulator's full state (the scripted expert) also has `bind(env)`, called after each env reset.
    `reads_pixels = False` (absent: True) tells the evaluator it may step an env that renders no frames."""

    def reset(self) -> None: ...

    def act(self, obs: dict) -> np.ndarray: ...


@dataclass
class Demonstrations:
    """All frames of many episodes, flat (see the module docstring for the columns and files)."""

    pixels: np.ndarray
    agent_pos: np.ndarray
    action: np.ndarray
    episode_index: np.ndarray
    frame_index: np.ndarray
    coverage: np.ndarray
    block_pose: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.pixels)
        for name, dtype in {**COLUMNS, **OPTIONAL_COLUMNS}.items():
            if getattr(self, name) is None:
                continue
            value = np.asarray(getattr(self, name), dtype=dtype)
            if len(value) != n:
                raise ValueError(f"demonstrations: column {name} has {len(value)} rows, pixels has {n}")
            setattr(self, name, value)

    def __len__(self) -> int:
        return len(self.pixels)

    @property
    def n_episodes(self) -> int:
        return int(self.episode_index.max()) + 1 if len(self) else 0

    @property
    def episode_ends(self) -> np.ndarray:
        """(E,) exclusive end row of each episode (episodes are contiguous and in order)."""
        return np.searchsorted(self.episode_index, np.arange(self.n_episodes), side="right")

    @property
    def episode_starts(self) -> np.ndarray:
        return np.searchsorted(self.episode_index, np.arange(self.n_episodes), side="left")

    def episodes(self) -> list[slice]:
        """One row slice per episode: `demos.action[demos.episodes()[3]]` is episode 3's actions."""
        return [slice(int(s), int(e)) for s, e in zip(self.episode_starts, self.episode_ends)]

    def save(self, path: str | Path) -> Path:
        from tokenmind.model.checkpoint import atomic_directory

        meta = {"format": FORMAT, **self.meta, "n_frames": len(self), "n_episodes": self.n_episodes}
        with atomic_directory(path) as tmp:
            np.savez_compressed(tmp / "data.npz", **{name: getattr(self, name) for name in (*COLUMNS, *OPTIONAL_COLUMNS)
                                                     if getattr(self, name) is not None})
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Demonstrations:
        path = Path(path)
        if not (path / "data.npz").exists():
            raise FileNotFoundError(f"{path} holds no demonstrations (no data.npz): record some with "
                                    f"`tokenmind embodied record --out {path}`")
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        with np.load(path / "data.npz") as data:
            optional = {name: data[name] for name in OPTIONAL_COLUMNS if name in data.files}
            return cls(**{name: data[name] for name in COLUMNS}, **optional, meta=meta)


def run_episode(env, policy, seed: int, max_steps: int = MAX_STEPS, keep_frames: bool = True) -> dict:
    """One seeded episode: {"seed", "success", "steps", "max_coverage", "final_coverage", "coverage" and
    "action" (per step), and with keep_frames "pixels", "agent_pos", "block_pose" (per step, before its
    action) and "last_pixels" (the frame after the last step)}. Stops at success or max_steps."""
    obs, _ = env.reset(seed=seed)
    policy.reset()
    if hasattr(policy, "bind"):
        policy.bind(env)
    frames = {"pixels": [], "agent_pos": [], "block_pose": []}
    covs, actions, success = [], [], False
    for _ in range(max_steps):
        action = np.asarray(policy.act(obs), dtype=np.float32).reshape(2)
        actions.append(action)
        if keep_frames:
            frames["pixels"].append(obs["pixels"])
            frames["agent_pos"].append(np.asarray(obs["agent_pos"], dtype=np.float32))
            frames["block_pose"].append(np.asarray(obs["block_pose"], dtype=np.float32))
        obs, _, terminated, truncated, info = env.step(action)
        covs.append(float(info["coverage"]))
        if info["is_success"]:
            success = True
        if terminated or truncated:
            break
    out = {"seed": seed, "success": success, "steps": len(covs), "max_coverage": max(covs, default=0.0),
           "final_coverage": covs[-1] if covs else 0.0, "coverage": covs, "action": actions}
    return {**out, **frames, "last_pixels": obs["pixels"]} if keep_frames else out


def replay_frames(env, seed: int, actions: list[np.ndarray]) -> list[np.ndarray]:
    """The frames of the episode seeded `seed` in which `actions` were taken (the physics is deterministic):
    the first observation's and one after each action, as `run_episode`'s pixels + last_pixels."""
    obs, _ = env.reset(seed=seed)
    frames = [obs["pixels"]]
    for action in actions:
        frames.append(env.step(action)[0]["pixels"])
    return frames


def record_demonstrations(out_dir: str | Path | None, n_episodes: int, seed: int = 0, policy=None,
                          only_successful: bool = True, progress: bool = True, max_steps: int = MAX_STEPS,
                          max_tries: int | None = None) -> Demonstrations:
    """Roll out `policy` (default: the scripted expert) on episodes seeded seed, seed+1, … until
    `n_episodes` are kept — only successful ones unless only_successful=False — and save them to out_dir
    (when given). Gives up after max_tries episodes (default 3·n_episodes) with whatever it kept."""
    from tokenmind.progress import Bars

    if policy is None:
        from tokenmind.embodied.expert import ScriptedExpert

        policy = ScriptedExpert()
    max_tries = max_tries or 3 * n_episodes
    env = make_env()
    kept, seeds, tried, successes = [], [], 0, 0
    start = time.perf_counter()
    with Bars(progress) as bars:
        advance = bars.add("record", n_episodes)
        while len(kept) < n_episodes and tried < max_tries:
            ep = run_episode(env, policy, seed + tried, max_steps)
            tried += 1
            successes += ep["success"]
            if ep["success"] or not only_successful:
                kept.append(ep)
                seeds.append(ep["seed"])
                if advance:
                    advance(1, f"{successes}/{tried} succeeded")
    env.close()
    if not kept:
        raise RuntimeError(f"record: none of {tried} episodes succeeded; pass only_successful=False to keep failures")
    cols = {name: np.concatenate([np.asarray(ep[name]) for ep in kept])
            for name in ("pixels", "agent_pos", "block_pose", "action")}
    cols["coverage"] = np.concatenate([ep["coverage"] for ep in kept])
    cols["episode_index"] = np.concatenate([np.full(ep["steps"], i) for i, ep in enumerate(kept)])
    cols["frame_index"] = np.concatenate([np.arange(ep["steps"]) for ep in kept])
    meta = {"env_id": ENV_ID, "fps": FPS, "max_steps": max_steps, "episode_seeds": seeds,
            "expert": type(policy).__name__, "only_successful": only_successful, "episodes_tried": tried,
            "success_rate_tried": successes / tried, "seconds": round(time.perf_counter() - start, 1)}
    demos = Demonstrations(**cols, meta=meta)
    if out_dir is not None:
        demos.save(out_dir)
    return demos
