"""Text in, streamed text out: plain completion and a multi-turn chat session, over the engine.

The CLI's `generate` and `chat` are thin shells over these. Both run through `LLM` (the paged
engine, one request at a time), so speculative decoding, quantized weights and prefix caching
(a chat's earlier turns are not recomputed) work here as they do in the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from .engine.llm import LLM
from .engine.outputs import RequestOutput
from .engine.sampling import SamplingParams
from .engine.speculative import SpeculativeConfig, parse_speculative
from .model.load import Pretrained, load_model


def interactive_llm(model: Pretrained, speculative: str | None = None) -> LLM:
    """An engine for one conversation at a time. `speculative`: None, "ngram" (prompt lookup, no
    second model), "mtp" (the model's multi-token prediction depths), "medusa:PATH" / "eagle:PATH"
    (a trained draft head) or a draft model reference (path or alias) whose tokenizer is the target's."""
    if speculative is None:
        return LLM(model, max_num_seqs=1)
    if (config := parse_speculative(speculative)) is not None:
        return LLM(model, max_num_seqs=1, speculative=config)
    dtype = model.model.embed_tokens.weight.dtype
    draft = load_model(speculative, dtype=dtype)
    return LLM(model, draft_model=draft, max_num_seqs=1, speculative=SpeculativeConfig("draft"))


class StreamStats:
    """The timing of one streamed reply, as `--stats` prints it: time to first token (prompt
    processing plus one step) and the decode speed after it."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens, self.tokens, self.finish_reason = prompt_tokens, 0, None
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end = self.start

    def observe(self, out: RequestOutput) -> RequestOutput:
        self.end = time.perf_counter()
        if self.first is None and out.token_ids:
            self.first = self.end
        self.tokens, self.finish_reason = len(out.token_ids), out.finish_reason
        return out

    @property
    def ttft(self) -> float:
        return (self.first or self.end) - self.start

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after it (0 when there was one token or none)."""
        after = self.end - (self.first or self.end)
        return (self.tokens - 1) / after if self.tokens > 1 and after > 0 else 0.0

    def summary(self) -> str:
        return (f"[{self.tokens} tokens in {self.end - self.start:.2f} s; time to first token "
                f"{self.ttft * 1000:.0f} ms ({self.prompt_tokens} prompt tokens, "
                f"{self.prompt_tokens / max(self.ttft, 1e-9):.0f} tok/s); decode {self.decode_tokens_per_s:.1f} tok/s; "
                f"finish: {self.finish_reason}]")


def complete(model: Pretrained | LLM, prompt: str, params: SamplingParams) -> Iterator[str]:
    """Continue `prompt` as plain text (no chat template), streamed in pieces that never split a character."""
    llm = model if isinstance(model, LLM) else interactive_llm(model)
    for out in llm.stream(llm.tokenizer.encode_prompt(prompt), params):
        if out.new_text:
            yield out.new_text


class ChatSession:
    """A conversation: keeps the messages, renders them with the model's chat template each turn."""

    def __init__(self, model: Pretrained | LLM, params: SamplingParams, system: str | None = None):
        self.llm = model if isinstance(model, LLM) else interactive_llm(model)
        self.llm.tokenizer.get_chat_template()  # fail now, with the fix named, if there is no template
        self.params, self.system = params, system
        self.messages: list[dict[str, str]] = []
        self.last_stats: StreamStats | None = None  # the timing of the latest reply

    def reset(self) -> None:
        self.messages.clear()

    def _prompt_ids(self) -> list[int]:
        """Render the conversation, dropping the oldest turns while it does not fit the context."""
        tok, context = self.llm.tokenizer, self.llm.engine.max_model_len
        while True:
            system = [{"role": "system", "content": self.system}] if self.system else []
            ids = tok.apply_chat_template(system + self.messages, add_generation_prompt=True)
            if len(ids) + min(self.params.max_tokens, 64) <= context or len(self.messages) <= 1:
                return ids
            self.messages = self.messages[2:] if len(self.messages) > 2 else self.messages[1:]

    def send(self, user_text: str) -> Iterator[str]:
        """Add a user turn and stream the assistant's reply; the reply joins the history when done."""
        self.messages.append({"role": "user", "content": user_text})
        pieces: list[str] = []
        prompt = self._prompt_ids()
        self.last_stats = stats = StreamStats(len(prompt))
        try:
            for out in map(stats.observe, self.llm.stream(prompt, self.params)):
                if out.new_text:
                    pieces.append(out.new_text)
                    yield out.new_text
        finally:  # also when the caller stops early (Ctrl-C): keep what was said
            self.messages.append({"role": "assistant", "content": "".join(pieces)})

