"""Paged attention (block pool + block tables) gives the same logits as the plain forward pass."""

import sys

import pytest
import torch

from tokenmind.model.config import ModelConfig
from tokenmind.model.paged_attention import PagedAttentionMetadata, PagedKVCache
from tokenmind.model.transformer import Transformer

BLOCK = 4


def tiny(**kw):
    cfg = ModelConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), **kw})
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    m.init_weights(std=0.3)
    return m


class Pool:
    """Hands out blocks in a scrambled order so block tables are never contiguous (or in order, to
    exercise the view path)."""

    def __init__(self, n, in_order=False):
        self.free = list(range(n - 1, -1, -1)) if in_order else \
            torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()

    def table(self, length):
        return [self.free.pop() for _ in range(-(-length // BLOCK))]


def run_step(model, cache, seqs, chunks):
    """seqs: list of (tokens, table); chunks: per seq (start, end) of tokens to feed this step."""
    ids, pos, slots, starts, lens = [], [], [], [0], []
    for (tokens, table), (a, b) in zip(seqs, chunks):
        ids += tokens[a:b]
        pos += list(range(a, b))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(a, b)]
        starts.append(len(ids))
        lens.append(b)
    width = max(len(t) for _, t in seqs)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, t in seqs])
    meta = PagedAttentionMetadata(torch.tensor(slots), starts, lens, tables)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.tensor([pos]), kv_cache=cache, attn=meta)[0]
    return [logits[starts[i]:starts[i + 1]] for i in range(len(seqs))]


MLA = {"model_type": "deepseek_v3", "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "rope_interleave": True}


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5}, {"attn_logit_softcapping": 3.0},
                                {"num_key_value_heads": 1}, MLA])  # MLA: absorbed over latents == expanded
def test_chunked_prefill_and_batched_decode_match_full_forward(kw, in_order):
    model = tiny(**kw)
    cache = PagedKVCache(model.cfg, num_blocks=40, block_size=BLOCK)
    pool = Pool(40, in_order)
    g = torch.Generator().manual_seed(1)
    lengths = [13, 6, 9]
    tokens = [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]
    seqs = [(t, pool.table(len(t))) for t in tokens]
    # Step 1: chunked prefill of different sizes; step 2: the rest of the prompts;
    # then decode steps where every sequence adds one token, contexts of different lengths.
    got = [[] for _ in seqs]
    prefill_a = [7, 2, 3]  # each <= length - 3: the last 3 tokens are decode steps
    schedule = [[(0, p) for p in prefill_a], [(p, n - 3) for p, n in zip(prefill_a, lengths)]]
    schedule += [[(n - 3 + s, n - 2 + s) for n in lengths] for s in range(3)]
    for chunks in schedule:
        active = [i for i, (a, b) in enumerate(chunks) if b > a]
        out = run_step(model, cache, [seqs[i] for i in active], [chunks[i] for i in active])
        for i, o in zip(active, out):
            got[i].append(o)
    for i, t in enumerate(tokens):
        with torch.no_grad():
            ref = model(torch.tensor([t]))[0]
        assert (torch.cat(got[i]) - ref).abs().max().item() <= 1e-5


def test_consecutive_blocks_are_read_as_a_view():
    meta = PagedAttentionMetadata(torch.tensor([0]), [0, 1, 3], [9, 6], torch.tensor([[4, 5, 6, 0], [7, 2, 0, 0]]))
    assert meta.run_start(0, BLOCK) == 4 and meta.run_start(1, BLOCK) is None
    k = torch.randn(10, BLOCK, 2, 3)
    from tokenmind.model.paged_attention import _gather

    table = torch.tensor([4, 5, 6])
    assert torch.equal(_gather(k, table, 9, run=4), _gather(k, table, 9, run=None))
    assert _gather(k, table, 9, run=4).data_ptr() == k[4].data_ptr()  # no copy


def test_copy_block_duplicates_every_layer():
    model = tiny()
    cache = PagedKVCache(model.cfg, num_blocks=4, block_size=BLOCK)
    cache.k[:, 1].normal_()
    cache.v[:, 1].normal_()
    cache.copy_block(1, 3)
    assert torch.equal(cache.k[:, 3], cache.k[:, 1]) and torch.equal(cache.v[:, 3], cache.v[:, 1])


def test_paged_needs_positions_and_pool():
    model = tiny()
    meta = PagedAttentionMetadata(torch.tensor([0]), [0, 1], [1], torch.tensor([[0]]))
    with pytest.raises(ValueError, match="explicit positions"):
        model(torch.tensor([[1]]), kv_cache=PagedKVCache(model.cfg, 2, BLOCK), attn=meta)


def resident_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unused_block_pool_costs_no_resident_memory(dtype):
    """A 512 MiB pool (k + v) is zeros that become resident only where k/v are written."""
    cfg = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4)
    per_block = PagedKVCache.bytes_per_block(cfg, 16, dtype)
    before = resident_bytes()
    cache = PagedKVCache(cfg, (512 << 20) // per_block, 16, dtype=dtype)
    assert resident_bytes() - before < 32 << 20
    assert cache.k.dtype == dtype and not cache.k[:, :3].any() and not cache.v[:, -3:].any()
    cache.k_layer_slots[1].index_copy_(1, torch.tensor([5]), torch.ones(1, 1, 4, 64, dtype=dtype))
    cache.copy_block(0, 7)  # the pool is ordinary writable memory
    assert cache.k[1, 7, 5].eq(1).all() and int(cache.k.count_nonzero()) == 2 * 4 * 64
