"""Reward models: the scalar-head Transformer against transformers, Bradley–Terry training against
TRL's RewardTrainer, a process reward model on verifiable arithmetic steps, and scoring."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from test_preference import pairs, trl_losses, write
from test_sft_helpers import tiny_model_dir, tiny_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.cli import main
from tokenmind.data.loader import IGNORE_INDEX
from tokenmind.jsonl import read_jsonl
from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.reward_model import RewardModel
from tokenmind.posttrain.reward import (
    build_reward_trainer,
    load_reward_config,
    load_reward_model,
    reward_train,
    step_example,
)
from tokenmind.posttrain.tasks import stepwise_examples
from tokenmind.train.distributed import init_distributed


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("reward")
    tokenizer = tiny_tokenizer()
    lm_dir = tiny_model_dir(root / "lm", tokenizer, seed=5)
    rm = RewardModel.from_language_model(load_hf_dir(lm_dir), torch.Generator().manual_seed(0))
    return SimpleNamespace(tokenizer=tokenizer, lm=lm_dir, rm=save_hf_dir(rm, root / "rm", tokenizer=tokenizer),
                           pairs=write(root / "pairs.jsonl", pairs()), root=root)


def config(setup, out, *overrides):
    return load_reward_config(None, [
        f"--reward.init_from={setup.rm}", f"--data.files={setup.pairs}", "--data.batch_size=1",
        "--data.seq_len=1024", "--data.val_fraction=0", "--data.shuffle=false", "--optim.lr=1e-3",
        "--optim.betas=[0.9,0.999]", "--optim.weight_decay=0", "--optim.grad_clip=1.0", "--schedule.name=constant",
        "--schedule.warmup_steps=0", "--train.steps=4", "--train.precision=fp32", f"--train.out_dir={out}",
        *overrides])


def test_reward_model_checkpoints_load_in_transformers_with_equal_scores(setup, tmp_path):
    ids = torch.tensor([setup.tokenizer.apply_chat_template(r["prompt"] + r["chosen"]) for r in pairs()[:1]])
    ours = load_hf_dir(setup.rm)
    assert isinstance(ours, RewardModel) and ours.lm_head is None
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(setup.rm).eval()
    with torch.no_grad():
        expected = hf(ids).logits[:, 0]
        got = ours.eval()(ids)[:, -1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and back: a reward model saved by transformers loads here with the same scores
    with torch.no_grad():
        hf.score.weight.mul_(-2.0)
    hf.save_pretrained(tmp_path / "hf")
    setup.tokenizer.save(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(load_hf_dir(tmp_path / "hf")(ids)[:, -1], hf(ids).logits[:, 0], atol=1e-5,
                                   rtol=1e-5)


def test_bradley_terry_steps_equal_trl_reward_trainer(setup, tmp_path):
    from trl import RewardConfig, RewardTrainer

    expected, _ = trl_losses(RewardTrainer, RewardConfig, SimpleNamespace(model=setup.rm), tmp_path, pairs(),
                             sequence_classifier=True,
                             center_rewards_coefficient=0.01)
    got = reward_train(config(setup, tmp_path / "ours", "--reward.center_coefficient=0.01")).losses
    assert got == pytest.approx(expected, abs=2e-5)
    assert got[-1] < got[0] - 0.05


def test_outcome_reward_model_learns_to_prefer_the_right_answer_and_scores(setup, tmp_path):
    cfg = config(setup, tmp_path, f"--reward.init_from={setup.lm}", "--train.steps=15", "--data.val_fraction=0.25",
                 "--data.seq_len=256", "--data.batch_size=2")
    trainer = build_reward_trainer(cfg, init_distributed("none", "cpu"))
    result = trainer.train()
    metrics = read_jsonl(result.metrics_path)
    assert [r for r in metrics if "accuracy" in r][-1]["accuracy"] == 1.0
    assert "val_accuracy" in metrics[-1]
    scorer = load_reward_model(tmp_path)  # the run folder stands for its final/
    held_out = pairs()
    prompts = [r["prompt"] for r in held_out]
    chosen = scorer.score(prompts, [r["chosen"][0]["content"] for r in held_out])
    rejected = scorer.score(prompts, [r["rejected"][0]["content"] for r in held_out])
    assert sum(c > r for c, r in zip(chosen, rejected)) >= 7
    # packed scoring gives each answer the score it gets alone
    assert scorer.score(prompts[:1], [held_out[0]["chosen"][0]["content"]]) == pytest.approx(chosen[:1], abs=1e-4)


def test_step_labels_sit_on_each_steps_last_token(setup):
    record = next(stepwise_examples(1, seed=3, corrupt_fraction=1.0))
    ids, ends = step_example(setup.tokenizer, record["prompt"], record["completions"], record["labels"])
    assert len(ends) == len(record["completions"]) and ends[-1] == len(ids) - 1
    text = setup.tokenizer.decode(ids)
    for end, step in zip(ends, record["completions"]):
        assert setup.tokenizer.decode(ids[:end + 1]).endswith(step + "\n")
    assert record["prompt"] in text
    with pytest.raises(ValueError, match="one label per step"):
        step_example(setup.tokenizer, "2+2", ["4"], [True, False])


def test_process_reward_model_learns_which_steps_are_wrong(setup, tmp_path):
    records = list(stepwise_examples(24, seed=0))
    assert any(not all(r["labels"]) for r in records) and any(all(r["labels"]) for r in records)
    steps = write(tmp_path / "steps.jsonl", records)
    cfg = config(setup, tmp_path / "run", f"--reward.init_from={setup.lm}", "--reward.kind=process",
                 f"--data.files={steps}", "--data.seq_len=256", "--data.batch_size=4", "--train.steps=100",
                 "--optim.lr=2e-3")
    trainer = build_reward_trainer(cfg, init_distributed("none", "cpu"))
    batch = next(trainer.loader)
    labelled = batch.targets[batch.targets != IGNORE_INDEX]
    assert set(labelled.tolist()) == {0, 1}
    result = trainer.train()
    stats = json.loads((tmp_path / "run" / "reward_data.json").read_text())
    assert stats["train_steps"] > stats["train_correct_steps"] > 0
    p = stats["train_correct_steps"] / stats["train_steps"]
    prior = -(p * math.log(p) + (1 - p) * math.log(1 - p))  # the loss of always answering the base rate
    with torch.no_grad():  # over every training step label at once, not one noisy batch
        terms = trainer.objective(trainer.model.eval(), trainer.loader.batch_for_rows(range(len(trainer.loader.rows))),
                                  "fp32")
    assert terms.count == stats["train_steps"]
    assert terms.loss / terms.count < 0.6 * prior  # it tells steps apart, beyond the base rate
    assert terms.metrics["accuracy"] / terms.count > max(p, 1 - p) + 0.1
    scorer = load_reward_model(tmp_path / "run")
    probs = scorer.score_steps(records[0]["prompt"], records[0]["completions"])
    assert len(probs) == len(records[0]["completions"]) and all(0 < p < 1 for p in probs)


def test_posttrain_reward_cli_and_bad_input(setup, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["posttrain", "reward", f"--reward.init_from={setup.lm}", f"--data.files={setup.pairs}",
                 "--data.seq_len=256", "--data.batch_size=2", "--data.val_fraction=0", "--train.steps=2",
                 "--schedule.warmup_steps=0", "--train.precision=fp32", f"--train.out_dir={out}"]) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    config_json = json.loads((out / "final" / "config.json").read_text())
    assert config_json["architectures"] == ["LlamaForSequenceClassification"]
    assert main(["posttrain", "prm", f"--reward.init_from={setup.lm}", f"--data.files={setup.pairs}",
                 f"--train.out_dir={tmp_path / 'prm'}"]) == 2
    assert 'needs "prompt", "completions"' in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a reward model"):
        load_reward_model(setup.lm)
