"""The pre-training loop: `pretrain(cfg)` turns token shards into a trained, exported model.

`Trainer` owns everything a run's continuation depends on — model, optimizer, LR scheduler,
data loader, step counter — so a checkpoint of exactly those, plus RNG states, makes a resumed
run retrace the uninterrupted one's loss curve. One optimizer step:

1. grad_accum micro-batches, each: forward (under bf16 autocast if configured; parameters stay
   fp32, so they are the master weights and the optimizer never sees bf16), summed next-token
   cross-entropy in fp32 divided by the number of trained targets in the whole global batch,
   backward. So every trained target weighs the same, however they spread over micro-batches
   and ranks: with packed pre-training rows that is all of them (the plain mean), with SFT
   only the assistant tokens (the others are `IGNORE_INDEX`). Under DDP/FSDP gradients are
   synchronized only on the last micro-batch.
2. Global gradient norm, measured before clipping (the logged number) and clipped.
3. A NaN/inf loss or norm stops the run *before* the update with `TrainingDiverged`; no
   checkpoint is written after that, so the newest one on disk is the last good state.
4. Optimizer step, then the scheduler sets the next step's lr.

Around that: validation loss every eval_every steps and at the end, checkpoints every
checkpoint_every steps and at the end, metrics to JSONL, and finally the model exported as a
Hugging Face directory (`out_dir/final`) and the loss curve as `out_dir/loss.png`.

Where batches come from and how the model starts are two methods, `_build_data` and
`_build_model`: pre-training reads token shards into a randomly initialized model; a subclass
(SFT in `tokenmind.posttrain`) supplies chat batches and pretrained weights and reuses the rest.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmind.data.loader import Batch, LoaderConfig, PackedLoader
from tokenmind.data.shards import TokenShards
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.transformer import Transformer

from .checkpoint import TrainingState, capture_rng, latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
from .config import RunConfig, save_resolved
from .distributed import (
    clip_grad_norm,
    grad_sync,
    init_distributed,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
    wrap_model,
)
from .metrics import MetricsLogger, default_peak_flops, flops_per_token, mfu, plot_loss
from .optim import build_optimizer
from .schedule import build_scheduler


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the newest checkpoint is the last good state."""


@dataclass
class TrainResult:
    """What a `pretrain` call did. losses: the train loss of every step this call ran (after a
    resume, only the resumed steps); tokens_per_s/mfu: averaged over this call's steps after
    the first (which pays one-off costs), global over all ranks."""

    steps: int
    tokens_seen: int
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


def autocast(device: torch.device, precision: str):
    """bf16 autocast for matmuls (weights stay fp32) or a no-op for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


IGNORE_INDEX = -100  # a target with this id is not trained on (F.cross_entropy's default ignore_index)


def token_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor,
               positions: torch.Tensor, precision: str, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of `targets` given `ids` (mean or sum over the targets that are not
    IGNORE_INDEX), attention kept within each packed document. The logits are upcast so the
    softmax and loss are computed in fp32. The unit `train.compile` compiles: with the loss
    inside the graph the compiler fuses the upcast, log-softmax and gather over the vocabulary."""
    with autocast(ids.device, precision):
        logits = model(ids, positions, document_ids=docs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def next_token_loss(model: nn.Module, batch: Batch, device: torch.device, precision: str,
                    reduction: str = "mean", loss_fn=token_loss) -> torch.Tensor:
    """`token_loss` (or a compiled `loss_fn` of it) of a loader `Batch`, moved to `device`."""
    ids, targets, docs, positions = (t.to(device, non_blocking=True) for t in batch)
    return loss_fn(model, ids, targets, docs, positions, precision, reduction)


def trained_targets(batch: Batch) -> int:
    """How many targets of `batch` carry loss."""
    return int((batch.targets != IGNORE_INDEX).sum())


def seed_everything(seed: int) -> None:
    """Seed the global RNGs (torch, python, numpy) that any code in a step might draw from."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


class Trainer:
    """Builds the run from a `RunConfig` (resuming from out_dir's newest checkpoint when
    train.resume) and trains it with `train()`. Call `close()` when done (`pretrain` does)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.ctx = init_distributed(cfg.train.distributed, cfg.train.device)
        try:
            self._build()
        except BaseException:
            self.ctx.close()
            raise

    def _build(self) -> None:
        cfg, t, ctx = self.cfg, self.cfg.train, self.ctx
        self.out_dir = Path(t.out_dir)
        self.checkpoint_root = self.out_dir / "checkpoints"
        self._build_data()
        seed_everything(t.seed + ctx.rank)
        model = self._build_model()
        model.gradient_checkpointing = t.gradient_checkpointing
        model.to(ctx.device)
        self.loss_fn = torch.compile(token_loss) if t.compile else token_loss
        self.model = model  # the module whose state we save (sharded in place under fsdp)
        self.wrapped = wrap_model(model, ctx)  # the module we call in training
        self.params = list(model.parameters())
        self.optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, t.steps)

        self.step = 0
        self.tokens_seen = 0
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * t.grad_accum * ctx.world_size
        self.flops_per_token = flops_per_token(model.cfg, cfg.data.seq_len)
        self.peak_flops = t.peak_flops or default_peak_flops(ctx.device, t.precision)

        latest = latest_checkpoint(self.checkpoint_root)
        if latest is not None:
            if not t.resume:
                raise FileExistsError(f"{self.checkpoint_root} already has checkpoints (newest: {latest.name}); "
                                      "pass --train.resume=true to continue that run or choose a new --train.out_dir")
            self._restore(latest)

    def _build_data(self) -> None:
        """Set `self.loader` (train batches), `self.val_loader` (None or a loader that
        `evaluate` rewinds to `self.val_start`), both yielding `Batch`es and saving their
        position with state_dict/load_state_dict; here: packed token shards."""
        cfg = self.cfg
        if not cfg.data.shards:
            raise ValueError("data.shards is not set; pass --data.shards=DIR (a token-shard folder with a manifest.json)")
        train_shards = TokenShards(cfg.data.shards, "train")
        if train_shards.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"the shards use token ids up to {train_shards.vocab_size - 1} but model.vocab_size="
                             f"{cfg.model.vocab_size}; set --model.vocab_size={train_shards.vocab_size} (or more)")
        self.loader = PackedLoader(train_shards, self._loader_config(cfg.data.seed, cfg.data.shuffle))
        self.val_loader: PackedLoader | None = None  # every evaluation rewinds it to its first batch
        if "val" in train_shards.manifest["splits"]:  # built now so a too-small split fails before training
            try:
                self.val_loader = PackedLoader(TokenShards(cfg.data.shards, "val"),
                                               self._loader_config(seed=0, shuffle=False))
            except ValueError as e:
                raise ValueError(f"val split: {e}; hold out more tokens for val or lower data.batch_size") from e
            self.val_start = self.val_loader.state_dict()

    def _build_model(self) -> Transformer:
        """The model training starts from (on CPU, fp32); here: cfg.model, randomly initialized."""
        model = Transformer(self.cfg.model)
        model.init_weights(self.cfg.train.init_std, torch.Generator().manual_seed(self.cfg.train.seed))  # rank-equal
        return model

    def _loader_config(self, seed: int, shuffle: bool) -> LoaderConfig:
        data = self.cfg.data
        return LoaderConfig(batch_size=data.batch_size, seq_len=data.seq_len, seed=seed, shuffle=shuffle,
                            rank=self.ctx.rank, world_size=self.ctx.world_size)

    # ---- checkpoints -----------------------------------------------------------------------------

    def save(self) -> Path:
        """Checkpoint the current step (every rank must call this)."""
        state = TrainingState(
            model=model_state(self.model, self.ctx),
            optimizer=optimizer_state(self.model, self.optimizer, self.ctx),
            trainer={"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict()},
            rank={"loader": self.loader.state_dict(), "rng": capture_rng()},
        )
        return save_checkpoint(self.checkpoint_root, self.step, state, self.ctx, self.cfg.train.keep_last)

    def _restore(self, path: Path) -> None:
        read_shared = self.ctx.is_main or self.ctx.strategy != "fsdp"
        state = load_checkpoint(path, self.ctx.rank, read_shared)
        load_model_state(self.model, state.model, self.ctx)
        load_optimizer_state(self.model, self.optimizer, state.optimizer, self.ctx)
        self.scheduler.load_state_dict(state.trainer["scheduler"])
        self.step, self.tokens_seen = state.trainer["step"], state.trainer["tokens_seen"]
        self.loader.load_state_dict(state.rank["loader"])
        restore_rng(state.rank["rng"])

    # ---- the loop --------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step over the global batch; returns (loss, pre-clip grad norm, lr used)."""
        t, device = self.cfg.train, self.ctx.device
        batches = [next(self.loader) for _ in range(t.grad_accum)]
        # DDP/FSDP average gradients over ranks, so each rank divides by the per-rank mean count.
        count = self.ctx.mean(torch.tensor(float(sum(map(trained_targets, batches))), device=device))
        total = torch.zeros((), device=device)
        for micro, batch in enumerate(batches):
            with grad_sync(self.wrapped, enabled=micro == t.grad_accum - 1):
                loss = next_token_loss(self.wrapped, batch, device, t.precision, "sum", self.loss_fn) / count
                loss.backward()
            total += loss.detach()
        grad_norm = float(clip_grad_norm(self.params, self.cfg.optim.grad_clip))
        loss = float(self.ctx.mean(total))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            last = latest_checkpoint(self.checkpoint_root)
            raise TrainingDiverged(
                f"loss is {loss} (gradient norm {grad_norm}) at step {self.step + 1}; stopped before applying "
                f"that update. Last good checkpoint: {last or 'none (no checkpoint saved yet)'}. Lower optim.lr, "
                "raise schedule.warmup_steps or set optim.grad_clip, then rerun with train.resume=true")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss per trained target over the first eval_batches batches of the val split (the
        same batches every time, so values are comparable across steps); None without a val split."""
        if self.val_loader is None:
            return None
        self.val_loader.load_state_dict(self.val_start)
        batches = [next(self.val_loader) for _ in range(min(self.cfg.train.eval_batches,
                                                                self.val_loader.batches_per_epoch))]
        self.model.eval()
        total = sum(next_token_loss(self.model, batch, self.ctx.device, self.cfg.train.precision, reduction="sum")
                    for batch in batches)
        self.model.train()
        count = torch.tensor(float(sum(map(trained_targets, batches))), device=self.ctx.device)
        return float(self.ctx.mean(total) / self.ctx.mean(count))

    def export(self) -> Path:
        """Write the trained model as a Hugging Face directory `out_dir/final` (rank 0)."""
        path = self.out_dir / "final"
        state = model_state(self.model, self.ctx)  # collective under fsdp
        if self.ctx.is_main:
            model = self.model
            if self.ctx.strategy == "fsdp":  # parameters are shards; build a whole copy
                model = Transformer(self.model.cfg)
                model.load_state_dict(state)
            save_hf_dir(model, path, tokenizer=self._tokenizer())
        return path

    def _tokenizer(self):
        """The tokenizer named in data.tokenizer, saved with the model so the export chats as is."""
        if not self.cfg.data.tokenizer:
            return None
        from tokenmind.pretrained import resolve_model_path
        from tokenmind.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(resolve_model_path(self.cfg.data.tokenizer))

    def train(self) -> TrainResult:
        """Train from the current step to train.steps; see the module docstring."""
        t, ctx = self.cfg.train, self.ctx
        if ctx.is_main:
            save_resolved(self.cfg, self.out_dir / "config.yaml")
        metrics_path = self.out_dir / "metrics.jsonl"
        logger = MetricsLogger(metrics_path, total_steps=t.steps, start_step=self.step, enabled=ctx.is_main)
        losses: list[float] = []
        timed_tokens, timed_seconds, val_loss = 0, 0.0, None
        checkpoint = latest_checkpoint(self.checkpoint_root)  # stays it if resumed at the end
        started = time.perf_counter()
        self.model.train()
        try:
            while self.step < t.steps:
                tick = time.perf_counter()
                loss, grad_norm, lr = self.train_step()
                seconds = time.perf_counter() - tick
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                losses.append(loss)
                if len(losses) > 1 or self.step == t.steps:  # the first step pays warm-up costs
                    timed_tokens, timed_seconds = timed_tokens + self.tokens_per_step, timed_seconds + seconds
                if self.step % t.log_every == 0 or self.step == t.steps:
                    speed = self.tokens_per_step / seconds
                    logger.log({"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                "tokens_per_s": speed,
                                "mfu": mfu(speed, self.flops_per_token, self.peak_flops, ctx.world_size),
                                "tokens": self.tokens_seen, "elapsed": time.perf_counter() - started})
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps:
                    val_loss = self.evaluate()
                    if val_loss is not None:
                        logger.log({"step": self.step, "val_loss": val_loss,
                                    "elapsed": time.perf_counter() - started})
                if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.steps:
                    checkpoint = self.save()
        finally:
            logger.close()
        final_model = self.export()
        plot_path = self.out_dir / "loss.png"
        if ctx.is_main:
            plot_loss(metrics_path, plot_path)
        speed = timed_tokens / timed_seconds if timed_seconds else 0.0
        return TrainResult(
            steps=self.step, tokens_seen=self.tokens_seen, final_loss=losses[-1] if losses else None,
            final_val_loss=val_loss, tokens_per_s=speed,
            mfu=mfu(speed, self.flops_per_token, self.peak_flops, ctx.world_size),
            out_dir=self.out_dir, metrics_path=metrics_path, plot_path=plot_path,
            checkpoint_path=checkpoint, final_model_path=final_model, losses=losses)

    def close(self) -> None:
        """Leave the process group if this trainer created it."""
        self.ctx.close()


def pretrain(cfg: RunConfig) -> TrainResult:
    """Train (or resume) the run `cfg` describes; the library entry point behind `tokenmind train`."""
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()
