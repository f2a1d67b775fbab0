"""The gates a request passes before any route sees it: trusted Host, body size, API key.

Each is ASGI middleware, so it runs before the body is even parsed and answers in OpenAI's error
shape. A FastAPI dependency would run after body validation, so an unauthenticated caller could
probe the API's validation errors, and a huge body would already have been read and parsed.

* Host: without an API key a server on 127.0.0.1 is still reachable from a browser through DNS
  rebinding (a hostile page whose name resolves to 127.0.0.1). Such requests carry the attacker's
  name in `Host`, so only the bound address and localhost names are accepted unless widened.
* Body size: `Content-Length` above the limit is refused at once; a chunked body is counted as
  it arrives and refused when it crosses the limit, so neither is ever held in memory whole.
* API key: `/health` (for load balancers) and the chat page's static files stay open: they
  reveal nothing, and the page asks for the key itself.
"""

from __future__ import annotations

import hmac
from typing import Any

from .errors import APIError

PROTECTED_PREFIXES = ("/v1/", "/metrics")


class TrustedHostMiddleware:
    """400 unless the `Host` header (port ignored) is one of `allowed` (case-insensitive)."""

    def __init__(self, app: Any, allowed: list[str]):
        self.app, self.allowed = app, {h.lower().strip("[]") for h in allowed}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and host_name(scope) not in self.allowed:
            error = APIError(400, f"this server does not answer to the Host {host_name(scope)!r}; it accepts "
                                  f"{', '.join(sorted(self.allowed))}. Start it with --allowed-hosts NAME (or an "
                                  "--api-key) to accept another name", code="invalid_host")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def host_name(scope: dict) -> str:
    """The Host header without its port: 'localhost:8000' → 'localhost', '[::1]:8000' → '::1'."""
    host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`, declared (`Content-Length`) or streamed (chunked)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received, started = 0, False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        limit = f"{self.max_bytes / 2**20:.1f} MiB" if self.max_bytes >= 2**20 else f"{self.max_bytes} bytes"
        error = APIError(413, f"the request body is larger than this server's limit of {limit}; send a shorter "
                              "prompt, or start the server with a larger --max-body-mb",
                         code="request_too_large")  # the connection stays open: the client can finish
        # sending (uvicorn discards the rest of the body) and then read this answer
        await error.response()(scope, receive, send)


class ApiKeyMiddleware:
    """Answer 401 in OpenAI's error shape unless `Authorization: Bearer <api_key>` is sent."""

    def __init__(self, app: Any, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
            error = APIError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>` with "
                                  "the key the server was started with (--api-key)", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
