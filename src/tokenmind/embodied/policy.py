"""Trained policies as the simulator loop drives them, and loading one from disk.

A policy (`demos.Policy`) is any object with `reset()` (a new episode begins) and `act(obs) ->
action`, obs being the environment's dict ({"pixels": (H, W, 3) uint8, "agent_pos": (2,),
"block_pose": (3,)}) and the action a (2,) target position; the scripted expert, the random baseline
and trained policies all fit it, so one evaluation loop scores them all.

`ChunkingPolicy` turns a model that predicts action chunks into such a policy by receding-horizon
control: it keeps the last T_o observations (repeating the first one at an episode's start) and a
queue of planned actions; when the queue is empty it samples a chunk of T_p actions and queues the
T_a starting at the current frame, so the model runs once every T_a steps.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import torch

from .demos import Policy
from .diffusion_policy import KIND, DiffusionPolicy, load_diffusion_policy


class ChunkingPolicy:
    """`model` (a `DiffusionPolicy`) as a `Policy`. seed: the sampling noise restarts from it at every
    `reset`, so an episode's actions depend only on its observations. steps: denoising steps per
    chunk (None: the model's num_inference_steps)."""

    def __init__(self, model: DiffusionPolicy, seed: int = 0, steps: int | None = None):
        self.model, self.seed, self.steps = model.eval(), seed, steps
        cfg = model.cfg
        self.n_obs_steps, self.n_action_steps = cfg.n_obs_steps, cfg.n_action_steps
        self.keys = {"agent_pos": np.float32}  # what the model reads of an observation (the VLA: pixels + agent_pos)
        if getattr(cfg, "uses_pixels", True):
            self.keys["pixels"] = np.uint8
        if getattr(cfg, "uses_block_pose", False):
            self.keys["block_pose"] = np.float32
        self.reads_pixels = "pixels" in self.keys
        self.device = next(model.parameters()).device
        self.generator = torch.Generator()
        self.observations: deque[dict[str, np.ndarray]] = deque(maxlen=cfg.n_obs_steps)
        self.actions: deque[np.ndarray] = deque()
        self.reset()

    def reset(self) -> None:
        self.observations.clear()
        self.actions.clear()
        self.generator.manual_seed(self.seed)

    def act(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        missing = [key for key in self.keys if key not in obs]
        if missing:
            raise KeyError(f"the observation lacks {missing}: this policy reads {list(self.keys)} (make_env's "
                           "observations have them all)")
        frame = {key: np.array(obs[key], dtype=dtype) for key, dtype in self.keys.items()}
        while len(self.observations) < self.n_obs_steps - 1:  # an episode's first frame stands in for the past
            self.observations.append(frame)
        self.observations.append(frame)
        if not self.actions:
            self.actions.extend(self.plan())
        return self.actions.popleft()

    def plan(self) -> list[np.ndarray]:
        """The next T_a actions from a chunk sampled for the current observation window."""
        window = {key: torch.from_numpy(np.stack([o[key] for o in self.observations]))[None].to(self.device)
                  for key in self.keys}
        block = {"block_pose": window["block_pose"]} if "block_pose" in window else {}  # state policies only
        chunk = self.model.predict_action_chunk(window.get("pixels"), window["agent_pos"], self.generator, self.steps,
                                                **block)[0].cpu().numpy()
        start = self.n_obs_steps - 1  # the chunk's row for the current frame
        return list(chunk[start:start + self.n_action_steps])


def policy_dir(path: str | Path) -> Path:
    """The folder holding a saved policy: `path` itself or a training run's `final/`."""
    for folder in (Path(path), Path(path) / "final"):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    raise FileNotFoundError(f"{path} holds no trained policy (config.json + model.safetensors); pass the run folder "
                            "of `tokenmind embodied train` or its final/ folder")


def load_policy(path: str | Path, seed: int = 0, steps: int | None = None, device: str = "cpu") -> Policy:
    """A trained policy from a run folder (or its final/ export), ready to `reset`/`act`."""
    folder = policy_dir(path)
    kind = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("kind")
    if kind == KIND:
        return ChunkingPolicy(load_diffusion_policy(folder, device), seed=seed, steps=steps)
    if kind == "vla":  # the vision-language-action model (vla.py) has the same chunk interface
        from .vla import load_vla

        return ChunkingPolicy(load_vla(folder, device), seed=seed, steps=steps)
    raise ValueError(f"{folder}/config.json names policy kind {kind!r}; this version loads {KIND!r} or 'vla'")
