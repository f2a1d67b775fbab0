"""Exact and near-duplicate document removal, keeping the first occurrence.

Duplicated text is memorized instead of learned and silently reweights the corpus toward
whatever got mirrored most, so both kinds are removed:

* Exact duplicates (`ExactDeduplicator`): a 128-bit BLAKE2 digest of the text with whitespace
  runs collapsed. Only digests are kept in memory.
* Near duplicates (`MinHashDeduplicator`): documents whose sets of word n-grams ("shingles")
  have Jaccard similarity above a threshold, e.g. the same article with a different header.
  Comparing all pairs is quadratic, so we use MinHash (Broder 1997) to summarize each shingle
  set in `num_perm` numbers whose agreement rate estimates the Jaccard similarity, and
  locality-sensitive hashing (Indyk & Motwani 1998; Leskovec, Rajaraman & Ullman, "Mining of
  Massive Datasets", ch. 3) to find candidate pairs: the signature is cut into `bands` bands of
  `rows` values, and two documents become candidates when any band matches exactly. The
  probability of that is 1 - (1 - J**rows)**bands, an S-curve whose steepest point we place at
  the threshold (`choose_bands_rows`). Candidates are then confirmed by their estimated
  Jaccard, which removes most of LSH's false positives.

Both classes are streaming: `is_duplicate(text)` answers for one document and remembers it if
it is new, so the pipeline never holds the corpus in memory. Order matters: the first of a
group of duplicates is the one kept.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from tokenmind.data.hashing import hash_words, ngram_hashes, normalized_words


def exact_key(text: str) -> bytes:
    """Content hash of a document, insensitive to how its whitespace is laid out."""
    return hashlib.blake2b(" ".join(text.split()).encode("utf-8"), digest_size=16).digest()


class ExactDeduplicator:
    """Flags documents whose whitespace-normalized text was already seen."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def band_keys(self, signature: np.ndarray) -> list[bytes]:
        """The LSH bucket key of each band: two documents are candidates when any key matches."""
        return [signature[band * self.rows : (band + 1) * self.rows].tobytes() for band in range(self.bands)]

    def is_duplicate(self, text: str) -> bool:
        key = exact_key(text)
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


@dataclass
class MinHashConfig:
    """Near-dedup settings.

    threshold: Jaccard similarity of shingle sets at or above which a document is a duplicate.
    num_perm: signature length; the estimate's standard error is about sqrt(J(1-J)/num_perm).
    ngram: words per shingle (documents shorter than this form a single shingle).
    seed: picks the hash functions; the same seed gives the same decisions on the same input.
    """

    threshold: float = 0.8
    num_perm: int = 128
    ngram: int = 5
    seed: int = 0


def choose_bands_rows(threshold: float, num_perm: int) -> tuple[int, int]:
    """The (bands, rows) with bands * rows <= num_perm that best separates around `threshold`.

    Minimizes the area of false positives (pairs below the threshold that become candidates)
    plus false negatives (pairs above it that do not), integrating the LSH S-curve numerically.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"Jaccard threshold must be in (0, 1), got {threshold}")
    below = np.linspace(0.0, threshold, 256)
    above = np.linspace(threshold, 1.0, 256)
    best = (float("inf"), 1, 1)  # (error, bands, rows)
    for rows in range(1, num_perm + 1):
        for bands in range(1, num_perm // rows + 1):
            false_positive = np.trapezoid(1.0 - (1.0 - below**rows) ** bands, below)
            false_negative = np.trapezoid((1.0 - above**rows) ** bands, above)
            best = min(best, (float(false_positive + false_negative), bands, rows))
    return best[1], best[2]


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """The distinct hashed word n-grams of a text (sorted uint64); see `normalized_words`."""
    word_hashes = hash_words(normalized_words(text))
    if 0 < len(word_hashes) < ngram:
        return np.unique(ngram_hashes(word_hashes, len(word_hashes)))
    return np.unique(ngram_hashes(word_hashes, ngram))


class MinHashDeduplicator:
    """Streaming MinHash-LSH near-duplicate detection.

    The k-th of the `num_perm` hash functions is multiply-shift hashing (Dietzfelbinger et al.
    1997): h_k(x) = ((a_k * x + b_k) mod 2**64) >> 32 with a random odd a_k and random b_k.
    That is one multiply, add and shift per shingle and function, evaluated for all of them in
    one numpy expression; it is a sound family here because the shingle hashes it is applied
    to are already thoroughly mixed. Signatures are the 32-bit minima, stored as uint32.
    """

    _CHUNK = 4096  # shingles per block, bounding the (shingles x num_perm) temporary

    def __init__(self, cfg: MinHashConfig | None = None) -> None:
        self.cfg = cfg or MinHashConfig()
        self.bands, self.rows = choose_bands_rows(self.cfg.threshold, self.cfg.num_perm)
        rng = np.random.default_rng(self.cfg.seed)
        size = self.cfg.num_perm
        self._multipliers = rng.integers(0, 2**64, size=size, dtype=np.uint64) | np.uint64(1)
        self._increments = rng.integers(0, 2**64, size=size, dtype=np.uint64)
        self._buckets: list[defaultdict[bytes, list[int]]] = [
            defaultdict(list) for _ in range(self.bands)
        ]
        self._signatures: list[np.ndarray] = []

    def signature(self, text: str) -> np.ndarray | None:
        """The MinHash signature (num_perm uint32), or None for a text without words."""
        shingles = shingle_hashes(text, self.cfg.ngram)
        if not len(shingles):
            return None
        signature = np.full(self.cfg.num_perm, 2**32 - 1, dtype=np.uint64)
        for start in range(0, len(shingles), self._CHUNK):
            block = shingles[start : start + self._CHUNK, None] * self._multipliers[None, :]
            block += self._increments[None, :]
            block >>= np.uint64(32)
            np.minimum(signature, block.min(axis=0), out=signature)
        return signature.astype(np.uint32)

    @staticmethod
    def estimate_jaccard(a: np.ndarray, b: np.ndarray) -> float:
        """Fraction of agreeing signature positions: an unbiased Jaccard estimate."""
        return float(np.mean(a == b))

    def band_keys(self, signature: np.ndarray) -> list[bytes]:
        """The LSH bucket key of each band: two documents are candidates when any key matches."""
        return [signature[band * self.rows : (band + 1) * self.rows].tobytes() for band in range(self.bands)]

    def is_duplicate(self, text: str) -> bool:
        """True if `text` is a near-duplicate of an earlier kept document; else remember it.

        Texts without any word are never near-duplicates (exact dedup handles those).
        """
        signature = self.signature(text)
        if signature is None:
            return False
        band_keys = self.band_keys(signature)
        checked: set[int] = set()
        for buckets, key in zip(self._buckets, band_keys):
            for candidate in buckets.get(key, ()):
                if candidate in checked:
                    continue
                checked.add(candidate)
                similarity = self.estimate_jaccard(signature, self._signatures[candidate])
                if similarity >= self.cfg.threshold:
                    return True
        doc_index = len(self._signatures)
        self._signatures.append(signature)
        for buckets, key in zip(self._buckets, band_keys):
            buckets[key].append(doc_index)
        return False
