"""Chaos against a real `tokenmind serve`: clients that give up, floods, huge bodies, SIGTERM under load.

Starts `tokenmind serve --model smollm2` (a subprocess, as a user would run it) and drives it
through one scenario after another. Every request's outcome is classified: completed, a 4xx or
5xx by error code, abandoned on purpose by the scenario's client, or *hung* (no answer within
the scenario's deadline: must be 0). While each scenario runs, an unrelated client polls
`GET /v1/models` and the worst latency it saw is reported. After each scenario the server must be
healthy and, once idle, hold no KV blocks (`kv_blocks_leaked` must be 0). Prints JSON.

    python benchmarks/bench_chaos.py [--dtype bfloat16] [--out result.json] [--only overload_300,...]

Scenarios (the issue's list): a long ~6k-token prompt with clients that time out before their
first token (the bug that once killed the engine), abandoned non-streaming requests, a storm of
disconnecting streams, 300 concurrent streams, a burst beyond the admission capacity (429), a
10 MB body (413), a 0.9 MB body (parsed off the event loop), queue-wait expiry (503, on a second
server with a short --max-queue-wait), and SIGTERM while 32 streams run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, free_port, machine_info, percentile, start_server  # noqa: E402

MODEL = "smollm2"
CHAT = "/v1/chat/completions"
DEADLINE = 300.0  # seconds after which a request that should have been answered counts as hung
PARAGRAPH = ("The history of the river valley is a long one, shaped by floods, harvests and the slow work of "
             "generations who built terraces, mills and bridges along its banks. ")


class Outcomes:
    """What happened to each request of a scenario."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.ttft: list[float] = []  # seconds to the first content token, completed streams
        self.headers: list[float] = []  # seconds to the response headers, streams

    def add(self, outcome: str) -> None:
        self.counts[outcome] += 1

    def summary(self) -> dict:
        c = self.counts
        by_code = {k: v for k, v in sorted(c.items()) if k[0] in "45"}
        return {"sent": sum(c.values()), "completed": c["completed"], "abandoned_by_client": c["abandoned"],
                "4xx": {k: v for k, v in by_code.items() if k[0] == "4"},
                "5xx": {k: v for k, v in by_code.items() if k[0] == "5"},
                "hung": c["hung"], "transport_errors": c["transport_error"],
                "ttft_s": {"p50": percentile(self.ttft, 50), "max": max(self.ttft, default=None)},
                "stream_headers_s": {"p50": percentile(self.headers, 50), "max": max(self.headers, default=None)}}


def chat(content: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "ignore_eos": True}


def _error_key(r: httpx.Response) -> str:
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return f"{r.status_code} {code}"


async def request(client: httpx.AsyncClient, url: str, body: dict | bytes, out: Outcomes, *,
                  give_up_after: float | None = None, read_chunks: int | None = None) -> None:
    """One request, classified into `out`. `give_up_after`: the client times out on purpose;
    `read_chunks`: a streaming client that disconnects after that many lines."""
    t0 = time.perf_counter()
    timeout = give_up_after if give_up_after is not None else DEADLINE
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = isinstance(body, dict) and body.get("stream")
    try:
        async with asyncio.timeout(timeout):
            if not stream:
                r = await client.post(url + CHAT, content=content, headers={"Content-Type": "application/json"})
                out.add("completed" if r.status_code == 200 else _error_key(r))
                return
            async with client.stream("POST", url + CHAT, content=content,
                                     headers={"Content-Type": "application/json"}) as r:
                out.headers.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    await r.aread()
                    out.add(_error_key(r))
                    return
                lines, first, result = 0, None, "hung"
                async for line in r.aiter_lines():
                    lines += 1
                    if read_chunks is not None and lines >= read_chunks:
                        out.add("abandoned")
                        return
                    if line == "data: [DONE]":
                        break
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            result = f"{500 if event['error'].get('type') == 'server_error' else 400} " \
                                     f"{event['error'].get('code')}"
                        elif first is None and any(ch.get("delta", {}).get("content") for ch in event["choices"]):
                            first = time.perf_counter() - t0
                        elif any(ch.get("finish_reason") for ch in event["choices"]):
                            result = "completed"
                if first is not None:
                    out.ttft.append(first)
                if result == "500 queue_timeout":
                    result = "503 queue_timeout"  # the status a non-streaming client would have got
                out.add(result)
    except TimeoutError:
        out.add("abandoned" if give_up_after is not None else "hung")
    except httpx.TransportError:
        out.add("transport_error")


async def probe(url: str, stop: asyncio.Event) -> float:
    """Poll an unrelated endpoint until `stop`; the worst latency seen (a failed poll counts as its wait)."""
    worst = 0.0
    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await client.get(url + "/v1/models")
            except httpx.HTTPError:
                pass
            worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.05)
    return worst


# ----------------------------------------------------------------------------- scenarios


async def abandon_before_first_token(client, url, out):
    """A ~6k-token prompt holds long prefill steps; three clients give up after 0.5 s meanwhile."""
    long = asyncio.create_task(request(client, url, chat(PARAGRAPH * 170, 16, False), out))
    await asyncio.sleep(0.5)
    await asyncio.gather(*(request(client, url, chat(f"quick {i}", 64, i == 1), out, give_up_after=0.5)
                           for i in range(3)))
    await long


async def abandoned_non_streaming(client, url, out):
    rng = random.Random(0)
    await asyncio.gather(*(request(client, url, chat(f"Tell me about topic {i}.", 256, False), out,
                                   give_up_after=rng.uniform(0.2, 3.0)) for i in range(32)))


async def disconnect_storm(client, url, out):
    rng = random.Random(1)
    await asyncio.gather(*(request(client, url, chat(f"Story {i}:", 200, True), out, read_chunks=rng.randint(1, 20))
                           for i in range(64)))


async def overload_300(client, url, out):
    await asyncio.gather(*(request(client, url, chat(f"Question {i}: why is the sky blue?", 64, True), out)
                           for i in range(300)))


async def burst_over_capacity(client, url, out):
    await asyncio.gather(*(request(client, url, chat(f"Hi {i}", 8, False), out) for i in range(400)))


async def huge_body(client, url, out):
    await request(client, url, json.dumps(chat("x" * (10 << 20), 8, False)).encode(), out)


async def large_body(client, url, out):
    await request(client, url, chat("word " * 180_000, 8, False), out)


async def queue_wait_expiry(client, url, out):
    await asyncio.gather(*(request(client, url, chat(f"Q{i}", 64, i % 2 == 0), out) for i in range(40)))


SCENARIOS = {"abandon_before_first_token": abandon_before_first_token,
             "abandoned_non_streaming": abandoned_non_streaming, "disconnect_storm": disconnect_storm,
             "overload_300": overload_300, "burst_over_capacity": burst_over_capacity, "huge_body": huge_body,
             "large_body": large_body}


async def run_scenario(name: str, fn, url: str) -> dict:
    out, stop = Outcomes(), asyncio.Event()
    watcher = asyncio.create_task(probe(url, stop))
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await fn(client, url, out)
    seconds = time.perf_counter() - t0
    stop.set()
    result = {"seconds": round(seconds, 2), **out.summary(), "worst_unrelated_latency_s": round(await watcher, 3)}
    result.update(await after_scenario(url))
    print(f"{name:>28}: {json.dumps(result)}", file=sys.stderr)
    return result


async def after_scenario(url: str) -> dict:
    """Health, then (once idle) the KV blocks still held: a leak if not 0."""
    async with httpx.AsyncClient(timeout=30) as client:
        alive = (await client.get(url + "/health")).status_code == 200
        deadline = time.monotonic() + 120
        while True:
            m = metrics((await client.get(url + "/metrics")).text)
            idle = m["tokenmind_num_requests_running"] == m["tokenmind_num_requests_waiting"] == 0 \
                and m["tokenmind_requests_in_flight"] == 0
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    return {"engine_alive": alive, "idle_after": idle, "kv_blocks_leaked": int(m["tokenmind_kv_cache_blocks_used"])}


def metrics(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def serve(args: argparse.Namespace, *flags: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmind.cli", "serve", "--model", args.model, "--served-model-name", MODEL,
           "--dtype", args.dtype, "--port", str(port), "--log-level", "warning", *flags]
    return start_server(cmd, port, "/health", stderr=log.open("w"))


async def sigterm_mid_load(proc: subprocess.Popen, url: str) -> dict:
    """32 streams of 200 tokens; SIGTERM after 2 s: every stream must end with [DONE], the process with 0."""
    out = Outcomes()
    async with httpx.AsyncClient(timeout=None) as client:
        tasks = [asyncio.create_task(request(client, url, chat(f"Essay {i}:", 200, True), out)) for i in range(32)]
        await asyncio.sleep(2.0)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
        code = await asyncio.to_thread(proc.wait, 120)
    return {**out.summary(), "exit_status": code, "exit_after_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--only", default=None, help="comma-separated scenario names (default: all)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    wanted = set(args.only.split(",")) if args.only else None
    logdir = Path("benchmarks/results")
    logdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}

    proc, url = serve(args, log=logdir / "chaos_server.log")
    try:
        asyncio.run(run_scenario("warm-up", lambda c, u, o: request(c, u, chat("Hello", 8, False), o), url))
        for name, fn in SCENARIOS.items():
            if wanted is None or name in wanted:
                results[name] = asyncio.run(run_scenario(name, fn, url))
        if wanted is None or "sigterm_mid_load" in wanted:
            results["sigterm_mid_load"] = asyncio.run(sigterm_mid_load(proc, url))
            print(f"{'sigterm_mid_load':>28}: {json.dumps(results['sigterm_mid_load'])}", file=sys.stderr)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    if wanted is None or "queue_wait_expiry" in wanted:
        proc, url = serve(args, "--max-num-seqs", "4", "--max-queue-wait", "2", log=logdir / "chaos_server2.log")
        try:
            results["queue_wait_expiry"] = asyncio.run(run_scenario("queue_wait_expiry", queue_wait_expiry, url))
        finally:
            proc.terminate()
            proc.wait(60)
    totals = {"hung": sum(r["hung"] for r in results.values()),
              "kv_blocks_leaked": sum(r.get("kv_blocks_leaked", 0) for r in results.values()),
              "5xx_other_than_queue_timeout": sum(n for r in results.values() for k, n in r["5xx"].items()
                                                  if "queue_timeout" not in k),
              "engine_alive_after_every_scenario": all(r.get("engine_alive", True) for r in results.values())}
    emit({"benchmark": "chaos", "model": args.model, "dtype": args.dtype, "machine": machine_info(),
          "totals": totals, "scenarios": results}, args.out)


if __name__ == "__main__":
    main()
