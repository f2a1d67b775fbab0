"""Shared pieces of the server tests: a tiny chat model with a real `Tokenizer`, and a live uvicorn server.

(The other test_serve_* modules import from here, as test_engine_async imports from test_engine_llm.)

The tokenizer is byte-level (token id = byte value) with ChatML special tokens and template, so
chat requests run the real template code. The model is a random 2-layer Transformer whose logits
are masked to printable ASCII: its greedy output is deterministic, always valid text, and never
ends before `max_tokens` (EOS is masked too), which makes stream contents and lengths exact.
`step_delay` slows each forward pass, for tests that must act while a request is running.
"""

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.model.load import Pretrained
from tokenmind.serve.config import ServeConfig
from tokenmind.serve.server import uvicorn_server
from tokenmind.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
MODEL = "tiny"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table that ByteLevel pre-tokenizers use."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Tokenizer:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=CHATML)


class TinyChatModel(Transformer):
    """A random Transformer that only ever emits printable ASCII (bytes 32..126), `step_delay` s per step."""

    def __init__(self, cfg: ModelConfig, step_delay: float = 0.0):
        super().__init__(cfg)
        self.step_delay = step_delay
        mask = torch.full((cfg.vocab_size,), -1e4)  # finite: logprobs stay JSON numbers
        mask[32:127] = 0.0
        self.register_buffer("mask", mask, persistent=False)

    def hidden_states(self, input_ids, positions=None, *args, **kw):
        if self.step_delay:
            time.sleep(self.step_delay)
        return super().hidden_states(input_ids, positions, *args, **kw)

    def logits(self, hidden):
        return super().logits(hidden) + self.mask


def tiny_pretrained(step_delay: float = 0.0, context: int = 256) -> Pretrained:
    cfg = ModelConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context)
    torch.manual_seed(0)
    model = TinyChatModel(cfg, step_delay).eval()
    model.init_weights(std=0.5)
    return Pretrained(model, byte_tokenizer(), Path(MODEL))


class LiveServer:
    """A uvicorn server on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, pretrained: Pretrained | None, model: str = MODEL, **options):
        """`pretrained` None: the server loads `model` itself, as `tokenmind serve` does."""
        self.config = ServeConfig(model=model, port=0, log_level="warning", **options)
        self.server = uvicorn_server(self.config, pretrained)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.service = self.server.config.app.state.service

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def openai(self, api_key: str = "unused") -> "openai.OpenAI":
        """The official client for this server (no retries: a test sees every error)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {"name{labels}": value}."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Until nothing runs, waits or holds KV blocks; returns the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["tokenmind_num_requests_running"] == m["tokenmind_num_requests_waiting"] == 0
                    and m["tokenmind_kv_cache_usage_ratio"] == 0 and m["tokenmind_requests_in_flight"] == 0)
            if idle:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: {m}")
            time.sleep(0.02)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(lines) -> list:
    """The JSON payloads of `data:` lines up to `[DONE]` (which must come last)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            events.append("[DONE]")
            break
        events.append(json.loads(data))
    return events


def test_byte_tokenizer_round_trips_and_renders_chatml():
    tok = byte_tokenizer()
    text = "Grüße, world!"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[0] == 257 and tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == {258}
