"""Reading files straight out of a downloaded package: wheels and zips, tarballs (sdists) and
Debian `.deb`s, without installing or unpacking them to disk.

Every extractor goes through `iter_members` (or `read_member` for one known path), so the
archive formats are handled once, here; `decode_text` turns a member's bytes into text the
same way for every source.
"""

from __future__ import annotations

import fnmatch
import io
import subprocess
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path


def iter_members(archive: str | Path, pattern: str | Callable[[str], bool] = "*") -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each regular file in a wheel/zip, tarball or `.deb` whose path matches.

    `pattern` is an fnmatch pattern (`*` crosses `/`) or a predicate on the path. Paths have no
    leading `./`. Symlinks and hard links are skipped: in Debian packages they duplicate files.
    """
    match = pattern if callable(pattern) else (lambda name: fnmatch.fnmatchcase(name, pattern))
    archive = Path(archive)
    name = archive.name
    if name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                path = info.filename
                is_link = (info.external_attr >> 16) & 0o170000 == 0o120000
                if not info.is_dir() and not is_link and match(path):
                    yield path, zf.read(info)
    elif name.endswith(".deb"):
        yield from _iter_tar(_deb_data_tar(archive), match)
    elif name.endswith((".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar")):
        with open(archive, "rb") as fh:
            yield from _iter_tar(fh, match)
    else:
        raise ValueError(f"{archive}: unknown archive type (expected .whl, .zip, .deb or .tar.*)")


def read_member(archive: str | Path, path: str) -> bytes:
    """The bytes of one file inside `archive`; KeyError naming the archive if it is absent."""
    for _, data in iter_members(archive, lambda name: name == path):
        return data
    raise KeyError(f"{path} not found in {archive}")


def decode_text(data: bytes) -> str:
    """A member's bytes as text: UTF-8 (undecodable bytes replaced, never an error), `\\n` line ends."""
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def _iter_tar(fileobj: io.IOBase, match: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=fileobj, mode="r|*") as tf:  # streaming: one pass, bounded memory
        for info in tf:
            path = info.name.removeprefix("./")
            if info.isreg() and match(path):
                yield path, tf.extractfile(info).read()


def _deb_data_tar(deb: Path) -> io.IOBase:
    """The `data.tar.*` member of a Debian package (an `ar` archive), as a file object.

    Read in Python so no dpkg is needed; `dpkg-deb --fsys-tarfile` is the fallback for
    compressions Python's tarfile lacks (zstd).
    """
    with open(deb, "rb") as fh:
        if fh.read(8) != b"!<arch>\n":
            raise ValueError(f"{deb} is not a Debian package (no ar header)")
        while header := fh.read(60):
            if len(header) < 60:
                break
            member = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            if member.startswith("data.tar"):
                if member.endswith((".xz", ".gz", ".bz2")) or member == "data.tar":
                    return io.BytesIO(fh.read(size))
                out = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
                return io.BytesIO(out.stdout)
            fh.seek(size + size % 2, 1)
    raise ValueError(f"{deb} has no data.tar member")
