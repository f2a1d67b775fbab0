"""Verifiable tasks: problems whose answers a program can check, and the checkers as reward functions.

Post-training needs a signal that costs nothing per sample: best-of-N keeps the candidate a checker
likes, rejection sampling (RAFT) fine-tunes on the kept ones, preference pairs put a right answer
beside a wrong one, a process reward model learns from per-step labels, and online RL (GRPO) uses
the same checkers as rewards. Every reward here has one shape, TRL's:

    reward(prompt, completion, **meta) -> float

`prompt` is the chat (`[{"role", "content"}, ...]`) or a plain string, `completion` the generated
text, `meta` the task's fields (the gold `answer`, say); unknown fields are ignored, so one record's
fields can feed several rewards. `VERIFIERS` names them for the command line.

Multi-step arithmetic (`multistep_problem`) is the task with per-step labels. A problem is a fully
parenthesized integer expression of `num_steps` operations (+, -, *), its solution one operation per
line in evaluation order, then the result:

    Compute ((7 * 3) + 17) - (5 * 2).

    Step 1: 7 * 3 = 21
    Step 2: 21 + 17 = 38
    Step 3: 5 * 2 = 10
    Step 4: 38 - 10 = 28
    Answer: 28

`check_steps` labels each line of a written solution: a `Step` line is right when its equation
holds and it computes an operation of the problem whose operands are the problem's numbers or the
results of earlier right steps (any order of independent operations is fine); the `Answer` line is
right when it is the expression's value. Labels are PRM800K / Math-Shepherd style: the first wrong
line and every line after it are False. `corrupt_solution` writes the wrong solutions such a checker
must catch: a wrong result in step k, carried through the later steps, with exactly those labels;
`stepwise_examples` packs both kinds as TRL's stepwise-supervision records for a process reward model.

Answer checkers: `extract_answer` (GSM8K's `#### N`, an `Answer:` line, "the answer is N", else the
last number), `numbers_equal`, `extract_choice` (a multiple-choice letter); `ANSWER_EXTRACTORS`
names the extractors whose answers self-consistency votes on. reasoning-gym's
generators (an optional dependency) come through `reasoning_gym_items`; its `gsm_symbolic` is refused
because it rewrites GSM8K test items.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .chat_mix import normalize

Reward = Callable[..., float]
Prompt = str | list[dict[str, str]]
OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                             "*": lambda a, b: a * b}
COMMUTATIVE = {"+", "*"}


# ------------------------------------------------------------------------- multi-step arithmetic


@dataclass(frozen=True)
class Operation:
    """One node of the expression: `left op right = value`; `children` index the nodes that
    produced the operands (None where the operand is a number of the problem)."""

    left: int
    op: str
    right: int
    value: int
    children: tuple[int | None, int | None]


@dataclass(frozen=True)
class ArithmeticProblem:
    """An expression and its operations in evaluation order (children before parents; the last is the root)."""

    expression: str
    operations: tuple[Operation, ...]

    @property
    def answer(self) -> int:
        return self.operations[-1].value

    @property
    def question(self) -> str:
        """The user's message: the expression and the solution format the checker reads."""
        return (f"Compute {self.expression}. Work it out one operation per line, like \"Step 1: 7 * 3 = 21\", "
                "then give the result on a last line \"Answer: N\".")

    def solution(self) -> str:
        """The correct written solution (the module docstring shows the format)."""
        return format_solution([(o.left, o.op, o.right, o.value) for o in self.operations], self.answer)


def format_solution(steps: list[tuple[int, str, int, int]], answer: int) -> str:
    """`Step i: a op b = c` lines, then `Answer: N`."""
    lines = [f"Step {i}: {a} {op} {b} = {c}" for i, (a, op, b, c) in enumerate(steps, 1)]
    return "\n".join([*lines, f"Answer: {answer}"])


def multistep_problem(seed: int, num_steps: int = 3, max_operand: int = 20, max_value: int = 500) -> ArithmeticProblem:
    """A random expression of `num_steps` operations on integers 1..`max_operand`, the same for the same seed.

    The tree grows by replacing a random number with an operation on it and a new number, so problems
    mix chains ("((a + b) * c) - d") and independent branches ("(a * b) - (c * d)"). Trees are drawn
    again until every intermediate value is in 1..`max_value` and every product has a factor of at
    most 12: small numbers a small model can work with, and never zero, so a wrong intermediate result
    always changes the answer (which `corrupt_solution` relies on)."""
    if num_steps < 1 or max_operand < 2:
        raise ValueError(f"need num_steps >= 1 and max_operand >= 2, got {num_steps}, {max_operand}")
    rng = random.Random(seed)
    while True:
        tree: Any = rng.randint(1, max_operand)  # a leaf is an int, an operation [op, left, right]
        for _ in range(num_steps):
            tree = _grow(tree, rng, max_operand)
        operations: list[Operation] = []
        text = _flatten(tree, operations, top=True)
        if all(1 <= o.value <= max_value and (o.op != "*" or min(o.left, o.right) <= 12) for o in operations):
            return ArithmeticProblem(text, tuple(operations))


def _grow(tree: Any, rng: random.Random, max_operand: int) -> Any:
    """`tree` with one of its numbers, picked at random, replaced by an operation on it and a new number."""
    if isinstance(tree, int):
        op = rng.choice("+-*")
        other = rng.randint(2, 9) if op == "*" else rng.randint(1, max_operand)
        return [op, tree, other] if rng.random() < 0.5 else [op, other, tree]
    side = rng.choice((1, 2))
    grown = list(tree)
    grown[side] = _grow(tree[side], rng, max_operand)
    return grown


def _flatten(tree: Any, operations: list[Operation], top: bool = False) -> str:
    """The text of `tree`, appending its operations to `operations` in evaluation order."""
    if isinstance(tree, int):
        return str(tree)
    op, *operands = tree
    texts, values, children = [], [], []
    for child in operands:
        texts.append(_flatten(child, operations))
        leaf = isinstance(child, int)
        values.append(child if leaf else operations[-1].value)
        children.append(None if leaf else len(operations) - 1)
    operations.append(Operation(values[0], op, values[1], OPS[op](values[0], values[1]), (children[0], children[1])))
    text = f"{texts[0]} {op} {texts[1]}"
    return text if top else f"({text})"


_STEP = re.compile(r"^\s*(?:Step\s*\d+\s*[:.)]\s*)?(-?[\d,]+)\s*([-+*×x])\s*(-?[\d,]+)\s*=\s*(-?[\d,]+)\s*\.?\s*$",
                   re.IGNORECASE)
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*[:=]\s*(.+?)\s*$", re.IGNORECASE)


def solution_lines(text: str) -> list[str]:
    """The lines of a written solution that get a label: every non-blank line."""
    return [line for line in text.splitlines() if line.strip()]


def check_steps(problem: ArithmeticProblem, solution: str) -> list[bool]:
    """One label per non-blank line of `solution`: True while every line so far is right.

    A step line must read `[Step i:] a op b = c` with the equation true and must compute one of the
    problem's operations not yet done, from operands available now (the problem's numbers, or results
    of earlier right steps); + and * may swap their operands. An `Answer:` line is right when its number
    is the expression's value. Anything else (prose, a wrong or unparsable line) is wrong, and so is
    every line after the first wrong one."""
    done = [False] * len(problem.operations)
    labels, ok = [], True
    for line in solution_lines(solution):
        ok = ok and _line_right(problem, line, done)
        labels.append(ok)
    return labels


def _line_right(problem: ArithmeticProblem, line: str, done: list[bool]) -> bool:
    if m := _ANSWER_LINE.match(line):
        value = parse_number(m.group(1))
        return value is not None and value == problem.answer
    m = _STEP.match(line)
    if m is None:
        return False
    a, b, c = (int(m.group(k).replace(",", "")) for k in (1, 3, 4))
    op = {"×": "*", "x": "*", "X": "*"}.get(m.group(2), m.group(2))
    if OPS[op](a, b) != c:
        return False
    for i, o in enumerate(problem.operations):
        available = all(child is None or done[child] for child in o.children)
        operands = (a, b) == (o.left, o.right) or (op in COMMUTATIVE and (b, a) == (o.left, o.right))
        if not done[i] and available and o.op == op and operands:
            done[i] = True
            return True
    return False


def corrupt_solution(problem: ArithmeticProblem, step: int, seed: int = 0) -> tuple[str, list[bool]]:
    """A solution whose step `step` (0-based) has a wrong result, carried into every later step that
    uses it, and its labels: True for the steps before, False from `step` on (the `Answer` line too).

    The wrong result is the right one off by a small amount, or the result of the wrong operation,
    the slips a model makes. Every value of a problem is nonzero, so the final answer is wrong too."""
    if not 0 <= step < len(problem.operations):
        raise ValueError(f"step must be in [0, {len(problem.operations)}), got {step}")
    rng = random.Random(seed)
    true = problem.operations[step]
    candidates = {true.value + d for d in (-10, -2, -1, 1, 2, 10)}
    candidates |= {f(true.left, true.right) for name, f in OPS.items() if name != true.op}
    candidates.discard(true.value)
    steps = _propagate(problem, step, rng.choice(sorted(candidates)))
    labels = [i < step for i in range(len(steps))] + [False]
    return format_solution(steps, steps[-1][3]), labels


def _propagate(problem: ArithmeticProblem, step: int, wrong: int) -> list[tuple[int, str, int, int]]:
    """The operations recomputed from `step` on with `wrong` as that step's result."""
    values = [o.value for o in problem.operations]
    steps = []
    for i, o in enumerate(problem.operations):
        left = o.left if o.children[0] is None else values[o.children[0]]
        right = o.right if o.children[1] is None else values[o.children[1]]
        values[i] = wrong if i == step else OPS[o.op](left, right)
        steps.append((left, o.op, right, values[i]))
    return steps


def stepwise_examples(count: int, seed: int = 0, min_steps: int = 2, max_steps: int = 5,
                      corrupt_fraction: float = 0.5) -> Iterator[dict[str, Any]]:
    """Process-supervision records in TRL's stepwise format, `{"prompt", "completions", "labels"}`
    (one completion and one label per solution line), plus the `answer`.

    A `corrupt_fraction` of them carry a wrong step (uniform over the steps), the rest are correct.
    Record i depends only on (seed, i)."""
    for i in range(count):
        rng = random.Random(f"stepwise/{seed}/{i}")
        problem = multistep_problem(rng.randrange(2**32), rng.randint(min_steps, max_steps))
        if rng.random() < corrupt_fraction:
            text, labels = corrupt_solution(problem, rng.randrange(len(problem.operations)), rng.randrange(2**32))
        else:
            text = problem.solution()
            labels = [True] * len(solution_lines(text))
        yield {"prompt": problem.question, "completions": solution_lines(text), "labels": labels,
               "answer": problem.answer}


def multistep_items(count: int, seed: int = 0, min_steps: int = 2, max_steps: int = 4) -> list[dict[str, Any]]:
    """Multi-step arithmetic as task items `{"id", "prompt", "answer", "expression", "solution", "task"}`:
    what sampling and pair building take (meta fields go to the rewards)."""
    items = []
    for i in range(count):
        rng = random.Random(f"multistep/{seed}/{i}")
        problem = multistep_problem(rng.randrange(2**32), rng.randint(min_steps, max_steps))
        items.append({"id": f"multistep/{seed}/{i}", "prompt": [{"role": "user", "content": problem.question}],
                      "answer": problem.answer, "expression": problem.expression, "solution": problem.solution(),
                      "task": "multistep"})
    return items


def problem_from_expression(expression: str) -> ArithmeticProblem:
    """The problem of a fully parenthesized expression as `multistep_problem` writes it (for checking
    a record's solution from its `expression` field)."""
    tokens = re.findall(r"\d+|[-+*()]", expression)
    operations: list[Operation] = []
    pos = 0

    def operand() -> tuple[int, int | None]:
        nonlocal pos
        if tokens[pos] == "(":
            pos += 1
            value, index = binary()
            pos += 1  # ")"
            return value, index
        pos += 1
        return int(tokens[pos - 1]), None

    def binary() -> tuple[int, int | None]:
        nonlocal pos
        left, li = operand()
        if pos == len(tokens) or tokens[pos] == ")":
            return left, li
        op = tokens[pos]
        pos += 1
        right, ri = operand()
        operations.append(Operation(left, op, right, OPS[op](left, right), (li, ri)))
        return operations[-1].value, len(operations) - 1

    binary()
    if pos != len(tokens) or not operations:
        raise ValueError(f"not a parenthesized arithmetic expression: {expression!r}")
    return ArithmeticProblem(expression, tuple(operations))


# ------------------------------------------------------------------------- answers


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*(.+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*[:\s]*([^\n]*)", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The first number in `text` as an exact fraction ("1,234" and "$5" and "3/4" and "2.50" read as
    numbers), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    s = m.group().replace(",", "").replace("$", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The final-answer part of a completion: after GSM8K's `####`, else after the last "answer is" /
    "Answer:", else the last number in the text (None if there is none)."""
    if m := _GSM8K.search(text):
        return m.group(1).strip()
    hits = _ANSWER_IS.findall(text)
    if hits and _NUMBER.search(hits[-1]):
        return hits[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def numbers_equal(a: str | int | float | Fraction, b: str | int | float | Fraction, rel_tol: float = 1e-6) -> bool:
    """Whether two answers are the same number ("1,000" == "1000.0"; 0.3333333 == 1/3 within `rel_tol`)."""
    x = a if isinstance(a, Fraction) else parse_number(str(a))
    y = b if isinstance(b, Fraction) else parse_number(str(b))
    if x is None or y is None:
        return False
    return x == y or abs(x - y) <= rel_tol * max(abs(x), abs(y))


def numeric_reward(prompt: Prompt, completion: str, answer: Any = None, **meta: Any) -> float:
    """1.0 when the completion's final answer (`extract_answer`) is the number `answer`, else 0.0."""
    if answer is None:
        raise ValueError("the numeric verifier needs the gold answer: pass answer=... (CLI: --answer)")
    got = extract_answer(completion)
    return float(got is not None and numbers_equal(got, answer))


_CHOICE_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"answer\s*(?:is|:)\s*\(?((?-i:[A-J]))\b",  # "The answer is B", "Answer: (C)"; letters upper case only
    r"^\s*\(?((?-i:[A-J]))[.):]",  # "B. text", "(B) text", "B:"
    r"^\s*((?-i:[A-J]))\s*$",  # a bare letter
)]
LETTERS = "ABCDEFGHIJ"


def extract_choice(text: str, choices: list[str] | None = None) -> str | None:
    """The letter a completion picks ("The answer is B", "B. Paris", "(B)", a bare "B"); failing that,
    with the `choices` given, the letter of the only choice whose text the completion contains. None
    when it picks none (or a letter past the choices)."""
    for pattern in _CHOICE_PATTERNS:
        if m := pattern.search(text.strip()):
            letter = m.group(1)
            return letter if choices is None or LETTERS.index(letter) < len(choices) else None
    if choices:
        said = normalize(text)
        named = [k for k, c in enumerate(choices) if normalize(c) and f" {normalize(c)} " in f" {said} "]
        if len(named) == 1:
            return LETTERS[named[0]]
    return None


def choice_reward(prompt: Prompt, completion: str, answer: Any = None, choices: list[str] | None = None,
                  **meta: Any) -> float:
    """1.0 when the completion picks choice `answer` (a letter, or a 0-based index), else 0.0;
    `choices` (the choice texts) lets an answer that names the choice without its letter count."""
    if answer is None:
        raise ValueError("the choice verifier needs the gold answer: a letter or 0-based index (CLI: --answer B)")
    gold = LETTERS[answer] if isinstance(answer, int) else str(answer).strip().upper()
    return float(extract_choice(completion, choices) == gold)


def multistep_reward(prompt: Prompt, completion: str, expression: str | None = None, answer: Any = None,
                     **meta: Any) -> float:
    """With the problem's `expression`: the share of the reference solution's lines (its operations
    and the answer) that the completion gets right before its first wrong line (`check_steps`), so
    1.0 only for a fully right solution. Without it: `numeric_reward` on the final answer.

    Partial credit ranks a solution that goes wrong late above one that goes wrong early: a denser
    signal for best-of-N and pair building than right/wrong."""
    if expression is None:
        return numeric_reward(prompt, completion, answer)
    problem = problem_from_expression(expression)
    total = len(problem.operations) + 1
    return min(sum(check_steps(problem, completion)), total) / total


VERIFIERS: dict[str, Reward] = {"numeric": numeric_reward, "choice": choice_reward, "multistep": multistep_reward}


def numeric_answer(text: str) -> str | None:
    """The completion's final answer (`extract_answer`) as a canonical number, so equal numbers compare
    equal as strings ("1,000.0" → "1000", "0.50" → "1/2"); None if it gives none."""
    got = extract_answer(text)
    value = None if got is None else parse_number(got)
    return None if value is None else str(value)


# the final answer of a completion in a form where equal answers are equal strings (self-consistency votes on it)
ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {"numeric": numeric_answer, "choice": extract_choice}


def get_answer_extractor(name: str) -> Callable[[str], str | None]:
    if name not in ANSWER_EXTRACTORS:
        raise ValueError(f"unknown answer kind {name!r}; choose one of {', '.join(ANSWER_EXTRACTORS)}")
    return ANSWER_EXTRACTORS[name]


def get_verifier(name: str) -> Reward:
    """A verifier by name (`VERIFIERS`, or `reasoning-gym`); an error listing the names otherwise."""
    if name == "reasoning-gym":
        return reasoning_gym_reward
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of {', '.join([*VERIFIERS, 'reasoning-gym'])}")
    return VERIFIERS[name]


# ------------------------------------------------------------------------- reasoning-gym (optional)


REFUSED_GYM_TASKS = {"gsm_symbolic": "its templates are rewritten GSM8K test items (see DATA_SOURCES.md)"}


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError("reasoning-gym is not installed; `pip install reasoning-gym==0.1.25` "
                          "(an optional dependency of tokenmind's verifiable tasks)") from err
    return reasoning_gym


def reasoning_gym_items(name: str, count: int, seed: int = 0, **config: Any) -> list[dict[str, Any]]:
    """`count` items of reasoning-gym's generator `name` as task items (`prompt` a chat, the gym's
    `answer`, and the task name and seed that `reasoning_gym_reward` rebuilds the scorer from)."""
    if name in REFUSED_GYM_TASKS:
        raise ValueError(f"reasoning-gym task {name!r} is not allowed: {REFUSED_GYM_TASKS[name]}")
    data = _reasoning_gym().create_dataset(name, size=count, seed=seed, **config)
    return [{"id": f"{name}/{seed}/{i}", "prompt": [{"role": "user", "content": entry["question"]}],
             "answer": entry["answer"], "gym_task": name, "gym_entry": entry, "task": "reasoning-gym"}
            for i, entry in enumerate(data)]


def reasoning_gym_reward(prompt: Prompt, completion: str, gym_task: str | None = None,
                         gym_entry: dict | None = None, **meta: Any) -> float:
    """The gym's own score (0..1) for the completion's answer: the text after a last `Answer:`, else
    the last non-blank line."""
    if gym_task is None or gym_entry is None:
        raise ValueError("the reasoning-gym verifier needs the item's gym_task and gym_entry fields "
                         "(made by reasoning_gym_items)")
    lines = solution_lines(completion)
    answers = [m.group(1) for line in lines if (m := _ANSWER_LINE.match(line))]
    given = answers[-1] if answers else (lines[-1].strip() if lines else None)
    scorer = _reasoning_gym().get_score_answer_fn(gym_task)
    return float(scorer(given, gym_entry))
