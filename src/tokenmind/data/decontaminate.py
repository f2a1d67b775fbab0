"""Find training documents that overlap evaluation texts (benchmark contamination).

A model that saw a benchmark's passages during pre-training scores well on that benchmark for
the wrong reason. Following the practice of GPT-3 (Brown et al. 2020, appendix C), a training
document is contaminated when it shares any word 13-gram with an evaluation text, after
normalizing both sides (NFKC, case-folded, punctuation dropped; see `normalized_words`).
Thirteen words is long enough that sharing one by chance is rare, yet short enough to catch a
passage embedded in an otherwise unrelated page.

Evaluation texts shorter than `ngram` words (many benchmark questions are) would never match
with that rule, so each such text of at least `min_short_words` words is used whole as one
shorter n-gram instead.

The index is a sorted array of n-gram hashes per n-gram size, with a parallel array of the
evaluation text each came from, so that a match can be reported against its source and a
lookup is a vectorized binary search (`np.searchsorted`), not a Python loop over n-grams.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tokenmind.data.hashing import hash_words, ngram_hashes, normalized_words


@dataclass
class DecontaminationConfig:
    """ngram: words per n-gram; action: drop contaminated documents ("remove") or keep them
    and only list them in the report ("report"); min_short_words: see the module docstring."""

    ngram: int = 13
    action: Literal["remove", "report"] = "remove"
    min_short_words: int = 8

    def __post_init__(self) -> None:
        if self.action not in ("remove", "report"):
            raise ValueError(f"action must be 'remove' or 'report', got {self.action!r}")


class Decontaminator:
    """An n-gram index over evaluation texts; `match(text)` says which one a text overlaps."""

    def __init__(self, eval_texts: Iterable[str], cfg: DecontaminationConfig | None = None) -> None:
        self.cfg = cfg or DecontaminationConfig()
        hashes: dict[int, list[np.ndarray]] = {}
        owners: dict[int, list[np.ndarray]] = {}
        self.num_eval_texts = 0
        self.skipped_short_texts = 0
        for index, text in enumerate(eval_texts):
            self.num_eval_texts += 1
            word_hashes = hash_words(normalized_words(text))
            size = min(self.cfg.ngram, len(word_hashes))
            if size == 0 or size < min(self.cfg.ngram, self.cfg.min_short_words):
                self.skipped_short_texts += 1
                continue
            grams = np.unique(ngram_hashes(word_hashes, size))
            hashes.setdefault(size, []).append(grams)
            owners.setdefault(size, []).append(np.full(len(grams), index, dtype=np.int64))
        # size -> (sorted n-gram hashes, eval text index of each)
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for size in sorted(hashes):
            all_hashes = np.concatenate(hashes[size])
            all_owners = np.concatenate(owners[size])
            order = np.argsort(all_hashes, kind="stable")
            self._index[size] = (all_hashes[order], all_owners[order])

    def match(self, text: str) -> int | None:
        """Index (in the order given) of an evaluation text sharing an n-gram with `text`.

        When several match, the one owning the earliest n-gram of `text` is returned.
        """
        word_hashes = hash_words(normalized_words(text))
        best: tuple[int, int] | None = None  # (position in text, eval index)
        for size, (keys, owners) in self._index.items():
            grams = ngram_hashes(word_hashes, size)
            if not len(grams):
                continue
            slots = np.searchsorted(keys, grams).clip(max=len(keys) - 1)
            hits = np.flatnonzero(keys[slots] == grams)
            if len(hits) and (best is None or hits[0] < best[0]):
                best = (int(hits[0]), int(owners[slots[hits[0]]]))
        return None if best is None else best[1]
