"""train.max_minutes: the trainer fixes its step count once from its measured rate, trains the whole
LR schedule for that count, and keeps the count over a resume. Timed with a fake clock: every step
takes one second, the first (compilation, warm-up) five."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_helpers import Preempted, one_thread, pretrainer, tiny_config, write_shards  # noqa: F401

from tokenmind.jsonl import read_jsonl
from tokenmind.train.budget import PROBE_STEPS, same_lr_so_far, steps_within_budget
from tokenmind.train.config import ScheduleSection, load_config
from tokenmind.train.schedule import lr_multiplier

WSD = ["--schedule.name=wsd", "--schedule.warmup_steps=2", "--schedule.decay_fraction=0.3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"))


def test_steps_within_budget():
    assert steps_within_budget(9, 1.0, 13.0, 30.0, 40) == 26  # 17 s left: 17 more steps
    assert steps_within_budget(9, 1.0, 13.0, 30.0, 20) == 20  # the configured count fits: kept
    assert steps_within_budget(9, 2.5, 13.0, 30.0, 40) == 15  # floor(17 / 2.5) = 6 more
    assert steps_within_budget(9, 1.0, 45.0, 30.0, 40) == 9  # already over: stop where it is
    with pytest.raises(ValueError, match="seconds_per_step"):
        steps_within_budget(9, 0.0, 13.0, 30.0, 40)


@pytest.mark.parametrize("name", ["wsd", "cosine", "constant"])
def test_same_lr_so_far_is_sound_against_the_schedule(name):
    cfg = ScheduleSection(name=name, warmup_steps=5, decay_fraction=0.3)
    allowed = 0
    for a, b in ((40, 60), (60, 40), (40, 41), (30, 90)):
        for done in range(1, min(a, b) + 1):
            same = all(lr_multiplier(cfg, a, s) == lr_multiplier(cfg, b, s) for s in range(done))
            if same_lr_so_far(cfg, done, a, b):
                allowed += 1
                assert same, (a, b, done)  # never allows a change that rewrites the lr of a step taken
    assert allowed >= 4 * 5  # and does allow it through warmup at least


def fake_clock(trainer, first: float = 5.0, rest: float = 1.0, die_in_step: int | None = None,
               until: tuple[int, float] = (0, 0.0)):
    """Make `trainer` see a clock on which step 1 of this process takes `first` seconds and every other
    `rest` (steps up to until[0] take until[1]); optionally die as a killed job would as step `die_in_step`
    starts."""
    now = [1000.0]
    step = trainer.train_step
    calls = []

    def timed_step():
        if die_in_step is not None and trainer.step == die_in_step - 1:
            raise Preempted
        now[0] += first if not calls else until[1] if trainer.step < until[0] else rest
        calls.append(trainer.step)
        return step()

    trainer.clock = lambda: now[0]
    trainer.train_step = timed_step
    return trainer


def records(out_dir: Path) -> list[dict]:
    return list(read_jsonl(out_dir / "metrics.jsonl"))


def train_losses_and_lrs(out_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["lr"]) for r in records(out_dir) if "loss" in r]


def test_budget_fixes_the_step_count_and_trains_the_whole_schedule(shards, tmp_path):
    cfg = tiny_config(shards, tmp_path / "budget", "--train.steps=40", "--train.max_minutes=0.5", *WSD)
    result = fake_clock(pretrainer(cfg)).train()
    # steps 2..9 are the probe (1 s each); 5 + 8 = 13 s spent at step 9, 17 s left: 17 more steps
    assert result.steps == 26
    budget = [r for r in records(tmp_path / "budget") if "budget_steps" in r]
    assert [(r["step"], r["budget_steps"], r["budget_step_s"]) for r in budget] == [(1 + PROBE_STEPS, 26, 1.0)]
    # decided in WSD's stable phase, so the run is exactly a 26-step run: same losses, same lrs,
    # cool-down to min_lr_ratio included
    plain = tiny_config(shards, tmp_path / "plain", "--train.steps=26", *WSD)
    pretrainer(plain).train()
    got, want = train_losses_and_lrs(tmp_path / "budget"), train_losses_and_lrs(tmp_path / "plain")
    assert got == want and len(got) == 26
    assert got[-1][2] == pytest.approx(plain.optim.lr * plain.schedule.min_lr_ratio)


def budget_records(out_dir: Path) -> list[tuple[int, int]]:
    return [(r["step"], r["budget_steps"]) for r in records(out_dir) if "budget_steps" in r]


def test_later_faster_steps_raise_the_count_while_the_schedule_allows(shards, tmp_path):
    # steps 2..9 take 2 s, then 1 s; the rate is the median of the timed steps. At step 9: 5 + 16 = 21 s
    # spent, 39 s left at 2 s: 19 more (28). At step 17: 29 s spent, 31 left at 1.5 s: 37. At step 25:
    # 37 s spent, 23 left at 1 s: 48. WSD's stable phase has not ended at either (decay from step 20
    # of 28, 26 of 37, 34 of 48), so each new count applies; the run ends on the minute.
    cfg = tiny_config(shards, tmp_path / "budget", "--train.steps=100", "--train.max_minutes=1", *WSD)
    assert fake_clock(pretrainer(cfg), until=(9, 2.0)).train().steps == 48
    assert budget_records(tmp_path / "budget") == [(9, 28), (17, 37), (25, 48)]
    pretrainer(tiny_config(shards, tmp_path / "plain", "--train.steps=48", *WSD)).train()
    assert train_losses_and_lrs(tmp_path / "budget") == train_losses_and_lrs(tmp_path / "plain")
    # a cosine schedule decays from its warmup's end: the second estimate would change the lr of steps
    # already taken, so the first count stays
    cosine = tiny_config(shards, tmp_path / "cosine", "--train.steps=100", "--train.max_minutes=1",
                         "--schedule.name=cosine", "--schedule.warmup_steps=2")
    assert fake_clock(pretrainer(cosine), until=(9, 2.0)).train().steps == 28
    assert budget_records(tmp_path / "cosine") == [(9, 28)]


def test_budget_that_fits_the_configured_steps_changes_nothing(shards, tmp_path):
    cfg = tiny_config(shards, tmp_path / "run", "--train.steps=12", "--train.max_minutes=10", *WSD)
    assert fake_clock(pretrainer(cfg)).train().steps == 12


def test_resume_keeps_the_fixed_step_count_and_the_time_spent(shards, tmp_path):
    overrides = ["--train.steps=40", "--train.max_minutes=0.5", "--train.checkpoint_every=4", *WSD]
    whole = tiny_config(shards, tmp_path / "whole", *overrides)
    fake_clock(pretrainer(whole)).train()
    cfg = tiny_config(shards, tmp_path / "run", *overrides)
    with pytest.raises(Preempted):  # killed in step 15: the step-12 checkpoint holds the count
        fake_clock(pretrainer(cfg), die_in_step=15).train()
    # a slower machine on resume: a fresh probe would now fit fewer steps; the count stays 26
    result = fake_clock(pretrainer(cfg), first=3.0, rest=3.0).train()
    assert result.steps == 26
    assert train_losses_and_lrs(tmp_path / "run") == train_losses_and_lrs(tmp_path / "whole")


def test_resume_before_the_decision_counts_the_time_already_spent(shards, tmp_path):
    overrides = ["--train.steps=40", "--train.max_minutes=0.5", "--train.checkpoint_every=4", *WSD]
    cfg = tiny_config(shards, tmp_path / "run", *overrides)
    with pytest.raises(Preempted):  # killed in step 6, before the probe finished: 5 + 3 = 8 s spent at step 4
        fake_clock(pretrainer(cfg), die_in_step=6).train()
    # the resumed process: step 5 pays 5 s of warm-up again, steps 6..13 are its probe;
    # 8 + 5 + 8 = 21 s spent at step 13, 9 s left: 9 more steps
    assert fake_clock(pretrainer(cfg)).train().steps == 22


def test_max_minutes_must_not_be_negative():
    with pytest.raises(ValueError, match="max_minutes"):
        load_config(None, ["--train.max_minutes=-1"])
