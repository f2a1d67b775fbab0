"""The rest of the OpenAI API through the official `openai` client on a live server: echo with prompt
log-probs, structured output (`response_format`), tool calling, embeddings, /tokenize and
/detokenize, speculative decoding in the server, and the OpenAPI description of every status."""

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from test_engine_llm import naive_greedy
import test_serve_api
from test_serve_fixtures import MODEL, LiveServer, tiny_pretrained

from tokenmind.model.load import load_model, save_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "size"],
          "properties": {"city": {"type": "string", "maxLength": 10}, "size": {"enum": ["small", "large"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["utc", "local"]}}}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


@pytest.fixture(scope="module")
def pretrained():  # the generic tool format's system message needs a longer context than test_serve_api's
    return tiny_pretrained(context=2048)


server, client = test_serve_api.server, test_serve_api.client  # the live server and its client, on this model


def full_logprobs(pretrained, ids):
    with torch.no_grad():
        return pretrained.model(torch.tensor([ids]))[0].float().log_softmax(-1)


# ----------------------------------------------------------------- echo and prompt log-probs

def test_echo_scores_the_prompt_as_the_legacy_api(pretrained, client):
    prompt = "the cat sat on the mat"
    ids = pretrained.tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert lp.tokens == [pretrained.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = full_logprobs(pretrained, ids)
    assert lp.token_logprobs[1:] == pytest.approx([ref[k - 1, ids[k]].item() for k in range(1, len(ids))], abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0


def test_echo_then_generated_tokens_for_every_prompt_form(pretrained, client):
    ids = pretrained.tokenizer.encode("hello")
    generated = pretrained.tokenizer.decode(naive_greedy(pretrained.model, ids, 3))
    for prompt in ("hello", ids):
        choice = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=3,
                                           temperature=0).choices[0]
        assert choice.text == "hello" + generated
        assert len(choice.logprobs.tokens) == len(ids) + 3 and choice.logprobs.token_logprobs[0] is None
    batch = client.completions.create(model=MODEL, prompt=[ids, pretrained.tokenizer.encode("hello world")],
                                      echo=True, max_tokens=2, n=2,
                                      temperature=0)
    texts = {c.index: c.text for c in batch.choices}
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] == "hello" + generated[:2] and texts[2].startswith("hello world")


def test_echo_streams_the_prompt_first(client):
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", echo=True, logprobs=1, max_tokens=4,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[0].choices[0].text.startswith("stream me") and text.startswith("stream me")
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


# ----------------------------------------------------------------- structured output

@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_always_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "a place"}], response_format=fmt,
                      temperature=1.0, seed=seed, max_tokens=80)
        if stream:
            chunks = client.chat.completions.create(**kwargs, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            out = client.chat.completions.create(**kwargs)
            text = out.choices[0].message.content
            assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_response_format_and_completions_too(client):
    out = client.completions.create(model=MODEL, prompt="{", max_tokens=300, temperature=0.7, seed=1,
                                    extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "s", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                          response_format={"type": "json_object"}, max_tokens=3, temperature=0)
    assert chat.choices[0].message.content.startswith("{")


# ----------------------------------------------------------------- tool calling

def check_calls(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_always_parse_and_validate(client, choice):
    names = {"get_time"} if isinstance(choice, dict) else {"get_weather", "get_time"}
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER, TIME],
            tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        check_calls(message.tool_calls, names)
        assert len(message.tool_calls) == 1  # parallel_tool_calls=False


def test_streamed_tool_call_deltas_assemble_to_the_whole_response(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME],
                  tool_choice="required", temperature=0.9, seed=7, max_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_a_conversation_with_calls_and_results_renders(client):
    messages = [{"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=5)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=5, temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_tool_errors_are_400s_naming_the_field(server):
    url = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
               "tool_choice": "required"}, "tools")]
    for extra, param in cases:
        response = httpx.post(url, json={**base, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_echo_of_token_ids_outside_the_vocabulary_is_a_400(server):
    # found by the schema fuzzer: echo decoded the ids before they were checked, and a huge one overflowed
    for ids in ([453, 202299277562856, 1576], [453, -63]):
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True,
                                                                     "max_tokens": 1})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt" and "token ids must be in" in response.text


# ----------------------------------------------------------------- embeddings, tokenize

def test_embeddings_through_the_client_in_both_encodings(pretrained, client):
    inputs = ["a small cat", "a large dog"]
    b64 = client.embeddings.create(model=MODEL, input=inputs)  # the client asks for base64 by default
    floats = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert [d.index for d in b64.data] == [0, 1]
    for a, b in zip(b64.data, floats.data):
        assert len(a.embedding) == pretrained.model.cfg.hidden_size
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
        assert sum(x * x for x in a.embedding) == pytest.approx(1.0, abs=1e-4)
    assert floats.usage.prompt_tokens == sum(len(pretrained.tokenizer.encode(t)) for t in inputs)
    ids = client.embeddings.create(model=MODEL, input=pretrained.tokenizer.encode("a small cat"),
                                   encoding_format="float").data[0].embedding
    assert ids == pytest.approx(floats.data[0].embedding, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="x", dimensions=3)


def test_tokenize_and_detokenize(pretrained, server):
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hi there"}).json()
    assert tok["tokens"] == pretrained.tokenizer.encode("hi there", add_special_tokens=True)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == pretrained.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                      add_generation_prompt=True)
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": "hi there"}
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": []}).status_code == 400
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


# ----------------------------------------------------------------- speculative serving, OpenAPI

def test_speculative_server_output_equals_plain_decoding_and_reports_acceptance(pretrained):
    prompt = "abc abc abc abc abc abc"
    ids = pretrained.tokenizer.encode(prompt)
    expected = pretrained.tokenizer.decode(naive_greedy(pretrained.model, ids, 24))
    with LiveServer(pretrained, speculative="ngram", num_speculative_tokens=4) as s:
        client = s.openai()
        outs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0) for _ in range(2)]
        metrics = s.metrics()
    assert [o.choices[0].text for o in outs] == [expected, expected]
    assert metrics["tokenmind_spec_decode_draft_tokens_total"] > 0
    rate = metrics["tokenmind_spec_decode_acceptance_rate"]
    assert rate == metrics["tokenmind_spec_decode_accepted_tokens_total"] / \
        metrics["tokenmind_spec_decode_draft_tokens_total"]


def test_a_draft_model_speculates_in_the_server(pretrained, tmp_path):
    """`serve --model DIR --speculative DRAFT_DIR` loads both; a draft equal to the model is always right."""
    save_model(pretrained, tmp_path / "model")
    saved = load_model(tmp_path / "model")  # a plain Transformer: without the fixture's printable-only mask
    expected = saved.tokenizer.decode(naive_greedy(saved.model, saved.tokenizer.encode("draft me"), 16))
    with LiveServer(None, model=str(tmp_path / "model"), served_model_name=MODEL,
                    speculative=str(tmp_path / "model")) as s:
        client = s.openai()
        out = client.completions.create(model=MODEL, prompt="draft me", max_tokens=16, temperature=0)
        metrics = s.metrics()
    assert out.choices[0].text == expected
    assert metrics["tokenmind_spec_decode_acceptance_rate"] == 1.0


def test_openapi_documents_every_status_and_the_metrics_type(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    errors = {"400", "401", "404", "413", "500", "503"}
    for path, expected in [("/v1/chat/completions", errors | {"429"}), ("/v1/completions", errors | {"429"}),
                           ("/v1/embeddings", errors), ("/tokenize", {"400", "401", "404", "413"})]:
        assert set(spec["paths"][path]["post"]["responses"]) == expected | {"200"}, path
    assert "422" not in json.dumps(spec["paths"])  # invalid input is a 400, as OpenAI answers
    assert spec["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/plain; version=0.0.4" in " ".join(metrics)


def test_a_sentence_encoder_serves_embeddings_beside_the_chat_model(pretrained, tmp_path):
    """`serve --embedding-model DIR`: requests naming the encoder get its vectors (as `load_encoder`
    computes them), the chat model keeps its own, and the encoder cannot be asked to generate."""
    from test_encoder import write_tiny_bert

    from tokenmind.model.encoder import load_encoder

    encoder_dir = write_tiny_bert(tmp_path / "tiny-bert")
    reference = load_encoder(encoder_dir)
    texts = ["a man is eating food.", "the new movie is awesome", " ".join(["a b c"] * 30)]
    with LiveServer(pretrained, embedding_model=str(encoder_dir)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL, "tiny-bert"]
        out = client.embeddings.create(model="tiny-bert", input=texts, encoding_format="float")
        got = torch.tensor([d.embedding for d in out.data])
        torch.testing.assert_close(got, reference.embed(texts), rtol=1e-5, atol=1e-5)
        assert out.usage.prompt_tokens == sum(map(len, reference.encode_ids(texts)))  # the long one truncated
        b64 = client.embeddings.create(model="tiny-bert", input=texts[0])  # base64, as the client asks by default
        assert b64.data[0].embedding == pytest.approx(got[0].tolist(), abs=1e-6)
        ids = reference.encode_ids(texts[:1])[0]
        assert client.embeddings.create(model="tiny-bert", input=ids, encoding_format="float").data[0].embedding == \
            pytest.approx(got[0].tolist(), abs=1e-5)
        chat_vector = client.embeddings.create(model=MODEL, input="a small cat").data[0].embedding
        assert len(chat_vector) == pretrained.model.cfg.hidden_size  # the LM's own embeddings still work
        with pytest.raises(openai.BadRequestError, match="embedding model: use it with /v1/embeddings"):
            client.chat.completions.create(model="tiny-bert", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="token ids for tiny-bert must be in"):
            client.embeddings.create(model="tiny-bert", input=[10 ** 6])
        with pytest.raises(openai.BadRequestError, match="32 dimensions"):
            client.embeddings.create(model="tiny-bert", input="x", dimensions=8)
