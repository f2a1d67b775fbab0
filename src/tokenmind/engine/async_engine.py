"""`AsyncEngine`: the `Engine` on a background thread, with an asyncio front for concurrent streams.

The engine is not thread-safe and its steps are long, blocking tensor work, so one dedicated
thread owns it: it applies queued commands (add, abort, stats, stop) between steps, runs steps
while any request is unfinished, and sleeps otherwise. Callers on an event loop talk to it only
through those commands and receive each request's outputs on an `asyncio.Queue` of their own
(handed over with `call_soon_threadsafe`). A stream whose consumer stops listening — a `break`,
a cancelled task, a dropped HTTP connection — aborts its request, so its blocks are freed.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..pretrained import Pretrained
from .llm import LLM, Engine, EngineStats, RequestOutput
from .sampling import SamplingParams


class AsyncEngine:
    """`async for out in engine.generate(prompt, params)`: one `RequestOutput` per step with new tokens.

    Each output carries the cumulative `token_ids`/`text` and the step's `new_token_ids`/`new_text`.
    """

    def __init__(self, engine: Engine | Callable[[], Engine]):
        """Take an `Engine`, or a function that builds one: it then runs on the engine thread, so
        the KV pool is allocated there and no other thread's OpenMP team lingers beside the
        engine's (see `serve.app.load_off_main_thread` for what that costs)."""
        self._commands: queue.SimpleQueue[tuple[Callable, tuple, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._closing = False
        self._running = True
        self._error: BaseException | None = None
        build = (lambda: engine) if isinstance(engine, Engine) else engine
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="tokenmind-engine", daemon=True)
        self._thread.start()
        self.engine: Engine = built.result()  # a failed build raises here

    @classmethod
    def from_pretrained(cls, model: str | Path | Pretrained, **engine_options: Any) -> AsyncEngine:
        """Load a model (or take a loaded one) as `LLM` does and start the engine thread."""
        return cls(lambda: LLM(model, **engine_options).engine)

    # ----------------------------------------------------------------- the asyncio side

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs until it finishes; leaving the loop early aborts it."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def add() -> None:
            self.engine.add_request(prompt, params, request_id)
            self._streams[request_id] = (loop, outputs)

        await self._call(add)  # a bad request raises here, in the caller
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished and self._running:
                self._submit(self._abort, request_id)  # no await: this may run while being cancelled

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort"."""
        await self._call(self._abort, request_id)

    async def stats(self) -> EngineStats:
        return await self._call(self.engine.stats)

    async def shutdown(self) -> None:
        """Abort everything still running, end all streams and stop the engine thread."""
        if not self._closing:
            self._closing = True
            self._submit(self._stop)
        await asyncio.to_thread(self._thread.join)

    def _submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        self._commands.put((fn, args, future))
        self._wake.set()
        return future

    async def _call(self, fn: Callable, *args: Any) -> Any:
        if self._error is not None:
            raise RuntimeError(f"the engine failed: {self._error!r}; start a new AsyncEngine")
        if self._closing:
            raise RuntimeError("the engine is shut down")
        return await asyncio.wrap_future(self._submit(fn, *args))

    # ----------------------------------------------------------------- the engine thread

    def _run(self, build: Callable[[], Engine], built: Future) -> None:
        try:
            self.engine = build()
        except BaseException as e:
            self._running = False
            built.set_exception(e)
            return
        built.set_result(self.engine)
        while self._running:
            self._apply_commands()
            if not self._running:
                break
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # the engine's state is suspect now: fail every stream, stop
                self._error, self._running = e, False
                for stream in self._streams.values():
                    self._deliver(stream, e)
                self._streams.clear()
                break
            for out in outputs:
                stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
                if stream is not None:
                    self._deliver(stream, out)
        self._apply_commands()  # whatever came in meanwhile fails cleanly

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not self._running:
                future.set_exception(RuntimeError("the engine is shut down"))
                continue
            try:
                future.set_result(fn(*args))
            except Exception as e:
                future.set_exception(e)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            self._deliver(stream, out)

    def _stop(self) -> None:
        for request_id in list(self.engine.requests):
            self._abort(request_id)
        self._running = False

    @staticmethod
    def _deliver(stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: Any) -> None:
        loop, outputs = stream
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # that caller's event loop is closed: nobody is listening
            pass
