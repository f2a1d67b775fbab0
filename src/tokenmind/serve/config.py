"""`ServeConfig`: what `tokenmind serve` listens on, who may call it, and how much work it takes at once.

Limits bound the load. The engine runs at most `max_num_seqs` sequences per step; requests
beyond that wait inside the engine, and at most `max_queue` may wait. A request beyond both is
refused at once with HTTP 429 and a `Retry-After` header, so an overloaded server answers
quickly instead of letting latency grow without bound, and admitted requests keep being served.
A request that waits longer than `max_queue_wait` for its first step gets 503 + `Retry-After`.
Before admission, the body is capped (`max_body_bytes`, 413 above it) and parsed and tokenized on
a worker thread, so no single request can stall the others.

`tokenmind serve` builds it with `load_serve_config`: the fields' defaults, then the command's own
(a 512 MiB KV cache, the API key from $TOKENMIND_API_KEY), then `--config serve.yaml`, then flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Overrides, load_config
from ..engine.speculative import SpeculativeConfig, parse_speculative
from ..model.load import AUTO, quantization_setting
from .tool_calls import FORMATS as TOOL_PARSERS

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
BODY_BYTES_PER_CONTEXT_TOKEN = 128  # a token is ~4 characters, JSON escapes take up to 6 bytes per character
MIN_BODY_BYTES = 1 << 20
CLI_KV_CACHE_BYTES = 512 << 20  # `tokenmind serve`'s KV pool: fixed, not a share of free memory


@dataclass
class ServeConfig:
    """Settings of the OpenAI-compatible server. Only `model` is required."""

    model: str  # HF model directory, .gguf file, or alias (smollm2)
    host: str = "127.0.0.1"  # loopback only unless asked: 0.0.0.0 exposes the model to the network
    port: int = 8000
    api_key: str | None = None  # if set, /v1/* and /metrics need `Authorization: Bearer <api_key>`
    served_model_name: str | None = None  # the `model` clients send; None = derived from `model`
    lora: dict[str, str] = field(default_factory=dict)  # LoRA adapters: the `model` name a request uses → PEFT dir
    # weight and KV cache dtype: auto (the checkpoint's own where the CPU computes it natively), float32, bfloat16,
    # float16
    dtype: str = "auto"
    kv_cache_bytes: int | None = None  # KV block pool size; None = the engine's share of free memory
    max_num_seqs: int = 64  # sequences decoded together in one engine step
    max_queue: int = 256  # requests that may wait for a running slot; beyond that: 429
    max_model_len: int | None = None  # longest prompt + output; None = the model's context window
    # weight-only quantized linears: auto (a GGUF's blocks run quantized), None, "int8", "int4"
    quantization: str | None = "auto"
    max_queue_wait: float | None = 30.0  # seconds a request may wait for its first step; then 503 (None = forever)
    max_body_bytes: int | None = None  # request body limit (413 above); None = 128 bytes per context token, >= 1 MiB
    allowed_hosts: list[str] | None = None  # Host header values accepted; None = the bound address + localhost
    # without an API key (DNS-rebinding guard), any with one; "*" accepts any
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed to call the API (CORS off if empty)
    heartbeat_interval: float = 5.0  # seconds between SSE keep-alive comments while a stream has nothing to send
    stuck_step_timeout: float = 120.0  # /health reports 503 once one engine step has run this long
    exit_on_engine_failure: bool = True  # a failed engine ends the process (status 1) for a supervisor to restart
    shutdown_timeout: float = 30.0  # seconds in-flight requests may run after SIGTERM before being aborted
    retry_after: int = 1  # seconds a 429 tells the client to wait
    speculative: str | None = None  # "ngram", "mtp" (MTP depths), "medusa:PATH", "eagle:PATH" (heads) or a draft model
    # a sentence encoder (alias minilm, or a sentence-transformers folder) for /v1/embeddings under its own name
    embedding_model: str | None = None
    num_speculative_tokens: int = 8  # the most draft tokens per sequence and step
    tool_parser: str | None = None  # how replies call tools: hermes, json, generic; None = from the chat template
    log_level: str = "info"
    max_images: int = 16  # a diffusion model's images per /v1/images/generations request (`n`); more: 400
    # a vision-language model's input images (chat image_url parts): per request, bytes and pixels each; more: 400
    max_images_per_request: int = 4
    max_image_bytes: int = 4 << 20
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a non-empty key or leave it unset")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 (0 = no waiting: refuse when all slots run), "
                             f"got {self.max_queue}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.retry_after < 1:
            raise ValueError(f"retry_after must be >= 1 second, got {self.retry_after}")
        for name in ("heartbeat_interval", "stuck_step_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise ValueError(f"max_queue_wait must be > 0 seconds (or None to wait forever), got {self.max_queue_wait}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024 (a chat request needs a few hundred bytes), "
                             f"got {self.max_body_bytes}")
        clash = sorted(set(self.lora) & {self.model_name, self.embedding_model_name})
        if self.embedding_model_name == self.model_name:
            raise ValueError(f"the embedding model and the chat model are both named {self.model_name!r}; set "
                             "served_model_name")
        if clash or any(not name or not path for name, path in self.lora.items()):
            raise ValueError(f"every LoRA adapter needs a name other than the base model's ({self.model_name!r}) "
                             f"and a path, as --lora NAME=PATH; got {self.lora}")
        if self.tool_parser is not None and self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser={self.tool_parser!r}: choose one of {', '.join(TOOL_PARSERS)} or leave "
                             "it unset to follow the chat template")
        for name in ("max_images", "max_images_per_request", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        self.quantization = quantization_setting(self.quantization, "quantization")

    @property
    def model_name(self) -> str:
        """The id `/v1/models` lists and requests must name: `served_model_name`, else the model's short name."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name or str(self.model)

    @property
    def embedding_model_name(self) -> str | None:
        """The `model` an embeddings request names to get the encoder's vectors (its alias or folder name)."""
        return None if self.embedding_model is None else Path(self.embedding_model).name

    @property
    def is_public(self) -> bool:
        """True when the server listens beyond this machine (any non-loopback address)."""
        return self.host not in LOCAL_HOSTS

    def body_limit(self, context_len: int, images: bool = False) -> int:
        """The request body limit in bytes: `max_body_bytes`, or enough for a full context window
        (plus, with `images`, the most base64 images a request may carry)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        image_bytes = self.max_images_per_request * 4 * (self.max_image_bytes // 3 + 1) if images else 0
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * context_len) + image_bytes

    def trusted_hosts(self) -> list[str] | None:
        """Host header values to accept; None = any (an API key guards the server, or `*` was given)."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else list(self.allowed_hosts)
        if self.api_key is not None:
            return None
        bound = [] if self.host in WILDCARD_HOSTS else [self.host]
        return list(dict.fromkeys([*bound, *LOCAL_HOSTS]))

    def engine_options(self) -> dict[str, Any]:
        """`EngineConfig` fields for `AsyncEngine.from_pretrained` / `EngineConfig(**...)`."""
        options: dict[str, Any] = {"dtype": None if self.dtype == AUTO else self.dtype,
                                   "max_num_seqs": self.max_num_seqs,
                                   "max_num_batched_tokens": max(2048, self.max_num_seqs),
                                   "max_queue_wait": self.max_queue_wait}
        if self.kv_cache_bytes is not None:
            options["kv_cache_bytes"] = self.kv_cache_bytes
        if self.max_model_len is not None:
            options["max_model_len"] = self.max_model_len
        if self.speculative is not None:
            options["speculative"] = (parse_speculative(self.speculative, self.num_speculative_tokens)
                                      or SpeculativeConfig("draft", self.num_speculative_tokens))
        return options


def load_serve_config(path: str | Path | None = None, overrides: Overrides = ()) -> ServeConfig:
    """What `tokenmind serve` runs with: field defaults ← a 512 MiB KV cache and $TOKENMIND_API_KEY
    ← the YAML file at `path` (any ServeConfig field) ← overrides (flags, as field names)."""
    defaults: dict[str, Any] = {"kv_cache_bytes": CLI_KV_CACHE_BYTES}
    if os.environ.get("TOKENMIND_API_KEY"):
        defaults["api_key"] = os.environ["TOKENMIND_API_KEY"]
    return load_config(ServeConfig, path, overrides, defaults)
