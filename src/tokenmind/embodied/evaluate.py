"""Evaluating a PushT policy in simulation: success rate and coverage over seeded episodes.

Episode i starts from `env.reset(seed=seed + i)`, so every policy meets the same initial states
(the default seed 1000 keeps evaluation clear of the demonstrations' seeds 0, 1, …). Per episode:
success (coverage > 0.95 at some step; the env then terminates) and the *maximum* coverage over the
episode, the metric the diffusion-policy paper reports for PushT (final coverage is kept too).
Across episodes: success_rate ± sqrt(p(1−p)/n) and mean_coverage ± std/sqrt(n) (sample std).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from tokenmind.embodied.demos import replay_frames, run_episode
from tokenmind.embodied.env import MAX_STEPS, make_env


class RandomPolicy:
    """The floor: a uniformly random target position in [0, 512]² every step."""

    reads_pixels = False

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass

    def act(self, obs: dict) -> np.ndarray:
        return self.rng.uniform(0, 512, size=2).astype(np.float32)


def summarize(episodes: list[dict]) -> dict:
    """Success rate and mean max-coverage with their standard errors, from `run_episode` records."""
    n = len(episodes)
    if n == 0:
        raise ValueError("summarize: no episodes")
    p = sum(bool(ep["success"]) for ep in episodes) / n
    cov = np.array([ep["max_coverage"] for ep in episodes], dtype=float)
    final = np.array([ep["final_coverage"] for ep in episodes], dtype=float)
    se = float(cov.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return {"n_episodes": n, "success_rate": p, "success_se": math.sqrt(p * (1 - p) / n),
            "mean_coverage": float(cov.mean()), "coverage_se": se, "mean_final_coverage": float(final.mean()),
            "mean_steps": float(np.mean([ep["steps"] for ep in episodes]))}


def save_strip(frames: list[np.ndarray], path: str | Path, n: int = 8, scale: int = 2) -> Path:
    """n frames evenly spaced over an episode (first and last included) side by side, as a PNG."""
    import torch

    from tokenmind.diffusion.sampling import save_grid

    idx = np.unique(np.linspace(0, len(frames) - 1, min(n, len(frames))).round().astype(int))
    pixels = torch.from_numpy(np.stack([frames[i] for i in idx])).permute(0, 3, 1, 2).float() / 127.5 - 1
    return save_grid(pixels, path, nrow=len(idx), scale=scale)


def evaluate_policy(policy, n_episodes: int = 50, seed: int = 1000, max_steps: int = MAX_STEPS,
                    strip_dir: str | Path | None = None, n_strips: int = 3, progress: bool = False,
                    name: str | None = None) -> dict:
    """Run `policy` (reset/act, see `demos.Policy`) for n_episodes seeded episodes; return `summarize`'s
    statistics plus "episodes" (seed, success, steps, max/final coverage each) and "seconds". With
    strip_dir, the first n_strips episodes are also saved as frame strips `<name>_seed<S>.png`, and
    so is the first successful episode when none of those succeeded (a solved rollout to look at). A policy
    with `reads_pixels = False` plays in an env that renders nothing (the same physics and seeds, ~5×
    faster steps) except its first n_strips episodes; a later solved episode's strip is rendered by
    replaying its actions."""
    from tokenmind.progress import Bars

    name = name or type(policy).__name__
    env = make_env()
    blind = None if getattr(policy, "reads_pixels", True) else make_env(pixels=False)
    episodes, strips, drew_success = [], [], False
    start = time.perf_counter()
    with Bars(progress) as bars:
        advance = bars.add(f"eval {name}"[:14], n_episodes)
        for i in range(n_episodes):
            wanted = strip_dir is not None and (i < n_strips or not drew_success)
            rendered = blind is None or (wanted and i < n_strips)
            ep = run_episode(env if rendered else blind, policy, seed + i, max_steps, keep_frames=wanted and rendered)
            if wanted and (i < n_strips or ep["success"]):
                frames = [*ep["pixels"], ep["last_pixels"]] if rendered else replay_frames(env, seed + i, ep["action"])
                strips.append(str(save_strip(frames, Path(strip_dir) / f"{name}_seed{seed + i}.png")))
                drew_success |= ep["success"]
            episodes.append({k: ep[k] for k in ("seed", "success", "steps", "max_coverage", "final_coverage")})
            if advance:
                advance(1, f"{sum(e['success'] for e in episodes)}/{i + 1} succeeded")
    for e in (env, blind):
        if e is not None:
            e.close()
    return {"policy": name, **summarize(episodes), "seconds": round(time.perf_counter() - start, 1),
            "strips": strips, "episodes": episodes}


def format_result(result: dict) -> str:
    """One line: success rate ± SE, mean max-coverage ± SE, episodes, seconds."""
    return (f"{result['policy']}: success {result['success_rate']:.1%} ± {result['success_se']:.1%}, "
            f"max coverage {result['mean_coverage']:.3f} ± {result['coverage_se']:.3f} "
            f"over {result['n_episodes']} episodes ({result['seconds']} s)")


def write_result(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path
