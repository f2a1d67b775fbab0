"""A scripted PushT expert that plans pushes from the full simulator state (no learning).

Each re-plan scores a set of candidate pushes by simulating them on a private copy of the simulator
(`PushTState.write` restores the exact state, velocities included):

* contact pushes: a point on the T's outline (spaced along all 8 edges), the agent placed just off it
  along the outward normal, then pushing into the block along the normal or ±`PUSH_TILT` off it
  (inside the friction cone: friction is 1, a 45° cone), the target advancing `speed` px a step;
* when the agent touches the block: continuing pushes from where it is, in the 8 of 16 directions that
  point at the block (no approach needed).

The pose error is the mean distance between the block's T outline points and the goal's (px). A
candidate is scored by the rate at which it shrinks the error: log(error after / error now) divided by
its steps — the approach (path length / approach speed), its best push length (1..horizon), and
`OVERHEAD` — so a long walk must buy a large push, and in the end game, where success needs ~2 px and
~2°, small careful pushes win by the same rule. Predicted and actual errors agree closely, since the
lookahead runs the env's own physics and PD loop. The winner is executed in the real env: the agent walks to the
pre-contact point along the shortest path around the block dilated by the agent's radius (a visibility
graph over the vertices of a larger dilation, so it rarely bumps the block), pushes for the chosen
number of steps, then re-plans. Pushes slow down as the error shrinks (the target advances 0.4 × error
px a step, clipped to 3..12).
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
OVERHEAD = 2.0  # steps a re-plan is charged on top of its own (favours pushes that get somewhere)
CLEARANCE = 4.0  # px between the agent and the block before a push
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


def _distance_to_t(q: np.ndarray) -> float:
    """Distance from a body-frame point to the T (0 inside)."""
    def box(b):
        dx = max(b[0, 0] - q[0], 0.0, q[0] - b[1, 0])
        dy = max(b[0, 1] - q[1], 0.0, q[1] - b[2, 1])
        return math.hypot(dx, dy)
    return min(box(BAR), box(STEM))


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
            normal = normal if _outward(point, normal) else -normal
            if _distance_to_t(point + normal * (AGENT_RADIUS + CLEARANCE)) >= AGENT_RADIUS + CLEARANCE - 0.5:
                out.append((point, normal))  # the agent fits there (not in the notch beside the stem)
    return out


CONTACTS = _contacts()


class ScriptedExpert:
    """Plans pushes by simulated lookahead (module docstring). `bind(env)` after each reset gives it the
    simulator to read the state from; `act(obs)` then returns the next target position."""

    reads_pixels = False

    def __init__(self, horizon: int = 8, overhead: float = OVERHEAD):
        self.horizon, self.overhead = horizon, overhead
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
                agent.velocity = (vx + (PD_KP * (tx - px) - PD_KV * vx) * DT,
                                  vy + (PD_KP * (ty - py) - PD_KV * vy) * DT)
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
            start = wp + wn * (AGENT_RADIUS + CLEARANCE)
            if not np.all((AGENT_RADIUS + 6 <= start) & (start <= 506 - AGENT_RADIUS)):
                continue  # the agent would not fit between the block and the wall
            dist = float(np.linalg.norm(start - agent))
            for tilt in (-PUSH_TILT, 0.0, PUSH_TILT):
                candidates.append((start, _rot(tilt) @ -wn, dist))
        local = _rot(-block[2]) @ (agent - block[:2])
        if _distance_to_t(local) < AGENT_RADIUS + CLEARANCE:  # touching: also keep pushing from here
            for k in range(16):
                a = 2 * math.pi * k / 16
                direction = np.array([math.cos(a), math.sin(a)])
                if np.dot(direction, block[:2] + rot @ np.array([0.0, 45.0]) - agent) > 0:
                    candidates.append((agent.copy(), direction, 0.0))
        best = None
        for start, direction, dist in candidates:
            approach = 0 if dist < 3 else math.ceil(dist * 1.2 / APPROACH_SPEED) + 2
            targets = [start + direction * speed * (j + 1) for j in range(self.horizon)]
            errors = self._simulate(state, start, targets)
            for j, e in enumerate(errors):
                score = math.log(max(e, 0.5) / err0) / (approach + j + 1 + self.overhead)
                if best is None or score < best[0]:
                    best = (score, start, targets[: j + 1], dist)
        _, start, push, dist = best
        path = [] if dist < 3 else self._path(state, start)
        return path + push

    def _path(self, state: PushTState, goal: np.ndarray) -> list[np.ndarray]:
        """Targets that walk the agent to `goal` around the block (visibility graph, module docstring)."""
        from shapely.geometry import LineString, Point, Polygon
        from shapely.ops import unary_union

        rot, pos = _rot(state.block_pose[2]), state.block_pose[:2]
        t = unary_union([Polygon(BAR @ rot.T + pos), Polygon(STEM @ rot.T + pos)])
        obstacle = t.buffer(AGENT_RADIUS + CLEARANCE / 2, quad_segs=2)
        ring = t.buffer(AGENT_RADIUS + 10.0, quad_segs=2, join_style="mitre", mitre_limit=2.0).exterior
        here = state.agent_pos.astype(float)
        retreat = []
        if obstacle.contains(Point(here)):  # touching the block: back off to the ring first
            here = np.array(ring.interpolate(ring.project(Point(here))).coords[0])
            retreat = [here]
        nodes = [here, goal] + [np.array(c) for c in ring.coords[:-1]]

        def free(a, b):
            return not LineString([a, b]).intersects(obstacle)

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
        waypoints, i = [goal], 1
        if 1 in prev:
            waypoints = []
            while i != 0:
                waypoints.append(nodes[i])
                i = prev[i]
            waypoints.reverse()
        # Resample the polyline into targets APPROACH_SPEED apart, ending with a few at the goal to settle.
        targets, here = [], state.agent_pos.astype(float)
        for w in [*retreat, *waypoints]:
            seg = w - here
            n = max(1, math.ceil(np.linalg.norm(seg) / APPROACH_SPEED))
            targets += [here + seg * (k + 1) / n for k in range(n)]
            here = w
        return targets + [goal, goal]
