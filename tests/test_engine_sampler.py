"""Batched sampler: penalties, top-k/p and min-p on hand-made logits, per-row seeds, logprobs, and a
row-by-row reference written from the definitions."""

import pytest
import torch

from tokenmind.engine.sampler import apply_penalties, filter_batch, sample_batch
from tokenmind.engine.sampling import SamplingParams, make_generator
from tokenmind.engine.sequence import Sequence


def seq(prompt, output=(), **params):
    s = Sequence("r", list(prompt), SamplingParams(**params), set(), max_len=1000)
    for t in output:
        s.append_token(t)
    return s


def test_repetition_penalty_hf_style_over_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    out = apply_penalties(logits, [seq([0], [1, 1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, 1.0]]  # positive / p, negative * p, unseen untouched
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, 1.0]]  # the input is not modified


def test_presence_and_frequency_penalties_openai_style_over_output_only():
    logits = torch.zeros(1, 5)
    s = seq([4, 4], [1, 2, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [s])
    # token 1: 0.5 + 0.25; token 2: 0.5 + 3 * 0.25; the prompt's token 4 is not penalised
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0]]


def test_penalties_are_per_row():
    logits = torch.ones(2, 3)
    out = apply_penalties(logits, [seq([0], [], repetition_penalty=2.0), seq([0])])
    assert out.tolist() == [[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(filter_batch(logits, [SamplingParams(min_p=0.2)]))
    assert kept.tolist() == [[True, True, True, False]]  # 0.05 < 0.2 * 0.5
    kept = torch.isfinite(filter_batch(logits, [SamplingParams(min_p=0.5)]))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.equal(filter_batch(logits, [SamplingParams(min_p=0.2)]), reference_filter(logits[0],
                                                                                            SamplingParams(min_p=0.2)))


def reference_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, straight from the definitions, token by token: what survives keeps its tempered logit."""
    logits = row.float() / p.temperature
    probs = logits.softmax(-1)
    order = sorted(range(len(row)), key=lambda i: -logits[i].item())
    keep = set(order)
    if p.top_k:  # the k largest (and ties with the kth)
        kth = logits[order[min(p.top_k, len(row)) - 1]].item()
        keep = {i for i in keep if logits[i].item() >= kth}
    if p.top_p < 1:  # a token goes when the mass of the better ones (among the kept) reaches top_p
        kept = torch.tensor([logits[i].item() if i in keep else float("-inf") for i in range(len(row))]).softmax(-1)
        mass = 0.0
        for i in order:
            if mass >= p.top_p:
                keep.discard(i)
            mass += kept[i].item()
    out = torch.tensor([logits[i].item() if i in keep else float("-inf") for i in range(len(row))])
    if p.min_p:
        probs = out.softmax(-1)
        out = out.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return out[None]


def test_top_k_keeps_exactly_k_and_top_p_the_smallest_nucleus():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    assert torch.isfinite(filter_batch(logits, [SamplingParams(top_k=2)])).tolist() == [[False, True, False, True,
                                                                                          False]]
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(filter_batch(logits, [SamplingParams(top_p=0.75)])).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_batch(logits, [SamplingParams(top_p=0.1)])).tolist() == [[True, False, False, False]]


def test_sampling_frequencies_follow_temperature():
    logits = torch.tensor([[0.0, 1.0]])
    for temperature in (1.0, 0.5):
        s = seq([0], temperature=temperature, seed=0)
        draws = [sample_batch(logits, [s])[0][0] for _ in range(4000)]
        expected = torch.softmax(logits / temperature, -1)[0, 1].item()
        assert abs(sum(draws) / len(draws) - expected) < 0.03


@pytest.mark.parametrize("bad,match", [({"max_tokens": -1}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_sampling_params_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_a_seed_reproduces_and_no_seed_differs():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert not torch.equal(torch.rand(4, generator=make_generator(None)), torch.rand(4, generator=make_generator(None)))


def test_batched_filter_equals_the_single_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.8),
              SamplingParams(temperature=1.3, top_k=10, top_p=0.5, min_p=0.1), SamplingParams(),
              SamplingParams(min_p=0.3)]
    got = filter_batch(logits, params)
    for i, p in enumerate(params):
        ref = reference_filter(logits[i], p)
        kept = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got[i:i + 1]), kept) and kept.sum() >= 1
        assert torch.allclose(got[i:i + 1][kept], ref[kept], atol=1e-5)


def test_greedy_rows_take_the_argmax_and_consume_no_randomness():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    s = seq([0], temperature=0)
    state = s.generator.get_state()
    tokens, _ = sample_batch(logits[:1], [s])
    assert tokens == [int(logits[0].argmax())]
    assert torch.equal(s.generator.get_state(), state)


def test_same_seed_same_draws_whatever_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    alone = seq([0], temperature=1.0, seed=7)
    solo = [sample_batch(logits[2:3], [alone])[0][0] for _ in range(10)]
    crowd = [seq([0], temperature=1.0, seed=s) for s in (1, 2)] + [seq([0], temperature=1.0, seed=7),
                                                                   seq([0], temperature=0)]
    batched = [sample_batch(logits, crowd)[0][2] for _ in range(10)]
    assert solo == batched
    assert len(set(solo)) > 1  # it really samples


def test_logprobs_are_log_softmax_of_penalised_logits_before_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    s = seq([0], [2], temperature=0.5, logprobs=2, frequency_penalty=1.0, seed=0)
    tokens, logprobs = sample_batch(logits, [s])
    ref = torch.tensor([1.0, 2.0, 2.0, 0.0]).log_softmax(-1)  # token 2 penalised once; no temperature
    lp = logprobs[0]
    assert lp.token_id == tokens[0] and lp.logprob == pytest.approx(ref[tokens[0]].item())
    assert [t for t, _ in lp.top] in ([1, 2], [2, 1])
    assert [v for _, v in lp.top] == pytest.approx(ref.topk(2).values.tolist())
    assert sample_batch(logits, [seq([0], temperature=0)])[1] == [None]  # off unless asked


@pytest.mark.parametrize("bad,match", [({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
                                       ({"presence_penalty": 3.0}, "presence_penalty"),
                                       ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"stop": [""]}, "stop"),
                                       ({"n": 0}, "n must"), ({"logprobs": 21}, "logprobs")])
def test_new_sampling_params_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_tiny_temperature_and_top_p_are_greedy_not_nan():
    # 1e-30 would overflow logits / temperature to inf and make the softmax NaN.
    params = SamplingParams(temperature=1e-30, top_p=1e-30)
    assert params.greedy and params.top_p > 0
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert sample_batch(logits, [seq([0], temperature=1e-30, top_p=1e-30)])[0] == [1]
    sampled = SamplingParams(temperature=0.5, top_p=1e-30)
    assert not torch.isnan(filter_batch(logits, [sampled]).softmax(-1)).any()


@pytest.mark.parametrize("params", [dict(temperature=0.9, top_p=0.9), dict(temperature=1.0, top_k=5),
                                    dict(temperature=0.7, min_p=0.2), dict(temperature=1.3, top_k=40, top_p=0.5),
                                    dict(temperature=1.0), dict(temperature=2.0, top_p=0.999)])
def test_draws_among_candidates_follow_the_full_filtered_distribution(params):
    """Peaked logits put the nucleus among the candidates (the fast path), flat ones do not (the full
    path); both must sample the distribution `filter_batch` defines over the whole vocabulary."""
    from tokenmind.engine.sampler import draw

    g = torch.Generator().manual_seed(3)
    for scale in (8.0, 0.3):
        logits = torch.randn(1, 2000, generator=g) * scale
        expected = filter_batch(logits, [SamplingParams(**params)]).softmax(-1)[0]
        s = seq([0], seed=1, **params)
        counts = torch.bincount(torch.tensor([draw(logits, [s])[0] for _ in range(3000)]), minlength=2000).float()
        support = expected > 0
        assert counts[~support].sum() == 0  # never a filtered-out token
        top = expected.argsort(descending=True)[:5]
        assert (counts[top] / 3000 - expected[top]).abs().max() < 0.03
