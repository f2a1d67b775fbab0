"""Bad requests get a 4xx in OpenAI's error shape naming the field; keys are checked; overload gets 429."""

import threading
import time

import httpx
import openai
import pytest
from test_serve_fixtures import MODEL, LiveServer, sse_events, tiny_pretrained

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with LiveServer(tiny_pretrained(context=64)) as s:
        yield s


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("body,param,code", [
    (b'{"model": "tiny", "messages": [', None, "invalid_json"),  # malformed JSON
    (b"[1, 2]", None, "invalid_json"),  # JSON, but not an object
    (b"", None, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "model", None),  # missing field
    (b'{"model": "tiny"}', "messages", None),
    (b'{"model": "tiny", "messages": []}', "messages", None),
    (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', "model", None),  # wrong types
    (b'{"model": "tiny", "messages": "hi"}', "messages", None),
    (b'{"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}', "messages.0.role", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', "messages.0.content", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"}', "temperature", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}', "max_tokens", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": true}', "n", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": 5}', "stop", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}', "stop.0", None),
])
def test_malformed_bodies_and_wrong_types(server, body, param, code):
    response = httpx.post(server.url + CHAT, content=body, headers={"Content-Type": "application/json"})
    assert_error(response, 400, param, code)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 10**30), ("max_completion_tokens", 100_000),
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 10_000),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("seed", 2**64), ("top_logprobs", 5), ("logprobs", 3),
    ("repetition_penalty", 1e-300), ("stop", ["x"] * 17),
    ("logit_bias", {"65": 5}),  # not implemented: refused, not silently ignored
    ("tools", [{"type": "function", "function": {"name": "not a name!"}}]), ("tools", [{"type": "retrieval"}]),
    ("tool_choice", "sometimes"), ("tool_choice", {"type": "function", "function": {"name": "absent"}}),
    ("response_format", {"type": "xml"}), ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
])
def test_out_of_range_values_name_the_field(server, field, value):
    response = httpx.post(server.url + CHAT, json={"model": MODEL, "messages": MESSAGES, field: value})
    assert response.status_code == 400, response.text
    param = response.json()["error"]["param"]
    assert param == field or param.startswith(field + "."), param  # the field, or the part of it that is wrong


def test_completion_specific_errors(server):
    url = server.url + "/v1/completions"
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": "x", "logprobs": 21}), 400, "logprobs")
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": []}), 400, "prompt")
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": [[1], []]}), 400, "prompt")
    error = assert_error(httpx.post(url, json={"model": MODEL, "prompt": [5000]}), 400, "prompt")  # not a token id
    assert "[0, 260)" in error["message"]


def test_prompt_longer_than_the_context_window(server):
    long = [{"role": "user", "content": "word " * 100}]  # > 64 tokens
    error = assert_error(httpx.post(server.url + CHAT, json={"model": MODEL, "messages": long}), 400, "messages",
                         "context_length_exceeded")
    assert "64" in error["message"]
    error = assert_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 64}),
                         400, "prompt", "context_length_exceeded")
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 63, "max_tokens": 1})
    assert ok.status_code == 200
    error = assert_error(httpx.post(server.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": "x" * 60, "max_tokens": 5}), 400, "max_tokens")
    assert "at most 4" in error["message"]


def test_no_max_tokens_means_the_rest_of_the_context(server):
    out = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 50, "temperature": 0})
    assert out.json()["usage"]["completion_tokens"] == 14 and out.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_model_route_and_method(server):
    error = assert_error(httpx.post(server.url + CHAT, json={"model": "gpt-4o", "messages": MESSAGES}), 404, "model",
                         "model_not_found")
    assert MODEL in error["message"]
    client = server.openai()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, code="not_found")
    assert_error(httpx.get(server.url + CHAT), 405, code="method_not_allowed")


def test_errors_are_counted_in_metrics(server):
    httpx.post(server.url + CHAT, json={"model": MODEL, "messages": MESSAGES, "temperature": 9})
    assert server.metrics()['tokenmind_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1


def test_api_key_is_required_except_for_health():
    with LiveServer(tiny_pretrained(context=64), api_key="sesame") as server:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            assert_error(httpx.post(server.url + CHAT, json=body, headers=headers), 401, code="invalid_api_key")
        assert_error(httpx.post(server.url + CHAT, content=b"{bad", headers={}), 401)  # before the body is read
        assert_error(httpx.get(server.url + "/metrics"), 401)
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/").status_code == 200  # the page asks for the key itself
        with pytest.raises(openai.AuthenticationError):
            server.openai("wrong").models.list()
        good = server.openai("sesame")
        assert good.chat.completions.create(**body).usage.completion_tokens == 2
        assert server.metrics()['tokenmind_requests_total{endpoint="/v1/chat/completions",status="401"}'] == 4


def test_overload_gets_429_with_retry_after_while_admitted_requests_finish():
    """2 running + 1 queued fill the server; the 4th is refused at once; the 3 admitted complete."""
    with LiveServer(tiny_pretrained(step_delay=0.02, context=64), max_num_seqs=2, max_queue=1) as server:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 0, "stream": True}
        results = []

        def stream():
            with httpx.stream("POST", server.url + CHAT, json=body, timeout=30) as r:
                results.append(sse_events(r.iter_lines()))

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while server.metrics()["tokenmind_requests_in_flight"] < 3:  # all three admitted (one waits for a slot)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = httpx.post(server.url + CHAT, json=body)
        assert_error(refused, 429, code="queue_full")
        assert refused.headers["Retry-After"] == "1"
        client = server.openai()
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(**{**body, "stream": False})
        for t in threads:
            t.join(timeout=30)
        assert len(results) == 3
        texts = {"".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) for events in results}
        assert len(texts) == 1 and len(texts.pop()) == 30 and all(events[-1] == "[DONE]" for events in results)
        assert client.chat.completions.create(**{**body, "stream": False}).usage.completion_tokens == 30
        m = server.wait_idle()
        assert m['tokenmind_requests_total{endpoint="/v1/chat/completions",status="429"}'] == 2
