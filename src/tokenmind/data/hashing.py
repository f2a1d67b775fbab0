"""Deterministic, vectorized hashing of words and word n-grams.

Three stages of the pipeline reason about word n-grams: the Gopher repetition filters
(`quality.py`), MinHash near-dedup (`dedup.py`) and benchmark decontamination
(`decontaminate.py`). They all need the same two things, and this module is where they live:

* Hashes that are stable across processes and runs. Python's built-in `hash()` of a string is
  salted per process, so a corpus deduplicated twice could differ; we use CRC-32 of the UTF-8
  bytes for words instead (fast, in C, and fixed forever).
* Speed. Hashing every n-gram as a Python tuple costs a tuple allocation per position. Instead
  each word is hashed once, and the n-gram hashes at every position are computed with a handful
  of whole-array numpy operations (a polynomial rolling combination, then a bit mixer).

All arithmetic is on uint64 and wraps modulo 2**64 on purpose.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

_WORD = re.compile(r"\w+")

# Odd 64-bit multiplier for the rolling combination (any large odd constant works; this one is
# the 64-bit golden-ratio constant, whose bits are well spread).
_ROLL = np.uint64(0x9E3779B97F4A7C15)
# Multipliers of MurmurHash3's 64-bit finalizer (Appleby, public domain).
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB93FE53A87)
_SHIFT = np.uint64(33)


def normalized_words(text: str) -> list[str]:
    """Split text into comparable words: NFKC-normalized, case-folded runs of word characters.

    Punctuation, case and Unicode compatibility forms are dropped so that "The end." and
    "the END" produce the same words. `\\w` is Unicode-aware, so this works for any script that
    separates words with spaces or punctuation.
    """
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def hash_words(words: Sequence[str]) -> np.ndarray:
    """One stable uint64 hash per word (CRC-32 of its UTF-8 bytes)."""
    return np.fromiter(
        (zlib.crc32(word.encode("utf-8")) for word in words), dtype=np.uint64, count=len(words)
    )


def _mix64(values: np.ndarray) -> np.ndarray:
    """Scramble uint64 values so every output bit depends on every input bit (a bijection)."""
    x = values ^ (values >> _SHIFT)
    x = x * _FMIX_1
    x ^= x >> _SHIFT
    x *= _FMIX_2
    x ^= x >> _SHIFT
    return x


def ngram_hashes_by_size(word_hashes: np.ndarray, sizes: Iterable[int]) -> dict[int, np.ndarray]:
    """`ngram_hashes` for several sizes at once, extending each size's rolling combination to
    the next instead of starting over (the Gopher filters need six consecutive sizes)."""
    wanted = sorted(set(sizes))
    if wanted and wanted[0] < 1:
        raise ValueError(f"n-gram size must be >= 1, got {wanted[0]}")
    result: dict[int, np.ndarray] = {}
    combined = word_hashes.astype(np.uint64)  # the 1-grams; a copy, never the caller's array
    size = 1
    for n in wanted:
        if n > len(word_hashes):
            result[n] = np.empty(0, dtype=np.uint64)
            continue
        while size < n:
            # The (size+1)-gram at i is the size-gram at i followed by word i + size.
            combined = combined[:-1] * _ROLL + word_hashes[size:]
            size += 1
        result[n] = _mix64(combined)
    return result


def ngram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """Hash of the n-gram starting at each position: `len(word_hashes) - n + 1` uint64 values.

    Returns an empty array when there are fewer than `n` words. The combination is order
    sensitive ("a b" and "b a" differ), and equal n-grams always get equal hashes.
    """
    return ngram_hashes_by_size(word_hashes, [n])[n]
