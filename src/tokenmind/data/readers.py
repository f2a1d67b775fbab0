"""Read raw documents from text, JSON Lines and Parquet files, or folders of them.

Everything downstream (cleaning, dedup, tokenization) sees one stream of `Document`s, whatever
the files looked like. Two properties matter more than convenience here:

* Determinism. Folders are walked recursively in sorted order of their relative paths, so the
  same inputs always give the same document order, hence the same dedup decisions ("keep the
  first occurrence") and the same shards. The pipeline also relies on this to read its inputs
  twice (the boilerplate pass needs counts before it can clean anything).
* Errors that say where. A corrupt line in a 40 GB dump is only fixable if the message names
  the file and the line, so every parse problem raises `DataReadError` with both.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".jsonl.gz", ".parquet")


class DataReadError(ValueError):
    """An input that cannot be read as documents: unknown format, bad JSON, missing field."""


@dataclass(frozen=True, slots=True)
class Document:
    """One unit of training text.

    `source` is the input path the document was found under (the folder for a folder input), so
    per-source statistics such as boilerplate lines group naturally. `id` names the document
    itself: the record's own id field when it has one, otherwise file and line/row/part.
    """

    text: str
    source: str
    id: str

    def to_dict(self) -> dict[str, str]:
        return {"text": self.text, "source": self.source, "id": self.id}


@dataclass
class ReaderConfig:
    """How to turn files into documents.

    text_field: the JSONL/Parquet field holding the text.
    id_field: a field to use as the document id when present (None: always use the location).
    split_txt_on_blank_lines: treat blank-line-separated blocks of a .txt file as separate
        documents (for files that concatenate many short texts) instead of one per file.
    encoding / encoding_errors: passed to the text decoder; "strict" fails loudly on bytes that
        are not valid in `encoding`, "replace" substitutes U+FFFD instead.
    parquet_batch_rows: rows per Arrow batch, which bounds memory on large Parquet files.
    """

    text_field: str = "text"
    id_field: str | None = "id"
    split_txt_on_blank_lines: bool = False
    encoding: str = "utf-8"
    encoding_errors: str = "strict"
    parquet_batch_rows: int = 1024


def _extension(path: Path) -> str | None:
    name = path.name.lower()
    return next((ext for ext in SUPPORTED_EXTENSIONS if name.endswith(ext)), None)


def list_input_files(path: str | Path) -> list[Path]:
    """The readable files under `path`: itself if it is a file, else a sorted recursive walk.

    Inside folders, hidden entries (names starting with ".") and files with other extensions
    are skipped, so READMEs and `.DS_Store` do not break a run; a file named explicitly must
    have a supported extension.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"Input path does not exist: {root}")
    if root.is_file():
        if _extension(root) is None:
            raise DataReadError(
                f"Unsupported file type: {root} (supported: {', '.join(SUPPORTED_EXTENSIONS)})"
            )
        return [root]
    files = [
        file
        for file in root.rglob("*")
        if file.is_file()
        and _extension(file) is not None
        and not any(part.startswith(".") for part in file.relative_to(root).parts)
    ]
    if not files:
        raise DataReadError(
            f"No readable files under {root} (supported: {', '.join(SUPPORTED_EXTENSIONS)})"
        )
    return sorted(files, key=lambda file: file.relative_to(root).as_posix())


def read_documents(
    paths: str | Path | Iterable[str | Path], cfg: ReaderConfig | None = None
) -> Iterator[Document]:
    """Yield every document from `paths` (files and/or folders), in a deterministic order.

    Documents are yielded lazily, so a corpus larger than memory streams through. Missing paths
    are reported before anything is read.
    """
    cfg = cfg or ReaderConfig()
    roots = [paths] if isinstance(paths, (str, Path)) else list(paths)
    plan = [(str(root), list_input_files(root)) for root in roots]
    for source, files in plan:
        for file in files:
            yield from read_file(file, source, cfg)


def read_file(file: Path, source: str, cfg: ReaderConfig) -> Iterator[Document]:
    """The documents of one file, in order; `source` is the input it was found under (the Ray
    engine reads the files of `list_input_files` in parallel through this)."""
    ext = _extension(file)
    if ext == ".txt":
        yield from _read_txt(file, source, cfg)
    elif ext == ".parquet":
        yield from _read_parquet(file, source, cfg)
    else:
        opener = gzip.open if ext == ".jsonl.gz" else open
        try:
            with opener(file, "rt", encoding=cfg.encoding, errors=cfg.encoding_errors) as handle:
                yield from _read_jsonl(handle, file, source, cfg)
        except (UnicodeDecodeError, OSError, EOFError) as err:
            raise DataReadError(f"{file}: cannot be read as {ext} ({err})") from err


def _read_txt(file: Path, source: str, cfg: ReaderConfig) -> Iterator[Document]:
    try:
        text = file.read_text(encoding=cfg.encoding, errors=cfg.encoding_errors)
    except UnicodeDecodeError as err:
        raise DataReadError(f"{file}: not valid {cfg.encoding} text ({err})") from err
    if not cfg.split_txt_on_blank_lines:
        if text.strip():
            yield Document(text=text, source=source, id=str(file))
        return
    block: list[str] = []
    part = 0
    for line in [*text.splitlines(), ""]:
        if line.strip():
            block.append(line)
        elif block:
            yield Document(text="\n".join(block), source=source, id=f"{file}#{part}")
            part += 1
            block = []


def _read_jsonl(handle: IO[str], file: Path, source: str, cfg: ReaderConfig) -> Iterator[Document]:
    for line_number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataReadError(f"{file}:{line_number}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise DataReadError(
                f"{file}:{line_number}: expected a JSON object, got {type(record).__name__}"
            )
        text = _text_field(record, cfg.text_field, f"{file}:{line_number}")
        yield Document(text=text, source=source, id=_record_id(record, cfg, f"{file}:{line_number}"))


def _read_parquet(file: Path, source: str, cfg: ReaderConfig) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            f"Reading {file} needs pyarrow, which is not installed: pip install pyarrow"
        ) from err
    parquet = pq.ParquetFile(file)
    names = parquet.schema_arrow.names
    if cfg.text_field not in names:
        raise DataReadError(
            f"{file}: no column {cfg.text_field!r} (columns: {', '.join(names)})"
        )
    columns = [cfg.text_field]
    if cfg.id_field is not None and cfg.id_field in names and cfg.id_field != cfg.text_field:
        columns.append(cfg.id_field)
    row = 0
    for batch in parquet.iter_batches(batch_size=cfg.parquet_batch_rows, columns=columns):
        for record in batch.to_pylist():
            where = f"{file}:row {row}"
            yield Document(
                text=_text_field(record, cfg.text_field, where),
                source=source,
                id=_record_id(record, cfg, where),
            )
            row += 1


def _text_field(record: dict[str, Any], field: str, where: str) -> str:
    if field not in record:
        raise DataReadError(
            f"{where}: record has no {field!r} field (fields: {', '.join(map(str, record))})"
        )
    value = record[field]
    if not isinstance(value, str):
        raise DataReadError(
            f"{where}: field {field!r} is {type(value).__name__}, expected a string"
        )
    return value


def _record_id(record: dict[str, Any], cfg: ReaderConfig, location: str) -> str:
    if cfg.id_field is not None and record.get(cfg.id_field) is not None:
        return str(record[cfg.id_field])
    return location
