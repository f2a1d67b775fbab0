"""OpenAI's response shapes: streaming chunks and whole responses, for chat and for plain completions.

The two endpoints differ only in packaging (`delta.content` vs `text`, `message`, and two
logprobs layouts), so one formatter per endpoint turns the same per-choice pieces — new text,
the new tokens' logprobs, a finish reason — into that endpoint's JSON. A chat request with tools
also has its reply split into content and `tool_calls` by the template's tool format, as a whole
or while streaming (holding back text that may be the start of a call).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.sampler import TokenLogprob
from .tool_calls import ToolCall, ToolDelta, ToolFormat, ToolStream


@dataclass
class ChoiceDelta:
    """What one step added to one choice."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


@dataclass
class ChoiceState:
    """A choice so far: everything the non-streaming response needs."""

    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    ttft_seen: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseFormat:
    """Shared header fields (`id`, `created`, `model`) and token strings for logprobs."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer: Any, include_usage: bool = False):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.tokenizer, self.include_usage = model, tokenizer, include_usage
        self._token_text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The SSE chunk for one delta; None when it holds nothing to send yet."""
        choice = self._chunk_choice(delta)
        if choice is None:
            return None
        body = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            body["usage"] = None  # only the last chunk carries usage
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage}

    def response(self, choices: list[ChoiceState], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.object_name, [self._choice(c) for c in choices]), "usage": usage}

    def _chunk_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        raise NotImplementedError

    def _choice(self, choice: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    """`chat.completion(.chunk)`; logprobs as `{"content": [{token, logprob, bytes, top_logprobs}]}`.

    With `tools` (the template's tool format), replies are parsed into `tool_calls`, and a reply
    that called a tool finishes with "tool_calls".
    """

    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, tokenizer: Any, include_usage: bool = False, tools: ToolFormat | None = None):
        super().__init__(model, tokenizer, include_usage)
        self.tools = tools
        self._role_sent: set[int] = set()
        self._streams: dict[int, ToolStream] = {}
        self._called: set[int] = set()  # choices that streamed a tool call

    def _chunk_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        text, calls = delta.text, []
        if self.tools is not None:
            stream = self._streams.setdefault(delta.index, self.tools.stream())
            text, calls = stream.feed(delta.text)
            if delta.finish_reason is not None:
                more_text, more_calls = stream.finish()
                text, calls = text + more_text, calls + more_calls
        message: dict[str, Any] = {}
        if delta.index not in self._role_sent:  # the first chunk of each choice names the speaker
            self._role_sent.add(delta.index)
            message["role"] = "assistant"
        if text or "role" in message:
            message["content"] = text
        if calls:
            self._called.add(delta.index)
            message["tool_calls"] = [_tool_delta(call) for call in calls]
        finish = delta.finish_reason
        if finish == "stop" and delta.index in self._called:
            finish = "tool_calls"
        if not message and finish is None and not delta.logprobs:
            return None
        return {"index": delta.index, "delta": message, "logprobs": self._logprobs(delta.logprobs),
                "finish_reason": finish}

    def _choice(self, choice: ChoiceState) -> dict[str, Any]:
        content: str | None = choice.text
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.parse(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = choice.finish_reason
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": choice.index, "message": message, "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": finish}

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionFormat(ResponseFormat):
    """`text_completion`; logprobs as parallel lists `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`."""

    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, tokenizer: Any, include_usage: bool = False):
        super().__init__(model, tokenizer, include_usage)
        self._offsets: dict[int, int] = {}  # choice → characters of token text reported so far

    def _chunk_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        return {"index": delta.index, "text": delta.text, "logprobs": self._logprobs(delta.index, delta.logprobs),
                "finish_reason": delta.finish_reason}

    def _choice(self, choice: ChoiceState) -> dict[str, Any]:
        return {"index": choice.index, "text": choice.text, "logprobs": self._logprobs(choice.index, choice.logprobs),
                "finish_reason": choice.finish_reason}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """Echoed prompt tokens come first; the first of them has no logprob (null, as OpenAI's)."""
        if entries is None:
            return None
        tokens = [self.token(e.token_id) for e in entries]
        offsets, offset = [], self._offsets.get(index, 0)
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else {self.token(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def _tool_delta(call: ToolDelta) -> dict[str, Any]:
    """One `delta.tool_calls` element: id, type and name on a call's first fragment only."""
    out: dict[str, Any] = {"index": call.index}
    if call.id is not None:
        out.update(id=call.id, type="function")
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        function["name"] = call.name
    out["function"] = function
    return out
