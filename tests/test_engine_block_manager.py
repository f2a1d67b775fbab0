"""BlockManager: reference counts, the free list, prefix caching, copy-on-write and LRU eviction."""

from tokenmind.engine.block_manager import BlockManager
from tokenmind.engine.sampling import SamplingParams
from tokenmind.engine.sequence import Sequence

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(temperature=0), set(), max_len=1000)


def prefilled(bm, tokens, rid="r"):
    """A sequence allocated and with its whole prompt computed (as after its prefill step)."""
    s = seq(tokens, rid)
    bm.allocate(s)
    bm.mark_computed(s, s.num_pending_tokens)
    return s


def test_allocate_and_free_keep_counts_exact():
    bm = BlockManager(8, BS)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert [bm.ref_counts[b] for b in a.block_table] == [1, 1, 1]
    assert bm.usage == 3 / 8
    assert not bm.can_allocate(seq(range(100, 124)))  # 6 blocks > 5 free
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_append_slot_adds_a_block_at_the_boundary():
    bm = BlockManager(4, BS)
    a = prefilled(bm, range(8))  # two full blocks, all computed
    a.append_token(9)  # the 9th token starts a third block
    assert bm.can_append(a, 1)
    bm.append_slots(a, 1)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    a.append_token(10)  # no allocation until the 13th token
    bm.mark_computed(a, 1)
    bm.append_slots(a, 1)
    assert len(a.block_table) == 3


def test_prefix_hit_on_a_shared_system_prompt():
    bm = BlockManager(16, BS)
    system = list(range(100, 112))  # 3 full blocks
    a = prefilled(bm, system + [1, 2, 3])
    b = seq(system + [7, 8], "b")
    bm.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 12  # b computes 2 tokens instead of 14
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 2, 1]
    assert bm.prefix_hit_rate == 12 / (15 + 14)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16  # cached blocks count as free: they can be evicted
    c = seq(system + [9], "c")
    bm.allocate(c)
    assert c.num_cached_tokens == 12  # still cached after both finished


def test_the_last_token_is_always_computed():
    bm = BlockManager(8, BS)
    prefilled(bm, range(8))
    again = seq(range(8), "again")  # the same 8 tokens: 2 full blocks
    bm.allocate(again)
    assert again.num_computed_tokens == 4  # only the first block: the 8th token must give logits
    assert again.num_pending_tokens == 4


def test_a_different_earlier_block_breaks_the_chain():
    bm = BlockManager(8, BS)
    prefilled(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    other = seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "other")  # same second block, different first
    bm.allocate(other)
    assert other.num_cached_tokens == 0


def test_copy_on_write_when_a_shared_block_is_written():
    copies = []
    bm = BlockManager(8, BS, copy_block=lambda src, dst: copies.append((src, dst)))
    parent = prefilled(bm, range(6))  # block 1 holds tokens 4, 5 and has room
    child = parent.fork(1)
    bm.fork(parent, child)
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    shared = parent.block_table[1]
    parent.append_token(60)
    child.append_token(61)
    assert bm.can_append(parent, 1)
    bm.append_slots(parent, 1)  # writes position 6 into the shared block → copy first
    assert copies == [(shared, parent.block_table[1])] and parent.block_table[1] != shared
    assert bm.ref_counts[shared] == 1 and bm.ref_counts[parent.block_table[0]] == 2
    bm.append_slots(child, 1)  # now the only owner: writes in place
    assert child.block_table[1] == shared and len(copies) == 1
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_can_append_counts_the_copy():
    bm = BlockManager(2, BS, copy_block=lambda s, d: None)
    parent = prefilled(bm, range(2))
    child = parent.fork(1)
    bm.fork(parent, child)
    parent.append_token(9)
    assert bm.can_append(parent, 1)  # one free block for the copy
    bm.append_slots(parent, 1)
    child.append_token(9)
    assert bm.can_append(child, 1)  # sole owner now: no copy needed
    assert bm.num_free_blocks == 0


def test_lru_evicts_the_least_recently_freed_cached_block():
    bm = BlockManager(6, BS)
    a = prefilled(bm, range(9), "a")  # 2 full (cached) blocks + 1 partial
    b = prefilled(bm, range(50, 55), "b")  # 1 full (cached) block + 1 partial
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)  # b after a: b's blocks are the more recently used
    assert set(bm.cached.values()) == {a_blocks[0], a_blocks[1], b_blocks[0]}
    c = seq(range(200, 213), "c")
    bm.allocate(c)  # 4 blocks: 3 never-cached ones, then 1 eviction
    assert bm.num_evictions == 1
    # a's tail went first (a sequence frees its tail before its head), b's block is untouched
    assert set(bm.cached.values()) == {a_blocks[0], b_blocks[0]}
    bm.allocate(seq(range(300, 304), "d"))
    assert set(bm.cached.values()) == {b_blocks[0]}  # a was freed before b
    bm.free(c)  # never computed: nothing of it is cached
    b2 = seq(range(50, 55), "b2")
    bm.allocate(b2)
    assert b2.num_cached_tokens == 4 and b2.block_table[0] == b_blocks[0]
    assert bm.num_evictions == 2


def test_disabled_prefix_caching_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = prefilled(bm, range(9))
    bm.free(a)
    again = seq(range(9))
    bm.allocate(again)
    assert again.num_cached_tokens == 0 and bm.prefix_hit_rate == 0.0
