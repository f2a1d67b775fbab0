"""Answer a question from an index: retrieve → a grounded prompt of numbered passages → a streamed
reply whose citations `[n]` can only name passages that were retrieved.

The model is told to answer from the passages and cite them by number. As the reply streams, a
citation is held back until its bracket closes and then kept only if every number in it names a
retrieved passage; an invented one (`[7]` of five passages) is dropped and reported, never shown.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from .index import Hit, RagIndex

SYSTEM = ("Answer the question in a few sentences, using only the numbered passages. After each "
          "sentence, put the numbers of the passages it comes from in square brackets, for example: "
          "\"The capital of France is Paris [2].\" If the passages do not contain the answer, say that you "
          "do not know.")
_CITATION = re.compile(r"\[(\d+(?:\s*,\s*\d+)*)\]")
_LONGEST_CITATION = 24  # an open "[" followed by more than this is plain text, not a citation


def grounded_messages(question: str, hits: list[Hit]) -> list[dict[str, str]]:
    """Chat messages: the instructions, then the question, the passages numbered from 1 with their
    sources, and the request to cite. (Passages labelled "[1] ..." made Qwen2.5-Coder-0.5B and 1.5B
    reply with a bare "[1]"; "Passage 1 (...):" with the question first gets sentences.)"""
    passages = "\n\n".join(f"Passage {n} ({h.chunk.source}{' — ' + h.chunk.heading if h.chunk.heading else ''}):"
                           f"\n{h.chunk.text}" for n, h in enumerate(hits, start=1))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question: {question}\n\nPassages:\n\n{passages}\n\nAnswer the question, "
                                        "citing passages like [1]."}]


@dataclass
class CitationFilter:
    """Passes streamed text through, keeping a citation `[n]` or `[n, m]` only when every number is in
    1..passages; what it drops is listed in `invented`, what it keeps in `cited`."""

    passages: int
    cited: list[int] = field(default_factory=list)
    invented: list[str] = field(default_factory=list)
    _held: str = ""

    def feed(self, text: str) -> str:
        out, self._held = self._scan(self._held + text, final=False)
        return out

    def close(self) -> str:
        out, self._held = self._scan(self._held, final=True)
        return out

    def _scan(self, text: str, final: bool) -> tuple[str, str]:
        out = []
        while True:
            start = text.find("[")
            if start < 0:
                return "".join(out) + text, ""
            out.append(text[:start])
            text = text[start:]
            close = text.find("]")
            if close < 0:  # the bracket may still close in a later piece
                if final or len(text) > _LONGEST_CITATION:
                    out.append(text[0])
                    text = text[1:]
                    continue
                return "".join(out), text
            match = _CITATION.fullmatch(text[:close + 1])
            if match is None:  # brackets that are not a citation: plain text
                out.append(text[0])
                text = text[1:]
                continue
            numbers = [int(n) for n in match.group(1).split(",")]
            if all(1 <= n <= self.passages for n in numbers):
                self.cited += [n for n in numbers if n not in self.cited]
                out.append(match.group(0))
            else:
                self.invented.append(match.group(0))
            text = text[close + 1:]


@dataclass
class Answer:
    """The retrieved passages and, once the stream is consumed, the citations the reply kept and dropped."""

    hits: list[Hit]
    citations: CitationFilter

    def sources(self) -> list[tuple[int, Hit]]:
        """The cited passages as (number, hit), in the order the reply first cited them."""
        return [(n, self.hits[n - 1]) for n in self.citations.cited]


def ask(llm, index: RagIndex, question: str, params, k: int = 4, mode: str = "hybrid",
        **search_options) -> tuple[Answer, Iterator[str]]:
    """Retrieve `k` passages and stream a grounded reply from `llm` (an `LLM` over a chat model).
    Returns the answer record and the stream of reply text (citations already checked).
    `search_options`: `RagIndex.search`'s rerank, mmr and candidates."""
    hits = index.search(question, k, mode, **search_options)
    if not hits:
        raise ValueError("the index is empty: add documents with `tokenmind rag index`")
    record = Answer(hits, CitationFilter(len(hits)))
    prompt = llm.tokenizer.apply_chat_template(grounded_messages(question, hits), add_generation_prompt=True)

    def stream() -> Iterator[str]:
        for out in llm.stream(prompt, params):
            piece = record.citations.feed(out.new_text)
            if piece:
                yield piece
        rest = record.citations.close()
        if rest:
            yield rest

    return record, stream()
