"""benchmarks/quality_dpo.py without a model: its summary's paired statistics, its per-stage cache and
the on-policy stage's DPO config (the real run takes the better part of an hour on a CPU)."""

import argparse
import json

import pytest

from tokenmind.posttrain.preference import load_preference_config


@pytest.fixture
def quality_dpo(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # it imports _common
    import quality_dpo

    return quality_dpo


def test_onpolicy_is_compared_with_the_sft_model_it_started_from(quality_dpo):
    sft = {"answer_right": [1, 0, 0, 1], "steps_right": [1, 0, 0, 0], "example": "",
           "pair_logps": [(-5.0, -6.0), (-4.0, -3.0)]}
    dpo = {"answer_right": [0, 0, 0, 0], "steps_right": [0, 0, 0, 0], "example": "",
           "pair_logps": [(-5.5, -7.0), (-4.5, -3.0)]}
    onpolicy = {"answer_right": [1, 1, 0, 1], "steps_right": [1, 1, 0, 0], "example": "",
                "pair_logps": [(-4.0, -6.5), (-3.0, -3.5)]}
    out = quality_dpo.summarize({"sft": sft, "dpo": dpo, "onpolicy": onpolicy}, {})["stages"]
    # each DPO stage against the SFT model (its reference), not against the stage printed before it
    assert out["onpolicy"]["answer_gain_vs_sft"]["gain"] == 0.25
    assert out["onpolicy"]["answer_gain_vs_sft"]["paired_stderr"] == 0.25  # one change in four: sd 0.5 / √4
    assert out["dpo"]["answer_gain_vs_sft"]["gain"] == -0.5
    # implicit reward: chosen's log-ratio above rejected's (pair 1: +1.0 vs -0.5; pair 2: +1.0 vs -0.5)
    assert out["onpolicy"]["heldout_implicit_reward_accuracy_vs_sft"] == 1.0
    assert out["dpo"]["heldout_implicit_reward_accuracy_vs_sft"] == 0.5
    assert "answer_gain_vs_dpo" not in out["onpolicy"]


def test_a_stage_cached_with_other_settings_is_refused(quality_dpo, tmp_path):
    args = ["--work", str(tmp_path), "--train", "4", "--heldout", "2", "--tasks", "2"]
    ns = argparse.Namespace(
        train=4, sft_steps=10, sft_lr=1e-3, sft_seq=288, heldout=2, tasks=2, max_tokens=128)
    cached = {"settings": quality_dpo.stage_settings("sft", ns), "answer_right": [1, 0], "steps_right": [0, 0],
              "example": ""}
    (tmp_path / "results.json").write_text(json.dumps({"results": {"sft": cached}}))
    with pytest.raises(SystemExit, match="holds stage sft"):
        quality_dpo.main([*args, "--stage", "sft", "--sft-steps", "3"])
    with pytest.raises(SystemExit, match="run --stage sft first"):
        quality_dpo.main(["--work", str(tmp_path / "empty"), "--train", "4", "--heldout", "2", "--tasks", "2",
                          "--stage", "onpolicy"])
    summary = quality_dpo.main([*args, "--stage", "sft", "--out", str(tmp_path / "out.json")])  # cached: no training
    assert summary["stages"]["sft"]["answer_accuracy"] == 0.5
    assert summary["decontamination"]["train_expressions_in_evaluation"] == 0


def test_onpolicy_dpo_trains_on_the_sampled_pairs_without_a_val_split(quality_dpo, tmp_path):
    ns = argparse.Namespace(
        beta=0.3, nll_weight=0.5, seq=400, steps=8, lr=5e-4, onpolicy_steps=6, onpolicy_lr=1e-4)
    cfg = load_preference_config(None, quality_dpo.dpo_overrides(ns, tmp_path, "onpolicy"), {"preference.loss": "dpo"})
    assert cfg.preference.beta == 0.3 and cfg.preference.nll_weight == 0.5
    assert cfg.optim.lr == 1e-4 and cfg.train.steps == 6
    assert cfg.data.val_fraction == 0 and cfg.data.files == [str(tmp_path / "onpolicy_pairs" / "pairs.jsonl")]
    assert cfg.train.out_dir == str(tmp_path / "onpolicy")


def test_reevaluate_keeps_the_training_record_and_replaces_the_outcomes(quality_dpo, tmp_path, monkeypatch):
    args = ["--work", str(tmp_path), "--train", "4", "--heldout", "2", "--tasks", "2", "--stage", "sft"]
    ns = argparse.Namespace(train=4, sft_steps=10, sft_lr=1e-3, sft_seq=288, heldout=2, tasks=2, max_tokens=128)
    cached = {"settings": quality_dpo.stage_settings("sft", ns), "answer_right": [0, 0], "steps_right": [0, 0],
              "example": "", "train_seconds": 12.5, "final_loss": 0.2, "steps": 10}
    (tmp_path / "results.json").write_text(json.dumps({"results": {"sft": cached}}))
    evaluated = []
    monkeypatch.setattr(quality_dpo, "evaluate", lambda ref, items, work, a, pairs: evaluated.append(ref) or {
        "answer_right": [1, 0], "steps_right": [1, 0], "example": "Answer: 3", "eval_seconds": 1.0})
    assert quality_dpo.main(args)["stages"]["sft"]["answer_accuracy"] == 0
    assert evaluated == []  # cached: nothing runs without --reevaluate
    row = quality_dpo.main([*args, "--reevaluate"])["stages"]["sft"]
    assert evaluated == [tmp_path / "sft"] and row["answer_accuracy"] == 0.5
    assert row["train_seconds"] == 12.5 and row["steps"] == 10  # the training is not run again
