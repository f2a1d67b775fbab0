"""Verifier-built preference pairs stay clear of the evaluation problems."""

from __future__ import annotations

from tokenmind.posttrain.pairs import multistep_pairs
from tokenmind.posttrain.tasks import check_steps, multistep_items, problem_from_expression


def test_multistep_pairs_skip_evaluation_problems_and_keep_the_count():
    evaluation = {it["expression"] for it in multistep_items(100, seed=2)} | \
        {p["expression"] for p in multistep_pairs(100, seed=1)}
    plain = multistep_pairs(300, seed=0)
    assert {p["expression"] for p in plain} & evaluation, "two-step problems repeat across seeds: the reason to filter"
    kept = multistep_pairs(300, seed=0, exclude=evaluation)
    assert len(kept) == 300 and not {p["expression"] for p in kept} & evaluation
    clean = [p for p in plain if p["expression"] not in evaluation]
    assert kept[:len(clean)] == clean  # the same draws, the excluded ones replaced by later ones
    for p in kept[-3:]:
        problem = problem_from_expression(p["expression"])
        assert p["prompt"][0]["content"] == problem.question and all(check_steps(problem, p["chosen"][0]["content"]))
