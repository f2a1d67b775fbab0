"""One GRPO optimizer step on SmolLM2-135M-Instruct: tokenmind's RL trainer vs TRL's GRPOTrainer, on CPU.

Both sides take the same task items (reasoning-gym's `chain_sum` with two terms of 1–2 digits, the task of
`configs/rl_smollm2.yaml`, which SmolLM2 partly solves, so the rewards differ within a group and the update
is not empty; chat prompts rendered with the model's chat template), the same reward (the reply's final
number, `tasks.numeric_reward`) and
the same settings: `--prompts` prompts × `--group` completions each, at most `--max-new` new tokens,
temperature 1 (no top-p / top-k), fp32 weights and compute, GRPO's loss (per-completion token mean;
TRL loss_type="grpo"), group-scaled advantages, ε = 0.2, β = 0 (no reference model on either side),
one optimizer step per rollout, AdamW lr 1e-6, betas (0.9, 0.95), no weight decay, gradient clip 1.

* tokenmind: `build_rl_trainer` + `Trainer.train_step`: completions sampled by the paged engine on the
  live policy (each prompt's G completions share its KV blocks), then the packed learner step. The
  loader's own metrics split the step: rollout_s (sampling + scoring), prepare_s (packing; no extra
  forwards at β = 0 and one update per rollout), and the rest is the learner.
* TRL: `GRPOTrainer(...).train()` with `max_steps = warmup + steps`, generating with `transformers`
  `generate` (padded batch of prompts × G rows, KV cache per row). Step time is measured by a callback
  (`on_step_begin` → `on_step_end`); generation and the whole generate-and-score phase are timed by
  wrapping `_generate` / `_generate_and_score_completions`.

The first `--warmup` steps of each side are not timed. Rollout tokens/s = completion tokens (the end
token included when a completion stopped) / generation seconds. The samples differ (each side has its
own sampler), so completion lengths differ: compare tokens/s for the rollout and look at the mean
completion length next to the per-step times. Each side runs in its own process (own peak memory,
no shared thread pools) and reports its mean reward and gradient norm (the update is real work) and
its process CPU seconds per step. On a machine shared with other jobs, `--threads 1` for both sides:
two OpenMP threads on two oversubscribed cores wait at every barrier for a descheduled thread (the
engine's rollout measured 4–10× slower than with one thread at load 4–6), and one-thread CPU
seconds hardly move with the load. Prints one JSON object.

    python benchmarks/bench_rl.py [--prompts 4] [--group 8] [--max-new 64] [--steps 2] [--warmup 1]
                                  [--threads N] [--out bench_rl.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import child_env, machine_info, side_or_run

LR = 1e-6
BETAS = (0.9, 0.95)
CLIP_EPS = 0.2
BETA = 0.0
SEED = 0


TASK = "gym:chain_sum"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
VERIFIER = "numeric"


def task_items(count: int) -> list[dict]:
    """The prompts and answers (the only columns the reward reads; TRL's dataset gets no others)."""
    from tokenmind.posttrain.rl_train import task_items as make_items

    return [{"prompt": it["prompt"], "answer": it["answer"]} for it in make_items(TASK, count, SEED, TASK_CONFIG)[0]]


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else float("nan")


# ---- tokenmind -----------------------------------------------------------------------------------


def tokenmind_trainer(args: argparse.Namespace, *overrides: str, reward: Any = None) -> tuple[Any, float]:
    """(tokenmind's GRPO trainer with the settings above, seconds to build it); `overrides` win;
    `reward` replaces the task's verifier."""
    from tokenmind.posttrain.rl_train import Task, build_rl_trainer, load_rl_config
    from tokenmind.posttrain.tasks import get_verifier
    from tokenmind.train.distributed import init_distributed

    items = task_items(args.items)
    cfg = load_rl_config(None, [
        "--rl.algo=grpo", "--rl.init_from=smollm2", f"--rl.group_size={args.group}",
        f"--rl.max_new_tokens={args.max_new}", "--rl.temperature=1.0", "--rl.top_p=1.0", f"--rl.kl_coef={BETA}",
        f"--rl.clip_low={CLIP_EPS}", f"--rl.clip_high={CLIP_EPS}", "--rl.epochs=1", "--rl.dynamic_sampling=false",
        f"--data.batch_size={args.prompts}", f"--data.seed={SEED}", f"--optim.lr={LR}",
        f"--optim.betas=[{BETAS[0]},{BETAS[1]}]", "--optim.weight_decay=0", "--optim.grad_clip=1.0",
        "--train.precision=fp32", "--train.grad_accum=1", "--train.device=cpu", "--train.steps=1000",
        "--train.eval_every=0", "--train.checkpoint_every=0", f"--train.out_dir={tempfile.mkdtemp()}",
        *overrides])
    started = time.perf_counter()
    task = Task(items, [], reward or get_verifier(VERIFIER))
    trainer = build_rl_trainer(cfg, init_distributed("none", "cpu"), task)
    return trainer, time.perf_counter() - started


def timed_steps(trainer: Any, args: argparse.Namespace) -> list[dict]:
    """`args.warmup` untimed optimizer steps, then `args.steps` timed ones: each step's time, the
    loader's rollout_s / prepare_s split, completion tokens, reward, loss, gradient norm, the rollout's staleness, the
    engine's own tokens/s (on the actors, if there) and the last weight push's seconds."""
    steps = []
    for k in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        stats = trainer.train_step()
        step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        rollout = trainer.loader.pop_metrics()
        if k >= args.warmup:
            steps.append({"step_s": step_s, "cpu_s": cpu_s, "rollout_s": rollout["rollout_s"],
                          "prepare_s": rollout["prepare_s"],
                          "tokens": rollout["rollout_tokens"], "completion_length": rollout["completion_length"],
                          "reward": rollout["reward"], "loss": stats["loss"], "grad_norm": stats["grad_norm"],
                          "staleness": rollout["staleness"],
                          "engine_tokens_per_s": rollout["rollout_tokens_per_s"],
                          "weights_push_s": rollout.get("weights_push_s", 0.0)})
    return steps


def _tokenmind(args: argparse.Namespace) -> dict:
    trainer, setup_s = tokenmind_trainer(args)
    return _summary(timed_steps(trainer, args), setup_s,
                    {"engine": "tokenmind paged engine (same process, live weights)", "torch_threads": _threads()})


# ---- TRL -----------------------------------------------------------------------------------------


def _trl(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tokenmind.posttrain.tasks import get_verifier

    items = task_items(args.items)
    verifier = get_verifier(VERIFIER)
    meta_keys = [k for k in items[0] if k != "prompt"]

    def task_reward(prompts, completions, **columns):
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(float(verifier(prompt, text.strip(), **{k: columns[k][i] for k in meta_keys})))
        return out

    timings: dict[str, list[float]] = {"step": [], "cpu": [], "generate": [], "generate_and_score": [], "tokens": [],
                                       "completions": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            timings["step"].append(time.perf_counter())
            timings["cpu"].append(time.process_time())

        def on_step_end(self, *a, **kw):
            timings["step"][-1] = time.perf_counter() - timings["step"][-1]
            timings["cpu"][-1] = time.process_time() - timings["cpu"][-1]

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            timings["generate"].append(time.perf_counter() - t0)
            timings["tokens"].append(float(sum(len(c) for c in out[1])))
            timings["completions"].append(float(len(out[1])))
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timings["generate_and_score"].append(time.perf_counter() - t0)
            return out

    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf_dir)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", logging_steps=1, seed=SEED, max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_new, temperature=1.0, top_p=1.0, top_k=0,
        loss_type="grpo", scale_rewards="group", beta=BETA, epsilon=CLIP_EPS, num_iterations=1,
        learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0)
    dataset = datasets.Dataset.from_list(items)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=task_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    setup_s = time.perf_counter() - started
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    grad_norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    steps = []
    for k in range(args.warmup, args.warmup + args.steps):
        gen, gen_score = timings["generate"][k], timings["generate_and_score"][k]
        steps.append({"step_s": timings["step"][k], "cpu_s": timings["cpu"][k], "rollout_s": gen,
                      "prepare_s": gen_score - gen,
                      "tokens": timings["tokens"][k],
                      "completion_length": timings["tokens"][k] / timings["completions"][k],
                      "reward": rewards[k] if k < len(rewards) else float("nan"),
                      "loss": losses[k] if k < len(losses) else float("nan"),
                      "grad_norm": grad_norms[k] if k < len(grad_norms) else float("nan")})
    return _summary(steps, setup_s, {"engine": f"transformers {transformers.__version__} generate (padded batch)",
                                     "torch_threads": _threads()})


# ---- shared --------------------------------------------------------------------------------------


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _summary(steps: list[dict], setup_s: float, extra: dict) -> dict:
    """Per-step means over the timed steps; learner_s = step − rollout − prepare."""
    step_s = [s["step_s"] for s in steps]
    rollout_s = [s["rollout_s"] for s in steps]
    prepare_s = [s["prepare_s"] for s in steps]
    learner_s = [s["step_s"] - s["rollout_s"] - s["prepare_s"] for s in steps]
    tokens = sum(s["tokens"] for s in steps)
    return {
        "seconds_per_step": _mean(step_s), "cpu_s_per_step": _mean([s["cpu_s"] for s in steps]),
        "rollout_s": _mean(rollout_s), "prepare_s": _mean(prepare_s),
        "learner_s": _mean(learner_s), "rollout_tokens_per_s": round(tokens / sum(rollout_s), 2),
        "completion_length": _mean([s["completion_length"] for s in steps]),
        "reward": _mean([s["reward"] for s in steps]), "losses": [round(s["loss"], 5) for s in steps],
        "grad_norms": [round(float(s["grad_norm"]), 5) for s in steps],
        "step_s_each": [round(x, 3) for x in step_s], "setup_s": round(setup_s, 2), "peak_rss_mib": _peak_rss_mib(),
        **extra,
    }


def _child(args: argparse.Namespace, side: str, **extra) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-new", str(args.max_new), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--items", str(args.items)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = child_env(peer=side != "tokenmind", **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    if out.returncode:
        raise RuntimeError(f"{side} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same_prompts(hf_dir: Path, items: list[dict]) -> bool:
    """Whether both sides tokenize the chat prompts identically (tokenmind's tokenizer and chat
    template vs the HF directory's, as TRL renders them)."""
    import transformers

    from tokenmind.model.load import load_tokenizer
    from tokenmind.posttrain.rollout import prompt_ids

    ours = load_tokenizer("smollm2")
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for item in items:
        hf = theirs.apply_chat_template(item["prompt"], add_generation_prompt=True, tokenize=True)
        hf = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
        if list(hf) != list(prompt_ids(ours, item["prompt"])):
            return False
    return True


def _lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    keep = ("Model name", "CPU family", "Model", "Core(s) per socket", "Thread(s) per core", "L3 cache")
    return {k: fields[k].strip() for k in keep if k in fields}


def run(args: argparse.Namespace) -> dict:
    import torch

    from tokenmind.model.load import load_model, save_model

    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp())
    hf_dir = save_model(load_model("smollm2"), root / "smollm2-hf")
    same_prompts = _same_prompts(hf_dir, task_items(args.items))
    ours = _child(args, "tokenmind")
    trl = _child(args, "trl", hf_dir=hf_dir)
    load_end = os.getloadavg()
    return {
        "benchmark": "rl_grpo_step", "model": "SmolLM2-135M-Instruct", "task": f"{TASK} {TASK_CONFIG}",
        "verifier": VERIFIER,
        "prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.max_new,
        "temperature": 1.0, "precision": "fp32", "beta": BETA, "clip_eps": CLIP_EPS, "loss": "grpo (sequence mean)",
        "timed_steps": args.steps, "warmup_steps": args.warmup, "same_prompt_token_ids": same_prompts,
        "definitions": {
            "rollout_s": "tokenmind: the loader's rollout_s (engine sampling + reward scoring); TRL: _generate",
            "prepare_s": "tokenmind: packing; TRL: the rest of _generate_and_score_completions (rewards, "
                         "padding, advantages)",
            "learner_s": "seconds_per_step - rollout_s - prepare_s (forward, backward, optimizer step)",
            "cpu_s_per_step": "the side's process CPU seconds (user + system) per step: with --threads 1, the work "
                              "itself, much less moved than wall time by other jobs on a shared machine",
            "rollout_tokens_per_s": "completion tokens / rollout_s over the timed steps"},
        "tokenmind": ours, "trl": trl,
        "speedup_step": round(trl["seconds_per_step"] / ours["seconds_per_step"], 3),
        "speedup_cpu_s": round(trl["cpu_s_per_step"] / ours["cpu_s_per_step"], 3),
        "speedup_rollout_tokens_per_s": round(ours["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"], 3),
        "speedup_learner": round(trl["learner_s"] / ours["learner_s"], 3),
        "machine": machine_info(lscpu=_lscpu(), torch_threads_children=ours["torch_threads"],
                                loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in load_end], torch_version=torch.__version__),
    }


def step_arguments(p: argparse.ArgumentParser, prompts: int, group: int, max_new: int, steps: int) -> None:
    """The options `tokenmind_trainer` and `timed_steps` read, with a benchmark's defaults."""
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    p.add_argument("--group", type=int, default=group, help="completions per prompt (G)")
    p.add_argument("--max-new", type=int, default=max_new, help="max new tokens per completion")
    p.add_argument("--steps", type=int, default=steps, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--items", type=int, default=256, help="task items in the pool prompts are drawn from")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    step_arguments(p, prompts=4, group=8, max_new=64, steps=2)
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both sides (0: torch's default)")
    p.add_argument("--out")
    for hidden in ("--side", "--hf-dir"):  # a child process's
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return side_or_run(args, lambda a: _tokenmind(a) if a.side == "tokenmind" else _trl(a), run)


if __name__ == "__main__":
    main()
