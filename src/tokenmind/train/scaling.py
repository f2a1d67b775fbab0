"""Scaling laws on a CPU budget: a grid of tiny models × token budgets, the fitted L(N, D), the
compute-optimal size for a larger budget, and one held-out run that checks the prediction.

Every grid point is an ordinary pre-training run (`pretrain`, cosine schedule ending at its own
token budget, so each point is a finished run, as Hoffmann et al. 2022 insist, not a checkpoint
of a longer one). Its final validation loss is one observation L(N, D), with

* N: the parameters that do a matmul per token (`matmul_parameters`: all but the input lookup; the
  tied embedding counts once, as the LM head). Kaplan et al. 2020 leave embeddings out, which suits
  large models; at these sizes the LM head is most of the compute (a 32-wide model's blocks have
  27k parameters, its 4k-token head 131k), so leaving it out would make 6·N·D undercount the
  work ~6× and N mismeasure capacity;
* D: training tokens seen;
* compute C = 6·N·D (the rule: 2 FLOPs per parameter per token forward, 4 backward), reported
  next to the count with attention and the LM head (`flops_per_token`) and the count
  `torch.utils.flop_counter` measures on a real step.

The fit is Chinchilla's approach 3: L(N, D) = E + A/N^α + B/D^β, by minimising a Huber loss
between log L̂ and log L, L̂ written as logsumexp(a − α log N, b − β log D, e) so every parameter
stays unconstrained, from a grid of starting points (the loss surface has local minima), with
L-BFGS. Under C = 6ND the loss is smallest at

    N_opt(C) = G · (C/6)^(β/(α+β)),  G = (αA / βB)^(1/(α+β)),  D_opt = C / (6 N_opt).

The held-out run (a point not in the grid) is trained last and its loss compared with the
fit's prediction; the report states both.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch.utils.flop_counter import FlopCounterMode

from tokenmind.config import config_dict, load_config as load_schema
from tokenmind.jsonl import atomic_open, write_json
from tokenmind.model.config import ModelConfig
from tokenmind.train.config import DataSection, OptimSection, RunConfig, ScheduleSection, TrainSection
from tokenmind.train.metrics import flops_per_token, matmul_parameters
from tokenmind.train.trainer import pretrain


@dataclass
class ScalingConfig:
    """A scaling-law study.

    shards: token shards to train on (the speedrun's, `runs/cpu/shards`, by default); their
        `val` split gives every run's loss. sizes: model shapes as [hidden_size, layers]; heads
        are hidden/32 (half as many key/value heads when that is an even 4 or more), the MLP 3× wide, as the
        speedrun's model. tokens: training-token budgets; every size trains at every budget.
    holdout: [hidden_size, layers, tokens] of the run kept out of the fit to test its prediction.
    budget_flops: the larger compute budget the compute-optimal size is predicted for.
    seq_len/batch_size/lr/warmup_fraction/precision: shared by every run (lr is not tuned per
        size: a stated simplification). threads: torch threads per run (0 = torch's default).
    """

    shards: str = "runs/cpu/shards"
    out_dir: str = "runs/scaling"
    sizes: list[list[int]] = field(default_factory=lambda: [[32, 1], [64, 2], [128, 3], [192, 4]])
    tokens: list[int] = field(default_factory=lambda: [25_000, 50_000, 100_000, 200_000, 400_000])
    holdout: list[int] = field(default_factory=lambda: [160, 3, 300_000])
    budget_flops: float = 1e15
    seq_len: int = 128
    batch_size: int = 4
    lr: float = 5e-3
    warmup_fraction: float = 0.1
    precision: str = "fp32"
    seed: int = 0
    threads: int = 0

    def __post_init__(self) -> None:
        bad = [s for s in self.sizes if len(s) != 2 or s[0] % 32 or s[1] < 1]
        if bad or not self.sizes:
            raise ValueError(f"scaling.sizes must be [hidden_size, layers] pairs with hidden_size a multiple of 32 "
                             f"(one head per 32 features); got {self.sizes}")
        if len(self.holdout) != 3 or self.holdout[0] % 32:
            raise ValueError(f"scaling.holdout must be [hidden_size, layers, tokens]; got {self.holdout}")
        if len(self.sizes) * len(self.tokens) < 6:
            raise ValueError("the fit has 5 parameters: give at least 6 grid points (sizes × tokens)")
        if min(self.tokens) < self.seq_len * self.batch_size * 4:
            raise ValueError(f"every token budget needs at least 4 steps of {self.seq_len * self.batch_size} tokens")


def load_scaling_config(path: str | Path | None = None, overrides=()) -> ScalingConfig:
    return load_schema(ScalingConfig, path, overrides)


def model_config(hidden: int, layers: int, vocab_size: int, seq_len: int) -> ModelConfig:
    """The grid's model family: the speedrun's shape (SwiGLU 3×, GQA, tied embeddings) at any size."""
    heads = hidden // 32
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads // 2 if heads >= 4 and heads % 2 == 0 else heads,
                       max_position_embeddings=seq_len,
                       tie_word_embeddings=True)


def measured_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of one real forward + backward, as torch's FLOP counter sees them, per token. Attention
    runs on SDPA's math path here: the counter has no formula for the CPU's fused kernel and would
    count its matmuls as zero."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tokenmind.model.transformer import Transformer

    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return counter.get_total_flops() / seq_len


def run_config(cfg: ScalingConfig, hidden: int, layers: int, tokens: int, vocab_size: int) -> RunConfig:
    steps = max(4, round(tokens / (cfg.seq_len * cfg.batch_size)))
    return RunConfig(
        model=model_config(hidden, layers, vocab_size, cfg.seq_len),
        data=DataSection(shards=cfg.shards, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed),
        optim=OptimSection(lr=cfg.lr, weight_decay=0.1, grad_clip=1.0),
        schedule=ScheduleSection(name="cosine", warmup_steps=max(1, int(cfg.warmup_fraction * steps)),
                                 min_lr_ratio=0.1),
        train=TrainSection(steps=steps, precision=cfg.precision, eval_every=0, eval_batches=10_000,
                           checkpoint_every=0, keep_last=1, log_every=max(1, steps // 20),
                           out_dir=str(Path(cfg.out_dir) / f"h{hidden}_l{layers}_t{tokens}"), seed=cfg.seed),
    )


def train_point(cfg: ScalingConfig, hidden: int, layers: int, tokens: int, vocab_size: int) -> dict[str, Any]:
    """Train one grid point (or read its result, when a finished run with the same config exists)."""
    run = run_config(cfg, hidden, layers, tokens, vocab_size)
    out = Path(run.train.out_dir)
    cached = out / "scaling_point.json"
    wanted = config_dict(run)
    if cached.is_file():
        point = json.loads(cached.read_text())
        if point.get("config") == wanted:
            return point
    result = pretrain(run)
    n = matmul_parameters(run.model)
    d = result.tokens_seen
    point = {"hidden": hidden, "layers": layers, "tokens": d, "params": n,
             "params_total": run.model.num_parameters, "loss": result.final_val_loss,
             "train_loss": result.final_loss, "tokens_per_s": result.tokens_per_s,
             "flops_6nd": 6.0 * n * d, "flops_counted": flops_per_token(run.model, cfg.seq_len) * d,
             "flops_measured": measured_flops_per_token(run.model, cfg.seq_len) * d, "config": wanted}
    write_json(cached, point)
    return point


@dataclass
class ScalingLaw:
    """L(N, D) = E + A/N^α + B/D^β."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def compute_optimal(self, flops: float) -> tuple[float, float]:
        """(N, D) minimising L under 6·N·D = flops."""
        a, b = self.alpha, self.beta
        g = (a * self.A / (b * self.B)) ** (1 / (a + b))
        n = g * (flops / 6) ** (b / (a + b))
        return n, flops / (6 * n)


def fit_scaling_law(points: list[tuple[float, float, float]], delta: float = 1e-3) -> ScalingLaw:
    """Chinchilla's approach-3 fit to (N, D, loss) points: Huber(δ) on log-loss residuals, L-BFGS
    from a grid of starting points, the best final objective kept."""
    if len(points) < 6:
        raise ValueError(f"fitting 5 parameters needs at least 6 points, got {len(points)}")
    t = torch.tensor(points, dtype=torch.float64)
    log_n, log_d, log_l = t[:, 0].log(), t[:, 1].log(), t[:, 2].log()

    def objective(p: torch.Tensor) -> torch.Tensor:
        a, b, e, alpha, beta = p
        pred = torch.logsumexp(torch.stack([a - alpha * log_n, b - beta * log_d, e.expand_as(log_n)]), 0)
        return torch.nn.functional.huber_loss(pred, log_l, delta=delta, reduction="sum")

    best, best_value = None, math.inf
    for a, b, e, alpha, beta in itertools.product((0.0, 5.0, 10.0), (0.0, 5.0, 10.0), (0.5,),
                                                  (0.2, 0.6), (0.2, 0.6)):
        p = torch.tensor([a, b, e, alpha, beta], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([p], lr=1, max_iter=100, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            value = objective(p)
            value.backward()
            return value

        opt.step(closure)
        value = float(objective(p.detach()))
        if math.isfinite(value) and value < best_value and p[3] > 0 and p[4] > 0:
            best, best_value = p.detach().clone(), value
    if best is None:
        raise RuntimeError("the scaling-law fit found no finite solution with positive exponents")
    a, b, e, alpha, beta = best.tolist()
    return ScalingLaw(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta)


def plot_scaling(points: list[dict], law: ScalingLaw, holdout: dict, png_path: Path) -> Path:
    """Left: loss vs tokens per size, measured (dots) and fitted (lines), the held-out run (star).
    Right: iso-FLOP curves, the fitted loss along 6ND = C for several C, minima marked."""
    figure = Figure(figsize=(12, 4.8), layout="tight")
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    sizes = sorted({(p["hidden"], p["layers"], p["params"]) for p in points}, key=lambda s: s[2])
    d_grid = torch.logspace(math.log10(min(p["tokens"] for p in points) / 2),
                            math.log10(max(p["tokens"] for p in points) * 4), 50).tolist()
    for i, (hidden, layers, n) in enumerate(sizes):
        colour = f"C{i}"
        mine = sorted((p for p in points if p["hidden"] == hidden and p["layers"] == layers), key=lambda p: p["tokens"])
        left.plot([p["tokens"] for p in mine], [p["loss"] for p in mine], "o", color=colour,
                  label=f"N={n / 1e3:.0f}k (h{hidden}, {layers} layers)")
        left.plot(d_grid, [law.loss(n, d) for d in d_grid], "-", color=colour, alpha=0.6)
    left.plot([holdout["tokens"]], [holdout["loss"]], "*", color="black", markersize=14,
              label=f"held out: measured {holdout['loss']:.3f}, predicted {holdout['predicted']:.3f}")
    left.set(xscale="log", xlabel="training tokens D", ylabel="validation loss",
             title=f"L = {law.E:.2f} + {law.A:.3g}/N^{law.alpha:.2f} + {law.B:.3g}/D^{law.beta:.2f}")
    left.legend(fontsize=7)
    flops = sorted(p["flops_6nd"] for p in points)
    budgets = torch.logspace(math.log10(flops[0]), math.log10(flops[-1]), 4).tolist()
    n_min = min(p["params"] for p in points) / 4
    n_max = max(p["params"] for p in points) * 8
    n_grid = torch.logspace(math.log10(n_min), math.log10(n_max), 80).tolist()
    for i, c in enumerate(budgets):
        curve = [law.loss(n, c / (6 * n)) for n in n_grid]
        right.plot(n_grid, curve, "-", color=f"C{i}", label=f"C = {c:.1e} FLOPs")
        n_opt, d_opt = law.compute_optimal(c)
        right.plot([n_opt], [law.loss(n_opt, d_opt)], "v", color=f"C{i}")
    right.set(xscale="log", xlabel="parameters N (matmul: blocks + LM head)", ylabel="fitted loss at 6ND = C",
              title="iso-FLOP curves (▼ compute-optimal N)")
    right.legend(fontsize=7)
    tmp = png_path.with_name(png_path.name + ".tmp.png")
    figure.savefig(tmp, dpi=120)
    tmp.replace(png_path)
    return png_path


def scaling(cfg: ScalingConfig) -> dict[str, Any]:
    """Run the grid and the held-out point, fit, predict; write `scaling.json`, `scaling.png` and
    `report.md` into `cfg.out_dir`. The library entry point behind `tokenmind scaling`."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = Path(cfg.shards) / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"no token shards at {cfg.shards}: run `tokenmind speedrun` (which writes "
                                f"runs/cpu/shards) or `tokenmind data prepare`, or set --shards")
    vocab_size = json.loads(manifest.read_text())["vocab_size"]
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    grid = [(h, n_layers, d) for (h, n_layers) in cfg.sizes for d in cfg.tokens]
    points = []
    for i, (h, n_layers, d) in enumerate(grid + [tuple(cfg.holdout)]):
        point = train_point(cfg, h, n_layers, d, vocab_size)
        print(f"scaling: run {i + 1}/{len(grid) + 1} hidden {h}, {n_layers} layers, {d:,} tokens: "
              f"val loss {point['loss']:.4f}", file=sys.stderr, flush=True)
        points.append(point)
    holdout = points.pop()
    law = fit_scaling_law([(p["params"], p["tokens"], p["loss"]) for p in points])
    holdout = {**holdout, "predicted": law.loss(holdout["params"], holdout["tokens"])}
    n_opt, d_opt = law.compute_optimal(cfg.budget_flops)
    summary = {
        "law": dataclasses.asdict(law),
        "tokens_per_parameter_at_optimum": d_opt / n_opt,
        "compute_optimal": {"flops": cfg.budget_flops, "params": n_opt, "tokens": d_opt,
                            "loss": law.loss(n_opt, d_opt)},
        "holdout": {k: holdout[k] for k in ("hidden", "layers", "params", "tokens", "loss", "predicted")},
        "holdout_error": holdout["loss"] - holdout["predicted"],
        "flops_measured_over_6nd": sum(p["flops_measured"] for p in points) / sum(p["flops_6nd"] for p in points),
        "points": [{k: v for k, v in p.items() if k != "config"} for p in points],
    }
    write_json(out / "scaling.json", summary)
    plot_scaling(points, law, holdout, out / "scaling.png")
    with atomic_open(out / "report.md") as fh:
        fh.write(report(summary))
    return summary


def report(summary: dict[str, Any]) -> str:
    law, opt, held = summary["law"], summary["compute_optimal"], summary["holdout"]
    rows = "\n".join(
        f"| {p['hidden']}×{p['layers']} | {p['params']:,} | {p['tokens']:,} | {p['flops_6nd']:.2e} | "
        f"{p['flops_measured']:.2e} | {p['loss']:.4f} | {p['tokens_per_s']:,.0f} |" for p in summary["points"])
    return f"""# Scaling laws

Fit (Chinchilla approach 3, N = parameters in matmuls (blocks + LM head), D = training tokens):
L(N, D) = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.3f} + {law['B']:.4g}/D^{law['beta']:.3f}

Compute-optimal for C = {opt['flops']:.2e} FLOPs (6ND): N = {opt['params']:,.0f}, D = {opt['tokens']:,.0f}
({summary['tokens_per_parameter_at_optimum']:.1f} tokens per parameter), predicted loss {opt['loss']:.3f}.

Held-out run {held['hidden']}×{held['layers']} (N = {held['params']:,}, D = {held['tokens']:,}):
measured {held['loss']:.4f}, predicted {held['predicted']:.4f} (error {summary['holdout_error']:+.4f}).

Measured FLOPs (torch's counter: attention, LM head, everything) / 6ND over the grid:
{summary['flops_measured_over_6nd']:.2f}.

![fit and iso-FLOP curves](scaling.png)

| model | N | D | 6ND | measured FLOPs | val loss | tok/s |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
{rows}
"""
