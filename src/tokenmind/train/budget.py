"""A wall-time budget for a training run (`train.max_minutes`): how many steps fit.

A fixed step count makes a run's length depend on the machine: the speedrun's 800 pre-training
steps take 6 minutes where the CPU computes bf16 natively and 27 where it is emulated. With a
budget the trainer times its first steps (the very first, which pays compilation and warm-up, is
left out of the rate but counts against the budget), then fixes the step count ONCE to
min(train.steps, what fits). The LR schedule is a function of the step and the total
(`schedule.py`), so the shorter run gets the whole schedule, cool-down included, rather than
being cut off mid-decay; deciding once, early (during warmup, or WSD's stable phase), keeps the
steps already taken on that same curve. Later time the estimate cannot see (evaluations,
checkpoints, the final export) is not in it: leave headroom in the budget for them.
"""

from __future__ import annotations

import math

PROBE_STEPS = 8  # timed steps the rate is measured over (their median: one slow step does not skew it)


def steps_within_budget(step: int, seconds_per_step: float, elapsed_s: float, budget_s: float,
                        configured_steps: int) -> int:
    """The run's total step count: `step` done after `elapsed_s` seconds, each further step taking
    `seconds_per_step`, all to end within `budget_s`; never more than configured, never fewer than done."""
    if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
        raise ValueError(f"seconds_per_step must be a positive number, got {seconds_per_step}")
    more = math.floor(max(0.0, budget_s - elapsed_s) / seconds_per_step)
    return max(step, min(configured_steps, step + more))
