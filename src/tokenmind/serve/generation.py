"""One HTTP request's generation: its engine streams merged, its choices tracked, its client watched.

A request holds one engine request per prompt (a /v1/completions batch has several), each with
n completions. `Generation` pumps every engine stream into one queue, so choices stream in the
order the engine produces them, and keeps each choice's text, logprobs and finish reason for the
non-streaming response and the usage numbers. Closing it — finished, failed, or because the
client went away — cancels the pumps, and leaving `AsyncEngine.generate` aborts the engine
request, which frees its KV blocks at once (also when the client leaves before its first token).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.async_engine import AsyncEngine
from ..engine.llm import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.sequence import PromptEmbeds
from .admission import Admission
from .errors import APIError
from .metrics import Metrics
from .responses import ChoiceDelta, ChoiceState, ResponseFormat, usage

T = TypeVar("T")
log = logging.getLogger("tokenmind.serve")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class QueueTimeout(Exception):
    """A prompt of the request waited longer than `max_queue_wait` for its first step."""


class Generation:
    """The engine requests of one HTTP request. Create (which admits it), iterate `deltas()`, always `close()`."""

    def __init__(self, engine: AsyncEngine, admission: Admission, metrics: Metrics, prompts: list[list[int]],
                 params: SamplingParams, request_id: str, adapter: str | None = None, echo: list[str] | None = None,
                 embeds: list[list[PromptEmbeds]] | None = None):
        """`echo`: per prompt, the text each of its choices starts with (its tokens' logprobs too, if
        `params.prompt_logprobs`). `embeds`: per prompt, its images' rows (`Engine.add_request`)."""
        self.echo = echo
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        admission.admit(self.request_ids)  # 429 / 503 before any work starts
        self.admission, self.metrics, self.n = admission, metrics, params.n
        self.started = time.perf_counter()
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_tokens = self.cached_tokens = 0
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._seen: set[int] = set()
        self._remaining = len(prompts)
        embeds = embeds or [None] * len(prompts)
        self._tasks = [asyncio.create_task(self._pump(i, engine.generate(ids, params, rid, adapter, e)))
                       for i, (ids, rid, e) in enumerate(zip(prompts, self.request_ids, embeds))]

    async def _pump(self, prompt: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((prompt, out))
        except Exception as e:  # e.g. the engine failed: the consumer raises it
            self._queue.put_nowait((prompt, e))

    async def deltas(self, heartbeat: float | None = None) -> AsyncIterator[list[ChoiceDelta] | None]:
        """Per engine output, the choices it changed; ends when every completion has finished.

        With `heartbeat`, yields None after that many seconds without output (a keep-alive).
        Raises `QueueTimeout` if a prompt waited too long to start, or the engine's error.
        """
        pending: asyncio.Future | None = None
        try:
            while self._remaining:
                if pending is None:
                    pending = asyncio.ensure_future(self._queue.get())
                done, _ = await asyncio.wait({pending}, timeout=heartbeat)
                if not done:
                    yield None
                    continue
                (prompt, item), pending = pending.result(), None
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason == "timeout":
                    raise QueueTimeout
                if item.finished:
                    self._remaining -= 1
                yield self._update(prompt, item)
        finally:
            if pending is not None:
                pending.cancel()
        self.metrics.latency.observe(time.perf_counter() - self.started)

    def _update(self, prompt: int, out: RequestOutput) -> list[ChoiceDelta]:
        if prompt not in self._seen:
            self._seen.add(prompt)
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_tokens += out.num_cached_tokens
            self.metrics.prompt_tokens += len(out.prompt_token_ids)
        deltas = []
        for o in out.outputs:
            index = prompt * self.n + o.index
            new_text, new_logprobs = o.new_text, None
            if o.logprobs is not None:  # logprobs align with token_ids; the new ones are at the end
                new_logprobs = o.logprobs[len(o.token_ids) - len(o.new_token_ids):len(o.token_ids)]
            if index not in self.choices and self.echo is not None:  # the choice starts with its prompt
                new_text = self.echo[prompt] + new_text
                if out.prompt_logprobs is not None:
                    new_logprobs = out.prompt_logprobs + (new_logprobs or [])
            choice = self.choices.setdefault(index, ChoiceState(index))
            if new_logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + new_logprobs
            choice.pieces.append(new_text)
            choice.num_tokens = len(o.token_ids)
            self.metrics.generation_tokens += len(o.new_token_ids)
            if o.ttft_s is not None and not choice.ttft_seen:
                choice.ttft_seen = True
                self.metrics.ttft.observe(o.ttft_s)
                if o.queue_s is not None:
                    self.metrics.queue_wait.observe(o.queue_s)
            finished_now = o.finish_reason is not None and choice.finish_reason is None
            if finished_now:
                choice.finish_reason = o.finish_reason
                if o.tpot_s is not None:
                    self.metrics.tpot.observe(o.tpot_s)
            if new_text or new_logprobs or finished_now:
                deltas.append(ChoiceDelta(index, new_text, new_logprobs, o.finish_reason if finished_now else None))
        return deltas

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices.values()), self.cached_tokens)

    def close(self) -> None:
        """Stop whatever still runs and give the places back. Synchronous: safe while being cancelled."""
        for task in self._tasks:
            task.cancel()
        self.admission.release(self.request_ids)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then cancel it and raise `ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(gen: Generation, fmt: ResponseFormat) -> dict[str, Any]:
    """The whole (non-streaming) response."""
    async for _ in gen.deltas():
        pass
    return fmt.response([gen.choices[i] for i in sorted(gen.choices)], gen.usage())


async def server_sent_events(gen: Generation, fmt: ResponseFormat, heartbeat: float,
                             failure: Callable[[Exception], APIError]) -> AsyncIterator[str]:
    """An SSE comment at once (the client sees headers while the request waits), keep-alive comments
    while nothing happens, `data: {chunk}` events, an optional usage chunk, then `data: [DONE]`.

    The status line said 200 before the outcome was known, so a failure (a queue timeout, the
    engine failing) becomes an error event, shaped like the error body the status would carry.
    Closes `gen` however it ends.
    """
    try:
        yield ": accepted\n\n"
        async for deltas in gen.deltas(heartbeat):
            if deltas is None:
                yield ": waiting\n\n"
                continue
            for delta in deltas:
                chunk = fmt.chunk(delta)
                if chunk is not None:
                    yield _event(chunk)
        if fmt.include_usage:
            yield _event(fmt.usage_chunk(gen.usage()))
    except Exception as e:
        error = failure(e)
        if error.status >= 500 and not isinstance(e, QueueTimeout):
            log.error("generation failed mid-stream: %s", e)
        yield _event(error.body())
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """The SSE response. It closes its `Generation` however the response ends — also when the client
    left before the first byte, when the body iterator never even starts and so never cleans up."""

    def __init__(self, gen: Generation, fmt: ResponseFormat, heartbeat: float,
                 failure: Callable[[Exception], APIError]):
        super().__init__(server_sent_events(gen, fmt, heartbeat, failure), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
