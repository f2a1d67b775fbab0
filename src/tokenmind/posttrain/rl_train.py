"""Online RL runs: the config, the trainer wiring, held-out evaluation and the report; behind `tokenmind rl`.

A run is the one `Trainer` (checkpoints, exact resume, LoRA, metrics JSONL) handed a
`RolloutLoader` (the paged engine sampling from the live policy, `rollout.py`) and an
`RLObjective` (`rl.py`), with `rl.algo` choosing the paper's recipe and every choice overridable.
The task's held-out items are scored greedily through the same engine before the first step and
every `train.eval_every` steps; items whose prompt text also occurs in the training items are
removed from training, so the held-out accuracy is measured on prompts never trained on.

Tasks: `gym:NAME` (a reasoning-gym generator; `data.task_config` its options), or `multistep`
(tokenmind's own multi-step arithmetic). GSM8K-style problems are for evaluation only: reasoning-gym's
`gsm_symbolic` is refused (it is built from GSM8K test items).

The reference is the starting policy, frozen: a copy in memory, or, with LoRA, the same model with
its adapter bypassed (no copy). PPO's critic is a scalar head on the policy's last hidden states
(shared trunk, value loss weighted by `rl.vf_coef`); the export drops it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from torch import nn

from tokenmind.config import Overrides, load_config
from tokenmind.jsonl import atomic_open, read_jsonl
from tokenmind.train.config import ScheduleSection, TrainSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.trainer import Trainer, TrainResult

from .data import prepare_chat_data
from .rewards import RewardMix
from .rl import ADVANTAGES, AGGREGATIONS, ALGORITHMS, KL_PLACES, RLObjective
from .rollout import RolloutLoader, RolloutSettings
from .sft import LoRASection, SFTOptimSection, SFTSection, adapter_base, add_stop_ids, load_start
from .tasks import Reward, get_verifier, multistep_items, reasoning_gym_items


@dataclass
class RLSection:
    """The algorithm and how rollouts are sampled.

    algo: reinforce, rloo, ppo, grpo, dr_grpo or dapo (`rl.ALGORITHMS`); the fields below that are
        empty/None take the algorithm's choice. init_from/tokenizer: the starting policy, as for SFT.
    rewards: reward specs (`rewards.py`: `verifier:NAME`, `format:answer-line*0.2`, `rm:PATH`, ...);
        `task` stands for the task's own verifier. group_size: completions per prompt (G).
    max_new_tokens/temperature/top_p: sampling; the loss uses softmax(logits / temperature), the
        distribution sampled (top_p < 1 samples from a truncated one: slightly off-policy).
    epochs: optimizer steps per rollout (μ; > 1 makes the ratio and the clip matter).
    advantage/aggregation/clip_low/clip_high/kl_coef/kl_place/dynamic_sampling: see `rl.py`.
    overlong_cache: DAPO's soft overlong penalty over the last this many tokens (0 = off; None:
        max_new_tokens / 4 for dapo, else off). max_sampling_rounds: dynamic sampling's limit.
    gamma/lam/vf_coef/value_clip: PPO's GAE, value-loss weight and value clipping.
    eval_max_new_tokens: the held-out evaluation's length limit (0 = max_new_tokens).
    rollout_workers: 0 samples in this process on the live weights; N samples on N Ray actors that
        get the weights after every step (`ray_rollout.py`, `pip install 'tokenmind[ray]'`), each
        with rollout_cpus CPUs. async_rollouts: sample the next rollout while the learner trains on
        this one (one step stale; needs rollout_workers >= 1). ray_address: the cluster to join
        (empty: the one this process joined, else a new local instance).
    """

    algo: str = "grpo"
    init_from: str = "smollm2"
    tokenizer: str = ""
    rewards: list[str] = field(default_factory=lambda: ["task"])
    group_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    epochs: int = 1
    advantage: str = ""
    aggregation: str = ""
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float | None = None
    kl_place: str = ""
    dynamic_sampling: bool | None = None
    max_sampling_rounds: int = 3
    overlong_cache: int | None = None
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.1
    value_clip: float = 0.2
    eval_max_new_tokens: int = 0
    rollout_workers: int = 0
    rollout_cpus: int = 1
    async_rollouts: bool = False
    ray_address: str = ""

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"rl.algo={self.algo!r}: choose one of {', '.join(ALGORITHMS)}")
        a = ALGORITHMS[self.algo]
        self.advantage = self.advantage or a.advantage
        self.aggregation = self.aggregation or a.aggregation
        self.clip_low = a.clip_low if self.clip_low is None else self.clip_low
        self.clip_high = a.clip_high if self.clip_high is None else self.clip_high
        self.kl_coef = a.kl_coef if self.kl_coef is None else self.kl_coef
        self.kl_place = self.kl_place or a.kl_place
        self.dynamic_sampling = a.dynamic_sampling if self.dynamic_sampling is None else self.dynamic_sampling
        if self.overlong_cache is None:
            self.overlong_cache = self.max_new_tokens // 4 if a.overlong_penalty else 0
        for name, value, choices in (("advantage", self.advantage, ADVANTAGES),
                                     ("aggregation", self.aggregation, AGGREGATIONS),
                                     ("kl_place", self.kl_place, KL_PLACES)):
            if value not in choices:
                raise ValueError(f"rl.{name}={value!r}: choose one of {', '.join(choices)}")
        if (self.advantage == "gae") != (self.algo == "ppo"):
            raise ValueError("advantage=gae needs a value function, which only algo=ppo trains; pick another "
                             "advantage or algo=ppo")
        if self.advantage in ("rloo", "group", "group_mean") and self.group_size < 2:
            raise ValueError(f"advantage={self.advantage} compares completions of one prompt: rl.group_size must "
                             f"be >= 2, got {self.group_size}")
        if self.group_size < 1 or self.max_new_tokens < 1 or self.epochs < 1 or self.max_sampling_rounds < 1:
            raise ValueError("rl.group_size, rl.max_new_tokens, rl.epochs and rl.max_sampling_rounds must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"rl.temperature must be > 0 (RL samples), got {self.temperature}")
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError("rl.clip_low, rl.clip_high and rl.kl_coef must be >= 0")
        if not self.rewards:
            raise ValueError("rl.rewards is empty; name at least one reward, e.g. task")
        if self.rollout_workers < 0 or self.rollout_cpus < 1:
            raise ValueError("rl.rollout_workers must be >= 0 (0: sample in-process) and rl.rollout_cpus >= 1")
        if self.async_rollouts and not self.rollout_workers:
            raise ValueError("rl.async_rollouts=true overlaps sampling on Ray actors with learning here; set "
                             "rl.rollout_workers >= 1 or rl.async_rollouts=false")

    def settings(self, precision: str) -> RolloutSettings:
        return RolloutSettings(self.group_size, self.max_new_tokens, self.temperature, self.top_p, self.advantage,
                               self.kl_coef, self.kl_place, self.gamma, self.lam, self.epochs,
                               bool(self.dynamic_sampling), self.max_sampling_rounds, self.overlong_cache, precision)


@dataclass
class TaskSection:
    """The task: `task` (`gym:NAME` or `multistep`) with `task_config` (generator options), how
    many items to train on (`train_size`) and hold out (`eval_size`, made from `eval_seed`),
    `instruction`: text added to every user prompt (e.g. how to write the answer). verifier: what
    calls a completion right, for the accuracy and the `task` reward (`tasks.VERIFIERS` or
    reasoning-gym; empty: the task's own: reasoning-gym's scorer for gym tasks, which wants the bare
    answer, or multistep's step checker). batch_size:
    prompts per micro-batch (× train.grad_accum per optimizer step). seq_len: only counts FLOPs
    for the MFU column (prompt + completion tokens of a typical sequence)."""

    task: str = "gym:basic_arithmetic"
    task_config: dict[str, Any] = field(default_factory=dict)
    train_size: int = 2000
    eval_size: int = 100
    seed: int = 0
    eval_seed: int = 1_000_003
    instruction: str = ""
    verifier: str = ""
    batch_size: int = 4
    seq_len: int = 256

    def __post_init__(self) -> None:
        if self.train_size < 1 or self.eval_size < 0 or self.batch_size < 1:
            raise ValueError("data.train_size and data.batch_size must be >= 1, data.eval_size >= 0")
        if self.seed == self.eval_seed:
            raise ValueError("data.seed and data.eval_seed must differ: held-out items come from their own seed")


@dataclass
class RLOptimSection(SFTOptimSection):
    """Fine-tuning's optimizer with RL's usual lr (TRL's GRPO default is 1e-6 for 1B+ models; a
    135M model on a short budget moves with 1e-6 to 5e-6)."""

    lr: float = 2e-6


@dataclass
class RLScheduleSection(ScheduleSection):
    """A constant lr from the first step: RL runs are short and start from a trained policy."""

    name: str = "constant"
    warmup_steps: int = 0


@dataclass
class RLTrainSection(TrainSection):
    """`TrainSection` for RL: runs/rl, 50 steps, fp32, held-out accuracy every 10 steps.

    fp32, because RL compares log-probs of nearly equal models: under bf16 autocast an update of
    lr 2e-6 flips the bf16 rounding of some weights, and that noise swamps the change itself (on
    SmolLM2 after one GRPO step the per-token KL to the reference read 0.020 in bf16 and 0.0002 in
    fp32), so the KL penalty and its curve would follow rounding, not the policy."""

    out_dir: str = "runs/rl"
    steps: int = 50
    precision: str = "fp32"
    eval_every: int = 10


@dataclass
class RLConfig:
    """An RL run: `rl` (algorithm, policy, sampling), `data` (the task), `lora`, then the trainer's sections."""

    rl: RLSection = field(default_factory=RLSection)
    data: TaskSection = field(default_factory=TaskSection)
    lora: LoRASection = field(default_factory=LoRASection)
    optim: RLOptimSection = field(default_factory=RLOptimSection)
    schedule: RLScheduleSection = field(default_factory=RLScheduleSection)
    train: RLTrainSection = field(default_factory=RLTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)
        if self.train.distributed != "none":
            raise ValueError("RL runs on one process (the engine samples from the whole policy); use "
                             "--train.distributed=none")


def load_rl_config(path: str | Path | None = None, overrides: Overrides = (),
                   defaults: dict | None = None) -> RLConfig:
    """`defaults` ← YAML file ← `--section.key=value` overrides (`tokenmind.config.load_config`)."""
    return load_config(RLConfig, path, overrides, defaults)


# ---- tasks --------------------------------------------------------------------------------------


def task_items(task: str, count: int, seed: int, config: dict[str, Any]) -> tuple[list[dict], Reward]:
    """`count` items of `task` and its verifier."""
    if task.startswith("gym:"):
        return reasoning_gym_items(task[4:], count, seed, **config), get_verifier("reasoning-gym")
    if task == "multistep":
        return multistep_items(count, seed, **config), get_verifier("multistep")
    raise ValueError(f"unknown task {task!r}; use gym:NAME (a reasoning-gym generator, e.g. gym:basic_arithmetic) "
                     "or multistep")


def with_instruction(items: list[dict], instruction: str) -> list[dict]:
    """Items whose last user message ends with `instruction` (a blank line between)."""
    if not instruction:
        return items
    out = []
    for item in items:
        prompt = [dict(m) for m in item["prompt"]]
        prompt[-1]["content"] = f"{prompt[-1]['content']}\n\n{instruction}"
        out.append({**item, "prompt": prompt})
    return out


def split_tasks(data: TaskSection) -> tuple[list[dict], list[dict], Reward, int]:
    """(train items, held-out items, the verifier, train items dropped because a held-out item has
    the same prompt)."""
    train, verifier = task_items(data.task, data.train_size, data.seed, data.task_config)
    verifier = get_verifier(data.verifier) if data.verifier else verifier
    held_out = task_items(data.task, data.eval_size, data.eval_seed, data.task_config)[0] if data.eval_size else []
    seen = {json.dumps(it["prompt"], sort_keys=True) for it in held_out}
    kept = [it for it in train if json.dumps(it["prompt"], sort_keys=True) not in seen]
    if not kept:
        raise ValueError("every training item also occurs in the held-out set; raise data.train_size or use a task "
                         "with more distinct problems")
    return (with_instruction(kept, data.instruction), with_instruction(held_out, data.instruction), verifier,
            len(train) - len(kept))


# ---- the run ------------------------------------------------------------------------------------


class RLTrainer(Trainer):
    """The one `Trainer`, telling the rollout loader about every update (version = the step, so
    rollout workers get the weights and each rollout's staleness is known); the export drops PPO's
    value head (the policy alone is the product)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loader.policy_updated(self.updates)  # a resumed run's weights are the checkpoint's

    @property
    def updates(self) -> int:
        """Optimizer steps taken: the LR scheduler counts them (checkpointed, and counted also when
        `train_step` is called on its own, as benchmarks do, which leaves `step` alone)."""
        return self.scheduler.last_epoch

    def train_step(self) -> dict[str, float]:
        stats = super().train_step()
        self.loader.policy_updated(self.updates)
        return stats

    def export(self) -> Path:
        head = self.model._modules.pop("value_head", None)
        try:
            return super().export()
        finally:
            if head is not None:
                self.model.value_head = head


@dataclass
class Task:
    """A task given as data instead of `data.task`: items (`{"prompt": chat, **fields}`; the fields
    go to the rewards), held-out items, and the verifier that calls a completion right (score 1)."""

    train: list[dict]
    held_out: list[dict]
    verifier: Reward


def build_rl_trainer(cfg: RLConfig, ctx: DistContext, task: Task | None = None) -> RLTrainer:
    """The policy, its frozen reference, rewards, the rollout loader and the objective, wired into
    the trainer; `task` replaces data.task. Writes the task's statistics to out_dir/rl_data.json."""
    rl, data = cfg.rl, cfg.data
    start = load_start(SFTSection(rl.init_from, rl.tokenizer), cfg.lora)
    model, tokenizer = start.model, start.tokenizer
    end_id = _turn_end(tokenizer)
    add_stop_ids(model, {end_id})
    if task is None:
        train_items, held_out, verifier, dropped = split_tasks(data)
    else:
        train_items, held_out, verifier, dropped = task.train, task.held_out, task.verifier, 0
    rewards = RewardMix.from_specs(rl.rewards, task=verifier)
    if rl.kl_coef > 0 and cfg.train.precision == "bf16":
        warnings.warn("train.precision=bf16 with a KL penalty: bf16 rounding noise between the policy and the "
                      "reference dominates the KL (see RLTrainSection); use --train.precision=fp32 or --rl.kl_coef=0")
    reference = None
    if rl.kl_coef > 0 and not cfg.lora.rank:
        reference = copy.deepcopy(model).requires_grad_(False).eval()
    with_values = rl.algo == "ppo"
    if with_values:
        model.value_head = nn.Linear(model.cfg.hidden_size, 1)
        nn.init.zeros_(model.value_head.weight)
        nn.init.zeros_(model.value_head.bias)
    model.to(ctx.device)
    if reference is not None:
        reference.to(ctx.device)
    loader = RolloutLoader(train_items, start, rl.settings(cfg.train.precision), rewards, verifier, data.batch_size,
                           cfg.train.grad_accum, data.seed, end_id, reference, with_values)
    if rl.rollout_workers:  # sized by what the loader found (the adapter, the longest prompt)
        from .ray_rollout import RolloutActors

        loader.workers = RolloutActors(start, loader.adapter, rl.rollout_workers, rl.rollout_cpus,
                                       data.batch_size * cfg.train.grad_accum * rl.group_size, loader.max_len,
                                       rl.ray_address or None)
        loader.async_rollouts = rl.async_rollouts
    objective = RLObjective(rl.aggregation, rl.clip_low, rl.clip_high, rl.kl_coef if rl.kl_place == "loss" else 0.0,
                            rl.temperature, rl.max_new_tokens, rl.vf_coef if with_values else 0.0, rl.value_clip)
    evaluator = (lambda: loader.evaluate(held_out, rl.eval_max_new_tokens or None)) if held_out else None
    stats = {"task": data.task, "train_items": len(train_items), "held_out_items": len(held_out),
             "train_items_dropped_as_held_out": dropped, "rewards": rewards.names, "reward_weights": rewards.weights,
             "algo": rl.algo, "end_token": tokenizer.decode([end_id])}
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_open(out_dir / "rl_data.json") as handle:
        handle.write(json.dumps(stats, indent=2) + "\n")
    return RLTrainer(cfg, ctx, model, loader, objective=objective, tokenizer=tokenizer,
                     adapter_base=adapter_base(rl.init_from), evaluator=evaluator)


def _turn_end(tokenizer: Any) -> int:
    """The special token that ends an assistant turn in the tokenizer's chat template (found as SFT
    finds it, on a one-turn chat)."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ends = prepare_chat_data(tokenizer, [chat], seq_len=64).turn_end_ids
    if len(ends) != 1:
        raise ValueError(f"the chat template ends assistant turns with {sorted(ends) or 'no'} special token(s); RL "
                         "needs a chat model whose template closes each turn with exactly one (e.g. <|im_end|>)")
    return next(iter(ends))


def rl_train(cfg: RLConfig, task: Task | None = None) -> TrainResult:
    """Train (or resume) the RL run `cfg` describes (on `task` if given), then plot its report (`rl.png`)."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        trainer = build_rl_trainer(cfg, ctx, task)
        with contextlib.closing(trainer.loader):  # rollout workers stop with the run
            result = trainer.train()
    plot_rl(result.metrics_path, Path(cfg.train.out_dir) / "rl.png")
    return result


# ---- the report ---------------------------------------------------------------------------------

PANELS = (("reward", "mean reward (rollouts)"), ("accuracy", "accuracy"), ("kl", "KL to reference"),
          ("entropy", "policy entropy (nats/token)"), ("completion_length", "completion tokens"),
          ("clip_fraction", "clip fraction"), ("time", "seconds per step"), ("rollout_tokens_per_s", "rollout tok/s"))


def plot_rl(runs: str | Path | dict[str, str | Path], png_path: str | Path) -> Path:
    """The RL curves as one PNG: reward, accuracy, KL, entropy, length, clip fraction, time per step
    and rollout speed. `runs` is one run's metrics JSONL (accuracy of the training rollouts and the
    held-out evaluation; the rollout/learning time split), or {label: metrics JSONL} to overlay runs
    side by side (held-out accuracy, total seconds per step)."""
    single = not isinstance(runs, dict)
    records = {"": read_jsonl(runs, missing_ok=True)} if single else {
        label: read_jsonl(path, missing_ok=True) for label, path in runs.items()}
    figure = Figure(figsize=(14, 7), layout="tight")
    for k, (key, title) in enumerate(PANELS):
        axes = figure.add_subplot(2, 4, k + 1)
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        for label, run in records.items():
            steps = [r for r in run if "loss" in r]
            evals = [(r["step"], r["eval_accuracy"]) for r in run if "eval_accuracy" in r]
            if single and key == "time":
                axes.plot([r["step"] for r in steps], [r.get("rollout_s", 0.0) for r in steps], label="rollout")
                axes.plot([r["step"] for r in steps], [r["step_s"] - r.get("rollout_s", 0.0) - r.get("prepare_s", 0.0)
                                                       for r in steps], label="learning")
            elif not single and key == "accuracy":
                if evals:
                    axes.plot(*zip(*evals), "o-", linewidth=1, markersize=3, label=label)
            else:
                name = "step_s" if key == "time" else key
                points = [(r["step"], r[name]) for r in steps if name in r]
                if points:
                    axes.plot(*zip(*points), linewidth=1, label=label or "train rollouts")
                if single and key == "accuracy" and evals:
                    axes.plot(*zip(*evals), "o-", label="held out (greedy)")
        if key == "accuracy" and not single:
            axes.set_title("held-out accuracy (greedy)", fontsize=10)
        if axes.lines and (not single or key in ("accuracy", "time")):
            axes.legend(fontsize=8)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    return png_path


def rl_summary(run_dir: str | Path) -> dict[str, Any]:
    """One finished (or running) run's headline numbers from its metrics JSONL: held-out accuracy at
    the start, the end and its best, training minutes (loading the model not counted), seconds per
    step and the share spent in rollouts, and the last five steps' mean reward and KL."""
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    if not steps or not evals:
        raise ValueError(f"{run_dir}: no RL steps or held-out evaluations in metrics.jsonl; is it a tokenmind rl run?")
    info = json.loads((run_dir / "rl_data.json").read_text()) if (run_dir / "rl_data.json").exists() else {}
    tail = steps[-5:]
    return {"run": run_dir.name, "algo": info.get("algo", "?"), "steps": steps[-1]["step"],
            "minutes": round(max(r.get("elapsed", 0.0) for r in records) / 60, 1),
            "held_out_start": evals[0]["eval_accuracy"], "held_out_end": evals[-1]["eval_accuracy"],
            "held_out_best": max(r["eval_accuracy"] for r in evals),
            "step_s": round(sum(r["step_s"] for r in steps) / len(steps), 1),
            "rollout_share": round(sum(r.get("rollout_s", 0.0) for r in steps) / sum(r["step_s"] for r in steps), 2),
            "reward_last5": round(sum(r["reward"] for r in tail) / len(tail), 3),
            "kl_last5": round(sum(r.get("kl", 0.0) for r in tail) / len(tail), 4)}


def compare_runs(run_dirs: list[str | Path], png_path: str | Path) -> list[dict[str, Any]]:
    """Side by side: the runs' curves overlaid in `png_path`, and each run's `rl_summary`."""
    summaries = [rl_summary(d) for d in run_dirs]
    algos = [s["algo"] for s in summaries]
    labels = [algo if algos.count(algo) == 1 else str(d) for algo, d in zip(algos, run_dirs)]
    plot_rl({label: Path(d) / "metrics.jsonl" for label, d in zip(labels, run_dirs)}, png_path)
    return summaries
