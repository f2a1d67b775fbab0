"""Self-consistency (sample N, vote on the extracted answers) and `tokenmind generate --self-consistency /
--beams` on a tiny random chat model: the vote counts what the extractor reads, the samples are
best-of-N's (one sampling path), and the CLI prints the majority and the best beam."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_sft_helpers import question, tiny_model_dir, tiny_tokenizer
from test_train_helpers import one_thread  # noqa: F401

from tokenmind.cli import main
from tokenmind.engine.llm import LLM
from tokenmind.engine.sampling import SamplingParams
from tokenmind.posttrain.sampling import Vote, best_of_n, self_consistency
from tokenmind.posttrain.tasks import get_answer_extractor, numeric_answer

PARAMS = SamplingParams(temperature=1.0, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", tiny_tokenizer())


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_num_seqs=8)


def test_the_majority_wins_and_ties_go_to_the_answer_given_first():
    vote = Vote({}, ["a", "b", "c", "d", "e"], [None, "4", "7", "7", "4"])
    assert vote.answer == "4" and vote.share == pytest.approx(0.4)  # 4 and 7 tie; 4 came first
    assert Vote({}, ["a", "b", "c"], ["7", "4", "4"]).answer == "4"
    assert Vote({}, ["a", "b"], [None, None]).answer is None and Vote({}, ["a"], [None]).share == 0.0


def test_numeric_answers_vote_together_when_they_are_the_same_number():
    texts = ["So the answer is 1,000.", "Answer: 1000.0", "It is $1000", "half: 0.50", "1/2", "no number here"]
    assert [numeric_answer(t) for t in texts] == ["1000", "1000", "1000", "1/2", "1/2", None]
    assert get_answer_extractor("choice")("The answer is B") == "B"
    with pytest.raises(ValueError, match="numeric, choice"):
        get_answer_extractor("regex")


def test_self_consistency_votes_on_best_of_ns_samples(llm):
    items = [{"prompt": [{"role": "user", "content": question(f)}]} for f in ("apple", "lime")]
    by_letter = lambda text: text[:1] or None  # noqa: E731  (a random model writes no numbers: vote on a letter)
    votes = self_consistency(llm, items, 6, by_letter, PARAMS, seed=4)
    ranked = best_of_n(llm, items, lambda p, c, **m: 0.0, 6, PARAMS, seed=4)
    for vote, r in zip(votes, ranked):
        assert vote.texts == r.texts and len(set(vote.texts)) > 1  # the same seeded samples
        assert vote.answers == [by_letter(t) for t in vote.texts]
        assert vote.share == vote.answers.count(vote.answer) / 6 >= max(map(vote.answers.count, vote.answers)) / 6
    with pytest.raises(ValueError, match="--temperature"):
        self_consistency(llm, items, 2, "numeric", SamplingParams(temperature=0))


def test_cli_self_consistency_and_beams(model_dir, capsys):
    base = ["generate", "--model", str(model_dir), "--max-tokens", "6", "--chat", "What color is a lime?"]
    assert main([*base, "--temperature", "1", "--seed", "3", "--self-consistency", "3", "--answer", "4",
                 "--verbose"]) == 0
    out = capsys.readouterr()
    assert out.out.count("--- candidate") == 3 and "--- voted answer" in out.out
    assert "self-consistency over 3 samples (numeric answers)" in out.err
    assert main([*base, "--beams", "3", "--length-penalty", "0.5", "--early-stopping", "never", "--verbose"]) == 0
    out = capsys.readouterr()
    assert out.out.count("--- beam") == 3 and "beam search with 3 beams, length penalty 0.5" in out.err
    scores = [float(line.split("score ")[1].split(",")[0]) for line in out.out.splitlines() if "--- beam" in line]
    assert scores == sorted(scores, reverse=True)
    assert main([*base, "--beams", "3", "--length-penalty", "0.5", "--early-stopping", "never"]) == 0
    best = capsys.readouterr().out.strip()
    llm = LLM(model_dir, max_num_seqs=3)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What color is a lime?"}],
                                            add_generation_prompt=True)
    params = SamplingParams(max_tokens=6, num_beams=3, length_penalty=0.5, early_stopping="never")
    assert best == llm.generate(ids, params)[0].text.strip()
    for flags, message in [(["--beams", "2", "--best-of", "2"], "give one of them"),
                           (["--length-penalty", "2"], "go with --beams N"),
                           (["--extract", "choice"], "goes with --self-consistency N"),
                           (["--beams", "2", "--top-k", "5"], "does not combine with top_k")]:
        assert main(["generate", "--model", str(model_dir), *flags, "hi"]) == 2
        assert message in capsys.readouterr().err
