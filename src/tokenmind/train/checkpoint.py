"""Training checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is a folder `<root>/step_000123/` holding

* `model.safetensors`: full model weights by parameter name (tensors that alias another one,
  like a tied LM head, are stored once and named in the file's metadata);
* `optimizer.pt`: the full optimizer state keyed by parameter name;
* `trainer.pt`: step, tokens seen, LR-scheduler counters;
* `rank_00000.pt`, one per rank: that rank's data-loader position and RNG states (ranks read
  different rows and may draw different random numbers).

Rank 0 writes every file (the other ranks send it their part), so a multi-node run writes its
checkpoint once, on node 0's disk. Nothing in it depends on the world size but the rank files:
model and optimizer state are full tensors by parameter name however the run was sharded, and a
run resuming on another number of ranks adapts rank 0's part (`reshard_rank_state`): the loader
position is a global one, and the per-rank RNG streams, which have no counterpart on another
world size, restart from seeds derived from (seed, step, rank).

The `.pt` files are our own, and hold only tensors, dicts, lists, numbers and strings, so they
load with `torch.load(weights_only=True)`, which refuses arbitrary pickled objects. A save
goes into `step_000123.tmp/` and becomes `step_000123/` with one `os.replace` once every file
is fsynced: a crash mid-save leaves at most a `.tmp` folder, which `latest_checkpoint` ignores,
and the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .distributed import DistContext

_NAME = re.compile(r"^step_(\d+)$")


@dataclass
class TrainingState:
    """One checkpoint's contents. model/optimizer/trainer are shared by all ranks (written by
    rank 0); rank is this process's own part. Empty dicts where a rank did not read them."""

    model: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    rank: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1  # how many ranks saved it (set on load)


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_dict(torch_state: torch.Tensor, python_state: tuple, numpy_state: tuple,
              cuda_states: list[torch.Tensor] | None) -> dict[str, Any]:
    """RNG states in weights_only-loadable form (no numpy arrays, no tuples of tuples)."""
    version, mt_state, gauss = python_state
    kind, key, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "torch": torch_state,
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
    }
    if cuda_states is not None:
        state["cuda"] = cuda_states
    return state


def capture_rng() -> dict[str, Any]:
    """Every global RNG a training step could draw from."""
    return _rng_dict(torch.get_rng_state(), random.getstate(), np.random.get_state(),
                     torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def seeded_rng(seed: int) -> dict[str, Any]:
    """The states `capture_rng` would return right after seeding every global RNG with `seed`."""
    cuda = ([torch.Generator(device=f"cuda:{i}").manual_seed(seed).get_state() for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else None)
    return _rng_dict(torch.Generator().manual_seed(seed).get_state(), random.Random(seed).getstate(),
                     np.random.RandomState(seed).get_state(), cuda)


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["key"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses tensors that share memory: store each storage once, name aliases."""
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"aliases": json.dumps(aliases)})
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    state.update({name: state[target] for name, target in aliases.items()})
    return state


def load_checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Only the model weights of a checkpoint (tied weights restored), to evaluate it."""
    return _load_weights(Path(path) / "model.safetensors")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (`.tmp` folders are not checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all); returns the deleted."""
    found = list_checkpoints(root)
    doomed = found[:-keep_last] if keep_last > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def save_checkpoint(root: str | Path, step: int, state: TrainingState, ctx: DistContext,
                    keep_last: int = 0) -> Path:
    """Write `state` as `<root>/step_{step:06d}` atomically, then prune. Every rank calls this and
    sends rank 0 its own part; rank 0 writes all files and commits, so only its disk needs `root`."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f"{final.name}.tmp"
    parts = [state.rank]
    if ctx.world_size > 1:  # every rank's part, in rank order, to rank 0
        parts = [None] * ctx.world_size if ctx.is_main else None
        dist.gather_object(state.rank, parts)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a stale one from a crash
        tmp.mkdir(parents=True)
        try:
            _save_weights(state.model, tmp / "model.safetensors")
            _torch_save(state.optimizer, tmp / "optimizer.pt")
            _torch_save(state.trainer, tmp / "trainer.pt")
            for rank, part in enumerate(parts):
                _torch_save(part, tmp / f"rank_{rank:05d}.pt")
            _fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # re-saving a step (a resumed run ending where it resumed)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        prune_checkpoints(root, keep_last)
    ctx.barrier()
    return final


def saved_world_size(path: str | Path) -> int:
    """How many ranks saved the checkpoint at `path` (one rank file each)."""
    return len(list(Path(path).glob("rank_*.pt")))


def load_checkpoint(path: str | Path, rank: int = 0, read_shared: bool = True,
                    world_size: int | None = None) -> TrainingState:
    """Read a checkpoint for `rank` of `world_size` ranks (default: as many as saved it); with
    read_shared=False skip the model and optimizer files (FSDP ranks other than 0 receive those by
    broadcast). On another world size than the saving run's, `rank` is rank 0's part, to pass
    through `reshard_rank_state`."""
    path = Path(path)
    saved = saved_world_size(path)
    if world_size is not None and world_size != saved:
        rank = 0
    rank_file = path / f"rank_{rank:05d}.pt"
    if not rank_file.exists():
        raise FileNotFoundError(f"{rank_file} is missing ({path} has {saved} rank files); the checkpoint is "
                                "incomplete, or pass world_size to read it on another number of ranks")
    state = TrainingState(trainer=torch.load(path / "trainer.pt", weights_only=True),
                          rank=torch.load(rank_file, weights_only=True), world_size=saved)
    if read_shared:
        state.model = _load_weights(path / "model.safetensors")
        state.optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    return state


_LAYOUT = ("rank", "world_size", "batch_size")  # the loader settings a world-size change may change


def reshard_loader_state(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """A row loader's saved position (`RowLoader.state_dict`) for the loader whose fresh state is `now`,
    which may have another rank, world size and per-rank batch size. The ranks of a step read one
    contiguous slice of the epoch's row order, so the position is global: rows consumed this epoch
    = step x batch_size x world_size, the same on every rank."""
    if "config" not in saved or "step" not in saved or any(key not in saved["config"] for key in _LAYOUT):
        raise ValueError(f"this loader's position ({sorted(saved)}) is per rank and cannot move to another world "
                         "size; resume on the number of ranks the checkpoint was saved with")
    rows = saved["step"] * saved["config"]["batch_size"] * saved["config"]["world_size"]
    per_step = now["config"]["batch_size"] * now["config"]["world_size"]
    if rows % per_step:
        raise ValueError(f"the checkpoint's ranks read {rows} rows of epoch {saved['epoch']}, not a whole number "
                         f"of this run's {per_step}-row global batches; keep data.batch_size x ranks at "
                         f"{saved['config']['batch_size'] * saved['config']['world_size']}")
    layout = {key: now["config"][key] for key in _LAYOUT}
    return {**saved, "step": rows // per_step, "config": {**saved["config"], **layout}}


def reshard_rank_state(saved: dict[str, Any], loader_now: dict[str, Any], seed: int, step: int,
                       rank: int) -> dict[str, Any]:
    """Rank 0's saved part (`load_checkpoint` on another world size) made this rank's: the loader at the
    same global position, every RNG seeded from (seed, step, rank), deterministic but not a replay
    of any stream drawn before, and the rest (fp8 scaling history) as rank 0 had it."""
    rng_seed = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
    return {**saved, "loader": reshard_loader_state(saved["loader"], loader_now), "rng": seeded_rng(rng_seed)}
