"""A wall-time budget for a training run (`train.max_minutes`): how many steps fit.

A fixed step count makes a run's length depend on the machine: the speedrun's 800 pre-training
steps take 6 minutes where the CPU computes bf16 natively and 27 where it is emulated. With a
budget the trainer times its steps (the first of each process, which pays compilation and
warm-up, is left out of the rate but counts against the budget) and, after PROBE_STEPS of them,
sets the step count to min(train.steps, what fits). The LR schedule is a function of the step and
the total (`schedule.py`), so the shorter run gets the whole schedule, cool-down included, rather
than being cut off mid-decay. Early steps are often slower than later ones (caches, allocator), so
the count is estimated again every PROBE_STEPS steps for as long as the new count leaves the steps
already taken on the same LR curve: through warmup, WSD's stable phase, or all of a constant
schedule. Time the estimate cannot see (evaluations, checkpoints, the final export) is not in it:
leave headroom in the budget for them.
"""

from __future__ import annotations

import math

from .config import ScheduleSection

PROBE_STEPS = 8  # timed steps before the first estimate, and between estimates; the rate is the median
# of every timed step so far (one slow step, an evaluation say, does not skew it)


def steps_within_budget(step: int, seconds_per_step: float, elapsed_s: float, budget_s: float,
                        configured_steps: int) -> int:
    """The run's total step count: `step` done after `elapsed_s` seconds, each further step taking
    `seconds_per_step`, all to end within `budget_s`; never more than configured, never fewer than done."""
    if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
        raise ValueError(f"seconds_per_step must be a positive number, got {seconds_per_step}")
    more = math.floor(max(0.0, budget_s - elapsed_s) / seconds_per_step)
    return max(step, min(configured_steps, step + more))


def same_lr_so_far(cfg: ScheduleSection, steps_done: int, total_a: int, total_b: int) -> bool:
    """Whether steps 0..steps_done-1 get the same lr under either total step count: within warmup
    (cosine), before both WSD decays start, always for a constant schedule."""
    if cfg.name == "constant":
        return True
    if cfg.name == "wsd":
        decay_start = min(t - max(1, round(cfg.decay_fraction * t)) for t in (total_a, total_b))
        return steps_done <= max(decay_start, cfg.warmup_steps)
    return steps_done <= cfg.warmup_steps
