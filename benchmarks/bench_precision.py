"""The loss-curve gap of low-precision training: fp32, bf16, fp16 with loss scaling, and FP8.

The same model (the CPU speedrun's shape, scaled down) from the same initial weights trains on
the same batches for --steps steps in each precision through the real `Trainer`:

* fp32: the reference;
* bf16: autocast, fp32 master weights (the project's default);
* fp16: autocast with dynamic loss scaling (`train/precision.py`): skipped steps and the final
  loss scale are reported;
* fp8: every projection through simulated FP8 GEMMs with delayed scaling (`model/fp8.py`),
  the rest in bf16.

Data: token shards (`--shards`, e.g. a speedrun's) when given, else `bench_train.SyntheticLoader`'s
seeded toy language. The JSON holds each run's final loss (mean of the last 10 steps' train
losses, as one step's loss is noisy), its gap to bf16 (absolute and relative) and its speed
(tokens/s over the run after the first step; FP8 is simulated, so its speed says what the
simulation costs, not what FP8 hardware gives). The loss curves go to one PNG
(`metrics.plot_loss_curves`).

    python benchmarks/bench_precision.py [--steps 120] [--out bench_precision.json] [--plot precision_loss.png]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import emit, machine_info
from bench_train import SyntheticLoader
from tokenmind.data.loader import PackedLoader
from tokenmind.data.shards import TokenShards
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train.config import DataSection, OptimSection, RunConfig, ScheduleSection, TrainSection
from tokenmind.train.distributed import init_distributed
from tokenmind.train.metrics import plot_loss_curves
from tokenmind.train.trainer import Trainer, loader_config

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def build_config(args: argparse.Namespace, precision: str, out_dir: Path, vocab_size: int) -> RunConfig:
    model = ModelConfig(vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=args.seq, tie_word_embeddings=True)
    return RunConfig(
        model=model, data=DataSection(batch_size=args.batch, seq_len=args.seq),
        optim=OptimSection(lr=args.lr), schedule=ScheduleSection(name="cosine", warmup_steps=args.steps // 10),
        train=TrainSection(steps=args.steps, precision=precision, log_every=1, out_dir=str(out_dir), resume=False,
                           device="cpu"))


def train_one(args: argparse.Namespace, precision: str, out_dir: Path) -> dict:
    shards = TokenShards(args.shards, "train") if args.shards else None
    cfg = build_config(args, precision, out_dir, shards.vocab_size if shards else args.vocab)
    ctx = init_distributed("none", "cpu")
    loader = (PackedLoader(shards, loader_config(cfg.data, ctx, seed=0, shuffle=True)) if shards
              else SyntheticLoader(cfg.model.vocab_size, args.batch, args.seq, seed=0))
    model = Transformer(cfg.model)
    model.init_weights(cfg.train.init_std, torch.Generator().manual_seed(0))
    trainer = Trainer(cfg, ctx, model, loader)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # the step lines are in metrics.jsonl
        result = trainer.train()
    tail = result.losses[-10:]
    row = {"final_loss": round(statistics.mean(tail), 4), "first_loss": round(result.losses[0], 4),
           "tokens_per_s": round(result.tokens_per_s, 1), "metrics": str(result.metrics_path)}
    if trainer.loss_scaler is not None:
        row.update(skipped_steps=trainer.loss_scaler.skipped_steps, final_loss_scale=trainer.loss_scaler.scale)
    return row


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            runs[precision] = train_one(args, precision, Path(tmp) / precision)
            print(precision, runs[precision], flush=True)
        plot = plot_loss_curves({p: r.pop("metrics") for p, r in runs.items()}, args.plot)
    if "bf16" in runs:
        base = runs["bf16"]["final_loss"]
        for row in runs.values():
            row["gap_vs_bf16"] = round(row["final_loss"] - base, 4)
            row["relative_gap_vs_bf16"] = round((row["final_loss"] - base) / base, 4)
    return {
        "benchmark": "precision", "machine": machine_info(),
        "data": args.shards or "synthetic (bench_train.SyntheticLoader)",
        "model": {"hidden_size": args.hidden_size, "layers": args.layers, "heads": 4, "kv_heads": 2,
                  "seq_len": args.seq, "batch_size": args.batch},
        "steps": args.steps, "lr": args.lr, "final_loss_is": "mean train loss of the last 10 steps",
        "runs": runs, "plot": str(plot), "elapsed_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--shards", help="a token-shard folder (with a train split); default: a synthetic corpus")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary of the synthetic corpus")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--plot", default="precision_loss.png")
    p.add_argument("--out")
    args = p.parse_args()
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
