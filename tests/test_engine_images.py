"""Prompt embeddings (an image's features at its placeholder tokens) through the paged engine: the
engine's greedy tokens equal a dense, uncached forward over the same spliced embeddings — batched,
split across prefill chunks, recomputed after preemption, forked — and the prefix cache tells two
images apart behind the same placeholder tokens."""

import pytest
import torch
from test_engine_llm import assert_no_leaks, pool_bytes, run, tiny_model

from tokenmind.engine.config import EngineConfig, SpeculativeConfig
from tokenmind.engine.llm import LLM, Engine
from tokenmind.engine.model_runner import Chunk, overrides
from tokenmind.engine.sampling import SamplingParams
from tokenmind.engine.sequence import PromptEmbeds, Sequence
from tokenmind.model.config import ModelConfig
from tokenmind.model.load import Pretrained
from tokenmind.model.transformer import Transformer

IMAGE = 7  # the placeholder token id
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def dense_greedy(model, prompt, embeds, max_tokens):
    """Recompute everything each token with no cache: embed the ids, overwrite the given rows, run."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            x = model.embed(torch.tensor([ids]))
            for start, values in embeds:
                x[0, start:start + len(values)] = values
            token = int(model.logits(model.norm(model.run_layers(x)))[0, -1].argmax())
            ids.append(token)
            out.append(token)
    return out


def image_prompt(before, n, after, seed):
    """Random text tokens around n placeholder tokens, and random (n, hidden) features for them."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(10, 64, (before + after,), generator=g).tolist()
    return text[:before] + [IMAGE] * n + text[before:], [(before, torch.randn(n, 32, generator=g))]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def requests(model):
    """Four prompts with images of different lengths at different places (one with two images)."""
    cases = [image_prompt(3, 6, 4, 0), image_prompt(1, 9, 2, 1), image_prompt(5, 4, 7, 2)]
    ids, embeds = image_prompt(2, 5, 3, 3)
    second = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    cases.append((ids + [IMAGE] * 3 + [11], embeds + [(len(ids), second)]))
    return [(ids, embeds, dense_greedy(model, ids, embeds, GREEDY.max_tokens)) for ids, embeds in cases]


@pytest.mark.parametrize("case", ["roomy", "chunked", "preemption"])
def test_batched_images_equal_a_dense_forward_over_the_spliced_embeddings(model, requests, case):
    options = {"roomy": {},
               "chunked": {"max_num_batched_tokens": 4},  # every image is split over steps
               "preemption": {"kv_cache_bytes": pool_bytes(model, 12)}}[case]
    engine = Engine(model, config=EngineConfig(**{"block_size": 4, "max_num_seqs": 4, **options}))
    rids = [engine.add_request(ids, GREEDY, prompt_embeds=embeds) for ids, embeds, _ in requests]
    finals, _ = run(engine)
    assert [finals[r].token_ids for r in rids] == [ref for _, _, ref in requests]
    if case == "preemption":
        assert engine.stats().num_preemptions > 0
    assert_no_leaks(engine)


def test_the_images_change_the_answer(model, requests):
    """Without its features (the placeholder tokens alone) a prompt is answered otherwise, so the
    comparison above can fail."""
    plain = LLM(Pretrained(model, None, None), block_size=4).generate([ids for ids, _, _ in requests], GREEDY)
    assert [out.token_ids for out in plain] != [ref for _, _, ref in requests]


def test_a_split_override_lands_on_the_right_rows(model):
    """Two chunks that each cover part of one image get its rows at their own offsets."""
    ids, [(start, values)] = image_prompt(3, 6, 2, 5)
    seq = Sequence("r", ids, GREEDY, set(), 64)
    seq.embeds = [PromptEmbeds(start, values)]
    other = Sequence("s", [1, 2, 3], GREEDY, set(), 64)
    rows, parts = overrides([Chunk(other, [1, 2, 3], 0), Chunk(seq, ids[:5], 0), Chunk(seq, ids[5:], 5)])
    assert rows == [3 + 3, 3 + 4] + [8 + 0, 8 + 1, 8 + 2, 8 + 3]
    assert torch.equal(torch.cat(parts), values)


def test_prefix_cache_hits_the_same_image_and_misses_another(model):
    """Same text and image again: its blocks come from the cache. Same placeholder tokens with another
    image: only the blocks before the image are shared, and the answer is that image's."""
    ids, embeds = image_prompt(4, 8, 5, 6)  # text in block 0, the image fills blocks 1 and 2
    other = [(4, torch.randn(8, 32, generator=torch.Generator().manual_seed(7)))]
    engine = Engine(model, config=EngineConfig(block_size=4))
    outputs = []
    for e in (embeds, embeds, other):
        rid = engine.add_request(ids, GREEDY, prompt_embeds=e)
        outputs.append(run(engine)[0][rid])
    assert outputs[0].num_cached_tokens == 0
    assert outputs[1].num_cached_tokens == 16  # the 4 full blocks before the last token's
    assert outputs[2].num_cached_tokens == 4  # the text before the image only
    assert outputs[1].token_ids == outputs[0].token_ids == dense_greedy(model, ids, embeds, GREEDY.max_tokens)
    assert outputs[2].token_ids == dense_greedy(model, ids, other, GREEDY.max_tokens)
    # a caller's own key (the server: a digest of the image bytes) stands for the tensor
    keyed = [PromptEmbeds(4, embeds[0][1], key=b"image-a")]
    for cached in (4, 16):  # the text block is cached already; the image blocks the second time
        rid = engine.add_request(ids, GREEDY, prompt_embeds=keyed)
        assert run(engine)[0][rid].num_cached_tokens == cached


def test_forked_completions_share_the_image(model, requests):
    ids, embeds, ref = requests[0]
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, n=3, ignore_eos=True)
    out = LLM(Pretrained(model, None, None), block_size=4).generate([ids], params, prompt_embeds=[embeds])[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3


def test_a_draft_model_drafts_from_the_placeholders_and_the_target_decides(model, requests):
    """Speculative decoding with a draft model of another width: the draft reads the token ids, the
    target verifies with the image, so the output is the target's."""
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(1)
    draft = Transformer(cfg).eval()
    engine = Engine(model, config=EngineConfig(block_size=4, speculative=SpeculativeConfig("draft", 3)),
                    draft_model=draft)
    rids = [engine.add_request(ids, GREEDY, prompt_embeds=embeds) for ids, embeds, _ in requests]
    finals, _ = run(engine)
    assert [finals[r].token_ids for r in rids] == [ref for _, _, ref in requests]
    assert engine.num_drafted > 0


@pytest.mark.parametrize("embeds, match", [
    ([(0, torch.zeros(2, 16))], "hidden size 32"),
    ([(4, torch.zeros(3, 32))], "run past the prompt"),
    ([(0, torch.zeros(3, 32)), (2, torch.zeros(2, 32))], "overlap at positions 2..2"),
    ([(0, torch.zeros(32))], r"must be \(n, hidden\)"),
    ([(-1, torch.zeros(2, 32))], "position >= 0"),
])
def test_bad_prompt_embeddings_are_rejected_with_the_fix(model, embeds, match):
    engine = Engine(model, config=EngineConfig(block_size=4))
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2, 3, 4, 5, 6], GREEDY, prompt_embeds=embeds)
    assert not engine.has_unfinished()
