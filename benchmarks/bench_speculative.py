"""Speculative decoding speed on SmolLM2-135M-Instruct (fp32, batch 1, greedy), through the engine: plain
decoding vs n-gram (prompt-lookup) drafting at several k, a self-speculative draft model, and trained
Medusa / EAGLE heads (`--medusa PATH`, `--eagle PATH`: directories `tokenmind posttrain medusa|eagle`
wrote; MTP does not apply, SmolLM2 has no MTP depths).

There is no smaller packaged model with SmolLM2's vocabulary, so the model drafter is a truncated
copy of the target itself: its first `--draft-layers` blocks + final norm + LM head (weights shared,
no training of an early exit). Prompts are chat-formatted; some ask to repeat / edit / correct /
summarize text that is in the prompt (where prompt lookup should help) and some are open-ended.

Each configuration is an `LLM` (the paged engine, one request at a time) built once. Every
configuration runs in one process, alternating with plain decoding in each repeat so load hits all
alike; medians are reported. Greedy speculative output is checked token for token against
plain decoding. `acceptance_length` is the mean number of tokens one target decode pass yields
(accepted drafts + the target's own token; 1.0 without speculation). Prints JSON.

    python benchmarks/bench_speculative.py [--max-tokens 128] [--ks 2,3,4,8] [--adaptive-ks 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, timed_call  # noqa: E402

PARAGRAPH = (
    "The printing press was invented by Johannes Gutenberg around 1440 in Mainz, Germany. It combined movable "
    "metal type, an oil-based ink and a wooden screw press adapted from those used to make wine and olive oil. "
    "Before it, books were copied by hand, which made them rare and expensive. Within fifty years, printing shops "
    "had spread to more than two hundred cities across Europe, and millions of books had been produced. Cheaper "
    "books helped spread literacy, allowed scientists to share their results quickly, and made it possible for new "
    "ideas to reach many people at once. Historians often call it one of the most important inventions of the "
    "second millennium."
)
TYPOS = (
    "Teh printing press was invnted by Johannes Gutenberg arround 1440 in Mainz, Germany. It combined moveable "
    "metal type, an oil-based ink and a woden screw press. Befor it, books were copyed by hand, wich made them "
    "rare and expensiv. Within fifty yeers, printing shops had spred to more then two hundred citys across Europe."
)
CODE = '''def checkout(cart, prices, discount_codes, tax_rate=0.08):
    total = 0.0
    for item, quantity in cart.items():
        if item not in prices:
            raise KeyError(f"unknown item: {item}")
        total += prices[item] * quantity
    for code in discount_codes:
        if code == "SAVE10":
            total = total * 0.9
        elif code == "FREESHIP":
            total = total - 5.0
    if total < 0:
        total = 0.0
    tax = total * tax_rate
    return round(total + tax, 2)
'''

PROMPTS = [  # (name, prompt lookup expected to help, user message)
    ("repeat_text", True, "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH),
    ("code_rename", True, "Rename the variable `total` to `subtotal` everywhere in this Python function and "
                          "output the complete updated function:\n\n```python\n" + CODE + "```"),
    ("fix_typos", True, "Correct the spelling mistakes in this text and output the corrected text:\n\n" + TYPOS),
    ("summarize", True, "Summarize the following text in a few sentences:\n\n" + PARAGRAPH),
    ("story", False, "Write a short story about a robot who learns to paint."),
    ("explain", False, "Explain how vaccines train the immune system."),
]




def truncated_draft(model, num_layers: int):
    """A self-speculative draft: the target's first `num_layers` blocks + its final norm and LM head.

    The modules are shared with `model` (no copy of the weights). Early layers without a trained exit
    are a rough draft; acceptance depends on how much the last layers change the prediction.
    """
    from dataclasses import replace

    from tokenmind.model.transformer import Transformer

    with torch.device("meta"):
        draft = Transformer(replace(model.cfg, num_hidden_layers=num_layers))
    draft.embed_tokens, draft.norm, draft.lm_head, draft.rotary = model.embed_tokens, model.norm, model.lm_head, \
        model.rotary
    draft.layers = torch.nn.ModuleList(model.layers[:num_layers])
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,3,4,8", help="comma-separated draft lengths for the n-gram drafter")
    ap.add_argument("--adaptive-ks", default="8", help="n-gram configs with adaptive draft length (k = ceiling); "
                                                       "empty skips them")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=6, help="truncated self-draft depth; 0 skips it")
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--draft-repeats", type=int, default=1, help="the truncated draft is slow; time it fewer times")
    ap.add_argument("--medusa", default=None, help="a trained Medusa head directory to time (posttrain medusa)")
    ap.add_argument("--eagle", default=None, help="a trained EAGLE head directory to time (posttrain eagle)")
    ap.add_argument("--head-k", type=int, default=4, help="most drafts per step for the heads (adaptive)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine a second thread slows decode ~10x)")
    ap.add_argument("--prompts", default=None, help="comma-separated subset of prompt names")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.engine.speculative import SpeculativeConfig
    from tokenmind.model.load import load_model

    pre = load_model(args.model, dtype=torch.float32)
    model, tok = pre.model, pre.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    ks = [int(k) for k in args.ks.split(",") if k]
    adaptive_ks = [int(k) for k in args.adaptive_ks.split(",") if k]
    wanted = set(args.prompts.split(",")) if args.prompts else None
    load_start = os.getloadavg()[0]

    def llm(method=None, k=8, adaptive=False, ngram=args.max_ngram, draft=None, head=None):
        spec = None if method is None else SpeculativeConfig(method, k, adaptive, max_ngram=ngram, head=head)
        return LLM(pre, draft_model=draft, max_num_seqs=1, max_model_len=4096, speculative=spec)

    engines = {"plain": llm()}
    for k in ks:
        engines[f"ngram_k{k}"] = llm("ngram", k)
    for k in adaptive_ks:
        engines[f"ngram_k{k}_adaptive"] = llm("ngram", k, adaptive=True)
    draft_name = None
    if args.draft_layers:
        draft_name = f"self_draft_{args.draft_layers}of{model.cfg.num_hidden_layers}_k{args.draft_k}"
        engines[draft_name] = llm("draft", args.draft_k, draft=truncated_draft(model, args.draft_layers))
    heads = {method: path for method, path in (("medusa", args.medusa), ("eagle", args.eagle)) if path}
    for method, path in heads.items():
        engines[f"{method}_k{args.head_k}_adaptive"] = llm(method, args.head_k, adaptive=True, head=path)

    def run(name, ids):
        engine = engines[name].engine
        drafted, accepted, steps = engine.num_drafted, engine.num_accepted, engine.num_steps
        out = engines[name].generate(ids, params)[0]
        return out, {"drafted": engine.num_drafted - drafted, "accepted": engine.num_accepted - accepted,
                     "steps": engine.num_steps - steps}

    rows = []
    for name, helps, message in PROMPTS:
        if wanted and name not in wanted:
            continue
        ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        with torch.inference_mode():
            prefill_s = min(timed_call(lambda: model.hidden_states(torch.tensor([ids])))[0] for _ in range(2))
        ref, _ = run("plain", ids)  # also the warm-up
        n = len(ref.token_ids)
        configs = [c for c in engines if c != draft_name]
        times: dict[str, list[float]] = {c: [] for c in engines}
        stats, identical = {}, {}
        for _ in range(args.repeats):
            for cname in configs:
                dt, (out, st) = timed_call(lambda: run(cname, ids))
                times[cname].append(dt)
                identical[cname] = out.token_ids == ref.token_ids
                stats[cname] = st
        if draft_name is not None:
            for _ in range(args.draft_repeats):
                dt, (out, st) = timed_call(lambda: run(draft_name, ids))
                times[draft_name].append(dt)
                identical[draft_name] = out.token_ids == ref.token_ids
                stats[draft_name] = st
            times["plain"].append(timed_call(lambda: run("plain", ids))[0])  # keep plain side by side with it
        med = {c: statistics.median(v) for c, v in times.items()}
        row = {"prompt": name, "lookup_expected_to_help": helps, "prompt_tokens": len(ids), "generated_tokens": n,
               "finish_reason": ref.finish_reason, "prefill_s": round(prefill_s, 3),
               "output_head": tok.decode(ref.token_ids[:40]), "configs": {}}
        for c in times:
            st = stats[c]
            row["configs"][c] = {
                "median_s": round(med[c], 3),
                "tok_s": round(n / med[c], 2),
                "decode_tok_s": round(n / max(med[c] - prefill_s, 1e-9), 2),
                "speedup": round(med["plain"] / med[c], 3),
                "identical_to_plain": identical.get(c, True),
                "runs": len(times[c]),
                "stats": {**st, "acceptance_rate": round(st["accepted"] / st["drafted"], 4) if st["drafted"] else None,
                          "tokens_per_step": round(n / st["steps"], 3),
                          "acceptance_length": round((n - 1) / max(st["steps"] - 1, 1), 3)},  # the first step prefills
            }
        rows.append(row)
        print(json.dumps({"prompt": name, **{c: (v["speedup"], v["stats"]["acceptance_rate"])
                                             for c, v in row["configs"].items()}}), file=sys.stderr, flush=True)

    def geomean(xs):
        return round(statistics.geometric_mean(xs), 3) if xs else None

    summary = {}
    for c in rows[0]["configs"] if rows else []:
        for helps in (True, False):
            sel = [r["configs"][c] for r in rows if r["lookup_expected_to_help"] == helps and c in r["configs"]]
            key = f"{c}|{'lookup_prompts' if helps else 'open_prompts'}"
            summary[key] = {"geomean_speedup": geomean([s["speedup"] for s in sel]),
                            "mean_acceptance": (round(statistics.mean(s["stats"]["acceptance_rate"] for s in sel), 3)
                                                if sel and sel[0]["stats"]["acceptance_rate"] is not None else None),
                            "mean_acceptance_length": (round(statistics.mean(s["stats"]["acceptance_length"]
                                                                             for s in sel), 3) if sel else None),
                            "all_identical": all(s["identical_to_plain"] for s in sel)}
    result = {
        "benchmark": "speculative_decoding_batch1_greedy",
        "model": pre.name,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "ks": ks,
        "adaptive_ks": adaptive_ks,
        "max_ngram": args.max_ngram,
        "repeats": args.repeats,
        "draft_model": (f"truncated self-draft: first {args.draft_layers} of {model.cfg.num_hidden_layers} layers "
                        "+ final norm + LM head of the target (shared weights, untrained exit)") if draft_name else None,
        "heads": {method: {"path": path, **json.loads((Path(path) / "head.json").read_text())}
                  for method, path in heads.items()},
        "head_k": args.head_k,
        "timing": "end to end per request (prefill included; decode_tok_s subtracts a separately timed prefill)",
        "machine": machine_info(loadavg_1m_start=round(load_start, 2)),
        "summary": summary,
        "prompts": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
