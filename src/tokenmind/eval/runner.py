"""`run_eval`: one model, several tasks, one report — what `tokenmind eval` and the speedrun's report card call.

    run_eval(EvalConfig(model="smollm2", tasks=["arc_easy", "hellaswag"], limit=200))

Tasks read the JSONL files `tokenmind data fetch eval` writes to `data/eval/` (see
`tokenmind.data.sources` for their schemas): multiple choice by log-likelihood
(`multiple_choice.py`), GSM8K by generation (`generative.py`), HumanEval by running tests
(`code.py`), and loss / perplexity / bits per byte on a token-shard val split (`val_loss`) or a
text file (`perplexity`) (`perplexity.py`), and in-context copying on random token runs (`induction`,
`induction.py`). Every data file is opened before the model is loaded,
so a missing one fails in a second, not after a minute of loading.

`limit` scores a seeded random sample of that many items, not the first ones: the files are
ordered (MMLU by subject), so a prefix would measure one subject. The same seed and limit give
the same items on every run and for every model.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..progress import Bars
from ..config import Overrides, build_config, read_config
from ..model.load import Pretrained, load_model, quantization_setting
from .chat_quality import evaluate_chat, load_baseline
from .code import evaluate_humaneval
from .generative import default_fewshot, evaluate_gsm8k
from .induction import evaluate_induction
from .multiple_choice import FORMATS, evaluate_mc, num_choices
from .perplexity import evaluate_lm, shard_val_loss

# task → the file `tokenmind data fetch eval` writes for it (without .jsonl)
DATA_FILES = {"arc_easy": "arc-easy", "arc_challenge": "arc-challenge", "hellaswag": "hellaswag", "piqa": "piqa",
              "openbookqa": "openbookqa", "winogrande": "winogrande", "mmlu": "mmlu", "mmlu_mc": "mmlu",
              "gsm8k": "gsm8k", "humaneval": "humaneval"}  # fmt: skip
TASKS = [*DATA_FILES, "val_loss", "perplexity", "chat", "induction"]
# the headline metric of each task (OLMES's choice of acc vs acc_norm for the cloze tasks)
PRIMARY = {"arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm", "piqa": "acc_norm",
           "openbookqa": "acc_norm", "winogrande": "acc", "mmlu": "acc_norm", "mmlu_mc": "acc",
           "gsm8k": "exact_match", "humaneval": "pass@1", "val_loss": "loss",
           "perplexity": "bits_per_byte", "chat": "on_topic", "induction": "induction_gain"}  # fmt: skip
FETCH_HINT = "fetch the evaluation sets with `tokenmind data fetch eval` (writes data/eval/*.jsonl)"


@dataclass
class EvalConfig:
    """What to evaluate and how. Fields left at None take each task's default."""

    model: str = "smollm2"  # an HF directory, a .gguf file, a training run's `final` dir, or an alias
    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "hellaswag"])  # or "a,b,c"
    data_dir: str = "data/eval"  # the folder of <task>.jsonl files (or its parent)
    limit: int | None = None  # score a seeded sample of at most this many items per task
    batch_size: int = 32  # sequences per forward pass (choices, or generations running at once)
    seed: int = 0  # picks the `limit` sample and the few-shot examples
    dtype: str = "float32"  # weights: float32, bfloat16 (AMX/tensor cores: faster, slightly noisier)
    quantize: str | None = None  # None, "int8", "int4" or "auto": weight-only quantized linear layers (`load_model`)
    num_fewshot: int | None = None  # None: 0 for multiple choice; GSM8K 0 for chat models, 8 for base
    max_tokens: int = 256  # generation budget per answer (gsm8k, humaneval)
    shards_dir: str | None = None  # val_loss: a token-shard folder with a val split
    val_batches: int = 20  # val_loss: batches of `batch_size` rows of `seq_len` tokens
    text_file: str | None = None  # perplexity: a UTF-8 text file
    seq_len: int = 1024  # val_loss and perplexity window
    stride: int | None = None  # perplexity: new tokens per window (None: seq_len // 2)
    out: str | None = None  # write the results as JSON here
    judge: str | None = "smollm2"  # chat: the model that scores fluency and preference (None: on-topic only)
    chat_baseline: str | None = None  # chat: answers to prefer against (a name such as cpu_v1, or a JSON path)
    log_samples: bool = False  # keep per-item predictions in the results
    progress: bool = True  # progress bars on stderr

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):  # "a,b" (also as one list item, from a YAML file or override)
            self.tasks = [self.tasks]
        self.tasks = [t.strip() for item in self.tasks for t in item.split(",") if t.strip()]
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"unknown or no tasks {unknown}; choose from {', '.join(TASKS)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (or None for every item), got {self.limit}")
        self.quantize = quantization_setting(self.quantize)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        if "val_loss" in self.tasks and not self.shards_dir:
            raise ValueError("the val_loss task needs shards_dir: a token-shard folder with a val split")
        if "perplexity" in self.tasks and not self.text_file:
            raise ValueError("the perplexity task needs text_file: a UTF-8 text file to score")


def load_eval_config(path: str | Path | None = None, overrides: Overrides = ()) -> EvalConfig:
    """What `tokenmind eval` runs: EvalConfig's defaults ← the YAML file at `path` ← overrides (flags,
    as field names). The model must be named by one of them: nothing is evaluated by default."""
    values = read_config(EvalConfig, path, overrides)
    if "model" not in values:
        raise ValueError("no model to evaluate: pass --model MODEL or set `model:` in the YAML config")
    return build_config(EvalConfig, values)


def load_items(task: str, data_dir: str | Path) -> list[dict[str, Any]]:
    """The items of a task's JSONL file in `data_dir` (or `data_dir/eval`); a clear error if absent."""
    name = f"{DATA_FILES[task]}.jsonl"
    for path in (Path(data_dir) / name, Path(data_dir) / "eval" / name):
        if path.is_file():
            with open(path, encoding="utf-8") as fh:
                return [json.loads(line) for line in fh if line.strip()]
    raise FileNotFoundError(f"no {name} in {data_dir}: the {task} task has no data; {FETCH_HINT}, or point "
                            "data_dir (--data-dir) at the folder holding it")


def sample(items: list[dict[str, Any]], limit: int | None, seed: int) -> list[dict[str, Any]]:
    """At most `limit` items, a seeded random sample kept in file order."""
    if limit is None or limit >= len(items):
        return items
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), limit))]


def run_eval(cfg: EvalConfig, pretrained: Pretrained | None = None) -> dict[str, Any]:
    """Evaluate `pretrained` (default: load `cfg.model`) on `cfg.tasks`; print a table, write
    `cfg.out`, and return `{"model", "config", "tasks": {task: metrics + seconds}, "seconds"}`."""
    data = {task: load_items(task, cfg.data_dir) for task in cfg.tasks if task in DATA_FILES}
    if "perplexity" in cfg.tasks and not Path(cfg.text_file).is_file():
        raise FileNotFoundError(f"perplexity text_file {cfg.text_file} does not exist")
    start = time.perf_counter()
    if pretrained is None:
        pretrained = load_model(cfg.model, dtype=cfg.dtype, quantize=cfg.quantize)
        if cfg.progress:
            print(f"loaded {pretrained.name} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    model, tokenizer = pretrained.model.eval(), pretrained.tokenizer
    results: dict[str, Any] = {"model": pretrained.name, "path": str(pretrained.path), "config": asdict(cfg),
                               "tasks": {}}
    with Bars(cfg.progress) as bars:
        for task in cfg.tasks:
            t0 = time.perf_counter()
            metrics = _run_task(task, cfg, model, tokenizer, data.get(task, []), bars)
            if not cfg.log_samples:
                metrics.pop("predictions", None)
            results["tasks"][task] = {**metrics, "primary": PRIMARY[task], "seconds": time.perf_counter() - t0}
    results["seconds"] = time.perf_counter() - start
    print_table(results)
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    return results


def _run_task(task: str, cfg: EvalConfig, model, tokenizer, items: list[dict[str, Any]], bars: Bars) -> dict:
    if task in FORMATS:
        chosen = sample(items, cfg.limit, cfg.seed)
        return evaluate_mc(model, tokenizer, task, chosen, pool=items, num_fewshot=cfg.num_fewshot or 0,
                           seed=cfg.seed, batch_size=cfg.batch_size, progress=bars.add(task, num_choices(chosen)))
    if task == "gsm8k":
        k = default_fewshot(tokenizer) if cfg.num_fewshot is None else cfg.num_fewshot
        chosen = sample(items[k:], cfg.limit, cfg.seed)  # the first k problems are the worked examples
        return evaluate_gsm8k(model, tokenizer, chosen, items[:k], max_tokens=cfg.max_tokens,
                              batch_size=cfg.batch_size, progress=bars.add(task, len(chosen)))
    if task == "humaneval":
        chosen = sample(items, cfg.limit, cfg.seed)
        return evaluate_humaneval(model, tokenizer, chosen, max_tokens=cfg.max_tokens, batch_size=cfg.batch_size,
                                  progress=bars.add(task, 2 * len(chosen)))
    if task == "chat":
        judge = load_model(cfg.judge) if cfg.judge else None
        baseline = load_baseline(cfg.chat_baseline)["answers"] if cfg.chat_baseline else None
        return evaluate_chat(model, tokenizer, judge and judge.model, judge and judge.tokenizer, baseline)
    if task == "induction":
        vocab = min(model.cfg.vocab_size, tokenizer.vocab_size)  # ids past the tokenizer's were never trained
        return evaluate_induction(model, vocab, batch_size=cfg.batch_size, seed=cfg.seed)
    if task == "val_loss":
        return shard_val_loss(model, cfg.shards_dir, cfg.val_batches, cfg.seq_len, cfg.batch_size, tokenizer,
                              progress=bars.add(task, cfg.val_batches))
    text = Path(cfg.text_file).read_text(encoding="utf-8")
    return evaluate_lm(model, text, tokenizer, seq_len=cfg.seq_len, stride=cfg.stride,
                       batch_size=cfg.batch_size, progress=bars.add(task, None))


def print_table(results: dict[str, Any]) -> None:
    """The results as a table on stdout: one row per metric, the primary one first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenmind eval: {results['model']}")
    for column in ("task", "n", "metric", "value", "seconds"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, metrics in results["tasks"].items():
        names = [metrics["primary"]] + [k for k in ("acc", "acc_norm", "acc_per_token", "loss", "perplexity",
                                                    "bits_per_byte", "fluency_ratio", "mc_letter_starts",
                                                    "first_copy_loss", "second_copy_loss")
                                        if k in metrics and k != metrics["primary"]]
        pref = metrics.get("preference") or {}
        extra = {f"judge_{k}": pref[k] for k in ("win_rate", "corrected_win_rate", "position_bias") if k in pref}
        metrics = {**metrics, **extra}
        names += list(extra)
        n = metrics.get("n", metrics.get("tokens"))
        for i, name in enumerate(names):
            value = metrics[name]
            shown = "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
            if name == "acc" and "acc_stderr" in metrics:
                shown += f" ± {metrics['acc_stderr']:.4f}"
            table.add_row(task if i == 0 else "", str(n) if i == 0 else "", name, shown,
                          f"{metrics['seconds']:.1f}" if i == 0 else "")
    Console().print(table)
