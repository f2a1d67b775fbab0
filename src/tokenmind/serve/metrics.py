"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

The format is a few lines per metric (`# HELP`, `# TYPE`, `name{label="v"} value`; histograms
as cumulative `_bucket{le=...}` plus `_sum` and `_count`), so a dependency is not worth it.
Counters and histograms are updated by the request handlers on the event loop thread; gauges
(running and waiting sequences, KV-cache usage, prefix-cache hit rate, the queue's oldest wait)
come from the snapshot the engine thread publishes after every step, so a scrape never waits
for a running step.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from ..engine.llm import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    """Observation counts per upper bound; rendered cumulatively, as Prometheus wants."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {total}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


class Metrics:
    """What the server counts. `endpoints` are the paths that get their own label; others are "other"."""

    def __init__(self, endpoints: list[str]):
        self.endpoints = set(endpoints)
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status) → count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(QUEUE_BUCKETS)

    def record_request(self, path: str, status: int) -> None:
        self.requests[(path if path in self.endpoints else "other", status)] += 1

    def render(self, stats: EngineStats, in_flight: int) -> str:
        """The whole exposition; `in_flight` = requests the server admitted (running or queued)."""
        scalars = [  # (name, type, help, value)
            ("prompt_tokens_total", "counter", "prompt tokens processed", self.prompt_tokens),
            ("generation_tokens_total", "counter", "tokens generated", self.generation_tokens),
            ("requests_in_flight", "gauge", "requests admitted by the server (running or queued)", in_flight),
            ("num_requests_running", "gauge", "sequences the engine is decoding", stats.num_running),
            ("num_requests_waiting", "gauge", "sequences queued in the engine (queue depth)", stats.num_waiting),
            ("oldest_waiting_seconds", "gauge", "how long the longest-waiting queued request has waited",
             stats.oldest_waiting_s),
            ("queue_timeouts_total", "counter", "requests refused after waiting longer than max_queue_wait",
             stats.num_queue_timeouts),
            ("kv_cache_usage_ratio", "gauge", "fraction of KV-cache blocks held by sequences", stats.kv_cache_usage),
            ("kv_cache_blocks_used", "gauge", "KV-cache blocks held by sequences",
             round(stats.kv_cache_usage * stats.num_blocks)),
            ("kv_cache_blocks", "gauge", "KV-cache blocks in the pool", stats.num_blocks),
            ("prefix_cache_hit_rate", "gauge", "prompt tokens served from the prefix cache / looked up",
             stats.prefix_cache_hit_rate),
            ("num_preemptions_total", "counter", "sequences preempted for lack of KV blocks", stats.num_preemptions),
            ("spec_decode_draft_tokens_total", "counter", "speculative decoding: draft tokens verified",
             stats.num_drafted_tokens),
            ("spec_decode_accepted_tokens_total", "counter", "speculative decoding: draft tokens the model kept",
             stats.num_accepted_tokens),
            ("spec_decode_acceptance_rate", "gauge", "accepted / verified draft tokens (0 before any)",
             stats.acceptance_rate),
        ]
        histograms = [  # (name, help, histogram)
            ("time_to_first_token_seconds", "time from arrival in the engine to the first token", self.ttft),
            ("time_per_output_token_seconds", "mean time per output token after the first", self.tpot),
            ("queue_wait_seconds", "time from arrival in the engine to the first step", self.queue_wait),
            ("request_latency_seconds", "time from admission to the last token of a request", self.latency),
        ]
        p = "tokenmind_"
        requests = [f'{p}requests_total{{endpoint="{_label(e)}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())]
        blocks = [(p + "requests_total", "counter", "HTTP requests by endpoint and status code", requests)]
        blocks += [(p + name, kind, help_text, [f"{p}{name} {_number(value)}"])
                   for name, kind, help_text, value in scalars]
        blocks += [(p + name, "histogram", help_text, h.lines(p + name)) for name, help_text, h in histograms]
        out = []
        for name, kind, help_text, samples in blocks:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(out) + "\n"


class MetricsMiddleware:
    """ASGI middleware counting every HTTP response by path and status (an escaping exception counts as 500)."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            self.metrics.record_request(scope["path"], status)


def _number(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
