"""Offline batched throughput on SmolLM2-135M: tokenmind's paged engine vs `transformers` batched
generate vs llama.cpp.

A fixed, seeded set of requests with mixed prompt and output lengths arrives all at once.
- tokenmind runs them through continuous batching (weights dequantized from the GGUF to `--dtype`;
  with `--quantize` also a second run on the int8/int4 kernels);
- transformers runs them as left-padded batches that each go on until their longest request is
  done (only requested tokens are counted for it), same `--dtype`, same process;
- llama.cpp (`llama-cpp-python`, the file's own Q4_1 weights, in benchmarks/.venv-peers) runs
  them one after another, the way its Python binding serves them (it has no batching).
Peak memory: the process's peak RSS after each tokenmind run, and the KV pool's fixed size, which
is all the engine allocates for the cache however many requests come. Prints JSON.

    python benchmarks/bench_throughput.py [--requests 64] [--hf-batch 64] [--quantize int4]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PEER_SETUP, emit, machine_info, peer_python, percentile, run_llamacpp  # noqa: E402


def make_requests(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt_len = rng.choice([16, 32, 64, 128, 256])
        out_len = rng.choice([16, 32, 64, 128])
        reqs.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], out_len))
    return reqs


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


def run_llama(path: Path, reqs, threads: int) -> dict:
    r = run_llamacpp({"model": str(path), "threads": threads, "requests": reqs})
    tokens = sum(n for _, n in reqs)
    return {"seconds": round(r["seconds"], 2), "output_tok_s": round(tokens / r["seconds"], 1),
            "ttft_s": {"p50": round(percentile(r["ttft_s"], 50), 3), "p99": round(percentile(r["ttft_s"], 99), 3)},
            "tpot_s": {"p50": round(percentile(r["tpot_s"], 50), 4), "p99": round(percentile(r["tpot_s"], 99), 4)},
            "llama_cpp": r["llama_cpp"], "weights": "Q4_1 as stored", "batching": "none (one request at a time)"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=64,
                    help="transformers batch size (default 64: all requests in one batch, its fastest here)")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="tokenmind KV-cache budget")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights and activations, both tokenmind and transformers (bfloat16 is ~2x faster here)")
    ap.add_argument("--quantize", choices=("int8", "int4"), default=None, help="also run tokenmind quantized")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    from tokenmind.model.load import load_model, resolve_model_path

    path = resolve_model_path(args.model)
    ours = load_model(path, dtype=args.dtype)
    reqs = make_requests(args.requests, ours.model.cfg.vocab_size, args.seed)
    result = {"benchmark": "throughput", "model": path.name, "dtype": args.dtype, "requests": len(reqs),
              "prompt_tokens": sum(len(p) for p, _ in reqs), "output_tokens": sum(n for _, n in reqs),
              "machine": machine_info()}
    result["tokenmind"] = run_tokenmind(ours, reqs, args.kv_cache_mb * 2**20)
    result["tokenmind"]["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    if args.quantize:
        del ours
        quant = load_model(path, quantize=args.quantize)
        result[f"tokenmind_{args.quantize}"] = run_tokenmind(quant, reqs, args.kv_cache_mb * 2**20)
        del quant
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=getattr(torch, args.dtype)).eval()
        hf.generation_config.eos_token_id = None
        result["transformers"] = run_transformers(hf, reqs, args.hf_batch)
        del hf
    if not args.skip_llama:
        if peer_python() is None:
            result["notes"] = [f"llama.cpp skipped: its venv is missing; run `{PEER_SETUP}` once"]
        else:
            result["llama.cpp_Q4_1"] = run_llama(path, reqs, torch.get_num_threads())
    for peer in ("transformers", "llama.cpp_Q4_1"):
        if peer in result:
            result[f"ratio_vs_{peer}"] = {k: round(result[k]["output_tok_s"] / result[peer]["output_tok_s"], 2)
                                          for k in result if k.startswith("tokenmind")}
    result["machine"]["loadavg_1m_end"] = machine_info()["loadavg_1m"]
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
