"""Multiple-choice scoring: rigged bigram models must pick the planted answers, length
normalisation must change the pick when lengths differ, and the prompt formats are as documented."""

import pytest
import torch
from test_eval_fixtures import VOCAB, ByteTokenizer, bigram_model, preferring, random_model
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.eval.multiple_choice import build_prompts, encode_pair, evaluate_mc


def item(question, choices, answer, **extra):
    return {"id": f"t/{question[:12]}/{answer}", "question": question, "choices": choices, "answer": answer, **extra}


def test_the_choice_the_model_favours_wins():
    model = bigram_model(preferring({"x": 8.0}))
    items = [item("Which letter?", ["abcd", "xxxx", "qqqq"], 1), item("Again?", ["xy", "ab", "cd"], 0)]
    result = evaluate_mc(model, ByteTokenizer(), "arc_easy", items)
    assert result["n"] == 2 and result["acc"] == result["acc_norm"] == 1.0
    assert [p["pred"] for p in result["predictions"]] == [1, 0]


def test_length_normalisation_prefers_the_likelier_per_byte_choice():
    # p(x) ≈ 0.61: a short choice wins on the summed log-prob, a long run of x's per byte.
    model = bigram_model(preferring({"x": 6.0}))
    items = [item("Pick one", ["x", "xxxxxxxx"], 1)]
    result = evaluate_mc(model, ByteTokenizer(), "piqa", items)
    (pred,) = result["predictions"]
    assert (pred["pred"], pred["pred_norm"], pred["pred_per_token"]) == (0, 1, 1)
    assert (result["acc"], result["acc_norm"]) == (0.0, 1.0)


def test_winogrande_scores_the_shared_rest_of_the_sentence():
    sentence = "The trophy did not fit in the case because _ was too big."
    pairs = build_prompts("winogrande", [item(sentence, ["the trophy", "the case"], 0)])[0]
    assert pairs == [("The trophy did not fit in the case because the trophy", " was too big."),
                     ("The trophy did not fit in the case because the case", " was too big.")]
    table = torch.zeros(VOCAB, VOCAB)
    table[ord("b"), ord(" ")] = 10.0  # only an option ending in "b" makes the rest of the sentence likely
    items = [item("Then _ left.", ["aa", "bb"], 1), item("So _ stayed.", ["bb", "aa"], 0)]
    result = evaluate_mc(bigram_model(table), ByteTokenizer(), "winogrande", items)
    assert result["acc"] == result["acc_norm"] == 1.0


def test_prompt_formats():
    arc = build_prompts("arc_easy", [item("Why is the sky blue?", ["Rayleigh scattering", "paint"], 0)])[0]
    assert arc[0] == ("Question: Why is the sky blue?\nAnswer:", " Rayleigh scattering")
    hs = build_prompts("hellaswag", [item("Baking: A man  opens the oven. He", ["takes out a cake."], 0)])[0]
    assert hs == [("Baking: A man opens the oven. He", " takes out a cake.")]
    q = item("2 + 2 =", ["3", "4"], 1, subject="elementary_mathematics")
    (cloze,) = build_prompts("mmlu", [q])
    assert cloze[1] == ("The following are questions (with answers) about elementary mathematics.\n\n"
                        "Question: 2 + 2 =\nAnswer:", " 4")
    (lettered,) = build_prompts("mmlu_mc", [q])
    assert lettered[0][0].endswith("about elementary mathematics.\n\n2 + 2 =\nA. 3\nB. 4\nAnswer:")
    assert [cont for _, cont in lettered] == [" A", " B"]
    with pytest.raises(ValueError, match="unknown multiple-choice task"):
        build_prompts("trivia", [q])


def test_fewshot_examples_come_from_other_items_of_the_same_subject():
    pool = [item(f"q{i}", ["no", "yes"], 1, subject="law" if i < 4 else "art") for i in range(8)]
    (pairs,) = build_prompts("mmlu", pool[:1], pool, num_fewshot=2, seed=3)
    context = pairs[0][0]
    shots = [q["question"] for q in pool if f"Question: {q['question']}\nAnswer: yes\n\n" in context]
    assert len(shots) == 2 and "q0" not in shots and all(int(s[1:]) < 4 for s in shots)
    assert context.startswith("The following are questions (with answers) about law.\n\nQuestion: ")
    assert context.endswith("Question: q0\nAnswer:")
    assert build_prompts("mmlu", pool[:1], pool, num_fewshot=2, seed=3) == [pairs]  # seeded


def test_batch_size_does_not_change_the_scores():
    items = [item(f"Question number {i}?", ["alpha", "be", "gamma ray", "d"], i % 4) for i in range(6)]
    model = random_model()
    one = evaluate_mc(model, ByteTokenizer(), "arc_challenge", items, batch_size=1)
    many = evaluate_mc(model, ByteTokenizer(), "arc_challenge", items, batch_size=16)
    # the same choices; the log-likelihoods to float32 rounding (MKL's AVX2 kernels, which tokenmind selects on
    # AMD CPUs, sum a call's last 1-3 rows in another order than its full blocks of 6)
    drop = lambda p: {k: v for k, v in p.items() if k != "loglik"}  # noqa: E731
    assert [drop(p) for p in one["predictions"]] == [drop(p) for p in many["predictions"]]
    for a, b in zip(one["predictions"], many["predictions"], strict=True):
        assert a["loglik"] == pytest.approx(b["loglik"], rel=1e-6)


def test_continuation_ids_are_the_tail_of_the_whole_encoding():
    ctx, cont = encode_pair(ByteTokenizer(), "Answer:", " yes")
    assert ctx == list(b"Answer:") and cont == list(b" yes")
