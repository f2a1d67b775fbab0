"""Training metrics: FLOP accounting and MFU, the JSONL log, the console, the loss plot.

MFU (model FLOPs utilization) = achieved model FLOP/s ÷ the hardware's peak. Model FLOPs per
trained token follow the standard count (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022,
appendix B):

    6·N + 12·L·(H·D)·T

* 6·N: each parameter that takes part in a matmul does a multiply-add (2 FLOPs) per token in
  the forward pass and twice that in the backward. N counts all parameters *except the input
  embedding*, which is a table lookup; the LM head is a real matmul, so a tied embedding
  counts once, as the head.
* 12·L·(H·D)·T: attention scores and the weighted sum (2 matmuls of T×(H·D), forward +
  backward) in each of L layers, at sequence length T, counted without the causal halving,
  as PaLM does.

It is a *model* count: gradient-checkpointing recomputation does not raise it (that would be
hardware FLOPs utilization). The peak is stated, not guessed: see `default_peak_flops`.

Every `log_every` steps one JSON object per line goes to `metrics.jsonl` (train records carry
`loss`, val records `val_loss`); the console gets a rich progress bar on a terminal and plain
lines otherwise (CI logs). On resume, records past the checkpoint's step are dropped, so the
file always describes the one run the checkpoints describe.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tokenmind.jsonl import read_jsonl
from tokenmind.model.config import ModelConfig

# (device-name substring, dense bf16 peak, fp32 peak) FLOP/s per device: NVIDIA's dense (no
# sparsity) datasheet values; fp32 means non-TF32 matmuls. CPUs differ too much to list: measured.
_PEAKS = (("H100", 989e12, 67e12), ("H200", 989e12, 67e12), ("A100", 312e12, 19.5e12))


@functools.cache
def measured_cpu_peak(dtype: torch.dtype, threads: int, size: int = 1024) -> float:
    """This CPU's matmul FLOP/s in `dtype` on `threads` threads: the best of a few size³ matmuls (a
    fixed table went wrong across machines: one machine's fp32 peak is another's 60%)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    best, spent = math.inf, 0.0
    for _ in range(10):  # the first warms up the kernel; an emulated dtype (bf16 on AVX2) stops after a second
        start = time.perf_counter()
        torch.mm(a, b)
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
        if spent > 1.0:
            break
    return 2 * size**3 / best


def matmul_parameters(cfg: ModelConfig) -> int:
    """The N of 6·N: active parameters that take part in a matmul per token (all but the input
    embedding, a lookup; a tied embedding counts once, as the LM head)."""
    return cfg.num_active_parameters - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def flops_per_token(cfg: ModelConfig, seq_len: int, frozen_base: bool = False) -> float:
    """Training (forward + backward) model FLOPs per token; see the module docstring. frozen_base
    (LoRA): the backward computes no weight gradients for the base, 4·N instead of 6·N (the adapters'
    own few FLOPs, ~4% of N at rank 16 on SmolLM2, left out)."""
    n = matmul_parameters(cfg)
    per_head = (cfg.qk_head_dim + cfg.v_head_dim) / 2 if cfg.kv_lora_rank else cfg.head_dim  # q·k and p·v widths
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * per_head * seq_len
    return (4.0 if frozen_base else 6.0) * n + attention


def default_peak_flops(device: torch.device, precision: str) -> float | None:
    """The per-device peak FLOP/s MFU divides by, or None for an unknown GPU (set train.peak_flops):
    on a CPU a dense matmul measured here, with the threads training uses. fp16 and fp8 (whose FP8
    GEMMs are simulated, `model/fp8.py`) are measured against the bf16 peak."""
    low = precision != "fp32"
    if device.type == "cpu":
        return measured_cpu_peak(torch.bfloat16 if low else torch.float32, torch.get_num_threads())
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp32 in _PEAKS:
        if key in name:
            return bf16 if low else fp32
    return None


def mfu(tokens_per_s: float, flops_token: float | None, peak_flops: float | None, world_size: int = 1) -> float | None:
    """Fraction of `world_size` devices' peak achieved at a global `tokens_per_s`; None without
    a FLOP count or a peak."""
    if peak_flops is None or flops_token is None:
        return None
    return tokens_per_s * flops_token / (peak_flops * world_size)


class MetricsLogger:
    """Appends step records to a JSONL file and shows progress. Disabled (no file, no output)
    on ranks other than 0. unit: what a train record's throughput counts (`<unit>_per_s`)."""

    def __init__(self, path: str | Path, *, total_steps: int, start_step: int = 0, enabled: bool = True,
                 console: Console | None = None, unit: str = "tokens") -> None:
        self.path, self.enabled, self.unit = Path(path), enabled, unit
        self.console = console or Console(stderr=True)
        self._handle = None
        self._progress: Progress | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_jsonl(self.path, missing_ok=True) if r.get("step", 0) <= start_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        tmp.replace(self.path)
        self._handle = open(self.path, "a", encoding="utf-8")
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(), console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (must have `step`); show a summary of it."""
        if not self.enabled:
            return
        assert self._handle is not None
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        summary = self._summary(record)
        if self._progress is not None and "loss" in record:  # the bar shows the latest train step
            self._progress.update(self._task, completed=record["step"], info=summary)
        else:  # val results stay on screen above the bar; plain lines off a terminal
            self.console.print(f"step {record['step']}: {summary}", highlight=False)

    def set_total(self, total_steps: int) -> None:
        """The run's step count changed (a time budget fixed it): the progress bar follows."""
        if self._progress is not None:
            self._progress.update(self._task, total=total_steps)

    def _summary(self, record: dict[str, Any]) -> str:
        if "budget_steps" in record:
            return (f"time budget: {record['budget_steps']} steps fit ({record['budget_step_s']:.3g} s/step, "
                    f"{record['elapsed']:.0f} s spent)")
        if "val_loss" in record:
            return f"val_loss {record['val_loss']:.4f}"
        if "loss" not in record:  # an evaluator's numbers
            return " ".join(f"{k} {v:.4g}" for k, v in record.items() if k.startswith("eval_"))
        parts = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"|g| {record['grad_norm']:.3f}",
                 f"{record[f'{self.unit}_per_s']:,.0f} {'tok' if self.unit == 'tokens' else self.unit}/s"]
        if "reward" in record:  # an RL step
            parts.insert(1, f"reward {record['reward']:.3f}")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        return "  ".join(parts)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def plot_loss(jsonl_path: str | Path, png_path: str | Path) -> Path:
    """Train loss per step (line) and val loss (points) from a metrics JSONL, as a PNG."""
    return plot_loss_curves({"": jsonl_path}, png_path)


def plot_loss_curves(runs: dict[str, str | Path], png_path: str | Path) -> Path:
    """Train loss (lines) and val loss (points) of one or more runs' metrics JSONL in one PNG,
    each run labelled by its key (runs compared on the same axes: a dense model and its MoE)."""
    figure = Figure(figsize=(8, 4.5), layout="tight")  # no pyplot: no global figure state
    axes = figure.add_subplot()
    drawn = False
    for name, jsonl_path in runs.items():
        records = read_jsonl(jsonl_path, missing_ok=True)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        prefix = f"{name} " if name else ""
        if train:
            axes.plot(*zip(*train), label=f"{prefix}train loss", linewidth=1)
        if val:
            axes.plot(*zip(*val), "o-", label=f"{prefix}val loss", markersize=4)
        drawn = drawn or bool(train or val)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.grid(alpha=0.3)
    if drawn:
        axes.legend()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=120)
    return png_path


def expert_load_stats(loads: list[torch.Tensor]) -> dict[str, Any]:
    """A step's expert-load record for metrics.jsonl: `expert_load`, each MoE layer's share of
    routed tokens per expert (the histogram), and `expert_load_max`, the busiest expert's share
    times the number of experts over all layers (1.0 = perfectly even; E = one expert takes all)."""
    if not loads:
        return {}
    return {"expert_load": [[round(float(x), 5) for x in layer] for layer in loads],
            "expert_load_max": max(float(layer.max()) * len(layer) for layer in loads)}


def plot_expert_load(jsonl_path: str | Path, png_path: str | Path) -> Path:
    """Expert utilisation of a mixture-of-experts run, as a PNG: the busiest expert's load relative
    to an even split over the steps (left), and the last logged load of every expert per layer (right)."""
    records = [r for r in read_jsonl(jsonl_path, missing_ok=True) if "expert_load" in r]
    figure = Figure(figsize=(11, 4.5), layout="tight")
    trend, last = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    if records:
        steps = [r["step"] for r in records]
        for i in range(len(records[-1]["expert_load"])):
            trend.plot(steps, [max(r["expert_load"][i]) * len(r["expert_load"][i]) for r in records],
                       label=f"MoE layer {i}", linewidth=1)
        final = records[-1]["expert_load"]
        width = 0.8 / len(final)
        for i, layer in enumerate(final):
            last.bar([e + (i + 0.5) * width - 0.4 for e in range(len(layer))], layer, width=width,
                     label=f"MoE layer {i}")
        last.set_xticks(range(len(final[0])))
        last.axhline(1 / len(final[0]), color="black", linestyle="--", linewidth=1, label="even")
        trend.legend(fontsize="small")
        last.legend(fontsize="small")
    trend.axhline(1.0, color="black", linestyle="--", linewidth=1)
    trend.set(xlabel="step", ylabel="busiest expert's load / even load", title="load imbalance")
    last.set(xlabel="expert", ylabel="share of routed tokens", title="expert load at the last step")
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=120)
    return png_path
