"""Serving throughput and latency of `tokenmind serve`: a concurrency sweep of streaming chat requests over HTTP.

At each concurrency level c, c clients keep one streaming /v1/chat/completions request each in
flight until `--requests` (default 2c, at least 8) have completed. Per level: requests/s, output
tokens/s, time to first token and time per output token (p50, p99), from the client's side of
the wire. Prints JSON.

By default the script starts the server itself (the library call behind `tokenmind serve
--model smollm2`) on a free local port and stops it afterwards; `--url` measures a server that is
already running. A peer server is measured in the same run, level by level alternating with
tokenmind so machine noise hits both alike: `--peer llama.cpp` starts llama.cpp's OpenAI server
(`llama_cpp.server` from benchmarks/.venv-peers, made by `bash benchmarks/setup_peers.sh`) on the
same GGUF, with `--interrupt_requests False` (by default it cancels the request in flight whenever
a new one arrives, which fails every concurrent stream but the last); `--peer-url` measures any
other running OpenAI-compatible server.

    python benchmarks/bench_serve.py [--concurrency 1,4,16,64] [--max-tokens 64] [--quantize int4] \
        [--peer llama.cpp] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (PEER_PYTHON, PEER_SETUP, emit, free_port, machine_info, peer_python,  # noqa: E402
                     percentile, start_server)

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "What causes the seasons on Earth?", "Give three tips for learning a new language.",
    "Why is the sky blue?", "Describe how a bicycle works.", "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.", "How do vaccines train the immune system?",
    "What is a prime number? Give examples.", "Explain recursion to a child.",
    "List the planets of the solar system in order.", "What does a compiler do?",
    "How do bees make honey?", "Why do we need sleep?",
]

SERVER = """
from tokenmind.serve import ServeConfig, run_server
run_server(ServeConfig(model={model!r}, port={port}, served_model_name="smollm2", dtype={dtype!r},
                       quantization={quantize!r}, kv_cache_bytes={kv}, max_num_seqs={seqs}, max_queue=1024,
                       log_level="warning"))
"""


async def one_request(client: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int,
                      api_key: str | None) -> dict:
    """Stream one chat completion; the client-side timings of its tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    first = last = None
    chunks, tokens = 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    tokens = chunks if tokens is None else tokens  # a peer without usage in streams: count content chunks
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None}


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    api_key: str | None) -> dict:
    queue = list(range(num_requests))
    results: list[dict] = []
    errors: list[str] = []  # a failed request is counted, not fatal: peers differ in what they survive
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                try:
                    results.append(await one_request(client, url, model, QUESTIONS[i % len(QUESTIONS)],
                                                     max_tokens, api_key))
                except httpx.HTTPError as e:
                    errors.append(f"{type(e).__name__}: {e}"[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    return {"concurrency": concurrency, "requests": len(results), "failed": len(errors),
            "first_errors": sorted(set(errors))[:3], "wall_s": round(wall, 3),
            "requests_per_s": round(len(results) / wall, 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "mean_output_tokens": round(statistics.mean(r["tokens"] for r in results), 1) if results else 0,
            "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)}}


def start_tokenmind(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    seqs = max(int(c) for c in args.concurrency.split(","))
    code = SERVER.format(model=args.model, port=port, dtype=args.dtype, quantize=args.quantize,
                         kv=args.kv_cache_mib * 2**20, seqs=seqs)
    return start_server([sys.executable, "-c", code], port, "/health")


def start_llamacpp(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """llama.cpp's OpenAI server on the same GGUF, with as many threads as torch uses here."""
    from tokenmind.model.load import resolve_model_path

    import torch

    if peer_python() is None:
        raise SystemExit(f"--peer llama.cpp needs the peer venv; run `{PEER_SETUP}` once")
    port = free_port()
    threads = str(torch.get_num_threads())
    cmd = [str(PEER_PYTHON), "-m", "llama_cpp.server", "--model", str(resolve_model_path(args.model)),
           "--model_alias", args.peer_model, "--n_threads", threads, "--n_threads_batch", threads,
           "--n_ctx", "2048", "--verbose", "False", "--interrupt_requests", "False",  # queue, do not cancel
           "--host", "127.0.0.1", "--port", str(port)]
    return start_server(cmd, port, "/v1/models")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model to serve when the script starts the server")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="KV pool of the started server (MiB)")
    ap.add_argument("--url", default=None, help="measure this running tokenmind server instead of starting one")
    ap.add_argument("--served-model", default="smollm2", help="the `model` name to send to --url")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--quantize", choices=("int8", "int4"), default=None, help="weight quantization of the started server")
    ap.add_argument("--peer", choices=("llama.cpp",), default=None, help="start this peer server and measure it too")
    ap.add_argument("--peer-url", default=None, help="a running OpenAI-compatible peer server to measure alongside")
    ap.add_argument("--peer-model", default="smollm2", help="the `model` name the peer expects")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: 2c, at least 8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()

    procs = []
    if args.url:
        url = args.url
    else:
        proc, url = start_tokenmind(args)
        procs.append(proc)
    targets = {"tokenmind": (url, args.served_model)}
    if args.peer == "llama.cpp":
        proc, peer_url = start_llamacpp(args)
        procs.append(proc)
        targets["llama.cpp"] = (peer_url, args.peer_model)
    elif args.peer_url:
        targets["peer"] = (args.peer_url.rstrip("/"), args.peer_model)
    results: dict[str, list[dict]] = {name: [] for name in targets}
    try:
        for name, (target, model) in targets.items():  # warm-up: first-request costs stay out of the numbers
            asyncio.run(run_level(target, model, 1, 1, 8, args.api_key))
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.requests or max(2 * c, 8)
            for name, (target, model) in targets.items():
                level = asyncio.run(run_level(target, model, c, n, args.max_tokens, args.api_key))
                results[name].append(level)
                print(f"{name:>9} c={c:<3} {level['requests_per_s']:7.2f} req/s {level['output_tokens_per_s']:8.1f} "
                      f"tok/s  TTFT p50 {level['ttft_s']['p50']}s  TPOT p50 {level['tpot_s']['p50']}  "
                      f"failed {level['failed']}", file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    result = {"benchmark": "serve", "model": args.model, "max_tokens": args.max_tokens,
              "tokenmind": {"dtype": args.dtype, "quantize": args.quantize}, "machine": machine_info(),
              "targets": {name: t[0] for name, t in targets.items()}, "results": results}
    if len(results) == 2:
        peer = [name for name in results if name != "tokenmind"][0]
        result[f"output_tok_s_ratio_vs_{peer}"] = {
            str(ours["concurrency"]): round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2)
            for ours, theirs in zip(results["tokenmind"], results[peer]) if theirs["output_tokens_per_s"]}
    emit(result, args.out)


if __name__ == "__main__":
    main()
