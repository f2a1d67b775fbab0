"""Data parallelism on `torch.distributed`: process group, model wrapping, gathered state.

The trainer is written once for N ranks and this module makes N = 1 the same code path: a
`DistContext` with world_size 1 turns every collective into a no-op. Two strategies:

* ddp: every rank holds the whole model; `DistributedDataParallel` averages gradients with
  an all-reduce during backward. Simple and fastest while the model fits on one device.
* fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`): each block's parameters, gradients and
  optimizer state are sharded across ranks and all-gathered just in time for its forward and
  backward; memory per rank falls ~N-fold. Parameters become `DTensor`s.
* ep: for a mixture of experts, ddp with each MoE layer's experts split across the ranks and
  tokens sent to them by all-to-all (`expert_parallel.py`).
* tp: tensor parallelism, every block's matmuls split by heads and features over the ranks,
  which all read the same batch (`tensor_parallel.py`).
* pp: pipeline parallelism, the layers split into consecutive stages, one per rank, the batch
  run through them in micro-batches (`pipeline_parallel.py`).

Either way the optimizer sees the average gradient of the global batch, so N ranks with B/N
rows each follow the single-process loss curve of batch B (tp and pp: N ranks with B rows follow
the curve of B, as they form one replica). Checkpoints hold *full* (unsharded)
state with plain parameter names, gathered through `torch.distributed.checkpoint.state_dict`,
so a run saved under ddp can resume under fsdp or ep and back, and on another number of ranks
(`checkpoint.reshard_rank_state` moves the data position and reseeds the RNGs). torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) drives initialization, on one
node or many (`torchrun --nnodes`), or a process group someone else created (Ray Train,
`ray_train.py`) is joined; gloo serves CPU and nccl CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .expert_parallel import expert_data_parallel, gather_experts, local_experts
from .pipeline_parallel import PipelineParallel, gather_optimizer_stages, gather_stages
from .tensor_parallel import checkpoint_layout, rank_major_layout, tensor_parallel


@dataclass
class DistContext:
    """Who this process is. owns_group: we created the process group, so we destroy it."""

    strategy: str
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes logs, shared checkpoint files and the exported model."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which rows this rank reads: tensor- and pipeline-parallel ranks are one model replica
        and all read the same rows."""
        return 0 if self.strategy in ("tp", "pp") else self.rank

    @property
    def data_world_size(self) -> int:
        """How many ranks read different rows (the data-parallel degree)."""
        return 1 if self.strategy in ("tp", "pp") else self.world_size

    @property
    def full_state_on_rank0(self) -> bool:
        """Whether a full model state exists only on rank 0 (saved from there, broadcast on load)."""
        return self.strategy in ("fsdp", "tp")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The average of `value` over ranks (gloo has no AVG op, so SUM / N)."""
        if self.world_size == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """auto → this rank's GPU when CUDA is available, else CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available; use --train.device=cpu or auto")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init_distributed(strategy: str, device_preference: str = "auto") -> DistContext:
    """Join (or create) the process group torchrun describes; a plain context for strategy none."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "none":
        if env_world > 1:
            raise RuntimeError(f"started as {env_world} processes but train.distributed=none; "
                               "set --train.distributed=ddp, fsdp, ep, tp or pp")
        return DistContext(strategy, resolve_device(device_preference))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":  # also in a group someone else created: nccl collectives use the current device
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"train.distributed={strategy} needs the torchrun environment (missing "
                               f"{', '.join(missing)}); launch with `torchrun --nproc_per_node=N ...` "
                               "or set --train.distributed=none")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return DistContext(strategy, device, dist.get_rank(), dist.get_world_size(), local_rank, owns)


def wrap_model(model: nn.Module, ctx: DistContext, microbatches: int = 1, schedule: str = "1f1b",
               batch_size: int = 1) -> nn.Module | PipelineParallel:
    """Shard `model` in place (fsdp, tp), wrap it (ddp), both (ep: the experts sharded, the rest
    wrapped) or keep this rank's pipeline stage of it (pp: the `PipelineParallel` running
    `microbatches` micro-batches of a `batch_size`-row batch under `schedule`); returns what to
    call for training.

    FSDP2 shards each block (and multi-token prediction depth) separately, so only one is
    unsharded at a time, then the root, which keeps the embeddings, final norm and LM head.
    """
    if ctx.strategy == "fsdp":
        for layer in [*model.layers, *model.mtp]:
            fully_shard(layer)
        fully_shard(model)
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    if ctx.strategy == "ddp":
        return DistributedDataParallel(model, device_ids=device_ids)
    if ctx.strategy == "ep":
        return expert_data_parallel(model, device_ids)
    if ctx.strategy == "tp":
        return tensor_parallel(model, ctx.device.type)
    if ctx.strategy == "pp":
        return PipelineParallel(model, ctx.device, microbatches, schedule, batch_size)
    return model


@contextlib.contextmanager
def grad_sync(wrapped: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter for all but the last micro-batch of an
    accumulated step; gradients accumulate locally and are synchronized once."""
    if isinstance(wrapped, DistributedDataParallel) and not enabled:
        with wrapped.no_sync():
            yield
        return
    if isinstance(wrapped, FSDPModule):
        wrapped.set_requires_gradient_sync(enabled)
    yield


def _by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` split into DTensors and plain tensors: foreach ops refuse a list that mixes both
    (tensor parallelism shards some parameters and replicates the rest)."""
    groups: dict[bool, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(isinstance(t, DTensor), []).append(t)
    return list(groups.values())


def scale_grads(parameters: list[nn.Parameter], factor: float | torch.Tensor) -> None:
    """Divide every gradient by `factor`, in place."""
    for group in _by_kind([p.grad for p in parameters if p.grad is not None]):
        torch._foreach_div_(group, factor)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, sharded: list[nn.Parameter] | None = None,
                   counted_elsewhere: list[nn.Parameter] | None = None) -> torch.Tensor:
    """Clip to `max_norm` (0 = measure only); returns the global pre-clip norm on every rank.
    sharded: those of `parameters` that each rank holds a different part of (expert-parallel
    experts, pipeline stages): their squares are summed over the ranks. counted_elsewhere: ones
    this rank clips but another rank counts (a pipeline's tied embedding on its last stage).
    DTensor gradients (fsdp, tp) count in full."""
    own, skip = {id(p) for p in sharded or ()}, {id(p) for p in counted_elsewhere or ()}
    square = torch.zeros((), device=parameters[0].device if parameters else None)
    for group in _by_kind([p.grad for p in parameters if p.grad is not None and id(p) not in own | skip]):
        norm = torch.nn.utils.get_total_norm(group)
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
    if sharded:
        local = torch.nn.utils.get_total_norm([p.grad for p in sharded if p.grad is not None]).square()
        dist.all_reduce(local)
        square = square + local
    norm = square.sqrt()
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        for group in _by_kind([p.grad for p in parameters if p.grad is not None]):
            torch._foreach_mul_(group, coef)
    return norm


def _options(ctx: DistContext, loading: bool) -> StateDictOptions:
    if not ctx.full_state_on_rank0:
        return StateDictOptions()
    # Full, unsharded tensors on rank 0's CPU; on load rank 0 reads and broadcasts the shards.
    return StateDictOptions(full_state_dict=True, cpu_offload=not loading, broadcast_from_rank0=loading)


def model_state(model: nn.Module, ctx: DistContext, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full model state keyed by parameter name, on CPU (on rank 0 only under fsdp, tp and pp). Collective.
    trainable_only: just the parameters that train (a LoRA run's adapters, not its frozen base)."""
    state = get_model_state_dict(model, options=_options(ctx, loading=False))
    if ctx.strategy == "ep":
        state = gather_experts(model, state)
    elif ctx.strategy == "tp":
        state = checkpoint_layout(model, state)
    elif ctx.strategy == "pp":
        state = gather_stages(state)
    keep = {name for name, p in model.named_parameters() if p.requires_grad} if trainable_only else state
    return {name: tensor.detach().cpu() for name, tensor in state.items() if name in keep}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict[str, Any]:
    """Full optimizer state keyed by parameter name (rank 0 only under fsdp, tp and pp). Collective."""
    state = get_optimizer_state_dict(model, optimizer, options=_options(ctx, loading=False))
    if ctx.strategy == "ep":
        state = {**state, "state": gather_experts(model, state["state"])}
    elif ctx.strategy == "tp" and state:
        state = {**state, "state": checkpoint_layout(model, state["state"])}
    elif ctx.strategy == "pp":
        state = gather_optimizer_stages(state)
    return state


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], ctx: DistContext, strict: bool = True) -> None:
    """Inverse of `model_state` (strict=False for a trainable-only state); under fsdp only rank 0's
    `state` is read (under tp too)."""
    if ctx.strategy == "ep":
        state = local_experts(model, state)
    elif ctx.strategy == "tp":
        state = rank_major_layout(model, state)
    elif ctx.strategy == "pp":  # this stage's part of the whole model's state
        state = {name: tensor for name, tensor in state.items() if name in model.state_dict()}
    set_model_state_dict(model, state, options=dataclasses.replace(_options(ctx, loading=True), strict=strict))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                         ctx: DistContext) -> None:
    """Inverse of `optimizer_state`; under fsdp only rank 0's `state` is read."""
    if ctx.strategy == "ep":
        state = {**state, "state": local_experts(model, state["state"])}
    elif ctx.strategy == "tp" and state:
        state = {**state, "state": rank_major_layout(model, state["state"])}
    set_optimizer_state_dict(model, optimizer, state, options=_options(ctx, loading=True))
