"""Data-parallel pre-training on a Ray cluster: Ray Train's `TorchTrainer` in place of torchrun.

`train_on_ray(cfg, num_workers)` starts `num_workers` Ray Train workers (one CPU, or one GPU, each),
which form the torch process group (gloo on CPU, nccl on GPU) and set RANK, WORLD_SIZE and
LOCAL_RANK as torchrun would; each worker then runs the unchanged `pretrain(cfg)`, whose
`init_distributed` joins that group. So the loop, checkpoints (written by rank 0 into
train.out_dir, which every node must reach at the same path) and resuming are torchrun's, and a
run can stop under Ray and resume under torchrun, or on another number of workers. Ray is joined or
started as the data pipeline does it (`data.ray_pipeline.ray_session`) and imported only here.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from tokenmind.data.ray_pipeline import ray_session
from tokenmind.data.stages import DataPipelineConfig

from .config import RunConfig
from .trainer import TrainResult, pretrain

_PATHS = ("out_dir", "metrics_path", "plot_path", "checkpoint_path", "final_model_path")


def _worker(config: dict[str, RunConfig]) -> None:
    """One Ray Train worker: train as one rank, then report rank 0's result. Ray Train hands the
    driver only metrics reported with a checkpoint, so rank 0 attaches an empty one (the model
    stays in tokenmind's own checkpoints)."""
    import ray.train

    result = dataclasses.asdict(pretrain(config["cfg"]))
    metrics = {"train_result": {k: str(v) if k in _PATHS else v for k, v in result.items()}}
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as empty:
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(empty))


def train_on_ray(cfg: RunConfig, num_workers: int, ray_address: str | None = None) -> TrainResult:
    """Train (or resume) `cfg` as `num_workers` data-parallel Ray Train workers, each on one GPU under
    train.device=cuda, else on one CPU; see the module docstring. ray_address: the cluster to join
    (None: the one this process joined, else a local instance with num_workers CPUs)."""
    if cfg.train.distributed not in ("ddp", "fsdp"):
        raise ValueError(f"Ray Train runs data-parallel workers, but train.distributed={cfg.train.distributed}; "
                         "set --train.distributed=ddp or fsdp")
    try:
        from ray.train import RunConfig as RayRunConfig
        from ray.train import ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as err:
        raise ImportError("training on Ray needs Ray Train: pip install 'tokenmind[ray]', or launch with torchrun "
                          "(docs/scale-out.md)") from err
    use_gpu = cfg.train.device == "cuda"  # the driver itself may have no GPU: "auto" means CPU workers here
    session = DataPipelineConfig(engine="ray", ray_address=ray_address, ray_num_cpus=None if ray_address else num_workers)
    with ray_session(session):
        trainer = TorchTrainer(
            _worker, train_loop_config={"cfg": cfg},
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            run_config=RayRunConfig(name="ray_train", storage_path=str(Path(cfg.train.out_dir).resolve())))
        reported: dict[str, Any] = trainer.fit().metrics["train_result"]
    return TrainResult(**{k: Path(v) if k in _PATHS else v for k, v in reported.items()})
