"""The agent task set: problems with verifiable answers that need tools, run with and without them.

Three kinds, 30 tasks (`tasks/tasks.jsonl`):
- `arithmetic`: word problems with awkward numbers (the calculator); correct when the reply's final
  number ("The answer is N.", else the last number) equals the answer, as GSM8K is scored;
- `lookup`: questions about invented facts (`tasks/docs/*.md`, written for this set, so no model
  knows them; the instruction says the answer is in "our documents", as a user of a document
  collection would); correct when the reply contains every expected keyword (case-insensitive);
- `code`: small Python functions; correct when the reply's last code block passes the tests in the
  sandbox.

With tools the agent has the calculator, sandboxed Python and search over an index of the documents;
without tools it answers in one reply. Scored: success rate per kind and overall, steps and tool
calls per task.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from ...eval.code import run_program
from ...jsonl import read_jsonl
from ...eval.generative import is_correct
from ...posttrain.rewards import completion_code
from .builtin import calculator_tool, python_tool, search_tool
from .loop import run_agent

TASKS_DIR = Path(__file__).parent / "tasks"
KINDS = ("arithmetic", "lookup", "code")
INSTRUCTIONS = {
    "arithmetic": 'End your reply with "The answer is N." where N is the final number.',
    "lookup": "Answer in one sentence, from our documents.",
    "code": "Reply with the complete function in a ```python code block.",
}


def load_tasks(path: str | Path | None = None, kinds: tuple[str, ...] = KINDS,
               per_kind: int | None = None) -> list[dict]:
    """The tasks of `kinds` from a JSONL file (default: the built-in set); with `per_kind`, only the first
    that many of each kind (a balanced subset)."""
    rows = read_jsonl(path or TASKS_DIR / "tasks.jsonl")
    unknown = {r["kind"] for r in rows} - set(KINDS)
    if unknown:
        raise ValueError(f"unknown task kind(s) {sorted(unknown)}; the kinds are {', '.join(KINDS)}")
    rows = [r for r in rows if r["kind"] in kinds]
    if per_kind is not None:
        rows = [r for r in rows if [q["id"] for q in rows if q["kind"] == r["kind"]].index(r["id"]) < per_kind]
    return rows


def prompt(task: dict) -> str:
    return f"{task['task']} {INSTRUCTIONS[task['kind']]}"


def is_solved(task: dict, answer: str | None) -> bool:
    """Whether a final reply solves the task (see the module docstring for each kind's rule)."""
    if not answer:
        return False
    if task["kind"] == "arithmetic":
        return is_correct(answer, str(task["answer"]))
    if task["kind"] == "lookup":
        return all(word.lower() in answer.lower() for word in task["answer"])
    return run_program(completion_code(answer) + "\n\n" + task["tests"] + "\n")


def documents_index(encoder, out: str | Path):
    """An index over the lookup tasks' documents."""
    from ..rag import build_index

    index, _ = build_index([TASKS_DIR / "docs"], encoder, out, progress=False)
    return index


def evaluate_agent(chat, tasks: list[dict], index, *, max_steps: int = 6, tool_choice: str = "auto",
                   baseline: bool = True, transcript: str | Path | None = None,
                   progress: Callable[[dict], None] | None = None) -> dict:
    """Run every task with tools (`tool_choice` as in `run_agent`) and, with `baseline`, without; per
    condition, the success rate per kind and overall, mean steps and tool calls, and seconds.
    `progress` gets each task's record as it finishes."""
    tools = [calculator_tool(), python_tool(), search_tool(index)]
    records = []
    for condition, toolbox in (("tools", tools), ("no tools", [])) if baseline else (("tools", tools),):
        for task in tasks:
            t0 = time.perf_counter()
            result = run_agent(chat, prompt(task), toolbox, max_steps=max_steps if toolbox else 1,
                               tool_choice=tool_choice, transcript=transcript)
            record = {"id": task["id"], "kind": task["kind"], "condition": condition,
                      "solved": is_solved(task, result.answer), "steps": result.steps,
                      "tool_calls": result.tool_calls, "stop": result.stop_reason,
                      "seconds": round(time.perf_counter() - t0, 2)}
            records.append(record)
            if progress:
                progress(record)
    return {"tasks": len(tasks), "tool_choice": tool_choice, "conditions": summarize(records), "records": records}


def summarize(records: list[dict]) -> dict:
    by_condition: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_condition[record["condition"]].append(record)
    out = {}
    for condition, rows in by_condition.items():
        kinds = {kind: [r for r in rows if r["kind"] == kind] for kind in KINDS}
        out[condition] = {
            "success": round(sum(r["solved"] for r in rows) / len(rows), 3),
            **{f"success_{kind}": round(sum(r["solved"] for r in rs) / len(rs), 3) for kind, rs in kinds.items() if rs},
            "steps_per_task": round(sum(r["steps"] for r in rows) / len(rows), 2),
            "tool_calls_per_task": round(sum(r["tool_calls"] for r in rows) / len(rows), 2),
            "seconds": round(sum(r["seconds"] for r in rows), 1),
        }
    return out

