"""Image data for diffusion: Fashion-MNIST from its Debian package, scikit-learn's 8×8 digits for
tests, and the loader that feeds the trainer batches scaled to [−1, 1].

Fashion-MNIST (Xiao et al. 2017: 60k train + 10k test 28×28 grayscale clothes, 10 classes) comes
from the Debian package `dataset-fashion-mnist`, downloaded and checksummed by the same machinery
as the text corpora (`tokenmind.data.fetch.download`, the cache under `default_cache_dir()`, the
SHA-256 lock file); its IDX files are read straight out of the `.deb` once and the arrays cached
as `<cache>/images/fashion-mnist.npz`, so later loads take a fraction of a second.

Every dataset is returned as (uint8 images (N, H, W) in 0..255, int64 labels (N,)), so one loader
serves them all. `ImageLoader` yields `ImageBatch`es with a `noise_seed` derived from the run seed
and the batch's position: the objective draws its timesteps and noise from a generator seeded with
it, so a batch's whole loss is a function of the loader position (exact resume, and validation
sees the same noise at every evaluation).
"""

from __future__ import annotations

import gzip
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tokenmind.data.fetch import FetchError, default_cache_dir, download
from tokenmind.data.sources.archive import iter_members
from tokenmind.data.sources.base import Record, Source

FASHION_MNIST_CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                         "ankle-boot"]
DIGITS_CLASSES = [str(d) for d in range(10)]
DATASETS = ("fashion-mnist", "digits")
IMAGE_SIZES = {"fashion-mnist": 28, "digits": 8}  # square, one channel
_FASHION_DIR = "usr/share/datasets/fashion-mnist/"
_SPLIT_FILES = {"train": "train", "test": "t10k"}
_IDX_MAGIC = {1: 0x801, 3: 0x803}  # labels, images (unsigned bytes)


def read_idx(data: bytes, ndim: int, name: str) -> np.ndarray:
    """An IDX array (LeCun's MNIST format: magic, big-endian dims, then uint8 values) of `ndim` dims."""
    magic = int.from_bytes(data[:4], "big")
    if magic != _IDX_MAGIC[ndim]:
        raise FetchError(f"{name}: IDX magic {magic:#x}, expected {_IDX_MAGIC[ndim]:#x} (a {ndim}-D uint8 array)")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    values = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if values.size != int(np.prod(shape)):
        raise FetchError(f"{name}: {values.size} values for shape {shape}; the file is truncated")
    return values.reshape(shape)


def extract_fashion_mnist(archive: Path) -> list[Record]:
    """The train and test splits out of the `dataset-fashion-mnist` .deb, checked for agreement."""
    files = {Path(path).name: gzip.decompress(data) for path, data in iter_members(archive, _FASHION_DIR + "*.gz")}
    records = []
    for split, prefix in _SPLIT_FILES.items():
        names = f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz"
        missing = [n for n in names if n not in files]
        if missing:
            raise FetchError(f"{archive.name} lacks {', '.join(missing)} under {_FASHION_DIR}; "
                             "is it the right package?")
        images, labels = read_idx(files[names[0]], 3, names[0]), read_idx(files[names[1]], 1, names[1])
        if len(images) != len(labels) or labels.max() >= len(FASHION_MNIST_CLASSES):
            raise FetchError(f"{archive.name}: {split} has {len(images)} images, {len(labels)} labels "
                             f"(max {labels.max()}); expected one label in 0..9 per image")
        records.append({"id": split, "images": images, "labels": labels.astype(np.int64)})
    return records


FASHION_MNIST = Source(
    name="fashion-mnist", registry="debian", package="dataset-fashion-mnist", version="0.0~git20200523.55506a9-1",
    license="MIT", data_license="MIT", kind="images", extractor=extract_fashion_mnist,
    description="Fashion-MNIST: 60k + 10k 28x28 grayscale clothing images in 10 classes (Zalando Research)")


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_fashion_mnist(split: str = "train", cache_dir: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images (N, 28, 28), int64 labels (N,)) of the `train` (60k) or `test` (10k) split;
    the first call downloads the package (31 MB) and caches the arrays. Class names:
    FASHION_MNIST_CLASSES."""
    if split not in _SPLIT_FILES:
        raise ValueError(f"split={split!r} is not one of {', '.join(_SPLIT_FILES)}")
    root = Path(cache_dir or default_cache_dir()).expanduser()
    cached = root / "images" / "fashion-mnist.npz"
    if not cached.is_file():
        archive = download(FASHION_MNIST, root)["path"]
        _save_npz(cached, {f"{r['id']}_{key}": r[key] for r in extract_fashion_mnist(archive)
                           for key in ("images", "labels")})
    with np.load(cached) as arrays:
        return torch.from_numpy(arrays[f"{split}_images"].copy()), torch.from_numpy(arrays[f"{split}_labels"].copy())


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8×8 handwritten digits (1,797 images, classes 0-9), rescaled from
    their 0..16 gray levels to uint8 0..255: a data set small enough for unit tests."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:
        raise ImportError("the digits data set comes with scikit-learn: pip install scikit-learn") from err
    digits = sklearn_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)
    return torch.from_numpy(images), torch.from_numpy(digits.target.astype(np.int64))


def class_names(dataset: str) -> list[str]:
    """The label names of `dataset`, by label index."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r} is not one of {', '.join(DATASETS)}")
    return FASHION_MNIST_CLASSES if dataset == "fashion-mnist" else DIGITS_CLASSES


def image_shape(dataset: str, pad_to: int = 0) -> tuple[int, int, int]:
    """(C, H, W) of a data set's images as the model sees them (after padding to pad_to)."""
    class_names(dataset)  # checks the name
    size = pad_to or IMAGE_SIZES[dataset]
    return 1, size, size


def load_split(dataset: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A named data set's `train` or `test` split. The digits have no official split: their last
    197 images are the test split, the first 1,600 the train split."""
    if class_names(dataset) is FASHION_MNIST_CLASSES:
        return load_fashion_mnist(split)
    if split not in _SPLIT_FILES:
        raise ValueError(f"split={split!r} is not one of {', '.join(_SPLIT_FILES)}")
    images, labels = load_digits()
    return (images[:1600], labels[:1600]) if split == "train" else (images[1600:], labels[1600:])


def to_model_range(images: torch.Tensor, pad_to: int = 0) -> torch.Tensor:
    """uint8 (B, H, W) or (B, C, H, W) in 0..255 → float (B, C, H', W') in [−1, 1], padded with −1
    (the black background) to pad_to × pad_to when given: 28 → 32 lets a DiT patchify by 2, 4 or 8."""
    x = images.float() / 127.5 - 1
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if pad_to:
        h, w = x.shape[-2:]
        if pad_to < max(h, w) or (pad_to - h) % 2 or (pad_to - w) % 2:
            raise ValueError(f"cannot pad {h}x{w} images evenly to {pad_to}x{pad_to}; use a size >= {max(h, w)} "
                             "that differs from the image size by an even number")
        p, q = (pad_to - h) // 2, (pad_to - w) // 2
        x = F.pad(x, (q, q, p, p), value=-1.0)
    return x


@dataclass
class ImageBatch:
    """images: float (B, C, H, W) in [−1, 1]; labels: int64 (B,); noise_seed: seeds the objective's
    draws of timesteps, noise and label dropout for this batch."""

    images: torch.Tensor
    labels: torch.Tensor
    noise_seed: int

    def to(self, device: torch.device | str) -> ImageBatch:
        return ImageBatch(self.images.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                          self.noise_seed)


class ImageLoader:
    """Endless batches of whole images (uint8 scaled to [−1, 1], or float ones as they are: latents),
    in a seeded permutation per epoch (or in order), each rank
    taking every world_size-th image; the last partial batch of an epoch is dropped. Its state is
    (epoch, position), so a resumed run continues with the very same batches."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, pad_to: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels
        self.batch_size, self.seed, self.shuffle, self.pad_to = batch_size, seed, shuffle, pad_to
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = len(images) // world_size // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(images)} images make no batch of {batch_size} on each of {world_size} ranks; "
                             "lower data.batch_size")
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> torch.Tensor:
        n = len(self.images)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)) \
            if self.shuffle else torch.arange(n)
        return order[self.rank::self.world_size]

    def __iter__(self) -> ImageLoader:
        return self

    def __next__(self) -> ImageBatch:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        rows = self._order[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        noise_seed = int(np.random.SeedSequence([self.seed, self.rank, self.epoch, self.position]).generate_state(1)[0])
        self.position += 1
        images = self.images[rows]  # float images (a latent diffusion run's latents) are the model's data as is
        return ImageBatch(images if images.is_floating_point() else to_model_range(images, self.pad_to),
                          self.labels[rows], noise_seed)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()
