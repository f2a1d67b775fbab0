"""Benchmark decontamination by shared word n-grams."""

from __future__ import annotations

import pytest

from tokenmind.data.decontaminate import DecontaminationConfig, Decontaminator

EVAL_PASSAGE = (
    "The mitochondria is the powerhouse of the cell, producing most of the chemical energy "
    "needed to power the biochemical reactions of the cell."
)
OTHER_EVAL = "Which river flows through the city of Vienna, the capital of Austria, on its way east?"


def filler(count: int, prefix: str) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


def test_planted_passage_is_caught_despite_case_and_punctuation() -> None:
    index = Decontaminator([OTHER_EVAL, EVAL_PASSAGE])
    planted_words = EVAL_PASSAGE.upper().replace(",", "").split()[3:16]  # 13 words, mid-passage
    training = f"{filler(200, 'a')} -- {' '.join(planted_words)}!! {filler(50, 'b')}"
    assert index.match(training) == 1
    assert index.match(filler(300, "c")) is None


def test_twelve_shared_words_are_not_enough_for_13_grams() -> None:
    index = Decontaminator([EVAL_PASSAGE])
    twelve = " ".join(EVAL_PASSAGE.split()[:12])
    assert index.match(f"{filler(20, 'x')} {twelve} {filler(20, 'y')}") is None
    thirteen = " ".join(EVAL_PASSAGE.split()[:13])
    assert index.match(f"{filler(20, 'x')} {thirteen} {filler(20, 'y')}") == 0


def test_ngram_size_is_configurable() -> None:
    index = Decontaminator([EVAL_PASSAGE], DecontaminationConfig(ngram=4))
    assert index.match("we know the powerhouse of the cell well") == 0


def test_short_eval_texts_match_as_a_whole() -> None:
    question = "What is the boiling point of water at sea level?"  # 10 words < 13
    index = Decontaminator([question, "too short to use"])
    assert index.skipped_short_texts == 1
    assert index.match(f"Quiz: what is the boiling point of water at sea level? {filler(30, 'z')}") == 0
    assert index.match("what is the boiling point of water") is None
    assert index.match("this is too short to use as evidence") is None


def test_earliest_match_wins_and_invalid_action() -> None:
    index = Decontaminator([EVAL_PASSAGE, OTHER_EVAL])
    text = f"{OTHER_EVAL} then {EVAL_PASSAGE}"
    assert index.match(text) == 1
    with pytest.raises(ValueError, match="action"):
        DecontaminationConfig(action="delete")  # type: ignore[arg-type]
