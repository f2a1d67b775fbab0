"""Measure retrieval and grounded answering on a question set whose gold passage is known.

Retrieval: recall@k (the gold paragraph is among the top k chunks) and MRR@k (mean of 1 / its
rank), per mode, with query latency; with a reranker also "hybrid+rerank" (the chat model judges
the top CANDIDATES hybrid chunks). Answering (with a chat model): SQuAD's exact match and token
F1 against every gold answer, closed-book (the question alone) and with the top passages retrieved.

Two question sets:

* SQuAD (`tokenmind data fetch squad`): 1,000 questions over 803 paragraphs; the index holds the
  paragraphs, and a chunk is a hit when it comes from the question's own paragraph.
* The Python FAQ over the Python docs (`tokenmind data fetch python-faq python-doc`): each FAQ
  entry's question is asked, and its answer, indexed as a document of its own without the question
  over it, is the gold passage; the rest of the Python documentation (`--corpus`) is indexed beside
  the answers. The FAQ pages themselves are left out of that corpus (`distractors`): they hold the
  same answers under their questions, so a copy of the gold passage would sit in the index and, when
  found first, count as a miss. An answer that another page also gives counts as a miss as well, so
  the figures are a lower bound.
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

from ...progress import Bars
from .documents import Document
from .index import CANDIDATES, MODES, RagIndex

SHORT_ANSWER = "Answer with a short phrase only, no sentence."


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    answers: list[str]
    context: str


def load_qa(path: str | Path) -> list[QAItem]:
    """Question-answer items from JSONL with `question`, `answers` and `context` (the gold passage),
    or single-turn chats (`messages`, as the Python FAQ comes): the user's question, and the
    assistant's reply as both the answer and the gold passage."""
    items = []
    with open(path, encoding="utf-8") as lines:  # not splitlines(): a text may hold U+2028
        numbered = list(enumerate(lines, start=1))
    for n, line in numbered:
        if line.strip():
            r = json.loads(line)
            try:
                if "messages" in r:
                    turns = {m["role"]: m["content"] for m in r["messages"]}
                    r = {"id": r.get("id", n), "question": turns["user"], "answers": [turns["assistant"]],
                         "context": turns["assistant"]}
                items.append(QAItem(str(r.get("id", n)), r["question"], list(r["answers"]), r["context"]))
            except KeyError as e:
                raise ValueError(f"{path}:{n}: a QA item needs question, answers and context, or messages with a "
                                 f"user and an assistant turn (missing {e})") from e
    return items


def passages(items: list[QAItem]) -> tuple[list[Document], dict[str, str]]:
    """The distinct gold passages as documents, and each item's gold source name."""
    names: dict[str, str] = {}
    for item in items:
        names.setdefault(item.context, f"passage-{len(names):05d}")
    return [Document(name, text) for text, name in names.items()], {i.id: names[i.context] for i in items}


def distractors(corpus: list[Document], gold: list[Document]) -> tuple[list[Document], list[Document]]:
    """(kept, left out): the corpus documents to index beside the gold passages, leaving out every
    one that contains a gold passage (whitespace aside), which would be a second copy of it."""
    passages = [" ".join(d.text.split()) for d in gold]
    kept, dropped = [], []
    for doc in corpus:
        text = " ".join(doc.text.split())
        (dropped if any(p in text for p in passages) else kept).append(doc)
    return kept, dropped


def spread(items: list[QAItem], n: int | None) -> list[QAItem]:
    """n items spread evenly over the set (every len/n-th), so a subset covers all of it; None: all."""
    if n is None or n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def retrieval_metrics(index: RagIndex, items: list[QAItem], gold: dict[str, str], k: int = 10,
                      modes: tuple[str, ...] = MODES, reranker=None, candidates: int = CANDIDATES,
                      progress: bool = False) -> dict[str, dict[str, float]]:
    """Per mode: recall@1/5/k, MRR@k, and query latency p50/p99 in milliseconds. With `reranker`
    (an `LLMReranker`) also "hybrid+rerank": the top `candidates` hybrid chunks reranked by it."""
    runs = {mode: {"mode": mode} for mode in modes}
    if reranker is not None:
        runs["hybrid+rerank"] = {"mode": "hybrid", "rerank": reranker, "candidates": candidates}
    out = {}
    with Bars(progress) as bars:
        for name, options in runs.items():
            advance = bars.add(name, total=len(items))
            ranks, latency = [], []
            for item in items:
                t0 = time.perf_counter()
                hits = index.search(item.question, k, **options)
                latency.append((time.perf_counter() - t0) * 1000)
                sources = [h.chunk.source for h in hits]
                ranks.append(sources.index(gold[item.id]) + 1 if gold[item.id] in sources else None)
                if advance is not None:
                    advance()
            row = {f"recall@{n}": sum(r is not None and r <= n for r in ranks) / len(items)
                   for n in sorted({1, 5, k})}
            row[f"mrr@{k}"] = sum(1 / r for r in ranks if r) / len(items)
            latency.sort()
            row["p50_ms"], row["p99_ms"] = statistics.median(latency), latency[min(len(latency) - 1,
                                                                                    int(0.99 * len(latency)))]
            out[name] = {key: round(v, 4) for key, v in row.items()}
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
