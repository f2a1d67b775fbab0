"""Lexicons: the Jargon File, Ambrose Bierce's Devil's Dictionary, WordNet.

Dictionaries and glossaries from Debian, in formats with one entry per line or paragraph; each
extractor groups the entries into page-sized documents (per chapter or initial letter, or per
200 synsets) rather than one tiny document per headword.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path

from tokenmind.data.sources.archive import decode_text, iter_members
from tokenmind.data.sources.base import Record, Source
from tokenmind.data.sources.markup import tidy


def extract_jargon(deb: Path) -> Iterator[Record]:
    """The Jargon File 4.4.7: one document per chapter and appendix, and per initial letter of
    the lexicon (the headword index lists between letters are dropped)."""
    (_, data), *_ = iter_members(deb, "usr/share/doc/jargon-text/jargon.txt.gz")
    text = gzip.decompress(data).decode("utf-8", errors="replace").replace("\xa0", " ")
    body = text[text.find("\nChapter 1. ") :]
    lexicon_start, lexicon_end = body.find("\nGlossary\n"), body.find("\nAppendix A. ")
    for part in re.split(r"\n(?=(?:Chapter \d+|Appendix [A-Z])\. )", body[:lexicon_start] + body[lexicon_end:]):
        head = re.match(r"(Chapter \d+|Appendix [A-Z])\. ", part)
        if head:
            yield {"id": head.group(1).lower().replace(" ", "-"), "text": _dedent3(part)}
    letters: dict[str, list[str]] = {}
    paras = [p for p in re.split(r"\n\s*\n", body[lexicon_start:lexicon_end]) if p.strip()]
    short = [len(p.strip()) <= 60 and "\n" not in p.strip() and not p.strip().startswith(":") for p in paras]
    key = None
    for i, para in enumerate(paras):
        if short[i] and sum(short[max(0, i - 2) : i + 3]) >= 3:  # inside a run of index entries
            continue
        headword = re.match(r"\s*:([^:]+):", para)
        if headword:
            first = headword.group(1).lstrip("/(@")[:1].upper()
            key = first if first.isalpha() else "0-9"
        if key is not None:
            letters.setdefault(key, []).append(para)
    for letter, entries in sorted(letters.items()):
        yield {"id": f"lexicon/{letter}", "text": _dedent3("\n\n".join(entries))}


def _dedent3(text: str) -> str:
    return tidy("\n".join(line[3:] if line.startswith("   ") else line for line in text.split("\n")))


def extract_devils_dictionary(deb: Path) -> Iterator[Record]:
    """Ambrose Bierce's *The Devil's Dictionary* (dictd format), one document per initial letter."""
    files = dict(iter_members(deb, lambda n: n.startswith("usr/share/dictd/devil.")))
    body = gzip.decompress(files["usr/share/dictd/devil.dict.dz"]).decode("utf-8", errors="replace")
    letters: dict[str, list[str]] = {}
    for line in decode_text(files["usr/share/dictd/devil.index"]).splitlines():
        head, offset, length = line.split("\t")[:3]
        if head.startswith("00database") or not head[:1].isalpha():
            continue
        start, size = _dict_b64(offset), _dict_b64(length)
        letters.setdefault(head[0].upper(), []).append(body[start : start + size].strip())
    for letter, entries in sorted(letters.items()):
        yield {"id": letter, "text": tidy("\n\n".join(dict.fromkeys(entries)))}


def _dict_b64(value: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    number = 0
    for ch in value:
        number = number * 64 + alphabet.index(ch)
    return number


def extract_wordnet(deb: Path, per_doc: int = 200) -> Iterator[Record]:
    """WordNet 3.0 synsets as `words (pos): gloss; "examples"` lines, 200 synsets per document."""
    pos_names = {"noun": "n.", "verb": "v.", "adj": "adj.", "adv": "adv."}
    for path, data in iter_members(deb, lambda n: re.search(r"usr/share/wordnet/data\.(noun|verb|adj|adv)$", n)):
        pos = path.rsplit(".", 1)[1]
        lines = []
        for line in decode_text(data).splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # license header
            fields, gloss = line.split(" | ", 1)
            parts = fields.split()
            words = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in parts[4 : 4 + 2 * int(parts[3], 16) : 2]]
            lines.append(f"{', '.join(dict.fromkeys(words))} ({pos_names[pos]}): {gloss.strip()}")
        for i in range(0, len(lines), per_doc):
            yield {"id": f"{pos}/{i // per_doc:04d}", "text": "\n".join(lines[i : i + per_doc])}


SOURCES = [
    Source("jargon-file", "debian", "jargon-text", "4.4.7-4.1", "public domain", "public domain", "pretrain",
           extract_jargon, "The Jargon File 4.4.7 (hacker lexicon and essays)", ("pretrain",)),
    Source("devils-dictionary", "debian", "dict-devil", "1.0-13.1", "public domain", "public domain", "pretrain",
           extract_devils_dictionary, "Ambrose Bierce, The Devil's Dictionary", ("pretrain",)),
    Source("wordnet", "debian", "wordnet-base", "1:3.0-37", "WordNet-3.0 (BSD-like)", "WordNet-3.0 (BSD-like)",
           "pretrain", extract_wordnet, "WordNet 3.0 synsets with glosses and examples", ("pretrain",)),
]  # fmt: skip
