"""The OpenAI API through the official `openai` client (sync, async, streaming) on a live uvicorn server.

Greedy outputs are checked against naive decoding on the same tiny model, token for token, so the
server adds nothing and loses nothing between the engine and the wire.
"""

import asyncio
import logging

import httpx
import openai
import pytest
from test_engine_llm import naive_greedy
from test_serve_fixtures import MODEL, LiveServer, tiny_pretrained

from tokenmind.serve import ServeConfig
from tokenmind.serve.server import warn_if_exposed


@pytest.fixture(scope="module")
def pretrained():
    return tiny_pretrained()


@pytest.fixture(scope="module")
def server(pretrained):
    with LiveServer(pretrained) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def reference(pretrained, messages, max_tokens):
    """What the model says greedily, computed without the server."""
    ids = pretrained.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return pretrained.tokenizer.decode(naive_greedy(pretrained.model, ids, max_tokens)), len(ids)


def chat(content):
    return [{"role": "user", "content": content}]


def test_models_health_and_page(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["engine"]["alive"] and health["engine"]["step_running_s"] is None
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and '<script src="/static/chat.js">' in page.text
    for name in ("chat.js", "chat.css"):
        static = httpx.get(f"{server.url}/static/{name}")
        assert static.status_code == 200 and "http://" not in static.text and "https://" not in static.text  # no CDN


def test_chat_non_streaming_and_streaming_match_the_engine(pretrained, client):
    messages = chat("What is the capital of France?")
    expected, prompt_tokens = reference(pretrained, messages, 24)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 24)
    assert whole.usage.total_tokens == prompt_tokens + 24

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(chunks) > 10  # token by token, not one lump


def test_stream_usage_chunk_and_max_completion_tokens(client):
    stream = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_completion_tokens=7,
                                            max_tokens=99, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 7  # max_completion_tokens wins
    assert all(c.usage is None for c in body)
    assert sum(len(c.choices[0].delta.content or "") for c in body) == 7  # one ASCII character per token


def test_async_client_runs_requests_concurrently(pretrained, server):
    prompts = [f"question number {i}" for i in range(8)]

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(p):
            stream = await client.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=12,
                                                          temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        whole = await client.chat.completions.create(model=MODEL, messages=chat(prompts[0]), max_tokens=12,
                                                     temperature=0)
        streamed = await asyncio.gather(*(one(p) for p in prompts))
        await client.close()
        return whole, streamed

    whole, streamed = asyncio.run(main())
    assert whole.choices[0].message.content == streamed[0]
    assert streamed == [reference(pretrained, chat(p), 12)[0] for p in prompts]


def test_completions_batch_n_seed_and_logprobs(pretrained, client):
    kwargs = dict(model=MODEL, prompt=["The sky", "A cat"], max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=3)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]  # prompt-major: prompt i, completion j → i * n + j
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # the seed reproduces
    assert first.choices[0].text != first.choices[1].text  # siblings sample with seed + j
    assert first.usage.prompt_tokens == len("The sky") + len("A cat") and first.usage.completion_tokens == 24
    for choice in first.choices:
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text and lp.text_offset == list(range(6))
        assert len(lp.token_logprobs) == 6 and all(len(top) == 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    greedy = client.completions.create(model=MODEL, prompt=[84, 104, 101], max_tokens=5, temperature=0)  # ids of "The"
    ref = naive_greedy(pretrained.model, [84, 104, 101], 5)
    assert greedy.choices[0].text == pretrained.tokenizer.decode(ref)


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:  # greedy picks the most likely token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob) and t.bytes == list(t.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_strings_end_the_text_before_them(pretrained, client):
    text, _ = reference(pretrained, chat("stop here"), 20)
    stop = text[8:10]
    cut = text[:text.index(stop)]
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=chat("stop here"), max_tokens=20, temperature=0,
                                             stop=[stop, "never-there"], stream=stream)
        if stream:
            chunks = list(out)
            got, reason = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            got, reason = out.choices[0].message.content, out.choices[0].finish_reason
        assert (got, reason) == (cut, "stop")


def test_vanishing_temperature_and_top_p_are_greedy(pretrained, server, client):
    """1e-300 would overflow the engine's logits / temperature (and kill its thread): it means greedy."""
    expected, _ = reference(pretrained, chat("tiny"), 8)
    for extra in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324}):
        out = client.chat.completions.create(model=MODEL, messages=chat("tiny"), max_tokens=8, **extra)
        assert out.choices[0].message.content == expected
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["engine"]["alive"] and health["engine"]["step_running_s"] is None  # the engine thread is alive


def test_unused_defaults_of_unsupported_fields_are_accepted(client):
    out = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2, tools=[], tool_choice="none",
                                         response_format={"type": "text"}, stop="a stop string longer than 16")
    assert out.usage.completion_tokens == 2


def test_penalties_and_user_are_accepted(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                                                {"role": "user", "content": "hi"}],
                                         max_tokens=30, temperature=0, presence_penalty=2.0, frequency_penalty=2.0,
                                         top_p=0.5, user="someone")
    text = out.choices[0].message.content
    assert len(text) == 30 and len(set(text)) > 15  # strong penalties keep it from repeating itself


def test_metrics_in_prometheus_text_format(server, client):
    client.chat.completions.create(model=MODEL, messages=chat("count me"), max_tokens=4, temperature=0)
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = response.text.splitlines()
    names = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    for name in ("tokenmind_requests_total", "tokenmind_prompt_tokens_total", "tokenmind_generation_tokens_total",
                 "tokenmind_time_to_first_token_seconds", "tokenmind_time_per_output_token_seconds",
                 "tokenmind_num_requests_waiting", "tokenmind_num_requests_running", "tokenmind_kv_cache_usage_ratio",
                 "tokenmind_prefix_cache_hit_rate"):
        assert name in names
    m = server.metrics()
    assert m['tokenmind_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m["tokenmind_generation_tokens_total"] >= 4 and m["tokenmind_prompt_tokens_total"] > 0
    ttft = "tokenmind_time_to_first_token_seconds"
    assert m[ttft + '_bucket{le="+Inf"}'] == m[ttft + "_count"] > 0
    assert m["tokenmind_prefix_cache_hit_rate"] > 0  # every chat shares the template's first block
    buckets = [v for k, v in m.items() if k.startswith("tokenmind_time_per_output_token_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative


def test_config_is_local_by_default_and_warns_when_exposed(caplog):
    config = ServeConfig(model="/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8000, None) and not config.is_public
    assert config.model_name == "SmolLM2-135M-Instruct.Q4_1" and ServeConfig(model="smollm2").model_name == "smollm2"
    with caplog.at_level(logging.WARNING, logger="tokenmind.serve"):
        warn_if_exposed(config)
        assert not caplog.records
        warn_if_exposed(ServeConfig(model="smollm2", host="0.0.0.0"))
        assert "only requests whose Host header names 127.0.0.1, localhost, ::1" in caplog.text
        warn_if_exposed(ServeConfig(model="smollm2", host="0.0.0.0", allowed_hosts=["*"]))
        assert "WITHOUT an API key" in caplog.text
    with pytest.raises(ValueError, match="quantization"):
        ServeConfig(model="smollm2", quantization="int3")
    with pytest.raises(ValueError, match="api_key"):
        ServeConfig(model="smollm2", api_key=" ")
