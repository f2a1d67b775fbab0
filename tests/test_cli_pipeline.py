"""The CLI path a user takes: `tokenizer train` → `data prepare` → `train` → `generate` from the run."""

import importlib
import inspect
import json

import pytest

from tokenmind.cli import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real English prose: the docstrings of a few standard-library modules, one document each."""
    root = tmp_path_factory.mktemp("corpus")
    names = ["argparse", "collections", "json", "logging", "pathlib", "random", "subprocess", "textwrap",
             "threading", "unittest", "email.message", "http.client", "inspect", "tarfile", "zipfile", "string",
             "datetime", "decimal", "fractions", "heapq", "shutil", "tempfile", "urllib.parse", "csv",
             "difflib", "pickle", "socket", "sqlite3", "statistics", "calendar"]
    for name in names:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module)] + [inspect.getdoc(obj) for _, obj in inspect.getmembers(module)
                                           if inspect.isfunction(obj) or inspect.isclass(obj)]
        unique = list(dict.fromkeys(d for d in docs if d))
        (root / f"{name.replace('.', '_')}.txt").write_text("\n\n".join(unique))
    return root


def test_tokenizer_prepare_train_generate(corpus, tmp_path, capsys):
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", "--data", str(corpus), "--out", str(tok), "--vocab-size", "512",
                 "--reference", ""]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 512
    shards = tmp_path / "shards"
    assert main(["data", "prepare", str(corpus), "--out", str(shards), "--tokenizer", str(tok),
                 "--workers", "1", "--val-fraction", "0.1", "--no-near-dedup"]) == 0
    report = json.loads((shards / "report.json").read_text())
    assert report["output"]["splits"]["val"]["documents"] >= 1, report["output"]
    run = tmp_path / "run"
    overrides = ["--data.shards", str(shards), f"--data.tokenizer={tok}", "--data.batch_size=4",
                 "--data.seq_len=64", "--model.vocab_size=512", "--model.hidden_size=64",
                 "--model.intermediate_size=128", "--model.num_hidden_layers=2", "--model.num_attention_heads=4",
                 "--model.num_key_value_heads=2", "--model.max_position_embeddings=128",
                 "--model.tie_word_embeddings=true", "--train.steps=6", "--train.eval_every=3",
                 "--train.checkpoint_every=3", f"--train.out_dir={run}", "--optim.lr=3e-3",
                 "--schedule.warmup_steps=1"]
    assert main(["train", *overrides]) == 0
    out = capsys.readouterr().out
    assert "done: 6 steps" in out
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in lines if "loss" in r]
    assert len(train_losses) >= 6 and train_losses[-1] < train_losses[0]
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "final" / "tokenizer.json").exists()
    assert main(["generate", "--model", str(run / "final"), "--max-tokens", "5", "The cat"]) == 0
    assert "tok/s" in capsys.readouterr().err


def test_train_rejects_unknown_override(tmp_path, capsys):
    assert main(["train", "--optim.lrr=1"]) == 2
    assert "lrr" in capsys.readouterr().err
