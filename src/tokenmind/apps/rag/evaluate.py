"""Measure retrieval and grounded answering on a question set whose gold passage is known.

Retrieval: recall@k (the gold paragraph is among the top k chunks) and MRR@k (mean of 1 / its
rank), per mode, with query latency. Answering (with a chat model): SQuAD's exact match and token
F1 against every gold answer, closed-book (the question alone) and with the top passages retrieved.
The data is `tokenmind data fetch squad` (1,000 SQuAD questions over 803 paragraphs).
"""

from __future__ import annotations

import json
import re
import statistics
import string
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .documents import Document
from .index import MODES, RagIndex

SHORT_ANSWER = "Answer with a short phrase only, no sentence."


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    answers: list[str]
    context: str


def load_qa(path: str | Path) -> list[QAItem]:
    """Question-answer items from JSONL with `question`, `answers` and `context` (the gold passage)."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            r = json.loads(line)
            try:
                items.append(QAItem(str(r.get("id", n)), r["question"], list(r["answers"]), r["context"]))
            except KeyError as e:
                raise ValueError(f"{path}:{n}: a QA item needs question, answers and context (missing {e})") from e
    return items


def passages(items: list[QAItem]) -> tuple[list[Document], dict[str, str]]:
    """The distinct gold passages as documents, and each item's gold source name."""
    names: dict[str, str] = {}
    for item in items:
        names.setdefault(item.context, f"passage-{len(names):05d}")
    return [Document(name, text) for text, name in names.items()], {i.id: names[i.context] for i in items}


def retrieval_metrics(index: RagIndex, items: list[QAItem], gold: dict[str, str], k: int = 10,
                      modes: tuple[str, ...] = MODES) -> dict[str, dict[str, float]]:
    """Per mode: recall@1/5/k, MRR@k, and query latency p50/p99 in milliseconds."""
    out = {}
    for mode in modes:
        ranks, latency = [], []
        for item in items:
            t0 = time.perf_counter()
            hits = index.search(item.question, k, mode)
            latency.append((time.perf_counter() - t0) * 1000)
            sources = [h.chunk.source for h in hits]
            ranks.append(sources.index(gold[item.id]) + 1 if gold[item.id] in sources else None)
        row = {f"recall@{n}": sum(r is not None and r <= n for r in ranks) / len(items) for n in sorted({1, 5, k})}
        row[f"mrr@{k}"] = sum(1 / r for r in ranks if r) / len(items)
        latency.sort()
        row["p50_ms"], row["p99_ms"] = statistics.median(latency), latency[min(len(latency) - 1,
                                                                                int(0.99 * len(latency)))]
        out[mode] = {key: round(v, 4) for key, v in row.items()}
    return out


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def f1(prediction: str, answers: list[str]) -> float:
    """The best token-overlap F1 of the prediction against any gold answer."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def answer_metrics(llm, index: RagIndex, items: list[QAItem], params, k: int = 3,
                   mode: str = "hybrid") -> dict[str, dict[str, float]]:
    """Exact match and F1 of the model's short answers, closed-book and with k retrieved passages."""
    from .answer import grounded_messages

    scores = {"closed_book": [], "retrieved": []}
    for item in items:
        for setting in scores:
            if setting == "closed_book":
                messages = [{"role": "system", "content": SHORT_ANSWER},
                            {"role": "user", "content": item.question}]
            else:
                messages = grounded_messages(item.question, index.search(item.question, k, mode))
                messages[0] = {"role": "system", "content": "Answer from the passages. " + SHORT_ANSWER}
            ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            reply = llm.generate(ids, params)[0].text.strip().split("\n")[0]
            reply = re.sub(r"\s*\[\d+(?:\s*,\s*\d+)*\]", "", reply)  # citations are not part of the answer
            scores[setting].append((exact_match(reply, item.answers), f1(reply, item.answers)))
    return {s: {"exact_match": round(sum(e for e, _ in v) / len(v), 4), "f1": round(sum(f for _, f in v) / len(v), 4)}
            for s, v in scores.items()}
