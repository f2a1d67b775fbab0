"""The engine against naive full-recompute decoding and against itself running one request alone,
on a tiny random model and a scripted one."""

import dataclasses
from pathlib import Path

import pytest
import torch
from test_eval_fixtures import EOS, ByteTokenizer

from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import LLM, Engine, OutputStream
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.config import ModelConfig
from tokenmind.model.paged_attention import PagedKVCache
from tokenmind.model.transformer import Transformer
from tokenmind.model.load import Pretrained, load_model


def tiny_model(vocab=64, context=64):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.init_weights(std=0.5)  # large weights → peaked, varied distributions
    return model


def naive_greedy(model, prompt, max_tokens, stop_ids=()):
    """Recompute the whole sequence for every token, no cache: the obvious reference."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(min(max_tokens, model.cfg.max_position_embeddings - len(prompt))):
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token in stop_ids:
                break
            ids.append(token)
            out.append(token)
    return out


def solo(model, prompt, params, **config):
    """The engine's tokens for one request running alone."""
    engine = Engine(model, config=EngineConfig(**{"block_size": 4, **config}))
    rid = engine.add_request(prompt, params)
    return run(engine)[0][rid].token_ids


def pool_bytes(model, blocks, block_size=4):
    return blocks * PagedKVCache.bytes_per_block(model.cfg, block_size, torch.float32)


def run(engine):
    """Step until done; final outputs by request id, and the deltas seen per request."""
    finals, deltas = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append((out.new_token_ids, out.new_text))
            if out.finished:
                finals[out.request_id] = out
    return finals, deltas


def assert_batched_greedy_equals_naive(model, max_tokens=12, **config):
    """Four prompts of different lengths through one engine, in small steps (chunked prefill, decode
    batched with prefill) give each the tokens the no-cache reference gives it alone. `config`:
    more `EngineConfig` fields (speculative decoding, a small pool); returns the engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 17, 5)]
    engine = Engine(model, config=EngineConfig(**{"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 8,
                                                  **config}))
    ids = [engine.add_request(p, params) for p in prompts]
    finals, _ = run(engine)
    assert [finals[i].token_ids for i in ids] == [naive_greedy(model, p, max_tokens) for p in prompts]
    return engine


def assert_no_leaks(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 5, 12)]


GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def references(model, prompts):
    return [naive_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("case", ["roomy", "preemption", "chunked", "no_prefix_cache"])
def test_batched_greedy_equals_naive_decoding(model, prompts, references, case):
    options = {"roomy": dict(),
               "preemption": dict(kv_cache_bytes=pool_bytes(model, 14)),  # < half of what 6 sequences need
               "chunked": dict(max_num_batched_tokens=6, max_num_seqs=6),  # the 30-token prompt takes 5+ steps
               "no_prefix_cache": dict(enable_prefix_caching=False, kv_cache_bytes=pool_bytes(model, 14))}[case]
    engine = Engine(model, config=EngineConfig(**{"block_size": 4, "max_num_seqs": 8, **options}))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    finals, _ = run(engine)
    assert [finals[i].token_ids for i in ids] == references
    assert all(finals[i].finish_reason == "length" for i in ids)
    if case in ("preemption", "no_prefix_cache"):
        assert engine.stats().num_preemptions > 0
    if case == "chunked":
        assert engine.stats().num_steps >= 30 // 6 + GREEDY.max_tokens
    assert_no_leaks(engine)


def test_chunked_prefill_keeps_decodes_flowing(model, prompts, references):
    """A long prompt arriving mid-generation is prefilled in chunks while the first request decodes."""
    engine = Engine(model, config=EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=4))
    first = engine.add_request(prompts[0], GREEDY)
    engine.step()
    engine.add_request(prompts[3], GREEDY)  # 30 tokens: at least 4 chunks of <= 7
    new_tokens_of_first = 0
    for _ in range(4):
        for out in engine.step():
            if out.request_id == first:
                new_tokens_of_first += len(out.new_token_ids)
    assert new_tokens_of_first == 4  # one decode token in every step of the long prefill
    finals, _ = run(engine)
    assert finals["1"].token_ids == references[3]


def test_prefix_cache_computes_a_shared_system_prompt_once(model):
    system = list(range(1, 17))  # 16 tokens = 4 full blocks of 4
    engine = Engine(model, config=EngineConfig(block_size=4))
    a = engine.add_request(system + [40, 41, 42], GREEDY)
    first, _ = run(engine)
    b = engine.add_request(system + [50, 51], GREEDY)
    second, _ = run(engine)
    assert first[a].num_cached_tokens == 0
    assert second[b].num_cached_tokens == 16  # the second request computes 2 prompt tokens, not 18
    assert engine.stats().prefix_cache_hit_rate == pytest.approx(16 / (19 + 18))
    assert second[b].token_ids == naive_greedy(model, system + [50, 51], GREEDY.max_tokens)
    assert_no_leaks(engine)


def test_n_completions_share_the_prompt_and_reproduce_their_seeds(model):
    prompt = list(range(5, 15))  # 10 tokens: the third block is partial, so siblings copy it on write
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3)
    engine = Engine(model, config=EngineConfig(block_size=4))
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill once, fork the siblings
    assert len(engine.requests[rid]) == 3
    assert engine.block_manager.ref_counts[engine.requests[rid][0].block_table[0]] == 3
    finals, _ = run(engine)
    outs = finals[rid].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    for i, o in enumerate(outs):  # sibling i samples with seed + i, exactly like a request of its own
        assert o.token_ids == solo(model, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3 + i))
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert engine.block_manager.num_copies >= 2
    assert_no_leaks(engine)


def test_n_completions_under_preemption(model, prompts):
    """Siblings and other requests fight over a tiny pool: everything still matches running alone."""
    engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_bytes=pool_bytes(model, 12), max_num_seqs=6))
    sampled = SamplingParams(max_tokens=14, temperature=1.0, seed=5, n=3)
    a = engine.add_request(prompts[1], sampled)
    b = engine.add_request(prompts[2], GREEDY)
    finals, _ = run(engine)
    assert engine.stats().num_preemptions > 0
    for i, o in enumerate(finals[a].outputs):
        assert o.token_ids == solo(model, prompts[1], SamplingParams(max_tokens=14, temperature=1.0, seed=5 + i))
    assert finals[b].token_ids == naive_greedy(model, prompts[2], GREEDY.max_tokens)
    assert_no_leaks(engine)


def test_seeded_sampling_ignores_batch_composition(model, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=11)
    ref = solo(model, prompts[1], params)
    crowded = Engine(model, config=EngineConfig(block_size=4, kv_cache_bytes=pool_bytes(model, 16)))
    crowded.add_request(prompts[0], SamplingParams(max_tokens=16, temperature=1.2))
    rid = crowded.add_request(prompts[1], params)
    crowded.add_request(prompts[2], SamplingParams(max_tokens=16, temperature=0.5, seed=1))
    crowded.add_request(prompts[3], GREEDY)
    assert run(crowded)[0][rid].token_ids == ref
    assert ref == solo(model, prompts[1], params) and ref != solo(model, prompts[1], dataclasses.replace(params,
                                                                                                        seed=12))


def test_logprobs_are_log_softmax_of_the_logits(model, prompts):
    engine = Engine(model, config=EngineConfig(block_size=4))
    rid = engine.add_request(prompts[2], SamplingParams(max_tokens=3, temperature=0, logprobs=4))
    out = run(engine)[0][rid]
    ids = prompts[2] + out.token_ids
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0].log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        row = logp[len(prompts[2]) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))  # greedy picks the top token


def test_stop_token_eos_and_lengths(model, prompts, references):
    ref = references[1]
    eos = ref[5]
    engine = Engine(model, config=EngineConfig(block_size=4), eos_token_ids=[eos])
    a = engine.add_request(prompts[1], GREEDY)
    b = engine.add_request(prompts[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    c = engine.add_request(prompts[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[ref[2]]))
    d = engine.add_request(list(range(40)) + [1] * 20, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    finals, _ = run(engine)
    assert finals[a].token_ids == ref[:ref.index(eos)] and finals[a].finish_reason == "stop"
    assert finals[b].token_ids == ref and finals[b].finish_reason == "length"
    assert finals[c].token_ids == ref[:ref.index(ref[2])] and finals[c].finish_reason == "stop"
    assert len(finals[d].token_ids) == 4 and finals[d].finish_reason == "length"  # the 64-token context is full


def test_abort_frees_blocks_and_others_go_on(model, prompts, references):
    engine = Engine(model, config=EngineConfig(block_size=4))
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    engine.step()
    engine.step()
    out = engine.abort(ids[1])
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    assert engine.abort(ids[1]) is None
    finals, _ = run(engine)
    assert [finals[ids[0]].token_ids, finals[ids[2]].token_ids] == [references[0], references[2]]
    assert_no_leaks(engine)


def test_requests_that_cannot_fit_are_rejected(model):
    engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_bytes=pool_bytes(model, 5), max_num_seqs=2))
    for prompt, params, match in [
        (list(range(64)), GREEDY, "max_model_len is 64"),
        ([1, 2, 3], SamplingParams(max_tokens=30), "needs 8 KV blocks but the pool has 5"),
        ([1, 2, 3], SamplingParams(max_tokens=5, n=3), "max_num_seqs=2"),
        ([], GREEDY, "prompt is empty"),
        ([1, 99], GREEDY, r"\[0, 64\)"),
        ([1, 2], SamplingParams(stop=["x"]), "need a tokenizer"),
        ("text", GREEDY, "no tokenizer"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, params)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("options,match", [
    (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens=8 cannot"),
    (dict(kv_cache_bytes=10), "holds no KV block"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32, max_num_seqs=4), "without chunked prefill"),
    (dict(kv_cache_fraction=0.0), "kv_cache_fraction"),
    (dict(dtype="fp8"), "unknown dtype 'fp8'"),
])
def test_config_errors_name_the_fix(model, options, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, config=EngineConfig(**options))


def test_pool_from_free_memory_is_capped_by_what_sequences_can_use(model):
    engine = Engine(model, config=EngineConfig(block_size=4, max_num_seqs=3))
    assert engine.block_manager.num_blocks == 3 * 64 // 4


# ----------------------------------------------------------------- text: stop strings, multi-byte characters


class ScriptedModel(Transformer):
    """Greedy decoding writes `script` (bytes), whatever the prompt: position p predicts script[p]."""

    def __init__(self, script: bytes):
        super().__init__(ModelConfig(vocab_size=260, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=128))
        self.script = list(script) + [EOS]

    def hidden_states(self, input_ids, positions=None, *args, **kw):
        return positions[..., None].float()

    def logits(self, hidden):
        nxt = torch.tensor([self.script[min(int(p), len(self.script) - 1)] for p in hidden[..., 0].flatten()])
        return torch.nn.functional.one_hot(nxt, 260).float().reshape(*hidden.shape[:-1], 260)


TEXT = "Héllo wörld! 3€ each"


@pytest.mark.parametrize("stop,expected", [
    (["wörld"], "Héllo "),  # spans many tokens, with a 2-byte character inside
    (["€"], "Héllo wörld! 3"),  # the stop string is one 3-byte character
    (["d! 3", "ö"], "Héllo w"),  # the first occurrence of any stop string wins
    (["€ ea", "zzz"], "Héllo wörld! 3"),
    (["nowhere"], TEXT),
])
def test_stop_strings_across_tokens_and_multibyte_characters(stop, expected):
    engine = Engine(ScriptedModel(TEXT.encode()), ByteTokenizer(), EngineConfig(block_size=4))
    rid = engine.add_request([0], SamplingParams(max_tokens=64, temperature=0, stop=stop))
    finals, deltas = run(engine)
    out = finals[rid]
    assert out.text == expected
    assert out.finish_reason == "stop"  # a stop string, or EOS after the whole script
    assert "".join(t for _, t in deltas[rid]) == expected  # streamed pieces add up, nothing taken back
    assert all("\ufffd" not in t for _, t in deltas[rid])  # never half a character
    assert sum(len(ids) for ids, _ in deltas[rid]) == len(out.token_ids)
    assert bytes(out.token_ids).decode().startswith(expected)


def test_max_tokens_inside_a_character_flushes_at_the_end():
    engine = Engine(ScriptedModel(TEXT.encode()), ByteTokenizer(), EngineConfig(block_size=4))
    rid = engine.add_request([0], SamplingParams(max_tokens=2, temperature=0))  # "H" + first byte of "é"
    out = run(engine)[0][rid]
    assert out.finish_reason == "length" and out.text == "H\ufffd"


def test_output_stream_holds_back_a_possible_stop_string():
    stream = OutputStream(ByteTokenizer().stream_decoder(), ["€x"])
    pieces = []
    for b in "ab€".encode():
        assert not stream.push(b)
        pieces.append(stream.visible_text(False))
    assert pieces == ["", "a", "a", "a", "ab"]  # "€" is held: it might start "€x"
    assert stream.push(ord("x")) and stream.text == "ab"


def test_llm_generate_text_prompts_in_order():
    model = ScriptedModel(TEXT.encode())
    llm = LLM(Pretrained(model, ByteTokenizer(), Path("scripted")), block_size=4)
    outs = llm.generate(["a", "bc", "def"], [SamplingParams(max_tokens=m, temperature=0) for m in (3, 5, 64)],
                        progress=True)
    # position p predicts script[p]: a prompt of length L starts at script[L - 1], maybe mid-character
    assert [o.text for o in outs] == ["Hé", "éllo", "\ufffdllo wörld! 3€ each"]
    assert outs[0].metrics["ttft_s"] > 0 and outs[2].finish_reason == "stop"
    assert outs[1].prompt_token_ids == list(b"bc")


@pytest.mark.slow
def test_smollm2_batched_equals_naive_decoding_and_stops_on_a_string():
    pretrained = load_model("smollm2")
    llm = LLM(pretrained, max_num_seqs=4, kv_cache_bytes=32 << 20)
    tok = pretrained.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == naive_greedy(pretrained.model, tok.encode(prompt, add_special_tokens=True), 6)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    answer = llm.generate([chat], SamplingParams(max_tokens=12, temperature=0, stop=["."]))[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop" and "." not in answer.text
