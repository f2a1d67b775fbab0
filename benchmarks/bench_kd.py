"""Knowledge distillation on the real model: SmolLM2-135M-Instruct teaches a student cut from its layers.

Runs `tokenmind posttrain kd|gkd` as `src/tokenmind/configs/kd_smollm2.yaml` describes (15 of the
30 layers, every other one; the speedrun's SFT chats; bf16) through the library entry points, and
reports what a reader needs to judge it:

* the teacher's top-k cache: build time and teacher tokens/s (offline mode), and the share of the
  teacher's probability mass its top k hold on the validation answers for k = 1 ... 128 (the
  evidence for the default k);
* the student's validation KL to the teacher and cross-entropy on the data's answers before
  training and after, next to the teacher's own cross-entropy (the floor a student approaches);
* training tokens/s over the timed steps (the Trainer's count: rows × seq_len per step), and the
  machine (CPU model and the ISA that decides bf16 speed).

    python benchmarks/bench_kd.py [--config src/tokenmind/configs/kd_smollm2.yaml] [--out bench_kd.json]
                                  [section.key=value ...]   # e.g. train.steps=300 distill.mode=gkd
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import time
from pathlib import Path

import torch

from _common import emit, machine_info
from tokenmind.data.loader import IGNORE_INDEX
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.load import load_model
from tokenmind.posttrain.kd import build_kd_trainer, load_kd_config
from tokenmind.train.distributed import init_distributed
from tokenmind.train.objectives import NextTokenObjective, autocast

CONFIG = Path(__file__).resolve().parents[1] / "src" / "tokenmind" / "configs" / "kd_smollm2.yaml"
KS = (1, 8, 16, 32, 64, 128)


@torch.no_grad()
def teacher_reference(cfg, trainer) -> dict:
    """The teacher's own cross-entropy on the val batches the student is evaluated on, and the
    mass its top k hold there."""
    teacher = load_model(cfg.distill.teacher, dtype=torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32)
    val_loader, batches = trainer.val_loader, cfg.train.eval_batches
    val_loader.load_state_dict(trainer.val_start)
    ce_terms, mass, positions = [], torch.zeros(len(KS)), 0
    for _ in range(min(batches, val_loader.batches_per_epoch)):
        batch = next(val_loader)
        ce_terms.append(NextTokenObjective()(teacher.model, batch, cfg.train.precision))
        with autocast(batch.input_ids.device, cfg.train.precision):
            hidden = teacher.model.hidden_states(batch.input_ids, batch.positions,
                                                 DenseAttentionMetadata(document_ids=batch.document_ids))
            logits = teacher.model.logits(hidden[batch.targets != IGNORE_INDEX])
        probs = torch.softmax(logits.float() / cfg.distill.temperature, -1).topk(max(KS)).values.cumsum(-1)
        mass += probs[:, [k - 1 for k in KS]].sum(0)
        positions += len(probs)
    terms = functools.reduce(operator.add, ce_terms)
    return {"teacher_val_ce": float(terms.loss / terms.count),
            "teacher_topk_mass": {k: round(float(m / positions), 4) for k, m in zip(KS, mass)}}


def run(config: Path, overrides: list[str]) -> dict:
    cfg = load_kd_config(config, overrides)
    ctx = init_distributed(cfg.train.distributed, cfg.train.device)
    cache_dir = Path(cfg.distill.cache_dir or Path(cfg.train.out_dir) / "teacher_topk")
    cached_before = set(cache_dir.glob("*.safetensors"))
    start = time.perf_counter()
    trainer = build_kd_trainer(cfg, ctx, progress=True)
    setup_s = time.perf_counter() - start
    data = json.loads((Path(cfg.train.out_dir) / "kd_data.json").read_text())
    before = trainer.evaluate()
    result = trainer.train()
    after = trainer.evaluate()
    reference = teacher_reference(cfg, trainer)
    rows = {"mode": cfg.distill.mode, "steps": result.steps, "student_layers": trainer.model.cfg.num_hidden_layers,
            "student_parameters": trainer.model.cfg.num_parameters, "setup_s": round(setup_s, 1),
            "val_before": {k: round(v, 4) for k, v in before.items()},
            "val_after": {k: round(v, 4) for k, v in after.items()}, **reference,
            "train_tokens_per_s": round(result.tokens_per_s, 1), "final_train_loss": result.final_loss,
            "out_dir": str(result.out_dir)}
    if cfg.distill.mode == "offline":
        built = set(cache_dir.glob("*.safetensors")) - cached_before
        rows["teacher_cache"] = {"built_now": bool(built), "bytes": sum(p.stat().st_size for p in built),
                                 "train_mean_topk_mass": data["train_teacher_topk"]["mean_topk_mass"],
                                 # setup = loading both models + the teacher's pass over every train and val token
                                 "teacher_tokens_per_s": round(data["train_tokens"] / setup_s, 1) if built else None}
    return machine_info(config=str(config), overrides=overrides, **rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--out")
    args, overrides = p.parse_known_args(argv)
    result = run(args.config, overrides)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
