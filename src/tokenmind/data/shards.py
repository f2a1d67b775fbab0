"""Token shards: the on-disk format between tokenization and training.

A split (`train`, optionally `val`) is a folder of shards. Shard k is two files:

* `shard_{k:05d}.bin`: the token ids of its documents back to back, each document followed by
  the tokenizer's end-of-sequence id, as a raw little-endian array (uint16 when every id fits,
  else uint32). Raw arrays can be memory-mapped, so training reads only the pages it touches.
* `shard_{k:05d}.idx.npy`: int64 offsets of document starts within the shard, plus a final
  entry equal to the shard's length, so document i is `tokens[idx[i]:idx[i + 1]]` (eos
  included as its last token). Documents never span shards.

`manifest.json` at the top describes everything (dtype, vocabulary size, eos id, tokenizer
identity, per-shard and total counts) and is written last: it is the commit record. Every
file is written under a temporary name, flushed to disk, then `os.replace`d into place, which
is atomic, so a crash can leave complete files or temporary ones but never a truncated file
under a final name, and a folder without a manifest is never mistaken for a finished dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "tokenmind.token_shards"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size - 1) fits in 16 bits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass
class ShardConfig:
    """tokens_per_shard: target shard size (a shard closes before a document would overflow
    it; a single larger document gets a shard of its own).
    val_tokens: hold out the last documents of the stream, at least this many tokens, as `val`.
    val_fraction: instead, hold out this fraction of documents, chosen by a hash of their
        tokens (deterministic, spread over the whole corpus, stable under reordering). A small
        corpus where the hash picks none still gets one: its last training document."""

    tokens_per_shard: int = 100_000_000
    val_tokens: int = 0
    val_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens_per_shard < 1:
            raise ValueError(f"tokens_per_shard must be >= 1, got {self.tokens_per_shard}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_tokens < 0:
            raise ValueError(f"val_tokens must be >= 0, got {self.val_tokens}")
        if self.val_tokens and self.val_fraction:
            raise ValueError("Set val_tokens or val_fraction, not both")


def _replace_durably(temporary: Path, final: Path) -> None:
    """Atomically rename into place, then fsync the folder so the rename survives power loss."""
    os.replace(temporary, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _SplitWriter:
    """Writes the shards of one split, one open temporary .bin file at a time."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, tokens_per_shard: int) -> None:
        self.root, self.split, self.dtype = root, split, dtype
        self.tokens_per_shard = tokens_per_shard
        self.shards: list[dict[str, Any]] = []
        self._handle: BinaryIO | None = None
        self._offsets: list[int] = []

    def _paths(self) -> tuple[Path, Path]:
        stem = f"shard_{len(self.shards):05d}"
        folder = self.root / self.split
        return folder / f"{stem}.bin", folder / f"{stem}.idx.npy"

    def add(self, tokens: np.ndarray) -> None:
        if self._offsets and self._offsets[-1] + len(tokens) > self.tokens_per_shard:
            self._finish_shard()
        if self._handle is None:
            bin_path, _ = self._paths()
            bin_path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(f"{bin_path}.tmp", "wb")
            self._offsets = [0]
        tokens.tofile(self._handle)
        self._offsets.append(self._offsets[-1] + len(tokens))

    def _finish_shard(self) -> None:
        assert self._handle is not None
        bin_path, idx_path = self._paths()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None
        with open(f"{idx_path}.tmp", "wb") as handle:
            np.save(handle, np.asarray(self._offsets, dtype=np.int64))
            handle.flush()
            os.fsync(handle.fileno())
        _replace_durably(Path(f"{idx_path}.tmp"), idx_path)
        _replace_durably(Path(f"{bin_path}.tmp"), bin_path)
        self.shards.append(
            {
                "bin": bin_path.relative_to(self.root).as_posix(),
                "idx": idx_path.relative_to(self.root).as_posix(),
                "tokens": self._offsets[-1],
                "documents": len(self._offsets) - 1,
            }
        )
        self._offsets = []

    @property
    def documents(self) -> int:
        """Documents added so far, committed or in the open shard."""
        return sum(shard["documents"] for shard in self.shards) + max(len(self._offsets) - 1, 0)

    def finish(self) -> dict[str, Any]:
        if self._handle is not None:
            self._finish_shard()
        return {
            "tokens": sum(shard["tokens"] for shard in self.shards),
            "documents": sum(shard["documents"] for shard in self.shards),
            "shards": self.shards,
        }

    def abort(self) -> None:
        """Delete the in-progress shard's temporary files (also if it failed mid-commit)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._offsets:
            for path in self._paths():
                Path(f"{path}.tmp").unlink(missing_ok=True)
            self._offsets = []


class ShardWriter:
    """Streams tokenized documents into shards; use as a context manager.

    On a clean exit the last shards and the manifest are committed; if the block raises, the
    in-progress shard's temporary files are deleted and no manifest is written.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        vocab_size: int,
        eos_token_id: int,
        tokenizer: dict[str, Any] | None = None,
        cfg: ShardConfig | None = None,
    ) -> None:
        self.root = Path(output_dir)
        if (self.root / MANIFEST_NAME).exists():
            raise FileExistsError(
                f"{self.root / MANIFEST_NAME} already exists; write to a new folder or delete it"
            )
        if eos_token_id is None:
            raise ValueError("The tokenizer has no eos token; shards need one to separate documents")
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary ({vocab_size})")
        self.cfg = cfg or ShardConfig()
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.tokenizer = tokenizer or {}
        self.dtype = token_dtype(vocab_size)
        self._splits = {
            name: _SplitWriter(self.root, name, self.dtype, self.cfg.tokens_per_shard)
            for name in ("train", "val")
        }
        self._held_back: deque[np.ndarray] = deque()  # the stream's tail, for val_tokens
        self._held_back_tokens = 0
        self._last_train: np.ndarray | None = None  # for val_fraction: val's fallback document
        self._description: dict[str, Any] = {}
        self.manifest: dict[str, Any] | None = None  # set by close()

    def describe(self, **fields: Any) -> None:
        """More manifest fields, about how the documents were made (the pipeline records each source's
        tokens and the fill-in-the-middle settings), written with the manifest at close."""
        self._description.update(fields)

    def add(self, tokens: Any) -> None:
        """Append one document's token ids (eos is appended here, not by the caller)."""
        ids = np.asarray(tokens)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"Expected a 1-D sequence of integer token ids, got {ids.dtype} {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"Token id out of range [0, {self.vocab_size}): min {ids.min()}, max {ids.max()}"
            )
        document = np.append(ids.astype(self.dtype), np.array(self.eos_token_id, self.dtype))
        if self.cfg.val_fraction:
            digest = hashlib.blake2b(document.tobytes(), digest_size=8).digest()
            if int.from_bytes(digest, "little") / 2**64 < self.cfg.val_fraction:
                self._splits["val"].add(document)
            else:
                if self._last_train is not None:
                    self._splits["train"].add(self._last_train)
                self._last_train = document
        elif self.cfg.val_tokens:
            self._held_back.append(document)
            self._held_back_tokens += len(document)
            while self._held_back_tokens - len(self._held_back[0]) >= self.cfg.val_tokens:
                self._held_back_tokens -= len(self._held_back[0])
                self._splits["train"].add(self._held_back.popleft())
        else:
            self._splits["train"].add(document)

    def close(self) -> dict[str, Any]:
        """Commit the last shards and write the manifest; returns the manifest."""
        if self.cfg.val_tokens and self._held_back_tokens < self.cfg.val_tokens:
            raise ValueError(
                f"The corpus has {self._held_back_tokens} tokens, fewer than "
                f"val_tokens={self.cfg.val_tokens}; nothing would be left to train on"
            )
        while self._held_back:
            self._splits["val"].add(self._held_back.popleft())
        if self._last_train is not None:
            val_is_empty = not self._splits["val"].documents
            train_has_more = bool(self._splits["train"].documents)
            self._splits["val" if val_is_empty and train_has_more else "train"].add(self._last_train)
            self._last_train = None
        splits = {name: writer.finish() for name, writer in self._splits.items()}
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "eos_appended": True,
            "tokenizer": self.tokenizer,
            "tokens_per_shard": self.cfg.tokens_per_shard,
            "total_tokens": sum(split["tokens"] for split in splits.values()),
            "documents": sum(split["documents"] for split in splits.values()),
            "splits": {name: split for name, split in splits.items() if split["shards"]},
            **self._description,
        }
        temporary = self.root / f"{MANIFEST_NAME}.tmp"
        temporary.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _replace_durably(temporary, self.root / MANIFEST_NAME)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Drop the in-progress shards' temporary files; committed shards stay on disk."""
        for writer in self._splits.values():
            writer.abort()

    def __enter__(self) -> ShardWriter:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


class TokenShards:
    """Read-only, memory-mapped view of one split of a shard folder, as one token stream.

    `doc_starts` holds the global start of every document plus the total length, so document i
    is `read(doc_starts[i], doc_starts[i + 1] - doc_starts[i])`.
    """

    def __init__(self, directory: str | Path, split: str = "train") -> None:
        self.root = Path(directory)
        manifest_path = self.root / MANIFEST_NAME
        if not manifest_path.exists():
            raise FileNotFoundError(
                f"No {MANIFEST_NAME} in {self.root}: not a shard folder, or its writing never finished"
            )
        self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if self.manifest.get("format") != FORMAT_NAME or self.manifest.get("version") != FORMAT_VERSION:
            raise ValueError(f"{manifest_path} is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest")
        if split not in self.manifest["splits"]:
            raise KeyError(
                f"{self.root} has no {split!r} split (splits: {', '.join(self.manifest['splits'])})"
            )
        self.split = split
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_token_id: int = self.manifest["eos_token_id"]
        self._tokens: list[np.ndarray] = []
        starts: list[np.ndarray] = []
        base = 0
        for shard in self.manifest["splits"][split]["shards"]:
            bin_path = self.root / shard["bin"]
            expected_bytes = shard["tokens"] * self.dtype.itemsize
            if not bin_path.exists() or bin_path.stat().st_size != expected_bytes:
                raise ValueError(f"{bin_path} is missing or not {expected_bytes} bytes: corrupt shard")
            self._tokens.append(np.memmap(bin_path, dtype=self.dtype, mode="r"))
            offsets = np.load(self.root / shard["idx"])
            if len(offsets) != shard["documents"] + 1 or offsets[-1] != shard["tokens"]:
                raise ValueError(f"{self.root / shard['idx']} does not match the manifest: corrupt index")
            starts.append(offsets[:-1] + base)
            base += shard["tokens"]
        self._shard_starts = np.cumsum([0] + [len(tokens) for tokens in self._tokens])
        self.num_tokens = int(base)
        self.doc_starts = np.concatenate(starts + [np.array([base], dtype=np.int64)])
        self.num_documents = len(self.doc_starts) - 1

    def __len__(self) -> int:
        return self.num_documents

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream (a copy, possibly across shards)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"Range [{start}, {start + length}) outside 0..{self.num_tokens}")
        pieces = []
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        while length > 0:
            local = start - int(self._shard_starts[shard])
            piece = self._tokens[shard][local : local + length]
            pieces.append(piece)
            start += len(piece)
            length -= len(piece)
            shard += 1
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)

    def document(self, index: int, include_eos: bool = False) -> np.ndarray:
        """Token ids of document `index`, without its trailing eos unless asked."""
        start, end = int(self.doc_starts[index]), int(self.doc_starts[index + 1])
        return self.read(start, end - start - (0 if include_eos else 1))
