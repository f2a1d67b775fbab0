"""R's data serialization (XDR `saveRDS` and lazy-load databases), read without R.

Debian ships some corpora only as R packages: r-cran-janeaustenr keeps the six novels in its
`data/Rdata.rdb` lazy-load database. This module decodes the subset of the format plain data
uses; anything else is an error naming the R type, not a silent skip.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from typing import Any


def read_r_serialized(data: bytes) -> Any:
    """Decode R's XDR serialization (`saveRDS`, lazy-load databases) for the types plain data
    uses: NULL, logical/integer/double/character vectors, lists and pairlists, symbols.

    Vectors with a `names` attribute become dicts; other attributes are ignored.
    """
    if data[:2] != b"X\n":
        raise ValueError("not an R XDR serialization (expected the 'X\\n' header)")
    reader = _RReader(data, 2)
    version = reader.int()
    reader.int(), reader.int()  # writer and minimal reader R versions
    if version == 3:
        length = reader.int()  # then the native encoding's name
        reader.pos += length
    return reader.item()


class _RReader:
    def __init__(self, data: bytes, pos: int):
        self.data, self.pos, self.refs = data, pos, []

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP: a symbol seen before
            return self.refs[(flags >> 8 or self.int()) - 1]
        if kind == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP; bit 14 of the flags (LATIN1 level) picks the encoding
            n = self.int()
            if n == -1:
                return None
            raw = self.data[self.pos : self.pos + n]
            self.pos += n
            return raw.decode("latin-1" if flags & (1 << 14) else "utf-8", errors="replace")
        if kind == 2:  # LISTSXP (pairlist), read iteratively along its CDRs
            out = {}
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return out
                if kind != 2:
                    raise ValueError(f"unsupported R pairlist tail type {kind}")
        if kind in (10, 13, 14, 16, 19):  # LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP
            n = self.int()
            if kind in (10, 13):
                values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
                self.pos += 4 * n
            elif kind == 14:
                values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
                self.pos += 8 * n
            else:
                values = [self.item() for _ in range(n)]
            if has_attr:
                names = self.item().get("names")
                if names and len(names) == len(values):
                    return dict(zip(names, values))
            return values
        raise ValueError(f"unsupported R object type {kind} at byte {self.pos - 4}")


def read_r_lazyload(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """The variables of an R lazy-load database (`Rdata.rdx` index + `Rdata.rdb` blobs), as the
    `data/` folder of an installed R package holds them. Blobs are zlib-compressed."""
    index = read_r_serialized(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:]))
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[int(offset) : int(offset) + int(length)]
        out[name] = read_r_serialized(zlib.decompress(blob[4:]))  # 4 bytes: uncompressed length
    return out
