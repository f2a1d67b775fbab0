"""Normalization, Gopher-style quality rules and boilerplate removal, with their stats."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmind.data.clean import CleanConfig, DocumentCleaner, normalize_text
from tokenmind.data.hashing import hash_words, ngram_hashes
from tokenmind.data.quality import (
    QualityConfig,
    duplicate_line_fractions,
    duplicate_ngram_char_fraction,
    quality_rules,
    symbol_word_ratio,
    top_ngram_char_fraction,
)
from tokenmind.data.readers import Document

NO_RULES = QualityConfig(
    min_chars=None,
    max_chars=None,
    min_words=None,
    max_symbol_word_ratio=None,
    max_duplicate_line_fraction=None,
    max_duplicate_line_char_fraction=None,
    max_top_ngram_char_fraction=None,
    max_duplicate_ngram_char_fraction=None,
)


def distinct_words(count: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


def doc(text: str, source: str = "src", id: str = "d") -> Document:
    return Document(text=text, source=source, id=id)


# --- normalization -----------------------------------------------------------------------------


def test_normalize_unicode_and_whitespace() -> None:
    raw = "\ufeffCafe\u0301\u00a0bar  \r\n\tindented()\t \r\n\n\n\n\nend\u200b\x00 \n\n"
    assert normalize_text(raw) == "Caf\u00e9 bar\n\tindented()\n\n\nend"


def test_normalize_keeps_code_indentation_and_joiners() -> None:
    code = "def f(x):\n    if x:\n        return 1\n\n\n    return 2"
    assert normalize_text(code) == code
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # emoji ZWJ sequence
    assert normalize_text(family) == family


@pytest.mark.parametrize("max_blank, expected", [(0, "a\nb"), (1, "a\n\nb"), (2, "a\n\n\nb")])
def test_normalize_collapses_blank_runs(max_blank: int, expected: str) -> None:
    assert normalize_text("a\n\n\n\n\n\nb", max_blank_lines=max_blank) == expected


# --- Gopher statistics -------------------------------------------------------------------------


def test_duplicate_line_fractions() -> None:
    text = "aaaa\nbb\naaaa\n\ncc\naaaa"
    line_fraction, char_fraction = duplicate_line_fractions(text)
    assert line_fraction == pytest.approx(2 / 5)  # two of five non-blank lines repeat "aaaa"
    assert char_fraction == pytest.approx(8 / 16)


def word_arrays(text: str) -> tuple[np.ndarray, np.ndarray]:
    words = text.split()
    return hash_words(words), np.array([len(word) for word in words])


def test_top_ngram_char_fraction() -> None:
    hashes, lengths = word_arrays("ab cd ab cd ab cd xyz")  # "ab cd" x3 covers 12 of 15 chars
    assert top_ngram_char_fraction(ngram_hashes(hashes, 2), lengths, 2) == pytest.approx(12 / 15)
    hashes, lengths = word_arrays("each word here differs")
    assert top_ngram_char_fraction(ngram_hashes(hashes, 2), lengths, 2) == 0.0


def test_duplicate_ngram_char_fraction() -> None:
    text = "a1 b2 c3 x a1 b2 c3 yy"  # the second "a1 b2 c3" repeats: 6 of 15 word chars
    hashes, lengths = word_arrays(text)
    assert duplicate_ngram_char_fraction(ngram_hashes(hashes, 3), lengths, 3) == pytest.approx(6 / 15)
    assert duplicate_ngram_char_fraction(ngram_hashes(hashes, 4), lengths, 4) == 0.0


def test_symbol_word_ratio() -> None:
    assert symbol_word_ratio("#tag #tag words here ...", ("#", "...")) == pytest.approx(2 / 5)


# --- quality rules in the cleaner --------------------------------------------------------------


def test_each_rule_removes_its_documents_and_counts_them() -> None:
    quality = QualityConfig(min_chars=20, max_chars=1000, min_words=5)
    cleaner = DocumentCleaner(CleanConfig(remove_boilerplate=False, quality=quality))
    good = distinct_words(60)
    cases = {
        "min_chars": "too short",
        "max_chars": distinct_words(400),
        "min_words": "onlyfour wordsinthis longish document",
        "symbol_word_ratio": distinct_words(30) + " #a #b #c #d",
        "duplicate_lines": "\n".join(["same line repeated here"] * 4 + [distinct_words(20)]),
        "top_ngram": "spam eggs " * 20 + distinct_words(15),
        "duplicate_ngram": distinct_words(30) + " " + distinct_words(30) + " " + distinct_words(10, "v"),
    }
    assert cleaner(doc(good)) is not None
    for name, text in cases.items():
        assert cleaner(doc(text)) is None, name
    stats = {stage.name: stage for stage in cleaner.stats}
    assert [stage.name for stage in cleaner.stats] == ["normalize"] + [f"filter:{name}" for name in cases]
    for name, text in cases.items():
        stage = stats[f"filter:{name}"]
        assert (stage.docs_removed, stage.chars_removed) == (1, len(text)), name
    assert stats["normalize"].docs_in == len(cases) + 1


def test_disabled_rules_are_absent() -> None:
    assert quality_rules(NO_RULES) == []
    only_length = QualityConfig(**{**NO_RULES.__dict__, "min_words": 3})
    assert [rule.name for rule in quality_rules(only_length)] == ["min_words"]


def test_normalization_stats_and_empty_documents() -> None:
    cleaner = DocumentCleaner(CleanConfig(remove_boilerplate=False, quality=NO_RULES))
    messy, blank = "text   \n\n\n\n\nmore  ", " \u200b \n\t\n"
    cleaned = cleaner(doc(messy))
    assert cleaned is not None and cleaned.text == "text\n\n\nmore"
    assert cleaner(doc(blank)) is None
    normalize = cleaner.stats[0]
    assert (normalize.docs_in, normalize.docs_removed) == (2, 1)
    assert normalize.chars_removed == (len(messy) - len(cleaned.text)) + len(blank)


# --- boilerplate -------------------------------------------------------------------------------


def site_page(i: int) -> str:
    return (
        "Home | About | Contact | Blog\n"
        f"Article {i}: {distinct_words(12, f'p{i}x')}\n"
        "}\n"
        "Copyright 2024 Example Corp. All rights reserved."
    )


def test_boilerplate_lines_are_removed_per_source() -> None:
    cfg = CleanConfig(quality=NO_RULES, boilerplate_min_docs=5, boilerplate_min_fraction=0.5)
    cleaner = DocumentCleaner(cfg)
    corpus = [doc(site_page(i), source="site") for i in range(10)]
    # The same navigation line in another source appears in too few of *its* documents.
    corpus += [doc(site_page(100), source="other"), doc(distinct_words(40), source="other")]
    for document in corpus:
        cleaner.observe(document)
    cleaned = [cleaner(document) for document in corpus]
    assert all(result is not None for result in cleaned)
    for i, result in enumerate(cleaned[:10]):
        assert result.text == f"Article {i}: {distinct_words(12, f'p{i}x')}\n}}"  # short "}" kept
    assert cleaned[10].text == site_page(100)
    stats = {stage.name: stage for stage in cleaner.stats}["boilerplate"]
    removed_per_page = len("Home | About | Contact | Blog\n") + len(
        "\nCopyright 2024 Example Corp. All rights reserved."
    )
    assert (stats.docs_in, stats.docs_removed, stats.chars_removed) == (12, 0, 10 * removed_per_page)


def test_document_made_only_of_boilerplate_is_dropped() -> None:
    cleaner = DocumentCleaner(CleanConfig(quality=NO_RULES, boilerplate_min_docs=3, boilerplate_min_fraction=0))
    corpus = [doc(f"Subscribe to our newsletter today!\nbody {i} unique") for i in range(4)]
    corpus.append(doc("Subscribe to our newsletter today!"))
    for document in corpus:
        cleaner.observe(document)
    assert [cleaner(d) is None for d in corpus] == [False] * 4 + [True]
    stats = {stage.name: stage for stage in cleaner.stats}["boilerplate"]
    assert stats.docs_removed == 1
