"""The speedrun orchestration on a hand-made miniature data folder (no downloads)."""

import importlib
import inspect
import json

import yaml

from tokenmind.speedrun import load_speedrun_config, speedrun


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_data(root):
    docs = []
    for name in ["argparse", "collections", "json", "logging", "pathlib", "random", "subprocess", "textwrap",
                 "threading", "unittest", "inspect", "tarfile", "zipfile", "datetime", "decimal", "shutil"]:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module)] + [inspect.getdoc(o) for _, o in inspect.getmembers(module)
                                            if inspect.isfunction(o) or inspect.isclass(o)]
        docs.append({"text": "\n\n".join(dict.fromkeys(p for p in parts if p)), "source": "stdlib", "id": name})
    write_jsonl(root / "pretrain" / "docs.jsonl", docs)
    chats = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                           {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
             for a in range(12) for b in range(12)]
    write_jsonl(root / "sft" / "arith.jsonl", chats)
    arc = [{"id": f"q{i}", "question": f"Which number is larger, {i} or {i + 5}?",
            "choices": [str(i), str(i + 5)], "answer": 1, "text": f"Which number is larger, {i} or {i + 5}?"}
           for i in range(10)]
    write_jsonl(root / "eval" / "arc-easy.jsonl", arc)


def test_speedrun_end_to_end_on_local_data(tmp_path):
    make_data(tmp_path / "data")
    cfg_path = tmp_path / "mini.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "name": "mini", "out_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data"),
        "pretrain_sources": [], "sft_sources": [], "eval_sources": [], "vocab_size": 400, "val_tokens": 3000,
        "pretrain": {"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 128, "tie_word_embeddings": True},
                     "data": {"batch_size": 4, "seq_len": 64},
                     "optim": {"lr": 0.003}, "schedule": {"warmup_steps": 2},
                     "train": {"steps": 12, "precision": "fp32", "eval_every": 6, "eval_batches": 1}},
        "sft": {"data": {"seq_len": 64, "batch_size": 4, "val_fraction": 0.05},
                "optim": {"lr": 0.003}, "schedule": {"warmup_steps": 2},
                "train": {"steps": 6, "precision": "fp32", "eval_every": 3, "eval_batches": 1}},
        "eval": {"tasks": ["val_loss", "arc_easy"], "limit": 10, "batch_size": 8, "val_batches": 1},
        "chat_prompts": ["What is 2 plus 3?"],
    }))
    report = speedrun(load_speedrun_config(str(cfg_path)))
    text = report.read_text()
    for section in ("## Pre-training", "## SFT", "## Evaluation", "## Samples", "arc_easy", "val_loss",
                    "What is 2 plus 3?", "tokenmind chat --model"):
        assert section in text, section
    run = tmp_path / "run"
    assert (run / "pretrain" / "loss.png").exists() and (run / "sft" / "final" / "tokenizer.json").exists()
    stages = json.loads((run / "stages.json").read_text())
    assert list(stages) == ["fetch", "tokenizer", "data", "pretrain", "sft", "eval", "samples"]
    # A second run finds every stage done and only rewrites the report.
    before = (run / "pretrain" / "metrics.jsonl").read_text()
    speedrun(load_speedrun_config(str(cfg_path)))
    assert (run / "pretrain" / "metrics.jsonl").read_text() == before


def test_unknown_config_names_the_choices():
    import pytest

    with pytest.raises(FileNotFoundError, match="cpu, gpu"):
        load_speedrun_config("no-such-config")
