"""GSM8K answer extraction and prompting, generation through the engine with a scripted bigram
model, the unbiased pass@k estimator, and HumanEval's sandboxed test runs."""

import math

import pytest
from test_eval_fixtures import ByteTokenizer, ChatByteTokenizer, bigram_model, chain
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.eval.code import evaluate_humaneval, humaneval_program, pass_at_k, passes_tests, run_program
from tokenmind.eval.generative import (evaluate_gsm8k, extract_answer, gsm8k_prompt, is_correct, normalize_number,
                                       worked_solution)

PROBLEM = {"id": "gsm8k/0", "question": "Tom has 3 apples and buys 4 more. How many?", "answer": "7",
           "solution": "3 + 4 = <<3+4=7>>7\n#### 7"}


@pytest.mark.parametrize("text,expected", [
    ("She makes 9 * 2 = $18 every day.\nThe answer is 18.", "18"),
    ("The answer is 18. Check: 9 + 9 = 18, 20 - 2 = 18, so 3 steps", "18"),  # the stated answer wins
    ("The answer is: $1,234.50", "1234.5"),
    ("It drops to -5 degrees", "-5"),
    ("a loss of -$40", "-40"),
    ("total 1,000,000 grains", "1000000"),
    ("so 3.0 hours", "3"),
    ("0.25 of the cake", "0.25"),
    ("the answer is 12 apples, not 13", "12"),
    ("In 2 days she reads 30 pages, then 45.", "45"),  # no "answer is": the last number
    ("I don't know", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_numbers_compare_by_value():
    assert normalize_number("18.00") == "18" and normalize_number("-0") == "0" and normalize_number("1e3") == "1000"
    assert normalize_number("seven") is None
    assert is_correct("The answer is 18.00.", "18") and not is_correct("The answer is 81.", "18")
    assert not is_correct("no idea", "18")


def test_worked_solution_and_prompts():
    assert worked_solution(PROBLEM) == "3 + 4 = 7\nThe answer is 7."
    base = ByteTokenizer().decode(gsm8k_prompt(ByteTokenizer(), {"question": "Q2?"}, [PROBLEM]))
    assert base == f"Question: {PROBLEM['question']}\nAnswer: 3 + 4 = 7\nThe answer is 7.\n\nQuestion: Q2?\nAnswer:"
    chat = ChatByteTokenizer()
    text = chat.decode(gsm8k_prompt(chat, {"question": "Q2?"}, []))
    assert text.startswith("<user>Q2?\n\nSolve this math problem")
    assert text.endswith('"The answer is N." where N is the final number.\n<assistant>')


def test_gsm8k_exact_match_through_the_engine():
    model = bigram_model(chain(": 42"))  # after "Answer:" it writes " 42" and stops
    items = [{"id": "a", "question": "6 * 7?", "answer": "42"}, {"id": "b", "question": "3 + 4?", "answer": "7"}]
    done = []
    result = evaluate_gsm8k(model, ByteTokenizer(), items, [PROBLEM], max_tokens=8, progress=done.append)
    assert result["exact_match"] == 0.5 and result["n"] == 2 and sum(done) == 2
    assert [p["completion"] for p in result["predictions"]] == [" 42", " 42"]
    assert [p["correct"] for p in result["predictions"]] == [True, False]


def test_pass_at_k_matches_the_combinatorial_definition():
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)
    for n, c, k in [(200, 20, 10), (200, 3, 100), (50, 0, 1)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_programs_run_isolated_with_a_timeout():
    assert run_program("assert sum([1, 2]) == 3\n")
    assert not run_program("raise SystemExit(1)\n")
    assert not run_program("while True:\n    pass\n", timeout=1.0)


def test_humaneval_runs_each_completion_against_its_tests():
    def problem(task_id, expected):
        return {"task_id": task_id, "prompt": "def f():\n    return", "entry_point": "f",
                "test": f"def check(candidate):\n    assert candidate() == {expected}\n"}

    items = [problem("HumanEval/0", 1), problem("HumanEval/1", 2)]
    assert humaneval_program(items[0], " 1").startswith("def f():\n    return 1\n\ndef check(candidate):")
    result = evaluate_humaneval(bigram_model(chain("n 1")), ByteTokenizer(), items, max_tokens=8)
    assert [p["completion"] for p in result["predictions"]] == [" 1", " 1"]
    assert result["pass@1"] == 0.5 and [p["passed"] for p in result["predictions"]] == [True, False]


def test_a_completion_that_exits_before_the_tests_does_not_pass():
    item = {"task_id": "HumanEval/0", "prompt": "def f():\n    return", "entry_point": "f",
            "test": "def check(candidate):\n    assert candidate() == 1\n"}
    assert passes_tests(item, " 1\n")
    assert not passes_tests(item, " 2\n")
    assert not passes_tests(item, " 2\nimport sys\nsys.exit(0)\n")  # exits 0 without running check()
    assert not passes_tests(item, " 2\nimport os\nprint('tests-done-0'); os._exit(0)\n")
