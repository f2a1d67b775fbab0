"""The FastAPI app: OpenAI's routes over one `AsyncEngine`, plus health, metrics and the chat page.

Routes only translate: check the model name, turn messages or a prompt into token ids, check
them against the context window, and hand a `Generation` to the streaming or the collecting
responder (`generation.py`). The engine thread starts with the app's lifespan and stops with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from ..engine.async_engine import AsyncEngine
from ..pretrained import Pretrained, load_pretrained
from .admission import Admission
from .auth import ApiKeyMiddleware
from .config import ServeConfig
from .errors import APIError, install_error_handlers
from .generation import ClientDisconnected, EventStream, Generation, collect, until_disconnect
from .metrics import Metrics, MetricsMiddleware
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from .responses import ChatFormat, CompletionFormat, ResponseFormat

log = logging.getLogger("tokenmind.serve")
STATIC = Path(__file__).parent / "static"
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/"]
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"; only metrics see it


class Service:
    """What the routes share: the model's tokenizer and limits, the engine while serving, admission, metrics."""

    def __init__(self, config: ServeConfig, pretrained: Pretrained):
        self.config, self.pretrained, self.tokenizer = config, pretrained, pretrained.tokenizer
        self.model_name = config.model_name
        self.admission = Admission(config.max_num_seqs + config.max_queue, config.retry_after)
        self.metrics = Metrics(ENDPOINTS)
        self.engine: AsyncEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.max_model_len = self.max_seq_len = 0
        self._drain_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.engine = AsyncEngine.from_pretrained(self.pretrained, **self.config.engine_options())
        engine = self.engine.engine
        self.max_model_len = engine.max_model_len
        # the longest sequence the KV pool can hold (its last token is sampled, never cached)
        self.max_seq_len = min(engine.max_model_len, engine.block_manager.num_blocks * engine.config.block_size + 1)
        self.loop = asyncio.get_running_loop()
        log.info("serving %s as %r (context %d tokens, %d KV blocks)", self.pretrained.name, self.model_name,
                 self.max_model_len, engine.block_manager.num_blocks)

    async def stop(self) -> None:
        """The last step of shutdown: connections are closed by now; the engine aborts anything left."""
        self.admission.draining = True
        if self.engine is not None:
            await self.engine.shutdown()

    def begin_shutdown(self) -> None:
        """From a signal handler: refuse new work now, abort what still runs after `shutdown_timeout`."""
        if self.loop is not None and self.engine is not None:
            self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        drain = self.admission.drain(self.engine.abort, self.config.shutdown_timeout)
        self._drain_task = asyncio.create_task(drain)  # keep a reference: the loop holds tasks only weakly

    # ----------------------------------------------------------------- request → token ids

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.for_template() for m in body.messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id]
        if not ids:
            raise APIError(400, "the prompt is empty and the tokenizer has no BOS token to start from", param="prompt")
        return ids

    def max_tokens(self, body: SamplingRequest, prompts: list[list[int]], prompt_param: str) -> int:
        """The request's max_tokens, checked against the context window; by default all that is left."""
        longest = max(map(len, prompts))
        if longest >= self.max_model_len:
            raise APIError(400, f"the prompt has {longest} tokens but this model's context window is "
                                f"{self.max_model_len} tokens; shorten it", param=prompt_param,
                           code="context_length_exceeded")
        name, requested = body.requested_max_tokens()
        if requested is None:
            return max(1, self.max_seq_len - longest)
        if longest + requested > self.max_model_len:
            raise APIError(400, f"the context window is {self.max_model_len} tokens; the prompt takes {longest}, "
                                f"so {name} can be at most {self.max_model_len - longest} (got {requested})",
                           param=name, code="context_length_exceeded")
        return requested

    # ----------------------------------------------------------------- request → response

    async def respond(self, request: Request, body: SamplingRequest, prompts: list[list[int]], prompt_param: str,
                      fmt: ResponseFormat) -> Response:
        """Run the prompts and answer with an event stream or one JSON body."""
        if self.engine is None:
            raise APIError(503, "the engine is not running", type="server_error", code="not_ready")
        try:
            params = body.sampling_params(self.max_tokens(body, prompts, prompt_param))
        except ValueError as e:
            raise APIError(400, str(e)) from e
        gen = Generation(self.engine, self.admission, self.metrics, prompts, params, uuid.uuid4().hex)
        handed_over = False  # to the event stream, which closes `gen` when it ends
        try:
            await until_disconnect(request, gen.start())
            if body.stream:
                handed_over = True
                return EventStream(gen, fmt)
            return JSONResponse(await until_disconnect(request, collect(gen, fmt)))
        except ValueError as e:  # the engine rejected a prompt (token ids out of range, KV pool too small, ...)
            raise APIError(400, str(e)) from e
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not handed_over:
                gen.close()


def load_off_main_thread(config: ServeConfig) -> Pretrained:
    """Load the model on a short-lived thread, so that the main thread never runs parallel tensor work.

    The engine computes on its own thread. Weight loading on the main thread would leave that
    thread's OpenMP team alive beside the engine's; with more OpenMP threads than cores, libgomp
    stops spinning between parallel regions and every op then pays a futex wake-up. Measured on 2
    cores: 19 vs 29 tokens/s at batch 1. The loader thread's team ends with the thread.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmind-load") as pool:
        return pool.submit(load_pretrained, config.model, dtype=config.dtype, quantize=config.quantization).result()


def build_app(config: ServeConfig, pretrained: Pretrained | None = None) -> FastAPI:
    """The ASGI app serving `config.model` (or an already loaded `pretrained`, e.g. in tests or notebooks).

    The engine (and its KV cache) is created when the app starts serving and freed when it stops.
    """
    if pretrained is None:
        pretrained = load_off_main_thread(config)
    service = Service(config, pretrained)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="tokenmind", summary="OpenAI-compatible API over the tokenmind engine", lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # the docs pages load from a CDN; /openapi.json stays
    app.state.service = service
    install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(MetricsMiddleware, metrics=service.metrics)  # outermost: it also counts the 401s

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while requests are accepted; 503 when starting, shutting down, or after an engine failure."""
        if service.engine is None or service.admission.draining:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        try:
            await service.engine.stats()
        except RuntimeError as e:
            return JSONResponse({"status": f"unavailable: {e}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        service.check_model(model_id)
        return _model_card(service)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        fmt = ChatFormat(service.model_name, service.tokenizer, body.include_usage)
        return await service.respond(request, body, [service.chat_prompt(body)], "messages", fmt)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        prompts = [service.completion_prompt(p) for p in body.prompts()]
        fmt = CompletionFormat(service.model_name, service.tokenizer, body.include_usage)
        return await service.respond(request, body, prompts, "prompt", fmt)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if service.engine is None:
            raise APIError(503, "the engine is not running", type="server_error", code="not_ready")
        text = service.metrics.render(await service.engine.stats(), service.admission.in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _model_card(service: Service) -> dict:
    return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "tokenmind",
            "max_model_len": service.max_model_len}
