"""The request bodies of the OpenAI API as pydantic models, and their translation to `SamplingParams`.

Validation is strict (JSON types as OpenAI documents them: `"0.5"` is not a number, `true` is
not an integer) and every range OpenAI enforces is enforced here, so a bad field is rejected
with a 400 naming it before anything reaches the engine. Fields we accept but do not act on
(`user`) are listed; unknown fields are ignored, as OpenAI-compatible servers commonly do.
A few vLLM-style extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`) expose what
the engine can do; benchmarks use `ignore_eos` to get outputs of a fixed length.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..engine.sampling import SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # n siblings use seed + i: still inside torch's 64-bit range
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16

NonEmptyStr = Annotated[str, Field(min_length=1)]
# OpenAI fields this server does not implement, with the values that ask for nothing: any other
# value is refused (400 naming the field) rather than silently ignored.
UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
               "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False  # one last chunk with `usage` and no choices


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)  # None = as many as the context window leaves
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; requests are not attributed to users
    # extensions (vLLM names)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)  # tinier values overflow the logits
    ignore_eos: bool = False
    # not implemented: see UNSUPPORTED
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in UNSUPPORTED[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server; leave it out")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_limit(cls, stop: Any) -> Any:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stop)}")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(the field that set it, the value); None = as many as fit."""
        return "max_tokens", self.max_tokens

    def num_logprobs(self) -> int | None:
        """None = no logprobs; k = the chosen token's logprob and the top k alternatives."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed, stop=stop,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, n=self.n, ignore_eos=self.ignore_eos,
                              logprobs=self.num_logprobs())


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: continue a prompt (text or token ids; a list of them runs a batch)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="text or token ids, or a list of them")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list | str) and not p for p in prompt)):
            raise ValueError("the prompt list is empty, or holds an empty prompt; give at least one token or character")
        if isinstance(prompt, list) and len(prompt) > MAX_N and isinstance(prompt[0], list | str):
            raise ValueError(f"at most {MAX_N} prompts per request")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (text, or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The {"role", "content"} dict chat templates expect; `developer` is the newer name of `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the model's chat template renders `messages`, the reply is generated."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins if both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
