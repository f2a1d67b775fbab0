"""The FastAPI app: OpenAI's routes over one `AsyncEngine`, plus health, metrics and the chat page.

Routes only translate. A generation request is read (its size already capped by a guard), then
parsed, validated, tokenized and checked against the engine's limits on a worker thread, so a
large body never holds up other requests; then it is admitted (or refused with 429/503) and
handed to the streaming or the collecting responder (`generation.py`). The engine thread starts
with the app's lifespan and stops with it; if it fails, `/health` says so and (by default) the
process exits with status 1, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from ..engine.async_engine import AsyncEngine, EngineFailed, EngineStopped
from ..engine.sampling import SamplingParams
from ..data.fim import find_fim_tokens, infill_prompt
from ..engine.speculative import parse_speculative
from ..engine.structured import StructuredOutput
from ..model.load import AUTO, Pretrained, load_model
from ..model.encoder import SentenceEncoder, load_encoder
from ..model.lora import is_adapter_dir, load_adapter, routing_of
from .admission import Admission
from .config import ServeConfig
from .errors import APIError, documented, install_error_handlers
from .generation import ClientDisconnected, EventStream, Generation, QueueTimeout, collect, until_disconnect
from .guards import ApiKeyMiddleware, BodyLimitMiddleware, TrustedHostMiddleware
from .metrics import Metrics, MetricsMiddleware
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                       SamplingRequest, TokenizeRequest)
from .responses import ChatFormat, CompletionFormat, ResponseFormat
from .tool_calls import FORMATS as TOOL_FORMATS
from .tool_calls import ToolFormat, format_for_template

if TYPE_CHECKING:  # imported where a VLM is served: the vision stack costs the chat server nothing otherwise
    from ..vision.vlm import VisionLanguageModel
    from .vision import ImageInputs, RequestImage

log = logging.getLogger("tokenmind.serve")
STATIC = Path(__file__).parent / "static"
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize",
             "/health", "/metrics", "/"]
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
# A generation answers one JSON body, or (stream: true) server-sent events; or one of these errors.
GENERATION_RESPONSES = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
                              "description": "the completion, or its chunks as server-sent events with stream: true"},
                        **documented(400, 401, 404, 413, 429, 500, 503)}
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"; only metrics see it


class Prepared:
    """A parsed, tokenized request that the engine will accept; `images` (a VLM's chat) start at
    `image_starts` in its one prompt."""

    def __init__(self, body: SamplingRequest, prompts: list[list[int]], params: SamplingParams, fmt: ResponseFormat,
                 adapter: str | None, echo: list[str] | None = None, images: list[RequestImage] | None = None,
                 image_starts: list[int] | None = None):
        self.body, self.prompts, self.params, self.fmt, self.adapter = body, prompts, params, fmt, adapter
        self.echo, self.images, self.image_starts = echo, images or [], image_starts or []


class Service:
    """What the routes share: the model's tokenizer and limits, the engine while serving, admission, metrics."""

    def __init__(self, config: ServeConfig, pretrained: Pretrained, draft: Pretrained | None = None,
                 encoder: SentenceEncoder | None = None, vision: VisionLanguageModel | None = None):
        """`vision`: the VLM whose language model `pretrained` is; chat messages may then hold images."""
        self.config, self.pretrained, self.tokenizer, self.draft = config, pretrained, pretrained.tokenizer, draft
        self.encoder = encoder  # answers /v1/embeddings requests that name config.embedding_model_name
        self.images: ImageInputs | None = None
        if vision is not None:
            from .vision import ImageInputs
            self.images = ImageInputs(vision, self.tokenizer, config.max_images_per_request, config.max_image_bytes,
                                      config.max_image_pixels)
        self.model_name = config.model_name
        self.admission = Admission(config.max_num_seqs + config.max_queue, config.retry_after)
        self.metrics = Metrics(ENDPOINTS)
        self.engine: AsyncEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.max_model_len = self.max_seq_len = 0
        self.exit_code = 0
        self.request_exit: Callable[[], None] | None = None  # set by the server that runs this app
        self._drain_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        options = self.config.engine_options()
        if self.draft is not None:
            options["draft_model"] = self.draft
        self.engine = AsyncEngine.from_pretrained(self.pretrained, **options)
        self.engine.on_failure.append(self._on_engine_thread_failure)
        limits = self.engine.limits
        self.max_model_len, self.max_seq_len = limits.max_model_len, limits.max_seq_len
        log.info("serving %s as %r (context %d tokens, %d KV blocks)", self.pretrained.name, self.model_name,
                 self.max_model_len, limits.num_blocks)

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

    def _on_engine_thread_failure(self, error: BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already closed: the server is gone anyway
            self.loop.call_soon_threadsafe(self._engine_failed, error)

    def _engine_failed(self, error: BaseException) -> None:
        log.critical("the engine failed: %r; every request was ended with an error", error, exc_info=error)
        if self.config.exit_on_engine_failure and self.request_exit is not None:
            log.critical("shutting down with exit status 1 so that a supervisor restarts the server")
            self.exit_code = 1
            self.admission.draining = True
            self.request_exit()

    def ready(self) -> AsyncEngine:
        """The engine, or 503 if it is not serving."""
        if self.engine is None:
            raise APIError(503, "the engine is not running", type="server_error", code="not_ready")
        if self.engine.error is not None:
            raise APIError(503, f"the engine failed ({self.engine.error!r}); the server must be restarted",
                           type="server_error", code="engine_failed")
        return self.engine

    # ----------------------------------------------------------------- request → token ids (worker thread)

    @property
    def model_names(self) -> list[str]:
        """The base model's name, then its LoRA adapters' (what a request's `model` may be), then the encoder's."""
        return [self.model_name, *self.config.lora, *([self.config.embedding_model_name] if self.encoder else [])]

    def check_model(self, model: str, embeddings: bool = False) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model), or a 404; the
        embedding model is accepted only where `embeddings` (it cannot generate)."""
        if model not in self.model_names:
            served = ", ".join(repr(m) for m in self.model_names)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        if model == self.config.embedding_model_name and not embeddings:
            raise APIError(400, f"{model!r} is an embedding model: use it with /v1/embeddings; generate with "
                                f"{self.model_name!r}", param="model")
        return None if model == self.model_name else model

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How this model's template shows tools and how its replies call them (`--tool-parser` overrides)."""
        if self.config.tool_parser is not None:
            return TOOL_FORMATS[self.config.tool_parser]
        return format_for_template(self.tokenizer.chat_template)

    def template_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as the chat template reads them, image parts as the VLM's placeholder tokens;
        a 400 if they hold images and this model reads text only."""
        image_text = None if self.images is None else self.images.image_text
        for i, m in enumerate(messages):
            if image_text is None and m.images():
                j = m.images()[0][0]
                raise APIError(400, f"messages[{i}].content[{j}] is an image, but {self.model_name!r} is a text-only "
                                    "model; send text only, or serve a vision-language model (tokenmind serve "
                                    "--model VLM_DIR)", param=f"messages[{i}].content[{j}]",
                               code="image_input_not_supported")
        return [m.for_template(image_text) for m in messages]

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages, tools = self.template_messages(body.messages), body.tool_dicts()
        try:
            messages, tools = self.tool_format.prepare(messages, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tools" if tools else "messages") from e
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e

    def structured_output(self, body: SamplingRequest) -> tuple[StructuredOutput | None, str | None]:
        """The grammar the reply must match (a forced tool call, or `response_format`), and the
        request field it comes from."""
        try:
            structured = body.structured()
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from e
        if not isinstance(body, ChatCompletionRequest):
            return structured, "response_format"
        forced, name = body.forced_function()
        if not forced:
            return structured, "response_format"
        if structured is not None:
            raise APIError(400, "response_format cannot be combined with a forced tool call (tool_choice "
                                "\"required\" or a named function): drop one of them", param="response_format")
        try:
            special = self.ready().grammar.special_tokens(self.tool_format.markup)
            grammar = self.tool_format.grammar(body.tool_dicts(), name, body.parallel_tool_calls, special)
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from e
        return StructuredOutput(lark=grammar), "tools"

    def echo_texts(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
        """Per prompt, what `echo` repeats: the prompt as sent (token ids decoded)."""
        if not body.echo:
            return None
        return [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(body.prompts(), prompts)]

    def completion_prompt(self, prompt: str | list[int], suffix: str | None = None) -> list[int]:
        if suffix:  # fill-in-the-middle: the prompt is the prefix
            tokens = find_fim_tokens(self.tokenizer)
            if tokens is None:
                raise APIError(400, "this model has no fill-in-the-middle tokens, so it cannot complete between a "
                                    "prompt and a suffix; leave suffix out, or serve a model trained with FIM",
                               param="suffix")
            prefix = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            return infill_prompt(prefix, self.tokenizer.encode(suffix), tokens)
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

    def prepare(self, raw: bytes, content_type: str | None, kind: type[SamplingRequest]) -> Prepared:
        """Body bytes → a request the engine accepts, or an `APIError` naming what is wrong. Blocking."""
        body = parse_body(raw, content_type, kind)
        adapter = self.check_model(body.model)
        echo, images, starts = None, [], []
        if isinstance(body, ChatCompletionRequest):
            prompts, param = [self.chat_prompt(body)], "messages"
            if self.images is not None:
                images = self.images.read(body.messages)
                starts = self.images.starts(prompts[0], len(images))
            tools = self.tool_format if body.tool_dicts() else None
            fmt: ResponseFormat = ChatFormat(body.model, self.tokenizer, body.include_usage, tools)
        else:
            prompts, param = [self.completion_prompt(p, body.suffix) for p in body.prompts()], "prompt"
            fmt = CompletionFormat(body.model, self.tokenizer, body.include_usage)
        structured, structured_param = self.structured_output(body)
        try:
            params = body.sampling_params(self.max_tokens(body, prompts, param), structured)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        if isinstance(body, CompletionRequest) and body.suffix:
            params.stop_token_ids = self.tokenizer.infill_stop_token_ids
        if structured is not None:  # compiled here, on this worker thread; the engine finds it cached
            try:
                self.ready().grammar.matcher(structured)
            except ValueError as e:
                raise APIError(400, str(e), param=structured_param) from e
        for ids in prompts:  # token ids out of range, a KV pool too small for the sequence, ...
            try:
                self.ready().check_request(ids, params)
            except ValueError as e:
                raise APIError(400, str(e), param=param) from e
        if isinstance(body, CompletionRequest):  # decoded only once the ids are known to be in the vocabulary
            echo = self.echo_texts(body, prompts)
        return Prepared(body, prompts, params, fmt, adapter, echo, images, starts)

    # ----------------------------------------------------------------- request → response

    async def respond(self, request: Request, kind: type[SamplingRequest]) -> Response:
        """Run the request and answer with an event stream or one JSON body."""
        self.ready()
        self.admission.check(1)  # a full server refuses before reading or parsing anything
        raw = await request.body()
        prep = await asyncio.to_thread(self.prepare, raw, request.headers.get("content-type"), kind)
        embeds = None
        if prep.images:  # the ViT and projector run on the engine thread, between two steps
            try:
                embeds = [await self.ready().run_between_steps(self.images.embeds, prep.images, prep.image_starts)]
            except (EngineFailed, EngineStopped) as e:
                raise self.failure(e) from e
        gen = Generation(self.ready(), self.admission, self.metrics, prep.prompts, prep.params, uuid.uuid4().hex,
                         prep.adapter, prep.echo, embeds)
        if prep.body.stream:
            return EventStream(gen, prep.fmt, self.config.heartbeat_interval, self.failure)
        try:
            return JSONResponse(await until_disconnect(request, collect(gen, prep.fmt)))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except (QueueTimeout, EngineFailed, EngineStopped) as e:
            raise self.failure(e) from e
        finally:
            gen.close()

    # ----------------------------------------------------------------- embeddings, tokens

    def embedding_inputs(self, raw: bytes, content_type: str | None) -> tuple[EmbeddingRequest, list[list[int]]]:
        """Parse and tokenize an embeddings request (worker thread)."""
        body = parse_body(raw, content_type, EmbeddingRequest)
        self.check_model(body.model, embeddings=True)
        if self.encoder is not None and body.model == self.config.embedding_model_name:
            return body, self.encoder_inputs(body)
        hidden = self.pretrained.model.cfg.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(400, f"this model's embeddings have {hidden} dimensions and cannot be shortened; "
                                "leave out `dimensions`", param="dimensions")
        prompts = [self.completion_prompt(p) for p in body.inputs()]
        for ids in prompts:
            try:
                self.ready().check_request(ids, SamplingParams(max_tokens=0))
            except ValueError as e:
                raise APIError(400, str(e), param="input") from e
        return body, prompts

    def encoder_inputs(self, body: EmbeddingRequest) -> list[list[int]]:
        """The encoder's token ids for each input: text tokenized (and truncated) as in training, or
        token ids of its own vocabulary as given."""
        enc = self.encoder
        if body.dimensions is not None and body.dimensions != enc.dimensions:
            raise APIError(400, f"{body.model} embeddings have {enc.dimensions} dimensions and cannot be "
                                "shortened; leave out `dimensions`", param="dimensions")
        rows = []
        for item in body.inputs():
            if isinstance(item, str):
                rows.extend(enc.encode_ids([item]))
            elif max(item) >= enc.model.cfg.vocab_size or min(item) < 0 or len(item) > enc.max_seq_length:
                raise APIError(400, f"token ids for {body.model} must be in [0, {enc.model.cfg.vocab_size}) and at "
                                    f"most {enc.max_seq_length} of them; or send text", param="input")
            else:
                rows.append(item)
        return rows

    async def embeddings(self, request: Request) -> dict[str, Any]:
        engine = self.ready()
        body, prompts = await asyncio.to_thread(self.embedding_inputs, await request.body(),
                                                request.headers.get("content-type"))
        if self.encoder is not None and body.model == self.config.embedding_model_name:
            vectors = (await engine.run_between_steps(self.encoder.embed_ids, prompts)).tolist()
            pooling = "mean of the encoder's final hidden states, L2-normalized (sentence-transformers)"
        else:
            vectors = await engine.embed(prompts)
            pooling = "mean of the language model's final hidden states, L2-normalized"
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(map(len, prompts))
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "pooling": pooling}

    def tokenize(self, raw: bytes, content_type: str | None) -> dict[str, Any]:
        body = parse_body(raw, content_type, TokenizeRequest)
        if body.model is not None:
            self.check_model(body.model)
        if body.messages is not None:
            messages = self.template_messages(body.messages)
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
            except (ValueError, TypeError, jinja2.TemplateError) as e:
                raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.tokenizer.id_to_token(i) for i in ids]}

    def detokenize(self, raw: bytes, content_type: str | None) -> dict[str, Any]:
        body = parse_body(raw, content_type, DetokenizeRequest)
        if body.model is not None:
            self.check_model(body.model)
        vocab = self.pretrained.model.cfg.vocab_size
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < vocab:
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def failure(self, error: Exception) -> APIError:
        """The error response for a generation that could not finish."""
        if isinstance(error, APIError):
            return error
        if isinstance(error, QueueTimeout):
            wait = self.config.max_queue_wait
            return APIError(503, f"the request waited more than {wait:g}s in the queue: the server is overloaded; "
                                 f"retry after {self.config.retry_after}s", type="server_error", code="queue_timeout",
                            headers={"Retry-After": str(self.config.retry_after)})
        if isinstance(error, EngineStopped):
            return APIError(503, "the server is shutting down; retry against another instance", type="server_error",
                            code="shutting_down")
        if isinstance(error, EngineFailed):
            return APIError(500, f"generation failed: {error}", type="server_error", code="engine_failed")
        return APIError(500, f"generation failed: {error!r}", type="server_error")


def parse_body(raw: bytes, content_type: str | None, kind: type[BaseModel]) -> Any:
    """Validate a JSON body as FastAPI would (same errors, so the same 400 messages), off the event loop."""
    data: Any = raw
    if not raw:
        data = None
    elif content_type is None or _is_json(content_type):
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            pos, msg = (e.pos, e.msg) if isinstance(e, json.JSONDecodeError) else (e.start, "not UTF-8")
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": msg}}]) from e
    if data is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def load_off_main_thread(config: ServeConfig) -> tuple[Pretrained, Pretrained | None, SentenceEncoder | None,
                                                       VisionLanguageModel | None]:
    """Load the models on a short-lived thread, so that the main thread never runs parallel tensor work.

    The engine computes on its own thread. Weight loading on the main thread would leave that
    thread's OpenMP team alive beside the engine's; with more OpenMP threads than cores, libgomp
    stops spinning between parallel regions and every op then pays a futex wake-up. Measured on 2
    cores: 19 vs 29 tokens/s at batch 1. The loader thread's team ends with the thread.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmind-load") as pool:
        return pool.submit(_load_models, config).result()


def _load_models(config: ServeConfig) -> tuple[Pretrained, Pretrained | None, SentenceEncoder | None,
                                                VisionLanguageModel | None]:
    """The model, the draft model `--speculative MODEL` names, the `--embedding-model` encoder, and
    the VLM when the model is one (its language model is then the model)."""
    encoder = None if config.embedding_model is None else load_encoder(config.embedding_model)
    pretrained, vision = _load_chat_model(config)
    return pretrained, _load_draft(config, pretrained), encoder, vision


def _load_chat_model(config: ServeConfig) -> tuple[Pretrained, VisionLanguageModel | None]:
    """The model to generate with, and the VLM it belongs to if `config.model` is a `save_vlm` directory."""
    from ..vision.vlm import load_vlm, vlm_dir

    folder = vlm_dir(config.model)
    if folder is None:
        return load_model(config.model, dtype=config.dtype, quantize=config.quantization), None
    if config.quantization not in (None, AUTO):
        raise ValueError(f"--quantization {config.quantization} is not supported for a vision-language model; "
                         "serve it with float weights (--quantization none)")
    vision, tokenizer = load_vlm(folder, dtype=config.dtype)
    return Pretrained(vision.language_model, tokenizer, folder), vision


def _load_draft(config: ServeConfig, pretrained: Pretrained) -> Pretrained | None:
    """The draft model `--speculative MODEL` names (same dtype and quantization)."""
    if config.speculative is None or parse_speculative(config.speculative) is not None:
        return None
    draft = load_model(config.speculative, dtype=config.dtype, quantize=config.quantization)
    if draft.tokenizer.vocab_size != pretrained.tokenizer.vocab_size:
        raise ValueError(f"--speculative {config.speculative}: its vocabulary ({draft.tokenizer.vocab_size} tokens) "
                         f"is not the model's ({pretrained.tokenizer.vocab_size}); a draft model must share the "
                         "tokenizer")
    return draft


def attach_adapters(pretrained: Pretrained, adapters: dict[str, str]) -> None:
    """Add each LoRA adapter (name → PEFT directory) to the model, none active: each request
    picks one (or none) by its `model`, and one batch mixes them."""
    for name, path in adapters.items():
        if not is_adapter_dir(path):
            raise FileNotFoundError(f"--lora {name}={path}: no adapter_config.json there; give a PEFT LoRA adapter "
                                    "directory (e.g. an SFT run's final/ trained with --lora.rank)")
        load_adapter(pretrained.model, path, name=name)
    routing_of(pretrained.model).active = None


def build_app(config: ServeConfig, pretrained: Pretrained | None = None) -> FastAPI:
    """The ASGI app serving `config.model` (or an already loaded `pretrained`, e.g. in tests or notebooks).
    A vision-language model's directory (`save_vlm`) is served with image inputs (`vision.py`).

    The engine (and its KV cache) is created when the app starts serving and freed when it stops.
    """
    if pretrained is None:
        pretrained, draft, encoder, vision = load_off_main_thread(config)
    else:
        draft = vision = None
        encoder = None if config.embedding_model is None else load_encoder(config.embedding_model)
    attach_adapters(pretrained, config.lora)
    service = Service(config, pretrained, draft, encoder, vision)

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
    install_guards(app, config, service.metrics, pretrained.model.cfg.max_position_embeddings, vision is not None)

    @app.get("/health", responses={503: {"description": "starting, shutting down, stuck or failed (the body says)"}})
    async def health() -> JSONResponse:
        """200 while requests are accepted; 503 when starting, shutting down, after an engine failure, or
        while one engine step has run longer than `stuck_step_timeout`. Never waits for the engine."""
        if service.engine is None:
            return JSONResponse({"status": "unavailable", "reason": "starting"}, status_code=503)
        h, stats = service.engine.health(), service.engine.snapshot
        engine = {"alive": h.alive, "step_running_s": h.step_running_s, "last_step_age_s": h.last_step_age_s,
                  "running": stats.num_running, "waiting": stats.num_waiting}
        reason = None
        if h.error is not None:
            reason = f"the engine failed: {h.error}"
        elif service.admission.draining:
            reason = "shutting down"
        elif not h.alive:
            reason = "the engine thread is not running"
        elif h.step_running_s is not None and h.step_running_s > config.stuck_step_timeout:
            reason = (f"one engine step has run for {h.step_running_s:.0f}s "
                      f"(limit {config.stuck_step_timeout:g}s, --stuck-step-timeout)")
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason, "engine": engine}, status_code=503)
        return JSONResponse({"status": "ok", "engine": engine})

    @app.get("/v1/models", responses=documented(401))
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(service, name) for name in service.model_names]}

    @app.get("/v1/models/{model_id:path}", responses=documented(401, 404))
    async def get_model(model_id: str) -> dict:
        service.check_model(model_id, embeddings=True)
        return _model_card(service, model_id)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest), responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        return await service.respond(request, ChatCompletionRequest)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest), responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> Response:
        return await service.respond(request, CompletionRequest)

    @app.post("/v1/embeddings", openapi_extra=_json_body(EmbeddingRequest),
              responses=documented(400, 401, 404, 413, 500, 503))
    async def embeddings(request: Request) -> JSONResponse:
        return JSONResponse(await service.embeddings(request))

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest), responses=documented(400, 401, 404, 413))
    async def tokenize(request: Request) -> JSONResponse:
        raw = await request.body()
        return JSONResponse(await asyncio.to_thread(service.tokenize, raw, request.headers.get("content-type")))

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest), responses=documented(400, 401, 404, 413))
    async def detokenize(request: Request) -> JSONResponse:
        raw = await request.body()
        return JSONResponse(await asyncio.to_thread(service.detokenize, raw, request.headers.get("content-type")))

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {METRICS_TYPE: {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition format 0.0.4"}, **documented(401, 503)})
    async def metrics() -> PlainTextResponse:
        if service.engine is None:
            raise APIError(503, "the engine is not running", type="server_error", code="not_ready")
        text = service.metrics.render(service.engine.snapshot, service.admission.in_flight)
        return PlainTextResponse(text, media_type=METRICS_TYPE)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _document_request_bodies(app, ChatCompletionRequest, CompletionRequest, EmbeddingRequest, TokenizeRequest,
                             DetokenizeRequest)
    return app


def install_guards(app: FastAPI, config: ServeConfig, metrics: Metrics, model_context: int, images: bool = False
                   ) -> None:
    """Middleware, innermost first: API key, CORS, body limit, trusted hosts, metrics (outermost: it
    also counts the requests the others refuse). `images`: bodies may carry images (a VLM)."""
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:  # outside the key check: browsers send preflight requests without credentials
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    context = min(model_context, config.max_model_len or model_context)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.body_limit(context, images))
    hosts = config.trusted_hosts()
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed=hosts)
    app.add_middleware(MetricsMiddleware, metrics=metrics)


def _json_body(model: type[BaseModel]) -> dict:
    """OpenAPI for a route that reads its JSON body itself (to parse it off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _document_request_bodies(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add the request models (and the models they use) to the OpenAPI components `_json_body` points at."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(spec.pop("$defs", {}))
                components[model.__name__] = spec
            for operations in schema["paths"].values():  # bad input is a 400 here, never FastAPI's 422
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


def _model_card(service: Service, name: str) -> dict:
    card = {"id": name, "object": "model", "created": 0, "owned_by": "tokenmind",
            "max_model_len": service.max_model_len}
    if name == service.config.embedding_model_name and service.encoder is not None:  # /v1/embeddings only
        card.update(root=str(service.encoder.path), max_model_len=service.encoder.max_seq_length)
    elif name != service.model_name:  # a LoRA adapter over the base model, as vLLM lists them
        card.update(root=str(service.config.lora[name]), parent=service.model_name)
    if name == service.model_name and service.images is not None:
        card.update(input_modalities=["text", "image"], tokens_per_image=service.images.model.tokens_per_image)
    return card


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """An embedding as JSON floats, or base64 of little-endian float32 (what the openai client asks for)."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
