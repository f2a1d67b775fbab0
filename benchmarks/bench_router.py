"""Prefix-cache-aware routing vs round-robin over the same `tokenmind serve` replicas, on a multi-turn chat workload.

Starts `--replicas` engine processes (the `tokenmind serve --replicas N` launcher) and, in this
process, one router per policy over those same replicas. Each policy then runs the same kind of
workload: `--conversations` chats, each with its own long system prompt, run concurrently; each
chat sends `--turns` turns one after the other, every turn appending the model's reply and the next
question to its conversation, so each prompt extends the previous one. Each policy gets chats with
other system prompts (of the same length), so neither finds the other's prefixes in the caches.

Per policy: the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each reply's
`usage.prompt_tokens_details.cached_tokens`), TTFT p50/p95, output tokens/s and requests/s over the
run, how many requests each replica got, and the router's own aggregate of the replicas' hit rates
(cumulative since the replicas started). Requests are streamed and timed by `bench_serve.one_request`.
Prints JSON.

    python benchmarks/bench_router.py [--model smollm2] [--replicas 2] [--conversations 4] [--turns 4] \
        [--system-chars 1200] [--max-tokens 16] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, percentile  # noqa: E402
from bench_serve import QUESTIONS, RequestFailed, one_request  # noqa: E402

from tokenmind.serve.config import ServeConfig  # noqa: E402
from tokenmind.serve.replicas import LocalReplicas, router_server  # noqa: E402
from tokenmind.serve.router import RouterConfig  # noqa: E402

SERVED = "smollm2"
PERSONAS = ["a ship's navigator", "a pastry chef", "a museum guide", "a chess coach", "a park ranger",
            "a radio host", "a librarian", "a mountain guide", "a tax advisor", "a gardener", "a watchmaker",
            "a lighthouse keeper"]
RULES = ["Keep answers short and concrete.", "Use plain words a child would understand.",
         "Mention one fact from your own work in each answer.", "Never use lists; answer in sentences.",
         "If a question is unclear, say what you assume.", "Be warm but do not flatter the user.",
         "Give numbers with their units.", "Avoid jargon unless you explain it.",
         "End with a question back to the user when it helps.", "Do not repeat the question."]


def system_prompt(rng: random.Random, chars: int) -> str:
    """A distinct persona with rules in a random order, padded with more rules to `chars` characters."""
    text = f"You are {rng.choice(PERSONAS)} (id {rng.randrange(10**8):08d}). Follow these rules."
    while len(text) < chars:
        text += " " + rng.choice(RULES)
    return text[:chars]


def questions(rng: random.Random, turns: int) -> list[str]:
    return [rng.choice(QUESTIONS) for _ in range(turns)]


async def conversation(client: httpx.AsyncClient, url: str, system: str, asks: list[str], max_tokens: int) -> list:
    """One chat, turn after turn; each turn's timings and token counts."""
    messages = [{"role": "system", "content": system}]
    results = []
    for ask in asks:
        messages.append({"role": "user", "content": ask})
        body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        result = await one_request(client, url, body, "plain", None)
        results.append(result)
        messages.append({"role": "assistant", "content": result["output"]})
    return results


async def run_workload(url: str, chats: list[tuple[str, list[str]]], max_tokens: int) -> tuple[list, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(conversation(client, url, s, q, max_tokens) for s, q in chats))
        return [r for turns in done for r in turns], time.perf_counter() - t0


def router_counts(url: str) -> tuple[dict[str, float], float | None]:
    """Requests routed to each replica, and the router's aggregate prefix-cache hit rate."""
    routed, rate = {}, None
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("tokenmind_router_replica_routed_total{"):
            routed[line.split('replica="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith("tokenmind_router_prefix_cache_hit_rate "):
            rate = float(line.split()[-1])
    return routed, rate


def measure(policy: str, urls: list[str], serve: ServeConfig, chats: list, max_tokens: int) -> dict:
    """Run the chats through a fresh router with `policy` over the running replicas."""
    server = router_server(serve, RouterConfig(policy=policy), urls)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        results, wall = asyncio.run(run_workload(url, chats, max_tokens))
        routed, router_rate = router_counts(url)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    # turn 1 of every chat is a new prompt wherever it goes: the later turns show what routing changes
    later = [r["ttft"] for i, r in enumerate(results) if i % len(chats[0][1])]
    return {"policy": policy, "requests": len(results), "wall_s": round(wall, 2),
            "prefix_cache_hit_rate": round(cached / prompt, 4), "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_s": {"p50": percentile(ttft, 50), "p95": percentile(ttft, 95)},
            "ttft_later_turns_s": {"p50": percentile(later, 50), "p95": percentile(later, 95)},
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "requests_per_s": round(len(results) / wall, 3), "routed_per_replica": routed,
            "router_aggregate_hit_rate_cumulative": router_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model the replicas serve (alias, HF dir or .gguf)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--replica-threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool of each replica (MiB)")
    ap.add_argument("--conversations", type=int, default=4, help="chats run at once, each with its system prompt")
    ap.add_argument("--turns", type=int, default=4, help="turns per chat")
    ap.add_argument("--system-chars", type=int, default=1200, help="length of each system prompt")
    ap.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn (EOS ignored)")
    ap.add_argument("--policies", default="round_robin,prefix", help="router policies, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rng = random.Random(args.seed)
    workloads = {p: [(system_prompt(rng, args.system_chars), questions(rng, args.turns))
                     for _ in range(args.conversations)] for p in policies}
    serve = ServeConfig(model=args.model, served_model_name=SERVED, dtype=args.dtype, port=0, log_level="warning",
                        kv_cache_bytes=args.kv_cache_mib << 20, max_num_seqs=max(8, args.conversations))
    launch = RouterConfig(replicas=args.replicas, replica_threads=args.replica_threads)
    t0 = time.perf_counter()
    with LocalReplicas(serve, launch) as replicas:
        urls = replicas.start()
        started = time.perf_counter() - t0
        for url in urls:  # warm-up, straight to each replica: first-request costs stay out of the numbers
            asyncio.run(run_workload(url, [("You are terse.", ["Hi."])], 4))
        runs = []
        for policy in policies:
            try:
                runs.append(measure(policy, urls, serve, workloads[policy], args.max_tokens))
            except (httpx.HTTPError, RequestFailed) as e:
                raise SystemExit(f"the {policy} run failed: {e}") from e
            print(f"{policy:>12}: hit rate {runs[-1]['prefix_cache_hit_rate']:.1%}  TTFT p50 "
                  f"{runs[-1]['ttft_s']['p50']}s p95 {runs[-1]['ttft_s']['p95']}s  "
                  f"{runs[-1]['output_tokens_per_s']} tok/s", file=sys.stderr)
    by = {r["policy"]: r for r in runs}
    result = {"benchmark": "router", "model": args.model, "dtype": args.dtype, "replicas": args.replicas,
              "replica_threads": args.replica_threads, "conversations": args.conversations, "turns": args.turns,
              "system_chars": args.system_chars, "max_tokens": args.max_tokens, "replica_start_s": round(started, 1),
              "machine": machine_info(), "runs": runs}
    if {"prefix", "round_robin"} <= by.keys():
        p, rr = by["prefix"], by["round_robin"]
        result["prefix_vs_round_robin"] = {
            "hit_rate": [p["prefix_cache_hit_rate"], rr["prefix_cache_hit_rate"]],
            "ttft_p50_ratio": round(p["ttft_s"]["p50"] / rr["ttft_s"]["p50"], 3),
            "throughput_ratio": round(p["output_tokens_per_s"] / rr["output_tokens_per_s"], 3)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
