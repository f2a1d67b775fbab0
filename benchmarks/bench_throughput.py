"""Offline batched throughput on SmolLM2-135M: tokenmind's paged engine vs `transformers` batched generate.

A fixed, seeded set of requests with mixed prompt and output lengths arrives all at once.
tokenmind runs them through continuous batching; transformers runs them as left-padded
batches that each go on until their longest request is done (only requested tokens are
counted for it). Same fp32 weights (dequantized from the same GGUF), same process. Prints JSON.

    python benchmarks/bench_throughput.py [--requests 64] [--hf-batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time

import torch


def make_requests(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt_len = rng.choice([16, 32, 64, 128, 256])
        out_len = rng.choice([16, 32, 64, 128])
        reqs.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], out_len))
    return reqs


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_tokenmind(pretrained, reqs, kv_bytes: int):
    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams

    llm = LLM(pretrained, kv_cache_bytes=kv_bytes, max_num_seqs=len(reqs))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, progress=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs)
    ttft = [o.metrics["ttft_s"] for o in outs]
    tpot = [o.metrics["tpot_s"] for o in outs if o.metrics["tpot_s"] is not None]
    stats = llm.engine.stats()
    return {"seconds": round(dt, 2), "output_tok_s": round(tokens / dt, 1),
            "ttft_s": {"p50": round(percentile(ttft, 50), 3), "p99": round(percentile(ttft, 99), 3)},
            "tpot_s": {"p50": round(percentile(tpot, 50), 4), "p99": round(percentile(tpot, 99), 4)},
            "kv_cache_bytes_budget": kv_bytes, "preemptions": stats.num_preemptions,
            "prefix_hit_rate": round(stats.prefix_cache_hit_rate, 3)}


def run_transformers(hf, reqs, batch: int):
    t0 = time.perf_counter()
    tokens, ttft = 0, []
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(n for _, n in chunk)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + new
        tokens += sum(n for _, n in chunk)
        ttft += [time.perf_counter() - t0] * len(chunk)  # a batch's requests all finish together
    dt = time.perf_counter() - t0
    return {"seconds": round(dt, 2), "output_tok_s": round(tokens / dt, 1), "batch_size": batch,
            "completion_s": {"p50": round(statistics.median(ttft), 2), "p99": round(percentile(ttft, 99), 2)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="tokenmind KV-cache budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    import transformers

    from tokenmind.pretrained import load_pretrained, resolve_model_path

    path = resolve_model_path(args.model)
    ours = load_pretrained(path)
    reqs = make_requests(args.requests, ours.model.cfg.vocab_size, args.seed)
    result = {"benchmark": "throughput", "model": path.name, "dtype": "float32", "requests": len(reqs),
              "prompt_tokens": sum(len(p) for p, _ in reqs), "output_tokens": sum(n for _, n in reqs),
              "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}
    result["tokenmind"] = run_tokenmind(ours, reqs, args.kv_cache_mb * 2**20)
    result["peak_rss_mb_after_tokenmind"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    if not args.skip_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        result["transformers"] = run_transformers(hf, reqs, args.hf_batch)
        result["ratio_vs_transformers"] = round(result["tokenmind"]["output_tok_s"]
                                                / result["transformers"]["output_tok_s"], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
