"""Scheduler logic without a model: FCFS admission, the token budget, joining and leaving, preemption."""

import random

import pytest

from tokenmind.engine.block_manager import BlockManager
from tokenmind.engine.config import EngineConfig
from tokenmind.engine.sampling import SamplingParams
from tokenmind.engine.scheduler import Scheduler
from tokenmind.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, **options):
    cfg = EngineConfig(**{"block_size": BS, "max_num_seqs": 4, "max_num_batched_tokens": 16, **options})
    bm = BlockManager(num_blocks, BS, cfg.enable_prefix_caching)
    return Scheduler(cfg, bm), bm


def seq(rid, n, first=0):
    return Sequence(rid, list(range(first, first + n)), SamplingParams(temperature=0), set(), max_len=1000)


def fake_step(sched, bm, batch, max_new=None):
    """What the engine does after the forward pass: mark computed, 'sample' a token, finish."""
    for s, n in batch:
        bm.mark_computed(s, n)
    for s, n in batch:
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(1)
            if max_new is not None and s.num_output_tokens >= max_new:
                sched.finish(s)


def test_fcfs_admission_and_budget():
    sched, bm = make()
    seqs = [seq(str(i), n) for i, n in enumerate([5, 6, 9, 2])]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("0", 5), ("1", 6), ("2", 5)]  # 16 tokens: "2" is chunked
    assert [s.request_id for s in sched.running] == ["0", "1", "2"] and list(sched.waiting) == [seqs[3]]
    fake_step(sched, bm, batch)
    batch = sched.schedule()  # decodes first, then the rest of "2", then "3"
    assert [(s.request_id, n) for s, n in batch] == [("0", 1), ("1", 1), ("2", 4), ("3", 2)]


def test_budget_and_seq_limit_hold_every_step():
    rng = random.Random(0)
    sched, bm = make(num_blocks=40, max_num_seqs=5, max_num_batched_tokens=12)
    for i in range(12):
        sched.add(seq(str(i), rng.randint(1, 30), first=100 * i))
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch and sum(n for _, n in batch) <= 12
        assert len(sched.running) <= 5 and len(batch) == len({s.request_id for s, _ in batch})
        fake_step(sched, bm, batch, max_new=6)
        steps += 1
    assert steps < 200
    assert bm.num_free_blocks == 40 and not any(bm.ref_counts)


def test_new_requests_join_at_the_next_step_and_finished_ones_leave_at_once():
    sched, bm = make()
    a = seq("a", 3)
    sched.add(a)
    fake_step(sched, bm, sched.schedule())
    b = seq("b", 4, first=50)
    sched.add(b)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch] == [("a", 1), ("b", 4)]
    fake_step(sched, bm, batch)
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert [s.request_id for s, _ in sched.schedule()] == ["b"]


def test_waiting_request_can_be_finished_too():
    sched, bm = make(max_num_seqs=1)
    a, b = seq("a", 3), seq("b", 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b)  # aborted while still queued
    assert not sched.waiting and b.status is SequenceStatus.FINISHED


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    sched, bm = make(num_blocks=4, enable_prefix_caching=False)
    a, b = seq("a", 4), seq("b", 4, first=20)  # one full block each
    sched.add(a)
    sched.add(b)
    fake_step(sched, bm, sched.schedule())  # both prefilled; 2 blocks left
    fake_step(sched, bm, sched.schedule())  # both decode into a second block: pool full
    for s in (a, b):  # fill the second blocks: 4 + 4 tokens
        for _ in range(3):
            s.append_token(2)
        bm.mark_computed(s, s.num_pending_tokens - 1)
    batch = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert [s.request_id for s, _ in batch] == ["a"]
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_tokens == 9  # its generated tokens are kept, to be recomputed with the prompt
    sched.finish(a)
    batch = sched.schedule()
    assert batch == [(b, 9)]  # readmitted: prompt + output recomputed in one go


@pytest.mark.parametrize("caching", [False, True])
def test_the_newest_preempts_itself_when_older_ones_hold_the_blocks(caching):
    sched, bm = make(num_blocks=3, enable_prefix_caching=caching)
    a, b = seq("a", 4), seq("b", 4, first=10)
    sched.add(a)
    sched.add(b)
    fake_step(sched, bm, sched.schedule())  # one block each; both now need a second one, 1 is free
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch] == ["a"]  # b could not grow: it is the newest, so it yields
    assert list(sched.waiting) == [b] and not sched.running[1:] and sched.num_preemptions == 1
    fake_step(sched, bm, batch)
    sched.finish(a)
    assert sched.schedule() == [(b, 1 if caching else 5)]  # its computed full block may still be cached


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched, bm = make(enable_chunked_prefill=False, max_num_batched_tokens=10)
    a, b = seq("a", 6), seq("b", 6, first=20)
    sched.add(a)
    sched.add(b)
    assert [(s.request_id, n) for s, n in sched.schedule()] == [("a", 6)]


def test_siblings_of_an_n_request_reserve_their_seats():
    sched, bm = make(max_num_seqs=3)
    parent = Sequence("p", list(range(10)), SamplingParams(n=3, temperature=0), set(), max_len=1000)
    sched.add(parent)
    sched.add(seq("o", 2, first=50))
    assert sched.schedule() == [(parent, 10)]  # budget is left, but the 3 seats are the parent's family
