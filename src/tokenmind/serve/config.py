"""`ServeConfig`: what `tokenmind serve` listens on, who may call it, and how much work it takes at once.

Two limits bound the load. The engine runs at most `max_num_seqs` sequences per step; requests
beyond that wait inside the engine, and at most `max_queue` may wait. A request beyond both is
refused at once with HTTP 429 and a `Retry-After` header, so an overloaded server answers
quickly instead of letting latency grow without bound, and admitted requests keep being served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pretrained import QUANTIZATIONS

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeConfig:
    """Settings of the OpenAI-compatible server. Only `model` is required."""

    model: str  # HF model directory, .gguf file, or alias (smollm2)
    host: str = "127.0.0.1"  # loopback only unless asked: 0.0.0.0 exposes the model to the network
    port: int = 8000
    api_key: str | None = None  # if set, /v1/* and /metrics need `Authorization: Bearer <api_key>`
    served_model_name: str | None = None  # the `model` clients send; None = derived from `model`
    dtype: str = "float32"  # weight and KV cache dtype: float32, bfloat16, float16
    kv_cache_bytes: int | None = None  # KV block pool size; None = the engine's share of free memory
    max_num_seqs: int = 64  # sequences decoded together in one engine step
    max_queue: int = 256  # requests that may wait for a running slot; beyond that: 429
    max_model_len: int | None = None  # longest prompt + output; None = the model's context window
    quantization: str | None = None  # weight-only quantization of the linears: None, "int8" or "int4"
    shutdown_timeout: float = 30.0  # seconds in-flight requests may run after SIGTERM before being aborted
    retry_after: int = 1  # seconds a 429 tells the client to wait
    log_level: str = "info"

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
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)} "
                             "or leave it unset for float weights")

    @property
    def model_name(self) -> str:
        """The id `/v1/models` lists and requests must name: `served_model_name`, else the model's short name."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name or str(self.model)

    @property
    def is_public(self) -> bool:
        """True when the server listens beyond this machine (any non-loopback address)."""
        return self.host not in LOCAL_HOSTS

    def engine_options(self) -> dict[str, Any]:
        """`EngineConfig` fields for `AsyncEngine.from_pretrained` / `EngineConfig(**...)`."""
        options: dict[str, Any] = {"dtype": self.dtype, "max_num_seqs": self.max_num_seqs,
                                   "max_num_batched_tokens": max(2048, self.max_num_seqs)}
        if self.kv_cache_bytes is not None:
            options["kv_cache_bytes"] = self.kv_cache_bytes
        if self.max_model_len is not None:
            options["max_model_len"] = self.max_model_len
        return options
