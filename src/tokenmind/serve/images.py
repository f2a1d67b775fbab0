"""Serving a class-conditional diffusion model: OpenAI's `POST /v1/images/generations`.

`tokenmind serve --model RUN_DIR`, where RUN_DIR is a `tokenmind diffusion train` run (its saved
config has a `diffusion` section), builds this app instead of the chat one. A diffusion model has
no tokenizer, KV cache or engine step loop: a request is one batch of `n` images sampled in
`steps` scheduler steps. What fits is shared with the chat server: the guards (API key, body
limit, trusted hosts, CORS), OpenAI's error shape, `Admission` (429 beyond `max_queue` waiting
requests, 503 while shutting down), the metrics and the graceful shutdown of `server.py`.

Sampling runs on one worker thread, the one that loaded the model (one OpenMP team beside the
event loop, as `app.load_off_main_thread` explains), so `/health` and bad requests are answered
while a batch runs; batches run one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

from ..diffusion.data import class_names, image_shape
from ..diffusion.latent import data_shape, decoder
from ..diffusion.sampling import class_label, encode_png, make_scheduler, sample
from ..diffusion.train import load_diffusion_model
from ..engine.outputs import EngineStats
from .admission import Admission
from .app import METRICS_TYPE, STATIC, install_guards, parse_body
from .config import ServeConfig
from .errors import APIError, documented, install_error_handlers
from .metrics import Metrics
from .protocol import ImageGenerationRequest

log = logging.getLogger("tokenmind.serve")
IMAGE_ENDPOINTS = ["/v1/images/generations", "/v1/models", "/health", "/metrics", "/"]
SAMPLER = {"ddpm": "ddim", "flow": "euler"}  # by training objective: deterministic, good in few steps


class ImageService:
    """The diffusion model, its one sampling thread, admission and metrics."""

    def __init__(self, config: ServeConfig):
        self.config, self.model_name = config, config.model_name
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmind-images")
        self.model, self.cfg = self.worker.submit(load_diffusion_model, config.model).result()
        self.classes = class_names(self.cfg.data.dataset)
        d = self.cfg.diffusion
        self.shape = data_shape(self.cfg.data.dataset, self.cfg.data.pad_to, d.latent_vae)  # pixels or latents
        self.decode = decoder(d.latent_vae)
        _, height, width = image_shape(self.cfg.data.dataset, self.cfg.data.pad_to)
        self.size = f"{width}x{height}"  # OpenAI's WIDTHxHEIGHT
        self.sampler = SAMPLER[self.cfg.diffusion.objective]
        self.admission = Admission(1 + config.max_queue, config.retry_after)  # one batch runs, max_queue wait
        self.metrics = Metrics(IMAGE_ENDPOINTS)
        self.running = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0
        self.request_exit: Callable[[], None] | None = None  # set by the server that runs this app
        self._drain_task: asyncio.Task | None = None
        log.info("serving the %s diffusion model %s as %r (%s images, classes: %s)", self.cfg.model.kind,
                 config.model, self.model_name, self.size, ", ".join(self.classes))

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        self.admission.draining = True
        self.worker.shutdown(wait=False, cancel_futures=True)

    def begin_shutdown(self) -> None:
        """From a signal handler: refuse new requests; the batch running finishes (it cannot be cut)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self.admission.drain(self._abandon, self.config.shutdown_timeout))

    async def _abandon(self, request_id: str) -> None:
        log.warning("shutting down: request %s is still sampling; uvicorn ends its connection", request_id)

    def card(self) -> dict:
        """The /v1/models entry, with what a client needs to ask for images: the classes and the size."""
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tokenmind",
                "task": "image-generation", "classes": self.classes, "size": self.size,
                "max_images": self.config.max_images}

    def check(self, body: ImageGenerationRequest) -> int:
        """The class label the request asks for, or the 4xx saying what to change."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        if body.n > self.config.max_images:
            raise APIError(400, f"n={body.n}: this server generates at most {self.config.max_images} images per "
                                "request (--max-images); ask for fewer, or send several requests", param="n")
        if body.size is not None and body.size != self.size:
            raise APIError(400, f"size {body.size!r}: this model generates {self.size} images only; send "
                                f"size={self.size!r} or leave it out", param="size")
        steps_max = self.cfg.diffusion.num_train_timesteps
        if self.sampler == "ddim" and body.steps > steps_max:
            raise APIError(400, f"steps={body.steps}: this model was trained with {steps_max} timesteps, so at "
                                f"most {steps_max} sampling steps", param="steps")
        try:
            return class_label(self.cfg, body.prompt)
        except ValueError as e:
            raise APIError(400, f"prompt must name one of the model's classes: {e}", param="prompt",
                           code="unknown_class") from e

    def draw(self, label: int, body: ImageGenerationRequest) -> list[bytes]:
        """`n` PNGs of class `label` (on the worker thread)."""
        generator = torch.Generator()
        if body.seed is None:
            generator.seed()
        else:
            generator.manual_seed(body.seed)
        labels = torch.full((body.n,), label)
        images = sample(self.model, make_scheduler(self.cfg, self.sampler), (body.n, *self.shape), labels,
                        body.steps, body.guidance_scale, generator, num_classes=len(self.classes))
        return encode_png(self.decode(images))

    async def generate(self, request: Request) -> dict:
        body = parse_body(await request.body(), request.headers.get("content-type"), ImageGenerationRequest)
        label = self.check(body)
        request_id = f"img-{uuid.uuid4().hex}"
        self.admission.admit([request_id])
        start = time.monotonic()
        try:
            pictures = await asyncio.wrap_future(self.worker.submit(self._draw_counted, label, body))
        except RuntimeError as e:  # the worker was shut down under us
            raise APIError(503, "the server is shutting down; retry against another instance", type="server_error",
                           code="shutting_down") from e
        finally:
            self.admission.release([request_id])
        self.metrics.latency.observe(time.monotonic() - start)
        encoded = [base64.b64encode(p).decode("ascii") for p in pictures]
        name = self.classes[label]
        if body.response_format == "url":
            data = [{"url": "data:image/png;base64," + b, "revised_prompt": name} for b in encoded]
        else:
            data = [{"b64_json": b, "revised_prompt": name} for b in encoded]
        return {"created": int(time.time()), "data": data}

    def _draw_counted(self, label: int, body: ImageGenerationRequest) -> list[bytes]:
        self.running += 1
        try:
            return self.draw(label, body)
        finally:
            self.running -= 1

    def stats(self) -> EngineStats:
        """The engine gauges /metrics shows, for a batch-at-a-time image sampler (no KV cache)."""
        waiting = max(0, self.admission.in_flight - self.running)
        return EngineStats(num_running=self.running, num_waiting=waiting, kv_cache_usage=0.0,
                           prefix_cache_hit_rate=0.0, num_generated_tokens=0, num_preemptions=0, num_steps=0,
                           num_blocks=0)


def build_image_app(config: ServeConfig) -> FastAPI:
    """The ASGI app serving the diffusion run `config.model`: images, models, health, metrics, the image page."""
    service = ImageService(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="tokenmind", summary="OpenAI-compatible image API over a tokenmind diffusion model",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    install_error_handlers(app)
    install_guards(app, config, service.metrics, 0)

    @app.get("/health", responses={503: {"description": "shutting down"}})
    async def health() -> JSONResponse:
        """200 while requests are accepted, 503 once shutting down."""
        images = {"running": service.running, "in_flight": service.admission.in_flight}
        if service.admission.draining:
            return JSONResponse({"status": "unavailable", "reason": "shutting down", "images": images},
                                status_code=503)
        return JSONResponse({"status": "ok", "images": images})

    @app.get("/v1/models", responses=documented(401))
    async def list_models() -> dict:
        return {"object": "list", "data": [service.card()]}

    @app.get("/v1/models/{model_id:path}", responses=documented(401, 404))
    async def get_model(model_id: str) -> dict:
        if model_id != service.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{service.model_name!r}", param="model", code="model_not_found")
        return service.card()

    @app.post("/v1/images/generations", responses=documented(400, 401, 404, 413, 429, 500, 503),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": ImageGenerationRequest.model_json_schema()}}}})
    async def images_generations(request: Request) -> JSONResponse:
        return JSONResponse(await service.generate(request))

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {METRICS_TYPE: {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition format 0.0.4"}, **documented(401)})
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(service.stats(), service.admission.in_flight),
                                 media_type=METRICS_TYPE)

    @app.get("/", include_in_schema=False)
    async def image_page() -> FileResponse:
        return FileResponse(STATIC / "images.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
