"""`run_eval` end to end on a tiny model and hand-written task files: every task kind, `limit`,
the JSON report, and the errors for missing data and bad configs."""

import json
from pathlib import Path

import pytest
from test_eval_fixtures import ByteTokenizer, random_model, write_jsonl
from test_train_helpers import VOCAB as SHARD_VOCAB
from test_train_helpers import one_thread, write_shards  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.eval.runner import EvalConfig, load_items, run_eval, sample
from tokenmind.model.load import Pretrained


def mc_items(task, n, choices=4):
    return [{"id": f"{task}/{i}", "question": f"Question {i} about _ things?", "choices": [f"c{j}" for j in
             range(choices)], "answer": i % choices, "subject": ["law", "art"][i % 2], "text": "..."}
            for i in range(n)]  # fmt: skip


@pytest.fixture
def data_dir(tmp_path):
    for task, name, choices in [("arc_easy", "arc-easy", 4), ("winogrande", "winogrande", 2), ("mmlu", "mmlu", 4)]:
        write_jsonl(tmp_path / "eval" / f"{name}.jsonl", mc_items(task, 12, choices))
    write_jsonl(tmp_path / "eval" / "gsm8k.jsonl", [
        {"id": f"gsm8k/{i}", "question": f"What is {i} + 1?", "answer": str(i + 1),
         "solution": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"} for i in range(6)])  # fmt: skip
    return tmp_path


def tiny(vocab=257):
    return Pretrained(random_model(vocab=vocab, context=512), ByteTokenizer(), Path("tiny"))


def test_run_eval_on_every_kind_of_task(data_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It is a truth universally acknowledged. " * 4)
    out = tmp_path / "results" / "eval.json"
    cfg = EvalConfig(model="tiny", tasks="arc_easy,winogrande,mmlu,gsm8k,perplexity", data_dir=str(data_dir),
                     limit=5, batch_size=8, max_tokens=4, num_fewshot=1, text_file=str(text), seq_len=64,
                     out=str(out))
    results = run_eval(cfg, tiny())
    tasks = results["tasks"]
    assert list(tasks) == ["arc_easy", "winogrande", "mmlu", "gsm8k", "perplexity"]
    for task in ("arc_easy", "winogrande", "mmlu", "gsm8k"):
        assert tasks[task]["n"] == 5 and tasks[task]["seconds"] > 0 and "predictions" not in tasks[task]
    assert 0 <= tasks["mmlu"]["acc_norm"] <= 1 and tasks["mmlu"]["primary"] == "acc_norm"
    assert 0 <= tasks["gsm8k"]["exact_match"] <= 1
    assert tasks["perplexity"]["tokens"] == len(text.read_bytes()) and tasks["perplexity"]["bits_per_byte"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert not list(out.parent.glob("*.tmp"))


def test_val_loss_and_logged_samples(data_dir, tmp_path):
    shards = write_shards(tmp_path / "shards")
    cfg = EvalConfig(tasks=["val_loss"], shards_dir=str(shards), val_batches=2, batch_size=2, seq_len=16,
                     progress=False)
    result = run_eval(cfg, tiny(SHARD_VOCAB))["tasks"]["val_loss"]
    assert result["tokens"] == 64 and result["loss"] > 0
    cfg = EvalConfig(tasks=["arc_easy"], data_dir=str(data_dir / "eval"), limit=3, log_samples=True, progress=False)
    predictions = run_eval(cfg, tiny())["tasks"]["arc_easy"]["predictions"]
    assert len(predictions) == 3 and set(predictions[0]) >= {"id", "answer", "pred", "pred_norm"}


def test_gsm8k_fewshot_examples_are_left_out_of_the_scored_set(data_dir):
    cfg = EvalConfig(tasks=["gsm8k"], data_dir=str(data_dir), num_fewshot=2, max_tokens=2, log_samples=True,
                     progress=False)
    result = run_eval(cfg, tiny())["tasks"]["gsm8k"]
    assert [p["id"] for p in result["predictions"]] == [f"gsm8k/{i}" for i in range(2, 6)]


def test_missing_data_names_the_fetch_command(tmp_path):
    cfg = EvalConfig(tasks=["hellaswag"], data_dir=str(tmp_path), progress=False)
    with pytest.raises(FileNotFoundError, match="tokenmind data fetch eval"):
        run_eval(cfg, tiny())
    with pytest.raises(FileNotFoundError, match="hellaswag.jsonl"):
        load_items("hellaswag", tmp_path)


def test_config_checks():
    assert EvalConfig(tasks=" arc_easy, gsm8k ").tasks == ["arc_easy", "gsm8k"]
    with pytest.raises(ValueError, match="unknown or no tasks"):
        EvalConfig(tasks="arc_easy,trivia")
    with pytest.raises(ValueError, match="shards_dir"):
        EvalConfig(tasks="val_loss")
    with pytest.raises(ValueError, match="text_file"):
        EvalConfig(tasks="perplexity")
    with pytest.raises(ValueError, match="limit"):
        EvalConfig(limit=0)


def test_limit_takes_a_seeded_sample_in_file_order():
    items = mc_items("mmlu", 100)
    picked = sample(items, 10, seed=0)
    indices = [items.index(x) for x in picked]
    assert len(picked) == 10 and indices == sorted(indices) and indices != list(range(10))
    assert sample(items, 10, seed=0) == picked and sample(items, 10, seed=1) != picked
    assert sample(items, None, 0) == items and sample(items, 500, 0) == items


def test_chat_task_scores_on_topic_fluency_and_preference(tmp_path, capsys):
    """`--tasks chat`: the held-out chat prompts, a judge model (a saved tiny one here) and the packaged
    cpu_v1 answers to prefer against; the table shows the judge's figures."""
    from test_serve_fixtures import tiny_pretrained

    from tokenmind.eval.runner import print_table
    from tokenmind.model.load import save_model

    model = tiny_pretrained()
    judge = save_model(model, tmp_path / "judge")
    cfg = EvalConfig(tasks=["chat"], judge=str(judge), chat_baseline="cpu_v1", max_tokens=8, progress=False)
    results = run_eval(cfg, model)
    chat = results["tasks"]["chat"]
    assert chat["primary"] == "on_topic" and chat["n"] >= 100 and 0 <= chat["on_topic"] <= 1
    assert chat["fluency_ratio"] > 0 and set(chat["preference"]) >= {"win_rate", "corrected_win_rate"}
    print_table(results)
    table = capsys.readouterr().out
    assert "fluency_ratio" in table and "judge_corrected_win_rate" in table
