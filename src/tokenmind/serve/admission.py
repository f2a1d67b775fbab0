"""`Admission`: the bounded front door. It decides which requests the engine gets, and ends them at shutdown.

The engine would queue any number of requests, and each queued one only waits longer; so the
server keeps count of what it has admitted (running + waiting) and refuses the rest with 429
and `Retry-After` before any work is done. At shutdown it stops admitting (503) and, once the
grace period is over, aborts the requests still running so their streams end cleanly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .errors import APIError

log = logging.getLogger("tokenmind.serve")


class Admission:
    """Counts admitted engine requests against `capacity` = running slots + queue size.

    A request with several prompts (a /v1/completions batch) takes one place per prompt.
    """

    def __init__(self, capacity: int, retry_after: int):
        self.capacity, self.retry_after = capacity, retry_after
        self.active: set[str] = set()  # engine request ids admitted and not yet released
        self.draining = False

    @property
    def in_flight(self) -> int:
        return len(self.active)

    def admit(self, request_ids: list[str]) -> None:
        """Take places for `request_ids` (give them back with `release`); 429 when full, 503 when shutting down."""
        self.check(len(request_ids))
        self.active.update(request_ids)

    def check(self, places: int) -> None:
        """Raise the 429 / 503 that admitting `places` more requests now would raise."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry against another instance", type="server_error",
                           code="shutting_down")
        if len(self.active) + places > self.capacity:
            raise APIError(429, f"the server is at capacity ({self.capacity} requests running or queued); "
                                f"retry after {self.retry_after}s", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after)})

    def release(self, request_ids: list[str]) -> None:
        self.active.difference_update(request_ids)

    async def drain(self, abort: Callable[[str], Awaitable[None]], timeout: float) -> None:
        """Refuse new requests; after `timeout` seconds `await abort(id)` every request still running."""
        self.draining = True
        if not self.active:
            return
        log.info("shutting down: %d request(s) in flight get %.0fs to finish", len(self.active), timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("shutting down: aborting %d unfinished request(s)", len(self.active))
            for request_id in list(self.active):
                await abort(request_id)
