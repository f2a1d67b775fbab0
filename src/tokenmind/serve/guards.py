"""Bearer-token check for the API, as ASGI middleware so it runs before the body is even parsed.

A FastAPI dependency would run after body validation, so an unauthenticated caller could probe
the API's validation errors; here a request without the key gets 401 before anything else.
`/health` (for load balancers) and the chat page's static files stay open: they reveal nothing,
and the page asks for the key itself.
"""

from __future__ import annotations

import hmac
from typing import Any

from .errors import APIError

PROTECTED_PREFIXES = ("/v1/", "/metrics")


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
