"""Decoding strategies scored on a verifiable task: SmolLM2-135M-Instruct on easy arithmetic.

The problems are `posttrain.tasks.multistep_items` (one or two operations on small integers, e.g.
"What is (7 * 3) + 17? Answer with a number."), checked by the numeric verifier. Four ways to get
one answer per problem, all through the engine, all problems batched:

* greedy: one argmax completion;
* beam search (`SamplingParams(num_beams=B)`): the best of B beams;
* self-consistency (`posttrain.sampling.self_consistency`): k samples, the majority of their
  extracted final numbers; no verifier, no gold answer;
* best-of-k with the oracle verifier: the same k samples, right when any of them is (the pick of a
  verifier that knows the answer, an upper bound for any reranker of these samples).

Self-consistency and best-of-k share one sampling run (the same seeded samples; the verifier's
cost is nothing next to sampling), so they report the same time. Also reported: pass@1, the mean
accuracy of single samples. Prints JSON.

    python benchmarks/bench_decoding_strategies.py [--problems 40] [--k 8] [--beams 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, timed_call  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--k", type=int, default=8, help="samples for self-consistency and best-of-k")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.model.load import load_model
    from tokenmind.posttrain.sampling import self_consistency
    from tokenmind.posttrain.tasks import multistep_items, numeric_reward

    pre = load_model(args.model, dtype=args.dtype)
    llm = LLM(pre, max_num_seqs=64)
    items = [{**it, "prompt": [{"role": "user", "content": f"What is {it['expression']}? Answer with a number."}]}
             for it in multistep_items(args.problems, seed=0, min_steps=1, max_steps=2)]
    prompts = [llm.tokenizer.apply_chat_template(it["prompt"], add_generation_prompt=True) for it in items]

    def right(item, text: str | None) -> bool:
        return text is not None and bool(numeric_reward(item["prompt"], text, answer=item["answer"]))

    def row(seconds: float, correct: list[bool], tokens: list[int], **extra) -> dict:
        return {"accuracy": round(sum(correct) / len(correct), 3), "correct": sum(correct),
                "seconds": round(seconds, 1), "seconds_per_problem": round(seconds / len(items), 2),
                "mean_output_tokens": round(statistics.mean(tokens), 1), **extra}

    results = {}
    greedy_s, greedy = timed_call(lambda: llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens,
                                                                                temperature=0)))
    results["greedy"] = row(greedy_s, [right(it, o.text) for it, o in zip(items, greedy)],
                            [len(o.token_ids) for o in greedy])
    beam_params = SamplingParams(max_tokens=args.max_tokens, num_beams=args.beams,
                                 length_penalty=args.length_penalty)
    beam_s, beams = timed_call(lambda: llm.generate(prompts, beam_params))
    results[f"beam_{args.beams}"] = row(beam_s, [right(it, o.text) for it, o in zip(items, beams)],
                                        [len(o.token_ids) for o in beams], length_penalty=args.length_penalty)
    sample_params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    sc_s, votes = timed_call(lambda: self_consistency(llm, items, args.k, "numeric", sample_params, args.seed))
    sample_right = [[right(it, t) for t in v.texts] for it, v in zip(items, votes)]
    sample_tokens = [len(llm.tokenizer.encode(t, add_special_tokens=False)) for v in votes for t in v.texts]
    results[f"self_consistency_{args.k}"] = row(
        sc_s, [right(it, v.answer) for it, v in zip(items, votes)], sample_tokens,
        mean_vote_share=round(statistics.mean(v.share for v in votes), 3),
        pass_at_1=round(statistics.mean(r for rs in sample_right for r in rs), 3))
    results[f"best_of_{args.k}_oracle"] = row(sc_s, [any(rs) for rs in sample_right], sample_tokens,
                                              note="the self-consistency samples, picked by the numeric verifier")
    emit({
        "benchmark": "decoding_strategies_arithmetic",
        "model": pre.name, "dtype": args.dtype, "task": "multistep_items(min_steps=1, max_steps=2), numeric verifier",
        "problems": len(items), "max_tokens": args.max_tokens,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed},
        "example_prompt": items[0]["prompt"][0]["content"], "example_greedy": greedy[0].text,
        "machine": machine_info(),
        "results": results,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
