"""A packing data loader over token shards: fixed-length rows, no padding, resumable.

Pre-training wants every position of every row to be a real token, so documents are not
padded to the row length but packed: the split's token stream (documents back to back, each
ending with eos, exactly as `shards.py` stores them) is cut into rows. Row r covers stream
positions [r*T, r*T + T] (T + 1 tokens): the first T are the inputs, the last T the targets.

Packing puts several documents in one row, and a model should not attend from one document
into an unrelated previous one. So next to the tokens every `TokenBatch` carries, per position:

* `document_ids`: which document of the row the input token belongs to, counting from 0 at the
  row's first token (a document's eos belongs to it); attention is allowed only where
  `document_ids` match.
* `positions`: the position inside that document, restarting at 0 at each document start
  and at the row start (for rotary/learned position embeddings).

Row order is a seeded permutation per epoch, so it is reproducible, and the loader's position
is two integers (epoch, batch within epoch): `state_dict()` saves them, `load_state_dict()`
restores them, and the resumed loader yields exactly the batches the original would have.
With `world_size` > 1, rank k takes every world_size-th row of the permutation (truncated so
every rank has the same number of rows): ranks see disjoint rows and stay in lockstep.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tokenmind.data.shards import TokenShards

IGNORE_INDEX = -100  # a target with this id is not trained on (F.cross_entropy's default ignore_index)


@dataclass
class TokenBatch:
    """Packed rows of tokens; every field is a (batch_size, seq_len) int64 tensor.

    input_ids: the tokens the model reads. targets: the token to predict at each position, or
        IGNORE_INDEX where nothing is trained (SFT's non-assistant tokens, row padding).
    document_ids, positions: the packing structure described in the module docstring.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor

    def to(self, device: torch.device) -> TokenBatch:
        """This batch on `device`."""
        return TokenBatch(*(t.to(device, non_blocking=True)
                            for t in (self.input_ids, self.targets, self.document_ids, self.positions)))


@dataclass
class LoaderConfig:
    """batch_size and seq_len: rows per batch (per rank) and tokens per row. shuffle=False
    keeps rows in stream order (useful for validation). rank/world_size: data parallelism."""

    batch_size: int
    seq_len: int
    seed: int = 0
    shuffle: bool = True
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {self.batch_size}, {self.seq_len}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")


class RowLoader:
    """What every packed-row loader shares: an infinite iterator of `TokenBatch`es whose epochs follow
    each other seamlessly, a seeded row order per epoch, rank k taking every world_size-th row, and
    an exact position (epoch, batch) that `state_dict`/`load_state_dict` save and restore.

    `batches_per_epoch` tells a training loop how many batches make one pass over this rank's
    rows; the trailing rows that do not fill a batch on every rank are skipped for that epoch
    (a different permutation next epoch skips different ones). Subclasses give `num_rows` and
    build batches in `batch_for_rows`.
    """

    def __init__(self, cfg: LoaderConfig, num_rows: int, source: str) -> None:
        self.cfg, self.num_rows = cfg, num_rows
        self.rows_per_rank = num_rows // cfg.world_size
        self.batches_per_epoch = self.rows_per_rank // cfg.batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"{source} make {num_rows} rows of {cfg.seq_len}, too few for one batch of "
                             f"{cfg.batch_size} rows on each of {cfg.world_size} rank(s)")
        self.epoch = 0
        self.step = 0  # batches already yielded in the current epoch
        self._rows: tuple[int, np.ndarray] | None = None  # (epoch, its rows) cache

    def rows_for_epoch(self, epoch: int) -> np.ndarray:
        """This rank's row indices for `epoch`, in the order they are served."""
        if self._rows is None or self._rows[0] != epoch:
            if self.cfg.shuffle:
                order = np.random.default_rng([self.cfg.seed, epoch]).permutation(self.num_rows)
            else:
                order = np.arange(self.num_rows)
            mine = order[self.cfg.rank :: self.cfg.world_size][: self.rows_per_rank]
            self._rows = (epoch, mine)
        return self._rows[1]

    def __iter__(self) -> RowLoader:
        return self

    def __next__(self) -> TokenBatch:
        if self.step == self.batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        size = self.cfg.batch_size
        rows = self.rows_for_epoch(self.epoch)[self.step * size : (self.step + 1) * size]
        self.step += 1
        return self.batch_for_rows(rows)

    def batch_for_rows(self, rows: np.ndarray) -> TokenBatch:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The exact position, plus what must not change for it to stay meaningful."""
        return {"epoch": self.epoch, "step": self.step, "num_rows": self.num_rows, "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; refuses states from different data or a different layout."""
        now = self.state_dict()
        mismatched = [f"{key}: saved {value!r}, now {now['config'].get(key)!r}"
                      for key, value in state["config"].items() if now["config"].get(key) != value]
        if state["num_rows"] != self.num_rows:
            mismatched.append(f"num_rows: saved {state['num_rows']}, now {self.num_rows}")
        if mismatched:
            raise ValueError("loader state does not match this data: " + "; ".join(mismatched))
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


class PackedLoader(RowLoader):
    """Pre-training batches: rows of seq_len + 1 consecutive tokens cut from the shards."""

    def __init__(self, shards: TokenShards, cfg: LoaderConfig) -> None:
        self.shards = shards
        super().__init__(cfg, max(shards.num_tokens - 1, 0) // cfg.seq_len, f"{shards.num_tokens} tokens")

    def batch_for_rows(self, rows: np.ndarray) -> TokenBatch:
        """Build the batch made of the given row indices (in that order)."""
        length = self.cfg.seq_len
        starts = rows.astype(np.int64) * length
        windows = np.stack([self.shards.read(int(start), length + 1) for start in starts])
        windows = windows.astype(np.int64)
        positions = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
        doc_starts = self.shards.doc_starts
        docs = np.searchsorted(doc_starts, positions, side="right") - 1
        segment_start = np.maximum(doc_starts[docs], starts[:, None])
        return TokenBatch(
            input_ids=torch.from_numpy(windows[:, :-1].copy()),
            targets=torch.from_numpy(windows[:, 1:].copy()),
            document_ids=torch.from_numpy(docs - docs[:, :1]),
            positions=torch.from_numpy(positions - segment_start),
        )
