"""The pre-training run configuration: one typed dataclass per concern, YAML in, YAML out.

A run is described by five sections — `model` (the `ModelConfig` itself, so a run and the
exported checkpoint agree by construction), `data`, `optim`, `schedule` and `train` — loaded
from a YAML file and then patched by `section.key=value` overrides from the command line, by
the project's one config loader (`tokenmind.config`: values coerced by annotation, unknown names
rejected with a did-you-mean). Each section checks itself in `__post_init__`, `RunConfig` the
constraints that span sections. The resolved config is written next to the run's outputs
(`save_resolved`) so a run can be reproduced from its folder alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tokenmind.config import Overrides, config_dict, save_resolved
from tokenmind.config import load_config as load_schema
from tokenmind.model.config import ModelConfig

__all__ = ["DataSection", "OptimSection", "RunConfig", "ScheduleSection", "TrainSection", "check_schedule_fits",
           "config_dict", "load_config", "save_resolved"]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{section}.{name}={value!r} is not one of {', '.join(choices)}")


@dataclass
class DataSection:
    """Where the tokens come from and how they are cut into batches.

    shards: a folder written by `ShardWriter` (`train` split required, `val` used when present).
    batch_size: rows per micro-batch on each rank. One optimizer step sees
        batch_size × train.grad_accum × world_size rows (the global batch).
    seq_len: tokens per row. shuffle/seed: the loader's seeded row permutation.
    tokenizer: the tokenizer the shards were made with (dir, .gguf or alias); saved into the
        exported model so `tokenmind chat --model <run>/final` works. Empty: export weights only.
    """

    shards: str = ""
    tokenizer: str = ""
    batch_size: int = 8
    seq_len: int = 512
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, f"data.batch_size must be >= 1, got {self.batch_size}")
        _check(self.seq_len >= 1, f"data.seq_len must be >= 1, got {self.seq_len}")


@dataclass
class OptimSection:
    """The optimizer. `adamw`: decoupled weight decay on hidden/output matrices only.
    `muon`: Newton–Schulz-orthogonalized momentum for the 2-D matrices inside the blocks, with
    AdamW (lr, betas, eps, weight_decay) for embeddings, the LM head, norms and biases.

    grad_clip: clip the global gradient norm to this value (0 = no clipping; the norm is still
    measured and logged). muon_lr/muon_momentum/muon_weight_decay/muon_ns_steps: Muon's own
    settings (Keller Jordan's defaults; weight decay off, as its update scale differs from Adam's).
    """

    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_ns_steps: int = 5

    def __post_init__(self) -> None:
        _choice("optim", "name", self.name, ("adamw", "muon"))
        for name in ("lr", "eps", "muon_lr"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, f"optim.{name} must be a finite number > 0, got {value}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
               f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        _check(0 <= self.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        for name in ("weight_decay", "muon_weight_decay", "grad_clip"):
            _check(getattr(self, name) >= 0, f"optim.{name} must be >= 0, got {getattr(self, name)}")
        _check(self.muon_ns_steps >= 1, f"optim.muon_ns_steps must be >= 1, got {self.muon_ns_steps}")


@dataclass
class ScheduleSection:
    """The learning-rate multiplier over training (it scales every parameter group's lr).

    cosine: linear warmup, then cosine decay to min_lr_ratio at the last step.
    wsd: warmup, stable at 1, then linear decay to min_lr_ratio over the last decay_fraction
        of the steps (warmup-stable-decay: the stable phase can be extended or branched).
    constant: warmup, then 1.
    """

    name: str = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _choice("schedule", "name", self.name, ("cosine", "wsd", "constant"))
        _check(self.warmup_steps >= 0, f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(0 < self.decay_fraction <= 1, f"schedule.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        _check(0 <= self.min_lr_ratio <= 1, f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def native_autocast(device: str) -> str:
    """bf16 where `device` ("auto", "cpu" or "cuda") computes it natively, else fp32: what
    `train.precision=auto` resolves to for language-model training."""
    from tokenmind.model.cpu import cpu_has_native_bf16
    from tokenmind.train.distributed import resolve_device

    return "bf16" if resolve_device(device).type == "cuda" or cpu_has_native_bf16() else "fp32"


@dataclass
class TrainSection:
    """The loop, precision, checkpoints, logging and parallelism.

    precision: fp32, or bf16 autocast (matmuls in bf16, parameters, gradients and optimizer
        state stay fp32: the fp32 copy is the master weights), fp16 autocast with dynamic loss
        scaling (`precision.py`), or fp8: the projections' matmuls through FP8 casts with delayed
        scaling (`model/fp8.py`), everything else in bf16 autocast. auto (the default): bf16 on
        CUDA and on CPUs that compute bf16 natively (AVX512_BF16 or AMX), fp32 on other CPUs,
        where bf16 is emulated (a speedrun-sized step took 55 s in bf16 vs 2.3 s in fp32 on an
        AVX2 EPYC); resolved here and saved resolved.
    loss_scale/loss_scale_growth_interval: fp16's initial loss scale, and the clean steps after
        which it doubles (an overflowing step is skipped and halves it).
    fp8_amax_history/fp8_margin: fp8's delayed scaling: amaxes remembered per tensor, and the
        extra headroom 2^margin (`Fp8Recipe`).
    eval_every/checkpoint_every: in optimizer steps; 0 = only at the end. keep_last: checkpoints
        kept on disk (0 = all). log_every: steps between JSONL lines / console updates.
    peak_flops: the hardware peak MFU divides by, per device. None: on a CPU, a 1024³ matmul in
        the precision measured at start (an AMX Xeon's 2 cores ran ~1.0e12 FLOP/s in bf16 and ~9e10
        in fp32, an AVX2 EPYC's ~1.4e11 in fp32); on H100/H200, the dense datasheet peaks (989e12 bf16).
    resume: continue from the newest checkpoint in out_dir if there is one.
    distributed: none, ddp, fsdp (FSDP2), ep (ddp with a mixture of experts' experts split
        across the ranks, `expert_parallel.py`), tp (tensor parallelism, `tensor_parallel.py`) or
        pp (pipeline parallelism, `pipeline_parallel.py`); all but none need the torchrun environment.
    pipeline_microbatches/pipeline_schedule: under pp, the micro-batches each rank's batch is cut
        into (more: a smaller bubble, smaller matmuls) and their order, gpipe or 1f1b.
    device: auto (cuda when available, else cpu), cpu or cuda.
    max_minutes: a wall-time budget for the loop (0 = none): the trainer times its first steps and
        fixes the step count once to min(steps, what fits), so a slower machine trains fewer steps
        with the whole LR schedule (warmup, decay, cool-down) rescaled to them, instead of running
        over time or stopping mid-schedule (`budget.py`). The count is saved in checkpoints.
    """

    steps: int = 1000
    max_minutes: float = 0.0
    grad_accum: int = 1
    precision: str = "auto"
    gradient_checkpointing: bool = False
    compile: bool = False
    eval_every: int = 0
    eval_batches: int = 8
    checkpoint_every: int = 0
    keep_last: int = 2
    log_every: int = 1
    out_dir: str = "runs/pretrain"
    seed: int = 0
    init_std: float = 0.02
    peak_flops: float | None = None
    resume: bool = True
    distributed: str = "none"
    device: str = "auto"
    pipeline_microbatches: int = 2
    pipeline_schedule: str = "1f1b"
    loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    fp8_amax_history: int = 16
    fp8_margin: int = 0

    def __post_init__(self) -> None:
        if self.precision == "auto":
            self.precision = native_autocast(self.device)
        _choice("train", "precision", self.precision, ("fp32", "bf16", "fp16", "fp8"))
        _choice("train", "distributed", self.distributed, ("none", "ddp", "fsdp", "ep", "tp", "pp"))
        _choice("train", "pipeline_schedule", self.pipeline_schedule, ("gpipe", "1f1b"))
        _choice("train", "device", self.device, ("auto", "cpu", "cuda"))
        for name in ("steps", "grad_accum", "log_every", "eval_batches", "pipeline_microbatches"):
            _check(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "keep_last"):
            _check(getattr(self, name) >= 0, f"train.{name} must be >= 0 (0 = off/all), got {getattr(self, name)}")
        _check(self.init_std > 0, f"train.init_std must be > 0, got {self.init_std}")
        _check(math.isfinite(self.max_minutes) and self.max_minutes >= 0,
               f"train.max_minutes must be >= 0 (0 = no time budget), got {self.max_minutes}")
        _check(self.peak_flops is None or self.peak_flops > 0,
               f"train.peak_flops must be > 0 or null (auto), got {self.peak_flops}")
        _check(math.isfinite(self.loss_scale) and self.loss_scale > 0,
               f"train.loss_scale must be a finite number > 0, got {self.loss_scale}")
        for name in ("loss_scale_growth_interval", "fp8_amax_history"):
            _check(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.fp8_margin >= 0, f"train.fp8_margin must be >= 0, got {self.fp8_margin}")
        if self.precision == "fp8":
            _check(not self.gradient_checkpointing, "train.precision=fp8 cannot recompute activations: the "
                   "recomputed forward would advance the amax histories again; set train.gradient_checkpointing=false")
            _check(self.distributed not in ("fsdp", "tp"), "train.precision=fp8 casts whole weight matrices, not "
                   f"{self.distributed} shards; use train.distributed=ddp, pp or none")
        _check(not (self.precision == "fp16" and self.distributed == "pp"),
               "train.precision=fp16 scales the loss the pipeline schedule computes inside its stages; use bf16 "
               "with train.distributed=pp")


@dataclass
class RunConfig:
    """A whole pre-training run; checks the constraints that span sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)

    def __post_init__(self) -> None:
        _check(self.data.seq_len <= self.model.max_position_embeddings,
               f"data.seq_len={self.data.seq_len} exceeds model.max_position_embeddings="
               f"{self.model.max_position_embeddings}; shorten data.seq_len or raise max_position_embeddings")
        check_schedule_fits(self.schedule, self.train)


def check_schedule_fits(schedule: ScheduleSection, train: TrainSection) -> None:
    """The schedule's warmup (and WSD decay) must fit in train.steps; shared by every run config."""
    _check(schedule.warmup_steps <= train.steps,
           f"schedule.warmup_steps={schedule.warmup_steps} exceeds train.steps={train.steps}; "
           "lower --schedule.warmup_steps")
    if schedule.name == "wsd":
        decay = round(schedule.decay_fraction * train.steps)
        _check(schedule.warmup_steps + decay <= train.steps,
               f"WSD warmup ({schedule.warmup_steps}) + decay ({decay}) steps exceed train.steps="
               f"{train.steps}; lower schedule.warmup_steps or schedule.decay_fraction")


def load_config(path: str | Path | None = None, overrides: Overrides = ()) -> RunConfig:
    """A pre-training run: defaults ← YAML file (if given) ← `section.key=value` overrides, validated;
    every error names the fix (`tokenmind.config.load_config` with `RunConfig`)."""
    return load_schema(RunConfig, path, overrides)
