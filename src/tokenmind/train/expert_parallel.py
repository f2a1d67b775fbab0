"""Expert parallelism: shard each MoE layer's experts across ranks and route tokens to them with all-to-all.

Most of a mixture of experts' parameters are experts, and a token uses only k of them, so instead
of every rank holding all E experts, rank r of W holds experts [r·E/W, (r+1)·E/W) — slices of the
fused 3-D tensors — and the tokens travel to their experts. The router stays replicated, like
attention and the embeddings: every rank routes its own tokens, and `Experts.forward` sorts the
(token, expert) rows by expert, hence by the rank that owns it. `ShardedExperts.run_grouped`
then

1. exchanges the row counts per (rank, local expert) in one all-to-all, so every rank knows how
   many rows it receives from each rank for each of its experts;
2. sends every row to its expert's rank (an all-to-all with those uneven splits);
3. regroups the received rows by local expert and runs each expert as one matmul;
4. sends the results back with the reverse all-to-all, in the order the rows left in, where
   `Experts.forward` weights them and sums them per token as it does without parallelism.

Both row exchanges are autograd-aware (`torch.distributed._functional_collectives`, which
torch 2.13 names as the successor of `torch.distributed.nn.functional`): the backward of an
all-to-all is the reverse all-to-all, so an expert's gradient collects the rows of every rank's
tokens.

With data parallelism (train.distributed=ep: each rank its own batch) the other parameters are
replicated and DDP averages their gradients over the W ranks, which is the gradient of the mean
of the ranks' losses. An expert's gradient is already the *sum* over every rank's loss, so it is
divided by W: then both are the gradient of the same mean, and the optimizer sees what a single
process sees on the whole global batch. The gradient norm adds the experts' squares over ranks.
Checkpoints hold the full expert tensors under their usual names (`gather`, collective) and
ranks slice their part back out on load (`shard`), so a run saved under ep loads in one process.
The whole model is built on every rank before its experts are sliced, so each rank must be able
to hold it once at start-up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single
from torch.nn.parallel import DistributedDataParallel

from tokenmind.model.transformer import Experts, MoE


class ShardedExperts(Experts):
    """This rank's num_experts / W experts of `experts`; tokens reach them over `group` (size W)."""

    holds_all_experts = False

    def __init__(self, experts: Experts, group: dist.ProcessGroup):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if experts.num_experts % world:
            raise ValueError(f"expert parallelism over {world} ranks needs num_experts divisible by {world}, got "
                             f"{experts.num_experts}; run on a number of processes that divides it")
        local, (_, d, f) = experts.num_experts // world, experts.down_proj.shape
        super().__init__(local, d, f)
        self.num_experts = experts.num_experts  # routing chooses among all of them
        self.group, self.world, self.local = group, world, local
        self.first = rank * local
        for name, full in experts.named_parameters():  # slices copied, so the full tensors can be freed
            setattr(self, name, nn.Parameter(self.shard(full.detach()).clone(), requires_grad=full.requires_grad))

    def run_grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """See the module docstring. rows (n, d) grouped by expert, counts (E,) → their outputs (n, d)."""
        send = counts.view(self.world, self.local)  # send[r, e]: rows for rank r's e-th expert
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[r, e]: rows rank r sends my e-th expert
        sent, received = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = all_to_all_single(rows.contiguous(), received, sent, self.group)  # by source rank, then expert
        expert_of_row = torch.arange(self.local, device=rows.device).repeat(self.world)
        by_expert = expert_of_row.repeat_interleave(recv.flatten()).argsort(stable=True)
        groups = arrived[by_expert].split(recv.sum(0).tolist())
        # Every local expert runs, even on no rows, so the output always depends on the rows that
        # arrived: each rank's backward then reaches both all-to-alls, which every rank must join.
        out = torch.cat([self.expert(e, group) for e, group in enumerate(groups)])
        return all_to_all_single(out[by_expert.argsort()], sent, received, self.group)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor over all experts (E, ...) → (E/W, ...)."""
        return full[self.first:self.first + self.local]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """Inverse of `shard`: every rank's part, concatenated in expert order. Collective."""
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part.contiguous(), group=self.group)
        return torch.cat(parts)


def shard_experts(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Replace every MoE layer's `Experts` by this rank's `ShardedExperts` over `group`, in place."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("expert parallelism shards a mixture of experts, but the model has no MoE layer; "
                         "set model.num_experts, or use --train.distributed=ddp or fsdp")
    for layer in layers:
        layer.experts = ShardedExperts(layer.experts, group)


def sharded_parameters(model: nn.Module) -> dict[str, ShardedExperts]:
    """Full name of every expert-parallel parameter → the `ShardedExperts` that holds it."""
    return {f"{prefix}.{name}": module for prefix, module in model.named_modules()
            if isinstance(module, ShardedExperts) for name, _ in module.named_parameters()}


def expert_data_parallel(model: nn.Module, device_ids: list[int] | None) -> DistributedDataParallel:
    """Shard `model`'s experts over all ranks (in place) and wrap the rest in DDP, which ignores
    the experts; an expert's gradient is divided by the world size (see the module docstring)."""
    world = dist.get_world_size()
    shard_experts(model, dist.new_group())  # its own group: the exchanges never queue behind DDP's all-reduces
    names = sharded_parameters(model)
    # DDP's way (pytorch#43690) to leave parameters alone: no broadcast from rank 0, no averaging.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(names))
    for name, p in model.named_parameters():
        if name in names:
            p.register_hook(lambda grad: grad / world)
    return DistributedDataParallel(model, device_ids=device_ids)


def _map_experts(model: nn.Module, state: dict[str, Any], fn) -> dict[str, Any]:
    """`state` (model or optimizer state keyed by parameter name) with `fn(module, tensor)`
    applied to each expert-parallel entry: the tensor itself, or each per-expert tensor of an
    optimizer state (exp_avg, exp_avg_sq; not the scalar step)."""
    out = dict(state)
    for name, module in sharded_parameters(model).items():  # the same order on every rank
        value = state.get(name)
        if isinstance(value, torch.Tensor):
            out[name] = fn(module, value)
        elif isinstance(value, dict):
            out[name] = {k: fn(module, v) if isinstance(v, torch.Tensor) and v.ndim == 3 else v
                         for k, v in value.items()}
    return out


def gather_experts(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every rank's experts gathered into full tensors (all E experts). Collective."""
    return _map_experts(model, state, ShardedExperts.gather)


def local_experts(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `gather_experts`: `state` with the full expert tensors cut to this rank's part."""
    return _map_experts(model, state, ShardedExperts.shard)
