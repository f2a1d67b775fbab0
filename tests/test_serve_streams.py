"""Many streams at once, and clients that leave: their requests are aborted and their KV blocks freed."""

import asyncio
import threading

import httpx
import openai
import pytest
from test_engine_llm import naive_greedy
from test_serve_fixtures import MODEL, LiveServer, sse_events, tiny_pretrained


CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def slow_server():
    """Each engine step takes >= 10 ms, so a 200-token request runs for seconds unless it is aborted."""
    with LiveServer(tiny_pretrained(step_delay=0.01)) as s:
        yield s


def body(content, max_tokens, stream=True):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def text_of(events):
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e != "[DONE]" and e["choices"])


def test_a_client_that_disconnects_mid_stream_is_aborted_and_others_are_unaffected(slow_server):
    server = slow_server
    baseline = server.wait_idle()
    expected = httpx.post(server.url + CHAT, json=body("bystander", 40, stream=False)).json()
    expected = expected["choices"][0]["message"]["content"]
    bystander = {}

    def run_bystander():
        with httpx.stream("POST", server.url + CHAT, json=body("bystander", 40), timeout=30) as r:
            bystander["events"] = sse_events(r.iter_lines())

    thread = threading.Thread(target=run_bystander)
    thread.start()
    with httpx.stream("POST", server.url + CHAT, json=body("victim", 200), timeout=30) as r:
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    m = server.wait_idle()
    thread.join(timeout=30)
    assert m["tokenmind_kv_cache_usage_ratio"] == baseline["tokenmind_kv_cache_usage_ratio"] == 0
    generated = m["tokenmind_generation_tokens_total"] - baseline["tokenmind_generation_tokens_total"]
    assert generated < 40 + 40 + 100  # the reference, the bystander, and only part of the victim's 200
    assert bystander["events"][-1] == "[DONE]" and text_of(bystander["events"]) == expected
    assert bystander["events"][-2]["choices"][0]["finish_reason"] == "length"


def test_a_non_streaming_client_that_gives_up_is_aborted(slow_server):
    server = slow_server
    before = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + CHAT, json=body("patience", 200, stream=False), timeout=0.3)
    m = server.wait_idle()
    assert m["tokenmind_generation_tokens_total"] - before["tokenmind_generation_tokens_total"] < 150  # of 200
    assert m['tokenmind_requests_total{endpoint="/v1/chat/completions",status="499"}'] == 1


def test_64_concurrent_streaming_clients_each_get_their_complete_stream():
    pretrained = tiny_pretrained()
    prompts = [f"client {i}: tell me something" for i in range(64)]
    expected = []
    for p in prompts:
        ids = pretrained.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        expected.append(pretrained.tokenizer.decode(naive_greedy(pretrained.model, ids, 16)))

    with LiveServer(pretrained) as server:
        async def main():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

            async def one(p):
                stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                              max_tokens=16, temperature=0, stream=True,
                                                              stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

            results = await asyncio.gather(*(one(p) for p in prompts))
            await client.close()
            return results

        results = asyncio.run(main())
        m = server.wait_idle()
    for (text, chunks), want in zip(results, expected):
        assert text == want
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 16
    assert m['tokenmind_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 64
    assert m["tokenmind_generation_tokens_total"] == 64 * 16
