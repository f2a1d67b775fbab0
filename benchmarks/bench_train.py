"""Training speed: tokenmind's `Trainer.train_step` vs a plain `transformers` LlamaForCausalLM + torch AdamW loop.

Both sides train the same model (tokenmind's `ModelConfig`, the reference built from its
`to_hf()` and loaded with the same initial weights) on the same batches (a seeded toy language,
see `SyntheticLoader`) with the same batch, sequence length, precision, AdamW hyperparameters
and gradient clipping, in one process. What runs:

* tokenmind: the real `Trainer`, handed the synthetic loader as SFT hands it chat loaders, and
  its `train_step`: fused q/k/v and gate/up, `NextTokenObjective` (packed-row document mask,
  fp32 cross-entropy), clipping, its AdamW parameter groups, the LR scheduler.
* reference: `loss = model(input_ids, labels=..., use_cache=False).loss`, backward,
  `clip_grad_norm_`, `torch.optim.AdamW(model.parameters())`, `zero_grad`; SDPA attention.

Compilation: tokenmind runs as its speedrun configs train, with `train.compile=true` (model and
loss compiled together; `--no-compile` for eager); the reference is the plain eager loop the
project's target is stated against (`--compile-reference` compiles it too, for the like-for-like
compiled comparison).

Precision: `--dtype bf16` runs both under `torch.autocast(bfloat16)` with fp32 parameters and
optimizer state (tokenmind's default `train.precision`); `--dtype fp32` runs both in plain fp32.

After warm-up steps on each side, repeats of `--steps` steps alternate between the two (the
order flips every repeat) so machine noise hits both alike; medians are reported. MFU uses
tokenmind's own count (`metrics.flops_per_token`, 6·N + attention) and the peak FLOP/s the
Trainer divides by (`metrics.default_peak_flops`), both stated in the JSON. Losses are reported
as a sanity check: both start near ln(vocab) and fall, and as both see the same batches from the
same weights their per-step losses should stay close.

    python benchmarks/bench_train.py [--dtype bf16] [--steps 5] [--repeats 5] [--out bench_train.json]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch

from _common import emit, machine_info, timed
from tokenmind.data.loader import TokenBatch
from tokenmind.model.checkpoint import to_hf_state_dict
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train.config import DataSection, OptimSection, RunConfig, ScheduleSection, TrainSection
from tokenmind.train.distributed import init_distributed
from tokenmind.train.metrics import mfu
from tokenmind.train.objectives import autocast
from tokenmind.train.trainer import Trainer

TARGET_SPEEDUP = 1.5  # the project's goal on CPU (on a GPU: MFU >= 50% for a ~124M model)


class SyntheticLoader:
    """Endless seeded batches of a learnable toy language: after each token comes perm[token]
    with probability 3/4, else a uniform one, so the loss can fall well below ln(vocab). One
    document per row (document_ids 0, positions 0..T-1). Two loaders with the same seed yield the
    same batches, which is how both sides of the benchmark see identical data."""

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.batch_size, self.seq_len, self.seed = vocab_size, batch_size, seq_len, seed
        self.load_state_dict({"batches": 0})

    def __iter__(self) -> SyntheticLoader:
        return self

    def __next__(self) -> TokenBatch:
        B, T, V, g = self.batch_size, self.seq_len, self.vocab_size, self.generator
        rows = torch.empty(B, T + 1, dtype=torch.long)
        rows[:, 0] = torch.randint(V, (B,), generator=g)
        noise = torch.randint(V, (B, T), generator=g)
        follow = torch.rand(B, T, generator=g) < 0.75
        for t in range(T):
            rows[:, t + 1] = torch.where(follow[:, t], self.perm[rows[:, t]], noise[:, t])
        self.batches += 1
        zeros = torch.zeros(B, T, dtype=torch.long)
        return TokenBatch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), zeros, torch.arange(T).repeat(B, 1))

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        self.perm = torch.randperm(self.vocab_size, generator=self.generator)
        self.batches = 0
        for _ in range(state["batches"]):
            next(self)


def build_trainer(cfg: RunConfig) -> Trainer:
    """The pre-training `Trainer` (a randomly initialized cfg.model, next-token loss) fed synthetic batches."""
    model = Transformer(cfg.model)
    model.init_weights(cfg.train.init_std, torch.Generator().manual_seed(cfg.train.seed))
    loader = SyntheticLoader(cfg.model.vocab_size, cfg.data.batch_size, cfg.data.seq_len, cfg.data.seed)
    return Trainer(cfg, init_distributed("none", cfg.train.device), model, loader)


def reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: SyntheticLoader,
                   device: torch.device, precision: str, grad_clip: float) -> float:
    """One step of the plain `transformers` loop; returns the loss. `shift_labels` gives HF the
    same T targets per row as tokenmind (plain `labels` would drop each row's last one)."""
    batch = next(loader)
    ids, targets = batch.input_ids.to(device), batch.targets.to(device)
    with autocast(device, precision):
        loss = model(input_ids=ids, labels=ids, shift_labels=targets, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def build_config(args: argparse.Namespace, out_dir: str) -> RunConfig:
    model = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden_size, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    total = args.warmup + args.steps * args.repeats
    return RunConfig(
        model=model,
        data=DataSection(batch_size=args.batch, seq_len=args.seq),
        optim=OptimSection(lr=1e-3),  # higher than the default so a few dozen steps visibly learn
        schedule=ScheduleSection(name="constant", warmup_steps=0),  # the same lr as the reference's
        train=TrainSection(steps=total, precision=args.dtype, device=args.device, compile=args.compile,
                           out_dir=out_dir, resume=False),
    )


def run(args: argparse.Namespace) -> dict:
    import transformers

    load_start = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:  # the Trainer wants one; train_step writes nothing
        cfg = build_config(args, out_dir)
        result = _measure(args, cfg, build_trainer(cfg), transformers)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result["machine"] = machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                     loadavg_end=[round(x, 2) for x in os.getloadavg()])
    return result


def _measure(args: argparse.Namespace, cfg: RunConfig, trainer: Trainer, transformers) -> dict:
    device, precision = trainer.ctx.device, cfg.train.precision
    hf_cfg = transformers.AutoConfig.for_model(**cfg.model.to_hf(), attn_implementation="sdpa")
    reference = transformers.LlamaForCausalLM(hf_cfg)
    reference.load_state_dict(to_hf_state_dict(trainer.model), strict=True)  # the same initial weights
    reference.to(device).train()
    if args.compile_reference:
        reference.compile()
    o = cfg.optim
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                      weight_decay=o.weight_decay)
    ref_loader = SyntheticLoader(cfg.model.vocab_size, cfg.data.batch_size, cfg.data.seq_len, cfg.data.seed)
    trainer.model.train()

    losses: dict[str, list[float]] = {"tokenmind": [], "reference": []}
    steps = {
        "tokenmind": lambda: losses["tokenmind"].append(trainer.train_step()["loss"]),
        "reference": lambda: losses["reference"].append(
            reference_step(reference, ref_optimizer, ref_loader, device, precision, o.grad_clip)),
    }

    def steps_of(name: str, n: int) -> float:
        def go() -> None:
            for _ in range(n):
                steps[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return timed(go)

    for name in steps:
        steps_of(name, args.warmup)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.repeats):
        for name in (steps if r % 2 == 0 else reversed(list(steps))):
            seconds[name].append(steps_of(name, args.steps))

    tokens = args.steps * trainer.tokens_per_step
    sides = {}
    for name in steps:
        speeds = [tokens / s for s in seconds[name]]
        speed = statistics.median(speeds)
        utilization = mfu(speed, trainer.flops_per_token, trainer.peak_flops)
        sides[name] = {"tokens_per_s": round(speed, 1), "tokens_per_s_repeats": [round(s, 1) for s in speeds],
                       "mfu": None if utilization is None else float(f"{utilization:.4g}"),
                       "loss_first": round(losses[name][0], 4), "loss_last": round(losses[name][-1], 4)}
    sides["tokenmind"]["runs"] = ("tokenmind.train.Trainer.train_step (fused qkv/gate_up, document-masked SDPA, "
                                  "fp32 cross-entropy, AdamW param groups, LR scheduler)")
    sides["reference"]["runs"] = (f"transformers {transformers.__version__} LlamaForCausalLM "
                                  f"(attn_implementation={reference.config._attn_implementation}), "
                                  "loss from labels, torch.optim.AdamW over all parameters")
    speedup = sides["tokenmind"]["tokens_per_s"] / sides["reference"]["tokens_per_s"]
    diffs = [abs(a - b) for a, b in zip(losses["tokenmind"], losses["reference"])]
    return {
        "benchmark": "train",
        "config": {"hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads,
                   "kv_heads": cfg.model.num_key_value_heads, "intermediate": args.intermediate,
                   "vocab": args.vocab, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                   "repeats": args.repeats, "warmup_steps": args.warmup,
                   "compile": {"tokenmind": args.compile, "reference": args.compile_reference},
                   "device": str(device), "lr": o.lr, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip},
        "precision": ("bf16 autocast, fp32 parameters and AdamW state, both sides" if precision == "bf16"
                      else "fp32, both sides"),
        "num_parameters": cfg.model.num_parameters,
        "tokens_per_step": trainer.tokens_per_step,
        "flops_per_token": trainer.flops_per_token,
        "peak_flops": trainer.peak_flops,
        "peak_flops_source": f"tokenmind.train.metrics.default_peak_flops({device.type}, {precision})",
        "tokenmind": sides["tokenmind"],
        "reference": sides["reference"],
        "speedup": round(speedup, 3),
        "target_speedup": TARGET_SPEEDUP,
        "meets_target": speedup >= TARGET_SPEEDUP,
        "loss_ln_vocab": round(math.log(cfg.model.vocab_size), 4),
        "loss_max_abs_diff": round(max(diffs), 4),  # same data, same start: the curves should agree
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the repeats")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="tokenmind with train.compile=true, as the speedrun configs train (model and loss "
                         "compiled as one graph); --no-compile for eager")
    ap.add_argument("--compile-reference", action="store_true",
                    help="also torch.compile the reference model (the issue's reference is the plain eager loop)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="also write the JSON here (atomically)")
    args = ap.parse_args(argv)
    if min(args.steps, args.repeats, args.warmup) < 1:
        ap.error("--steps, --repeats and --warmup must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
