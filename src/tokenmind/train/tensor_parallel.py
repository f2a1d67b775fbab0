"""Tensor parallelism (Megatron-LM, arXiv 1909.08053) on DTensor: each rank holds 1/W of every block's matmuls.

All W ranks see the same batch. In each block, attention is split by heads and the MLP by its
intermediate features, so a block needs two all-reduces forward (and two backward):

* column-parallel (`ColwiseParallel`): `qkv_proj` and `gate_up_proj` keep 1/W of their output
  rows. The input is replicated; its gradient is the sum of every rank's part (an all-reduce in
  backward, identity in forward). Rank r computes its own heads' q, k and v, or its slice of gate
  and up, with no communication.
* row-parallel (`RowwiseParallel`): `o_proj` and `down_proj` keep the matching 1/W of their input
  columns, take the local activations as they are, and all-reduce the partial outputs (forward;
  identity in backward). A bias is added once, after the sum.

Both are `torch.distributed.tensor.parallel` styles over a 1-D device mesh; they run on gloo
(CPU) and nccl alike. Their weights are `DTensor`s sharded on dim 0 (column) or dim 1 (row).

The fused projections need one step before sharding: ColwiseParallel cuts contiguous row
blocks, but `qkv_proj`'s rows are [all q heads | all k heads | all v heads] and `gate_up_proj`'s
[gate | up], so a plain cut would give rank 0 all of q and none of v. `tensor_parallel` first
reorders those rows rank-major — [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], [gate_0 up_0 | gate_1 up_1 | ...]
— so that rank r's block is exactly the fused layout of a model with H/W heads (H_kv/W kv heads)
or f/W features, and the unchanged `Attention` and `MLP` code runs on it with its head counts
divided by W. Contiguous q and kv head blocks keep GQA's grouping: q head h reads kv head
h // (H/H_kv), and both lie on the same rank when H and H_kv divide by W. Checkpoints hold the
usual layout: the rows are put back on save (`checkpoint_layout`) and reordered on load.

The embeddings, norms and LM head stay replicated (each rank computes the same logits and the
same loss). A vocabulary-parallel embedding and head would save their memory but need a
cross-entropy over sharded logits (two more all-reduces of per-row maxima and sums); for the
models this project trains the head is a small share of the weights, so replication is the
simpler choice. Replicated parameters receive the same gradient on every rank, because the
column-parallel inputs' gradients are summed, and stay equal under the same optimizer step; a
per-head q/k norm's weight (Qwen3) is replicated but each rank applies it to its own heads only,
so its gradient is summed over the ranks by a hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import MLP, Attention


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """Refuse, naming the fix, a model whose layers cannot be split evenly over `world` ranks."""
    problems = []
    if cfg.num_experts:
        problems.append("it is a mixture of experts; use --train.distributed=ep")
    if cfg.kv_lora_rank:
        problems.append("multi-head latent attention is not split by tensor parallelism")
    if cfg.num_nextn_predict_layers:
        problems.append("multi-token prediction depths are not split by tensor parallelism")
    if cfg.qk_norm and not cfg.qk_norm_per_head:
        problems.append("its q/k norm spans all heads (qk_norm_per_head=false)")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, name) % world:
            problems.append(f"model.{name}={getattr(cfg, name)} does not divide by {world} ranks")
    if problems:
        raise ValueError(f"tensor parallelism over {world} ranks: {'; '.join(problems)}. Run on a number of "
                         "processes that divides the head and feature counts, or use --train.distributed=ddp or fsdp")


def rank_major(sizes: list[int], world: int) -> torch.Tensor:
    """The row order of a fused output made of segments `sizes` that puts rank r's 1/W of each
    segment side by side: [seg_0 part 0, seg_1 part 0, ..., seg_0 part 1, ...]."""
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return torch.cat([torch.arange(start + r * size // world, start + (r + 1) * size // world)
                      for r in range(world) for start, size in zip(starts, sizes)])


def fused_row_orders(model: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """Full name of every fused column-parallel weight and bias → its rank-major row order."""
    cfg = model.cfg
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    orders = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Attention):
            proj, order = "qkv_proj", rank_major([q, kv, kv], world)
        elif isinstance(module, MLP):
            proj, order = "gate_up_proj", rank_major([f, f], world)
        else:
            continue
        for name, _ in getattr(module, proj).named_parameters():
            orders[f"{prefix}.{proj}.{name}"] = order
    return orders


def summed_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: the sum of every rank's gradient."""
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def tensor_parallel(model: nn.Module, device_type: str) -> nn.Module:
    """Shard every block of `model` over all ranks, in place (see the module docstring)."""
    world = dist.get_world_size()
    check_tensor_parallel(model.cfg, world)
    orders = fused_row_orders(model, world)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in orders:
                p.copy_(p[orders[name]])
    plan = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Attention):
            module.n_heads, module.n_kv = module.n_heads // world, module.n_kv // world  # this rank's heads
            for norm in ("q_norm", "k_norm"):  # per-head norms: shared by all heads, each rank sees its own
                if hasattr(module, norm):
                    getattr(module, norm).weight.register_hook(summed_over_ranks)
            plan |= {f"{prefix}.qkv_proj": ColwiseParallel(), f"{prefix}.o_proj": RowwiseParallel()}
        elif isinstance(module, MLP):
            plan |= {f"{prefix}.gate_up_proj": ColwiseParallel(), f"{prefix}.down_proj": RowwiseParallel()}
    return parallelize_module(model, init_device_mesh(device_type, (world,)), plan)


def _reorder(model: nn.Module, state: dict[str, Any], inverse: bool) -> dict[str, Any]:
    """`state` (full tensors by parameter name, or full optimizer state) with the fused rows put in
    checkpoint order (inverse) or in rank-major order; tensors of other shapes (a step count) kept."""
    out = dict(state)
    for name, order in fused_row_orders(model, dist.get_world_size()).items():
        index = order.argsort() if inverse else order

        def apply(t):
            return t[index] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == len(index) else t

        value = state.get(name)  # rank 0 alone holds the full state
        if value is not None:
            out[name] = {k: apply(v) for k, v in value.items()} if isinstance(value, dict) else apply(value)
    return out


def checkpoint_layout(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A gathered tensor-parallel state in the usual checkpoint layout (q, k, v and gate, up rows whole)."""
    return _reorder(model, state, inverse=True)


def rank_major_layout(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `checkpoint_layout`: a checkpoint's state reordered for sharding."""
    return _reorder(model, state, inverse=False)
