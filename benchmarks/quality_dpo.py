"""Does DPO on verifier-built pairs make SmolLM2-135M better at the task? Before/after, with standard errors.

Pairs: `posttrain.pairs.multistep_pairs`, a correct step-by-step arithmetic solution (chosen) against
one with a wrong step carried to a wrong answer (rejected); training, held-out and task problems come
from different seeds. Measured before and after DPO (LoRA rank 16 on every projection):

* held-out preference accuracy: the share of held-out pairs whose chosen solution the model gives
  a higher log-probability than the rejected one (for the DPO model this is its implicit-reward
  accuracy up to the reference's own preference, which is also reported);
* task accuracy: greedy answers to held-out problems (the same prompt format), scored by
  `numeric_reward` (final answer right) and `multistep_reward` = 1 (every step right).

    python benchmarks/quality_dpo.py [--train 480] [--heldout 200] [--tasks 100] [--steps 60] [--out quality_dpo.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
from _common import emit, machine_info


def stderr(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / n)


@torch.no_grad()
def preference_accuracy(model, pairs_file: Path, seq_len: int) -> tuple[float, int]:
    """Share of pairs whose chosen completion gets the higher summed log-prob."""
    from tokenmind.data.loader import LoaderConfig
    from tokenmind.posttrain.preference import sequence_logps
    from tokenmind.posttrain.preference_data import UnitLoader, prepare_preferences, read_preferences

    kind, records = read_preferences([pairs_file])
    units = prepare_preferences(model.tokenizer, kind, records, seq_len // 2).train
    loader = UnitLoader(units, LoaderConfig(batch_size=4, seq_len=seq_len, shuffle=False))
    wins = 0
    for begin in range(0, len(loader.rows), 4):
        batch = loader.batch_for_rows(range(begin, min(begin + 4, len(loader.rows))))
        logps = sequence_logps(model.model.eval(), batch, "bf16")
        wins += int((logps[batch.members[:, 0]] > logps[batch.members[:, 1]]).sum())
    return wins / len(units), len(units)


def task_accuracy(model, items: list[dict]) -> dict:
    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.posttrain.tasks import multistep_reward, numeric_reward

    llm = LLM(model, max_num_seqs=len(items))
    ids = [model.tokenizer.apply_chat_template(it["prompt"], add_generation_prompt=True) for it in items]
    outs = llm.generate(ids, SamplingParams(max_tokens=160, temperature=0.0), progress=False)
    texts = [o.outputs[0].text for o in outs]
    answer = sum(numeric_reward(it["prompt"], t, answer=it["answer"]) for it, t in zip(items, texts)) / len(items)
    steps = sum(multistep_reward(it["prompt"], t, expression=it["expression"]) == 1.0
                for it, t in zip(items, texts)) / len(items)
    return {"answer_accuracy": answer, "answer_stderr": stderr(answer, len(items)), "all_steps_right": steps,
            "all_steps_stderr": stderr(steps, len(items)), "n": len(items), "example": texts[0][:300]}


def run(args: argparse.Namespace) -> dict:
    from tokenmind.jsonl import write_jsonl
    from tokenmind.model.load import load_model
    from tokenmind.posttrain.pairs import multistep_pairs
    from tokenmind.posttrain.preference import load_preference_config, preference_train
    from tokenmind.posttrain.tasks import multistep_items

    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp())
    strip = ("prompt", "chosen", "rejected")
    train_file, heldout_file = root / "train.jsonl", root / "heldout.jsonl"
    write_jsonl(train_file, [{k: r[k] for k in strip} for r in multistep_pairs(args.train, seed=0)])
    write_jsonl(heldout_file, [{k: r[k] for k in strip} for r in multistep_pairs(args.heldout, seed=1)])
    items = multistep_items(args.tasks, seed=2)

    base = load_model("smollm2", dtype="bfloat16")
    before = {"preference_accuracy": preference_accuracy(base, heldout_file, args.seq)[0],
              **task_accuracy(base, items)}
    del base

    cfg = load_preference_config(None, [
        "--preference.init_from=smollm2", f"--data.files={train_file}", "--data.batch_size=2",
        f"--data.seq_len={args.seq}", "--data.val_fraction=0.1", "--lora.rank=16", "--lora.alpha=32",
        "--lora.dropout=0", f"--optim.lr={args.lr}", "--schedule.name=cosine", "--schedule.warmup_steps=5",
        f"--train.steps={args.steps}", "--train.precision=bf16", "--train.compile=true", "--train.eval_every=0",
        f"--train.out_dir={root / 'dpo'}"])
    started = time.perf_counter()
    result = preference_train(cfg)
    train_s = time.perf_counter() - started
    metrics = [json.loads(line) for line in open(result.metrics_path)]
    val = [m for m in metrics if "val_reward_accuracy" in m][-1]

    tuned = load_model(root / "dpo", dtype="bfloat16")  # base + adapter, merged
    after = {"preference_accuracy": preference_accuracy(tuned, heldout_file, args.seq)[0],
             **task_accuracy(tuned, items)}
    n_pairs = args.heldout
    for side in (before, after):
        side["preference_stderr"] = stderr(side["preference_accuracy"], n_pairs)
    return {
        "benchmark": "dpo_quality", "model": "SmolLM2-135M-Instruct", "method": "DPO, LoRA r16 on all projections",
        "beta": 0.1, "lr": args.lr, "steps": args.steps, "train_pairs": args.train, "heldout_pairs": n_pairs,
        "train_seconds": round(train_s, 1), "final_loss": result.final_loss,
        "val_reward_accuracy": val["val_reward_accuracy"], "val_reward_margin": val["val_reward_margin"],
        "before": before, "after": after,
        "machine": machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in os.getloadavg()]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=480)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--tasks", type=int, default=100)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = run(args)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
