"""Parse the GGUF container: header, metadata key/values, tensor index, memory-mapped tensor data.

The `gguf` package's own reader builds a numpy view for every element of every metadata array, which
for a 49k-token vocabulary and its merges takes about two seconds; this one walks the header once with
`struct` (about 0.1 s) and hands out zero-copy, read-only views of the tensor data. It knows only
the container (little-endian GGUF v2/v3); `gguf.py` translates what it holds to Hugging Face terms.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_DEFAULT_ALIGNMENT = 32
_SUPPORTED_VERSIONS = (2, 3)
# Metadata value types (GGUF spec): id -> struct format of one scalar. 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
# Tensor types stored as plain numbers (one element each); every other type is bytes of blocks.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The bytes do not make a readable GGUF file (truncated or corrupt)."""


class GGUFByteOrderError(GGUFFormatError):
    """A big-endian GGUF file: readable in principle, but not on this (little-endian) reader."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. `shape` is in GGUF order (fastest-varying dimension first); `data` is
    a read-only view of the file: plain types as (rows..., elements), block types as (rows..., bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    version: int
    metadata: dict  # key -> int / float / bool / str / list, in file order
    tensors: list[GGUFTensor]  # in file order
    data_offset: int  # where the tensor data begins


class _Cursor:
    """Reads little-endian values from a buffer, raising GGUFFormatError instead of reading past its end."""

    def __init__(self, buffer, offset: int = 0) -> None:
        self.buffer, self.offset, self.size = buffer, offset, len(buffer)

    def take(self, n: int) -> int:
        """Reserve n bytes; returns where they start."""
        if n < 0 or self.offset + n > self.size:
            raise GGUFFormatError(f"needs {n} bytes at offset {self.offset}, the file ends at {self.size}")
        start, self.offset = self.offset, self.offset + n
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        try:
            return str(self.buffer[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a string at offset {start} is not UTF-8 ({e})") from e

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[item_kind])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buffer, dtype, count, start).tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind} at offset {self.offset - 4}")
        value = self.scalar(_SCALARS[kind])
        # A float32 reads back as its shortest decimal: a stored 1e-5 is 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(value))) if kind == _FLOAT32 else value


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse `path`'s header and map its tensor data (nothing is copied). Raises GGUFFormatError."""
    with open(path, "rb") as f:
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise GGUFFormatError(f"the file is empty ({e})") from e
    cursor = _Cursor(buffer)
    start = cursor.take(4)
    if buffer[start:start + 4] != b"GGUF":
        raise GGUFFormatError("the magic bytes are not b'GGUF'")
    version = cursor.scalar("<I")
    if version & 0xFFFF == 0:  # the version's bytes are reversed: written big-endian
        raise GGUFByteOrderError("the file is byte-swapped (written for the other endianness)")
    if version not in _SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (only {_SUPPORTED_VERSIONS})")
    n_tensors, n_keys = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict = {}
    for _ in range(n_keys):
        key = cursor.string()
        if key in metadata:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        metadata[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.scalar("<I")
        shape = tuple(cursor.scalar("<Q") for _ in range(n_dims))
        raw_type, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        try:
            infos.append((name, shape, GGMLQuantizationType(raw_type), offset))
        except ValueError as e:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from e
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, shape, qtype, offset in infos:
        if name in names:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(GGUFTensor(name, qtype, shape, _tensor_data(buffer, data_offset + offset, shape, qtype)))
    return GGUFFile(version, metadata, tensors, data_offset)


def _tensor_data(buffer, offset: int, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    rows = tuple(reversed(shape))  # numpy order: slowest-varying dimension first
    n_elements = int(np.prod(shape, dtype=np.int64))
    if qtype in _PLAIN:
        dtype, count = np.dtype(_PLAIN[qtype]), n_elements
    else:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if shape and shape[0] % block:
            raise GGUFFormatError(f"a {qtype.name} row of {shape[0]} elements is not whole blocks of {block}")
        dtype, count = np.dtype(np.uint8), n_elements // block * block_bytes
        rows = (*rows[:-1], rows[-1] // block * block_bytes) if rows else rows
    if offset + count * dtype.itemsize > len(buffer):
        raise GGUFFormatError(f"tensor data at offset {offset} runs past the end of the file ({len(buffer)} bytes)")
    return np.frombuffer(buffer, dtype, count, offset).reshape(rows)
