"""The PushT environment (gym-pusht's `gym_pusht/PushT-v0`, the diffusion-policy benchmark task).

A circular agent (radius 15) pushes a T-shaped block (two 120×30 and 30×90 boxes, friction 1) on a
512×512 table towards a fixed goal pose (256, 256, π/4). The action is the agent's *target* position
in [0, 512]²; a PD controller moves the agent there over 10 physics steps of 0.01 s (10 Hz control).
Space damping is 0, so the block stops the moment nothing pushes it (quasi-static pushing). Reward is
the coverage of the goal by the block (intersection area / T area); an episode succeeds, and
terminates, when coverage > 0.95, and is truncated after 300 steps.

`make_env` returns it with observations {"pixels": (S, S, 3) uint8, "agent_pos": (2,) float64,
"block_pose": (3,) float64}. Pixel policies read only the camera and the robot's own encoders
(pixels, agent_pos); low-dimensional state policies (the Diffusion Policy paper's "low-dim" PushT)
read the block's pose (x, y, θ) instead of the image, as a motion-capture system would give it. The
scripted expert reads the full state from the simulator itself (`PushTState.read(env)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium
import numpy as np

ENV_ID = "gym_pusht/PushT-v0"
MAX_STEPS = 300  # the registered TimeLimit
SUCCESS_COVERAGE = 0.95
FPS = 10  # control rate: one action per 0.1 s


class BlockPoseObservation(gymnasium.ObservationWrapper):
    """Adds "block_pose" (x, y, θ of the block body, as `PushTState` reads it) to the env's observation
    dict: the low-dimensional state a state-based policy conditions on. Over the env's "state" observation
    type (no camera) the observation becomes {"agent_pos", "block_pose"}: the same two entries, with no
    frame rendered."""

    def __init__(self, env: gymnasium.Env):
        super().__init__(env)
        pose = gymnasium.spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float64)
        self.has_camera = isinstance(env.observation_space, gymnasium.spaces.Dict)
        spaces = (env.observation_space.spaces if self.has_camera else
                  {"agent_pos": gymnasium.spaces.Box(0, 512, shape=(2,), dtype=np.float64)})
        self.observation_space = gymnasium.spaces.Dict({**spaces, "block_pose": pose})

    def observation(self, observation) -> dict:
        u = self.env.unwrapped
        pose = np.array([*u.block.position, u.block.angle], dtype=np.float64)
        if self.has_camera:
            return {**observation, "block_pose": pose}
        return {"agent_pos": np.array(u.agent.position), "block_pose": pose}


def make_env(seed: int | None = None, render_size: int = 96, pixels: bool = True) -> gymnasium.Env:
    """PushT-v0 with {"pixels", "agent_pos", "block_pose"} observations (frames `render_size`² RGB). With a seed, the
    env's RNG is seeded (by one `reset(seed=seed)`): the episodes that later `reset()` calls draw are
    reproducible. `pixels=False` skips rendering (about 5× faster): observations {"agent_pos", "block_pose"},
    for planning, state policies and baselines that do not look."""
    import gym_pusht  # noqa: F401  (registers the env id)

    kwargs = {"obs_type": "pixels_agent_pos", "observation_width": render_size,
              "observation_height": render_size} if pixels else {"obs_type": "state"}
    env = BlockPoseObservation(gymnasium.make(ENV_ID, render_mode="rgb_array", **kwargs))
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


@dataclass
class PushTState:
    """The simulator's full state: agent position and velocity, block pose (x, y, θ of the pymunk body
    origin: the middle of the bar's outer edge) and velocities, and the goal pose. Enough to restore a copy exactly
    (`write`), unlike the env's own `reset_to_state`, which sets the angle after the position and so
    rotates the block about its centre of gravity away from the pose it was given."""

    agent_pos: np.ndarray
    agent_vel: np.ndarray
    block_pose: np.ndarray
    block_vel: np.ndarray  # (vx, vy, ω)
    goal_pose: np.ndarray

    @classmethod
    def read(cls, env: gymnasium.Env) -> PushTState:
        u = env.unwrapped
        return cls(np.array(u.agent.position), np.array(u.agent.velocity),
                   np.array([*u.block.position, u.block.angle]),
                   np.array([*u.block.velocity, u.block.angular_velocity]), np.array(u.goal_pose, dtype=float))

    def write(self, env: gymnasium.Env) -> None:
        """Put the simulator of `env` (already reset once) into this state, without stepping it."""
        u = env.unwrapped
        u.agent.position, u.agent.velocity = tuple(self.agent_pos), tuple(self.agent_vel)
        u.block.angle = float(self.block_pose[2])  # angle first: setting it rotates about the centre of gravity
        u.block.position = tuple(self.block_pose[:2])
        u.block.velocity, u.block.angular_velocity = tuple(self.block_vel[:2]), float(self.block_vel[2])
        u.goal_pose = np.array(self.goal_pose)
        u.space.reindex_shapes_for_body(u.block)
        u.space.reindex_shapes_for_body(u.agent)


def coverage(env: gymnasium.Env) -> float:
    """Fraction of the goal T covered by the block now (the env's reward before clipping)."""
    return float(env.unwrapped._get_coverage())
