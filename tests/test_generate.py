"""Sampling and the simple KV-cache generation loop, on a tiny random model."""

import pytest
import torch

from tokenmind.engine.generate import generate, stream_tokens
from tokenmind.engine.sampling import SamplingParams, filter_logits, make_generator, sample
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    m.init_weights(std=0.5)  # large weights → peaked, varied distributions
    return m


def naive_greedy(model, prompt, n):
    """Recompute the whole sequence every step: no cache, the obvious reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_with_cache_equals_naive_recompute(model):
    prompt = [3, 14, 15, 9, 2, 6]
    out = generate(model, prompt, SamplingParams(max_tokens=20, temperature=0))
    assert out.token_ids == naive_greedy(model, prompt, 20)
    assert out.finish_reason == "length"


def test_stops_on_eos_without_emitting_it(model):
    prompt = [3, 14, 15]
    ref = naive_greedy(model, prompt, 10)
    eos = ref[4]
    first = ref.index(eos)
    out = generate(model, prompt, SamplingParams(max_tokens=10, temperature=0), eos_token_ids=[eos])
    assert out.token_ids == ref[:first]
    assert out.finish_reason == "stop"
    ignored = generate(model, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), [eos])
    assert ignored.token_ids == ref


def test_stream_yields_tokens_one_by_one(model):
    seen = []
    for tok in stream_tokens(model, [1, 2, 3], SamplingParams(max_tokens=5, temperature=0)):
        seen.append(tok)
    assert seen == naive_greedy(model, [1, 2, 3], 5)


def test_context_window_limits(model):
    with pytest.raises(ValueError, match="context window is 48"):
        generate(model, list(range(48)), SamplingParams(max_tokens=1))
    out = generate(model, list(range(40)), SamplingParams(max_tokens=100, temperature=0))
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], SamplingParams())


def test_seed_reproduces_and_differs(model):
    p = SamplingParams(max_tokens=16, temperature=1.5, seed=7)
    a, b = generate(model, [1, 2], p), generate(model, [1, 2], p)
    c = generate(model, [1, 2], SamplingParams(max_tokens=16, temperature=1.5, seed=8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.75)))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.75, 0.5+0.3 >= 0.75
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.1)))
    assert kept.tolist() == [[True, False, False, False]]  # the top token always survives


def test_sampling_frequencies_follow_temperature():
    logits = torch.tensor([[0.0, 1.0]])
    g = make_generator(0)
    for temperature in (1.0, 0.5):
        p = SamplingParams(temperature=temperature)
        draws = torch.stack([sample(logits, p, g) for _ in range(4000)])
        expected = torch.softmax(logits / temperature, -1)[0, 1].item()
        assert abs(draws.float().mean().item() - expected) < 0.03


def test_greedy_is_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams(temperature=0), None), logits.argmax(-1))


@pytest.mark.parametrize("bad,match", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_sampling_params_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
