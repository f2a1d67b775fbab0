"""Fuzzing: schemathesis derives valid and invalid requests from the app's own OpenAPI spec; none may get a 5xx.

Every JSON error must also be in OpenAI's shape. The model's context is 32 tokens, it runs at
most 4 sequences (so n <= 4) and admits 4 more prompts, so even the largest valid request the
fuzzer finds stays cheap. (The spec comes from `app.openapi()` and the cases are drawn with
`as_strategy`, not with schemathesis' pytest plugin, whose lazy-fixture loader fails on pytest 9.)
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode
from test_serve_fixtures import LiveServer, tiny_pretrained

from tokenmind.serve import ServeConfig, build_app

OPTIONS = dict(max_num_seqs=4, max_queue=4)
SPEC = build_app(ServeConfig(model="tiny", **OPTIONS), tiny_pretrained(context=32)).openapi()
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
CASES = [("POST", "/v1/chat/completions", POSITIVE), ("POST", "/v1/chat/completions", NEGATIVE),
         ("POST", "/v1/completions", POSITIVE), ("POST", "/v1/completions", NEGATIVE),
         ("GET", "/v1/models/{model_id}", POSITIVE)]  # a path parameter is any string: there is no invalid one


@pytest.fixture(scope="module")
def fuzz_server():
    with LiveServer(tiny_pretrained(context=32), **OPTIONS) as s:
        yield s


def test_the_spec_lists_every_endpoint():
    paths = set(SPEC["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= paths


@pytest.mark.parametrize("method,path,mode", CASES)
def test_no_generated_request_gets_a_server_error(fuzz_server, method, path, mode):
    operation = schemathesis.openapi.from_dict(SPEC)[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.explicit, Phase.generate])  # no shrinking: a failure shows the request as sent
    def check(case):
        if mode == POSITIVE and isinstance(case.body, dict):
            case.body["model"] = "tiny"  # else nearly every valid request is just an unknown model (404)
        response = case.call(base_url=fuzz_server.url, timeout=60)
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
    fuzz_server.wait_idle()  # and nothing was left running or holding KV blocks
