"""Token shards: round trip, dtypes, shard boundaries, splits, and crash safety."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenmind.data import shards as shards_module
from tokenmind.data.shards import MANIFEST_NAME, ShardConfig, ShardWriter, TokenShards, token_dtype

EOS = 0


def random_docs(count: int, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, size=rng.integers(1, 40)) for _ in range(count)]


def write(directory: Path, docs: list[np.ndarray], vocab_size: int = 300, **cfg: object) -> dict:
    with ShardWriter(
        directory, vocab_size=vocab_size, eos_token_id=EOS, tokenizer={"name": "test"}, cfg=ShardConfig(**cfg)
    ) as writer:
        for doc in docs:
            writer.add(doc)
    assert writer.manifest is not None
    return writer.manifest


def final_files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def test_token_dtype() -> None:
    assert token_dtype(257) == np.uint16
    assert token_dtype(65_536) == np.uint16  # ids 0..65535 still fit
    assert token_dtype(65_537) == np.uint32


@pytest.mark.parametrize("vocab_size", [300, 70_000])
def test_round_trip_equals_tokenization(tmp_path: Path, vocab_size: int) -> None:
    docs = random_docs(50, vocab_size)
    manifest = write(tmp_path, docs, vocab_size=vocab_size, tokens_per_shard=200)
    shards = TokenShards(tmp_path)
    assert shards.dtype == token_dtype(vocab_size)
    assert len(shards) == 50 and len(manifest["splits"]["train"]["shards"]) > 1
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(shards.document(i), doc)
        assert shards.document(i, include_eos=True)[-1] == EOS
    stream = np.concatenate([np.append(doc, EOS) for doc in docs])
    np.testing.assert_array_equal(shards.read(0, shards.num_tokens), stream)
    np.testing.assert_array_equal(shards.read(190, 30), stream[190:220])  # across a shard boundary
    assert shards.num_tokens == manifest["total_tokens"] == len(stream)


def test_shards_respect_size_and_never_split_documents(tmp_path: Path) -> None:
    docs = [np.full(30, 5), np.full(30, 6), np.full(30, 7), np.full(150, 8), np.full(10, 9)]
    manifest = write(tmp_path, docs, tokens_per_shard=64)
    sizes = [(s["tokens"], s["documents"]) for s in manifest["splits"]["train"]["shards"]]
    assert sizes == [(62, 2), (31, 1), (151, 1), (11, 1)]  # an oversized document gets its own shard
    assert final_files(tmp_path) == [MANIFEST_NAME] + [
        f"train/shard_{k:05d}.{ext}" for k in range(4) for ext in ("bin", "idx.npy")
    ]
    offsets = np.load(tmp_path / "train" / "shard_00000.idx.npy")
    np.testing.assert_array_equal(offsets, [0, 31, 62])


def test_manifest_contents(tmp_path: Path) -> None:
    write(tmp_path, random_docs(5, 300), tokens_per_shard=1000)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 300
    assert manifest["eos_token_id"] == EOS and manifest["tokenizer"] == {"name": "test"}
    assert manifest["documents"] == 5 and manifest["tokens_per_shard"] == 1000
    assert list(manifest["splits"]) == ["train"]


def test_exception_mid_write_leaves_no_final_named_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, vocab_size=300, eos_token_id=EOS) as writer:
            writer.add(np.arange(1, 20))
            writer.add(np.arange(1, 20))
            raise RuntimeError("boom")
    assert final_files(tmp_path) == []  # no shard, no temporary file, no manifest


def test_exception_keeps_committed_shards_and_drops_the_partial_one(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(tmp_path, vocab_size=300, eos_token_id=EOS, cfg=ShardConfig(tokens_per_shard=25)) as writer:
            writer.add(np.arange(1, 20))
            writer.add(np.arange(1, 20))  # shard 0 is committed here
            raise KeyboardInterrupt
    assert final_files(tmp_path) == ["train/shard_00000.bin", "train/shard_00000.idx.npy"]
    assert (tmp_path / "train" / "shard_00000.bin").stat().st_size == 20 * 2


def test_crash_while_committing_a_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    writer = ShardWriter(tmp_path, vocab_size=300, eos_token_id=EOS, cfg=ShardConfig(tokens_per_shard=25))
    with pytest.raises(OSError, match="disk full"):
        with writer:
            writer.add(np.arange(1, 20))  # shard 0 in progress
            monkeypatch.setattr(shards_module.np, "save", failing_save)
            writer.add(np.arange(1, 20))  # overflows: shard 0 is committed, and np.save fails
    assert final_files(tmp_path) == []  # nothing committed, temporary files cleaned up
    with pytest.raises(FileNotFoundError, match="never finished"):
        TokenShards(tmp_path)


def test_val_tokens_holds_out_the_tail(tmp_path: Path) -> None:
    docs = random_docs(40, 300, seed=1)
    write(tmp_path, docs, val_tokens=100)
    train, val = TokenShards(tmp_path, "train"), TokenShards(tmp_path, "val")
    assert len(train) + len(val) == 40
    lengths = [len(doc) + 1 for doc in docs]
    assert val.num_tokens >= 100 and val.num_tokens - lengths[len(train)] < 100  # minimal tail
    for i in range(len(val)):
        np.testing.assert_array_equal(val.document(i), docs[len(train) + i])


def test_val_fraction_is_a_deterministic_partition(tmp_path: Path) -> None:
    docs = random_docs(400, 300, seed=2)
    write(tmp_path / "a", docs, val_fraction=0.2)
    write(tmp_path / "b", docs, val_fraction=0.2)
    train, val = TokenShards(tmp_path / "a", "train"), TokenShards(tmp_path / "a", "val")
    assert 50 <= len(val) <= 110 and len(train) + len(val) == 400
    val_docs = {tuple(val.document(i)) for i in range(len(val))}
    train_docs = {tuple(train.document(i)) for i in range(len(train))}
    assert not val_docs & train_docs
    assert (tmp_path / "a" / "val" / "shard_00000.bin").read_bytes() == (
        tmp_path / "b" / "val" / "shard_00000.bin"
    ).read_bytes()


def test_a_small_corpus_still_gets_a_val_document(tmp_path: Path) -> None:
    """With 5 documents and a 1e-6 fraction the hash picks none; the last one becomes val."""
    docs = random_docs(5, 300, seed=3)
    manifest = write(tmp_path / "five", docs, val_fraction=1e-6)
    train, val = TokenShards(tmp_path / "five", "train"), TokenShards(tmp_path / "five", "val")
    assert manifest["splits"]["val"]["documents"] == 1
    np.testing.assert_array_equal(val.document(0), docs[-1])
    for i, doc in enumerate(docs[:-1]):  # the rest, in order
        np.testing.assert_array_equal(train.document(i), doc)
    lone = write(tmp_path / "one", docs[:1], val_fraction=1e-6)  # nothing to spare: it trains
    assert set(lone["splits"]) == {"train"}


def test_invalid_inputs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        ShardConfig(val_tokens=10, val_fraction=0.1)
    with ShardWriter(tmp_path, vocab_size=300, eos_token_id=EOS) as writer:
        with pytest.raises(ValueError, match=r"out of range \[0, 300\)"):
            writer.add([5, 300])
        with pytest.raises(ValueError, match="integer token ids"):
            writer.add([[1, 2]])
        writer.add([1, 2, 3])
    with pytest.raises(FileExistsError, match="already exists"):
        ShardWriter(tmp_path, vocab_size=300, eos_token_id=EOS)
    with pytest.raises(KeyError, match="no 'val' split"):
        TokenShards(tmp_path, "val")
    with pytest.raises(ValueError, match="fewer than val_tokens"):
        write(tmp_path / "small", random_docs(3, 300), val_tokens=10_000)
    assert not (tmp_path / "small" / MANIFEST_NAME).exists()


def test_truncated_shard_is_detected(tmp_path: Path) -> None:
    write(tmp_path, random_docs(10, 300))
    bin_path = tmp_path / "train" / "shard_00000.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="corrupt shard"):
        TokenShards(tmp_path)
