"""`AsyncEngine`: the `Engine` on a background thread, with an asyncio front for concurrent streams.

The engine is not thread-safe and its steps are long, blocking tensor work, so one dedicated
thread owns it: it applies queued commands (add, abort, stats, stop) between steps, runs steps
while any request is unfinished, and sleeps otherwise. Callers on an event loop talk to it only
through those commands and receive each request's outputs on an `asyncio.Queue` of their own
(handed over with `call_soon_threadsafe`). A stream whose consumer stops listening — a `break`,
a cancelled task, a dropped HTTP connection — aborts its request, so its blocks are freed.

The thread must never die silently, since every caller would then wait forever:

* a command whose caller gave up (its future was cancelled while queued) is skipped, and a
  request whose caller was cancelled after it was added is aborted, not left running unread;
* anything unexpected on the engine thread ends it in the failed state: every stream and every
  pending or later command gets `EngineFailed`, and `on_failure` callbacks learn the reason;
* `health()` and `snapshot()` read plain attributes the thread publishes, so a probe answers at
  once even while a step takes seconds, and a stuck step is visible by its age.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.load import Pretrained
from .llm import LLM, Engine, EngineStats, RequestOutput
from .sampling import SamplingParams
from .sequence import PromptEmbeds
from .structured import GrammarCompiler


class EngineFailed(RuntimeError):
    """The engine thread hit an unexpected error and stopped; nothing more will run on it."""


class EngineStopped(RuntimeError):
    """The engine was shut down on purpose."""


@dataclass(frozen=True)
class EngineLimits:
    """The engine's fixed limits, for callers that check requests before sending them."""

    max_model_len: int  # longest prompt + output
    max_seq_len: int  # longest sequence the KV pool can hold (<= max_model_len)
    num_blocks: int  # KV blocks in the pool
    block_size: int  # tokens per block


@dataclass
class EngineHealth:
    """What a health probe needs, read without waiting for the engine thread."""

    alive: bool  # the engine thread runs and has not failed
    error: str | None  # why it failed, if it did
    step_running_s: float | None  # how long the current step has run; None between steps
    last_step_age_s: float | None  # seconds since the last step ended; None before the first


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
        self._lock = threading.Lock()  # orders `_submit` against the thread's final drain
        self._accepting = True  # commands are still run (False once the thread is leaving)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._closing = False
        self._running = True
        self.error: BaseException | None = None
        self.on_failure: list[Callable[[BaseException], None]] = []  # called on the engine thread
        self._step_started: float | None = None
        self._last_step_end: float | None = None
        build = (lambda: engine) if isinstance(engine, Engine) else engine
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="tokenmind-engine", daemon=True)
        self._thread.start()
        self.engine: Engine = built.result()  # a failed build raises here; only the engine thread drives it
        e = self.engine
        self.limits = EngineLimits(e.max_model_len, e.max_seq_len, e.block_manager.num_blocks, e.config.block_size)

    @classmethod
    def from_pretrained(cls, model: str | Path | Pretrained, **engine_options: Any) -> AsyncEngine:
        """Load a model (or take a loaded one) as `LLM` does and start the engine thread."""
        return cls(lambda: LLM(model, **engine_options).engine)

    # ----------------------------------------------------------------- the asyncio side

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, adapter: str | None = None,
                       prompt_embeds: list[PromptEmbeds | tuple] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs until it finishes (with LoRA `adapter`, if named, and the
        `prompt_embeds` of `Engine.add_request`); leaving the loop early aborts it."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def add() -> None:
            self.engine.add_request(prompt, params, request_id, adapter, prompt_embeds)
            self._streams[request_id] = (loop, outputs)

        try:
            await self._call(add)  # a bad request raises here, in the caller
        except asyncio.CancelledError:  # the add may still run (or have run): nobody would read it
            self._submit(self._abort, request_id)
            raise
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._submit(self._abort, request_id)  # no await: this may run while being cancelled

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the engine would reject this request (safe from any thread)."""
        self.engine.check_request(prompt_ids, params)

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """`Engine.embed` on the engine thread, between two steps."""
        vectors = await self._call(self.engine.embed, prompts)
        return vectors.tolist()

    async def run_between_steps(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine thread, between two steps: other tensor work (an encoder's
        forward) then shares the engine's OpenMP threads instead of starting a second team."""
        return await self._call(fn, *args)

    @property
    def grammar(self) -> GrammarCompiler:
        """The engine's grammar compiler (thread-safe): compile a structured-output constraint here,
        off the event loop, and the engine's `add_request` finds it compiled."""
        return self.engine.grammar

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort". Nothing to do on a stopped engine."""
        try:
            await asyncio.wrap_future(self._submit(self._abort, request_id))
        except (EngineFailed, EngineStopped):  # nothing runs any more
            pass

    async def stats(self) -> EngineStats:
        """Exact statistics, taken between steps (waits for the current step; `snapshot` does not)."""
        return await self._call(self.engine.stats)

    def health(self) -> EngineHealth:
        now = time.perf_counter()
        started, ended = self._step_started, self._last_step_end
        alive = self._thread.is_alive() and self.error is None and not self._closing
        return EngineHealth(alive, None if self.error is None else repr(self.error),
                            None if started is None else now - started, None if ended is None else now - ended)

    async def shutdown(self) -> None:
        """Abort everything still running, end all streams and stop the engine thread."""
        if not self._closing:
            self._closing = True
            self._submit(self._stop)
        await asyncio.to_thread(self._thread.join)

    def _submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._accepting:
                self._commands.put((fn, args, future))
                self._wake.set()
                return future
        future.set_exception(self._gone())
        return future

    async def _call(self, fn: Callable, *args: Any) -> Any:
        if self.error is not None or self._closing:
            raise self._gone()
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _gone(self) -> RuntimeError:
        if self.error is not None:
            return EngineFailed(f"the engine failed: {self.error!r}; restart the server (or start a new AsyncEngine)")
        return EngineStopped("the engine is shut down")

    # ----------------------------------------------------------------- the engine thread

    def _run(self, build: Callable[[], Engine], built: Future) -> None:
        try:
            self.engine = build()
        except BaseException as e:
            self._running, self._accepting = False, False
            built.set_exception(e)
            return
        self.snapshot: EngineStats = self.engine.stats()  # refreshed by the engine thread every round
        built.set_result(self.engine)
        try:
            self._loop()
        except BaseException as e:  # the engine's state is suspect now: fail everything, stop
            self._fail(e)
        finally:
            with self._lock:
                self._accepting = False
            self._apply_commands()  # whatever came in meanwhile fails cleanly

    def _loop(self) -> None:
        while self._running:
            self._apply_commands()
            self.snapshot = self.engine.stats()
            if not self._running:
                break
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            self._step_started = time.perf_counter()
            outputs = self.engine.step()
            self._last_step_end, self._step_started = time.perf_counter(), None
            for out in outputs:
                stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
                if stream is not None:
                    self._deliver(stream, out)

    def _fail(self, error: BaseException) -> None:
        self.error, self._running, self._step_started = error, False, None
        failure = self._gone()
        failure.__cause__ = error
        for stream in self._streams.values():
            self._deliver(stream, failure)
        self._streams.clear()
        for callback in self.on_failure:
            try:
                callback(error)
            except Exception:  # a broken callback must not hide the engine's own error
                pass

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():  # its caller gave up while it was queued
                continue
            if not self._running:
                future.set_exception(self._gone())
                continue
            try:
                result = fn(*args)
            except Exception as e:
                future.set_exception(e)
            else:
                future.set_result(result)

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
