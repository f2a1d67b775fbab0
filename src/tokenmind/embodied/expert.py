"""A scripted PushT expert that plans pushes from the full simulator state (no learning).

Each re-plan scores a set of candidate pushes by simulating them on a private copy of the simulator
(`PushTState.write` restores the exact state, velocities included):

* contact pushes: a point on the T's outline (spaced along all 8 edges), the agent placed just off it
  along the outward normal, then pushing into the block along the normal or ±`PUSH_TILT` off it
  (inside the friction cone: friction is 1, a 45° cone), the target advancing `speed` px a step;
* continuing pushes from where the agent is now, in 16 directions (no approach needed).

A candidate's score is the pose error after its best push length (the mean distance between the block's
T outline points and the goal's, in px) plus `STEP_COST` px per step it costs, approach included
(path length / approach speed). The winner is executed in the real env: the agent walks to the
pre-contact point along the shortest path around the block dilated by the agent's radius (a visibility
graph over the vertices of a larger dilation, so it rarely bumps the block), pushes for the chosen
number of steps, then re-plans. Pushes slow down as the error shrinks (success needs ~2 px, ~2°).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from tokenmind.embodied.env import PushTState, make_env

AGENT_RADIUS = 15.0
BAR = np.array([[-60.0, 0.0], [60.0, 0.0], [60.0, 30.0], [-60.0, 30.0]])  # body frame, as gym-pusht builds the T
STEM = np.array([[-15.0, 30.0], [15.0, 30.0], [15.0, 120.0], [-15.0, 120.0]])
OUTLINE = np.array([[-60, 0], [60, 0], [60, 30], [15, 30], [15, 120], [-15, 120], [-15, 30], [-60, 30]], float)
PUSH_TILT = math.radians(25)
STEP_COST = 1.0  # px of pose error one env step is worth
APPROACH_SPEED = 25.0  # px per env step when walking to a contact
PD_KP, PD_KV, DT, SUBSTEPS = 100.0, 20.0, 0.01, 10  # gym-pusht's control loop


def _rot(theta: float) -> np.ndarray:
    c, s = math.cos(theta), math.sin(theta)
    return np.array([[c, -s], [s, c]])


def _error_points() -> np.ndarray:
    """Points every ~10 px along the T's outline: the pose error compares these, block vs goal."""
    pts = []
    for a, b in zip(OUTLINE, np.roll(OUTLINE, -1, axis=0)):
        n = max(1, int(np.linalg.norm(b - a) // 10))
        pts += [a + (b - a) * k / n for k in range(n)]
    return np.array(pts)


ERROR_POINTS = _error_points()


def pose_error(block_pose: np.ndarray, goal_pose: np.ndarray) -> float:
    """Mean distance (px) between corresponding outline points of the block and the goal T."""
    a = ERROR_POINTS @ _rot(block_pose[2]).T + block_pose[:2]
    b = ERROR_POINTS @ _rot(goal_pose[2]).T + goal_pose[:2]
    return float(np.linalg.norm(a - b, axis=1).mean())


def _outward(point: np.ndarray, normal: np.ndarray) -> bool:
    """Whether a small step from an outline point along `normal` leaves the T."""
    q = point + 2.0 * normal
    return not any(box[0, 0] < q[0] < box[1, 0] and box[0, 1] < q[1] < box[2, 1] for box in (BAR, STEM))


def _contacts(spacing: float = 20.0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(point, outward unit normal) pairs in the body frame, about `spacing` px apart along each edge."""
    out = []
    for a, b in zip(OUTLINE, np.roll(OUTLINE, -1, axis=0)):
        edge = b - a
        length = float(np.linalg.norm(edge))
        n = max(1, round(length / spacing))
        for k in range(n):
            point = a + edge * (k + 0.5) / n
            normal = np.array([edge[1], -edge[0]]) / length
            out.append((point, normal if _outward(point, normal) else -normal))
    return out


CONTACTS = _contacts()


class ScriptedExpert:
    """Plans pushes by simulated lookahead (module docstring). `bind(env)` after each reset gives it the
    simulator to read the state from; `act(obs)` then returns the next target position."""

    def __init__(self, horizon: int = 8, step_cost: float = STEP_COST):
        self.horizon, self.step_cost = horizon, step_cost
        self.sim = make_env(pixels=False)
        self.sim.reset(seed=0)
        self.env = None
        self.plan: list[np.ndarray] = []

    def reset(self) -> None:
        self.plan = []

    def bind(self, env) -> None:
        self.env = env
        self.plan = []

    def act(self, obs: dict) -> np.ndarray:
        if self.env is None:
            raise RuntimeError("ScriptedExpert plans from the simulator's state: call bind(env) after env.reset()")
        if not self.plan:
            self.plan = self._replan(PushTState.read(self.env))
        return self.plan.pop(0).astype(np.float32)

    # --- planning -------------------------------------------------------------------------------------

    def _simulate(self, state: PushTState, start: np.ndarray, targets: list[np.ndarray]) -> list[float]:
        """Pose error after each target of a push that starts with the agent at rest at `start`."""
        state = PushTState(start, np.zeros(2), state.block_pose, np.zeros(3), state.goal_pose)
        state.write(self.sim)
        u = self.sim.unwrapped
        agent, block, space = u.agent, u.block, u.space
        errors = []
        for target in targets:
            tx, ty = float(target[0]), float(target[1])
            for _ in range(SUBSTEPS):
                px, py = agent.position
                vx, vy = agent.velocity
                agent.velocity = (vx + (PD_KP * (tx - px) - PD_KV * vx) * DT, vy + (PD_KP * (ty - py) - PD_KV * vy) * DT)
                space.step(DT)
            errors.append(pose_error(np.array([*block.position, block.angle]), state.goal_pose))
        return errors

    def _replan(self, state: PushTState) -> list[np.ndarray]:
        block, goal, agent = state.block_pose, state.goal_pose, state.agent_pos
        err0 = pose_error(block, goal)
        speed = float(np.clip(err0 * 0.4, 3.0, 12.0))
        rot = _rot(block[2])
        candidates = []  # (start, direction, approach steps)
        for p, n in CONTACTS:
            wp, wn = rot @ p + block[:2], rot @ n
            start = wp + wn * (AGENT_RADIUS + 4.0)
            if not (AGENT_RADIUS + 6 <= start[0] <= 506 - AGENT_RADIUS and AGENT_RADIUS + 6 <= start[1] <= 506 - AGENT_RADIUS):
                continue
            dist = float(np.linalg.norm(start - agent))
            for tilt in (-PUSH_TILT, 0.0, PUSH_TILT):
                candidates.append((start, _rot(tilt) @ -wn, dist))
        for k in range(16):
            a = 2 * math.pi * k / 16
            candidates.append((agent.copy(), np.array([math.cos(a), math.sin(a)]), 0.0))
        best = None
        for start, direction, dist in candidates:
            approach = 0 if dist < 3 else math.ceil(dist * 1.2 / APPROACH_SPEED) + 2
            targets = [start + direction * speed * (j + 1) for j in range(self.horizon)]
            errors = self._simulate(state, start, targets)
            for j, e in enumerate(errors):
                score = e + self.step_cost * (approach + j + 1)
                if best is None or score < best[0]:
                    best = (score, start, targets[: j + 1], dist)
        _, start, push, dist = best
        path = [] if dist < 3 else self._path(state, start)
        return path + push

    def _path(self, state: PushTState, goal: np.ndarray) -> list[np.ndarray]:
        """Targets that walk the agent to `goal` around the block (visibility graph, module docstring)."""
        from shapely.geometry import LineString, Polygon
        from shapely.ops import unary_union

        rot, pos = _rot(state.block_pose[2]), state.block_pose[:2]
        t = unary_union([Polygon(BAR @ rot.T + pos), Polygon(STEM @ rot.T + pos)])
        obstacle = t.buffer(AGENT_RADIUS + 3.0, quad_segs=2)
        nodes_poly = t.buffer(AGENT_RADIUS + 8.0, quad_segs=2, join_style="mitre", mitre_limit=2.0)
        nodes = [state.agent_pos, goal] + [np.array(c) for c in nodes_poly.exterior.coords[:-1]]
        free = lambda a, b: not LineString([a, b]).crosses(obstacle) and not LineString([a, b]).within(obstacle)  # noqa: E731
        # Dijkstra from the agent (node 0) to the goal (node 1).
        dist, prev, heap = {0: 0.0}, {}, [(0.0, 0)]
        while heap:
            d, i = heapq.heappop(heap)
            if i == 1:
                break
            if d > dist.get(i, math.inf):
                continue
            for j in range(1, len(nodes)):
                if j == i:
                    continue
                w = float(np.linalg.norm(nodes[j] - nodes[i]))
                if d + w < dist.get(j, math.inf) and free(nodes[i], nodes[j]):
                    dist[j], prev[j] = d + w, i
                    heapq.heappush(heap, (d + w, j))
        if 1 not in prev:
            waypoints = [goal]
        else:
            waypoints, i = [], 1
            while i != 0:
                waypoints.append(nodes[i])
                i = prev[i]
            waypoints.reverse()
        # Resample the polyline into targets APPROACH_SPEED apart, ending with a few at the goal to settle.
        targets, here = [], state.agent_pos.astype(float)
        for w in waypoints:
            seg = w - here
            n = max(1, math.ceil(np.linalg.norm(seg) / APPROACH_SPEED))
            targets += [here + seg * (k + 1) / n for k in range(n)]
            here = w
        return targets + [goal, goal]
