"""The request bodies of the OpenAI API as pydantic models, and their translation to `SamplingParams`.

Validation is strict (JSON types as OpenAI documents them: `"0.5"` is not a number, `true` is
not an integer) and every range OpenAI enforces is enforced here, so a bad field is rejected
with a 400 naming it before anything reaches the engine. `response_format` becomes the engine's
`StructuredOutput`; `tools` and `tool_choice` are checked here and rendered/parsed by the
chat template's tool format (`tool_calls.py`). Fields we accept but do not act on
(`user`) are listed; unknown fields are ignored, as OpenAI-compatible servers commonly do.
A few vLLM-style extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`) expose what
the engine can do; benchmarks use `ignore_eos` to get outputs of a fixed length.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..engine.sampling import SamplingParams
from ..engine.structured import StructuredOutput

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # n siblings use seed + i: still inside torch's 64-bit range
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16

NonEmptyStr = Annotated[str, Field(min_length=1)]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names
# OpenAI fields this server does not implement, with the values that ask for nothing: any other
# value is refused (400 naming the field) rather than silently ignored.
UNSUPPORTED = {"functions": (None, []), "function_call": (None, "none"), "logit_bias": (None, {}),
               "best_of": (None, 1)}


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormatParam(BaseModel):
    """`response_format`: plain text, any JSON object, or JSON valid under a schema (always enforced)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_is_an_object(cls, spec: JSONSchemaFormat | None) -> JSONSchemaFormat | None:
        if spec is not None and "type" in spec.schema_ and not isinstance(spec.schema_["type"], str | list):
            raise ValueError("json_schema.schema.type must be a string or a list of strings")
        return spec

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format.type is json_schema but json_schema is missing; give "
                                 '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
            return StructuredOutput(json_schema=self.json_schema.schema_)
        return None


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
    response_format: ResponseFormatParam | None = None
    # not implemented: see UNSUPPORTED
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
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

    def num_prompt_logprobs(self) -> int | None:
        return None

    def structured(self) -> StructuredOutput | None:
        """The grammar the output must match, if the request asks for one."""
        return None if self.response_format is None else self.response_format.structured()

    def sampling_params(self, max_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed, stop=stop,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, n=self.n, ignore_eos=self.ignore_eos,
                              logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
                              structured=structured)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: continue a prompt (text or token ids; a list of them runs a batch)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="text or token ids, or a list of them")
    max_tokens: int | None = Field(None, ge=0)  # 0 (with echo): score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token
    echo: bool = False  # the prompt comes back before the completion (its tokens' logprobs too, with logprobs)
    suffix: str | None = None  # text after the gap: the completion is the middle (fill-in-the-middle); "" = none

    @model_validator(mode="after")
    def _suffix_without_echo(self) -> CompletionRequest:
        if self.suffix and self.echo:
            raise ValueError("echo cannot be combined with suffix (the completion is a middle, not a continuation)")
        return self

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

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    url: NonEmptyStr  # a data URL (data:image/png;base64,...): the server fetches nothing
    detail: Literal["auto", "low", "high"] | None = None  # accepted, ignored: images are resized to the model's size


class ImagePart(BaseModel):
    """An image in a chat message, for a vision-language model (`vision.py` reads it)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A call the assistant made earlier in the conversation, sent back with the history."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    def images(self) -> list[tuple[int, ImageURL]]:
        """(index in `content`, image) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(i, part.image_url) for i, part in enumerate(self.content) if isinstance(part, ImagePart)]

    def for_template(self, image_text: str | None = None) -> dict[str, Any]:
        """The OpenAI-shaped dict (role, content, tool_calls, tool_call_id) that tool formats and chat
        templates read; `developer` is the newer name of `system`. Content parts are joined in
        order, each image part written as `image_text` (a VLM's placeholder tokens); a message with
        images but no `image_text` is a ValueError."""
        content = self.content
        if isinstance(content, list):
            if image_text is None and self.images():
                raise ValueError("this message holds image_url parts but the model reads text only")
            content = "".join(image_text if isinstance(part, ImagePart) else part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # arguments are always schema-valid when a call is forced; auto calls are parsed


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the model's chat template renders `messages`, the reply is generated."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins if both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among `tools`")
        if choice == "required" and not tools:
            raise ValueError('tool_choice "required" needs at least one tool in `tools`')
        return choice

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI-shaped dicts, or None when the model should not see any (none given,
        or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def forced_function(self) -> tuple[bool, str | None]:
        """(a call is forced, the function it must call or None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: one vector per input (text or token ids)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: NonEmptyStr | list[NonEmptyStr] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value or any(isinstance(v, list) and not v for v in value):
                raise ValueError("input is empty, or holds an empty token list; give text or token ids")
            if isinstance(value[0], list | str) and len(value) > MAX_EMBEDDING_INPUTS:
                raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}")
        return value

    def inputs(self) -> list[str | list[int]]:
        v = self.input
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]
        return list(v)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for `prompt`; a chat template writes its own special tokens
    add_generation_prompt: bool = True  # for `messages`: end with the assistant's turn opening

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of `prompt` (text) and `messages` (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations for a class-conditional diffusion model: `prompt` names a class.

    OpenAI's fields, plus the sampler's (`steps`, `guidance_scale`, `seed`). `response_format`
    "url" answers `data:image/png;base64,...` URLs (the server hosts no files); `size`, when
    given, must be the model's own (it generates one size). `quality`, `style` and `user` are
    accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: NonEmptyStr
    model: str | None = None
    n: int = Field(1, ge=1)
    response_format: Literal["b64_json", "url"] = "b64_json"
    size: str | None = None
    steps: int = Field(25, ge=1, le=1000)
    guidance_scale: float = Field(3.0, ge=0.0, le=50.0)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    quality: str | None = None
    style: str | None = None
    user: str | None = None
