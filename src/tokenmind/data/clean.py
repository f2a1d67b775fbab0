"""Normalize documents, strip boilerplate lines, and drop low-quality documents.

Cleaning runs before dedup so that documents differing only in invisible ways (NFC vs NFD
accents, trailing spaces, CRLF line ends, a site's footer) are byte-identical by the time they
are hashed. It has three steps, each with its own row in the pipeline report:

1. `normalize_text`: Unicode NFC, one line-ending convention, exotic spaces to plain spaces,
   zero-width junk and control characters removed, trailing whitespace stripped, long runs of
   blank lines collapsed. Leading indentation is kept: code and poetry depend on it.
2. Boilerplate lines (`BoilerplateIndex`): navigation bars, cookie notices and copyright lines
   repeat verbatim across many documents of one source. Such lines are only recognizable by
   counting, so the index needs a first pass over the corpus (`observe`) before the second pass
   can remove them (`strip`).
3. Quality rules from `quality.py` (length, symbols, Gopher repetition).
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from tokenmind.data.quality import QualityConfig, quality_rules
from tokenmind.data.readers import Document
from tokenmind.data.report import StageStats

_LINE_BREAKS = re.compile(r"\r\n?|[\u2028\u2029\x85]")
_ODD_SPACES = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
# Zero-width space, word joiner, BOM and C0/DEL controls other than tab and newline. Zero-width
# (non-)joiners stay: Persian, Indic scripts and emoji sequences need them.
_INVISIBLE = re.compile("[\u200b\u2060\ufeff\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.MULTILINE)


@dataclass
class CleanConfig:
    """Settings of the cleaning stage.

    max_blank_lines: longest run of blank lines kept inside a document.
    remove_boilerplate: whether to run the two-pass boilerplate line removal.
    boilerplate_min_docs / boilerplate_min_fraction: a line is boilerplate when it appears in
        at least this many documents *and* this fraction of the documents of its source (both
        conditions, so a small source needs real repetition and a huge one is not gutted of
        every common phrase).
    boilerplate_min_line_chars: shorter lines (after stripping) are never treated as
        boilerplate; this spares "}" or "end" in code and short list markers.
    quality: thresholds of the quality rules.
    """

    max_blank_lines: int = 2
    remove_boilerplate: bool = True
    boilerplate_min_docs: int = 5
    boilerplate_min_fraction: float = 0.05
    boilerplate_min_line_chars: int = 10
    quality: QualityConfig = field(default_factory=QualityConfig)


def _collapse_blank_lines(text: str, max_blank_lines: int) -> str:
    # A run of k blank lines is k + 1 consecutive newlines.
    limit = max_blank_lines + 1
    return re.sub("\n{%d,}" % (limit + 1), "\n" * limit, text).strip("\n")


def normalize_text(text: str, max_blank_lines: int = 2) -> str:
    """Canonical form of a document's text (see the module docstring for what changes)."""
    text = unicodedata.normalize("NFC", text)
    text = _LINE_BREAKS.sub("\n", text)
    text = _INVISIBLE.sub("", text)
    text = _ODD_SPACES.sub(" ", text)
    text = _TRAILING_SPACE.sub("", text)
    return _collapse_blank_lines(text, max_blank_lines)


class BoilerplateIndex:
    """Counts, per source, how many documents contain each line; then strips frequent lines.

    Lines are keyed by an 8-byte BLAKE2 digest of their stripped text, so memory grows with the
    number of distinct lines rather than their length.
    """

    def __init__(self, min_docs: int, min_fraction: float, min_line_chars: int) -> None:
        self.min_docs = min_docs
        self.min_fraction = min_fraction
        self.min_line_chars = min_line_chars
        self._docs_per_source: Counter[str] = Counter()
        self._line_docs: defaultdict[str, Counter[bytes]] = defaultdict(Counter)

    def _key(self, line: str) -> bytes | None:
        line = line.strip()
        if len(line) < self.min_line_chars:
            return None
        return hashlib.blake2b(line.encode("utf-8"), digest_size=8).digest()

    def line_keys(self, text: str) -> set[bytes]:
        """The keys of the distinct lines of one (normalized) document that could be boilerplate."""
        keys = {self._key(line) for line in text.split("\n")}
        keys.discard(None)
        return keys  # type: ignore[return-value]

    def observe(self, source: str, text: str) -> None:
        """First pass: count each distinct line of one (normalized) document once."""
        self.add_counts(source, 1, self.line_keys(text))

    def add_counts(self, source: str, documents: int, line_docs: Iterable[bytes] | Mapping[bytes, int]) -> None:
        """Add `documents` documents of `source` and how many of them hold each line key (a
        mapping, or keys counted once each): the first pass's counts, however they were gathered."""
        self._docs_per_source[source] += documents
        self._line_docs[source].update(line_docs)

    def strip(self, source: str, text: str) -> str:
        """Second pass: the text without its source's boilerplate lines."""
        counts = self._line_docs.get(source)
        if not counts:
            return text
        threshold = max(
            self.min_docs, math.ceil(self.min_fraction * self._docs_per_source[source])
        )
        kept = [
            line
            for line in text.split("\n")
            if (key := self._key(line)) is None or counts[key] < threshold
        ]
        return "\n".join(kept)


class DocumentCleaner:
    """Applies normalization, boilerplate removal and quality rules, with per-step stats.

    Usage: if `needs_first_pass`, call `observe(doc)` on every document first; then call the
    cleaner on every document in the same order. It returns the cleaned document, or None when
    the document was dropped. `stats` lists one `StageStats` per step, in application order.
    """

    def __init__(self, cfg: CleanConfig | None = None) -> None:
        self.cfg = cfg or CleanConfig()
        self._rules = quality_rules(self.cfg.quality)
        self._boilerplate = (
            BoilerplateIndex(
                self.cfg.boilerplate_min_docs,
                self.cfg.boilerplate_min_fraction,
                self.cfg.boilerplate_min_line_chars,
            )
            if self.cfg.remove_boilerplate
            else None
        )
        self._normalize_stats = StageStats("normalize")
        self._boilerplate_stats = StageStats("boilerplate")
        self._rule_stats = [StageStats(f"filter:{rule.name}") for rule in self._rules]

    @property
    def needs_first_pass(self) -> bool:
        return self._boilerplate is not None

    @property
    def stats(self) -> list[StageStats]:
        steps = [self._normalize_stats]
        if self._boilerplate is not None:
            steps.append(self._boilerplate_stats)
        return steps + self._rule_stats

    def observe(self, doc: Document) -> None:
        """First pass over the corpus (only needed for boilerplate removal)."""
        if self._boilerplate is not None:
            self._boilerplate.add_counts(doc.source, 1, self.boilerplate_keys(doc))

    def boilerplate_keys(self, doc: Document) -> set[bytes]:
        """The line keys `observe` counts for one document, for counting them elsewhere (the Ray
        engine sums them across workers and hands the totals to `add_boilerplate_counts`)."""
        assert self._boilerplate is not None, "boilerplate removal is off"
        return self._boilerplate.line_keys(normalize_text(doc.text, self.cfg.max_blank_lines))

    def add_boilerplate_counts(self, source: str, documents: int, line_docs: Mapping[bytes, int]) -> None:
        """The first pass's counts, gathered elsewhere (`BoilerplateIndex.add_counts`)."""
        assert self._boilerplate is not None, "boilerplate removal is off"
        self._boilerplate.add_counts(source, documents, line_docs)

    def __call__(self, doc: Document) -> Document | None:
        text = normalize_text(doc.text, self.cfg.max_blank_lines)
        if not self._step(self._normalize_stats, len(doc.text), text):
            return None
        if self._boilerplate is not None:
            before = len(text)
            stripped = self._boilerplate.strip(doc.source, text)
            text = _collapse_blank_lines(stripped, self.cfg.max_blank_lines)
            if not self._step(self._boilerplate_stats, before, text):
                return None
        for rule, stats in zip(self._rules, self._rule_stats):
            rejected = rule.rejects(text)
            stats.record(len(text), None if rejected else len(text))
            if rejected:
                return None
        return replace(doc, text=text)

    @staticmethod
    def _step(stats: StageStats, chars_before: int, text: str) -> bool:
        """Record a transforming step; a document left with no visible text is dropped."""
        keep = bool(text.strip())
        stats.record(chars_before, len(text) if keep else None)
        return keep
