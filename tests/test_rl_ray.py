"""RL rollouts on Ray actors (`posttrain/ray_rollout.py`) against the in-process loop of `test_rl.py`.

One local Ray instance (2 CPUs) serves the module. Synchronous rollouts on one actor must give the
in-process run's tokens, rewards, held-out scores and losses exactly: the requests carry the same
seeds and the actor's weights are the learner's, pushed after every step. Async rollouts must be
one version stale from the second step on, still train, and leave the actor on the learner's
version; a killed actor must surface as an error, not a wait.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from test_rl import records, tiny_config, toy_task
from test_sft_helpers import tiny_model_dir, tiny_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.engine.sampling import SamplingParams
from tokenmind.jsonl import read_jsonl
from tokenmind.posttrain.ray_rollout import RolloutWorkerError
from tokenmind.posttrain.rl_train import build_rl_trainer, load_rl_config
from tokenmind.posttrain.rollout import RolloutLoader
from tokenmind.train.distributed import init_distributed


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_rl's tiny random chat model."""
    return tiny_model_dir(tmp_path_factory.mktemp("rl_ray") / "model", tiny_tokenizer(), seed=3)


def sampled_groups(loader: RolloutLoader) -> list[list[tuple]]:
    """Records, rollout by rollout, each packed group's (completion token ids, rewards, policy version)."""
    seen: list[list[tuple]] = []
    pack = loader.pack

    def recording(groups):
        seen.append([(g.completions, g.rewards, g.version) for g in groups])
        return pack(groups)

    loader.pack = recording
    return seen


def run(policy: Path, out: Path, *overrides: str):
    """Train a tiny GRPO run (KL to the reference on); returns the trainer (workers still up) and its groups."""
    cfg = tiny_config(policy, out, "--train.steps=3", "--train.eval_every=0", "--rl.kl_coef=0.05", *overrides)
    trainer = build_rl_trainer(cfg, init_distributed("none", "cpu"), toy_task())
    groups = sampled_groups(trainer.loader)
    trainer.train()
    return trainer, groups


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sync_rollouts_on_an_actor_equal_the_in_process_loop(ray_instance, policy: Path, tmp_path: Path,
                                                             lora: bool) -> None:
    extra = ["--lora.rank=4", "--lora.dropout=0", "--optim.lr=1e-2"] if lora else []
    local, local_groups = run(policy, tmp_path / "local", *extra)
    remote, remote_groups = run(policy, tmp_path / "actor", "--rl.rollout_workers=1", *extra)
    try:
        assert remote.loader.workers.versions() == [3]  # pushed after every step
    finally:
        remote.loader.close()
    assert local.loader.workers is None
    assert remote_groups == local_groups  # the same tokens and rewards, rollout by rollout
    assert [[g[2] for g in rollout] for rollout in remote_groups] == [[0, 0], [1, 1], [2, 2]]
    a, b = read_jsonl(tmp_path / "local" / "metrics.jsonl"), read_jsonl(tmp_path / "actor" / "metrics.jsonl")
    for key in ("loss", "reward", "kl", "grad_norm", "clip_fraction", "completion_length", "eval_accuracy",
                "eval_length", "staleness", "policy_version"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    steps = records(tmp_path / "actor")
    assert [r["staleness"] for r in steps] == [0, 0, 0] and steps[-1]["kl"] > 0  # the policy did move


@pytest.mark.slow
def test_async_rollouts_are_one_step_stale_and_train(ray_instance, policy: Path, tmp_path: Path) -> None:
    cfg = tiny_config(policy, tmp_path, "--train.steps=5", "--train.eval_every=0", "--rl.kl_coef=0",
                      "--rl.rollout_workers=1", "--rl.async_rollouts=true")
    trainer = build_rl_trainer(cfg, init_distributed("none", "cpu"), toy_task())
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
        steps = records(tmp_path)
        # the first rollout waits for version 0; each later one was sampled during the step before
        assert [r["policy_version"] for r in steps] == [0, 0, 1, 2, 3]
        assert [r["staleness"] for r in steps] == [0, 1, 1, 1, 1]
        assert all(math.isfinite(r["loss"]) for r in steps)
        assert any(not torch.equal(p, start[name]) for name, p in trainer.model.named_parameters())
        workers = trainer.loader.workers
        assert workers.versions() == [trainer.step] == [5]
        ray_instance.kill(workers.actors[0])  # an actor dies: the next request fails with a clear error
        with pytest.raises(RolloutWorkerError, match="a rollout actor died"):
            trainer.loader.generate([[1, 2, 3]], [SamplingParams(max_tokens=2)])
    finally:
        trainer.loader.close()


@pytest.mark.slow
def test_rl_command_samples_on_actors(ray_instance, policy: Path, tmp_path: Path) -> None:
    from tokenmind.cli import main

    out = tmp_path / "run"
    assert main(["rl", f"--rl.init_from={policy}", "--task", "multistep", "--rl.group_size=2", "--rl.max_new_tokens=4",
                 "--data.train_size=8", "--data.eval_size=0", "--data.batch_size=1",
                 "--data.task_config={min_steps: 1, max_steps: 1}", "--train.steps=2", f"--train.out_dir={out}",
                 "--rl.rollout_workers=1", "--rl.async_rollouts=true"]) == 0
    assert [r["staleness"] for r in records(out)] == [0, 1]


def test_rollout_workers_without_ray_name_the_install(policy: Path, tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="rl.rollout_workers >= 1"):
        load_rl_config(None, ["--rl.async_rollouts=true"])
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    cfg = tiny_config(policy, tmp_path, "--rl.rollout_workers=1")
    with pytest.raises(ImportError, match=r"pip install 'tokenmind\[ray\]'"):
        build_rl_trainer(cfg, init_distributed("none", "cpu"), toy_task())
