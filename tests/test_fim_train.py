"""Fill-in-the-middle end to end on a tiny code corpus: FIM shards train a model that fills held-out middles
better than the same model trained on the same documents without FIM (slow: two short trainings); and
`generate --fim` prints the middle the engine writes for the PSM prompt."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from test_train_helpers import one_thread  # noqa: F401 (autouse)

from tokenmind.cli import main
from tokenmind.data.clean import CleanConfig
from tokenmind.data.fim import FIM_TOKENS, FIMConfig
from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline
from tokenmind.data.quality import QualityConfig
from tokenmind.engine.sampling import SamplingParams
from tokenmind.eval.generative import generate_batch
from tokenmind.eval.infill import evaluate_infill, line_infill_examples
from tokenmind.model.config import ModelConfig
from tokenmind.model.load import Pretrained, load_model, save_model
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer.train import ENDOFTEXT, train_bpe
from tokenmind.train import load_config, pretrain

NAMES = ["width", "height", "name", "price", "count", "color", "speed", "label", "owner", "value", "size", "depth"]


def snippet(rng: random.Random) -> str:
    """A small class whose middle line (`self.v = v`) follows from the lines around it."""
    v = rng.choice(NAMES)
    cls = rng.choice(["Box", "Item", "Car", "Shape", "Node", "Cell"])
    return f"class {cls}:\n    def __init__(self, {v}):\n        self.{v} = {v}\n\n    def get_{v}(self):\n" \
           f"        return self.{v}\n"


def corpus(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(snippet(rng) for _ in range(3)) for _ in range(count)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same tiny model trained on the same documents, as FIM shards (rate 0.9) and plain ones."""
    root = tmp_path_factory.mktemp("fim")
    texts = corpus(600, seed=0)
    (root / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_bpe(texts, 400, [ENDOFTEXT, *FIM_TOKENS], chat_template=None)
    tokenizer.save(root / "tokenizer")
    out = {}
    for name, rate in (("fim", 0.9), ("plain", 0.0)):
        cfg = DataPipelineConfig(clean=CleanConfig(quality=QualityConfig.disabled(), remove_boilerplate=False),
                                 exact_dedup=False, near_dedup=None, num_workers=1, print_report=False,
                                 fim=FIMConfig(rate=rate, spm_rate=0.5))
        run_pipeline(root / "code.jsonl", root / f"shards-{name}", tokenizer, cfg)
        run = load_config(None, [
            "--model.vocab_size=400", "--model.hidden_size=64", "--model.intermediate_size=128",
            "--model.num_hidden_layers=2", "--model.num_attention_heads=4", "--model.num_key_value_heads=2",
            "--model.max_position_embeddings=256", f"--data.shards={root / f'shards-{name}'}",
            f"--data.tokenizer={root / 'tokenizer'}", "--data.batch_size=8", "--data.seq_len=128",
            "--optim.lr=3e-3", "--schedule.warmup_steps=10", "--train.steps=150", "--train.precision=fp32",
            f"--train.out_dir={root / name}", "--train.log_every=50"])
        pretrain(run)
        out[name] = root / name
    return out


def hide_first_assignment(text: str) -> dict[str, str]:
    """The example whose middle is the first class's `self.v = v` line (line 3)."""
    lines = text.split("\n")
    return {"prefix": "\n".join(lines[:2]) + "\n", "middle": lines[2], "suffix": "\n" + "\n".join(lines[3:])}


@pytest.mark.slow
def test_fim_training_fills_held_out_middles_that_plain_training_cannot(runs):
    examples = [hide_first_assignment(text) for text in corpus(20, seed=99)]
    scores = {}
    for name, run in runs.items():
        pretrained = load_model(run)
        scores[name] = evaluate_infill(pretrained.model, pretrained.tokenizer, examples, max_tokens=16)
    fim, plain = scores["fim"], scores["plain"]
    print({name: (round(s["middle_loss"], 3), s["exact_match"]) for name, s in scores.items()})
    assert fim["middle_loss"] < plain["middle_loss"] - 0.5


def test_generate_fim_prints_the_middle_the_engine_writes_for_the_psm_prompt(tmp_path, capsys):
    tokenizer = train_bpe(corpus(50, seed=0), 300, [ENDOFTEXT, *FIM_TOKENS], chat_template=None)
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.init_weights(std=0.5)  # a random model whose greedy middle is long, not an immediate eos
    save_model(Pretrained(model, tokenizer, tmp_path / "model"), tmp_path / "model")
    prefix, suffix = "class Car:\n    def __init__(self, speed):\n", "\n\n    def get_speed(self):\n"
    prompt = tokenizer.encode_infill(prefix, suffix)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=tokenizer.infill_stop_token_ids)
    expected = generate_batch(model, tokenizer, [prompt], params)[0]
    assert len(expected) > 5
    args = ["generate", "--model", str(tmp_path / "model"), "--fim", "--prefix", prefix, "--suffix", suffix,
            "--max-tokens", "16", "--dtype", "float32", "--quantize", "none"]
    assert main(args) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(args + ["--echo"]) == 0
    assert capsys.readouterr().out == prefix + expected + suffix + "\n"
    assert main(args[:-8] + ["--dtype", "float32"]) == 2  # --fim without --suffix
    assert "--fim fills the gap" in capsys.readouterr().err


def test_the_infill_loss_is_the_cross_entropy_of_the_middle_and_its_eos_after_the_psm_prompt():
    tokenizer = train_bpe(corpus(50, seed=0), 300, [ENDOFTEXT, *FIM_TOKENS], chat_template=None)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256)).eval()
    model.init_weights(std=0.1)
    examples = [hide_first_assignment(text) for text in corpus(3, seed=5)]
    result = evaluate_infill(model, tokenizer, examples, max_tokens=4)
    total, count = 0.0, 0
    for e in examples:
        prompt = tokenizer.encode_infill(e["prefix"], e["suffix"])
        middle = tokenizer.encode(e["middle"]) + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + middle[:-1]]))[0, len(prompt) - 1:]
        total += torch.nn.functional.cross_entropy(logits.float(), torch.tensor(middle), reduction="sum").item()
        count += len(middle)
    assert result["middle_loss"] == pytest.approx(total / count, rel=1e-4)


def test_line_examples_hide_one_line_and_rejoin():
    texts = corpus(5, seed=1)
    examples = line_infill_examples(texts, per_text=2, seed=0)
    assert len(examples) == 10
    for e in examples:
        assert "\n" not in e["middle"] and len(e["middle"].strip()) >= 8
        assert e["prefix"] + e["middle"] + e["suffix"] in texts
