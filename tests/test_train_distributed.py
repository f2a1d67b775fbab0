"""Data parallelism on CPU: 2 gloo processes with B/2 rows each follow the 1-process curve of B.

One spawn runs every distributed scenario (DDP, FSDP2, FSDP2 + Muon, FSDP2 with DeepSeek-V3's
multi-token prediction, FSDP2 crash + resume) in a process group the test creates, which
`pretrain` joins instead of creating its own; the single-process references run in the test
process.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_train_helpers import crash_then_resume, one_thread, tiny_config, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.train import pretrain
from tokenmind.jsonl import read_jsonl

STEPS = ["--train.steps=4", "--train.checkpoint_every=2"]
MUON = ["--optim.name=muon", "--optim.muon_lr=0.02"]
MTP = ["--model.model_type=deepseek_v3", "--model.num_experts=4", "--model.moe_intermediate_size=32",
       "--model.num_key_value_heads=4", "--model.kv_lora_rank=16", "--model.q_lora_rank=24",
       "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8", "--model.v_head_dim=16",
       "--model.num_nextn_predict_layers=2"]  # DeepSeek-V3 with two multi-token prediction depths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, port: int) -> Iterator[None]:
    """This spawned process joins a gloo group as rank `rank`, the way torchrun would set it up
    (environment variables, one thread), and leaves it at the end."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_scenarios(rank: int, world_size: int, port: int, shards: Path, root: Path) -> None:
    """Each rank: join the group the way torchrun would, then train every scenario."""
    with gloo_rank(rank, world_size, port):
        half = ["--data.batch_size=2", *STEPS]
        pretrain(tiny_config(shards, root / "ddp", "--train.distributed=ddp", *half))
        pretrain(tiny_config(shards, root / "fsdp", "--train.distributed=fsdp", *half))
        pretrain(tiny_config(shards, root / "fsdp_muon", "--train.distributed=fsdp", *half, *MUON))
        pretrain(tiny_config(shards, root / "fsdp_mtp", "--train.distributed=fsdp", *half, *MTP))

        crash_then_resume(tiny_config(shards, root / "fsdp_resumed", "--train.distributed=fsdp", *half),
                          crash_in_step=4)


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards")
    single = pretrain(tiny_config(shards, tmp_path / "single", "--data.batch_size=4", *STEPS)).losses
    single_muon = pretrain(tiny_config(shards, tmp_path / "single_muon", "--data.batch_size=4", *STEPS, *MUON)).losses
    single_mtp = pretrain(tiny_config(shards, tmp_path / "single_mtp", "--data.batch_size=4", *STEPS, *MTP)).losses

    mp.spawn(run_scenarios, args=(2, free_port(), shards, tmp_path), nprocs=2)

    assert len(single) == 4
    assert losses(tmp_path / "ddp") == pytest.approx(single, abs=1e-5)
    assert losses(tmp_path / "fsdp") == pytest.approx(single, abs=1e-5)
    # Float noise in the averaged gradient shifts Muon's orthogonalization a little (measured in bf16:
    # 1.3e-4 by step 3); orthogonalizing each shard alone instead of the whole matrix: 3.4e-3.
    assert losses(tmp_path / "fsdp_muon") == pytest.approx(single_muon, abs=5e-4)
    assert losses(tmp_path / "fsdp_resumed") == pytest.approx(losses(tmp_path / "fsdp"), abs=1e-6)
    # each MTP depth sharded on its own; its loss is a sum over tokens, so ranks add up to one process
    assert losses(tmp_path / "fsdp_mtp") == pytest.approx(single_mtp, abs=1e-5)
    final = tmp_path / "fsdp" / "final"
    assert (final / "model.safetensors").exists() and (final / "config.json").exists()
    assert sorted(p.name for p in (tmp_path / "fsdp" / "checkpoints" / "step_000004").glob("rank_*.pt")) == [
        "rank_00000.pt", "rank_00001.pt"]
