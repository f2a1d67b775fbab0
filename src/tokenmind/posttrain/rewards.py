"""Rewards beyond answer checking, for online RL: format, code tests, length shaping, and a weighted mix.

Each reward has the verifiers' shape (`tasks.py`), `reward(prompt, completion, **meta) -> float`,
so any of them, a task's verifier or a trained reward model combine in one `RewardMix`:

* `answer_line_format`: 1.0 when the completion ends with one `Answer: ...` line and has no other.
* `think_answer_format`: 1.0 for `<think>...</think>` then `<answer>...</answer>` and nothing else,
  the layout of DeepSeek-R1's format reward.
* `code_tests_reward`: 1.0 when the completion's code (its last fenced block, else the whole text)
  passes the item's `test` (defining `check`) on its `entry_point`, run in the project's one
  sandbox (`tokenmind.sandbox`: own process group, rlimits, no network, a temporary directory).
* `overlong_penalty`: DAPO's soft punishment of long answers, a function of the token count:
  0 up to max_new_tokens − cache, then falling linearly to −1 at max_new_tokens (applied by the
  rollout, which knows token counts).

A spec names a reward and optionally its weight: `verifier:numeric`, `format:answer-line*0.2`,
`code:tests`, `rm:PATH*0.5` (`load_scorer` resolves the name; best-of-N and rejection sampling take the same
specs).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmind.eval.code import passes_tests

from .tasks import Prompt, Reward, get_verifier, solution_lines

_ANSWER_LINE = re.compile(r"^\s*answer\s*:\s*\S", re.IGNORECASE)
_THINK_ANSWER = re.compile(r"^\s*<think>.+?</think>\s*<answer>.+?</answer>\s*$", re.DOTALL)
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)


def answer_line_format(prompt: Prompt, completion: str, **meta: Any) -> float:
    """1.0 when the last non-blank line, and only it, is an `Answer: ...` line."""
    lines = solution_lines(completion)
    answers = [i for i, line in enumerate(lines) if _ANSWER_LINE.match(line)]
    return float(answers == [len(lines) - 1])


def think_answer_format(prompt: Prompt, completion: str, **meta: Any) -> float:
    """1.0 for `<think>...</think><answer>...</answer>` (whitespace between allowed), else 0.0."""
    return float(bool(_THINK_ANSWER.match(completion)))


def completion_code(completion: str) -> str:
    """The program in a completion: its last fenced code block, else the whole text."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests_reward(prompt: Prompt, completion: str, test: str | None = None, entry_point: str | None = None,
                      timeout: float = 10.0, **meta: Any) -> float:
    """1.0 when the completion's code passes the item's tests in the sandbox, else 0.0."""
    if test is None or entry_point is None:
        raise ValueError("the code-tests reward needs the item's `test` (Python defining check(candidate)) and "
                         "`entry_point` (the function to check) fields")
    item = {"prompt": "", "test": test, "entry_point": entry_point}
    return float(passes_tests(item, completion_code(completion), timeout))


def overlong_penalty(length: int, max_new_tokens: int, cache: int) -> float:
    """DAPO's soft overlong punishment for a completion of `length` tokens (see the module docstring)."""
    if cache <= 0 or length <= max_new_tokens - cache:
        return 0.0
    return max(-1.0, (max_new_tokens - cache - length) / cache)


REWARDS = {"answer-line": answer_line_format, "think-answer": think_answer_format, "tests": code_tests_reward}


def item_fields(item: dict[str, Any]) -> dict[str, Any]:
    """A task item's fields other than its prompt: the `meta` its rewards are called with."""
    return {k: v for k, v in item.items() if k != "prompt"}


def load_scorer(spec: str) -> Any:
    """`verifier:NAME` (a reward function of `tasks.py`: numeric, choice, multistep, reasoning-gym),
    `format:answer-line`, `format:think-answer`, `code:tests` (this module's rewards) or `rm:PATH`
    (a trained reward model)."""
    kind, _, name = spec.partition(":")
    if kind == "verifier" and name:
        return get_verifier(name)
    if kind in ("format", "code") and name in REWARDS:
        return REWARDS[name]
    if kind == "rm" and name:
        try:
            from .reward import load_reward_model
        except ImportError as err:  # a ValueError, so the CLI prints it as a usage error
            raise ValueError(f"scorer {spec!r} needs tokenmind.posttrain.reward.load_reward_model, which this "
                             f"install lacks ({err}); use a verifier scorer (verifier:numeric, ...) instead") from err
        return load_reward_model(name)
    raise ValueError(f"unknown scorer {spec!r}; use verifier:NAME (numeric, choice, multistep, reasoning-gym), "
                     "format:answer-line, format:think-answer, code:tests or rm:PATH (a trained reward model)")


def score(scorer: Any, prompts: Sequence[Prompt], completions: Sequence[str], metas: Sequence[dict]) -> list[float]:
    """Scores of the completions: a reward model's `.score` on the whole batch (prompts as they were
    sampled: chats, or plain text that was continued), else the reward function once per completion
    with its item's fields."""
    if hasattr(scorer, "score"):
        return [float(s) for s in scorer.score(list(prompts), list(completions))]
    return [float(scorer(p, c, **m)) for p, c, m in zip(prompts, completions, metas)]


@dataclass
class RewardMix:
    """Weighted rewards: `names[i]` scored by `scorers[i]` (a reward function or a reward model)
    with weight `weights[i]`; the total is the weighted sum."""

    names: list[str]
    scorers: list[Any]
    weights: list[float]

    @classmethod
    def from_specs(cls, specs: Sequence[str], task: Reward | None = None) -> RewardMix:
        """Specs as in the module docstring, e.g. ["verifier:numeric", "format:answer-line*0.2"];
        with `task` given, the spec `task` stands for it (a run's task verifier)."""
        if not specs:
            raise ValueError("no reward given; name at least one, e.g. verifier:numeric")
        names, scorers, weights = [], [], []
        for spec in specs:
            name, star, weight = spec.rpartition("*") if "*" in spec else (spec, "", "1")
            try:
                weights.append(float(weight))
            except ValueError:
                raise ValueError(f"reward {spec!r}: the weight after '*' must be a number") from None
            names.append(name)
            scorers.append(task if name == "task" and task is not None else load_scorer(name))
        return cls(names, scorers, weights)

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str],
                 metas: Sequence[dict]) -> tuple[list[float], dict[str, list[float]]]:
        """(total reward per completion, each named reward's scores)."""
        parts = {name: score(s, prompts, completions, metas) for name, s in zip(self.names, self.scorers)}
        totals = [sum(w * parts[n][i] for n, w in zip(self.names, self.weights)) for i in range(len(completions))]
        return totals, parts
