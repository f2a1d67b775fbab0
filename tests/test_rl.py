"""Online RL: the math on problems with known answers, then the whole loop on a tiny model.

The bandit tests run each algorithm's own pieces (advantage, clipped surrogate, KL, value loss)
on a softmax policy over arms whose best arm is known; the tiny-model tests run `tokenmind rl`'s
loop (the paged engine sampling from the live policy, the trainer stepping on the objective) on a
reward that only a changed policy can earn, and check resume, LoRA and PPO's value head.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sft_helpers import tiny_model_dir, tiny_tokenizer
from test_train_helpers import crash_in_step_5, one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.jsonl import read_jsonl
from tokenmind.posttrain.rewards import (
    RewardMix,
    answer_line_format,
    code_tests_reward,
    overlong_penalty,
    think_answer_format,
)
from tokenmind.posttrain.rl import (
    ALGORITHMS,
    ROWS_PER_CHUNK,
    clipped_surrogate,
    gae,
    kl_k3,
    sampled_logps,
    sequence_advantages,
    value_loss,
)
from tokenmind.posttrain.rl_train import Task, build_rl_trainer, load_rl_config, plot_rl, rl_train, split_tasks
from tokenmind.sandbox import SandboxConfig, SandboxUnavailable, require_isolation
from tokenmind.train.distributed import init_distributed

# ---- advantages, GAE, KL -------------------------------------------------------------------------


def test_group_advantages_match_their_definitions() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]])
    group = sequence_advantages(rewards, "group")
    std = torch.tensor([np.std(r, ddof=1) for r in rewards.tolist()], dtype=torch.float32)[:, None]
    assert torch.allclose(group, (rewards - rewards.mean(1, keepdim=True)) / (std + 1e-4))
    assert torch.equal(group[1], torch.zeros(4))  # one answer for all: nothing to learn
    assert torch.allclose(sequence_advantages(rewards, "group_mean"), rewards - rewards.mean(1, keepdim=True))
    loo = torch.tensor([[r[i] - (sum(r) - r[i]) / 3 for i in range(4)] for r in rewards.tolist()])
    assert torch.allclose(sequence_advantages(rewards, "rloo"), loo)
    assert torch.allclose(sequence_advantages(rewards, "batch"), rewards - rewards.mean())
    with pytest.raises(ValueError, match="at least 2 completions"):
        sequence_advantages(rewards[:, :1], "rloo")


def test_gae_equals_the_discounted_sum_of_td_errors() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(7, generator=g), torch.randn(7, generator=g)
    for gamma, lam in ((1.0, 1.0), (0.9, 0.8), (0.99, 0.0)):
        advantages, returns = gae(rewards, values, gamma, lam)
        nxt = torch.cat([values[1:], torch.zeros(1)])
        delta = rewards + gamma * nxt - values
        expected = torch.tensor([sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, 7)) for t in range(7)])
        assert torch.allclose(advantages, expected, atol=1e-6)
        assert torch.allclose(returns, advantages + values)
    advantages, _ = gae(rewards, values, 1.0, 1.0)  # λ = γ = 1: Monte Carlo return minus the value
    assert torch.allclose(advantages, rewards.flip(0).cumsum(0).flip(0) - values, atol=1e-6)


def test_k3_is_an_unbiased_nonnegative_kl_estimate() -> None:
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(6, generator=g).log_softmax(0), torch.randn(6, generator=g).log_softmax(0)
    exact = (p.exp() * (p - q)).sum()
    draws = torch.multinomial(p.exp(), 200_000, replacement=True, generator=g)
    estimates = kl_k3(p[draws], q[draws])
    assert (estimates >= 0).all()
    assert abs(estimates.mean() - exact) < 0.01 * max(1.0, float(exact))
    assert torch.equal(kl_k3(p, p), torch.zeros(6))


def test_the_clip_stops_the_gradient_only_where_the_ratio_left_its_band() -> None:
    old = torch.zeros(4)
    logps = torch.tensor([0.5, -0.5, 0.5, -0.5], requires_grad=True)  # ratios 1.65, 0.61, 1.65, 0.61
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = clipped_surrogate(logps, old, advantages, 0.2, 0.28)
    loss.sum().backward()
    # A > 0 and ratio above 1 + ε_high: clipped; A > 0 below the band: still pushed up; A < 0 mirrored
    assert clipped.tolist() == [True, False, False, True]
    assert (logps.grad[clipped] == 0).all() and (logps.grad[~clipped] != 0).all()
    assert torch.allclose(loss[0], -torch.tensor(1.28))  # the clip-higher bound
    wide, _ = clipped_surrogate(logps, old, advantages, math.inf, math.inf)  # REINFORCE: no clip
    assert torch.allclose(wide, -torch.exp(logps - old) * advantages)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logps_equal_the_log_softmax_and_its_gradient(temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = 2 * ROWS_PER_CHUNK + 5  # slices of rows, the last one short
    logits = (3 * torch.randn(rows, 40, generator=gen)).requires_grad_()
    targets = torch.randint(0, 40, (rows,), generator=gen)
    weights = torch.randn(rows, generator=gen)
    logps, entropy = sampled_logps(logits, targets, temperature)
    (logps * weights).sum().backward()
    fused_grad, logits.grad = logits.grad, None
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    expected = log_p.gather(1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    assert torch.allclose(logps, expected, atol=1e-5)
    assert torch.allclose(entropy, -(log_p.exp() * log_p).sum(-1), atol=1e-4) and not entropy.requires_grad
    assert torch.allclose(fused_grad, logits.grad, atol=1e-6)


def test_value_loss_clips_around_the_old_value() -> None:
    old, ret = torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])
    values = torch.tensor([1.0, 0.1])
    # the first moved past the clip toward its return: the clipped (worse) error counts
    assert torch.allclose(value_loss(values, old, ret, 0.2), torch.tensor([0.5 * 0.8 ** 2, 0.5 * 1.1 ** 2]))


# ---- the algorithms on a bandit with a known best arm ---------------------------------------------


ARM_REWARDS = torch.tensor([0.1, 0.3, 1.0, 0.5, 0.0])  # arm 2 is best


def bandit_step(logits: torch.Tensor, algo: str, optimizer: torch.optim.Optimizer, g: torch.Generator,
                value: torch.Tensor | None, prompts: int = 4, group: int = 8) -> float:
    """One rollout + update of a softmax policy over arms with `algo`'s advantage, clip and KL."""
    a = ALGORITHMS[algo]
    with torch.no_grad():
        probs = logits.softmax(0)
        arms = torch.multinomial(probs, prompts * group, replacement=True, generator=g).view(prompts, group)
        rewards = ARM_REWARDS[arms] + 0.1 * torch.randn(prompts, group, generator=g)  # noisy rewards
        old = logits.log_softmax(0)[arms]
    ref = torch.zeros(5).log_softmax(0)[arms]  # the uniform starting policy
    for _ in range(2):  # μ = 2 updates per rollout: the ratio moves away from 1
        logp = logits.log_softmax(0)[arms]
        if a.advantage == "gae":  # one-step episodes: A = r − β·KL − V
            shaped = rewards - a.kl_coef * (old - ref)
            advantages = (shaped - value).detach()
            loss_v = 0.5 * ((value - shaped) ** 2).mean()
        else:
            shaped = rewards - a.kl_coef * (old - ref) if a.kl_place == "reward" else rewards
            advantages, loss_v = sequence_advantages(shaped, a.advantage), 0.0
        token, _ = clipped_surrogate(logp, old, advantages, a.clip_low, a.clip_high)
        if a.kl_place == "loss":
            token = token + a.kl_coef * kl_k3(logp, ref)
        loss = token.mean() + loss_v
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(rewards.mean())


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_algorithm_finds_the_best_arm(algo: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.zeros(5, requires_grad=True)
    value = torch.zeros(1, requires_grad=True) if ALGORITHMS[algo].advantage == "gae" else None
    optimizer = torch.optim.Adam([logits] + ([value] if value is not None else []), lr=0.05)
    for _ in range(150):
        bandit_step(logits, algo, optimizer, g, value)
    probs = logits.softmax(0)
    assert probs.argmax() == 2 and probs[2] > 0.8, probs


# ---- rewards ------------------------------------------------------------------------------------


def test_format_rewards_and_the_overlong_penalty() -> None:
    assert answer_line_format("q", "3 + 4 = 7\nAnswer: 7") == 1.0
    assert answer_line_format("q", "Answer: 7\nAnswer: 8") == 0.0
    assert answer_line_format("q", "Answer: 7\nmore") == 0.0
    assert think_answer_format("q", "<think>3+4</think>\n<answer>7</answer>") == 1.0
    assert think_answer_format("q", "<answer>7</answer>") == 0.0
    assert [overlong_penalty(n, 100, 20) for n in (50, 80, 90, 100, 120)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(100, 100, 0) == 0.0
    mix = RewardMix.from_specs(["task", "format:answer-line*0.5"], task=lambda p, c, **m: float(c.endswith("7")))
    totals, parts = mix(["q", "q"], ["Answer: 7", "7"], [{}, {}])
    assert totals == [1.5, 1.0] and parts["format:answer-line"] == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown scorer"):
        RewardMix.from_specs(["format:nope"])


def test_code_tests_reward_runs_the_tests_in_the_sandbox() -> None:
    try:
        require_isolation(SandboxConfig())
    except SandboxUnavailable as err:
        pytest.skip(f"no sandbox here: {err}")
    item = {"test": "def check(f):\n    assert f(2, 3) == 5\n", "entry_point": "add"}
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    assert code_tests_reward("q", good, **item) == 1.0
    assert code_tests_reward("q", bad, **item) == 0.0
    assert code_tests_reward("q", "import sys\nsys.exit(0)", **item) == 0.0  # exiting early is no pass


# ---- the loop on a tiny model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("rl") / "model", tiny_tokenizer(), seed=3)


def toy_task(n: int = 16) -> Task:
    fruits = ["lime", "kiwi", "pear", "apple", "grape", "plum", "fig", "melon"]
    items = [{"prompt": [{"role": "user", "content": f"What color is a {fruits[i % 8]}? ({i})"}]} for i in range(n)]
    return Task(items[:-4], items[-4:], starts_with_a_vowel)


def tiny_config(tiny: Path, out_dir: Path, *overrides: str):
    base = [f"--rl.init_from={tiny}", "--rl.group_size=8", "--rl.max_new_tokens=4", "--data.batch_size=2",
            "--optim.lr=3e-2", "--train.steps=6", "--train.eval_every=3", f"--train.out_dir={out_dir}",
            "--train.log_every=1"]
    return load_rl_config(None, base + list(overrides))


def records(out_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


def starts_with_a_vowel(prompt, completion: str, **meta) -> float:
    """The toy task: about a quarter of a random model's replies start with a vowel; all should."""
    return float(completion.strip()[:1].lower() in tuple("aeiou"))


def test_grpo_on_a_tiny_model_learns_the_rewarded_reply(tiny: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny, tmp_path, "--train.steps=20", "--rl.max_new_tokens=2", "--rl.kl_coef=0",
                      "--train.eval_every=20")
    result = rl_train(cfg, Task(toy_task().train, toy_task().held_out, starts_with_a_vowel))
    steps = records(tmp_path)
    early = np.mean([r["reward"] for r in steps[:5]])
    late = np.mean([r["reward"] for r in steps[-5:]])
    assert late > 0.8 and late > early + 0.3, (early, late)
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["eval_accuracy"] == 1.0  # greedy on held-out prompts
    for key in ("kl", "entropy", "clip_fraction", "completion_length", "rollout_tokens_per_s", "rollout_s",
                "step_s", "accuracy", "groups_kept"):
        assert key in steps[-1], key
    assert (result.final_model_path / "model.safetensors").exists()
    assert (tmp_path / "rl.png").stat().st_size > 10_000


def test_rl_resume_retraces_the_uninterrupted_run(tiny: Path, tmp_path: Path) -> None:
    # μ = 3 updates per rollout: the step-4 checkpoint holds the second rollout's last two passes
    args = ["--train.steps=8", "--train.checkpoint_every=4", "--train.keep_last=0", "--rl.epochs=3",
            "--rl.kl_coef=0.05", "--train.eval_every=0"]
    task = toy_task()
    rl_train(tiny_config(tiny, tmp_path / "straight", *args), task)
    crashed = tiny_config(tiny, tmp_path / "crashed", *args)
    crash_in_step_5(build_rl_trainer(crashed, init_distributed("none", "cpu"), task))
    assert len(rl_train(crashed, task).losses) == 4
    a, b = records(tmp_path / "straight"), records(tmp_path / "crashed")
    for key in ("loss", "reward", "kl", "clip_fraction", "grad_norm", "completion_length"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    assert [r["step"] for r in a if "reward" in r] == [1, 4, 7]  # a rollout every third step
    assert max(r["clip_fraction"] for r in a) > 0  # later passes see ratios ≠ 1


def test_ppo_trains_a_value_head_and_exports_the_policy_alone(tiny: Path, tmp_path: Path) -> None:
    # every reply earns 1 (λ = 1: every return is 1): the critic must learn V = 1 from zero; the policy
    # gets no advantage
    cfg = tiny_config(tiny, tmp_path, "--rl.algo=ppo", "--rl.kl_coef=0", "--rl.lam=1", "--rl.vf_coef=1",
                      "--rl.value_clip=10", "--optim.lr=1e-2", "--train.eval_every=0", "--train.steps=8")
    result = rl_train(cfg, Task(toy_task().train, [], lambda prompt, completion, **meta: 1.0))
    value_losses = [r["value_loss"] for r in records(tmp_path)]
    assert value_losses[0] == pytest.approx(0.5)  # ½(0 − 1)² at every token
    assert value_losses[-1] < 0.1 * value_losses[0], value_losses
    from safetensors import safe_open

    with safe_open(str(result.final_model_path / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "value_head" in k]


def test_lora_policy_samples_with_its_adapter_and_keeps_the_base_as_reference(tiny: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny, tmp_path, "--lora.rank=4", "--lora.dropout=0", "--rl.kl_coef=0.1", "--train.steps=4",
                      "--train.eval_every=0")
    trainer = build_rl_trainer(cfg, init_distributed("none", "cpu"), toy_task())
    assert trainer.loader.reference is None and trainer.loader.adapter == "default"  # no copy of the model
    trainer.train()
    steps = records(tmp_path)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # fresh adapters: the policy is the base
    assert steps[-1]["kl"] > 0  # trained adapters move the policy, and the engine samples from it
    assert (tmp_path / "final" / "adapter_config.json").exists()


def test_dapo_dynamic_sampling_keeps_only_informative_groups(tiny: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny, tmp_path, "--rl.algo=dapo", "--train.steps=2", "--train.eval_every=0")
    assert cfg.rl.clip_high == 0.28 and cfg.rl.aggregation == "token" and cfg.rl.overlong_cache == 1
    trainer = build_rl_trainer(cfg, init_distributed("none", "cpu"), Task(toy_task().train, [], lambda p, c, **m: 0.0))
    trainer.train()  # every group scores 0: nothing informative, the batch is filled with what there is
    assert records(tmp_path)[0]["groups_kept"] == 0.0


def test_shipped_config_loads_and_any_algorithm_can_replace_its_own() -> None:
    path = Path(__file__).parents[1] / "src" / "tokenmind" / "configs" / "rl_smollm2.yaml"
    cfg = load_rl_config(path)
    assert (cfg.rl.algo, cfg.data.task, cfg.train.precision) == ("grpo", "gym:chain_sum", "fp32")
    ppo = load_rl_config(path, ["rl.algo=ppo"])  # the fields the algorithm decides follow it
    assert (ppo.rl.advantage, ppo.rl.kl_place, ppo.data.task) == ("gae", "reward", "gym:chain_sum")


def test_bad_options_name_the_fix(tmp_path: Path) -> None:
    for options, match in [(["--rl.algo=trpo"], "choose one of reinforce"),
                           (["--rl.advantage=gae"], "only algo=ppo"),
                           (["--rl.algo=rloo", "--rl.group_size=1"], "group_size must be >= 2"),
                           (["--data.task=gym:gsm_symbolic"], "not allowed"),
                           (["--data.task=chess"], "unknown task")]:
        with pytest.raises(ValueError, match=match):
            split_tasks(load_rl_config(None, options).data)


def _fake_run(run_dir: Path, algo: str, held_out: list[float]) -> Path:
    """A run directory as `tokenmind rl` leaves it: metrics JSONL (evals every 2 steps) and rl_data.json."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(1, 2 * len(held_out) - 1):
        lines.append({"step": step, "loss": 0.0, "reward": 0.1 * step, "accuracy": 0.1 * step, "kl": 0.01 * step,
                      "step_s": 2.0, "rollout_s": 0.5, "elapsed": 2.0 * step})
    for k, accuracy in enumerate(held_out):
        lines.append({"step": 2 * k, "eval_accuracy": accuracy, "elapsed": 4.0 * k})
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    (run_dir / "rl_data.json").write_text(json.dumps({"algo": algo}))
    return run_dir


def test_plot_reads_a_metrics_file(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run", "grpo", [0.1, 0.3])
    assert plot_rl(run / "metrics.jsonl", tmp_path / "rl.png").stat().st_size > 10_000


def test_compare_summarises_runs_side_by_side(tmp_path: Path, capsys) -> None:
    from tokenmind.cli import main

    runs = [_fake_run(tmp_path / "a", "grpo", [0.2, 0.3, 0.5]), _fake_run(tmp_path / "b", "ppo", [0.2, 0.6, 0.4])]
    assert main(["rl", "--compare", *map(str, runs), "--compare-png", str(tmp_path / "cmp.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | algo | steps | minutes | held_out_start | held_out_end | held_out_best |")
    grpo, ppo = (row.split(" | ") for row in table[2:4])
    # run, algo, steps, minutes (8 s), held out at the start, end and best, s per step, rollout share
    assert grpo[1:9] == ["grpo", "4", "0.1", "0.2", "0.5", "0.5", "2.0", "0.25"]
    assert ppo[1:7] == ["ppo", "4", "0.1", "0.2", "0.4", "0.6"]
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    assert main(["rl", "--compare", str(runs[0]), "--algo", "ppo"]) == 2
    assert "drop the training options" in capsys.readouterr().err
    assert main(["rl", "--compare", str(tmp_path)]) == 2  # not a run directory: a clear error
    assert "metrics.jsonl" in capsys.readouterr().err


def test_rl_command_runs_a_task_from_the_command_line(tiny: Path, tmp_path: Path, capsys) -> None:
    from tokenmind.cli import main

    out = tmp_path / "run"
    config = tmp_path / "rl.yaml"  # --algo and --task win over the file's choices
    config.write_text("rl: {algo: ppo}\ndata: {task: 'gym:chain_sum'}\n")
    assert main(["rl", "--config", str(config), "--algo", "dr_grpo", "--task", "multistep", f"--rl.init_from={tiny}",
                 "--rl.group_size=2", "--rl.max_new_tokens=4", "--data.train_size=8", "--data.eval_size=2",
                 "--data.batch_size=1",
                 "--data.task_config={min_steps: 1, max_steps: 1}", "--train.steps=2", f"--train.out_dir={out}"]) == 0
    assert "RL report" in capsys.readouterr().out and (out / "rl.png").exists()
    stats = json.loads((out / "rl_data.json").read_text())
    assert stats["algo"] == "dr_grpo" and stats["held_out_items"] == 2 and stats["train_items"] <= 8
    assert main(["rl", "--rl.algo=nope", f"--train.out_dir={tmp_path / 'bad'}"]) == 2  # a clear error, no traceback


def test_bf16_with_a_kl_penalty_warns(tiny: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny, tmp_path / "bf16", "--train.precision=bf16", "--rl.kl_coef=0.04")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_rl_trainer(cfg, init_distributed("none", "cpu"), toy_task())
    assert any("rounding noise" in str(w.message) for w in caught)
    cfg = tiny_config(tiny, tmp_path / "fp32", "--train.precision=fp32", "--rl.kl_coef=0.04")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_rl_trainer(cfg, init_distributed("none", "cpu"), toy_task())
    assert not any("rounding noise" in str(w.message) for w in caught)  # fp32: nothing to warn about

