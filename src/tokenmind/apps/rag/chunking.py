"""Split a document into passages of at most `max_tokens` tokens, on heading and paragraph boundaries.

A heading (Markdown `#`, or a reStructuredText title over its `===`/`---` underline) always starts
a new chunk, and every chunk remembers the heading it sits under. Paragraphs are packed whole
while they fit; the next chunk starts with the last paragraphs of the previous one that fit in
`overlap` tokens, so a fact split across a boundary is found whole in one of them. A paragraph
longer than `max_tokens` is cut into overlapping windows of whole lines (of words within a line
that is itself too long).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_MD_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'*+#`:.])\1{2,}\s*$")


@dataclass(frozen=True)
class Chunk:
    text: str
    source: str  # the document it came from
    heading: str  # the title it sits under ("" before the first)
    position: int  # its order within the document

    @property
    def for_embedding(self) -> str:
        """What the encoder sees: the heading gives a passage cut from its section its topic."""
        return f"{self.heading}\n{self.text}" if self.heading else self.text


def _blocks(text: str) -> list[tuple[str, bool]]:
    """(paragraph, is_heading) in order; paragraphs are blank-line separated."""
    out = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln for ln in block.strip("\n").split("\n") if ln.strip()]
        if not lines:
            continue
        if _MD_HEADING.match(lines[0]):
            out.append((_MD_HEADING.match(lines[0]).group(1), True))
            lines = lines[1:]
        elif len(lines) >= 2 and _RST_UNDERLINE.match(lines[1]) and len(lines[1].strip()) >= len(lines[0].strip()):
            out.append((lines[0].strip(), True))
            lines = lines[2:]
        elif len(lines) >= 3 and _RST_UNDERLINE.match(lines[0]) and _RST_UNDERLINE.match(lines[2]):  # over+underline
            out.append((lines[1].strip(), True))
            lines = lines[3:]
        if lines:
            out.append(("\n".join(lines), False))
    return out


def _pack(units: list[str], sizes: list[int], joiner: str, max_tokens: int, overlap: int) -> list[str]:
    """Consecutive units joined into windows of at most max_tokens (a unit larger than that alone
    makes a window), each window starting with the last units of the previous that fit in `overlap`."""
    windows, start = [], 0
    while start < len(units):
        end, total = start, 0
        while end < len(units) and (end == start or total + sizes[end] <= max_tokens):
            total += sizes[end]
            end += 1
        windows.append(joiner.join(units[start:end]))
        if end == len(units):
            break
        back, kept = end, 0  # step back over the last `overlap` tokens' worth of units
        while back - 1 > start and kept + sizes[back - 1] <= overlap:
            back -= 1
            kept += sizes[back]
        start = back
    return windows


def _windows(paragraph: str, count: Callable[[str], int], max_tokens: int, overlap: int) -> list[str]:
    """A paragraph longer than max_tokens as overlapping windows: of whole lines where lines fit
    (a table, a code block keep their layout), of words inside a line that does not."""
    lines = []
    for line in paragraph.split("\n"):
        if count(line) <= max_tokens:
            lines.append(line)
        else:
            words = line.split()
            lines += _pack(words, [count(w) for w in words], " ", max_tokens, overlap)
    return _pack(lines, [count(line) for line in lines], "\n", max_tokens, overlap)


def chunk_text(text: str, source: str, count_tokens: Callable[[str], int], max_tokens: int = 200,
               overlap: int = 40) -> list[Chunk]:
    """The chunks of one document; `count_tokens` measures text in the encoder's tokens."""
    if max_tokens < 8 or not 0 <= overlap < max_tokens // 2:
        raise ValueError(f"need max_tokens >= 8 and 0 <= overlap < max_tokens / 2; got {max_tokens}, {overlap}")
    chunks: list[Chunk] = []
    heading, current = "", []  # current: (paragraph, tokens) of the chunk being filled

    def emit() -> None:
        if current:
            chunks.append(Chunk("\n\n".join(p for p, _ in current), source, heading, len(chunks)))

    for block, is_heading in _blocks(text):
        if is_heading:
            emit()
            heading, current = block, []
            continue
        size = count_tokens(block)
        pieces = [(block, size)] if size <= max_tokens else \
            [(w, count_tokens(w)) for w in _windows(block, count_tokens, max_tokens, overlap)]
        for piece, n in pieces:
            if current and sum(t for _, t in current) + n > max_tokens:
                emit()
                carried, kept = [], 0
                for p, t in reversed(current):  # the overlap: trailing paragraphs that fit in it
                    if kept + t > overlap or kept + t + n > max_tokens:
                        break
                    carried.insert(0, (p, t))
                    kept += t
                current = carried
            current.append((piece, n))
    emit()
    return chunks
