"""Pipeline parallelism on `torch.distributed.pipelining`: each rank holds a consecutive slice of the layers.

With W ranks, stage s keeps layers [s·L/W, (s+1)·L/W); the first stage also keeps the embedding,
the last the final norm and the LM head. A batch is cut into micro-batches; a micro-batch's
hidden states go from stage to stage (point-to-point send/recv, with its positions and document
ids so every stage builds the same attention masks and RoPE), and in backward their gradients
come back the same way. `torch.distributed.pipelining` runs the order of those sends: GPipe (all
micro-batches forward, then all backward: W - 1 idle slots at each end, the pipeline bubble) or
1F1B (after W - 1 warm-up forwards each stage alternates one forward with one backward: the same
bubble, but at most W micro-batches' activations held at once instead of all of them).

The last stage computes each micro-batch's loss *summed* over its targets and the schedule runs
with scale_grads=False, so the gradients are those of the summed loss over the whole batch,
exactly what one process computes (the trainer divides by the target count afterwards, as for
every strategy). Every rank reads the same batch (the ranks together are one data-parallel
replica), so the loss count is known everywhere; the summed loss is broadcast from the last stage.

A tied LM head (`tie_word_embeddings`) lives on the first stage as the embedding and on the last
as the head: the two copies start equal, their gradients are summed over the pair after each
backward, and the same optimizer step keeps them equal (Megatron-LM's treatment). Checkpoints hold
the whole model: each stage's parameters and optimizer state are gathered on rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from tokenmind.data.loader import IGNORE_INDEX, TokenBatch
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.config import ModelConfig

from .objectives import LossTerms, autocast

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def check_pipeline(cfg: ModelConfig, world: int, microbatches: int, batch_size: int) -> None:
    """Refuse, naming the fix, what this pipeline cannot split."""
    problems = []
    if cfg.num_hidden_layers < world:
        problems.append(f"model.num_hidden_layers={cfg.num_hidden_layers} is fewer than the {world} stages")
    if cfg.num_experts:
        problems.append("a mixture of experts' router loss spans the stages; use --train.distributed=ep")
    if cfg.num_nextn_predict_layers:
        problems.append("multi-token prediction depths read the embedding and head of different stages")
    if batch_size % microbatches:
        problems.append(f"data.batch_size={batch_size} does not divide into train.pipeline_microbatches="
                        f"{microbatches} micro-batches")
    if problems:
        raise ValueError(f"pipeline parallelism over {world} stages: {'; '.join(problems)}. Change those "
                         "settings, or use --train.distributed=ddp or fsdp")


def stage_layers(num_layers: int, stage: int, stages: int) -> slice:
    """The layers stage `stage` of `stages` runs: a contiguous, near-equal share."""
    return slice(stage * num_layers // stages, (stage + 1) * num_layers // stages)


class Stage(nn.Module):
    """One stage's forward: (token ids or hidden states, positions, document ids) → (hidden states,
    positions, document ids) for the next stage, or logits on the last."""

    def __init__(self, model: nn.Module, layers: slice, first: bool, last: bool):
        super().__init__()
        self.model, self.layers, self.first, self.last = model, layers, first, last

    def forward(self, x: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor):
        m = self.model
        if self.first:
            x = m.embed(x)
        x = m.run_layers(x, positions, DenseAttentionMetadata(document_ids=document_ids), layers=self.layers)
        return m.logits(m.norm(x)) if self.last else (x, positions, document_ids)


def keep_stage(model: nn.Module, layers: slice, first: bool, last: bool) -> None:
    """Free, in place, the parameters another stage owns (their names stay those of the whole model)."""
    for i in set(range(len(model.layers))) - set(range(len(model.layers))[layers]):
        model.layers[i] = nn.Identity()
    if not first and not (last and model.cfg.tie_word_embeddings):
        model.embed_tokens = None
    if not last:
        model.norm, model.lm_head = None, None


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A micro-batch's cross-entropy summed over its trained targets, softmax in fp32 (as `token_loss`)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class PipelineParallel:
    """This rank's stage of `model` (the rest freed, in place) and the schedule over all stages.
    `forward_backward` replaces the objective call and backward of a training step."""

    def __init__(self, model: nn.Module, device: torch.device, microbatches: int, schedule: str, batch_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        check_pipeline(model.cfg, world, microbatches, batch_size)
        self.world, self.first, self.last = world, rank == 0, rank == world - 1
        layers = stage_layers(model.cfg.num_hidden_layers, rank, world)
        keep_stage(model, layers, self.first, self.last)
        self.stage = PipelineStage(Stage(model, layers, self.first, self.last), rank, world, device)
        self.schedule = SCHEDULES[schedule](self.stage, microbatches, loss_fn=summed_loss, scale_grads=False)
        self.tied = None
        if model.cfg.tie_word_embeddings and world > 1:
            group = dist.new_group([0, world - 1])  # every rank joins the creation, only the pair uses it
            self.tied = (group, model.embed_tokens.weight) if self.first or self.last else None

    def shared_parameters(self) -> list[nn.Parameter]:
        """Parameters this rank holds and another rank holds too (a tied embedding on the last stage):
        their gradients are clipped here but counted in the norm by the first stage alone."""
        return [self.tied[1]] if self.tied is not None and self.last else []

    def _run(self, batch: TokenBatch, precision: str, train: bool) -> LossTerms:
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        with autocast(batch.input_ids.device, precision):
            if self.first:
                run(batch.input_ids, batch.positions, batch.document_ids, target=batch.targets, losses=losses)
            else:
                run(target=batch.targets, losses=losses)
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=batch.input_ids.device)
        dist.broadcast(loss, self.world - 1)
        return LossTerms(loss, (batch.targets != IGNORE_INDEX).sum())

    def forward_backward(self, batch: TokenBatch, precision: str) -> LossTerms:
        """Every micro-batch forward and backward through all stages; this stage's gradients
        accumulate into its parameters. Returns the batch's summed loss (on every rank)."""
        terms = self._run(batch, precision, train=True)
        if self.tied is not None:
            dist.all_reduce(self.tied[1].grad, group=self.tied[0])
        return terms

    @torch.no_grad()
    def evaluate(self, batch: TokenBatch, precision: str) -> LossTerms:
        """The batch's summed loss, forward only."""
        return self._run(batch, precision, train=False)


def gather_stages(state: dict[str, Any]) -> dict[str, Any]:
    """Every stage's `state` (by parameter name) merged on rank 0 ({} elsewhere). Collective."""
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, states, dst=0)
    return {k: v for s in states for k, v in s.items()} if states else {}


def gather_optimizer_stages(state: dict[str, Any]) -> dict[str, Any]:
    """Every stage's optimizer state merged on rank 0 ({} elsewhere): the per-parameter entries
    together, and each param group listing the parameters of all stages. Collective."""
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, states, dst=0)
    if not states:
        return {}
    groups = [dict(group) for group in states[0]["param_groups"]]
    for other in states[1:]:
        if len(other["param_groups"]) != len(groups):
            raise RuntimeError("pipeline stages built different optimizer groups; build them with empty groups kept")
        for group, more in zip(groups, other["param_groups"]):
            group["params"] = list(dict.fromkeys([*group["params"], *more["params"]]))
    return {"state": {k: v for s in states for k, v in s["state"].items()}, "param_groups": groups}
