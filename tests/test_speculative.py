"""Speculative decoding inside the engine: greedy output identical to plain decoding, sampled output
distributed like the target's, for prompt lookup and draft models, batched and under pressure."""

import pytest
import torch
from test_engine_llm import naive_greedy, pool_bytes, run

from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampler import filter_batch
from tokenmind.engine.sampling import SamplingParams, make_generator
from tokenmind.engine.speculative import Draft, NgramIndex, SpeculativeConfig, accept_reject
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


def spec_engine(model, kind, other=None, k=4, adaptive=True, **config):
    method = "ngram" if kind == "ngram" else "draft"
    draft = {"ngram": None, "other": other, "self": model}[kind]
    spec = SpeculativeConfig(method, num_speculative_tokens=k, adaptive=adaptive)
    return Engine(model, config=EngineConfig(**{"block_size": 4, "speculative": spec, **config}), draft_model=draft)


def generate(engine, prompts, params):
    """params: one SamplingParams for every prompt, or a list with one per prompt."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, per_prompt, strict=True)]
    finals, _ = run(engine)
    return [finals[i] for i in ids]


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "other", "self"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_batch_equals_plain_decoding(model, other, kind, k, adaptive):
    engine = spec_engine(model, kind, other, k, adaptive)
    outs = generate(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [naive_greedy(model, p, 40) for p in PROMPTS]
    stats = engine.stats()
    assert stats.num_drafted_tokens > 0
    if kind == "self":  # the draft is the target: every draft is kept, so far fewer steps
        assert stats.num_accepted_tokens == stats.num_drafted_tokens and stats.num_steps < 40
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["ngram", "other"])
def test_greedy_equal_under_preemption_and_chunked_prefill(model, other, kind):
    prompts = PROMPTS + [list(range(30)), [9] * 12]
    engine = spec_engine(model, kind, other, k=5, kv_cache_bytes=pool_bytes(model, 24), max_num_batched_tokens=8,
                         max_num_seqs=5)
    outs = generate(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [naive_greedy(model, p, 40) for p in prompts]
    assert engine.stats().num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_stops_inside_an_accepted_run(model, other, kind):
    """EOS, a stop token, a stop string and max_tokens cut a run of kept drafts where plain decoding stops."""
    ref = naive_greedy(model, PROMPTS[2], 40)
    eos = ref[3]
    engine = spec_engine(model, kind, other, k=5)
    engine.eos_token_ids = {eos}
    outs = generate(engine, [PROMPTS[2]], GREEDY) + \
        generate(engine, [PROMPTS[2]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[ref[6]])) + \
        generate(engine, [PROMPTS[2]], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert outs[0].token_ids == ref[:3] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == ref[:ref.index(ref[6])] and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == ref[:7] and outs[2].finish_reason == "length"


def test_logprobs_are_the_same_with_speculation(model, other):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    plain = generate(Engine(model, config=EngineConfig(block_size=4)), [PROMPTS[2]], params)[0]
    spec = generate(spec_engine(model, "self", k=4), [PROMPTS[2]], params)[0]
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_penalised_requests_decode_plainly(model):
    engine = spec_engine(model, "self", k=4)
    params = SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3)
    out = generate(engine, [PROMPTS[0]], params)[0]
    assert engine.stats().num_drafted_tokens == 0
    assert out.token_ids == generate(Engine(model, config=EngineConfig(block_size=4)), [PROMPTS[0]], params)[0].token_ids


def test_errors_name_the_fix(model):
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(model, config=EngineConfig(speculative=SpeculativeConfig("draft")))
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(model, config=EngineConfig(speculative=SpeculativeConfig("draft")), draft_model=tiny(2, vocab=60))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="'ngram'"):
        SpeculativeConfig("lookahead")


def test_ngram_lookup():
    index = NgramIndex(1, 3)
    assert index.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # the 2-gram (1, 2) was followed by 3, 4, 1
    assert index.lookup([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # extended incrementally
    assert NgramIndex(1, 3).lookup([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a recent match repeats its period
    assert NgramIndex(1, 3).lookup([1, 2, 3], 4) == []


# ----------------------------------------------------------------------------- sampling


V = 8
SAMPLED = SamplingParams(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def small():
    return tiny(3, vocab=V, std=0.3)


def target_joint(model, prompt, params):
    """Exact P(t1, t2) of plain sampling: (V, V)."""
    with torch.no_grad():
        p1 = filter_batch(model(torch.tensor([prompt]))[:, -1], [params]).softmax(-1)[0]
        ctx = torch.tensor([prompt + [t] for t in range(V)])
        p2 = filter_batch(model(ctx)[:, -1], [params] * V).softmax(-1)
    return p1[:, None] * p2


def bad_q(model, prompt):
    """Mass mostly on what the target likes least, including tokens its top-k filter removes."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    return torch.softmax(-2.0 * logits, -1)


def test_accept_reject_rule_first_token_distribution(small):
    """The rule alone, many trials: the first token ~ p whatever q is (sampled q and point masses)."""
    prompt = [1, 2, 3]
    with torch.no_grad():
        logits = small(torch.tensor([prompt + [5, 0]]))[0, -3:]  # positions after the prompt, 5, 0
    p = filter_batch(logits, [SAMPLED] * 3).softmax(-1)
    q = bad_q(small, prompt)
    g = make_generator(0)
    trials = 10000
    for draft_fn in (lambda: Draft(torch.multinomial(q, 2, replacement=True, generator=g).tolist(), q.expand(2, -1)),
                     lambda: Draft([5, 0])):
        counts = torch.zeros(V)
        for _ in range(trials):
            draft = draft_fn()
            m, nxt = accept_reject(p, draft, g)
            counts[draft.tokens[0] if m > 0 else nxt] += 1
        assert (counts / trials - p[0]).abs().max() < 0.015


class FixedQProposer:
    """Draws drafts i.i.d. from a fixed, context-free q (or proposes fixed tokens, q = point mass)."""

    def __init__(self, q=None, tokens=None):
        self.q, self.tokens = q, tokens

    def propose(self, seqs, ks):
        if self.tokens is not None:
            return [Draft(list(self.tokens[:k])) for k in ks]
        drafts = []
        for seq, k in zip(seqs, ks):
            toks = torch.multinomial(self.q, k, replacement=True, generator=seq.generator)
            drafts.append(Draft(toks.tolist(), self.q.expand(k, -1)))
        return drafts

    def verified(self, seq, num_tokens_before, drafted, accepted):
        pass


@pytest.mark.parametrize("kind", ["bad_q", "point_mass", "model"])
def test_sampled_output_follows_target_distribution(small, kind):
    """End to end through the engine: the first two sampled tokens ~ the target's exact joint, for a
    deliberately bad proposer; 1200 requests with different (fixed, so the test cannot flake) seeds
    run as one batch."""
    prompt = [1, 2, 3]
    joint = target_joint(small, prompt, SAMPLED)
    d1 = int(joint.sum(1).argsort()[-2])  # point masses on likely-but-not-top tokens: kept and rejected
    d2 = int(joint[d1].argsort()[-2])
    engine = spec_engine(small, "self" if kind == "model" else "ngram", k=3, adaptive=False, max_num_seqs=256,
                         max_num_batched_tokens=1024)
    if kind == "model":
        engine = Engine(small, config=engine.config, draft_model=tiny(4, vocab=V, std=0.3, layers=1))
    else:
        engine.proposer = FixedQProposer(q=bad_q(small, prompt)) if kind == "bad_q" else FixedQProposer(
            tokens=[d1, d2, 0])
    runs = 1200
    # Three tokens, so the first round drafts two: the second token exercises the rule after a keep.
    outs = generate(engine, [prompt] * runs, [SamplingParams(max_tokens=3, temperature=0.9, top_k=6, ignore_eos=True,
                                                             seed=10_000 + i) for i in range(runs)])
    counts = torch.zeros(V, V)
    for out in outs:
        counts[out.token_ids[0], out.token_ids[1]] += 1
    emp = counts / runs
    support = joint > 0  # 6 × 6 cells under top-k=6
    expected = joint[support] * runs
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 67.0, chi2  # 35 degrees of freedom: p ≈ 0.001
    assert (emp - joint).abs().max() < 0.04
    assert emp[joint == 0].sum() == 0  # never a token the top-k filter removed
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens


def test_sampled_is_reproducible_and_a_self_draft_keeps_all(small):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    a = generate(spec_engine(small, "ngram", k=4), [[1, 2]], params)[0]
    b = generate(spec_engine(small, "ngram", k=4), [[1, 2]], params)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    engine = spec_engine(small, "self", k=4)  # q == p up to float noise: (almost) every draft is kept
    generate(engine, [[1, 2]], params)
    assert engine.stats().acceptance_rate > 0.95
