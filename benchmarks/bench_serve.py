"""Serving throughput and latency of `tokenmind serve` (plain, tool-calling and JSON-schema chat), beside llama-server.

A concurrency sweep of streaming chat requests over HTTP in three scenarios (plain text, forced
tool calls, JSON-schema replies), optionally against llama.cpp's own C++ server.

At each concurrency level c, c clients keep one streaming /v1/chat/completions request each in
flight until `--requests` (default 2c, at least 8) have completed. Per level: requests/s, output
tokens/s, time to first token, time per output token and request latency (p50, p99), from the
client's side of the wire. Prints JSON.

Scenarios (`--scenario plain|tools|json|all`, or a comma list; default plain):

- plain: a short question, `ignore_eos`, exactly `--max-tokens` output tokens per request.
- tools: a question that needs one of three functions (`get_weather`, `get_time`,
  `convert_currency`, small JSON-schema parameters), `tool_choice: "required"`,
  `parallel_tool_calls: false`. A request succeeds when the reply carries `tool_calls`, each naming
  a given function, with `function.arguments` that parse as JSON and validate (jsonschema) against
  that function's `parameters`.
- json: the plain scenario's questions with `response_format: {"type": "json_schema", ...,
  "strict": true}`; success = the content parses as JSON and validates against the schema.
  Constrained outputs end when the JSON closes, so they are shorter than plain ones: compare their
  time per output token (TPOT), not totals. `constrained_tpot` in the output puts json's TPOT p50
  beside plain's at each level, per server.

TTFT is the time to the first chunk that carries output (content or a tool-call delta). A server
that announces a tool call only once its arguments are complete (tokenmind does: a client never
sees a call that later fails to parse) shows a TTFT close to the whole latency in the tools
scenario, and no TPOT there (one output chunk).

By default the script starts the server itself (the library call behind `tokenmind serve
--model smollm2`) on a free local port and stops it afterwards; `--url` measures a server that is
already running. A peer server is measured in the same run, level by level alternating with
tokenmind so machine noise hits both alike: `--peer llama.cpp` starts llama.cpp's own C++ server
(`llama-server`, parallel slots with continuous batching; build it once with `bash
benchmarks/setup_llama_server.sh`) on the same GGUF with `-t <torch threads> -np <max
concurrency> -c <np x --peer-ctx-per-slot> --jinja` (`--llama-server PATH` picks another binary);
`--peer-url` measures any other running OpenAI-compatible server. Both get the same requests. A
model template without tool support (SmolLM2's) makes llama-server ignore `tools` and
`tool_choice` and answer in prose, which the tools scenario counts as failures.

Output: `summary` (one row per scenario, level and server), `results_by_scenario`, per-level
`success_rate` and `invalid_examples` for tools/json, and `constrained_tpot`; `results` and
`output_tok_s_ratio_vs_<peer>` hold the plain scenario, as in earlier versions of this script.

    bash benchmarks/setup_llama_server.sh   # once: builds llama-server (~15 min on 2 cores), cached
    python benchmarks/bench_serve.py [--scenario all] [--concurrency 1,4,16,64] [--max-tokens 64] \
        [--quantize int4] [--peer llama.cpp] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (SETUP_LLAMA_SERVER, emit, free_port, llama_server_binary, machine_info,  # noqa: E402
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

TOOL_QUESTIONS = [
    "What's the weather like in Paris right now, in celsius?", "What time is it in Tokyo?",
    "How much is 250 US dollars in euros?", "Is it cold in Oslo today? Use fahrenheit.",
    "What is the current time in New York?", "Convert 1000 yen to British pounds.",
    "Tell me the temperature in Berlin in celsius.", "What time is it now in Sydney?",
    "How many dollars do I get for 80 euros?", "Weather forecast for Madrid, please, in fahrenheit.",
    "I need the current UTC time.", "Convert 42.5 pounds to US dollars.",
    "What's the weather in Cairo? Celsius.", "What time is it in Paris?",
    "How much is 5000 yen in euros?", "Is it raining in London? Give the temperature in celsius.",
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40, "description": "city name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current local time in a time zone.",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "enum": ["UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo",
                                                "Australia/Sydney"]}},
            "required": ["zone"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money from one currency to another.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "from": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
            "to": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]}},
            "required": ["amount", "from", "to"], "additionalProperties": False}}},
]

# String lengths are bounded so that a reply fits in ~96 tokens: a strict schema without bounds lets
# a small model write one string until max_tokens cuts it (then the JSON is unfinished, a failure).
ANSWER_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "answer": {"type": "string", "maxLength": 160},
    "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["topic", "answer", "confidence"], "additionalProperties": False}

SCENARIOS = ("plain", "tools", "json")
VALIDATORS = {t["function"]["name"]: jsonschema.Draft202012Validator(t["function"]["parameters"]) for t in TOOLS}
ANSWER_VALIDATOR = jsonschema.Draft202012Validator(ANSWER_SCHEMA)

SERVER = """
from tokenmind.serve import ServeConfig, run_server
run_server(ServeConfig(model={model!r}, port={port}, served_model_name="smollm2", dtype={dtype!r},
                       quantization={quantize!r}, kv_cache_bytes={kv}, max_num_seqs={seqs}, max_queue=1024,
                       log_level="warning"))
"""


class RequestFailed(Exception):
    """The server answered with an error status or an error event."""


def request_body(scenario: str, i: int, model: str, max_tokens: int) -> dict:
    """The i-th request of a scenario; the same for every server."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if scenario == "plain":
        body["messages"] = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        body["ignore_eos"] = True
    elif scenario == "tools":
        body["messages"] = [{"role": "user", "content": TOOL_QUESTIONS[i % len(TOOL_QUESTIONS)]}]
        body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    elif scenario == "json":
        body["messages"] = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    else:
        raise ValueError(scenario)
    return body


def check_output(scenario: str, content: str, calls: list[dict]) -> str | None:
    """Why the reply fails its scenario's contract, or None when it meets it."""
    if scenario == "tools":
        if not calls:
            return f"no tool_calls (content {content[:120]!r})"
        for call in calls:
            validator = VALIDATORS.get(call["name"])
            if validator is None:
                return f"unknown function {call['name']!r}"
            try:
                arguments = json.loads(call["arguments"])
            except json.JSONDecodeError as e:
                return f"{call['name']} arguments are not JSON ({e}): {call['arguments'][:120]!r}"
            error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
            if error is not None:
                return f"{call['name']} arguments {call['arguments'][:120]} invalid: {error.message}"
        return None
    if scenario == "json":
        try:
            value = json.loads(content)
        except json.JSONDecodeError as e:
            return f"content is not JSON ({e}): {content[:160]!r}"
        error = jsonschema.exceptions.best_match(ANSWER_VALIDATOR.iter_errors(value))
        return None if error is None else f"content {content[:160]} invalid: {error.message}"
    return None


async def one_request(client: httpx.AsyncClient, url: str, body: dict, scenario: str, api_key: str | None) -> dict:
    """Stream one chat completion; the client-side timings of its output, and whether it is valid."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    first = last = None
    chunks, tokens, prompt_tokens, cached_tokens = 0, None, None, None
    content: list[str] = []
    calls: dict[int, dict] = {}
    finish = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code >= 400:
            raise RequestFailed(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:400]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):
                raise RequestFailed(f"error event: {json.dumps(event['error'])[:400]}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                prompt_tokens = event["usage"].get("prompt_tokens")
                cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            output = False
            for choice in event.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content.append(delta["content"])
                    output = True
                if delta.get("reasoning_content"):
                    output = True
                for tc in delta.get("tool_calls") or []:
                    call = calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                    fn = tc.get("function") or {}
                    call["name"] += fn.get("name") or ""
                    call["arguments"] += fn.get("arguments") or ""
                    output = True
                finish = choice.get("finish_reason") or finish
            if output:
                last = time.perf_counter()
                first = first or last
                chunks += 1
    end = time.perf_counter()
    tokens = chunks if tokens is None else tokens  # a server without usage in streams: count output chunks
    text = "".join(content)
    problem = check_output(scenario, text, [calls[k] for k in sorted(calls)])
    return {"ttft": (first or end) - t0, "latency": end - t0, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "finish": finish,
            "tpot": (last - first) / (tokens - 1) if first is not None and chunks > 1 and tokens > 1 else None,
            "problem": problem, "output": text[:300] if not calls else json.dumps(list(calls.values()))[:300]}


async def run_level(url: str, model: str, scenario: str, concurrency: int, num_requests: int, max_tokens: int,
                    api_key: str | None) -> dict:
    queue = list(range(num_requests))[::-1]
    results: list[dict] = []
    errors: list[str] = []  # a failed request is counted, not fatal: servers differ in what they survive
    failed_request = None
    # A new connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a
    # few requests, and a request sent on it just then fails ("Server disconnected without sending a
    # response"); on loopback a connect costs well under a millisecond, the same for every server.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            nonlocal failed_request
            while queue:
                body = request_body(scenario, queue.pop(), model, max_tokens)
                try:
                    results.append(await one_request(client, url, body, scenario, api_key))
                except (httpx.HTTPError, RequestFailed, json.JSONDecodeError) as e:
                    errors.append(f"{type(e).__name__}: {e}"[:500])
                    failed_request = failed_request or body

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    level = {"scenario": scenario, "concurrency": concurrency, "requests": len(results), "failed": len(errors),
             "first_errors": sorted(set(errors))[:3], "wall_s": round(wall, 3),
             "requests_per_s": round(len(results) / wall, 3),
             "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
             "mean_output_tokens": round(statistics.mean(r["tokens"] for r in results), 1) if results else 0,
             "mean_prompt_tokens": round(statistics.mean(prompts), 1) if (prompts := [
                 r["prompt_tokens"] for r in results if r["prompt_tokens"] is not None]) else None,
             "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
             "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
             "latency_s": {"p50": percentile([r["latency"] for r in results], 50),
                           "p99": percentile([r["latency"] for r in results], 99)},
             "finish_reasons": dict(Counter(str(r["finish"]) for r in results))}
    if failed_request is not None:
        level["first_failed_request"] = failed_request
    if scenario != "plain":
        valid = [r for r in results if r["problem"] is None]
        level["valid"] = len(valid)
        level["success_rate"] = round(len(valid) / num_requests, 4)  # errors count as failures
        level["invalid_examples"] = sorted({r["problem"][:400] for r in results if r["problem"]})[:3]
        level["example_output"] = (valid or results or [{"output": None}])[0]["output"]
    return level


def start_tokenmind(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    seqs = max(int(c) for c in args.concurrency.split(","))
    code = SERVER.format(model=args.model, port=port, dtype=args.dtype, quantize=args.quantize,
                         kv=args.kv_cache_mib * 2**20, seqs=seqs)
    return start_server([sys.executable, "-c", code], port, "/health")


def start_llamacpp(args: argparse.Namespace, binary: Path) -> tuple[subprocess.Popen, str, dict]:
    """llama.cpp's C++ server on the same GGUF: as many threads as torch uses here, one slot per client."""
    import torch

    from tokenmind.model.load import resolve_model_path

    port = free_port()
    threads = str(torch.get_num_threads())
    slots = max(int(c) for c in args.concurrency.split(","))
    ctx = slots * args.peer_ctx_per_slot
    cmd = [str(binary), "-m", str(resolve_model_path(args.model)), "-t", threads, "-tb", threads, "-np", str(slots),
           "-c", str(ctx), "--jinja", "--alias", args.peer_model, "--no-webui", "--host", "127.0.0.1",
           "--port", str(port)]
    fd, log = tempfile.mkstemp(prefix="llama-server-", suffix=".log")  # its logs go to stderr: keep them
    try:
        proc, url = start_server(cmd, port, "/health", stderr=fd)
    except SystemExit:
        print(Path(log).read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        os.close(fd)  # the child has its own copy
    version = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True)
    info = {"binary": str(binary), "command": " ".join(cmd[1:]), "log": log,
            "version": (version.stdout + version.stderr).strip().splitlines()[:2]}
    build_info = binary.parent.parent / "BUILD_INFO"
    if build_info.exists():
        info["build"] = build_info.read_text().split()
    return proc, url, info


def summarize(results_by_scenario: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """One flat row per scenario × concurrency × server: the table a reader wants."""
    rows = []
    for scenario, per_target in results_by_scenario.items():
        for name, levels in per_target.items():
            for level in levels:
                rows.append({"scenario": scenario, "concurrency": level["concurrency"], "server": name,
                             "output_tok_s": level["output_tokens_per_s"], "ttft_p50_s": level["ttft_s"]["p50"],
                             "tpot_p50_s": level["tpot_s"]["p50"], "latency_p50_s": level["latency_s"]["p50"],
                             "mean_output_tokens": level["mean_output_tokens"],
                             "mean_prompt_tokens": level["mean_prompt_tokens"],
                             "success_rate": level.get("success_rate"), "failed": level["failed"]})
    return sorted(rows, key=lambda r: (SCENARIOS.index(r["scenario"]), r["concurrency"], r["server"]))


def constrained_tpot(results_by_scenario: dict[str, dict[str, list[dict]]]) -> dict:
    """Per server and level: TPOT p50 of the constrained scenarios beside plain's, and their ratio."""
    plain = results_by_scenario.get("plain", {})
    out: dict[str, dict] = {}
    for name, plain_levels in plain.items():
        for scenario in ("json", "tools"):
            for level in results_by_scenario.get(scenario, {}).get(name, []):
                base = next((p for p in plain_levels if p["concurrency"] == level["concurrency"]), None)
                ours, theirs = level["tpot_s"]["p50"], base and base["tpot_s"]["p50"]
                if ours is None or not theirs:
                    continue
                out.setdefault(name, {}).setdefault(str(level["concurrency"]), {}).update(
                    {"tpot_p50_plain_s": theirs, f"tpot_p50_{scenario}_s": ours,
                     f"{scenario}_over_plain": round(ours / theirs, 3)})
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'scenario':<8} {'c':>3} {'server':<10} {'tok/s':>8} {'TTFT p50':>9} {'TPOT p50':>9} {'lat p50':>8} "
          f"{'in tok':>6} {'out tok':>7} {'success':>8} {'failed':>6}", file=sys.stderr)

    def fmt(x, scale=1.0, digits=3, unit=""):
        return "-" if x is None else f"{x * scale:.{digits}f}{unit}"

    for r in rows:
        print(f"{r['scenario']:<8} {r['concurrency']:>3} {r['server']:<10} {r['output_tok_s']:>8.1f} "
              f"{fmt(r['ttft_p50_s']):>9} {fmt(r['tpot_p50_s'], 1000, 1, 'ms'):>9} {fmt(r['latency_p50_s']):>8} "
              f"{fmt(r['mean_prompt_tokens'], digits=0):>6} {r['mean_output_tokens']:>7} "
              f"{fmt(r['success_rate'], 100, 1, '%'):>8} {r['failed']:>6}",
              file=sys.stderr)


def parse_scenarios(text: str) -> list[str]:
    names = list(SCENARIOS) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        raise SystemExit(f"--scenario: unknown {unknown}; choose from {', '.join(SCENARIOS)}, a comma list, or all")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model to serve when the script starts the servers")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="KV pool of the started server (MiB)")
    ap.add_argument("--url", default=None, help="measure this running tokenmind server instead of starting one")
    ap.add_argument("--served-model", default="smollm2", help="the `model` name to send to --url")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--quantize", choices=("int8", "int4"), default=None,
                    help="weight quantization of the started server")
    ap.add_argument("--scenario", default="plain", help="plain, tools, json, a comma list of them, or all")
    ap.add_argument("--peer", choices=("llama.cpp",), default=None,
                    help=f"start this peer server and measure it too (llama.cpp: llama-server, see "
                         f"`{SETUP_LLAMA_SERVER}`)")
    ap.add_argument("--llama-server", default=None, help="path of the llama-server binary (default: the one "
                                                         "setup_llama_server.sh built for this CPU)")
    ap.add_argument("--peer-ctx-per-slot", type=int, default=1024, help="llama-server context per parallel slot")
    ap.add_argument("--peer-url", default=None, help="a running OpenAI-compatible peer server to measure alongside")
    ap.add_argument("--peer-model", default="smollm2", help="the `model` name the peer expects")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: 2c, at least 8)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="output tokens per request (plain ignores EOS; tools/json end when the call or JSON closes)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    scenarios = parse_scenarios(args.scenario)
    levels = [int(x) for x in args.concurrency.split(",")]

    # SIGTERM (a timeout, a kill) ends this process through `finally`, so the servers it started stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs = []
    peer_info = None
    # a missing binary is reported before anything starts
    binary = llama_server_binary(args.llama_server) if args.peer == "llama.cpp" else None
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            proc, url = start_tokenmind(args)
            procs.append(proc)
        targets = {"tokenmind": (url, args.served_model)}
        if args.peer == "llama.cpp":
            proc, peer_url, peer_info = start_llamacpp(args, binary)
            procs.append(proc)
            targets["llama.cpp"] = (peer_url, args.peer_model)
        elif args.peer_url:
            targets["peer"] = (args.peer_url.rstrip("/"), args.peer_model)
        results = {s: {name: [] for name in targets} for s in scenarios}
        for scenario in scenarios:  # warm-up: first-request costs (and grammar compiles) stay out of the numbers
            for name, (target, model) in targets.items():
                asyncio.run(run_level(target, model, scenario, 1, 1, 8, args.api_key))
        # Level by level, each scenario and server in turn, so that plain and json at one level run
        # minutes apart at most and machine noise hits every server alike.
        for c in levels:
            n = args.requests or max(2 * c, 8)
            for scenario in scenarios:
                for name, (target, model) in targets.items():
                    level = asyncio.run(run_level(target, model, scenario, c, n, args.max_tokens, args.api_key))
                    results[scenario][name].append(level)
                    success = f"  valid {level['success_rate']:.0%}" if "success_rate" in level else ""
                    print(f"{scenario:>6} {name:>9} c={c:<3} {level['requests_per_s']:7.2f} req/s "
                          f"{level['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {level['ttft_s']['p50']}s  "
                          f"TPOT p50 {level['tpot_s']['p50']}  failed {level['failed']}{success}", file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    rows = summarize(results)
    print_table(rows)
    result = {"benchmark": "serve", "model": args.model, "max_tokens": args.max_tokens, "scenarios": scenarios,
              "tokenmind": {"dtype": args.dtype, "quantize": args.quantize}, "machine": machine_info(),
              "targets": {name: t[0] for name, t in targets.items()}}
    if peer_info:
        result["llama_server"] = peer_info
    if "plain" in results:
        result["results"] = results["plain"]  # the plain scenario, where earlier versions of this script kept it
    result["results_by_scenario"] = results
    result["summary"] = rows
    if len(targets) == 2:
        peer = next(name for name in targets if name != "tokenmind")
        ratios = {scenario: {str(ours["concurrency"]):
                             round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2)
                             for ours, theirs in zip(per["tokenmind"], per[peer]) if theirs["output_tokens_per_s"]}
                  for scenario, per in results.items()}
        if "plain" in ratios:
            result[f"output_tok_s_ratio_vs_{peer}"] = ratios["plain"]
        result[f"output_tok_s_ratio_vs_{peer}_by_scenario"] = ratios
    if "plain" in results and len(scenarios) > 1:
        result["constrained_tpot"] = constrained_tpot(results)
    emit(result, args.out)


if __name__ == "__main__":
    main()
