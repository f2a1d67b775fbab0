"""`tokenmind serve --replicas N`: one OpenAI-compatible front over N engine servers, routing by prompt prefix.

Each replica is an unchanged `tokenmind serve` process (one engine loop, its own KV cache and
prefix cache); `replicas.py` starts them. This router is a small ASGI app that forwards every
request to one replica and relays the answer unchanged, streams chunk by chunk.

Routing (`PrefixPolicy`): a replica's prefix cache only helps requests whose prompt starts like
one it has already run, so requests sharing a prefix should land on the same replica. The router
does not tokenize (it serves any model and costs nothing per token): it cuts the request's
canonical text (model, tools, then each message in order; a completion's prompt) into
`block_chars`-character blocks and hashes them in a chain, so block i's hash names the whole
prefix up to it, as the engine's block hashes do for tokens. An LRU map remembers which replica
last ran each prefix hash. A request goes to the replica holding its longest known prefix when
that prefix covers at least `min_match` of the prompt (as SGLang's cache-aware router does), unless
that replica is down or has more than `max_imbalance` requests in flight beyond the least loaded
one; otherwise (a new prefix) to the least-loaded replica. A conversation's next turn extends its
previous prompt, so it returns to the replica that holds it; conversations with different system
prompts spread out. `RoundRobinPolicy` ignores the prompt, for comparison.

Failures: a replica that refuses the connection is marked down and the request tries the next one
(it never started there). One that fails after accepting the request (its process died, or a
stream stayed silent longer than `stream_idle_timeout` while replicas send keep-alives every few
seconds) ends the request with 503 in OpenAI's error shape (in a stream that already said 200: an
error event, then `data: [DONE]`) and is marked down; a health check every `health_interval`
brings it back when `/health` answers 200 again. With no replica up the answer is 503. Replies
from replicas, 4xx included, pass through as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .config import ServeConfig
from .errors import error_body
from .guards import ApiKeyMiddleware, BodyLimitMiddleware, TrustedHostMiddleware

log = logging.getLogger("tokenmind.serve.router")
POLICIES = ("prefix", "round_robin")
LAUNCHERS = ("local", "ray")
ROUTER_BODY_LIMIT = 64 << 20  # the router holds a body in memory while it picks a replica
# Per-connection headers that must not be forwarded; httpx and uvicorn write their own.
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "accept-encoding", "content-encoding"}
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class RouterConfig:
    """How many replicas, where they run, and how requests are spread over them."""

    replicas: int = 1  # engine processes to start (ignored with replica_urls)
    policy: str = "prefix"  # prefix: same prompt prefix → same replica, else least loaded; round_robin: in turn
    replica_urls: list[str] = field(default_factory=list)  # route to these running servers instead of starting any
    launcher: str = "local"  # local: subprocesses on this machine; ray: one Ray actor per replica
    ray_address: str | None = None  # join this Ray cluster (auto, HOST:6379); None: a local instance
    replica_threads: int | None = None  # torch threads per replica; None: this machine's cores / replicas
    block_chars: int = 128  # characters per hashed prefix block (~32 tokens)
    cache_entries: int = 100_000  # prefix hashes remembered (LRU)
    max_imbalance: int = 8  # in-flight requests the prefix holder may have beyond the least loaded
    min_match: float = 0.5  # the known prefix must cover this fraction of the prompt to pull it to its holder
    health_interval: float = 1.0  # seconds between health checks of each replica
    connect_timeout: float = 5.0
    stream_idle_timeout: float = 60.0  # a stream silent this long fails (replicas send keep-alives every 5 s)
    request_timeout: float = 600.0  # a non-streaming request's longest wait for its answer
    startup_timeout: float = 600.0  # seconds the started replicas may take to become healthy

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.ray_address is not None:  # a cluster address means the Ray launcher
            self.launcher = "ray"
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"replica launcher {self.launcher!r}: choose one of {', '.join(LAUNCHERS)}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_threads is not None and self.replica_threads < 1:
            raise ValueError(f"replica_threads must be >= 1, got {self.replica_threads}")
        bad = [u for u in self.replica_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"replica URLs must start with http:// or https://, got {bad}; e.g. "
                             "--replica-urls http://10.0.0.2:8001,http://10.0.0.3:8001")
        self.replica_urls = [u.rstrip("/") for u in self.replica_urls]
        for name in ("block_chars", "cache_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.min_match <= 1:
            raise ValueError(f"min_match is a fraction of the prompt in [0, 1], got {self.min_match}")
        for name in ("health_interval", "connect_timeout", "stream_idle_timeout", "request_timeout",
                     "startup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    @property
    def routed(self) -> bool:
        """True when `tokenmind serve` should run this router rather than one engine in-process."""
        return self.replicas > 1 or bool(self.replica_urls) or self.launcher == "ray"


@dataclass
class Replica:
    """One backend as the router sees it: reachable or not, and how busy."""

    index: int
    url: str
    up: bool = False
    in_flight: int = 0
    routed: int = 0  # requests sent to it so far
    reason: str = "not checked yet"  # why it is down


class NoReplicaAvailable(Exception):
    """Every replica is down."""


def prefix_hashes(text: str, block_chars: int) -> list[bytes]:
    """Chained hashes of `text`'s full `block_chars` blocks: entry i identifies text[:(i+1)*block_chars]."""
    out, h = [], b""
    for end in range(block_chars, len(text) + 1, block_chars):
        h = hashlib.blake2b(h + text[end - block_chars:end].encode("utf-8", "surrogatepass"), digest_size=16).digest()
        out.append(h)
    return out


def generation_body(path: str, body: bytes) -> dict[str, Any] | None:
    """A generation request's JSON object, or None (another path, or not a JSON object: a replica
    answers it, with its 400 if it is bad)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return req if isinstance(req, dict) else None


def routing_text(path: str, req: dict[str, Any]) -> str | None:
    """The text a request's prompt starts with, in a form where a longer conversation extends a
    shorter one: model, tools, then each chat message (or a completion's prompt)."""
    head = json.dumps([req.get("model"), req.get("tools")], sort_keys=True, ensure_ascii=False)
    if path == "/v1/completions":
        prompt = req.get("prompt")
        return head + (prompt if isinstance(prompt, str) else json.dumps(prompt))
    messages = req.get("messages")
    if not isinstance(messages, list):
        return None
    return head + "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) for m in messages)


class RoundRobinPolicy:
    """Each request to the next replica that is up, in turn."""

    def __init__(self) -> None:
        self.next = 0
        self.stats: Counter[str] = Counter()

    def choose(self, text: str | None, replicas: list[Replica]) -> Replica:
        for i in range(len(replicas)):
            replica = replicas[(self.next + i) % len(replicas)]
            if replica.up:
                self.next = (replica.index + 1) % len(replicas)
                self.stats["round_robin"] += 1
                return replica
        raise NoReplicaAvailable


class PrefixPolicy:
    """The replica that last ran the request's longest known prompt prefix, if that prefix is at least
    `min_match` of the prompt and the replica is up and not overloaded (> `max_imbalance` in flight
    above the least loaded); else the least loaded. (Two prompts that share only their opening words
    would otherwise pile onto one replica for a few cached tokens.)"""

    def __init__(self, block_chars: int = 128, cache_entries: int = 100_000, max_imbalance: int = 8,
                 min_match: float = 0.5):
        self.block_chars, self.cache_entries, self.max_imbalance = block_chars, cache_entries, max_imbalance
        self.min_match = min_match
        self.holder: OrderedDict[bytes, int] = OrderedDict()  # prefix hash → replica index, least recent first
        self.stats: Counter[str] = Counter()  # prefix_hit, prefix_overloaded, least_loaded

    def choose(self, text: str | None, replicas: list[Replica]) -> Replica:
        live = [r for r in replicas if r.up]
        if not live:
            raise NoReplicaAvailable
        least = min(live, key=lambda r: (r.in_flight, r.routed))
        hashes = prefix_hashes(text, self.block_chars) if text else []
        chosen, outcome = least, "least_loaded"
        shortest = self.min_match * len(text or "") / self.block_chars  # fewer blocks in common: a new prompt
        for n, h in reversed(list(enumerate(hashes, 1))):  # the longest prefix first
            if n < shortest:
                break
            index = self.holder.get(h)
            if index is None or index >= len(replicas) or not replicas[index].up:
                continue
            if replicas[index].in_flight - least.in_flight > self.max_imbalance:
                outcome = "prefix_overloaded"
                continue
            chosen, outcome = replicas[index], "prefix_hit"
            break
        self.stats[outcome] += 1
        for h in hashes:  # the chosen replica now holds every prefix of this prompt
            self.holder[h] = chosen.index
            self.holder.move_to_end(h)
        while len(self.holder) > self.cache_entries:
            self.holder.popitem(last=False)
        return chosen


def make_policy(config: RouterConfig) -> PrefixPolicy | RoundRobinPolicy:
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    return PrefixPolicy(config.block_chars, config.cache_entries, config.max_imbalance, config.min_match)


def unavailable(message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", None, code), status_code=503,
                        headers={"Retry-After": "1"})


class Router:
    """The replicas, the policy, the HTTP client to the replicas and what the router counts."""

    def __init__(self, urls: list[str], config: RouterConfig):
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        self.config = config
        self.replicas = [Replica(i, url) for i, url in enumerate(urls)]
        self.policy = make_policy(config)
        self.requests: Counter[tuple[int, int]] = Counter()  # (replica, status) → count
        self.failures: Counter[int] = Counter()  # replica → requests that failed on it after being sent
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(limits=limits, timeout=self.timeout(False))
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    def timeout(self, stream: bool) -> httpx.Timeout:
        read = self.config.stream_idle_timeout if stream else self.config.request_timeout
        return httpx.Timeout(read, connect=self.config.connect_timeout)

    # ----------------------------------------------------------------- health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.check_health()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        timeout = httpx.Timeout(max(2.0, self.config.health_interval), connect=self.config.connect_timeout)
        try:
            r = await self.client.get(replica.url + "/health", timeout=timeout)
            ok, reason = r.status_code == 200, f"/health answered {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            ok, reason = False, f"/health failed: {e!r}"
        if ok and not replica.up:
            log.info("replica %d (%s) is up", replica.index, replica.url)
        self.set_up(replica, ok, reason)

    def set_up(self, replica: Replica, up: bool, reason: str = "") -> None:
        if replica.up and not up:
            log.warning("replica %d (%s) is down: %s", replica.index, replica.url, reason)
        replica.up, replica.reason = up, "" if up else reason

    # ----------------------------------------------------------------- forwarding

    async def forward(self, request: Request) -> Response:
        """Send the request to the policy's replica (the next one if it refuses the connection)."""
        body = await request.body()
        path = request.url.path
        req = generation_body(path, body)
        text = None if req is None else routing_text(path, req)
        stream = req is not None and req.get("stream") is True
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        target = path + (f"?{request.url.query}" if request.url.query else "")
        for _ in range(len(self.replicas)):
            try:
                replica = self.policy.choose(text, self.replicas)
            except NoReplicaAvailable:
                break
            sent = self.client.build_request(request.method, replica.url + target, headers=headers, content=body,
                                             timeout=self.timeout(stream))
            replica.in_flight += 1
            replica.routed += 1
            try:
                response = await self.client.send(sent, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # it never saw the request: try another
                replica.in_flight -= 1
                self.set_up(replica, False, f"connection failed: {e}")
                continue
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                return self.failed(replica, e)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return RelayStream(self, replica, response)
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                return self.failed(replica, e)
            finally:
                replica.in_flight -= 1
                await response.aclose()
            self.requests[(replica.index, response.status_code)] += 1
            return Response(content, status_code=response.status_code, headers=_reply_headers(response))
        return unavailable("no replica is available: every replica is down (see GET /health); retry later",
                           "no_replica_available")

    def failed(self, replica: Replica, error: Exception) -> JSONResponse:
        """The 503 for a request its replica stopped answering; the replica counts as down until healthy."""
        self.set_up(replica, False, f"a request failed: {type(error).__name__}: {error}")
        self.failures[replica.index] += 1
        self.requests[(replica.index, 503)] += 1
        return unavailable(self._failure_message(replica, error), "replica_failed")

    @staticmethod
    def _failure_message(replica: Replica, error: Exception) -> str:
        return (f"replica {replica.index} stopped answering during this request ({type(error).__name__}); it is "
                "marked down and new requests go to the other replicas: retry the request")

    def stream_failed(self, replica: Replica, error: Exception) -> bytes:
        """The end of a stream whose replica stopped answering: an error event (OpenAI's error shape,
        code replica_failed), then `data: [DONE]`; the replica counts as down until healthy."""
        self.set_up(replica, False, f"a stream failed: {type(error).__name__}: {error}")
        self.failures[replica.index] += 1
        body = error_body(self._failure_message(replica, error), "server_error", None, "replica_failed")
        return f"\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()

    # ----------------------------------------------------------------- health and metrics answers

    def health(self) -> JSONResponse:
        replicas = [{"url": r.url, "up": r.up, "in_flight": r.in_flight, **({} if r.up else {"reason": r.reason})}
                    for r in self.replicas]
        up = sum(r.up for r in self.replicas)
        status = {"status": "ok" if up else "unavailable", "replicas_up": up, "replicas": replicas}
        return JSONResponse(status, status_code=200 if up else 503)

    async def metrics(self, authorization: str | None) -> str:
        """The router's own counts per replica, each up replica's prefix-cache hit rate, and their
        aggregate (weighted by each replica's prompt tokens)."""
        headers = {"Authorization": authorization} if authorization else {}
        scraped = await asyncio.gather(*(self._scrape(r, headers) for r in self.replicas))
        p = "tokenmind_router_"
        lines = [f"# HELP {p}requests_total requests answered, by replica and HTTP status",
                 f"# TYPE {p}requests_total counter"]
        lines += [f'{p}requests_total{{replica="{i}",status="{s}"}} {n}' for (i, s), n in sorted(self.requests.items())]
        per_replica = [("up", "gauge", "1 if the replica answers its health check", lambda r: int(r.up)),
                       ("in_flight", "gauge", "requests being answered by the replica", lambda r: r.in_flight),
                       ("routed_total", "counter", "requests sent to the replica", lambda r: r.routed),
                       ("failures_total", "counter", "requests that failed because the replica stopped answering",
                        lambda r: self.failures[r.index])]
        for name, kind, help_text, value in per_replica:
            lines += [f"# HELP {p}replica_{name} {help_text}", f"# TYPE {p}replica_{name} {kind}"]
            lines += [f'{p}replica_{name}{{replica="{r.index}",url="{r.url}"}} {value(r)}' for r in self.replicas]
        lines += [f"# HELP {p}decisions_total routing decisions by outcome", f"# TYPE {p}decisions_total counter"]
        lines += [f'{p}decisions_total{{outcome="{k}"}} {n}' for k, n in sorted(self.policy.stats.items())]
        lines += [f"# HELP {p}replica_prefix_cache_hit_rate each replica's prompt tokens served from its prefix cache",
                  f"# TYPE {p}replica_prefix_cache_hit_rate gauge"]
        hits = tokens = 0.0
        for r, sample in zip(self.replicas, scraped):
            if sample is not None:
                rate, prompt = sample
                lines.append(f'{p}replica_prefix_cache_hit_rate{{replica="{r.index}"}} {rate}')
                hits, tokens = hits + rate * prompt, tokens + prompt
        lines += [(f"# HELP {p}prefix_cache_hit_rate prefix-cache hit rate over the replicas that answered, "
                   "weighted by their prompt tokens"), f"# TYPE {p}prefix_cache_hit_rate gauge",
                  f"{p}prefix_cache_hit_rate {hits / tokens if tokens else 0.0}"]
        return "\n".join(lines) + "\n"

    async def _scrape(self, replica: Replica, headers: dict[str, str]) -> tuple[float, float] | None:
        """(prefix-cache hit rate, prompt tokens) from a replica's /metrics, or None if it does not answer."""
        if not replica.up:
            return None
        try:
            r = await self.client.get(replica.url + "/metrics", headers=headers, timeout=2.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        samples = dict(line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#"))
        try:
            return float(samples["tokenmind_prefix_cache_hit_rate"]), float(samples["tokenmind_prompt_tokens_total"])
        except (KeyError, ValueError):
            return None


class RelayStream(StreamingResponse):
    """A replica's server-sent events, relayed line by line as they arrive. However the response
    ends (also when the client left before the first byte, when the body iterator never even starts)
    it frees the replica's in-flight slot and closes the upstream connection, which aborts the
    generation there."""

    def __init__(self, router: Router, replica: Replica, upstream: httpx.Response):
        self.router, self.replica, self.upstream = router, replica, upstream
        self.status, self.released = upstream.status_code, False
        super().__init__(self._lines(), status_code=upstream.status_code, headers=_reply_headers(upstream))

    async def _lines(self) -> AsyncIterator[bytes]:
        try:
            async for line in self.upstream.aiter_lines():
                yield (line + "\n").encode()
        except httpx.HTTPError as e:
            self.status = 503
            yield self.router.stream_failed(self.replica, e)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.replica.in_flight -= 1
            self.router.requests[(self.replica.index, self.status)] += 1
            await self.upstream.aclose()


def _reply_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != "date"}


def build_router_app(urls: list[str], config: RouterConfig, serve: ServeConfig) -> Starlette:
    """The router as an ASGI app over running replicas at `urls`. `serve` gives what the front
    door checks itself: the API key (also forwarded to the replicas) and the Host names it answers."""
    router = Router(urls, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    async def health(request: Request) -> Response:
        return router.health()

    async def metrics(request: Request) -> Response:
        text = await router.metrics(request.headers.get("authorization"))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def forward(request: Request) -> Response:
        return await router.forward(request)

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              Route("/{path:path}", forward, methods=["GET", "POST", "DELETE"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    if serve.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=serve.api_key)
    if serve.cors_origins:  # as the serve app: outside the key check, since preflight requests carry no key
        app.add_middleware(CORSMiddleware, allow_origins=serve.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=serve.max_body_bytes or ROUTER_BODY_LIMIT)
    hosts = serve.trusted_hosts()
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed=hosts)
    return app
