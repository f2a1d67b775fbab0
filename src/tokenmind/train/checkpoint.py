"""Training checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is a folder `<root>/step_000123/` holding

* `model.safetensors`: full model weights by parameter name (tensors that alias another one,
  like a tied LM head, are stored once and named in the file's metadata);
* `optimizer.pt`: the full optimizer state keyed by parameter name;
* `trainer.pt`: step, tokens seen, LR-scheduler counters;
* `rank_00000.pt`, one per rank: that rank's data-loader position and RNG states (ranks read
  different rows and may draw different random numbers).

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


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def capture_rng() -> dict[str, Any]:
    """Every global RNG a training step could draw from, in weights_only-loadable form."""
    version, mt_state, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


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
        state = {name: f.get_tensor(name) for name in f.keys()}
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
    """Write `state` as `<root>/step_{step:06d}` atomically, then prune. Every rank calls this
    (each writes its own rank file); rank 0 writes the shared files and commits."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f"{final.name}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a stale one from a crash
        tmp.mkdir(parents=True)
    ctx.barrier()
    try:
        if ctx.is_main:
            _save_weights(state.model, tmp / "model.safetensors")
            _torch_save(state.optimizer, tmp / "optimizer.pt")
            _torch_save(state.trainer, tmp / "trainer.pt")
        _torch_save(state.rank, tmp / f"rank_{ctx.rank:05d}.pt")
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    ctx.barrier()
    if ctx.is_main:
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (a resumed run ending where it resumed)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        prune_checkpoints(root, keep_last)
    ctx.barrier()
    return final


def load_checkpoint(path: str | Path, rank: int = 0, read_shared: bool = True) -> TrainingState:
    """Read a checkpoint for `rank`; with read_shared=False skip the model and optimizer files
    (FSDP ranks other than 0 receive those by broadcast)."""
    path = Path(path)
    rank_file = path / f"rank_{rank:05d}.pt"
    if not rank_file.exists():
        saved = sorted(p.name for p in path.glob("rank_*.pt"))
        raise FileNotFoundError(f"{rank_file} is missing (checkpoint has {', '.join(saved) or 'no rank files'}); "
                                "resume with the world size the checkpoint was saved with")
    state = TrainingState(trainer=torch.load(path / "trainer.pt", weights_only=True),
                          rank=torch.load(rank_file, weights_only=True))
    if read_shared:
        state.model = _load_weights(path / "model.safetensors")
        state.optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    return state
