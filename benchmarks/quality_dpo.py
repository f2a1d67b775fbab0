"""Does SFT → DPO on verifier-built pairs make SmolLM2-135M better at the task? Each stage, with standard errors.

Data (`posttrain.pairs.multistep_pairs`): multi-step arithmetic problems, a correct step-by-step
solution (chosen) against one with a wrong step carried to a wrong answer (rejected). The task
problems (`multistep_items`, seed 2) and the held-out pairs (seed 1) are the evaluation; training
pairs (seed 0) are drawn with every evaluation expression excluded, and the script refuses to run
if any training expression is an evaluation one (small expressions do repeat across seeds).

Stages, each through the CLI's own config loaders (the JSON records the equivalent commands):

* base: SmolLM2-135M-Instruct as it is;
* sft: `tokenmind sft` with LoRA r16 on the chosen solutions of the training pairs (the base
  ignores the step format, so DPO alone has little to move: 0.01 → 0.03 final-answer accuracy);
* dpo: `tokenmind posttrain dpo` from the SFT model (which is also the reference), LoRA r16, on the
  scripted pairs above (off-policy: the SFT model would rarely write either solution);
* onpolicy: the same DPO from the SFT model, on pairs of its own samples: N samples per fresh training
  problem (`multistep_items` seed 3, evaluation expressions excluded) from the paged engine, ranked by
  the step verifier (`multistep_reward`: the share of steps right before the first wrong one), the
  best against the worst where they differ (`sampling.rejection_sample`, its `pairs.jsonl`).

Measured on the same items:

* task accuracy, every stage: greedy answers to the held-out problems, scored by `numeric_reward`
  (final answer right) and `multistep_reward` = 1 (every step right), with the binomial standard
  error, and the paired standard error of each stage's gain over the model it started from;
* held-out pairs, SFT and DPO models (scoring them is a forward pass per pair, which the shared
  2-core CPU cannot spare for the base too): preference accuracy, the share whose chosen solution
  gets the higher log-probability, and DPO's implicit-reward accuracy against its reference (the
  SFT model), the share where log π/π_ref is higher for chosen than rejected; DPO's own val split
  (`val_reward_accuracy`) is reported too where it has one.

A stage's results are kept in --work with the settings it ran with, so the pipeline can run in pieces
(`--stage sft`, then `dpo`, `onpolicy` and `base`; each trains if its run is missing, then evaluates)
and a stage whose own settings changed is refused rather than mixed; every call prints all done.

    python benchmarks/quality_dpo.py --work runs/quality_dpo [--stage all] [--tasks 100] [--heldout 100]
    python benchmarks/quality_dpo.py --work runs/quality_dpo --stage sft --reevaluate  # same code for all stages
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from _common import emit, machine_info

STAGES = ("base", "sft", "dpo", "onpolicy")
PARENT = {"sft": "base", "dpo": "sft", "onpolicy": "sft"}  # the model a stage starts from (and compares to)
_EVAL = ("heldout", "tasks", "max_tokens")
_SFT = ("train", "sft_steps", "sft_lr", "sft_seq", *_EVAL)
STAGE_SETTINGS = {  # what each stage's cached result depends on
    "base": ("tasks", "max_tokens"), "sft": _SFT, "dpo": (*_SFT, "steps", "lr", "seq", "beta", "nll_weight"),
    "onpolicy": (*_SFT, "problems", "samples", "temperature", "threshold", "onpolicy_steps", "onpolicy_lr", "seq",
                 "beta", "nll_weight")}


def stage_settings(stage: str, args: argparse.Namespace) -> dict:
    """The arguments a stage's result depends on: a cached result is reused only when they match."""
    return {k: getattr(args, k) for k in STAGE_SETTINGS[stage]}


def stderr(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / n)


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / √n)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def build_data(args: argparse.Namespace, work: Path) -> dict:
    """Writes train pairs, held-out pairs and SFT chats to `work`; returns the task items and counts."""
    from tokenmind.jsonl import write_jsonl
    from tokenmind.posttrain.pairs import multistep_pairs
    from tokenmind.posttrain.tasks import multistep_items

    items = multistep_items(args.tasks, seed=2)
    heldout = multistep_pairs(args.heldout, seed=1)
    evaluation = {it["expression"] for it in items} | {p["expression"] for p in heldout}
    unfiltered = {p["expression"] for p in multistep_pairs(args.train, seed=0)}
    train = multistep_pairs(args.train, seed=0, exclude=evaluation)
    leaked = {p["expression"] for p in train} & evaluation
    if leaked:
        raise RuntimeError(f"training pairs contain evaluation problems: {sorted(leaked)[:3]}")
    strip = ("prompt", "chosen", "rejected")
    write_jsonl(work / "train.jsonl", [{k: p[k] for k in strip} for p in train])
    write_jsonl(work / "heldout.jsonl", [{k: p[k] for k in strip} for p in heldout])
    write_jsonl(work / "sft.jsonl", [{"messages": p["prompt"] + p["chosen"]} for p in train])
    return {"items": items, "evaluation": evaluation, "counts": {
        "train_pairs": len(train), "sft_chats": len(train), "heldout_pairs": len(heldout), "task_problems": len(items),
        "decontamination": {"evaluation_expressions": len(evaluation),
                            "unfiltered_train_expressions_in_evaluation": len(unfiltered & evaluation),
                            "train_expressions_in_evaluation": len(leaked)}}}


def pair_logps(model, pairs_file: Path, seq_len: int) -> list[tuple[float, float]]:
    """(chosen, rejected) summed completion log-probs of every pair in the file, in file order."""
    from tokenmind.posttrain.preference import compute_reference_logps
    from tokenmind.posttrain.preference_data import prepare_preferences, read_preferences

    kind, records = read_preferences([pairs_file])
    units = prepare_preferences(model.tokenizer, kind, records, seq_len // 2).train
    compute_reference_logps(model.model, units, seq_len, 1, "fp32", torch.device("cpu"), progress=False)
    return [(float(u.ref_logps[0]), float(u.ref_logps[1])) for u in units]


def task_outcomes(model, items: list[dict], max_tokens: int) -> dict:
    """Per-item greedy scores (final answer right, every step right) and one example reply."""
    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.posttrain.tasks import multistep_reward, numeric_reward

    llm = LLM(model, max_num_seqs=len(items))
    ids = [model.tokenizer.apply_chat_template(it["prompt"], add_generation_prompt=True) for it in items]
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), progress=False)
    texts = [o.outputs[0].text for o in outs]
    return {"answer_right": [numeric_reward(it["prompt"], t, answer=it["answer"]) for it, t in zip(items, texts)],
            "steps_right": [float(multistep_reward(it["prompt"], t, expression=it["expression"]) == 1.0)
                            for it, t in zip(items, texts)],
            "example": texts[0][:300]}


def evaluate(model_ref: str | Path, items: list[dict], work: Path, args: argparse.Namespace, pairs: bool) -> dict:
    """Task outcomes and, with `pairs`, the held-out pairs' log-probs."""
    from tokenmind.model.load import load_model

    started = time.perf_counter()
    model = load_model(model_ref, dtype="float32")
    result = task_outcomes(model, items, args.max_tokens)
    if pairs:
        result["pair_logps"] = pair_logps(model, work / "heldout.jsonl", args.seq)
    result["eval_seconds"] = round(time.perf_counter() - started, 1)
    return result


def sft_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    return ["--sft.init_from=smollm2", f"--data.files={work / 'sft.jsonl'}", "--data.batch_size=2",
            f"--data.seq_len={args.sft_seq}", "--data.val_fraction=0", "--lora.rank=16", "--lora.alpha=32",
            "--lora.dropout=0", f"--optim.lr={args.sft_lr}", "--schedule.name=cosine", "--schedule.warmup_steps=3",
            f"--train.steps={args.sft_steps}", "--train.precision=auto", "--train.eval_every=0",
            "--train.checkpoint_every=5", f"--train.out_dir={work / 'sft'}"]


def dpo_overrides(args: argparse.Namespace, work: Path, stage: str) -> list[str]:
    """DPO from the SFT model: on the scripted pairs (`dpo`, a 10% val split) or on its own (`onpolicy`,
    too few pairs to spare a val split: the held-out pairs measure it)."""
    onpolicy = stage == "onpolicy"
    files, val = (work / "onpolicy_pairs" / "pairs.jsonl", 0) if onpolicy else (work / "train.jsonl", 0.1)
    steps, lr = (args.onpolicy_steps, args.onpolicy_lr) if onpolicy else (args.steps, args.lr)
    return [f"--preference.init_from={work / 'sft'}", f"--preference.beta={args.beta}",
            f"--preference.nll_weight={args.nll_weight}", f"--data.files={files}",
            "--data.batch_size=2", f"--data.seq_len={args.seq}", f"--data.val_fraction={val}", "--lora.rank=16",
            "--lora.alpha=32", "--lora.dropout=0", f"--optim.lr={lr}", "--schedule.name=cosine",
            "--schedule.warmup_steps=3", f"--train.steps={steps}", "--train.precision=auto", "--train.eval_every=0",
            "--train.checkpoint_every=5", f"--train.out_dir={work / stage}"]


def sample_pairs(args: argparse.Namespace, work: Path, evaluation: set[str]) -> dict:
    """The SFT model's own pairs (`sampling.rejection_sample`, scored by the step verifier) on fresh
    training problems, kept in work/onpolicy_pairs (sampled once per sampling settings: the slow part on a CPU)."""
    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.model.load import load_model
    from tokenmind.posttrain.sampling import rejection_sample
    from tokenmind.posttrain.tasks import multistep_items, multistep_reward

    out = work / "onpolicy_pairs"
    settings = {k: getattr(args, k) for k in ("problems", "samples", "temperature", "threshold", "max_tokens")}
    cached = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    if cached.get("settings") == settings:
        return cached
    items = [it for it in multistep_items(2 * args.problems, seed=3) if it["expression"] not in evaluation]
    items = items[:args.problems]
    if len(items) < args.problems:
        raise RuntimeError(f"only {len(items)} seed-3 problems are not evaluation problems; lower --problems")
    started = time.perf_counter()
    llm = LLM(load_model(work / "sft", dtype="float32"), max_num_seqs=len(items) * args.samples)
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens)
    report = rejection_sample(llm, items, multistep_reward, out, n=args.samples, threshold=args.threshold,
                              params=params, seed=0, progress=False)
    report.update(settings=settings, sample_seconds=round(time.perf_counter() - started, 1))
    (out / "report.json").write_text(json.dumps(report) + "\n")
    return report


def train_stage(stage: str, args: argparse.Namespace, work: Path, evaluation: set[str]) -> dict:
    """Runs (or resumes) the stage's training (for `onpolicy`, sampling its pairs first); its command,
    seconds and final metrics."""
    from tokenmind.posttrain.preference import load_preference_config, preference_train
    from tokenmind.posttrain.sft import load_sft_config, sft

    info = {"sampling": sample_pairs(args, work, evaluation)} if stage == "onpolicy" else {}
    overrides = sft_overrides(args, work) if stage == "sft" else dpo_overrides(args, work, stage)
    started = time.perf_counter()
    if stage == "sft":
        result, command = sft(load_sft_config(None, overrides)), "tokenmind sft"
    else:
        result, command = preference_train(load_preference_config(None, overrides, {"preference.loss": "dpo"})), \
            "tokenmind posttrain dpo"
    info.update(command=" ".join([command, *overrides]), train_seconds=round(time.perf_counter() - started, 1),
                final_loss=result.final_loss, steps=result.steps)
    if stage != "sft":
        metrics = [json.loads(line) for line in open(result.metrics_path)]
        info["train_reward_accuracy"] = [m["reward_accuracy"] for m in metrics if "reward_accuracy" in m]
        val = [m for m in metrics if "val_reward_accuracy" in m]
        if val:
            info.update({k: val[-1][k] for k in ("val_reward_accuracy", "val_reward_margin")})
    return info


def run_stage(stage: str, args: argparse.Namespace, work: Path, data: dict, trained: dict | None = None) -> dict:
    """Trains the stage (unless `trained` holds its cached training record) and evaluates its model."""
    load_start = [round(x, 2) for x in os.getloadavg()]
    if trained is not None:
        info = {k: v for k, v in trained.items() if k not in ("answer_right", "steps_right", "pair_logps")}
    else:
        info = {} if stage == "base" else train_stage(stage, args, work, data["evaluation"])
    # held-out pairs score the SFT model (DPO's reference) and the DPO models: what implicit rewards need
    info.update(evaluate("smollm2" if stage == "base" else work / stage, data["items"], work, args,
                         pairs=stage != "base"))
    info["loadavg"] = [load_start, [round(x, 2) for x in os.getloadavg()]]
    return info


def summarize(results: dict, counts: dict) -> dict:
    """Accuracies with standard errors per stage, paired gains, and implicit-reward accuracies."""
    out = {}
    for stage in [s for s in STAGES if s in results]:
        previous = PARENT.get(stage)
        r, n = results[stage], len(results[stage]["answer_right"])
        row = {"n": n}
        for key in ("answer_right", "steps_right"):
            p = sum(r[key]) / n
            row[key.replace("_right", "_accuracy")] = round(p, 4)
            row[key.replace("_right", "_stderr")] = round(stderr(p, n), 4)
        row["example"] = r["example"]
        ref = results.get(previous, {})
        for key in ("answer_right", "steps_right"):
            if key in ref:
                gain, se = mean_and_stderr([a - b for a, b in zip(r[key], ref[key])])
                row[f"{key.replace('_right', '')}_gain_vs_{previous}"] = {"gain": round(gain, 4),
                                                                          "paired_stderr": round(se, 4)}
        if "pair_logps" in r:
            pairs = r["pair_logps"]
            pref = sum(c > rej for c, rej in pairs) / len(pairs)
            row.update(heldout_pairs=len(pairs), preference_accuracy=round(pref, 4),
                       preference_stderr=round(stderr(pref, len(pairs)), 4))
        if "pair_logps" in r and "pair_logps" in ref:
            wins = sum((c - rc) > (rej - rr) for (c, rej), (rc, rr) in zip(pairs, ref["pair_logps"])) / len(pairs)
            row[f"heldout_implicit_reward_accuracy_vs_{previous}"] = round(wins, 4)
            row["heldout_implicit_reward_stderr"] = round(stderr(wins, len(pairs)), 4)
        for key in ("settings", "sampling", "command", "train_seconds", "final_loss", "steps", "train_reward_accuracy",
                    "val_reward_accuracy", "val_reward_margin", "eval_seconds", "loadavg"):
            if key in r:
                row[key] = r[key]
        out[stage] = row
    return {"benchmark": "dpo_quality", "model": "SmolLM2-135M-Instruct", "pipeline": "base -> SFT (LoRA r16) -> "
            "DPO (LoRA r16, reference = the SFT model) on scripted pairs (dpo) or on its own samples ranked by "
            "the step verifier (onpolicy)", "precision": "fp32", **counts, "stages": out}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/quality_dpo", help="data, runs and per-stage results")
    p.add_argument("--stage", choices=[*STAGES, "all"], default="all", help="run this stage (and report all done)")
    p.add_argument("--train", type=int, default=40, help="training pairs (their chosen answers are the SFT data)")
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--tasks", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--sft-steps", type=int, default=10)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-seq", type=int, default=288, help="SFT row length (two chats fit)")
    p.add_argument("--steps", type=int, default=8, help="DPO optimizer steps")
    p.add_argument("--lr", type=float, default=5e-4, help="DPO learning rate (LoRA)")
    p.add_argument("--seq", type=int, default=400, help="DPO row length: two pairs fit (a sequence may take half)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta (both DPO stages)")
    p.add_argument("--nll-weight", type=float, default=0.0,
                   help="weight of an NLL term on the chosen answers (RPO; both DPO stages; 0 = plain DPO)")
    p.add_argument("--problems", type=int, default=24, help="onpolicy: fresh training problems to sample")
    p.add_argument("--samples", type=int, default=6, help="onpolicy: samples per problem")
    p.add_argument("--temperature", type=float, default=0.8, help="onpolicy: sampling temperature")
    p.add_argument("--threshold", type=float, default=0.2,
                   help="onpolicy: the best sample's least step-verifier score to make a pair (1: all steps right)")
    p.add_argument("--onpolicy-steps", type=int, default=8)
    p.add_argument("--onpolicy-lr", type=float, default=2e-4)
    p.add_argument("--reevaluate", action="store_true", help="evaluate the stage's cached model again, so that "
                   "stages compared ran the same inference code (greedy answers are then paired exactly)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "results.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {"results": {}}
    data = build_data(args, work)
    for stage in STAGES if args.stage == "all" else (args.stage,):
        settings = stage_settings(stage, args)
        if stage in state["results"] and state["results"][stage]["settings"] != settings:
            raise SystemExit(f"{work} holds stage {stage} run with {state['results'][stage]['settings']}, not "
                             f"{settings}; pass another --work (or delete {work / stage} and its entry)")
        if PARENT.get(stage, "base") != "base" and PARENT[stage] not in state["results"]:
            raise SystemExit(f"stage {stage} starts from the SFT model; run --stage sft first")
        if stage not in state["results"] or args.reevaluate:
            trained = state["results"].get(stage)
            state["results"][stage] = {"settings": settings, **run_stage(stage, args, work, data, trained)}
            state_path.write_text(json.dumps(state) + "\n")
    result = {**summarize(state["results"], data["counts"]),
              "machine": machine_info(note="AMD EPYC, 2 cores AVX2, shared with other jobs: see each stage's loadavg")}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
