"""Language-agnostic document quality filters (the heuristic rules of the Gopher paper).

Rae et al. 2021 ("Scaling Language Models: Methods, Analysis & Insights from Training Gopher",
appendix A) showed that a few cheap statistics remove most machine-generated and
low-information web text: too short or too long, symbol soup, and above all repetition
(repeated lines, one phrase dominating the text, long spans of duplicated n-grams). We keep the
rules that do not depend on a language (no stop-word lists, no alphabet checks). Defaults are
the paper's thresholds for repetition and symbols and its 50-word minimum; the character
bounds are ours. Words are whitespace-separated tokens, as in the paper, so scripts written
without spaces (Chinese, Japanese, Thai) need `min_words=None`.

Each rule is a named predicate that returns True when a document should be *removed*; the
cleaner applies them in order and charges each removal to the first rule that fired, so the
report shows what each threshold cost. Setting a threshold to None disables its rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np

from tokenmind.data.hashing import hash_words, ngram_hashes_by_size


def _gopher_top_ngram() -> dict[int, float]:
    return {2: 0.20, 3: 0.18, 4: 0.16}


def _gopher_duplicate_ngram() -> dict[int, float]:
    return {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


@dataclass
class QualityConfig:
    """Thresholds of the quality rules; None disables a rule.

    min_chars / max_chars / min_words: length bounds.
    max_symbol_word_ratio: most occurrences of any one of `symbols` per word (Gopher: "#" and
        ellipses, typical of tag clouds, truncated snippets and menus).
    max_duplicate_line_fraction / max_duplicate_line_char_fraction: share of non-blank lines
        (and of their characters) that repeat an earlier line of the same document.
    max_top_ngram_char_fraction: {n: limit} on the characters covered by the single most
        frequent n-gram, for short n (a phrase repeated over and over).
    max_duplicate_ngram_char_fraction: {n: limit} on the characters covered by all n-grams that
        occur more than once, for longer n (copy-pasted passages).
    """

    min_chars: int | None = 200
    max_chars: int | None = 500_000
    min_words: int | None = 50
    max_symbol_word_ratio: float | None = 0.1
    symbols: tuple[str, ...] = ("#", "...", "\u2026")
    max_duplicate_line_fraction: float | None = 0.30
    max_duplicate_line_char_fraction: float | None = 0.20
    max_top_ngram_char_fraction: dict[int, float] | None = field(default_factory=_gopher_top_ngram)
    max_duplicate_ngram_char_fraction: dict[int, float] | None = field(
        default_factory=_gopher_duplicate_ngram
    )

    @classmethod
    def disabled(cls) -> QualityConfig:
        """No rule at all, for curated text: Gopher's web rules would drop short answers and
        lists of facts, whose n-grams repeat by design."""
        return cls(**{f.name: None for f in fields(cls) if f.name != "symbols"})


class QualityRule(NamedTuple):
    """A named removal predicate: `rejects(text)` is True when the document should go."""

    name: str
    rejects: Callable[[str], bool]


def symbol_word_ratio(text: str, symbols: tuple[str, ...]) -> float:
    """The highest count of any one symbol per whitespace-separated word."""
    words = len(text.split())
    if not words or not symbols:
        return 0.0
    return max(text.count(symbol) for symbol in symbols) / words


def duplicate_line_fractions(text: str) -> tuple[float, float]:
    """(fraction of non-blank lines, fraction of their characters) repeating an earlier line."""
    seen: set[str] = set()
    lines = duplicate_lines = chars = duplicate_chars = 0
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            continue
        lines += 1
        chars += len(line)
        if line in seen:
            duplicate_lines += 1
            duplicate_chars += len(line)
        else:
            seen.add(line)
    if not lines:
        return 0.0, 0.0
    return duplicate_lines / lines, duplicate_chars / chars


@functools.lru_cache(maxsize=1)
def _word_stats(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(word hashes, word lengths); cached because consecutive n-gram rules see the same text."""
    words = text.split()
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    return hash_words(words), lengths


def top_ngram_char_fraction(hashes: np.ndarray, word_lengths: np.ndarray, n: int) -> float:
    """Characters covered by every occurrence of the most frequent n-gram, over all word chars.

    `hashes` are the document's n-gram hashes (`ngram_hashes`), `word_lengths` its word lengths.
    """
    total = int(word_lengths.sum())
    if not len(hashes) or not total:
        return 0.0
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    group_starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    counts = np.diff(group_starts, append=len(ordered))
    best = int(np.argmax(counts))
    if counts[best] < 2:
        return 0.0
    first = order[group_starts[best]]
    return float(counts[best] * word_lengths[first : first + n].sum() / total)


def duplicate_ngram_char_fraction(hashes: np.ndarray, word_lengths: np.ndarray, n: int) -> float:
    """Characters of words inside any n-gram occurrence that repeats an earlier one."""
    total = int(word_lengths.sum())
    if not len(hashes) or not total:
        return 0.0
    # After a stable sort, equal hashes are adjacent in position order: every slot equal to
    # its predecessor is a later occurrence.
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    starts = order[1:][ordered[1:] == ordered[:-1]]
    if not len(starts):
        return 0.0
    # Mark words [start, start + n) of each repeated occurrence with a difference array
    # (starts are distinct positions, so plain fancy-index updates cannot collide).
    cover = np.zeros(len(word_lengths) + 1, dtype=np.int64)
    cover[starts] += 1
    cover[starts + n] -= 1
    covered = np.cumsum(cover[:-1]) > 0
    return float(word_lengths[covered].sum() / total)


def _ngram_rule(
    limits: dict[int, float], statistic: Callable[[np.ndarray, np.ndarray, int], float]
) -> Callable[[str], bool]:
    sizes = sorted(limits)

    def rejects(text: str) -> bool:
        word_hashes, word_lengths = _word_stats(text)
        by_size = ngram_hashes_by_size(word_hashes, sizes)
        for n in sizes:
            value = statistic(by_size[n], word_lengths, n)
            if value > limits[n]:
                return True
            if value == 0.0:
                # No n-gram repeats, so no longer one can (its first n words would repeat).
                return False
        return False

    return rejects


def quality_rules(cfg: QualityConfig) -> list[QualityRule]:
    """The enabled rules, cheapest first, so expensive n-gram statistics run on fewer docs."""
    rules: list[QualityRule] = []
    if cfg.min_chars is not None:
        rules.append(QualityRule("min_chars", lambda text: len(text) < cfg.min_chars))
    if cfg.max_chars is not None:
        rules.append(QualityRule("max_chars", lambda text: len(text) > cfg.max_chars))
    if cfg.min_words is not None:
        rules.append(QualityRule("min_words", lambda text: len(text.split()) < cfg.min_words))
    if cfg.max_symbol_word_ratio is not None:
        rules.append(
            QualityRule(
                "symbol_word_ratio",
                lambda text: symbol_word_ratio(text, cfg.symbols) > cfg.max_symbol_word_ratio,
            )
        )
    line_limits = (cfg.max_duplicate_line_fraction, cfg.max_duplicate_line_char_fraction)
    if any(limit is not None for limit in line_limits):

        def too_many_duplicate_lines(text: str) -> bool:
            fractions = duplicate_line_fractions(text)
            return any(
                limit is not None and value > limit for value, limit in zip(fractions, line_limits)
            )

        rules.append(QualityRule("duplicate_lines", too_many_duplicate_lines))
    if cfg.max_top_ngram_char_fraction:
        rules.append(
            QualityRule(
                "top_ngram", _ngram_rule(cfg.max_top_ngram_char_fraction, top_ngram_char_fraction)
            )
        )
    if cfg.max_duplicate_ngram_char_fraction:
        rules.append(
            QualityRule(
                "duplicate_ngram",
                _ngram_rule(cfg.max_duplicate_ngram_char_fraction, duplicate_ngram_char_fraction),
            )
        )
    return rules
