"""JSON Lines files, read whole and written atomically (a temp file renamed into place), so a
crash never leaves half a file where a finished one is expected; and the optional JSON config
files that model folders carry."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[IO[str]]:
    """Write to a temp file next to `path`, then rename it over `path`; nothing half-written stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            yield fh
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_jsonl(path: str | Path, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every record of a JSONL file (blank lines skipped); [] for a missing file if `missing_ok`."""
    path = Path(path)
    if missing_ok and not path.exists():
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def parse_jsonl(text: str) -> list[Any]:
    """The records of JSONL text. Split at "\\n" only: str.splitlines() also splits at U+2028, U+0085
    and \\x1c, which JSON strings may hold raw."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def located_objects(paths: Iterable[str | Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`file:line`, object) for every non-blank line of the JSONL files, for input checks that
    name the line at fault; a line that is not a JSON object is refused so."""
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e})") from e
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: not a JSON object")
                yield where, record


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Write `records` one per line, atomically; return how many."""
    n = 0
    with atomic_open(path) as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def write_json(path: str | Path, value: Any) -> None:
    """Write `value` as indented JSON, atomically (a report or result file)."""
    with atomic_open(path) as fh:
        fh.write(json.dumps(value, indent=2) + "\n")


def read_json_or_empty(path: Path) -> dict:
    """A JSON file's object, or {} when the file is absent (a model folder's optional configs)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
