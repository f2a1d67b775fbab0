"""The training loop: `Trainer` minimizes an objective over a loader's batches; `pretrain(cfg)`
turns token shards into a trained, exported model with it.

`Trainer` owns everything a run's continuation depends on — model, optimizer, LR scheduler,
data loader, step counter — so a checkpoint of exactly those, plus RNG states, makes a resumed
run retrace the uninterrupted one's loss curve. One optimizer step:

1. grad_accum micro-batches, each: the objective's loss summed over the batch's units
   (`objectives.py`; the forward under bf16/fp16 autocast if configured, while parameters stay
   fp32, so they are the master weights and the optimizer never sees bf16), backward (of the
   loss times the loss scale under fp16, `precision.py`). Under DDP/FSDP gradients are
   synchronized only on the last micro-batch.
2. The gradients are divided by the number of units in the whole global batch (and the loss
   scale), so every unit weighs the same however they spread over micro-batches and ranks: with
   next-token loss on packed pre-training rows that is the plain mean over targets, with SFT the
   mean over the assistant tokens (the others are `IGNORE_INDEX`).
3. Global gradient norm, measured before clipping (the logged number) and clipped.
4. A NaN/inf loss or norm stops the run *before* the update with `TrainingDiverged`; no
   checkpoint is written after that, so the newest one on disk is the last good state. Under
   fp16 an inf/NaN norm with a finite loss is an overflow of the scaled gradients instead: the
   update is skipped and the loss scale halves (logged as `loss_scale`, `skipped_steps`).
5. Optimizer step, then the scheduler sets the next step's lr.

Around that: validation loss every eval_every steps and at the end, checkpoints every
checkpoint_every steps and at the end, metrics to JSONL (the objective's extra metrics next to
the loss, as per-unit means too), and finally the model exported as a Hugging Face directory
(`out_dir/final`) and the loss curve as `out_dir/loss.png`.

The Trainer is handed what it trains — model, loaders, objective, tokenizer — and does not
care where they come from or what fields a batch has. `build_pretrainer` gives it packed
token-shard loaders and a randomly initialized model; SFT (`tokenmind.posttrain.sft`) gives it
chat loaders and a pretrained model; both train the `NextTokenObjective`. Throughput is counted
in `unit`s, tokens here; a trainer of other data (diffusion's images) overrides `unit`,
`units_per_step` and `export`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import random
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tokenmind.data.loader import LoaderConfig, PackedLoader
from tokenmind.data.shards import TokenShards
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.fp8 import Fp8Recipe, enable_fp8, fp8_state, load_fp8_state
from tokenmind.model.load import load_tokenizer
from tokenmind.model.lora import lora_layers, save_adapter
from tokenmind.model.transformer import MoE, Transformer, balance_experts

from .checkpoint import (
    TrainingState,
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    reshard_rank_state,
    restore_rng,
    save_checkpoint,
)
from .config import RunConfig, save_resolved
from .distributed import (
    DistContext,
    clip_grad_norm,
    grad_sync,
    init_distributed,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
    scale_grads,
    wrap_model,
)
from .expert_parallel import sharded_parameters
from .metrics import (
    MetricsLogger,
    default_peak_flops,
    expert_load_stats,
    flops_per_token,
    mfu,
    plot_expert_load,
    plot_loss,
)
from .objectives import LossTerms, NextTokenObjective, Objective
from .pipeline_parallel import PipelineParallel
from .optim import build_optimizer
from .precision import LossScaler
from .budget import PROBE_STEPS, same_lr_so_far, steps_within_budget
from .schedule import build_scheduler, lr_multiplier

if TYPE_CHECKING:
    from tokenmind.tokenizer import Tokenizer


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the newest checkpoint is the last good state."""


class Loader(Protocol):
    """What the Trainer needs of a loader: endless batches (anything with `.to(device)` that the
    objective takes) and its exact position, saved in checkpoints. A validation loader also has
    `batches_per_epoch`, the batches of one pass over its data. A loader that does work of its own
    (an RL rollout loader samples) may also have `pop_metrics() -> dict`: what it measured since
    it was last asked, logged with the step (a `tokens` entry there counts the step's tokens when
    batches vary in size)."""

    def __next__(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainResult:
    """What a `Trainer.train` call did. losses: the train loss of every step this call ran
    (after a resume, only the resumed steps); tokens_per_s/mfu: averaged over this call's steps
    after the first (which pays one-off costs), global over all ranks."""

    steps: int
    tokens_seen: int  # in the trainer's unit: tokens, or images for diffusion
    final_loss: float | None
    final_val_loss: float | None
    tokens_per_s: float
    mfu: float | None
    out_dir: Path
    metrics_path: Path
    plot_path: Path
    checkpoint_path: Path
    final_model_path: Path
    losses: list[float] = field(default_factory=list)


def seed_everything(seed: int) -> None:
    """Seed the global RNGs (torch, python, numpy) that any code in a step might draw from."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


class Trainer:
    """Trains `model` on `loader`'s batches by minimizing `objective`, as cfg's optim, schedule and
    train sections say (data.batch_size and data.seq_len count the tokens of a step), resuming
    from out_dir's newest checkpoint when train.resume.

    ctx: the process group the loaders were built for (`init_distributed`); its creator closes it.
    model: the starting weights, on CPU in fp32. val_loader: evaluated from the position it has
    now, every time. objective: what a batch's loss is (default: `NextTokenObjective`, which
    takes `TokenBatch`es). tokenizer: saved with the exported model, so the export chats as is.
    adapter_base: for a model with LoRA adapters (`model/lora.py`), where its frozen base comes
    from; then only the trainable parameters are optimized and checkpointed, and the export is a
    PEFT adapter directory naming that base. evaluator: a function measuring the model in its
    own way (held-out accuracy through the engine, say), run with validation and once before
    the first step, so its curve starts at the starting model; logged as `eval_NAME`.
    """

    def __init__(self, cfg: RunConfig, ctx: DistContext, model: Transformer, loader: Loader,
                 val_loader: Loader | None = None, objective: Objective | None = None,
                 tokenizer: Tokenizer | None = None, adapter_base: str = "",
                 evaluator: Callable[[], dict[str, float]] | None = None) -> None:
        t = cfg.train
        self.cfg, self.ctx, self.tokenizer, self.evaluator = cfg, ctx, tokenizer, evaluator
        self.out_dir = Path(t.out_dir)
        self.checkpoint_root = self.out_dir / "checkpoints"
        self.loader, self.val_loader = loader, val_loader
        self.val_start = val_loader.state_dict() if val_loader is not None else None
        self.objective = objective if objective is not None else NextTokenObjective()  # eval runs it eagerly
        self.train_objective = self.objective.compiled() if t.compile else self.objective
        seed_everything(t.seed + ctx.rank)
        model.gradient_checkpointing = t.gradient_checkpointing
        if t.precision == "fp8":
            enable_fp8(model, Fp8Recipe(t.fp8_amax_history, t.fp8_margin))
        self.loss_scaler = LossScaler(t.loss_scale, t.loss_scale_growth_interval) if t.precision == "fp16" else None
        model.to(ctx.device)
        self.model = model  # the module whose state we save (sharded in place under fsdp)
        self.wrapped = wrap_model(model, ctx, t.pipeline_microbatches, t.pipeline_schedule,
                                  cfg.data.batch_size)  # what we call in training
        self.pipeline = self.wrapped if isinstance(self.wrapped, PipelineParallel) else None
        if self.pipeline is not None and not isinstance(self.objective, NextTokenObjective):
            raise ValueError(f"pipeline parallelism trains next-token loss only, not {type(self.objective).__name__}; "
                             "use --train.distributed=ddp or fsdp")
        self.params = [p for p in model.parameters() if p.requires_grad]
        sharded = sharded_parameters(model)  # expert parallelism: each rank holds other experts
        self.sharded_params = [p for name, p in model.named_parameters() if name in sharded and p.requires_grad]
        self.shared_params = []  # a pipeline's tied embedding on its last stage: counted by the first
        if self.pipeline is not None:  # each stage holds other layers
            self.shared_params = self.pipeline.shared_parameters()
            self.sharded_params = [p for p in self.params if all(p is not q for q in self.shared_params)]
        self.frozen_base = len(self.params) < len(list(model.parameters()))  # checkpoints hold only what trains
        self.adapter_base = adapter_base
        self.optimizer = build_optimizer(model, cfg.optim, keep_empty_groups=self.pipeline is not None)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, t.steps)
        self.total_steps = t.steps  # train.max_minutes may lower it (`budget.py`)
        self.budget_applied = False
        self.elapsed_before = 0.0  # loop seconds spent before a resume (counted against the budget)
        self._loop_started: float | None = None
        self.clock = time.perf_counter  # what the loop is timed with (tests hand in their own)

        self.step = 0
        self.tokens_seen = 0
        self.tokens_per_step, self.flops_per_token = self.units_per_step()
        self.peak_flops = t.peak_flops or default_peak_flops(ctx.device, t.precision)

        latest = latest_checkpoint(self.checkpoint_root)
        if latest is not None:
            if not t.resume:
                raise FileExistsError(f"{self.checkpoint_root} already has checkpoints (newest: {latest.name}); "
                                      "pass --train.resume=true to continue that run or choose a new --train.out_dir")
            self._restore(latest)

    unit = "tokens"  # what throughput counts (logged as `<unit>` and `<unit>_per_s`)

    def units_per_step(self) -> tuple[int, float | None]:
        """(units one optimizer step trains on over all ranks, model FLOPs per unit or None for no
        MFU): data.batch_size × data.seq_len tokens per micro-batch, and the Transformer's count."""
        cfg = self.cfg
        return (cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum * self.ctx.data_world_size,
                flops_per_token(self.model.cfg, cfg.data.seq_len, self.frozen_base))

    # ---- checkpoints -----------------------------------------------------------------------------

    def save(self) -> Path:
        """Checkpoint the current step (every rank must call this)."""
        state = TrainingState(
            model=model_state(self.model, self.ctx, trainable_only=self.frozen_base),
            optimizer=optimizer_state(self.model, self.optimizer, self.ctx),
            trainer={"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                     **({"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler else {}),
                     **({"budget": {"total_steps": self.total_steps if self.budget_applied else None,
                                    "elapsed_s": self.elapsed()}} if self.cfg.train.max_minutes else {})},
            rank={"loader": self.loader.state_dict(), "rng": capture_rng(), "fp8": fp8_state(self.model)},
        )
        return save_checkpoint(self.checkpoint_root, self.step, state, self.ctx, self.cfg.train.keep_last)

    def _restore(self, path: Path) -> None:
        read_shared = self.ctx.is_main or not self.ctx.full_state_on_rank0
        state = load_checkpoint(path, self.ctx.rank, read_shared, self.ctx.world_size)
        if state.world_size != self.ctx.world_size:  # saved by another number of ranks: adapt rank 0's part
            state.rank = reshard_rank_state(state.rank, self.loader.state_dict(), self.cfg.train.seed,
                                            state.trainer["step"], self.ctx.rank)
        load_model_state(self.model, state.model, self.ctx, strict=not self.frozen_base)
        load_optimizer_state(self.model, self.optimizer, state.optimizer, self.ctx)
        self.scheduler.load_state_dict(state.trainer["scheduler"])
        self.step, self.tokens_seen = state.trainer["step"], state.trainer["tokens_seen"]
        budget = state.trainer.get("budget") if self.cfg.train.max_minutes else None
        if budget is not None:
            self.elapsed_before = budget["elapsed_s"]
            if budget["total_steps"] is not None:
                self.set_total_steps(budget["total_steps"])
        self.loader.load_state_dict(state.rank["loader"])
        restore_rng(state.rank["rng"])
        if self.loss_scaler is not None:
            if "loss_scaler" not in state.trainer:
                raise ValueError(f"{path} was not saved by an fp16 run (it has no loss scale); resume it with the "
                                 "train.precision it was trained in")
            self.loss_scaler.load_state_dict(state.trainer["loss_scaler"])
        load_fp8_state(self.model, state.rank.get("fp8", {}))

    # ---- the step count and the time budget ------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds in the training loop so far, over every process of this run."""
        running = self.clock() - self._loop_started if self._loop_started is not None else 0.0
        return self.elapsed_before + running

    def set_total_steps(self, total: int) -> None:
        """Fix the run's step count: the LR schedule is rebuilt for it, at the current step, and every
        group's lr set to the new schedule's value there."""
        position = self.scheduler.state_dict()
        self.scheduler = build_scheduler(self.optimizer, self.cfg.schedule, total)
        self.scheduler.load_state_dict(position)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * lr_multiplier(self.cfg.schedule, total, self.scheduler.last_epoch)
        self.total_steps, self.budget_applied = total, True

    def _budget_adjustable(self) -> bool:
        """Whether a new estimate could still change the step count (before the first one, or while the
        steps taken would keep their LR): past that, step times are no longer collected."""
        return not self.budget_applied or same_lr_so_far(self.cfg.schedule, self.step, self.total_steps,
                                                          self.total_steps)

    def _apply_budget(self, seconds_per_step: float, logger: MetricsLogger) -> None:
        """train.max_minutes: the step count from the measured rate (the ranks' mean, so all agree); the
        first estimate always applies, later ones only where they keep the LR of the steps taken."""
        rate = float(self.ctx.mean(torch.tensor(seconds_per_step, dtype=torch.float64, device=self.ctx.device)))
        total = steps_within_budget(self.step, rate, self.elapsed(), 60 * self.cfg.train.max_minutes,
                                    self.cfg.train.steps)
        if self.budget_applied and (
                total == self.total_steps or not same_lr_so_far(self.cfg.schedule, self.step, self.total_steps, total)):
            return
        self.set_total_steps(total)
        logger.set_total(total)
        logger.log({"step": self.step, "budget_steps": total, "budget_step_s": rate, "elapsed": self.elapsed()})

    # ---- the loop --------------------------------------------------------------------------------

    def _per_unit(self, terms: LossTerms) -> tuple[float, dict[str, float]]:
        """(units per rank, averaged over ranks; the loss and metrics per unit of the global
        batch) from this rank's summed `terms`, in one all-reduce."""
        sums = [terms.loss, terms.count, *terms.metrics.values()]
        loss, count, *metrics = self.ctx.mean(torch.stack(
            [torch.as_tensor(s, dtype=torch.float32, device=self.ctx.device) for s in sums])).tolist()
        return count, {"loss": loss / count, **{name: m / count for name, m in zip(terms.metrics, metrics)}}

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns the loss and the objective's metrics
        (per unit), then the lr used and the pre-clip gradient norm (and under fp16 the loss scale
        this step used and the steps skipped so far)."""
        t, scaler = self.cfg.train, self.loss_scaler
        scale = scaler.scale if scaler is not None else 1.0
        total = None
        for micro in range(t.grad_accum):
            batch = next(self.loader).to(self.ctx.device)
            with grad_sync(self.wrapped, enabled=micro == t.grad_accum - 1):
                if self.pipeline is not None:  # forward and backward, micro-batch by micro-batch, over the stages
                    terms = self.pipeline.forward_backward(batch, t.precision)
                else:
                    terms = self.train_objective(self.wrapped, batch, t.precision)
                    (terms.loss if scaler is None else scaler.scale_loss(terms.loss)).backward()
            total = terms.detach() if total is None else total + terms.detach()
        count, stats = self._per_unit(total)
        # DDP/FSDP averaged the ranks' gradients: divide by the per-rank mean count (and unscale)
        scale_grads(self.params, count * scale)
        grad_norm = float(clip_grad_norm(self.params, self.cfg.optim.grad_clip, self.sharded_params,
                                         self.shared_params))
        if scaler is not None and math.isfinite(stats["loss"]) and scaler.update(grad_norm):
            return self._skip_step(stats, grad_norm, scale)
        if not (math.isfinite(stats["loss"]) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            last = latest_checkpoint(self.checkpoint_root)
            raise TrainingDiverged(
                f"loss is {stats['loss']} (gradient norm {grad_norm}) at step {self.step + 1}; stopped before "
                f"applying that update. Last good checkpoint: {last or 'none (no checkpoint saved yet)'}. Lower "
                "optim.lr, raise schedule.warmup_steps or set optim.grad_clip, then rerun with train.resume=true")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        loads = balance_experts(self.model, self.ctx.mean)  # a mixture of experts' load, and its bias update
        return {**stats, "lr": lr, "grad_norm": grad_norm, **expert_load_stats(loads), **self._scaler_stats(scale)}

    def _skip_step(self, stats: dict[str, float], grad_norm: float, scale: float) -> dict[str, float]:
        """An fp16 step whose scaled gradients overflowed: no update (the LR schedule still moves
        on, so lr stays a function of the step); the loss scaler has halved its scale."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scaler.scale < torch.finfo(torch.float16).smallest_normal:
            raise TrainingDiverged(
                f"fp16 gradients overflow at every loss scale (now {self.loss_scaler.scale:.3g}) at step "
                f"{self.step + 1}: the gradients themselves are out of fp16's range. Use train.precision=bf16 or "
                "lower optim.lr, then rerun with train.resume=true")
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():  # torch warns when the first step is a skipped one; skipping is the point
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        return {**stats, "lr": lr, "grad_norm": grad_norm, **self._scaler_stats(scale)}

    def _scaler_stats(self, scale: float) -> dict[str, float]:
        if self.loss_scaler is None:
            return {}
        return {"loss_scale": scale, "skipped_steps": self.loss_scaler.skipped_steps}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """The loss and the objective's metrics per unit over the first eval_batches batches of the
        val loader (the same batches every time, so values are comparable across steps); None
        without a val loader."""
        if self.val_loader is None:
            return None
        self.val_loader.load_state_dict(self.val_start)
        batches = min(self.cfg.train.eval_batches, self.val_loader.batches_per_epoch)
        self.model.eval()
        run = self.pipeline.evaluate if self.pipeline is not None else functools.partial(self.objective, self.model)
        terms = [run(next(self.val_loader).to(self.ctx.device), self.cfg.train.precision) for _ in range(batches)]
        self.model.train()
        return self._per_unit(functools.reduce(operator.add, terms))[1]

    def export(self) -> Path:
        """Write the trained model as a Hugging Face directory `out_dir/final` (rank 0), or its
        LoRA adapter as a PEFT adapter directory."""
        path = self.out_dir / "final"
        if lora_layers(self.model):
            if self.ctx.is_main:
                save_adapter(self.model, path, self.adapter_base, tokenizer=self.tokenizer)
            return path
        state = model_state(self.model, self.ctx)  # collective under fsdp
        if self.ctx.is_main:
            model = self.model
            if self.ctx.strategy in ("fsdp", "ep", "tp", "pp"):  # parameters, experts or layers are parts
                model = type(self.model)(self.model.cfg)
                model.load_state_dict(state)
            save_hf_dir(model, path, tokenizer=self.tokenizer)
        return path

    def train(self) -> TrainResult:
        """Train from the current step to train.steps (or fewer under train.max_minutes); see the module
        docstring."""
        t, ctx = self.cfg.train, self.ctx
        if ctx.is_main:
            save_resolved(self.cfg, self.out_dir / "config.yaml")
        metrics_path = self.out_dir / "metrics.jsonl"
        logger = MetricsLogger(metrics_path, total_steps=self.total_steps, start_step=self.step,
                               enabled=ctx.is_main, unit=self.unit)
        losses: list[float] = []
        timed_tokens, timed_seconds, val_loss = 0, 0.0, None
        checkpoint = latest_checkpoint(self.checkpoint_root)  # stays it if resumed at the end
        started = self._loop_started = self.clock()
        probe: list[float] = []  # step times for the time budget
        if self.evaluator is not None and self.step == 0:
            logger.log({"step": 0, **{f"eval_{name}": v for name, v in self.evaluator().items()}, "elapsed": 0.0})
        self.model.train()
        try:
            while self.step < self.total_steps:
                tick = self.clock()
                stats = self.train_step()
                seconds = self.clock() - tick
                loader_stats = self.loader.pop_metrics() if hasattr(self.loader, "pop_metrics") else {}
                step_tokens = int(loader_stats.pop("tokens", self.tokens_per_step))
                self.step += 1
                self.tokens_seen += step_tokens
                losses.append(stats["loss"])
                if len(losses) > 1 or self.step == self.total_steps:  # the first step pays warm-up costs
                    timed_tokens, timed_seconds = timed_tokens + step_tokens, timed_seconds + seconds
                if t.max_minutes and len(losses) > 1 and self._budget_adjustable():
                    probe.append(seconds)
                    if len(probe) % PROBE_STEPS == 0:
                        self._apply_budget(statistics.median(probe), logger)
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    speed = step_tokens / seconds
                    logger.log({"step": self.step, **stats, **loader_stats, "step_s": seconds,
                                f"{self.unit}_per_s": speed,
                                "mfu": mfu(speed, self.flops_per_token, self.peak_flops, ctx.world_size),
                                self.unit: self.tokens_seen, "elapsed": self.clock() - started})
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == self.total_steps:
                    val = self.evaluate()
                    if val is not None:
                        val_loss = val["loss"]
                        logger.log({"step": self.step, **{f"val_{name}": v for name, v in val.items()},
                                    "elapsed": self.clock() - started})
                    if self.evaluator is not None:
                        logger.log({"step": self.step, **{f"eval_{k}": v for k, v in self.evaluator().items()},
                                    "elapsed": self.clock() - started})
                if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == self.total_steps:
                    checkpoint = self.save()
        finally:
            logger.close()
            self.elapsed_before, self._loop_started = self.elapsed(), None
        final_model = self.export()
        plot_path = self.out_dir / "loss.png"
        if ctx.is_main:
            plot_loss(metrics_path, plot_path)
            if any(isinstance(m, MoE) for m in self.model.modules()):
                plot_expert_load(metrics_path, self.out_dir / "expert_load.png")
        speed = timed_tokens / timed_seconds if timed_seconds else 0.0
        return TrainResult(
            steps=self.step, tokens_seen=self.tokens_seen, final_loss=losses[-1] if losses else None,
            final_val_loss=val_loss, tokens_per_s=speed,
            mfu=mfu(speed, self.flops_per_token, self.peak_flops, ctx.world_size),
            out_dir=self.out_dir, metrics_path=metrics_path, plot_path=plot_path,
            checkpoint_path=checkpoint, final_model_path=final_model, losses=losses)


# ---- pre-training ------------------------------------------------------------------------------


def loader_config(data: Any, ctx: DistContext, seed: int, shuffle: bool) -> LoaderConfig:
    """This rank's `LoaderConfig` for a data section's batch_size and seq_len."""
    return LoaderConfig(batch_size=data.batch_size, seq_len=data.seq_len, seed=seed, shuffle=shuffle,
                        rank=ctx.data_rank, world_size=ctx.data_world_size)


def build_pretrainer(cfg: RunConfig, ctx: DistContext) -> Trainer:
    """The `Trainer` of a pre-training run: packed loaders over data.shards (validation on their
    val split, when there is one) and cfg.model, randomly initialized, for next-token loss."""
    data = cfg.data
    if not data.shards:
        raise ValueError("data.shards is not set; pass --data.shards=DIR (a token-shard folder with a manifest.json)")
    train_shards = TokenShards(data.shards, "train")
    if train_shards.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the shards use token ids up to {train_shards.vocab_size - 1} but model.vocab_size="
                         f"{cfg.model.vocab_size}; set --model.vocab_size={train_shards.vocab_size} (or more)")
    loader = PackedLoader(train_shards, loader_config(data, ctx, data.seed, data.shuffle))
    val_loader = None
    if "val" in train_shards.manifest["splits"]:  # built now so a too-small split fails before training
        try:
            val_loader = PackedLoader(TokenShards(data.shards, "val"), loader_config(data, ctx, seed=0, shuffle=False))
        except ValueError as e:
            raise ValueError(f"val split: {e}; hold out more tokens for val or lower data.batch_size") from e
    model = Transformer(cfg.model)
    model.init_weights(cfg.train.init_std, torch.Generator().manual_seed(cfg.train.seed))  # equal on every rank
    tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else None
    return Trainer(cfg, ctx, model, loader, val_loader, tokenizer=tokenizer)


def pretrain(cfg: RunConfig) -> TrainResult:
    """Train (or resume) the run `cfg` describes; the library entry point behind `tokenmind train`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_pretrainer(cfg, ctx).train()

