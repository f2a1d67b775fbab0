"""`tokenmind speedrun`: text to a chatting model in one command, ending in a report card.

fetch corpora (registry packages) → [build the chat training mix] → train a BPE tokenizer →
clean/dedup/decontaminate/tokenize into shards → pre-train → SFT on chat data → evaluate →
[chat quality] → `report.md`. Each stage is a library
call owned by its package; this module only wires their outputs to the next stage's inputs,
skips stages whose outputs already exist (a re-run resumes), and records timings. Its config
holds each stage's own config whole (`RunConfig`, `SFTConfig`, `EvalConfig`), so a misspelt key
fails when the speedrun config loads, not minutes later when its stage starts.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import Overrides, build_config, read_config, save_resolved
from .eval.runner import EvalConfig
from .posttrain.chat_mix import ChatMixConfig
from .posttrain.sft import SFTConfig
from .progress import Stages
from .train.config import DataSection, RunConfig, TrainSection

CONFIG_DIR = Path(__file__).parent / "configs"
EVAL_DEFAULTS = {"tasks": ["val_loss", "arc_easy", "mmlu"], "limit": 200}


@dataclass
class SpeedrunConfig:
    """A named speedrun: which data, how big a tokenizer and model, how long each stage runs.

    pretrain/sft/eval are the stages' own configs (`RunConfig`, `SFTConfig`, `EvalConfig`), checked
    key by key when the speedrun config loads. The speedrun wires the stages together, so it sets
    their paths from out_dir and data_dir (and the model's vocab_size from vocab_size); see
    `load_speedrun_config`. eval defaults to val_loss, arc_easy and mmlu, 200 items each.
    """

    name: str = "cpu"
    base: str | None = None  # a packaged config (or YAML path) this one starts from; its own keys win
    description: str = ""  # why the recipe is what it is: shown at the top of the report card
    out_dir: str = "runs/cpu"
    data_dir: str = "data"
    pretrain_sources: list[str] = field(default_factory=lambda: ["tiny"])
    sft_sources: list[str] = field(default_factory=lambda: ["sft"])
    eval_sources: list[str] = field(default_factory=lambda: ["eval-small"])
    vocab_size: int = 8192
    tokenizer_max_chars: int = 0
    val_tokens: int = 100_000  # the last documents of the corpus, at least this many tokens, held out
    quality_filters: bool = True  # Gopher's rules for web text; off for a curated corpus (the chat mix)
    chat_mix: bool = False  # pre-train and fine-tune on `posttrain.chat_mix` (built from the fetched sources)
    mix: ChatMixConfig = field(default_factory=ChatMixConfig)  # how the chat mix is built
    chat_eval: bool = False  # score chat quality on the held-out prompts, at checkpoints and at the end
    chat_baseline: str | None = None  # earlier answers the final model is judged against (e.g. cpu_v1)
    chat_judge: str = "smollm2"  # the model that scores fluency and preference
    compare_with: str | None = None  # another speedrun's out_dir: its pre-training loss curve is drawn beside ours
    pretrain: RunConfig = field(default_factory=RunConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    chat_prompts: list[str] = field(default_factory=lambda: ["What is the capital of France?",
                                                             "Tell me about Mr. Darcy."])


def load_speedrun_config(name_or_path: str = "cpu", overrides: Overrides = ()) -> SpeedrunConfig:
    """A packaged config by name (`cpu`, `gpu`) or a YAML path, then overrides such as
    `pretrain.train.steps=10`; a misspelt key anywhere fails here, not when its stage starts. A
    config with `base: <name>` starts from that config's values, key by key."""
    values = read_config(SpeedrunConfig, _config_path(name_or_path), overrides)
    if values.get("base"):
        base = read_config(SpeedrunConfig, _config_path(values["base"]))
        if base.get("base"):
            raise ValueError(f"speedrun config {values['base']!r} has a base of its own; one level of base only")
        values = {**base, **values}
    return build_config(SpeedrunConfig, stage_paths(values))


def _config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not path.exists():
        path = CONFIG_DIR / f"speedrun_{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem.removeprefix("speedrun_") for p in CONFIG_DIR.glob("speedrun_*.yaml"))
        raise FileNotFoundError(f"no speedrun config {name_or_path!r}: give a YAML path or one of {', '.join(known)}")
    return path


def stage_paths(values: dict[str, Any]) -> dict[str, Any]:
    """The speedrun's flat config values with each stage's inputs set to the previous stage's outputs.

    Those keys belong to the speedrun: setting one to anything else is an error naming the key to
    change instead (out_dir, data_dir or vocab_size). sft.data.files, eval.tasks, eval.limit and
    eval.seq_len (pre-training's seq_len) are only defaults.
    """
    def get(key: str, default: Any) -> Any:
        return values.get(key, default)

    out, data = Path(str(get("out_dir", SpeedrunConfig.out_dir))), Path(str(get("data_dir", SpeedrunConfig.data_dir)))
    wired = {"pretrain.data.shards": (str(out / "shards"), "out_dir"),
             "pretrain.data.tokenizer": (str(out / "tokenizer"), "out_dir"),
             "pretrain.model.vocab_size": (get("vocab_size", SpeedrunConfig.vocab_size), "vocab_size"),
             "pretrain.train.out_dir": (str(out / "pretrain"), "out_dir"),
             "sft.sft.init_from": (str(out / "pretrain"), "out_dir"),
             "sft.train.out_dir": (str(out / "sft"), "out_dir"),
             "eval.model": (str(out / "sft" / "final"), "out_dir"),
             "eval.data_dir": (str(data / "eval"), "data_dir"),
             "eval.shards_dir": (str(out / "shards"), "out_dir"),
             "eval.out": (str(out / "eval.json"), "out_dir")}
    for key, (value, owner) in wired.items():
        if key in values and str(values[key]) != str(value):
            raise ValueError(f"{key}={values[key]!r}: the speedrun sets it to {value} (from {owner}); "
                             f"change {owner} instead, or leave {key} out")
    sft_files = out / "mix" / "sft" if get("chat_mix", False) else data / "sft"
    defaults = {"sft.data.files": [str(sft_files)],
                "eval.seq_len": get("pretrain.data.seq_len", DataSection.seq_len),
                **{f"eval.{k}": v for k, v in EVAL_DEFAULTS.items()}}
    return {**defaults, **values, **{key: value for key, (value, _) in wired.items()}}


def speedrun(cfg: SpeedrunConfig) -> Path:
    """Run every stage of `cfg` (from `load_speedrun_config`, which wires the stages' paths); return
    the path of the report card."""
    from .data.fetch import fetch
    from .data.clean import CleanConfig
    from .data.pipeline import DataPipelineConfig, run_pipeline
    from .data.quality import QualityConfig
    from .data.shards import ShardConfig
    from .model.load import load_tokenizer
    from .tokenizer import Tokenizer
    from .tokenizer.train import TokenizerTrainConfig, train_tokenizer
    from .train import pretrain

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out / "speedrun.yaml")  # every stage's whole config, paths included
    stages = Stages(out)
    data = Path(cfg.data_dir)

    def fetch_all():
        names = cfg.pretrain_sources + cfg.sft_sources + cfg.eval_sources
        if not names:  # data_dir was prepared by hand: pretrain/, sft/ and eval/ folders of JSONL
            return {"sources": []}
        manifest = fetch(names, out_dir=data)
        return {"sources": sorted(manifest.get("sources", {}))}

    stages.run("fetch", fetch_all)
    text_dir = data / "pretrain"
    if cfg.chat_mix:
        from .posttrain.chat_mix import build_chat_mix, check_held_out

        def mix():
            counts = build_chat_mix(data, out / "mix", cfg.mix)
            leaks = check_held_out(out / "mix")
            if leaks:
                raise RuntimeError(f"held-out chat prompts reached the training mix: {leaks[:5]}")
            return counts

        stages.run("mix", mix)
        text_dir = out / "mix" / "pretrain"
    tok_dir = Path(cfg.pretrain.data.tokenizer)
    tok_report = stages.run("tokenizer", lambda: train_tokenizer(TokenizerTrainConfig(
        data=[str(text_dir)], out=str(tok_dir), vocab_size=cfg.vocab_size,
        max_chars=cfg.tokenizer_max_chars), reference=load_tokenizer("smollm2")))
    shards = Path(cfg.pretrain.data.shards)

    def prepare():
        tokenizer = Tokenizer.from_pretrained(tok_dir)
        quality = QualityConfig() if cfg.quality_filters else QualityConfig.disabled()
        pipeline = DataPipelineConfig(eval_paths=[data / "eval"], shards=ShardConfig(val_tokens=cfg.val_tokens),
                                      clean=CleanConfig(quality=quality))
        report = run_pipeline(text_dir, shards, tokenizer, pipeline)
        return {k: report[k] for k in ("documents_read", "characters_read", "output", "seconds")}

    data_report = stages.run("data", prepare)
    pre_dir, sft_dir = Path(cfg.pretrain.train.out_dir), Path(cfg.sft.train.out_dir)

    def summary(result) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items() if k != "losses"}

    def run_sft():
        from .posttrain import sft

        return summary(sft(cfg.sft))

    def run_evals():
        from .eval.runner import run_eval

        return run_eval(cfg.eval)

    pre = stages.run("pretrain", lambda: summary(pretrain(cfg.pretrain)))
    post = stages.run("sft", run_sft)
    link_final(out, sft_dir / "final")
    evals = stages.run("eval", run_evals)

    def chat_samples():
        from .chat import ChatSession
        from .engine.sampling import SamplingParams
        from .model.load import load_model

        model = load_model(sft_dir / "final")
        samples = []
        for prompt in cfg.chat_prompts:
            session = ChatSession(model, SamplingParams(max_tokens=60, temperature=0.7, top_p=0.9, seed=0))
            samples.append({"prompt": prompt, "reply": "".join(session.send(prompt))})
        base = load_model(pre_dir / "final")
        from .chat import complete

        text = "".join(complete(base, "It is a truth universally acknowledged", SamplingParams(
            max_tokens=60, temperature=0.8, top_p=0.9, seed=0)))
        samples.append({"prompt": "(pre-trained model) It is a truth universally acknowledged", "reply": text})
        return samples

    samples = stages.run("samples", chat_samples)
    chat = stages.run("chat", lambda: chat_quality(cfg, pre_dir, sft_dir, out)) if cfg.chat_eval else None
    report = write_report(cfg, out, stages.timings, tok_report, data_report, pre, post, evals, samples, chat)
    from rich.console import Console

    Console(stderr=True).print(f"\n[bold green]report card:[/bold green] {report}\n"
                               f"chat with the result: [bold]tokenmind chat --model {out / 'final'}[/bold]")
    return report


def link_final(out: Path, model_dir: Path) -> Path:
    """`out/final`: a relative link to the run's finished chat model, so `--model runs/cpu/final`
    (or just `runs/cpu`) names it."""
    link, tmp = out / "final", out / "final.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(model_dir, out))
    tmp.replace(link)
    return link


def chat_quality(cfg: SpeedrunConfig, pre_dir: Path, sft_dir: Path, out: Path) -> dict[str, Any]:
    """The chat figures along the run (the pre-trained model, each SFT checkpoint, the final model)
    and, for the final model, the judge's preference against `chat_baseline`; plots the curve."""
    from .eval.chat_quality import evaluate_chat, load_baseline, plot_curve, reference_nll, save_baseline
    from .model.load import load_model
    from .train.checkpoint import list_checkpoints, load_checkpoint_weights

    judge = load_model(cfg.chat_judge)
    baseline = load_baseline(cfg.chat_baseline) if cfg.chat_baseline else None
    final = load_model(sft_dir / "final")
    points = [("pre-trained", load_model(pre_dir / "final").model)]
    for ckpt in list_checkpoints(sft_dir / "checkpoints")[:-1]:  # the last one is the final model
        model = copy.deepcopy(final.model)
        model.load_state_dict(load_checkpoint_weights(ckpt))
        points.append((f"SFT step {int(ckpt.name.split('_')[1])}", model))
    curve = []
    reference = reference_nll(judge.model, judge.tokenizer)  # once: every point shares it
    for name, model in points:
        r = evaluate_chat(model, final.tokenizer, judge.model, judge.tokenizer, reference=reference)
        curve.append({"point": name, "on_topic": r["on_topic"], "fluency_ratio": r["fluency_ratio"]})
    result = evaluate_chat(final.model, final.tokenizer, judge.model, judge.tokenizer,
                           baseline and baseline["answers"], reference=reference)
    curve.append({"point": "final", "on_topic": result["on_topic"], "fluency_ratio": result["fluency_ratio"]})
    save_baseline(result, cfg.name, out / "chat_answers.json")
    plot_curve(curve, out / "chat_quality.png")
    return {"final": result, "curve": curve, "baseline": baseline and {"name": baseline["name"],
                                                                       "figures": baseline["figures"]}}


def budget_note(train: TrainSection, steps_done: int) -> str:
    """' (of N: the M-minute budget)' when train.max_minutes cut the configured step count, else ''."""
    if steps_done >= train.steps:
        return ""
    return f" (of {train.steps}: what fitted the {train.max_minutes:g}-minute budget, `train.max_minutes`)"


def write_report(cfg: SpeedrunConfig, out: Path, timings: dict, tok: dict, data: dict, pre: dict,
                 post: dict, evals: dict, samples: list[dict], chat: dict | None = None) -> Path:
    """The report card: config, data stats, tokens, time, speed, losses, eval scores, samples."""
    comparison = tok.get("comparison") or {}

    def loss(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [f"# tokenmind speedrun: {cfg.name}", "",
             f"Total time: **{sum(timings.values()) / 60:.1f} min**. Config: `speedrun.yaml`; "
             "pre-training config: `pretrain/config.yaml`; SFT config: `sft/config.yaml`.", "",
             *([cfg.description.strip(), ""] if cfg.description.strip() else []),
             "| stage | seconds |", "| --- | ---: |", *[f"| {k} | {v} |" for k, v in timings.items()], "",
             "## Data and tokenizer", "",
             f"- sources: {', '.join(cfg.pretrain_sources)} (pre-training), {', '.join(cfg.sft_sources)} (SFT), "
             f"{', '.join(cfg.eval_sources)} (evaluation; decontaminated against)",
             f"- read {data['documents_read']:,} documents ({data['characters_read']:,} chars); kept "
             f"{data['output']['documents']:,} → {data['output']['tokens']:,} tokens",
             f"- BPE vocabulary {cfg.vocab_size}: {comparison.get('trained', tok.get('bytes_per_token', 0)):.2f} "
             f"bytes/token on held-out text (SmolLM2's tokenizer: {comparison.get('reference', float('nan')):.2f})",
             "", "## Pre-training", "",
             f"- {pre['steps']} steps{budget_note(cfg.pretrain.train, pre['steps'])}, {pre['tokens_seen']:,} tokens "
             f"seen, {pre['tokens_per_s']:,.0f} tokens/s, "
             f"MFU {100 * (pre['mfu'] or 0):.1f}%",
             f"- final train loss {loss(pre['final_loss'])}, validation loss {loss(pre['final_val_loss'])}", "",
             "![pre-training loss](pretrain/loss.png)", "", *model_comparison(cfg, out), "## SFT", "",
             f"- {post['steps']} steps{budget_note(cfg.sft.train, post['steps'])}, final train loss "
             f"{loss(post['final_loss'])}, "
             f"validation loss {loss(post['final_val_loss'])}", "", "![SFT loss](sft/loss.png)", "",
             "## Evaluation", "", "| task | n | metric | value |", "| --- | ---: | --- | ---: |"]
    for task, res in evals.get("tasks", {}).items():
        metric = res.get("primary")
        value = res.get(metric)
        shown = f"{value:.4f}" if isinstance(value, float) else value
        lines.append(f"| {task} | {res.get('n', '')} | {metric} | {shown} |")
    if chat is not None:
        lines += chat_section(chat)
    lines += ["", "## Samples", ""]
    for sample in samples:
        lines += [f"**{sample['prompt']}**", "", "> " + sample["reply"].replace("\n", "\n> "), ""]
    lines += ["## Try it", "", f"    tokenmind chat --model {out / 'final'}", ""]
    path = out / "report.md"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def model_comparison(cfg: SpeedrunConfig, out: Path) -> list[str]:
    """Report lines for a mixture of experts (the expert-utilisation plot) and for a run compared
    with another (both pre-training loss curves in one plot, `pretrain/loss_comparison.png`)."""
    from .train.metrics import plot_loss_curves

    lines = []
    pre = Path(cfg.pretrain.train.out_dir)
    if cfg.pretrain.model.num_experts:
        model = cfg.pretrain.model
        lines += [f"- mixture of experts: {model.num_experts} experts, top {model.num_experts_per_tok} per token; "
                  f"{model.num_active_parameters:,} of {model.num_parameters:,} parameters active per token", "",
                  f"![expert load]({(pre / 'expert_load.png').relative_to(out)})", ""]
    if cfg.compare_with:
        other = Path(cfg.compare_with) / "pretrain" / "metrics.jsonl"
        if not other.exists():
            return lines + [f"(no loss comparison: {other} is missing; run that speedrun first)", ""]
        png = plot_loss_curves({Path(cfg.compare_with).name: other, cfg.name: pre / "metrics.jsonl"},
                               pre / "loss_comparison.png")
        lines += [f"Pre-training loss beside `{cfg.compare_with}`:", "", f"![loss comparison]({png.relative_to(out)})",
                  ""]
    return lines


def chat_section(chat: dict[str, Any]) -> list[str]:
    """The report's chat-quality section: the figures against the baseline, the curve, ten exchanges."""
    final, base = chat["final"], chat["baseline"]
    pref = final.get("preference") or {}

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    lines = ["", "## Chat quality", "",
             f"On {final['n']} held-out prompts (`src/tokenmind/eval/data/chat_prompts.jsonl`, never trained on). "
             "On-topic: the answer passes its prompt's check. Fluency: the judge's (SmolLM2-135M-Instruct) mean "
             "per-token loss on the answers over that on hand-written reference answers (1.0 = as fluent; target "
             "≤ 1.5). Preference: how often the judge prefers this run's answer over the baseline's, asked in both "
             "orders: strictly (a pair counts only when both orders agree; ties left out) and position-corrected "
             "(the log-odds of both orders summed, which cancels the judge's lean towards one letter"
             + (f": it said \"A\" in {pct(pref['position_bias'])} of the questions)." if pref else ")."), "",
             "| model | on-topic | fluency ratio | answers starting with a letter choice | preferred by the judge, "
             "strict | preferred, position-corrected |",
             "| --- | ---: | ---: | ---: | ---: | ---: |",
             f"| this run | {pct(final['on_topic'])} | {final['fluency_ratio']:.2f} | {final['mc_letter_starts']} | "
             + (f"{pct(pref['win_rate'])} ({pref['wins']} won, {pref['losses']} lost, {pref['ties']} ties) | "
                f"{pct(pref['corrected_win_rate'])} ({pref['corrected_wins']} won, {pref['corrected_losses']} lost) |"
                if pref else "- | - |")]
    if base is not None:
        f = base["figures"]
        lines.append(f"| baseline `{base['name']}` | {pct(f['on_topic'])} | {f['fluency_ratio']:.2f} | "
                     f"{f['mc_letter_starts']} | | |")
    by_category = ", ".join(f"{c} {pct(v)}" for c, v in final["on_topic_by_category"].items())
    lines += ["", f"On-topic by category: {by_category}",
              "", "![chat quality along the run](chat_quality.png)", "",
              "| point | on-topic | fluency ratio |", "| --- | ---: | ---: |",
              *[f"| {p['point']} | {pct(p['on_topic'])} | {p['fluency_ratio']:.2f} |" for p in chat["curve"]],
              "", "Ten exchanges:", ""]
    for p in final["predictions"][::max(1, len(final["predictions"]) // 10)][:10]:
        lines += [f"- **{p['prompt']}** {p['answer']}" + ("" if p["on_topic"] else " *(off topic)*")]
    return lines
