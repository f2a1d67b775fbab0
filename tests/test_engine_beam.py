"""Beam search in the engine's step loop against transformers' `generate(num_beams=...)` on the same
random Llama weights, and against itself running alone; KV blocks shared, copied on write and freed."""

import pytest
import torch
import transformers
from test_engine_llm import assert_no_leaks, naive_greedy, pool_bytes, run

from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.checkpoint import to_hf_state_dict
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer

PROMPT_A = [5, 17, 33, 2, 9]
PROMPT_B = [40, 3, 3, 60, 12, 7, 1]


@pytest.fixture(scope="module")
def models():
    """Our tiny Llama and transformers' on the same weights (large enough to give peaked, varied
    distributions, so beams are never near ties)."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    ours.init_weights(std=0.3)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf())).eval()
    hf.load_state_dict(to_hf_state_dict(ours))
    return ours, hf


def hf_beams(hf, prompt, eos, max_tokens, **options):
    """transformers' returned beams (output tokens up to, not including, the EOS) and their scores."""
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos,
                      pad_token_id=0, output_scores=True, return_dict_in_generate=True, **options)
    stops = set(eos if isinstance(eos, list) else [eos])
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        beams.append(row[:ends[0]] if ends else row)
    return beams, out.sequences_scores.tolist()


def beam_search(model, prompt, params, eos=(), **config):
    """Our beams and scores for one request alone, and the engine (to check its blocks)."""
    engine = Engine(model, config=EngineConfig(**{"block_size": 4, "max_num_seqs": 8, **config}), eos_token_ids=eos)
    rid = engine.add_request(prompt, params)
    out = run(engine)[0][rid]
    return out, engine


# (prompt, EOS ids, max_tokens, num_beams, n, length_penalty, early_stopping); the EOS tokens end
# beams mid-way in all but the first; the last two differ only in early_stopping, and so do the results
CASES = [
    (PROMPT_A, [], 10, 4, 4, 1.0, False),  # no EOS: every beam runs to max_tokens
    (PROMPT_A, [31, 61], 12, 4, 4, 0.0, False),  # two stop tokens: 3 · num_beams candidates a step
    (PROMPT_B, [6], 10, 3, 3, 1.0, True),
    (PROMPT_B, [6], 10, 3, 2, 2.0, False),
    (PROMPT_B, [34], 10, 3, 3, -1.0, True),  # a negative penalty prefers short beams
    (PROMPT_B, [10], 24, 3, 3, 1.0, False),
    (PROMPT_B, [10], 24, 3, 3, 1.0, "never"),
]


@pytest.mark.parametrize("prompt,eos,max_tokens,num_beams,n,length_penalty,early_stopping", CASES)
def test_beams_and_scores_match_transformers(models, prompt, eos, max_tokens, num_beams, n, length_penalty,
                                             early_stopping):
    ours, hf = models
    want, want_scores = hf_beams(hf, prompt, eos or None, max_tokens, num_beams=num_beams, num_return_sequences=n,
                                 length_penalty=length_penalty, early_stopping=early_stopping)
    params = SamplingParams(max_tokens=max_tokens, num_beams=num_beams, n=n, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    out, engine = beam_search(ours, prompt, params, eos)
    assert [c.token_ids for c in out.outputs] == want
    assert [c.score for c in out.outputs] == pytest.approx(want_scores, rel=1e-6, abs=1e-5)
    assert [c.finish_reason for c in out.outputs] == ["length" if len(b) == max_tokens else "stop" for b in want]
    assert_no_leaks(engine)


def test_the_cases_exercise_stops_and_early_stopping(models):
    """EOS ends beams before max_tokens, and each early_stopping rule changes the answer somewhere
    (so the test above really checks each)."""
    ours, _ = models

    def beams(eos, max_tokens, early_stopping):
        params = SamplingParams(max_tokens=max_tokens, num_beams=3, n=3, early_stopping=early_stopping)
        return beam_search(ours, PROMPT_B, params, eos)[0].outputs

    def ids(outputs):
        return [c.token_ids for c in outputs]

    early, late = beams([6], 10, True), beams([10], 24, False)
    for outputs, max_tokens in ((early, 10), (late, 24)):
        assert any(c.finish_reason == "stop" and len(c.token_ids) < max_tokens for c in outputs)
    assert ids(early) != ids(beams([6], 10, False))
    assert ids(late) != ids(beams([10], 24, "never"))


def test_one_beam_is_greedy(models):
    ours, _ = models
    out, _ = beam_search(ours, PROMPT_A, SamplingParams(max_tokens=8, num_beams=1, temperature=0))
    assert out.token_ids == naive_greedy(ours, PROMPT_A, 8)


def test_beams_share_the_prompt_blocks_and_copy_the_partial_one(models):
    """After the first step the 4 beams reference the prompt's full block once each; the prompt's
    partly filled block is copied on the first write, never written while shared."""
    ours, _ = models
    engine = Engine(ours, config=EngineConfig(block_size=4, max_num_seqs=8))
    engine.add_request(PROMPT_B, SamplingParams(max_tokens=6, num_beams=4, ignore_eos=True))
    bm = engine.block_manager
    engine.step()  # prefill, then the first choice: 4 beams forked from the prompt
    beams = next(iter(engine.requests.values()))
    assert len(beams) == 4 and len({seq.block_table[0] for seq in beams}) == 1
    assert bm.ref_counts[beams[0].block_table[0]] == 4 and bm.ref_counts[beams[0].block_table[1]] == 4
    engine.step()  # every beam writes its first token into the shared partial block: 3 copy, the last keeps it
    assert bm.num_copies == 3
    run(engine)
    assert_no_leaks(engine)


def test_beam_request_batched_with_others_gives_its_solo_result(models):
    """A beam search next to greedy, sampled and beam requests under a small token budget and a small
    KV pool (sequences preempted and recomputed, a group split over steps) returns what it returns alone."""
    ours, _ = models
    beam_params = SamplingParams(max_tokens=16, num_beams=4, n=2, length_penalty=0.5)
    alone, _ = beam_search(ours, PROMPT_B, beam_params, [10])
    others = [(PROMPT_A, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)),
              ([7, 7, 8, 1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, temperature=0.9, seed=3, n=2)),
              (list(range(20, 50)), SamplingParams(max_tokens=12, num_beams=2, early_stopping=True))]
    # Which steps preempt depends on when the sampled request draws the end token (it frees its blocks);
    # this budget and pool give both a preemption and a split group for every seed from 0 to 7.
    engine = Engine(ours, config=EngineConfig(block_size=4, max_num_seqs=10, max_num_batched_tokens=13,
                                              kv_cache_bytes=pool_bytes(ours, 26)), eos_token_ids=[10])
    ids = [engine.add_request(p, params) for p, params in others[:2]]
    beam_id = engine.add_request(PROMPT_B, beam_params)
    ids.append(engine.add_request(*others[2]))
    finals, reports, split = {}, [], False
    while engine.has_unfinished():
        for out in engine.step():
            reports.append(out.request_id)
            if out.finished:
                finals[out.request_id] = out
        # a beam computed, waiting for a group mate the budget or a preemption held back
        split |= any(seq.beam is not None and not seq.num_pending_tokens for seq in engine.scheduler.running)
    assert engine.scheduler.num_preemptions > 0 and split
    got = finals[beam_id]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in alone.outputs]
    assert [c.score for c in got.outputs] == pytest.approx([c.score for c in alone.outputs], rel=1e-6, abs=1e-6)
    assert reports.count(beam_id) == 1  # reported once, when the search is over
    for rid, (prompt, params) in zip(ids, others):
        solo, _ = beam_search(ours, prompt, params, [10])
        assert [c.token_ids for c in finals[rid].outputs] == [c.token_ids for c in solo.outputs]
    assert_no_leaks(engine)


def test_prompt_logprobs_come_back_with_the_beams(models):
    ours, _ = models
    beams, _ = beam_search(ours, PROMPT_B, SamplingParams(max_tokens=3, num_beams=2, prompt_logprobs=1))
    scored, _ = beam_search(ours, PROMPT_B, SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert len(beams.prompt_logprobs) == len(PROMPT_B) and beams.prompt_logprobs == scored.prompt_logprobs


def test_abort_returns_the_live_beams_and_frees_their_blocks(models):
    ours, _ = models
    engine = Engine(ours, config=EngineConfig(block_size=4, max_num_seqs=8))
    rid = engine.add_request(PROMPT_A, SamplingParams(max_tokens=20, num_beams=3, ignore_eos=True))
    for _ in range(4):
        assert engine.step() == []  # nothing is reported while the search runs
    out = engine.abort(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) == 4 and c.score is None for c in out.outputs)  # one token a step
    assert_no_leaks(engine)


@pytest.mark.parametrize("options,match", [
    (dict(num_beams=2, n=3), "at most num_beams=2"),
    (dict(num_beams=2, top_k=5), "does not combine with top_k"),
    (dict(num_beams=2, stop=["x"], logprobs=1), "stop, logprobs"),
    (dict(num_beams=2, max_tokens=0), "max_tokens >= 1"),
    (dict(num_beams=0), "num_beams must be >= 1"),
    (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be"),
])
def test_bad_beam_settings_name_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**options)


def test_a_beam_search_that_cannot_fit_is_rejected(models):
    ours, _ = models
    engine = Engine(ours, config=EngineConfig(block_size=4, max_num_seqs=4, kv_cache_bytes=pool_bytes(ours, 10)))
    with pytest.raises(ValueError, match="beam search of 4 sequences of 17 tokens needs 16 KV blocks"):
        engine.add_request(PROMPT_A, SamplingParams(max_tokens=12, num_beams=4))
    with pytest.raises(ValueError, match="num_beams=5 beams cannot run at once with max_num_seqs=4"):
        engine.add_request(PROMPT_A, SamplingParams(max_tokens=2, num_beams=5))
