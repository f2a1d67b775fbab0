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
        "name": "mini", "description": "Why this recipe: it is tiny.", "out_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data"),
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
    for section in ("Why this recipe: it is tiny.", "## Pre-training", "## SFT", "## Evaluation", "## Samples", "arc_easy", "val_loss",
                    "What is 2 plus 3?", f"tokenmind chat --model {tmp_path / 'run' / 'final'}"):
        assert section in text, section
    run = tmp_path / "run"
    assert (run / "pretrain" / "loss.png").exists() and (run / "sft" / "final" / "tokenizer.json").exists()
    assert (run / "final" / "model.safetensors").is_file()  # runs/<name>/final names the chat model
    stages = json.loads((run / "stages.json").read_text())
    assert list(stages) == ["fetch", "tokenizer", "data", "pretrain", "sft", "eval", "samples"]
    # A second run finds every stage done and only rewrites the report.
    before = (run / "pretrain" / "metrics.jsonl").read_text()
    speedrun(load_speedrun_config(str(cfg_path)))
    assert (run / "pretrain" / "metrics.jsonl").read_text() == before
    # A mixture-of-experts variant of the same recipe (`base`), its loss drawn beside the dense run's.
    moe_path = tmp_path / "mini-moe.yaml"
    moe_path.write_text(yaml.safe_dump({
        "base": str(cfg_path), "name": "mini-moe", "out_dir": str(tmp_path / "moe"), "compare_with": str(run),
        "pretrain": {"model": {"model_type": "mixtral", "intermediate_size": 64, "num_experts": 4,
                               "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01}}}))
    moe_cfg = load_speedrun_config(str(moe_path))
    assert moe_cfg.pretrain.train.steps == 12 and moe_cfg.pretrain.model.hidden_size == 64  # from the base
    text = speedrun(moe_cfg).read_text()
    assert "![loss comparison](pretrain/loss_comparison.png)" in text and "![expert load]" in text
    assert "4 experts, top 2 per token" in text
    assert (tmp_path / "moe" / "pretrain" / "loss_comparison.png").stat().st_size > 10_000
    assert (tmp_path / "moe" / "pretrain" / "expert_load.png").exists()


def test_unknown_config_names_the_choices():
    import pytest

    with pytest.raises(FileNotFoundError, match="cpu, cpu-moe, cpu_v1, gpu"):
        load_speedrun_config("no-such-config")


def test_the_moe_speedrun_is_the_cpu_recipe_with_experts_of_the_same_active_width():
    moe, dense = load_speedrun_config("cpu-moe"), load_speedrun_config("cpu")
    assert moe.base == "cpu" and moe.out_dir == "runs/cpu-moe" and moe.compare_with == "runs/cpu"
    assert moe.pretrain.data == dense.pretrain.data.__class__(**{**vars(dense.pretrain.data),
                                                                 "shards": "runs/cpu-moe/shards",
                                                                 "tokenizer": "runs/cpu-moe/tokenizer"})
    assert moe.pretrain.train.steps == dense.pretrain.train.steps and moe.sft_sources == dense.sft_sources
    assert moe.pretrain.train.max_minutes == 0 < dense.pretrain.train.max_minutes  # equal steps, not equal time
    m, d = moe.pretrain.model, dense.pretrain.model
    assert (m.model_type, m.num_experts, m.num_experts_per_tok) == ("mixtral", 8, 2) and d.model_type == "llama"
    router = m.num_hidden_layers * m.hidden_size * m.num_experts
    assert m.num_active_parameters - router == d.num_active_parameters  # same MLP width per token
    assert m.num_parameters > 2.5 * d.num_parameters


def test_speedrun_chat_recipe_builds_the_mix_and_scores_chat_along_the_run(tmp_path):
    """The chat recipe's extra stages: the mix (packaged teacher text, templates; no fetched
    sources here), and chat quality at each SFT checkpoint against the packaged cpu_v1 answers.
    The run's own model stands in for the judge to keep this fast."""
    make_data(tmp_path / "data")
    run = tmp_path / "run"
    cfg_path = tmp_path / "chat.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "name": "chat", "out_dir": str(run), "data_dir": str(tmp_path / "data"), "pretrain_sources": [],
        "sft_sources": [], "eval_sources": [], "vocab_size": 400, "val_tokens": 3000, "quality_filters": False,
        "chat_mix": True, "chat_eval": True, "chat_baseline": "cpu_v1", "chat_judge": str(run / "sft" / "final"),
        "pretrain": {"model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "num_key_value_heads": 1,
                               "max_position_embeddings": 256, "tie_word_embeddings": True},
                     "data": {"batch_size": 2, "seq_len": 64}, "schedule": {"warmup_steps": 1},
                     "train": {"steps": 4, "precision": "fp32"}},
        "sft": {"data": {"seq_len": 64, "batch_size": 2, "val_fraction": 0.01}, "schedule": {"warmup_steps": 1},
                "train": {"steps": 4, "precision": "fp32", "checkpoint_every": 2, "keep_last": 0}},
        "eval": {"tasks": ["val_loss"], "batch_size": 8, "val_batches": 1},
    }))
    text = speedrun(load_speedrun_config(str(cfg_path))).read_text()
    stages = json.loads((run / "stages.json").read_text())
    assert list(stages) == ["fetch", "mix", "tokenizer", "data", "pretrain", "sft", "eval", "samples", "chat"]
    assert stages["mix"]["result"]["sft/templates"] > 500 and stages["mix"]["result"]["pretrain/stories"] > 400
    for part in ("## Chat quality", "baseline `cpu_v1`", "| SFT step 2 |", "| final |", "Ten exchanges:",
                 "position-corrected"):
        assert part in text, part
    assert (run / "chat_quality.png").stat().st_size > 0
    saved = json.loads((run / "chat_answers.json").read_text())
    assert saved["name"] == "chat" and len(saved["answers"]) == saved["figures"]["n"] >= 100
