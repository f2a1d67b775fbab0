"""Chat templates: render them exactly as `transformers.apply_chat_template` does, and mark the
tokens an SFT loss should train on.

A chat template is Jinja shipped with the model; the model only behaves when it sees its turns
formatted the way it was trained, so we reproduce transformers' Jinja setup (a sandbox, since
templates come from untrusted repos; `trim_blocks`/`lstrip_blocks`; `raise_exception`,
`strftime_now`, a `tojson` that does not HTML-escape; `break`/`continue`) and its input clean-up.

For the assistant mask we prefer `{% generation %}` blocks when the template has them (the
template author says exactly what the model produces); otherwise we find each assistant turn by
rendering the conversation up to it and diffing against the render that stops at the generation
prompt -- which works for any template whose renders of prefixes are prefixes of the full render.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Noncharacters (reserved by Unicode for internal use) that bracket `{% generation %}` output when
# spans are wanted, so its position in the rendered text can be recovered; they are then removed.
_GEN_START, _GEN_END = "\ufdd0", "\ufdd1"
_TRACK = "_tokenmind_track_generation"  # render variable that switches the markers on
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template is missing, or cannot be rendered / analysed for these messages."""


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: marks text the assistant generates (for the mask)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_bracket"), [], [], body).set_lineno(lineno)

    @jinja2.pass_context
    def _bracket(self, context, caller):
        text = caller()
        return f"{_GEN_START}{text}{_GEN_END}" if context.get(_TRACK) else text


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names so templates cannot reach dunder attributes."""

    def __init__(*args, **kwargs):  # noqa: N805 -- Jinja's signature, so `namespace(self=1)` works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set the attribute {name!r}")


class _DictFactory:
    """`dict(...)` / `dict.fromkeys(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own filter HTML-escapes `<`, `>`, `&`, `'`, which would corrupt tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandboxed environment configured like transformers'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_DictFactory(),
        namespace=_Namespace,
    )
    return env.from_string(source)


def render_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
) -> str:
    """The prompt text for `messages`; `variables` are extra template inputs (bos_token, ...)."""
    text, _ = _render_marked(template, messages, add_generation_prompt, tools, documents, variables, track=False)
    return text


def assistant_spans(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered prompt and the `[start, end)` character spans the assistant produced.

    Without `{% generation %}` blocks a span runs from the end of the generation prompt to the end
    of the assistant turn, minus trailing whitespace: content plus end-of-turn token (ChatML's
    `...<|im_end|>` but not the newline after it, which the template adds, not the model).
    """
    args = (tools, documents, variables)
    text, spans = _render_marked(template, messages, add_generation_prompt, *args)
    if spans:
        return text, spans
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        head = _render_marked(template, messages[:i], True, *args)[0] if i else ""
        upto = _render_marked(template, messages[: i + 1], False, *args)[0]
        if not (head and upto.startswith(head) and text.startswith(upto)):
            raise ChatTemplateError(
                f"Cannot locate assistant message {i} in the rendered chat: this template does not render "
                "conversation prefixes as prefixes of the full chat. Add {% generation %} blocks to it."
            )
        end = len(upto)
        while end > len(head) and upto[end - 1].isspace():
            end -= 1
        spans.append((len(head), end))
    return text, spans


def _render_marked(template, messages, add_generation_prompt, tools, documents, variables, track=True):
    """Render after transformers' input clean-up; with `track`, also return the `{% generation %}` spans."""
    if not messages:
        raise ChatTemplateError("Cannot apply a chat template to an empty conversation.")
    tools = _plain([_check_tool(tool) for tool in tools]) if tools is not None else None
    chat = [_alias_reasoning(_plain({k: v for k, v in m.items() if v is not None})) for m in messages]
    raw = compile_template(template).render(
        messages=chat,
        tools=tools,
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(variables),
        **{_TRACK: track},
    )
    if not track:
        return raw, []
    pieces, spans, opened, length = [], [], None, 0
    for piece in re.split(f"([{_GEN_START}{_GEN_END}])", raw):
        if piece == _GEN_START and opened is None:
            opened = length
        elif piece == _GEN_END and opened is not None:
            spans.append((opened, length))
            opened = None
        elif piece in (_GEN_START, _GEN_END):
            opened = -1  # a nested or stray marker
            break
        else:
            pieces.append(piece)
            length += len(piece)
    if opened is not None:
        raise ChatTemplateError("Unbalanced {% generation %} blocks (or messages containing U+FDD0/U+FDD1).")
    return "".join(pieces), spans


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span, else 0.

    Byte-level post-processors trim whitespace out of offsets, which can leave an all-space token
    with an empty `(p, p)` range; such a token counts as inside a span when `start < p <= end`.
    """
    def inside(begin: int, end: int) -> bool:
        if begin == end:
            return any(s < begin <= e for s, e in spans)
        return any(begin < e and end > s for s, e in spans)

    return [int(inside(begin, end)) for begin, end in offsets]


def _check_tool(tool):
    if not isinstance(tool, Mapping):
        raise TypeError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
    return tool


def _alias_reasoning(message: dict) -> dict:
    """Expose an assistant's reasoning under both names templates read (`reasoning_content`, `thinking`)."""
    reasoning = next((message[key] for key in _REASONING_KEYS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types.

    The sandbox cannot know which methods of arbitrary objects (tensors, images, ...) are safe, so
    templates only ever see str/int/float/bool/None, dicts, lists and tuples; anything else becomes
    an inert `"<TypeName>"` placeholder (templates only test such fields for presence).
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses: str/int enums, numpy floats
        if isinstance(value, base):
            return base(value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def render_chat(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat, and a same-length mask that is 1 on assistant-produced tokens.

    `tokenizer` is a `tokenmind.tokenizer.Tokenizer`. The ids are exactly
    `tokenizer.apply_chat_template(messages, ...)`; the mask covers each assistant turn's content
    and its end-of-turn token, which is what SFT should train the model to emit.
    """
    template = tokenizer.get_chat_template(chat_template)
    text, spans = assistant_spans(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        documents=documents,
        **{**tokenizer.special_tokens_map, **variables},
    )
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    return list(encoding.ids), token_mask(encoding.offsets, spans)
