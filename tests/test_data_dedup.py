"""Exact and MinHash-LSH near-duplicate detection."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmind.data.dedup import (
    ExactDeduplicator,
    MinHashConfig,
    MinHashDeduplicator,
    choose_bands_rows,
    exact_key,
    shingle_hashes,
)


def words(start: int, stop: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(start, stop)]


def true_jaccard(a: str, b: str, ngram: int = 5) -> float:
    sa, sb = set(shingle_hashes(a, ngram).tolist()), set(shingle_hashes(b, ngram).tolist())
    return len(sa & sb) / len(sa | sb)


def variant(base: list[str], changed: int, tag: str) -> str:
    """`base` with its last `changed` words replaced by new ones."""
    return " ".join(base[: len(base) - changed] + words(0, changed, prefix=f"{tag}new"))


def test_exact_dedup_ignores_whitespace_layout_and_keeps_first() -> None:
    dedup = ExactDeduplicator()
    texts = ["hello world\nagain", "hello   world again", "Hello world again", "hello world\nagain"]
    assert [dedup.is_duplicate(text) for text in texts] == [False, True, False, True]
    assert exact_key("a  b") == exact_key("a\nb") != exact_key("a b c")


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.8, 0.9])
def test_bands_rows_place_the_s_curve_at_the_threshold(threshold: float) -> None:
    bands, rows = choose_bands_rows(threshold, 128)
    assert bands * rows <= 128
    # The S-curve 1 - (1 - s^r)^b rises steeply around (1/b)^(1/r).
    assert abs((1 / bands) ** (1 / rows) - threshold) < 0.1


def test_known_jaccard_above_is_removed_below_is_kept() -> None:
    base = words(0, 300)
    original = " ".join(base)
    # 5-gram shingles: 296 per document; changing the last k words changes k shingles of
    # each, so J = (296 - k) / (296 + k).
    near = variant(base, 8, "a")  # J = 288 / 304 = 0.947
    far = variant(base, 60, "b")  # J = 236 / 356 = 0.663
    assert true_jaccard(original, near) == pytest.approx(288 / 304)
    assert true_jaccard(original, far) == pytest.approx(236 / 356)

    dedup = MinHashDeduplicator(MinHashConfig(threshold=0.8, num_perm=128, ngram=5, seed=1))
    assert dedup.is_duplicate(original) is False
    assert dedup.is_duplicate(near) is True
    assert dedup.is_duplicate(far) is False
    assert dedup.is_duplicate(original) is True  # exact copies are near-duplicates too


def test_minhash_estimate_tracks_true_jaccard() -> None:
    dedup = MinHashDeduplicator(MinHashConfig(num_perm=256, seed=3))
    base = words(0, 400)
    original = " ".join(base)
    for changed in (10, 50, 120, 250):
        other = variant(base, changed, f"c{changed}")
        estimate = dedup.estimate_jaccard(dedup.signature(original), dedup.signature(other))
        # Standard error is sqrt(J(1 - J) / 256) <= 0.031; allow about 3 sigma.
        assert estimate == pytest.approx(true_jaccard(original, other), abs=0.1)


def test_near_dedup_is_deterministic_per_seed() -> None:
    text = " ".join(words(0, 50))
    same_a = MinHashDeduplicator(MinHashConfig(seed=7)).signature(text)
    same_b = MinHashDeduplicator(MinHashConfig(seed=7)).signature(text)
    other = MinHashDeduplicator(MinHashConfig(seed=8)).signature(text)
    assert same_a is not None and other is not None
    np.testing.assert_array_equal(same_a, same_b)
    assert not np.array_equal(same_a, other)


def test_normalization_case_and_punctuation_do_not_hide_duplicates() -> None:
    dedup = MinHashDeduplicator()
    text = " ".join(words(0, 100))
    assert dedup.is_duplicate(text) is False
    assert dedup.is_duplicate(text.upper().replace(" ", ", ")) is True


def test_short_and_wordless_texts() -> None:
    dedup = MinHashDeduplicator(MinHashConfig(ngram=5))
    assert len(shingle_hashes("only three words", 5)) == 1  # the whole text is one shingle
    assert dedup.is_duplicate("only three words") is False
    assert dedup.is_duplicate("Only three words!") is True
    assert dedup.is_duplicate("only three") is False
    assert dedup.signature("... !!! ---") is None
    assert dedup.is_duplicate("... !!! ---") is False
    assert dedup.is_duplicate("... !!! ---") is False


def test_many_documents_mixed_with_planted_near_duplicates() -> None:
    rng = np.random.default_rng(0)
    vocabulary = np.array(words(0, 3000))
    originals = [" ".join(rng.choice(vocabulary, size=120)) for _ in range(400)]
    planted = []
    for i in range(0, 400, 10):  # 40 copies with 2 words edited: Jaccard ~ 0.85-0.9
        tokens = originals[i].split()
        tokens[30], tokens[90] = "edited", "changed"
        planted.append(" ".join(tokens))
    dedup = MinHashDeduplicator(MinHashConfig(threshold=0.7))
    flags = [dedup.is_duplicate(text) for text in originals + planted]
    assert not any(flags[:400])
    # With J ~ 0.84 the chosen LSH bands make a pair a candidate with probability ~0.96.
    assert sum(flags[400:]) >= 36
