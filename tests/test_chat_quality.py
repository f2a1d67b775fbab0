"""The chat-quality figures: answer checks, the prompt set's shape, and the judge on a tiny model."""

import pytest
from test_serve_fixtures import tiny_pretrained

from tokenmind.eval.chat_quality import (MC_LETTER, chat_answers, evaluate_chat, judge_preference,
                                         load_chat_prompts, mean_nll, passes, reference_nll)


def test_checks_match_whole_words_phrases_groups_and_counts():
    assert passes("Hello! How are you?", {"any": ["hello", "hi"]})
    assert not passes("This is it.", {"any": ["hi"]})  # not inside "This"
    assert passes("Good morning to you", {"any": ["good morning"]})
    assert passes("The capital of Japan is Tokyo.", {"any": ["Tokyo"]})
    count = {"count": ["red", "blue", "green", "yellow"], "min": 3}
    assert passes("Red, blue and green.", count) and not passes("Red, red and blue.", count)
    groups = {"all": [["one", "1"], ["two", "2"], ["three", "3"]]}
    assert passes("1, 2, three", groups) and not passes("one, two", groups)
    with pytest.raises(ValueError, match="unknown check"):
        passes("x", {"some": []})


def test_multiple_choice_openings_are_recognised():
    assert MC_LETTER.match("B. a bubction in a cup") and MC_LETTER.match("(C) Paris")
    assert not MC_LETTER.match("Bob is here.") and not MC_LETTER.match("A dog is an animal.")


def test_the_prompt_set_is_varied_and_complete():
    items = load_chat_prompts()
    assert len(items) >= 100 and len({it["id"] for it in items}) == len(items)
    assert len({it["prompt"] for it in items}) == len(items)
    assert {"greeting", "identity", "capital", "definition", "instruction"} <= {it["category"] for it in items}
    for it in items:  # every reference answer passes its own check: the checks are fair
        assert passes(it["reference"], it["check"]), it["id"]
        assert not MC_LETTER.match(it["reference"])


def test_figures_on_a_tiny_model():
    pre = tiny_pretrained()
    items = load_chat_prompts()[:6]
    answers = chat_answers(pre.model, pre.tokenizer, [it["prompt"] for it in items], max_tokens=8)
    assert len(answers) == 6 and all(isinstance(a, str) for a in answers)
    result = evaluate_chat(pre.model, pre.tokenizer, pre.model, pre.tokenizer, baseline=["Hello."] * 6,
                           prompts=items, max_tokens=8)
    assert 0 <= result["on_topic"] <= 1 and result["n"] == 6
    assert result["fluency_ratio"] > 0 and result["nll"] > 0
    pref = result["preference"]
    assert pref["wins"] + pref["losses"] + pref["ties"] == 6
    reference = reference_nll(pre.model, pre.tokenizer, items)  # computed once, passed in: the same figures
    assert result["reference_nll"] == pytest.approx(reference)
    again = evaluate_chat(pre.model, pre.tokenizer, pre.model, pre.tokenizer, prompts=items, max_tokens=8,
                          reference=2 * reference)  # the given denominator is the one used, not recomputed
    assert again["nll"] == pytest.approx(result["nll"])
    assert again["fluency_ratio"] == pytest.approx(result["fluency_ratio"] / 2)


def test_the_judge_prefers_the_likelier_answer_in_both_orders():
    pre = tiny_pretrained()
    q = ["Say something."]
    # identical answers: each order prefers position A or B the same way, so never a decided pair
    same = judge_preference(pre.model, pre.tokenizer, q, ["abc"], ["abc"])
    assert same["wins"] == same["losses"] == 0 and same["ties"] == 1
    assert same["corrected_wins"] == same["corrected_losses"] == 0  # equal answers: the margins cancel exactly
    assert same["position_bias"] in (0.0, 1.0)
    assert mean_nll(pre.model, pre.tokenizer, q, ["aaaa"]) > 0


def test_a_judge_that_always_says_a_ties_strictly_but_is_corrected(monkeypatch):
    """A judge leaning 5 nats towards "A" that still likes the better answer by 1 nat: the strict
    protocol ties every pair, the position-corrected margin finds the better answer."""
    import tokenmind.eval.chat_quality as cq

    pre = tiny_pretrained()

    def biased(judge, requests, batch_size):
        scores = []
        for ctx, cont in requests:
            text = pre.tokenizer.decode(ctx)
            a_part = text.split("Answer A:")[1].split("Answer B:")[0]
            letter_a = cont == pre.tokenizer.encode("A")
            good_here = "good" in (a_part if letter_a else text.split("Answer B:")[1])
            scores.append((5.0 if letter_a else 0.0) + (1.0 if good_here else 0.0))
        return scores

    monkeypatch.setattr(cq, "loglikelihoods", biased)
    r = cq.judge_preference(pre.model, pre.tokenizer, ["q1", "q2"], ["good one", "bad one"], ["bad", "good"])
    assert r["ties"] == 2 and r["win_rate"] is None and r["position_bias"] == 1.0
    assert (r["corrected_wins"], r["corrected_losses"], r["corrected_win_rate"]) == (1, 1, 0.5)
