"""Multi-node training on one machine: two torchrun "nodes" (one rank each, gloo) follow the
single-process loss curve of the same global batch and write one checkpoint; a checkpoint resumes
on another world size (2 ranks -> 1 under DDP and FSDP2, 1 -> 2 under FSDP2) with the same model and
optimizer state and the uninterrupted loss curve; Ray Train runs the same training function.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_train_distributed import free_port, gloo_rank, losses
from test_train_helpers import crash, one_thread, pretrainer, tiny_config, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.data.loader import LoaderConfig, PackedLoader
from tokenmind.data.shards import TokenShards
from tokenmind.jsonl import read_jsonl
from tokenmind.train import pretrain
from tokenmind.train.checkpoint import list_checkpoints, reshard_loader_state, restore_rng, seeded_rng
from tokenmind.train.config import save_resolved

STEPS = ["--train.steps=4", "--train.checkpoint_every=2"]
# fp32 on CPU: two ranks' half-batch gradients, summed by the all-reduce, round differently from one
# full-batch gradient. Measured here (4 and 8 steps, DDP and FSDP2, resumed or not): at most 9.5e-7,
# 2 float32 ulps of a loss near 5.7; the bound leaves 10 ulps for other CPUs' summation orders.
LOSS_TOL = 5e-6


def node_command(node_rank: int, port: int, config: Path) -> list[str]:
    """What an operator runs on node `node_rank` of 2 (here both on this machine)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
            "-m", "tokenmind.cli", "train", f"--config={config}"]


@pytest.mark.slow
def test_two_torchrun_nodes_match_one_process(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards")
    single = pretrain(tiny_config(shards, tmp_path / "single", "--data.batch_size=4", *STEPS)).losses
    config = tmp_path / "two_nodes.yaml"
    save_resolved(tiny_config(shards, tmp_path / "two_nodes", "--data.batch_size=2", "--train.distributed=ddp",
                              *STEPS), config)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    port = free_port()
    nodes = [subprocess.Popen(node_command(rank, port, config), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=80)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "done: 4 steps" in outputs[0]  # rank 0 reports; both ran the same steps

    out = tmp_path / "two_nodes"
    assert losses(out) == pytest.approx(single, abs=LOSS_TOL)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]  # one writer
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000004"]  # no .tmp
    files = sorted(p.name for p in (out / "checkpoints" / "step_000004").iterdir())
    assert files == ["model.safetensors", "optimizer.pt", "rank_00000.pt", "rank_00001.pt", "trainer.pt"]


# ---- resuming on another world size ---------------------------------------------------------------


def rows(batch) -> set[tuple[int, ...]]:
    return {tuple(row.tolist()) for row in batch.input_ids}


def test_the_loader_position_is_global_across_world_sizes(tmp_path: Path) -> None:
    shards = TokenShards(write_shards(tmp_path / "shards"), "train")
    two = [PackedLoader(shards, LoaderConfig(batch_size=2, seq_len=32, rank=r, world_size=2)) for r in (0, 1)]
    for _ in range(5):
        for loader in two:
            next(loader)
    saved = two[0].state_dict()  # what rank 0's file holds
    step_6 = rows(next(two[0])) | rows(next(two[1]))
    one = PackedLoader(shards, LoaderConfig(batch_size=4, seq_len=32))  # the same global batch
    one.load_state_dict(reshard_loader_state(saved, one.state_dict()))
    assert rows(next(one)) == step_6
    half = PackedLoader(shards, LoaderConfig(batch_size=2, seq_len=32))  # half of it: two steps per step 6
    half.load_state_dict(reshard_loader_state(saved, half.state_dict()))
    assert rows(next(half)) | rows(next(half)) == step_6

    eight = PackedLoader(shards, LoaderConfig(batch_size=8, seq_len=32))  # 5 x 4 rows is not a whole 8-row step
    with pytest.raises(ValueError, match="not a whole number"):
        reshard_loader_state(saved, eight.state_dict())
    with pytest.raises(ValueError, match="per rank"):  # a loader without a global position
        reshard_loader_state({"epoch": 0, "position": 3}, one.state_dict())


def test_reseeded_rngs_are_the_seeded_globals() -> None:
    restore_rng(seeded_rng(1234))
    drawn = torch.rand(3), random.random(), np.random.rand(2)
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    assert torch.equal(drawn[0], torch.rand(3)) and drawn[1] == random.random()
    assert np.array_equal(drawn[2], np.random.rand(2))


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested state (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def assert_same_state(saved: Path, resaved: Path) -> None:
    """The model and optimizer a run restored from `saved`, checkpointed again, are `saved`'s."""
    model_a, model_b = load_file(saved / "model.safetensors"), load_file(resaved / "model.safetensors")
    assert same(model_a, model_b)
    assert same(torch.load(saved / "optimizer.pt", weights_only=True),
                torch.load(resaved / "optimizer.pt", weights_only=True))


def resume_from(checkpoint: Path, out_dir: Path) -> None:
    """A new run folder holding only `checkpoint` (a run stopped there)."""
    shutil.copytree(checkpoint, out_dir / "checkpoints" / checkpoint.name)


def resave_and_train(cfg) -> None:
    """Restore cfg's checkpoint, save the restored state again (as step 2), then train on."""
    trainer = pretrainer(cfg)
    assert trainer.step == 2
    trainer.save()
    trainer.train()
    trainer.ctx.close()


def two_ranks(rank: int, port: int, shards: Path, root: Path) -> None:
    """Both ranks: DDP and FSDP2 runs killed in step 3 (after the step-2 checkpoint), and the 1-rank
    checkpoint resumed under FSDP2."""
    with gloo_rank(rank, 2, port):
        half = ["--data.batch_size=2", *STEPS]
        crash(tiny_config(shards, root / "ddp2", "--train.distributed=ddp", *half), crash_in_step=3)
        crash(tiny_config(shards, root / "fsdp2", "--train.distributed=fsdp", *half), crash_in_step=3)
        resave_and_train(tiny_config(shards, root / "one_to_two", "--train.distributed=fsdp", *half))


@pytest.mark.slow
def test_checkpoints_resume_on_another_world_size(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards")
    straight = pretrain(tiny_config(shards, tmp_path / "single", "--data.batch_size=4", *STEPS)).losses
    one_rank_ckpt = tmp_path / "single" / "checkpoints" / "step_000002"
    resume_from(one_rank_ckpt, tmp_path / "one_to_two")

    mp.spawn(two_ranks, args=(free_port(), shards, tmp_path), nprocs=2)

    # 1 rank -> 2 ranks (FSDP2): same state after the restore, then the straight run's steps 3-4
    assert_same_state(one_rank_ckpt, tmp_path / "one_to_two" / "checkpoints" / "step_000002")
    assert losses(tmp_path / "one_to_two") == pytest.approx(straight[2:], abs=LOSS_TOL)
    assert len(list((tmp_path / "one_to_two" / "checkpoints" / "step_000004").glob("rank_*.pt"))) == 2

    # 2 ranks (DDP, FSDP2) -> 1 process
    for kind in ("ddp2", "fsdp2"):
        saved = tmp_path / kind / "checkpoints" / "step_000002"
        assert len(list(saved.glob("rank_*.pt"))) == 2
        resume_from(saved, tmp_path / f"{kind}_to_one")
        resave_and_train(tiny_config(shards, tmp_path / f"{kind}_to_one", "--data.batch_size=4", *STEPS))
        assert_same_state(saved, tmp_path / f"{kind}_to_one" / "checkpoints" / "step_000002")
        assert losses(tmp_path / f"{kind}_to_one") == pytest.approx(straight[2:], abs=LOSS_TOL), kind


# ---- Ray Train ------------------------------------------------------------------------------------


def test_ray_train_refuses_a_run_that_is_not_data_parallel(tmp_path: Path) -> None:
    from tokenmind.train.ray_train import train_on_ray

    with pytest.raises(ValueError, match="train.distributed=ddp or fsdp"):  # refused before Ray starts
        train_on_ray(tiny_config(tmp_path, tmp_path / "run"), num_workers=2)


# Nearly all of this test is Ray Train starting (a controller actor, two worker processes, the
# gloo group): 64 s on the shared 2-core machine at load average 5, 122 s at load 13.
@pytest.mark.slow
def test_ray_train_matches_one_process(tmp_path: Path) -> None:
    pytest.importorskip("ray.train.torch")
    from tokenmind.train.ray_train import train_on_ray

    shards = write_shards(tmp_path / "shards")
    steps = ["--train.steps=2", "--train.checkpoint_every=2"]
    single = pretrain(tiny_config(shards, tmp_path / "single", "--data.batch_size=4", *steps)).losses
    result = train_on_ray(tiny_config(shards, tmp_path / "ray", "--data.batch_size=2", "--train.distributed=ddp",
                                      *steps), num_workers=2)
    assert result.losses == pytest.approx(single, abs=LOSS_TOL)
    assert losses(tmp_path / "ray") == pytest.approx(single, abs=LOSS_TOL)
    assert len(list(result.checkpoint_path.glob("rank_*.pt"))) == 2
