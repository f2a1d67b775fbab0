"""Tool calling per chat-template family: show tools and past calls to the model, read calls back out
of its reply (whole or while it streams), and write grammars that force a reply to be valid calls.

A model calls tools in the markup its template taught it, so each family is one `ToolFormat`:

- `hermes` (Qwen2.5, Hermes, templates with `<tool_call>`): calls are
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one or more, content may precede
  them. Qwen2.5-Coder sometimes answers with bare `{"name": ..., "arguments": ...}` objects as the
  whole reply, or opens it with them in a ```json code block; both are read as calls too.
- `json` (Llama 3.x and other templates that take `tools` without `<tool_call>`): the whole reply is
  `{"name": "f", "parameters": {...}}` ("arguments" also read), or a JSON list of such objects.
- `generic` (templates with no tool support, e.g. SmolLM2's ChatML): the tools and this reply format
  are described in the system message; the reply is `{"tool_calls": [{"name": "f", "arguments":
  {...}}]}`, possibly after some content. Past calls are shown as that JSON and tool results as
  user text ("Result of f (call_1):\\n..."), not as role "tool": ChatML would render a "tool" turn,
  but a model never trained on one reads a user turn better, and many tool-less templates (Llama 2,
  Mistral v0.1, Gemma) raise on any role but user/assistant or on two user turns in a row, so
  results are merged into the neighbouring user turn.

Reading is one scanner per family run over the reply text: `parse` runs it once over the finished
reply, `ToolStream` re-runs it from where it stopped as text arrives. The scanner decides only what
no continuation can change (text that may still become markup is held back), so both see the same
content and calls. A call is announced (id, name and all of its arguments in one delta) once its
markup is complete and parses: arguments then arrive in one piece rather than token by token, but a
client never receives a call that later turns out to be malformed. Content is trimmed at both ends
and around calls; pieces separated by calls are joined with a newline.

Grammars are llguidance Lark: fixed markup as literals, each function's arguments as `%json` of its
`parameters` schema with the separators templates' `tojson` writes (`", "`, `": "`), so a forced
reply looks exactly like the calls the template renders in history.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from ..engine.structured import JSON_OPTIONS

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
_MAYBE = object()  # "only more text can tell"
_NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolCall:
    id: str  # "call_" + random hex, as OpenAI
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ToolDelta:
    """One streaming event, shaped into OpenAI's `delta.tool_calls[i]` by the caller."""

    index: int  # which call in this message (0, 1, ...)
    id: str | None = None  # set on the first fragment of a call
    name: str | None = None  # set on the first fragment of a call
    arguments: str = ""  # a fragment of the arguments JSON text


@dataclass
class _Tool:
    name: str
    parameters: dict  # the arguments' JSON schema (an object schema)
    definition: dict  # the function definition as given, for templates


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --- tools and messages -------------------------------------------------------------------------


def check_tools(tools: list[dict] | None) -> list[_Tool]:
    """The function definitions of OpenAI `tools` (bare function definitions also accepted), checked."""
    out: list[_Tool] = []
    for i, tool in enumerate(tools or []):
        shape = 'give each tool as {"type": "function", "function": {"name": ..., "parameters": {...}}}'
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] is not an object; {shape}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] has type {tool.get('type')!r}; only \"function\" tools are supported")
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}] has no function name; {shape}")
        if any(t.name == name for t in out):
            raise ValueError(f"two tools are named {name!r}; give each tool a unique name")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = _NO_ARGS
        elif not isinstance(params, dict) or params.get("type") != "object":
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema of an object "
                             f'({{"type": "object", "properties": {{...}}}}), got {json.dumps(params)[:100]}')
        out.append(_Tool(name, params, fn))
    return out


def _text(content) -> str:
    """Message content as a string (None → "", text parts joined, other JSON values as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return json.dumps(content, ensure_ascii=False)


def _arguments(arguments):
    """A call's arguments as a dict when they are (or encode) a JSON object, else as given."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments if arguments is not None else {}


def _history_calls(message: dict) -> list[tuple[str | None, str, object]]:
    """(id, name, arguments) of an assistant message's OpenAI `tool_calls`."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append((call.get("id"), fn.get("name", ""), _arguments(fn.get("arguments"))))
    return calls


def _template_messages(messages: list[dict], one_call_per_message: bool) -> list[dict]:
    """Messages for templates that render tools themselves: string content, calls as
    {id, type, function: {name, arguments: dict}} (templates do `arguments | tojson`)."""
    out = []
    for message in messages:
        message = {**message, "content": _text(message.get("content"))}
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                 for i, n, a in _history_calls(message)]
        message.pop("tool_calls", None)  # an empty list would still trip `'tool_calls' in message`
        if calls and one_call_per_message:  # Llama 3.1's template refuses several calls in one message
            out += [{**message, "tool_calls": [call]} for call in calls]
        elif calls:
            out.append({**message, "tool_calls": calls})
        else:
            out.append(message)
    return out


def _template_tools(tools: list[dict] | None) -> list[dict] | None:
    checked = check_tools(tools)
    return [{"type": "function", "function": t.definition} for t in checked] or None


# --- reading replies ----------------------------------------------------------------------------


def _dumps(args: dict) -> str:
    text = json.dumps(args, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a \\ud8xx escape: keep it escaped
        text = json.dumps(args)
    return text


def _as_call(value) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object {"name": ..., "arguments"|"parameters": {...}}."""
    if not isinstance(value, dict) or set(value) - {"name", "arguments", "parameters", "type", "id"}:
        return None
    name, key = value.get("name"), "arguments" if "arguments" in value else "parameters"
    args = _arguments(value.get(key, "")) if key in value else None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, _dumps(args)


def _calls_of(value, lists: bool) -> list[tuple[str, str]] | None:
    items = value if lists and isinstance(value, list) else [value]
    calls = [_as_call(item) for item in items]
    return calls if calls and None not in calls else None


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _json_calls(text: str, pos: int, lists: bool, final: bool):
    """Read `text[pos:]` as nothing but call objects (or, with `lists`, lists of them) separated by
    whitespace (and ';' with `lists`). The calls; None when it is not that; _MAYBE when only more
    text can tell (never when `final`)."""
    calls: list[tuple[str, str]] = []
    while True:
        pos = _skip(text, pos, _WS + ";" if lists and calls else _WS)
        if pos == len(text):
            return (calls or None) if final else _MAYBE
        if text[pos] not in ("{[" if lists else "{"):
            return None
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None if final else _MAYBE
        found = _calls_of(value, lists)
        if found is None:
            return None
        calls += found


def _partial(text: str, start: int, marker: str) -> int:
    """Length of the longest end of `text[start:]` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class _Scan:
    """How far a reply has been read: text before `pos` is decided (content passed on, calls found)."""

    pos: int = 0
    mode: str | None = None  # family-specific: what the reply has turned out to be


class _Content:
    """Content assembly shared by `parse` and `ToolStream`: trims the ends and around calls, joins the
    pieces between calls with a newline, and holds trailing whitespace until it is known to be inner."""

    def __init__(self) -> None:
        self.pending, self.fresh, self.emitted = "", True, False

    def add(self, text: str) -> str:
        text = self.pending + text
        cut = len(text.rstrip())
        out, self.pending = text[:cut], text[cut:]
        if not out:
            return ""
        if self.fresh:
            out = ("\n" if self.emitted else "") + out.lstrip()
            self.fresh = False
        self.emitted = True
        return out

    def call(self) -> None:
        self.pending, self.fresh = "", True


class ToolStream:
    """Reads one streamed reply; `feed` the new text as it comes, `finish` at the end."""

    def __init__(self, fmt: ToolFormat):
        self._fmt, self._text, self._scan, self._content, self._calls = fmt, "", _Scan(), _Content(), 0

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        """New text of the reply → (content safe to show now, tool-call deltas). Text that may be the
        start of a call's markup is held back until it is known."""
        self._text += text
        return self._read(final=False)

    def finish(self) -> tuple[str, list[ToolDelta]]:
        """End of reply: flush what was held (an unfinished or unparsable call becomes content)."""
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, list[ToolDelta]]:
        content, deltas = [], []
        for event in self._fmt._events(self._text, self._scan, final):
            if isinstance(event, str):
                content.append(self._content.add(event))
                continue
            self._content.call()
            for name, arguments in event:
                deltas.append(ToolDelta(self._calls, new_call_id(), name, arguments))
                self._calls += 1
        return "".join(content), deltas


# --- the families -------------------------------------------------------------------------------


class ToolFormat:
    """One chat-template family's tool-call format. Instances are stateless."""

    name = ""
    markup: tuple[str, ...] = ()  # markup that some vocabularies hold as one added token (Qwen's <tool_call>)

    def prepare(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """OpenAI-shaped messages and tools → (messages for the chat template, its `tools` argument)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished reply → (content without the calls, or None if empty; the calls). Text that
        merely looks like a call but does not parse as one stays content."""
        stream = self.stream()
        stream._text = text
        content, deltas = stream._read(final=True)
        return content or None, [ToolCall(d.id, d.name, d.arguments) for d in deltas]

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def grammar(self, tools: list[dict], choice: str | None, parallel: bool,
                special_tokens: Collection[str] = ()) -> str:
        """An llguidance Lark grammar the whole reply must match: one call (one or more if
        `parallel`) of any of `tools` (`choice` None) or of the function named `choice`, in this
        family's markup, each with arguments matching that function's `parameters` schema.

        `special_tokens`: the strings of `self.markup` that are single tokens llguidance treats as
        special in the model's vocabulary (it does so for every added token, e.g. Qwen2.5's
        `<tool_call>`). Such a token matches no text literal, so the grammar names it as a token
        (`<tool_call>`) instead; naming a token the vocabulary lacks is an error, hence the caller's
        list: `[s for s in fmt.markup if (i := tok.token_to_id(s)) is not None and
        lltokenizer.is_special_token(i)]`."""
        special = [s for s in self.markup if s in special_tokens]
        checked = check_tools(tools)
        if not checked:
            raise ValueError("a forced tool call needs at least one tool in `tools`")
        if choice is not None:
            checked = [t for t in checked if t.name == choice]
            if not checked:
                names = ", ".join(repr(t.name) for t in check_tools(tools))
                raise ValueError(f"tool_choice names the function {choice!r}, which is not among tools ({names}); "
                                 "name one of them or add its definition to `tools`")
        rules = [self._start(parallel), "call: " + " | ".join(f"call_{k}" for k in range(len(checked)))]
        for k, tool in enumerate(checked):
            head, tail = self._markup(tool.name)
            rules.append(f"call_{k}: {_lark(head, special)} args_{k} {_lark(tail, special)}")
            rules.append(f"args_{k}: %json {json.dumps(_styled(tool.parameters), ensure_ascii=False)}")
        grammar = "\n".join(rules) + "\n"
        _check_grammar(grammar, checked)
        return grammar

    # What a family defines besides `prepare`:
    def _events(self, text: str, scan: _Scan, final: bool) -> list:
        """Read `text` from `scan.pos`: content strings and lists of (name, arguments) calls, in order."""
        raise NotImplementedError

    def _start(self, parallel: bool) -> str:
        """The grammar's start rule, over `call`."""
        raise NotImplementedError

    def _markup(self, name: str) -> tuple[str, str]:
        """The text before and after a call's arguments."""
        raise NotImplementedError


def _lark(text: str, special: list[str]) -> str:
    """`text` as Lark: string literals (which take JSON's escapes), with each of `special` as a token."""
    if not special:
        return json.dumps(text, ensure_ascii=False)
    pieces = re.split("(" + "|".join(map(re.escape, special)) + ")", text)
    return " ".join(p if p in special else json.dumps(p, ensure_ascii=False) for p in pieces if p)


def _styled(schema: dict) -> dict:
    return {**schema, "x-guidance": JSON_OPTIONS}


def _check_grammar(grammar: str, tools: list[_Tool]) -> None:
    """Raise ValueError naming the tool whose schema llguidance cannot enforce."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if not error:
        return
    for tool in tools:
        own = llguidance.LLMatcher.validate_grammar(f"start: %json {json.dumps(_styled(tool.parameters))}\n")
        if own:
            raise ValueError(f"tool {tool.name!r}: its parameters schema cannot be enforced as a grammar ({own}); "
                             "simplify the schema or use tool_choice \"auto\"")
    raise ValueError(f"the tools cannot be enforced as a grammar ({error}); use tool_choice \"auto\"")


class HermesFormat(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markup = (OPEN, CLOSE)

    def prepare(self, messages, tools):
        return _template_messages(messages, one_call_per_message=False), _template_tools(tools)

    def _events(self, text, scan, final):
        events: list = []
        if scan.mode is None:  # is the whole reply bare JSON call objects (Qwen2.5-Coder)?
            start = _skip(text, 0, _WS)
            if start == len(text) and not final:
                return events
            if text.startswith("`", start):
                fenced = self._fenced_calls(text, start, final)
                if fenced is _MAYBE:
                    return events
                if fenced:
                    calls, scan.pos = fenced
                    events.append(calls)
                scan.mode = "tags"
            elif text.startswith("{", start):
                calls = _json_calls(text, start, lists=False, final=final)
                if calls is _MAYBE:
                    return events
                if calls:
                    scan.mode, scan.pos = "bare", len(text)
                    return [calls]
            scan.mode = "tags"
        while scan.mode == "tags" and scan.pos < len(text):
            i = text.find(self.OPEN, scan.pos)
            if i < 0:
                end = len(text) - (0 if final else _partial(text, scan.pos, self.OPEN))
                if end > scan.pos:
                    events.append(text[scan.pos:end])
                    scan.pos = end
                break
            if i > scan.pos:
                events.append(text[scan.pos:i])
                scan.pos = i
            j = text.find(self.CLOSE, i + len(self.OPEN))
            if j < 0:
                if final:
                    events.append(text[i:])
                    scan.pos = len(text)
                break
            end = j + len(self.CLOSE)
            events.append(_json_calls(text[i + len(self.OPEN):j], 0, lists=False, final=True) or text[i:end])
            scan.pos = end
        return events

    @staticmethod
    def _fenced_calls(text: str, start: int, final: bool):
        """Call objects in a ```json code block opening the reply (Qwen2.5-Coder-0.5B writes its calls so):
        (calls, the position after the block); None if the reply does not open so; _MAYBE if only more
        text can tell."""
        newline = text.find("\n", start)
        if newline < 0:
            return None if final else _MAYBE
        if not text.startswith("```", start) or text[start + 3:newline].strip().lower() not in ("", "json"):
            return None
        close = text.find("```", newline + 1)
        if close < 0:
            body = text[newline + 1:].lstrip()
            return _MAYBE if not final and (not body or body.startswith("{")) else None
        calls = _json_calls(text[:close], newline + 1, lists=False, final=True)
        return (calls, close + 3) if calls else None

    def _start(self, parallel):
        return 'start: call ("\\n" call)*' if parallel else "start: call"

    def _markup(self, name):
        return f'{self.OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', f"}}\n{self.CLOSE}"


class JsonFormat(ToolFormat):
    name = "json"
    PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a call with it

    def prepare(self, messages, tools):
        return _template_messages(messages, one_call_per_message=True), _template_tools(tools)

    def _events(self, text, scan, final):
        if scan.mode is None:
            start = _skip(text, 0, _WS)
            if text.startswith(self.PYTHON_TAG, start):
                start = _skip(text, start + len(self.PYTHON_TAG), _WS)
            elif not final and self.PYTHON_TAG.startswith(text[start:]):
                return []
            if start == len(text) and not final:
                return []
            if text.startswith(("{", "["), start):
                calls = _json_calls(text, start, lists=True, final=final)
                if calls is _MAYBE:
                    return []
                if calls:
                    scan.mode, scan.pos = "calls", len(text)
                    return [calls]
            scan.mode = "text"
        if scan.mode == "text" and scan.pos < len(text):
            piece, scan.pos = text[scan.pos:], len(text)
            return [piece]
        return []

    def _start(self, parallel):
        return 'start: call | "[" call (", " call)* "]"' if parallel else "start: call"

    def _markup(self, name):
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', "}"


class GenericFormat(ToolFormat):
    name = "generic"
    KEY = '"tool_calls"'
    SYSTEM = (
        "You can call tools. Each line is one tool: its name, description and the JSON schema of its "
        "arguments.\n{tools}\n\n"
        "To call tools, reply with only this JSON, and nothing after it:\n"
        '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}\n'
        'Tool results come back in user messages starting "Result of". If no tool is needed, answer normally.'
    )

    def prepare(self, messages, tools):
        out: list[dict] = []
        names: dict[str, str] = {}  # call id → function name
        merge = False  # the last message holds tool results: a following user turn joins it
        for message in messages:
            role, content = message.get("role"), _text(message.get("content"))
            if role == "assistant" and message.get("tool_calls"):
                calls = _history_calls(message)
                names.update({i: n for i, n, _ in calls if i})
                shown = [{"name": n, "arguments": a} for _, n, a in calls]
                content = "\n".join(filter(None, [content, json.dumps({"tool_calls": shown}, ensure_ascii=False)]))
            if role == "tool":
                call_id = message.get("tool_call_id")
                name = message.get("name") or names.get(call_id, "")
                label = " ".join(filter(None, [name, f"({call_id})" if call_id else ""])) or "a tool"
                role, content = "user", f"Result of {label}:\n{content}"
            if role == "user" and out and out[-1]["role"] == "user" and (merge or message.get("role") == "tool"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + content}
            else:
                out.append({"role": role, "content": content})
            merge = message.get("role") == "tool"
        checked = check_tools(tools)
        if checked:
            system = self.SYSTEM.format(tools="\n".join(map(self._describe, checked)))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": "\n\n".join(filter(None, [out[0]["content"], system]))}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out, None

    @staticmethod
    def _describe(tool: _Tool) -> str:
        line = {"name": tool.name, "description": tool.definition.get("description"), "parameters": tool.parameters}
        return json.dumps({k: v for k, v in line.items() if v}, ensure_ascii=False)

    def _events(self, text, scan, final):
        events: list = []
        while scan.pos < len(text):
            i = text.find("{", scan.pos)
            if i < 0:
                events.append(text[scan.pos:])
                scan.pos = len(text)
                break
            if i > scan.pos:
                events.append(text[scan.pos:i])
                scan.pos = i
            head = self._header(text, i)
            if head is None and not final:
                break
            calls, end = None, i + 1
            if head:
                try:
                    value, end = _DECODER.raw_decode(text, i)
                except json.JSONDecodeError:
                    if not final:
                        break
                else:
                    if isinstance(value, dict) and list(value) == ["tool_calls"]:
                        calls = _calls_of(value["tool_calls"], lists=True) if value["tool_calls"] else None
            events.append(calls or text[i:end])
            scan.pos = end
        return events

    def _header(self, text: str, i: int) -> bool | None:
        """Whether `{` at `i` opens `{"tool_calls":`; None while the text ends before that is known."""
        j = _skip(text, i + 1, _WS)
        seen = text[j:j + len(self.KEY)]
        if len(seen) < len(self.KEY):
            return None if self.KEY.startswith(seen) else False
        if seen != self.KEY:
            return False
        k = _skip(text, j + len(self.KEY), _WS)
        return None if k == len(text) else text[k] == ":"

    def _start(self, parallel):
        more = ' (", " call)*' if parallel else ""
        return f'start: "{{\\"tool_calls\\": [" call{more} "]}}"'

    def _markup(self, name):
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', "}"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), JsonFormat(), GenericFormat())}


def format_for_template(template: str | None) -> ToolFormat:
    """The family a chat template's source implies: `<tool_call>` → hermes (Qwen2.5, Hermes);
    mentions `tools` otherwise → json (Llama 3.x style bare JSON objects); no tool support → generic."""
    if not template:
        return FORMATS["generic"]
    if HermesFormat.OPEN in template:
        return FORMATS["hermes"]
    if re.search(r"\btools\b", template):
        return FORMATS["json"]
    return FORMATS["generic"]
