"""The packing loader: row contents, document ids/positions, determinism, resume, ranks."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tokenmind.data.loader import LoaderConfig, PackedLoader, TokenBatch
from tokenmind.data.shards import ShardConfig, ShardWriter, TokenShards

EOS = 0
SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenShards, np.ndarray, np.ndarray]:
    """Shards of 120 random documents, plus the expected stream and per-token document index."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, size=rng.integers(1, 30)) for _ in range(120)]
    directory = tmp_path_factory.mktemp("shards")
    with ShardWriter(directory, vocab_size=500, eos_token_id=EOS, cfg=ShardConfig(tokens_per_shard=300)) as writer:
        for doc in docs:
            writer.add(doc)
    stream = np.concatenate([np.append(doc, EOS) for doc in docs])
    doc_of_token = np.concatenate([np.full(len(doc) + 1, i) for i, doc in enumerate(docs)])
    return TokenShards(directory), stream, doc_of_token


def loader(shards: TokenShards, **overrides: object) -> PackedLoader:
    cfg = {"batch_size": 4, "seq_len": SEQ, "seed": 0, **overrides}
    return PackedLoader(shards, LoaderConfig(**cfg))  # type: ignore[arg-type]


def take(it: PackedLoader, count: int) -> list[TokenBatch]:
    return [next(it) for _ in range(count)]


def assert_same(a: list[TokenBatch], b: list[TokenBatch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name, tensor in vars(x).items():
            assert torch.equal(tensor, getattr(y, name)), name


def test_rows_are_stream_windows_with_shifted_targets(corpus) -> None:
    shards, stream, _ = corpus
    it = loader(shards)
    batch = next(it)
    assert all(t.shape == (4, SEQ) and t.dtype == torch.int64 for t in vars(batch).values())
    for row, index in zip(range(4), it.rows_for_epoch(0)[:4]):
        window = stream[index * SEQ : index * SEQ + SEQ + 1]
        np.testing.assert_array_equal(batch.input_ids[row].numpy(), window[:-1])
        np.testing.assert_array_equal(batch.targets[row].numpy(), window[1:])
    assert it.num_rows == (len(stream) - 1) // SEQ


def test_doc_ids_and_positions_restart_at_document_boundaries(corpus) -> None:
    shards, _, doc_of_token = corpus
    it = loader(shards, shuffle=False, batch_size=8)
    for batch_index in range(3):
        batch = next(it)
        for row in range(8):
            start = (batch_index * 8 + row) * SEQ
            docs = doc_of_token[start : start + SEQ]
            np.testing.assert_array_equal(batch.document_ids[row].numpy(), docs - docs[0])
            expected_positions = []
            for t in range(SEQ):
                new_segment = t == 0 or docs[t] != docs[t - 1]
                expected_positions.append(0 if new_segment else expected_positions[-1] + 1)
            np.testing.assert_array_equal(batch.positions[row].numpy(), expected_positions)
            # A new document starts exactly after each eos input.
            inputs = batch.input_ids[row].numpy()
            starts = np.flatnonzero(np.diff(batch.document_ids[row].numpy())) + 1
            np.testing.assert_array_equal(starts, np.flatnonzero(inputs[:-1] == EOS) + 1)


def test_same_seed_same_batches_other_seed_other_order(corpus) -> None:
    shards, _, _ = corpus
    assert_same(take(loader(shards, seed=3), 5), take(loader(shards, seed=3), 5))
    assert not np.array_equal(loader(shards, seed=3).rows_for_epoch(0), loader(shards, seed=4).rows_for_epoch(0))


def test_each_epoch_is_a_new_permutation_of_all_rows(corpus) -> None:
    shards, _, _ = corpus
    it = loader(shards)
    first, second = it.rows_for_epoch(0), it.rows_for_epoch(1)
    assert sorted(first) == sorted(second) == list(range(it.num_rows))
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("consumed", [0, 3, 27, 56, 60])
def test_resume_from_state_gives_identical_next_batches(corpus, consumed: int) -> None:
    shards, _, _ = corpus
    uninterrupted = loader(shards, batch_size=4)
    assert uninterrupted.batches_per_epoch == 28  # so 27 and 60 resume into a new epoch
    take(uninterrupted, consumed)
    state = uninterrupted.state_dict()
    expected = take(uninterrupted, 12)

    resumed = loader(shards, batch_size=4)
    resumed.load_state_dict(state)
    assert_same(take(resumed, 12), expected)


def test_state_from_a_different_setup_is_refused(corpus) -> None:
    shards, _, _ = corpus
    state = loader(shards, batch_size=4).state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 4, now 2"):
        loader(shards, batch_size=2).load_state_dict(state)


def test_ranks_get_disjoint_rows_and_equal_counts(corpus) -> None:
    shards, stream, _ = corpus
    world = 3
    ranks = [loader(shards, rank=rank, world_size=world, batch_size=2) for rank in range(world)]
    for epoch in (0, 1):
        rows = [set(r.rows_for_epoch(epoch).tolist()) for r in ranks]
        assert len({len(r) for r in rows}) == 1 and len(rows[0]) == ranks[0].num_rows // world
        assert not rows[0] & rows[1] and not rows[0] & rows[2] and not rows[1] & rows[2]
    batches = [next(r) for r in ranks]
    for rank, batch in zip(ranks, batches):
        index = rank.rows_for_epoch(0)[0]
        np.testing.assert_array_equal(batch.input_ids[0].numpy(), stream[index * SEQ : index * SEQ + SEQ])
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == ranks[2].batches_per_epoch


def test_config_and_size_errors(corpus) -> None:
    shards, _, _ = corpus
    with pytest.raises(ValueError, match="rank must be in"):
        LoaderConfig(batch_size=1, seq_len=8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="too few"):
        loader(shards, batch_size=1000)
