"""Speculative decoding: greedy output identical to `generate`, sampled output distributed like the target."""

import pytest
import torch

from tokenmind.engine.generate import generate
from tokenmind.engine.sampling import SamplingParams, filter_logits, make_generator
from tokenmind.engine.speculative import (Draft, ModelDrafter, NgramDrafter, SpecStats, speculative_generate,
                                          speculative_stream, truncated_draft, verify_sampled)
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer


def tiny(seed, vocab=50, layers=2, hidden=32, std=0.5, max_pos=96):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    torch.manual_seed(seed)
    m = Transformer(cfg).eval()
    m.init_weights(std=std)  # large weights → peaked, varied distributions
    return m


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are bound by per-op overhead; a second thread on a busy 2-core machine makes them ~10× slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return tiny(0)


@pytest.fixture(scope="module")
def other():
    return tiny(1, layers=1)  # a different random model with the same vocabulary


PROMPTS = [[3, 14, 15, 9, 2, 6], [7], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def make_drafter(kind, model, other):
    return {"ngram": lambda: NgramDrafter(), "other": lambda: ModelDrafter(other),
            "self": lambda: ModelDrafter(model)}[kind]()


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "other", "self"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_matches_generate(model, other, kind, k, adaptive):
    drafter = make_drafter(kind, model, other)  # reused across prompts: it must resync to each
    for prompt in PROMPTS:
        ref = generate(model, prompt, GREEDY)
        out, stats = speculative_generate(model, prompt, GREEDY, drafter, k=k, adaptive=adaptive)
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason == "length"
        assert stats.emitted == len(ref.token_ids)
        assert stats.rounds <= len(ref.token_ids)
        if kind == "self":
            assert stats.acceptance_rate == 1.0
            assert stats.rounds == -(-len(ref.token_ids) // (k + 1))  # every round yields k + 1 tokens


def test_drafters_are_exercised(model, other):
    """The equality above must cover both kept and rejected drafts."""
    for drafter in (NgramDrafter(), ModelDrafter(other)):
        total = SpecStats()
        for prompt in PROMPTS:
            _, s = speculative_generate(model, prompt, GREEDY, drafter, k=3)
            total.drafted += s.drafted
            total.accepted += s.accepted
        assert 0 < total.accepted < total.drafted


@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_stops_inside_an_accepted_run(model, other, kind):
    prompt = PROMPTS[2]
    ref = generate(model, prompt, SamplingParams(max_tokens=40, temperature=0)).token_ids
    for pos in (3, 7, 10):
        eos = ref[pos]
        first = ref.index(eos)
        out, stats = speculative_generate(model, prompt, GREEDY, make_drafter(kind, model, other), k=5,
                                          eos_token_ids=[eos])
        assert out.token_ids == ref[:first] and out.finish_reason == "stop"
        assert stats.emitted == first
        via_stop_ids = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[eos])
        out2, _ = speculative_generate(model, prompt, via_stop_ids, make_drafter(kind, model, other), k=5)
        assert out2.token_ids == ref[:first]
    ignored = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    out, _ = speculative_generate(model, prompt, ignored, make_drafter(kind, model, other), k=5, eos_token_ids=[ref[3]])
    assert out.token_ids == ref
    for n in (1, 2, 5, 6, 7, 13):
        p = SamplingParams(max_tokens=n, temperature=0)
        out, _ = speculative_generate(model, prompt, p, make_drafter(kind, model, other), k=5)
        assert out.token_ids == ref[:n] and out.finish_reason == "length"


def test_self_draft_run_is_cut_at_eos(model):
    """With the target as its own drafter every round keeps all k drafts; EOS inside them ends the output."""
    prompt = PROMPTS[0]
    ref = generate(model, prompt, GREEDY).token_ids
    first = ref.index(ref[2])  # lands inside the first round's k + 1 = 6 tokens
    seen = list(speculative_stream(model, prompt, GREEDY, ModelDrafter(model), k=5, eos_token_ids=[ref[2]]))
    assert seen == ref[:first]


def test_stream_and_context_window(model, other):
    prompt = [i % 50 for i in range(1, 90)]  # 89 of 96 positions: only 7 tokens fit
    ref = generate(model, prompt, SamplingParams(max_tokens=100, temperature=0))
    out, _ = speculative_generate(model, prompt, SamplingParams(max_tokens=100, temperature=0),
                                  ModelDrafter(other), k=5)
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 7
    assert list(speculative_stream(model, [1, 2, 3], GREEDY, NgramDrafter(), k=4)) == \
        generate(model, [1, 2, 3], GREEDY).token_ids


def test_errors(model):
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        speculative_generate(model, [1], GREEDY, NgramDrafter(), k=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative_generate(model, [], GREEDY, NgramDrafter())
    with pytest.raises(ValueError, match="vocab_size is 60"):
        speculative_generate(model, [1], GREEDY, ModelDrafter(tiny(2, vocab=60)))
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)


# ----------------------------------------------------------------------------- drafters and caches


def test_ngram_lookup():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    assert d.propose([1, 2, 3, 4, 9, 9, 2, 3], 3).tokens == [4, 9, 9]  # "2 3" was followed by "4 9 9"
    assert d.propose([1, 2, 3, 1, 2, 5, 1, 2], 2).tokens == [5, 1]  # the latest earlier "1 2", not the first
    assert d.propose([7, 8, 7, 8], 5).tokens == [7, 8, 7, 8, 7]  # a recent match repeats with its period
    assert d.propose([4, 4, 4], 3).tokens == [4, 4, 4]
    assert d.propose([1, 2, 3], 3).tokens == []  # nothing to copy
    assert d.propose([5], 3).tokens == []
    assert d.propose([1, 2, 3, 1], 0).tokens == []
    # Incremental index == a fresh index, token by token.
    seq = [int(x) for x in torch.randint(0, 6, (60,), generator=torch.Generator().manual_seed(0))]
    inc = NgramDrafter(max_ngram=4, min_ngram=2)
    for i in range(2, len(seq)):
        assert inc.propose(seq[:i], 4).tokens == NgramDrafter(max_ngram=4, min_ngram=2).propose(seq[:i], 4).tokens


def test_target_cache_rollback(model):
    """Setting `length` back discards later slots: continuing equals a fresh forward over the kept tokens."""
    ids = [3, 14, 15, 9, 2, 6]
    with torch.no_grad():
        cache = model.new_kv_cache(1, 32)
        model(torch.tensor([ids]), kv_cache=cache)
        model(torch.tensor([[11, 12, 13, 14]]), kv_cache=cache)  # four drafts
        cache.length = len(ids) + 1  # keep the first
        cont = model(torch.tensor([[20, 21]]), kv_cache=cache)[0]
        fresh = model(torch.tensor([ids + [11, 20, 21]]))[0, -2:]
    assert cache.length == len(ids) + 3
    torch.testing.assert_close(cont, fresh, atol=1e-5, rtol=1e-5)


def test_model_drafter_resyncs_after_rejection(model, other):
    d = ModelDrafter(other)
    a = d.propose([1, 2, 3, 4], 5)
    assert len(d.ids) == 4 + 5 - 1  # the last draft is not fed yet
    # Keep two drafts and add a different token: the cache rolls back to the shared prefix.
    ctx = [1, 2, 3, 4, *a.tokens[:2], (a.tokens[2] + 1) % 50]
    assert d.propose(ctx, 4).tokens == ModelDrafter(other).propose(ctx, 4).tokens
    assert d.ids[:len(ctx)] == ctx
    # A new, unrelated context, and one long enough to grow the cache.
    long = [int(x) for x in torch.randint(0, 50, (90,), generator=torch.Generator().manual_seed(1))]
    assert d.propose(long, 3).tokens == ModelDrafter(other).propose(long, 3).tokens
    assert d.propose(long + [1], 10).tokens == ModelDrafter(other).propose(long + [1], 10).tokens  # clipped at 96


def test_truncated_draft_shares_weights(model):
    draft = truncated_draft(model, 1)
    assert draft.cfg.num_hidden_layers == 1 and draft.layers[0] is model.layers[0]
    assert draft.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    out, stats = speculative_generate(model, PROMPTS[0], GREEDY, ModelDrafter(draft), k=3)
    assert out.token_ids == generate(model, PROMPTS[0], GREEDY).token_ids
    assert stats.drafted > 0


# ----------------------------------------------------------------------------- sampling


class FixedQDrafter:
    """Draws k tokens i.i.d. from a fixed, context-free q (or proposes fixed tokens with q = point mass)."""

    def __init__(self, q=None, tokens=None):
        self.q, self.tokens = q, tokens

    def propose(self, context_ids, k, params=None, generator=None):
        if self.tokens is not None:
            return Draft(list(self.tokens[:k]))
        toks = torch.multinomial(self.q, k, replacement=True, generator=generator)
        return Draft(toks.tolist(), self.q.expand(k, -1))


V = 8
SAMPLED = SamplingParams(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def small():
    return tiny(3, vocab=V, std=0.3)


def target_joint(model, prompt, params):
    """Exact P(t1, t2) of plain sampling: (V, V)."""
    with torch.no_grad():
        p1 = filter_logits(model(torch.tensor([prompt]))[:, -1], params).softmax(-1)[0]
        ctx = torch.tensor([prompt + [t] for t in range(V)])
        p2 = filter_logits(model(ctx)[:, -1], params).softmax(-1)
    return p1[:, None] * p2


def bad_q(model, prompt, params):
    """Mass mostly on what the target likes least, including tokens its top-k filter removes."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    return torch.softmax(-2.0 * logits, -1)


def test_accept_reject_rule_first_token_distribution(small):
    """The rule alone, many trials: the first token ~ p whatever q is (sampled q and point masses)."""
    prompt = [1, 2, 3]
    with torch.no_grad():
        logits = small(torch.tensor([prompt + [5, 0]]))[0, -3:]  # positions after the prompt, 5, 0
    p = filter_logits(logits, SAMPLED).softmax(-1)
    q = bad_q(small, prompt, SAMPLED)
    g = make_generator(0)
    trials = 10000
    for draft_fn in (lambda: Draft(torch.multinomial(q, 2, replacement=True, generator=g).tolist(), q.expand(2, -1)),
                     lambda: Draft([5, 0])):
        counts = torch.zeros(V)
        for _ in range(trials):
            draft = draft_fn()
            m, nxt = verify_sampled(p, draft, g)
            counts[draft.tokens[0] if m > 0 else nxt] += 1
        assert (counts / trials - p[0]).abs().max() < 0.015


@pytest.mark.parametrize("kind", ["bad_q", "point_mass", "model"])
def test_sampled_output_follows_target_distribution(small, kind):
    """End to end: the first two sampled tokens ~ the target's exact joint, for a deliberately bad draft."""
    prompt = [1, 2, 3]
    joint = target_joint(small, prompt, SAMPLED)
    d1 = int(joint.sum(1).argsort()[-2])  # point masses on likely-but-not-top tokens: kept and rejected
    d2 = int(joint[d1].argsort()[-2])
    drafter = {"bad_q": lambda: FixedQDrafter(q=bad_q(small, prompt, SAMPLED)),
               "point_mass": lambda: FixedQDrafter(tokens=[d1, d2, 0]),
               "model": lambda: ModelDrafter(tiny(4, vocab=V, std=0.3, layers=1))}[kind]()
    runs = 1200
    counts = torch.zeros(V, V)
    total = SpecStats()
    for seed in range(runs):
        # Three tokens, so the first round drafts two: the second token exercises the rule after a keep.
        params = SamplingParams(max_tokens=3, temperature=0.9, top_k=6, seed=seed)
        out, s = speculative_generate(small, prompt, params, drafter, k=3)
        counts[out.token_ids[0], out.token_ids[1]] += 1
        total.drafted += s.drafted
        total.accepted += s.accepted
    emp = counts / runs
    support = joint > 0  # 6 × 6 cells under top-k=6
    expected = joint[support] * runs
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 67.0, chi2  # 35 degrees of freedom: p ≈ 0.001
    assert (emp - joint).abs().max() < 0.04
    assert emp[joint == 0].sum() == 0  # never a token the top-k filter removed
    assert 0 < total.accepted < total.drafted


def test_sampled_is_reproducible_and_self_draft_keeps_all(small):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5)
    a, _ = speculative_generate(small, [1, 2], params, NgramDrafter(), k=4)
    b, _ = speculative_generate(small, [1, 2], params, NgramDrafter(), k=4)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    # q == p up to float noise → (almost) every draft is kept.
    _, s = speculative_generate(small, [1, 2], params, ModelDrafter(small), k=4)
    assert s.acceptance_rate > 0.95
