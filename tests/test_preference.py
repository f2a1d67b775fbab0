"""The DPO family against TRL on the same tiny model, data and hyper-parameters, and as a user runs it."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_sft_helpers import COLORS, question, tiny_model_dir, tiny_tokenizer
from test_train_helpers import crash_in_step_5, one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.jsonl import read_jsonl
from tokenmind.model.load import load_model
from tokenmind.posttrain.preference import (
    PreferenceObjective,
    build_preference_trainer,
    kto_losses,
    load_preference_config,
    pair_losses,
    preference_data,
    sequence_logps,
)
from tokenmind.posttrain.preference_data import UnitLoader
from tokenmind.train.distributed import init_distributed
from tokenmind.data.loader import LoaderConfig

WRONG = {"apple": "blue", "banana": "green", "grape": "orange", "lime": "red", "plum": "white",
         "coconut": "pink", "blueberry": "gray", "lemon": "black"}


def pairs(system_every: int = 3) -> list[dict]:
    """Chosen = the right colour in a sentence, rejected = a wrong one, some with a system prompt."""
    out = []
    for i, fruit in enumerate(COLORS):
        prompt = [{"role": "user", "content": question(fruit)}]
        if i % system_every == 0:
            prompt = [{"role": "system", "content": "Answer briefly."}, *prompt]
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": f"It is {COLORS[fruit]}."}],
                    "rejected": [{"role": "assistant", "content": f"Maybe {WRONG[fruit]}, I think."}]})
    return out


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("pref")
    tokenizer = tiny_tokenizer()
    return SimpleNamespace(model=tiny_model_dir(root / "model", tokenizer, seed=3), tokenizer=tokenizer,
                           pairs=write(root / "pairs.jsonl", pairs()), root=root)


def config(setup, out: Path, loss: str, *overrides: str):
    """Every pair in one row of one micro-batch: a step sees the whole data, as TRL's full batch does."""
    return load_preference_config(None, [
        f"--preference.init_from={setup.model}", f"--preference.loss={loss}", f"--data.files={setup.pairs}",
        "--data.batch_size=1", "--data.seq_len=1024", "--data.val_fraction=0", "--data.shuffle=false",
        "--optim.lr=1e-3", "--optim.betas=[0.9,0.999]", "--optim.weight_decay=0", "--optim.grad_clip=1.0",
        "--schedule.name=constant", "--schedule.warmup_steps=0", "--train.steps=4", "--train.precision=fp32",
        "--train.checkpoint_every=0", f"--train.out_dir={out}", *overrides])


def ours(cfg) -> list[float]:
    trainer = build_preference_trainer(cfg, init_distributed("none", "cpu"), progress=False)
    return trainer.train().losses


def trl_losses(trainer_cls, config_cls, setup, tmp_path, dataset: list[dict], sequence_classifier: bool = False,
               **kwargs) -> tuple[list[float], object]:
    """The per-step losses TRL's trainer computes (recorded at full precision, not its rounded logs)."""
    import datasets
    import transformers

    seen: list[float] = []

    class Recording(trainer_cls):
        def compute_loss(self, *args, **kw):
            loss = super().compute_loss(*args, **kw)
            seen.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    hf_tok = transformers.AutoTokenizer.from_pretrained(setup.model)
    auto = transformers.AutoModelForSequenceClassification if sequence_classifier else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(setup.model, dtype=torch.float32)
    args = config_cls(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(dataset), max_steps=4,
                      learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                      dataloader_drop_last=False, seed=0, max_length=None, **kwargs)
    trainer = Recording(model=model, args=args, train_dataset=datasets.Dataset.from_list(dataset),
                        processing_class=hf_tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("trl").setLevel(logging.ERROR)
        trainer.train()
    return seen, trainer


@pytest.mark.parametrize("loss,trl_loss,nll_weight",
                         [("dpo", "sigmoid", 0), ("ipo", "ipo", 0), ("dpo", "sigmoid", 0.5)])
def test_dpo_and_ipo_steps_equal_trl(setup, tmp_path, loss, trl_loss, nll_weight):
    """DPO, IPO and DPO with an NLL term on the chosen answers (RPO: TRL's sigmoid + sft losses)."""
    from trl import DPOConfig, DPOTrainer

    kind = {"loss_type": [trl_loss, "sft"], "loss_weights": [1.0, nll_weight]} if nll_weight else \
        {"loss_type": [trl_loss]}
    expected, trainer = trl_losses(DPOTrainer, DPOConfig, setup, tmp_path, pairs(), beta=0.1, **kind)
    cfg = config(setup, tmp_path / "ours", loss, f"--preference.nll_weight={nll_weight}")
    # the same tokens: TRL's tokenized prompts and completions are ours
    data = preference_data(cfg, setup.tokenizer)
    for row, unit in zip(trainer.train_dataset, data.train):
        chosen, rejected = unit.members
        assert list(chosen.ids[:chosen.start]) == row["prompt_ids"]
        assert list(chosen.ids[chosen.start:]) == row["chosen_ids"]
        assert list(rejected.ids[rejected.start:]) == row["rejected_ids"]
    got = ours(cfg)
    assert len(got) == len(expected) == 4
    assert got == pytest.approx(expected, abs=2e-5)
    assert got[-1] < got[0] - 0.05  # it really trained


def test_kto_steps_equal_trl(setup, tmp_path):
    from trl import KTOConfig, KTOTrainer

    unpaired = [{"prompt": r["prompt"], "completion": r[a], "label": a == "chosen"}
                for r in pairs() for a in ("chosen", "rejected")]
    expected, _ = trl_losses(KTOTrainer, KTOConfig, setup, tmp_path, unpaired, beta=0.1,
                             train_sampling_strategy="sequential")
    # the paired file, unpaired in the same order; one KL group over the whole batch, as TRL's
    got = ours(config(setup, tmp_path / "ours", "kto", f"--preference.kl_group={len(unpaired)}",
                      "--data.seq_len=2048"))
    assert got == pytest.approx(expected, abs=2e-5)
    assert got[-1] < got[0] - 0.02


def test_orpo_and_simpo_losses_equal_trl_on_the_same_log_probs():
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(0)
    len_w, len_l = torch.randint(1, 30, (16,), generator=g).float(), torch.randint(1, 30, (16,), generator=g).float()
    chosen, rejected = -torch.rand(16, generator=g) * len_w * 3, -torch.rand(16, generator=g) * len_l * 3
    cpu = SimpleNamespace(device="cpu")
    zero = torch.zeros(16)

    trl = SimpleNamespace(beta=2.0, simpo_gamma=0.7, loss_type="simpo", label_smoothing=0.0, alpha=0.0, accelerator=cpu)
    expected, expected_w, expected_l = CPOTrainer.cpo_loss(trl, chosen / len_w, rejected / len_l)
    got, got_w, got_l = pair_losses("simpo", chosen, rejected, zero, zero, len_w, len_l, beta=2.0, gamma=0.7)
    torch.testing.assert_close((got, got_w, got_l), (expected, expected_w, expected_l))

    trl = SimpleNamespace(beta=0.25, accelerator=cpu)
    ratio_term, expected_w, expected_l, *_ = ORPOTrainer.odds_ratio_loss(trl, chosen / len_w, rejected / len_l)
    got, got_w, got_l = pair_losses("orpo", chosen, rejected, zero, zero, len_w, len_l, beta=0.25)
    # ours adds the chosen answer's per-token NLL to TRL's -λ·log σ(log odds)
    torch.testing.assert_close((got, got_w, got_l), (-chosen / len_w - ratio_term, expected_w, expected_l))


def test_losses_by_hand():
    """Small cases worked out from the papers' formulas."""
    one = torch.ones(1)
    loss, w, l = pair_losses("dpo", one * -2, one * -5, one * -3, one * -3, one, one, beta=0.5)
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(0.5 * (1 - -2))).item())
    assert (w.item(), l.item()) == (0.5, -1.0)
    loss, *_ = pair_losses("ipo", one * -2, one * -6, one * -3, one * -3, one * 2, one * 3, beta=0.25)
    assert loss.item() == pytest.approx((0.5 - -1.0 - 2.0) ** 2)
    losses, rewards, kl = kto_losses(torch.tensor([-1.0, -4.0]), torch.tensor([-2.0, -2.0]), torch.tensor([-3.0, -3.0]),
                                     torch.tensor([-3.5, -3.5]), torch.tensor([1.0, 0.0]), beta=1.0,
                                     desirable_weight=2.0)
    assert kl.item() == 0.5
    assert losses.tolist() == pytest.approx([2 * (1 - torch.sigmoid(torch.tensor(0.5)).item()),
                                             1 - torch.sigmoid(torch.tensor(2.5)).item()])
    _, _, kl = kto_losses(one, one, one * -3, one * -1, one, beta=1.0)
    assert kl.item() == 0.0  # a negative KL estimate is clamped


def test_packed_sequences_score_as_they_would_alone(setup, tmp_path):
    cfg = config(setup, tmp_path, "dpo", "--data.seq_len=256")
    data = preference_data(cfg, setup.tokenizer)
    model = load_model(setup.model).model.eval()
    batch = UnitLoader(data.train, LoaderConfig(batch_size=2, seq_len=256, shuffle=False)).batch_for_rows([0, 1])
    assert (batch.document_ids.max(dim=1).values >= 2).all()  # several sequences share each row
    packed = sequence_logps(model, batch, "fp32")
    for unit, members in zip(batch.units.tolist(), batch.members.tolist()):
        for seq, index in zip(data.train[unit].members, members):
            ids = torch.tensor(seq.ids)[None]
            logps = torch.log_softmax(model(ids)[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            assert packed[index].item() == pytest.approx(logps[seq.start - 1:].sum().item(), abs=1e-4)


@pytest.mark.parametrize("loss", ["orpo", "simpo"])
def test_reference_free_losses_learn_the_preference(setup, tmp_path, loss):
    cfg = config(setup, tmp_path, loss, "--train.steps=12", "--optim.lr=2e-3")
    trainer = build_preference_trainer(cfg, init_distributed("none", "cpu"), progress=False)
    assert not (tmp_path / "reference_logps.safetensors").exists()  # nothing to compare against
    result = trainer.train()
    assert result.losses[-1] < result.losses[0] * 0.8
    last = [r for r in read_jsonl(result.metrics_path) if "reward_accuracy" in r][-1]
    assert last["reward_accuracy"] == 1.0 and last["reward_margin"] > 0


def test_reference_log_probs_are_cached_and_resume_is_exact(setup, tmp_path, monkeypatch):
    import tokenmind.posttrain.preference as preference

    straight = config(setup, tmp_path / "straight", "dpo", "--train.steps=8", "--train.checkpoint_every=4",
                      "--data.val_fraction=0.25", "--train.eval_every=4")
    crashed = config(setup, tmp_path / "crashed", "dpo", "--train.steps=8", "--train.checkpoint_every=4",
                     "--data.val_fraction=0.25", "--train.eval_every=4")
    ours(straight)
    crash_in_step_5(build_preference_trainer(crashed, init_distributed("none", "cpu"), progress=False))
    assert (tmp_path / "crashed" / "reference_logps.safetensors").is_file()

    def fail(*args, **kwargs):
        raise AssertionError("reference log-probs recomputed although cached")

    monkeypatch.setattr(preference, "compute_reference_logps", fail)
    resumed = ours(crashed)  # resumes from step 4, reference log-probs read back
    assert len(resumed) == 4
    a, b = ([r for r in read_jsonl(tmp_path / run / "metrics.jsonl") if "loss" in r] for run in ("straight", "crashed"))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    val = [r for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if "val_reward_accuracy" in r]
    assert len(val) == 2 and "val_reward_margin" in val[-1]
    # other data, other reference numbers: the stale cache is not used
    other = write(setup.root / "other.jsonl", pairs(system_every=2))
    with pytest.raises(AssertionError, match="recomputed"):
        build_preference_trainer(config(setup, tmp_path / "crashed", "dpo", f"--data.files={other}"),
                                 init_distributed("none", "cpu"), progress=False)


def test_lora_dpo_uses_the_base_as_reference_and_exports_an_adapter(setup, tmp_path):
    cfg = config(setup, tmp_path, "dpo", "--lora.rank=8", "--lora.alpha=16", "--lora.dropout=0", "--optim.lr=5e-3",
                 "--train.steps=10")
    trainer = build_preference_trainer(cfg, init_distributed("none", "cpu"), progress=False)
    result = trainer.train()
    assert result.losses[0] == pytest.approx(0.6931, abs=1e-4)  # zero adapters: the policy is the reference
    assert result.losses[-1] < 0.4
    assert (result.final_model_path / "adapter_config.json").is_file()
    merged = load_model(tmp_path)  # base + adapter
    batch = trainer.loader.batch_for_rows([0])
    terms = PreferenceObjective("dpo", 0.1)(merged.model.eval(), batch, "fp32")
    assert terms.metrics["reward_accuracy"].item() == len(batch.units)  # every pair now prefers chosen


def test_bad_preference_data_is_refused_with_the_fix(setup, tmp_path):
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "hi", "answer": "x"}])
    with pytest.raises(ValueError, match='needs "chosen" and "rejected"'):
        preference_data(config(setup, tmp_path, "dpo", f"--data.files={bad}"), setup.tokenizer)
    unpaired = write(tmp_path / "kto.jsonl", [{"prompt": "hi", "completion": "yo", "label": True}])
    with pytest.raises(ValueError, match="use --preference.loss=kto"):
        preference_data(config(setup, tmp_path, "dpo", f"--data.files={unpaired}"), setup.tokenizer)
    with pytest.raises(ValueError, match="choose one of dpo, ipo, kto, orpo, simpo"):
        config(setup, tmp_path, "ppo")
    with pytest.raises(ValueError, match="ORPO has its own NLL term"):
        config(setup, tmp_path, "orpo", "--preference.nll_weight=1")


def test_posttrain_cli_runs_each_method(setup, tmp_path, capsys):
    from tokenmind.cli import main

    for method in ("dpo", "simpo"):
        out = tmp_path / method
        assert main(["posttrain", method, f"--preference.init_from={setup.model}", f"--data.files={setup.pairs}",
                     "--data.seq_len=256", "--data.batch_size=2", "--data.val_fraction=0", "--train.steps=2",
                     "--schedule.warmup_steps=0", "--train.precision=fp32", f"--train.out_dir={out}"]) == 0
        printed = capsys.readouterr().out
        assert "done: 2 steps" in printed and str(out / "final") in printed
        resolved = (out / "config.yaml").read_text()
        assert f"loss: {method}" in resolved
        assert load_model(out / "final").model.cfg.num_hidden_layers == 2
    assert main(["posttrain", "dpo", f"--preference.init_from={setup.model}", "--data.files=nope.jsonl"]) == 2
    assert "matches no .jsonl file" in capsys.readouterr().err
