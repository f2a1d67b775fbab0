"""RL rollouts on Ray actors: steps/s of the in-process loop, synchronous rollouts on actors, and async
rollouts (one step stale) on actors, for the same GRPO run on SmolLM2-135M-Instruct on CPU.

The settings are `bench_rl.py`'s (its `tokenmind_trainer` builds every run; `--prompts` × `--group`
completions of at most `--max-new` tokens, fp32, β = 0, one update per rollout; the reward is
`digit_share`) and its `timed_steps`
times `--warmup` untimed then `--steps` timed optimizer steps of each mode, one mode after the other in
this process, on one local Ray instance (`--num-cpus`, started once; its start is not timed):

* in_process: `rl.rollout_workers=0`, the paged engine on the live weights in this process;
* sync: `rl.rollout_workers=N`, generation on N actors, the learner waits for it;
* async: the same actors, with `rl.async_rollouts=true`: the next rollout is sampled while the
  learner takes its step, so a step costs about max(rollout, learning) instead of their sum.

The learner runs `--threads` torch threads, each actor `rl.rollout_cpus=1`. The synchronous mode
samples the same tokens as the in-process one (same seeds, same weights), so their losses and
gradient norms must be equal: `sync_equals_in_process` says whether they were. Per mode: seconds_per_step and steps_per_s; rollout_s is
what the learner waited for its rollout (and scored it), so `rollout_tokens_per_s` (tokens /
rollout_s) grows when the wait shrinks, while `engine_tokens_per_s` is the engine's own speed;
weights_push_s is the learner's share of a weight push. Prints one JSON object.

    python benchmarks/bench_rl_ray.py [--prompts 2] [--group 4] [--max-new 32] [--steps 3] [--warmup 1]
                                      [--rollout-workers 1] [--num-cpus 2] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info
from bench_rl import _mean, _summary, step_arguments, timed_steps, tokenmind_trainer


def digit_share(prompt, completion: str, **meta) -> float:
    """A dense reward (the share of digits in the completion), so every group has different rewards,
    every step a loss and a gradient, and equal losses mean equal samples (the task's verifier scores
    nearly every 32-token completion 0)."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def run_mode(args: argparse.Namespace, *overrides: str) -> dict:
    trainer, setup_s = tokenmind_trainer(args, *overrides, reward=digit_share)
    try:
        steps = timed_steps(trainer, args)
    finally:
        trainer.loader.close()
    summary = _summary(steps, setup_s, {"overrides": list(overrides), "losses_exact": [s["loss"] for s in steps],
                                        "grad_norms": [s["grad_norm"] for s in steps]})
    summary["steps_per_s"] = round(1 / summary["seconds_per_step"], 4)
    summary["staleness"] = [s["staleness"] for s in steps]
    summary["weights_push_s"] = _mean([s["weights_push_s"] for s in steps])
    summary["engine_tokens_per_s"] = _mean([s["engine_tokens_per_s"] for s in steps])
    return summary


def run(args: argparse.Namespace) -> dict:
    import ray
    import torch

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    tick = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - tick
    workers = f"--rl.rollout_workers={args.rollout_workers}"
    try:
        modes = {"in_process": run_mode(args), "sync": run_mode(args, workers),
                 "async": run_mode(args, workers, "--rl.async_rollouts=true")}
    finally:
        ray.shutdown()
    sync, overlapped = modes["sync"], modes["async"]
    return {
        "benchmark": "rl_rollouts_on_ray_actors", "model": "SmolLM2-135M-Instruct", "algo": "grpo",
        "prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.max_new,
        "timed_steps": args.steps, "warmup_steps": args.warmup, "rollout_workers": args.rollout_workers,
        "learner_threads": args.threads, "ray_num_cpus": args.num_cpus, "ray_start_s": round(ray_start_s, 2),
        **modes,
        "sync_equals_in_process": all(sync[k] == modes["in_process"][k] for k in ("losses_exact", "grad_norms")),
        "async_speedup_over_sync": round(sync["seconds_per_step"] / overlapped["seconds_per_step"], 3),
        "mean_staleness": {name: _mean(m["staleness"]) for name, m in modes.items()},
        "machine": machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in os.getloadavg()]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    step_arguments(p, prompts=2, group=4, max_new=32, steps=3)  # the actors start in the first, untimed step
    p.add_argument("--rollout-workers", type=int, default=1, help="Ray actors generating in the sync/async modes")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--threads", type=int, default=1, help="the learner's torch threads")
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = run(args)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
