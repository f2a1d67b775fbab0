"""The engine's prompt logprobs (echo scoring), max_tokens 0, grammar-constrained decoding and
embeddings, on a tiny random model with a real (byte-level BPE) tokenizer."""

import json

import jsonschema
import pytest
import torch
from test_serve_fixtures import tiny_pretrained

from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampling import SamplingParams
from tokenmind.engine.speculative import SpeculativeConfig
from tokenmind.engine.structured import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "size": {"enum": ["small", "large"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def pretrained():
    return tiny_pretrained(context=512)


def engine_for(pretrained, **config):
    return Engine(pretrained.model, pretrained.tokenizer, EngineConfig(**{"block_size": 4, **config}))


def finish(engine):
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def reference_logprobs(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_equal_a_full_forward(pretrained, config):
    engine = engine_for(pretrained, **config)
    ids = pretrained.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    rid = engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    out = finish(engine)[rid]
    ref = reference_logprobs(pretrained.model, ids)
    assert [e.token_id for e in out.prompt_logprobs] == ids
    assert out.prompt_logprobs[0].logprob is None and out.prompt_logprobs[0].top is None
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == ref[i - 1].topk(2).indices.tolist()
    assert len(out.token_ids) == 3  # and it went on generating


def test_a_cached_prefix_still_yields_prompt_logprobs(pretrained):
    """A prompt whose prefix is in the prefix cache is computed again when its logprobs are wanted;
    without logprobs the same prompt reuses the cache."""
    engine = engine_for(pretrained)
    ids = pretrained.tokenizer.encode("shared system prompt, long enough for several blocks. Question?")
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    finish(engine)
    plain = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    assert finish(engine)[plain].num_cached_tokens > 0
    scored = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    out = finish(engine)[scored]
    assert out.num_cached_tokens == 0
    ref = reference_logprobs(pretrained.model, ids)
    got = [e.logprob for e in out.prompt_logprobs[1:]]
    assert got == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)


def test_max_tokens_zero_scores_the_prompt_without_generating(pretrained):
    engine = engine_for(pretrained)
    ids = pretrained.tokenizer.encode("score me")
    rid = engine.add_request(ids, SamplingParams(max_tokens=0, n=2, prompt_logprobs=1))
    out = finish(engine)[rid]
    assert [o.token_ids for o in out.outputs] == [[], []]
    assert {o.finish_reason for o in out.outputs} == {"length"}
    assert len(out.prompt_logprobs) == len(ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("spec,check", [
    (StructuredOutput(json_schema=SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    (StructuredOutput(regex=r"(yes|no), because [a-z]{1,12}\."), None),
    (StructuredOutput(lark='start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'), None),
], ids=["json_schema", "regex", "lark"])
def test_sampled_outputs_always_match_the_grammar(pretrained, spec, check):
    import re

    engine = engine_for(pretrained)
    ids = [engine.add_request("answer:", SamplingParams(max_tokens=120, temperature=1.0, seed=s, n=2,
                                                        structured=spec)) for s in range(4)]
    finals = finish(engine)
    for rid in ids:
        for o in finals[rid].outputs:
            assert o.finish_reason == "stop", o.text
            if check is not None:
                check(o.text)
            elif spec.regex is not None:
                assert re.fullmatch(spec.regex, o.text), o.text
            else:
                assert re.fullmatch(r"x=[0-9]{1,3};", o.text), o.text


def test_json_object_takes_any_object_and_only_an_object(pretrained):
    engine = engine_for(pretrained)
    tok = pretrained.tokenizer

    def accepts(text):
        matcher = engine.grammar.matcher(StructuredOutput(json_object=True))
        return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()

    assert accepts('{"a": [1, {"b": null}], "c": "d"}') and accepts("{}")
    assert not accepts("[1, 2]") and not accepts('"text"') and not accepts('{"a": 1')


def test_constrained_and_free_requests_share_a_batch(pretrained):
    """A free request beside constrained ones decodes exactly as alone; speculation skips the
    constrained ones and still verifies the free one."""
    params = SamplingParams(max_tokens=40, temperature=0)
    alone = engine_for(pretrained)
    rid = alone.add_request("hello there", params)
    expected = finish(alone)[rid].token_ids
    engine = engine_for(pretrained, speculative=SpeculativeConfig("ngram"))
    free = engine.add_request("hello there", params)
    constrained = [engine.add_request("hello there", SamplingParams(
        max_tokens=120, temperature=0.8, seed=i, structured=StructuredOutput(json_schema=SCHEMA))) for i in range(3)]
    finals = finish(engine)
    assert finals[free].token_ids == expected
    for rid in constrained:
        jsonschema.validate(json.loads(finals[rid].text), SCHEMA)


def test_bad_constraints_are_refused_with_the_reason(pretrained):
    engine = engine_for(pretrained)
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.add_request("x", SamplingParams(structured=StructuredOutput(lark="start: undefined_rule")))
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.add_request("x", SamplingParams(structured=StructuredOutput(json_schema={"type": "frobnicate"})))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(json_object=True, regex="a")
    assert not engine.has_unfinished()


def test_embeddings_are_mean_pooled_unit_vectors_independent_of_batching(pretrained):
    engine = engine_for(pretrained)
    prompts = [pretrained.tokenizer.encode(t) for t in ("a cat", "a much longer sentence about dogs", "x")]
    together = engine.embed(prompts, max_batch_tokens=64)
    alone = torch.cat([engine.embed([p]) for p in prompts])
    assert together.shape == (3, pretrained.model.cfg.hidden_size)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together.norm(dim=-1), torch.ones(3))
    with torch.no_grad():
        hidden = pretrained.model.hidden_states(torch.tensor([prompts[1]]))[0].mean(0)
    torch.testing.assert_close(together[1], torch.nn.functional.normalize(hidden, dim=0), atol=1e-5, rtol=1e-5)
