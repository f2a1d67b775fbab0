"""The OpenAI client against `tokenmind serve` on the real Qwen2.5-Coder-0.5B-Instruct (a template
trained for tools: Hermes `<tool_call>` markup, which its vocabulary holds as one added token).
Slow, and skipped unless `tokenmind fetch-model qwen2.5-coder-0.5b` has cached the model."""

import json

import jsonschema
import pytest
from test_serve_fixtures import LiveServer

from tokenmind.model.load import ALIASES

PATH = ALIASES["qwen2.5-coder-0.5b"].path()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PATH.is_file(), reason=f"{PATH} not cached; run: "
                                                   "tokenmind fetch-model qwen2.5-coder-0.5b")]
NAME = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                                                                       "enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "What's the weather like in Oslo right now?"}]


@pytest.fixture(scope="module")
def client():
    with LiveServer(None, model=NAME, kv_cache_bytes=256 * 2**20) as server:
        yield server.openai()


def test_the_model_calls_a_tool_on_its_own_streamed_or_not(client):
    out = client.chat.completions.create(model=NAME, tools=[WEATHER], messages=ASK, temperature=0, max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Oslo"
    chunks = list(client.chat.completions.create(model=NAME, tools=[WEATHER], messages=ASK, temperature=0,
                                                 max_tokens=80, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_uses_the_tool_call_token_and_validates(client):
    for seed in range(3):
        out = client.chat.completions.create(model=NAME, tools=[WEATHER], messages=ASK, tool_choice="required",
                                             parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=80)
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_json_schema_output_and_prompt_logprobs(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string",
                                                                                     "maxLength": 40}}}
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        temperature=0, max_tokens=60)
    answer = json.loads(out.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"
    scored = client.completions.create(model=NAME, prompt="def add(a, b):\n    return a + b", echo=True,
                                       logprobs=1, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == "def add(a, b):\n    return a + b"
