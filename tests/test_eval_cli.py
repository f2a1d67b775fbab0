"""`tokenmind eval` end to end: a tiny random model saved as an HF directory, hand-written task
files, and `main([...])` as a user would type it: the JSON report, the table, --limit, --quantize,
the help text, and the errors for unknown tasks and missing data. (`--config eval.yaml`:
tests/test_config.py.)"""

import argparse
import json

import pytest
from test_eval_fixtures import config, write_jsonl
from test_serve_fixtures import byte_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.cli import build_parser, main
from tokenmind.eval import runner
from tokenmind.eval.runner import TASKS, EvalConfig
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.quant import Int8Linear
from tokenmind.model.transformer import Transformer
from tokenmind.model.load import load_model

N_ITEMS = 12  # per task file


def mc_items(task, choices):
    blank = "_" if task == "winogrande" else "the"  # winogrande questions hold one blank
    return [{"id": f"{task}/{i}", "question": f"Question {i} about {blank} things?",
             "choices": [f"choice {j}" for j in range(choices)], "answer": i % choices}
            for i in range(N_ITEMS)]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch

    torch.manual_seed(0)
    model = Transformer(config(vocab=260, context=512)).eval()  # 256 bytes + byte_tokenizer's 3 specials
    model.init_weights(std=0.5)
    return save_hf_dir(model, tmp_path_factory.mktemp("model") / "tiny", tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")  # laid out as `tokenmind data fetch eval --out root` does
    for task, name, choices in [("arc_easy", "arc-easy", 4), ("hellaswag", "hellaswag", 4),
                                ("winogrande", "winogrande", 2)]:
        write_jsonl(root / "eval" / f"{name}.jsonl", mc_items(task, choices))
    write_jsonl(root / "eval" / "gsm8k.jsonl", [
        {"id": f"gsm8k/{i}", "question": f"What is {i} + 1?", "answer": str(i + 1),
         "solution": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"} for i in range(N_ITEMS)])  # fmt: skip
    return root


def evaluate(model_dir, data_dir, *flags):
    return main(["eval", "--model", str(model_dir), "--data-dir", str(data_dir), "--batch-size", "8",
                 "--max-tokens", "4", *flags])


def test_eval_writes_json_and_prints_the_table(model_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "results" / "eval.json"
    tasks = ["arc_easy", "hellaswag", "winogrande", "gsm8k"]
    assert evaluate(model_dir, data_dir, "--tasks", ",".join(tasks), "--limit", "5", "--out", str(out)) == 0
    results = json.loads(out.read_text())
    assert list(results["tasks"]) == tasks and results["model"] == "tiny"
    for task in tasks:
        metrics = results["tasks"][task]
        assert metrics["n"] == 5, task
        assert 0 <= metrics[metrics["primary"]] <= 1, (task, metrics)
        assert metrics["seconds"] > 0
    for task in tasks[:3]:
        assert {"acc", "acc_norm", "acc_stderr"} <= set(results["tasks"][task])
    assert results["tasks"]["gsm8k"]["primary"] == "exact_match"
    assert results["config"]["limit"] == 5 and results["config"]["batch_size"] == 8
    assert results["config"]["max_tokens"] == 4 and results["config"]["quantize"] is None
    assert not list(out.parent.glob("*.tmp"))  # written atomically: no temp file left behind

    captured = capsys.readouterr()
    assert "tokenmind eval: tiny" in captured.out  # the table, on stdout
    for task in tasks:
        assert task in captured.out
    assert f"{results['tasks']['arc_easy']['acc']:.4f}" in captured.out
    assert "loaded tiny" in captured.err and f"wrote {out}" in captured.err


def test_limit_caps_the_items_scored(model_dir, data_dir, tmp_path):
    def predictions(*flags):
        out = tmp_path / "r.json"
        assert evaluate(model_dir, data_dir, "--tasks", "arc_easy", "--log-samples", "--no-progress",
                        "--out", str(out), *flags) == 0
        metrics = json.loads(out.read_text())["tasks"]["arc_easy"]
        assert metrics["n"] == len(metrics["predictions"])
        return [p["id"] for p in metrics["predictions"]]

    everything = predictions()
    assert len(everything) == N_ITEMS
    three = predictions("--limit", "3")
    assert len(three) == 3 and set(three) < set(everything)
    assert predictions("--limit", "3", "--seed", "1") != three  # the seed picks the sample


def test_quantized_model(model_dir, data_dir, tmp_path, monkeypatch):
    loaded = []

    def load(*args, **kwargs):
        loaded.append(load_model(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(runner, "load_model", load)
    out = tmp_path / "q.json"
    assert evaluate(model_dir, data_dir, "--tasks", "arc_easy", "--limit", "4", "--quantize", "int8",
                    "--no-progress", "--out", str(out)) == 0
    results = json.loads(out.read_text())
    assert results["config"]["quantize"] == "int8" and results["tasks"]["arc_easy"]["n"] == 4
    assert any(isinstance(m, Int8Linear) for m in loaded[0].model.modules())


def test_unknown_task_lists_the_supported_ones(model_dir, data_dir, capsys):
    assert evaluate(model_dir, data_dir, "--tasks", "arc_easy,trivia") == 2
    err = capsys.readouterr().err
    assert "trivia" in err and all(task in err for task in TASKS)
    assert "loaded" not in err  # rejected before the model is loaded


def test_missing_data_says_how_to_fetch_it(model_dir, tmp_path, capsys):
    assert evaluate(model_dir, tmp_path / "nowhere", "--tasks", "hellaswag") == 2
    err = capsys.readouterr().err
    assert "hellaswag.jsonl" in err and "tokenmind data fetch eval" in err
    assert "loaded" not in err  # the data is checked before the model is loaded


def test_bad_flag_values_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "m", "--quantize", "int3"])
    assert exit_.value.code == 2 and "int3" in capsys.readouterr().err
    assert main(["eval", "--tasks", "arc_easy"]) == 2  # --model (or `model:` in a --config file) is required
    assert "no model to evaluate: pass --model MODEL" in capsys.readouterr().err


def test_help_lists_tasks_and_flags_with_evalconfig_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(task in text for task in TASKS) and "tokenmind data fetch eval" in text
    eval_parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["eval"]
    helps = {action.dest: action.help for action in eval_parser._actions}
    defaults = EvalConfig()
    for name in ("seed", "batch_size", "max_tokens", "val_batches", "seq_len", "data_dir"):
        assert f"(default: {getattr(defaults, name)})" in helps[name], name
    assert f"(default: {','.join(defaults.tasks)})" in helps["tasks"]
    # every flag but --config is an EvalConfig field, so `cmd_eval` passes it through by name
    fields = set(vars(defaults))
    assert {dest for dest in helps if dest not in ("help", "config")} <= fields
